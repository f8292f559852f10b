"""The closed-form last-layer clipped sum equals the generic per-example path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpscale.privacy.clipping import make_clipped_sum_fn
from dpscale.privacy.linear import softmax_regression_clipped_sum


def _dense_loss(params, model_state, views):
    logits = views["features"] @ params["kernel"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()


def _problem(seed, b=12, d=7, c=4, scale=2.0):
    rng = np.random.default_rng(seed)
    params = {
        "kernel": jnp.asarray(rng.normal(size=(d, c)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(c,)), jnp.float32),
    }
    batch = {
        "features": jnp.asarray(rng.normal(size=(b, d)) * scale, jnp.float32),
        "label": jnp.asarray(rng.integers(0, c, size=b), jnp.int32),
    }
    return params, batch


def test_matches_per_example_gradients():
    params, batch = _problem(0)
    mask = jnp.asarray([1.0] * 10 + [0.0] * 2)
    fast = softmax_regression_clipped_sum(clip_norm=0.8)(params, {}, batch, mask)
    views = jax.tree_util.tree_map(lambda a: a[:, None], batch)  # K = 1 view per example
    slow = make_clipped_sum_fn(_dense_loss, clip_norm=0.8)(params, {}, views, mask)
    for key in ("kernel", "bias"):
        np.testing.assert_allclose(fast.value[key], slow.value[key], rtol=1e-5, atol=1e-6)
    for field in ("num_examples", "num_clipped", "num_nonfinite"):
        assert int(getattr(fast, field)) == int(getattr(slow, field))
    np.testing.assert_allclose(fast.sum_of_norms, slow.sum_of_norms, rtol=1e-5)
    np.testing.assert_allclose(fast.sum_of_losses, slow.sum_of_losses, rtol=1e-5)


def test_nonfinite_features_are_zeroed_and_counted():
    params, batch = _problem(1)
    poisoned = dict(batch, features=batch["features"].at[3, 0].set(jnp.nan))
    fn = softmax_regression_clipped_sum(clip_norm=1.0)
    result = fn(params, {}, poisoned, jnp.ones(12))
    reference = fn(params, {}, batch, jnp.ones(12).at[3].set(0.0))
    assert int(result.num_nonfinite) == 1
    np.testing.assert_allclose(result.value["kernel"], reference.value["kernel"], rtol=1e-5, atol=1e-6)


def test_precomputed_squared_norms_give_the_same_clipped_sum():
    params, batch = _problem(2, scale=3.0)
    mask = jnp.asarray([1.0] * 9 + [0.0] * 3)
    fn = softmax_regression_clipped_sum(clip_norm=0.5)
    computed = fn(params, {}, batch, mask)
    given = fn(params, {}, dict(batch, features_sq_norm=jnp.sum(batch["features"] ** 2, axis=-1)), mask)
    assert int(given.num_clipped) == int(computed.num_clipped) > 0
    for key in ("kernel", "bias"):
        np.testing.assert_allclose(given.value[key], computed.value[key], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(given.sum_of_norms, computed.sum_of_norms, rtol=1e-6)


def test_the_given_squared_norms_are_the_ones_used_for_clipping():
    # Guards the contract: a wrong norm changes the clipping, so feeds must compute it from X.
    params, batch = _problem(3, scale=3.0)
    fn = softmax_regression_clipped_sum(clip_norm=1.5)  # above max ||r_i|| = sqrt(2)
    zero = fn(params, {}, dict(batch, features_sq_norm=jnp.zeros(12)), jnp.ones(12))
    true = fn(params, {}, batch, jnp.ones(12))
    assert int(zero.num_clipped) == 0 < int(true.num_clipped)
