"""Per-example clipping, augmult averaging, padding and the NaN guard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy.bookkeeping import make_bookkeeping_clipped_sum_fn
from dpscale.privacy.clipping import (
    clipped_sum_from_gradients,
    make_clipped_sum_fn,
    per_example_gradients,
    per_example_norms,
)
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
from dpscale.privacy.linear import softmax_regression_clipped_sum


def test_clipped_sum_matches_explicit_per_example_loop(toy):
    params = toy.init_params(0)
    batch = toy.make_batch(1, 8, views=3, scale=3.0)
    mask = jnp.ones(8)
    clip = 0.7
    result = make_clipped_sum_fn(toy.loss_fn, clip_norm=clip)(params, {}, batch, mask)

    expected = np.zeros_like(toy.flat(params))
    for i in range(8):
        example = jax.tree_util.tree_map(lambda a: a[i], batch)
        g = toy.flat(jax.grad(toy.loss_fn)(params, {}, example))
        expected += g * min(1.0, clip / np.linalg.norm(g)) / clip
    np.testing.assert_allclose(toy.flat(result.value), expected, rtol=2e-5, atol=1e-6)
    assert result.sensitivity == 1.0
    assert int(result.num_examples) == 8


def test_each_example_contributes_at_most_one_in_norm(toy):
    params = toy.init_params(3)
    batch = toy.make_batch(4, 16, views=2, scale=50.0)  # large inputs: every gradient is clipped
    grads = per_example_gradients(toy.loss_fn, params, {}, batch)[1]
    for i in range(16):
        mask = jnp.zeros(16).at[i].set(1.0)
        single = clipped_sum_from_gradients(grads, mask, clip_norm=0.1)
        assert np.linalg.norm(toy.flat(single.value)) <= 1.0 + 1e-5


def test_augmult_averages_views_before_clipping():
    # loss = w . x: the gradient of one view is x itself.
    def linear_loss(params, state, views):
        return jnp.mean(views["x"] @ params["w"])

    params = {"w": jnp.zeros(2)}
    views = {"x": jnp.array([[[10.0, 0.0], [-10.0, 0.2]]])}  # one example, K = 2 views
    result = make_clipped_sum_fn(linear_loss, clip_norm=1.0)(params, {}, views, jnp.ones(1))
    # Mean of the views' gradients is (0, 0.1), below C: kept as is. Clipping each view
    # first would have given about (0.0001, 0.01).
    np.testing.assert_allclose(np.asarray(result.value["w"]), [0.0, 0.1], atol=1e-6)
    assert int(result.num_clipped) == 0


def test_padded_slots_contribute_nothing_even_if_garbage(toy):
    params = toy.init_params(5)
    real = toy.make_batch(6, 5, views=2)
    garbage = toy.make_batch(7, 3, views=2, scale=1e6)
    garbage["x"] = garbage["x"].at[0].set(jnp.nan)
    padded = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), real, garbage)
    mask = jnp.concatenate([jnp.ones(5), jnp.zeros(3)])
    fn = make_clipped_sum_fn(toy.loss_fn, clip_norm=1.0)
    with_padding = fn(params, {}, padded, mask)
    without = fn(params, {}, real, jnp.ones(5))
    np.testing.assert_allclose(toy.flat(with_padding.value), toy.flat(without.value), rtol=1e-5, atol=1e-6)
    assert int(with_padding.num_examples) == 5
    assert int(with_padding.num_nonfinite) == 0  # padding is not counted as a real failure


def test_nonfinite_gradients_are_zeroed_and_counted(toy):
    params = toy.init_params(8)
    batch = toy.make_batch(9, 6, views=1)
    poisoned = dict(batch, x=batch["x"].at[2].set(jnp.inf).at[4, 0, 1].set(jnp.nan))
    fn = make_clipped_sum_fn(toy.loss_fn, clip_norm=1.0)
    result = fn(params, {}, poisoned, jnp.ones(6))
    keep = jnp.array([1.0, 1, 0, 1, 0, 1])
    reference = fn(params, {}, batch, keep)
    assert np.all(np.isfinite(toy.flat(result.value)))
    np.testing.assert_allclose(toy.flat(result.value), toy.flat(reference.value), rtol=1e-5, atol=1e-6)
    assert int(result.num_nonfinite) == 2
    assert int(result.num_examples) == 6
    assert np.isfinite(float(result.sum_of_losses))


def test_norms_are_global_across_leaves_and_never_below_the_exact_norm():
    grads = {"a": jnp.array([[3.0, 0.0], [0.0, 0.0]]), "b": jnp.array([[4.0], [2.0]])}
    norms = np.asarray(per_example_norms(grads), np.float64)
    assert np.all(norms >= [5.0, 2.0])
    np.testing.assert_allclose(norms, [5.0, 2.0], rtol=2e-6)  # the bound's margin: a few units of roundoff


@pytest.mark.parametrize("clip_norm", [0.0, -1.0, float("inf"), float("nan")])
def test_every_clipped_sum_rejects_a_clip_norm_that_is_not_positive_and_finite(clip_norm):
    loss_fn = lambda params, model_state, views: jnp.sum(params["w"])  # noqa: E731
    builders = [
        lambda c: make_clipped_sum_fn(loss_fn, clip_norm=c),
        lambda c: make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=c),
        lambda c: make_ghost_clipped_sum_fn(loss_fn, clip_norm=c),
        lambda c: softmax_regression_clipped_sum(clip_norm=c),
    ]
    for build in builders:
        with pytest.raises(InvalidConfigError, match="clip norm must be positive and finite"):
            build(clip_norm)
