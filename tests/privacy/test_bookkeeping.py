"""Book-keeping clipped sums equal the vmap(grad) ones, and unsupported models are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dpscale.models.cnn import small_cnn
from dpscale.models.layers import GroupNorm, ScaledWSConv, WSConv
from dpscale.models.registry import get_model
from dpscale.privacy.bookkeeping import UnsupportedModelError, make_bookkeeping_clipped_sum_fn, per_example_gradients_bk
from dpscale.privacy.clipping import clipped_sum_from_gradients, make_clipped_sum_fn, per_example_gradients
from dpscale.privacy.dpsgd import DpsgdStep


class _ConvZoo(nn.Module):
    """Strides, paddings, kernel shapes, a bias, a shared (twice-called) layer, a dense head."""

    @nn.compact
    def __call__(self, x):
        x = WSConv(8, (3, 2), strides=2, padding="SAME", use_bias=True, name="a")(x)
        x = nn.relu(GroupNorm(num_groups=4, name="n")(x))
        x = WSConv(8, 3, strides=(2, 1), padding="VALID", name="b")(x)
        x = WSConv(8, 3, strides=1, padding=((2, 0), (1, 1)), name="c")(x)
        shared = WSConv(8, 1, strides=1, name="shared")
        x = shared(nn.relu(shared(x)))
        x = WSConv(12, 1, strides=2, name="d")(x)
        return nn.Dense(5, name="fc")(jnp.mean(x, axis=(1, 2)))


def test_conv_rules_match_autodiff_for_strides_paddings_and_shared_layers(nets):
    model = _ConvZoo()
    params = model.init(jax.random.key(0), jnp.zeros((1, 11, 9, 3)))["params"]
    loss_fn = nets.image_loss(model)
    batch = nets.image_batch(1, 3, 2, (11, 9, 3), classes=5)
    ref_losses, ref = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, {}, b))(params, batch)
    losses, grads = jax.jit(lambda p, b: per_example_gradients_bk(loss_fn, p, {}, b))(params, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    nets.assert_trees_close(grads, ref)


class _NormZoo(nn.Module):
    """GroupNorms with and without scale or bias, and flax's own class, between convolutions."""

    @nn.compact
    def __call__(self, x):
        x = WSConv(8, 3, name="a")(x)
        x = nn.relu(GroupNorm(num_groups=4, name="both")(x))
        x = WSConv(8, 3, name="b")(x)
        x = nn.relu(nn.GroupNorm(num_groups=2, use_scale=False, name="bias_only")(x))
        x = WSConv(8, 3, strides=2, name="c")(x)
        x = nn.relu(nn.GroupNorm(num_groups=8, use_bias=False, epsilon=1e-3, name="scale_only")(x))
        return nn.Dense(5, name="fc")(jnp.mean(x, axis=(1, 2)))


def test_group_norm_rule_matches_autodiff_with_and_without_scale_or_bias(nets):
    model = _NormZoo()
    params = model.init(jax.random.key(0), jnp.zeros((1, 9, 9, 3)))["params"]
    params = jax.tree_util.tree_map(lambda a: a + 0.3, params)  # scales away from 1, biases away from 0
    loss_fn = nets.image_loss(model)
    batch = nets.image_batch(4, 3, 2, (9, 9, 3), classes=5)
    ref_losses, ref = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, {}, b))(params, batch)
    losses, grads = jax.jit(lambda p, b: per_example_gradients_bk(loss_fn, p, {}, b))(params, batch)
    assert set(grads["bias_only"]) == {"bias"} and set(grads["scale_only"]) == {"scale"}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    nets.assert_trees_close(grads, ref)


