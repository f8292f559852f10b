"""The Gaussian sampler itself: the right distribution, independent draws, keys that count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpscale.privacy.noise import add_gaussian_noise, standard_normal


def test_standard_normal_is_unit_gaussian():
    z = np.asarray(standard_normal(jax.random.key(0), (400_000,)), np.float64)
    # Kolmogorov-Smirnov against N(0, 1) and the first four moments: a wrong scale
    # (e.g. forgetting 1/sqrt(SUMMANDS)) or correlated summands changes the variance.
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.mean()) < 5 / np.sqrt(z.size)
    assert abs(z.var() - 1) < 0.015
    assert abs(stats.kurtosis(z)) < 0.05
    # Sums of SUMMANDS draws reach far beyond one float32 draw's cut at ~5.4 only
    # with astronomically small probability; the bulk must not be truncated at all.
    assert np.abs(z).max() > 3.5


def test_draws_of_different_keys_and_positions_are_independent():
    a = np.asarray(standard_normal(jax.random.key(1), (200_000,)))
    b = np.asarray(standard_normal(jax.random.key(2), (200_000,)))
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.01  # neighbouring coordinates
    assert not np.array_equal(a, b)


def test_the_same_key_gives_the_same_noise():
    key = jax.random.key(3)
    jitted = jax.jit(standard_normal, static_argnums=1)
    np.testing.assert_array_equal(jitted(key, (1000,)), jitted(key, (1000,)))
    # Compiled and eager code may differ in the last bit (fused arithmetic), never more.
    np.testing.assert_allclose(standard_normal(key, (1000,)), jitted(key, (1000,)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_vmapped_models_each_use_their_own_key(jit):
    # XLA's generator batched the JAX way would keep only the first key: every model of an
    # audit would draw from model 0's stream. Each model must get what it gets alone.
    keys = jax.random.split(jax.random.key(4), 6)
    draw = jax.vmap(lambda k: standard_normal(k, (5, 7)))
    together = (jax.jit(draw) if jit else draw)(keys)
    for i, key in enumerate(keys):
        np.testing.assert_allclose(together[i], standard_normal(key, (5, 7)), rtol=0, atol=1e-6)


def test_nested_vmap_matches_the_unbatched_draw():
    keys = jax.random.split(jax.random.key(5), 6).reshape(2, 3)
    together = jax.vmap(jax.vmap(lambda k: standard_normal(k, (4,))))(keys)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(together[i, j], standard_normal(keys[i, j], (4,)), rtol=0, atol=1e-6)


def test_added_noise_has_the_requested_std_per_leaf():
    tree = {"w": jnp.zeros((300, 300)), "b": jnp.full((50_000,), 3.0)}
    noisy = add_gaussian_noise(tree, jax.random.key(6), std=2.5)
    assert abs(float(jnp.std(noisy["w"])) - 2.5) < 0.05
    assert abs(float(jnp.mean(noisy["b"])) - 3.0) < 0.05
    assert abs(float(jnp.std(noisy["b"])) - 2.5) < 0.05
    # The leaves draw different noise (each its own key).
    assert not np.allclose(np.asarray(noisy["w"]).ravel()[:1000], np.asarray(noisy["b"])[:1000] - 3.0)


def test_the_four_draws_get_independent_uniform_23_bit_integers():
    # The fourth draw is packed from the spare low bits of the three words: each draw's
    # 23 bits must be uniform and independent of the others' (a packing slip, e.g. reusing
    # bits, shows up as correlation or a narrower range).
    from dpscale.privacy.noise import summand_bits

    draws = [np.asarray(b >> 9, np.float64) for b in summand_bits(jax.random.key(7), (300_000,))]
    assert len(draws) == 4
    for d in draws:
        assert d.max() < 2**23 and d.max() > 2**23 * 0.999 and d.min() < 2**23 * 0.001
        assert abs(d.mean() / 2**23 - 0.5) < 0.005
        assert stats.kstest(d / 2**23, "uniform").pvalue > 1e-3
        for bit in range(23):  # every bit is a fair coin
            assert abs(np.mean((d.astype(np.int64) >> bit) & 1) - 0.5) < 0.006
    corr = np.corrcoef(np.stack(draws))
    assert np.all(np.abs(corr[~np.eye(4, dtype=bool)]) < 0.01)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_leaves_get_finite_noise_with_no_data_dependent_gaps(dtype):
    # The sum and the grid rounding happen in float32 and only the result is cast: done in
    # bfloat16 the grid would be finer than the format (outputs whose last mantissa bit is
    # odd were unreachable from x = -1 but not from x = 0); in float16 the division overflowed.
    odd = {}
    for x in (0.0, -1.0):
        leaf = jnp.full((200_000,), x, dtype)
        noisy = add_gaussian_noise({"w": leaf}, jax.random.key(8), std=1.0)["w"]
        assert noisy.dtype == dtype and bool(jnp.all(jnp.isfinite(noisy)))
        out = np.asarray(noisy.astype(jnp.float32))
        window = out[(out >= 0.5) & (out < 1.0)]
        mantissa = window.view(np.uint32) >> (16 if dtype == jnp.bfloat16 else 13)
        odd[x] = np.mean(mantissa & 1)
    assert abs(odd[0.0] - 0.5) < 0.05 and abs(odd[-1.0] - 0.5) < 0.05


def test_a_gaussian_release_refuses_a_zero_noise_scale():
    from dpscale.errors import InvalidConfigError
    from dpscale.privacy.noise import gaussian_release

    with pytest.raises(InvalidConfigError):
        gaussian_release(np.ones(3), jax.random.key(9), noise_multiplier=0.0)