def _compare_clipped_sums(nets, name, shape, size=6, views=2):
    model = get_model(name)
    params = nets.random_params(model, shape)
    loss_fn = nets.image_loss(model)
    batch = nets.image_batch(2, size, views, shape)
    batch["image"] = batch["image"].at[1, 1, 0, 0, 0].set(jnp.nan)  # one poisoned view
    mask = jnp.ones(size).at[size - 1].set(0.0)  # one padded slot
    losses, grads = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, {}, b))(params, batch)
    norms = np.linalg.norm(
        np.concatenate([np.reshape(g, (size, -1)) for g in jax.tree_util.tree_leaves(grads)], axis=1), axis=1
    )
    real = norms[: size - 1]  # the last slot is padding
    finite = np.sort(real[np.isfinite(real)])
    clip = float(finite[len(finite) // 2 - 1] + finite[len(finite) // 2]) / 2  # clips some, not all; no ties

    # What make_clipped_sum_fn returns, without compiling the vmap path a second time.
    ref = jax.jit(lambda g, m, losses: clipped_sum_from_gradients(g, m, clip_norm=clip, losses=losses))(
        grads, mask, losses
    )
    bk_fn = make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=clip, example=(params, {}, batch))
    out = jax.jit(bk_fn)(params, {}, batch, mask)
    assert bk_fn.sensitivity == 1.0 and out.sensitivity == 1.0
    assert int(out.num_examples) == size - 1 and int(out.num_nonfinite) == 1
    assert 0 < int(out.num_clipped) < size - 2
    for field in ("num_examples", "num_clipped", "num_nonfinite"):
        assert int(getattr(out, field)) == int(getattr(ref, field)), field
    np.testing.assert_allclose(out.sum_of_norms, ref.sum_of_norms, rtol=1e-5)
    np.testing.assert_allclose(out.sum_of_losses, ref.sum_of_losses, rtol=1e-6)
    nets.assert_trees_close(out.value, ref.value)


def test_clipped_sum_equals_vmap_path_on_cnn_small(nets):
    _compare_clipped_sums(nets, "cnn-small", (12, 12, 1))


def test_clipped_sum_equals_vmap_path_on_smallest_wrn(nets):
    _compare_clipped_sums(nets, "wrn-10-1", (8, 8, 3), size=4)


def test_dpsgd_update_equals_default_path(nets):
    model = get_model("cnn-small", num_classes=3)
    params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 12, 12, 1)))["params"]
    loss_fn = nets.image_loss(model)
    batch, mask = nets.image_batch(3, 4, 2, (12, 12, 1), classes=3), jnp.array([1.0, 1.0, 1.0, 0.0])
    results = []
    config = dict(noise_multiplier=0.7, expected_batch_size=4.0)
    for clipped in (
        make_clipped_sum_fn(loss_fn, clip_norm=0.05),
        make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=0.05),
    ):
        step = DpsgdStep(clipped, **config, seed=11, optimizer=optax.sgd(0.5), ema_decay=0.9999, capacity=8)
        results.append(step.update(step.init(params), [(batch, mask)]))
    (ref_state, ref_metrics), (state, metrics) = results
    nets.assert_trees_close(state.params, ref_state.params)
    for key in ("loss", "clipped_fraction", "mean_grad_norm", "batch_size", "nonfinite"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)


class _Scaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.mean(ScaledWSConv(4, 3)(x), axis=(1, 2)))


class _BatchStatistics(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(WSConv(4, 3)(x))
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


class _OwnParam(nn.Module):
    @nn.compact
    def __call__(self, x):
        temperature = self.param("temperature", nn.initializers.ones, ())
        return nn.Dense(3)(jnp.mean(WSConv(4, 3)(x), axis=(1, 2))) * temperature


class _DenseSubclass(nn.Dense):
    def __call__(self, x):
        return super().__call__(x) * 2.0


class _Subclassed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _DenseSubclass(3)(jnp.mean(x, axis=(1, 2)))


@pytest.mark.parametrize(
    "model",
    [_Scaled(), _BatchStatistics(), _OwnParam(), _Subclassed()],
    ids=["scaled-ws-conv", "batchnorm-batch-statistics", "own-param", "dense-subclass"],
)
def test_refuses_models_with_uncovered_parameters(model, nets):
    variables = model.init(jax.random.key(0), jnp.zeros((1, 6, 6, 2)))
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    batch = nets.image_batch(0, 2, 1, (6, 6, 2), classes=3)
    with pytest.raises(UnsupportedModelError):
        make_bookkeeping_clipped_sum_fn(nets.image_loss(model), clip_norm=1.0, example=(params, state, batch))
    fn = make_bookkeeping_clipped_sum_fn(nets.image_loss(model), clip_norm=1.0)  # checked on the first trace too
    with pytest.raises(UnsupportedModelError):
        jax.jit(fn)(params, state, batch, jnp.ones(2))


def test_refuses_a_loss_that_uses_parameters_outside_the_layers(nets):
    model = small_cnn(channels=(16,), num_classes=3)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    base = nets.image_loss(model)

    def penalised(params, model_state, views):  # an L2 penalty: a gradient no layer rule sees
        return base(params, model_state, views) + 1e-3 * optax.global_norm(params) ** 2

    def rescaled(params, model_state, views):  # the layers read a transformed copy
        return base(jax.tree_util.tree_map(lambda p: 2.0 * p, params), model_state, views)

    batch = nets.image_batch(0, 2, 1, (8, 8, 1), classes=3)
    for loss_fn in (penalised, rescaled):
        with pytest.raises(UnsupportedModelError):
            make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch))
