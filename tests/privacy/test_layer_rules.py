"""Each book-keeping rule equals vmap(grad) per example; the settings a rule does not compute are refused.

Plain convolutions (strides, paddings, kernel shapes, biases), EfficientNet-Lite's depthwise
convolution (odd and even sizes, stride 2), frozen BatchNorm (with and without scale or bias,
random statistics) and the EfficientNet-Lite0 tops trained above a cut, at K = 1 and 2 views.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dpscale.models import cuts, registry
from dpscale.models.efficientnet_lite import DepthwiseConv
from dpscale.privacy.bookkeeping import UnsupportedModelError, per_example_gradients_bk, plan_layers
from dpscale.privacy.clipping import clipped_sum_from_gradients, per_example_gradients
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn


class _LiteZoo(nn.Module):
    """Plain convolutions, depthwise convolutions and frozen BatchNorms of every kind, a dense head."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 2), strides=2, padding="SAME", name="a")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True, epsilon=1e-3, name="bn_both")(x))
        x = nn.Conv(8, (3, 3), strides=(2, 1), padding="VALID", use_bias=False, name="b")(x)
        x = nn.Conv(8, (3, 3), padding=((2, 0), (1, 1)), name="c")(x)
        x = DepthwiseConv(3, stride=2, name="dw3")(x)
        x = nn.Conv(8, (2, 2), padding=1, use_bias=False, name="d")(x)
        x = nn.BatchNorm(use_running_average=True, use_scale=False, name="bn_bias")(x)
        x = DepthwiseConv(5, stride=2, name="dw5")(x)
        x = nn.BatchNorm(use_running_average=True, use_bias=False, name="bn_scale")(x)
        x = nn.Conv(12, (1, 1), use_bias=False, name="e")(x)
        return nn.Dense(5, name="fc")(jnp.mean(x, axis=(1, 2)))


def _random_stats(abstract, seed):
    """BatchNorm statistics away from (0, 1): means N(0, 1), variances exp(N(0, 0.5))."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(
            np.exp(0.5 * rng.normal(size=a.shape)) if path[-1].key == "var" else rng.normal(size=a.shape), a.dtype
        ),
        abstract,
    )


def _assert_equal_to_vmap(loss_fn, params, state, batch, nets):
    ref_losses, ref = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, state, b))(params, batch)
    losses, grads = jax.jit(lambda p, b: per_example_gradients_bk(loss_fn, p, state, b))(params, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    nets.assert_trees_close(grads, ref)


@pytest.mark.parametrize("views", [1, 2])
def test_conv_depthwise_and_batchnorm_rules_match_autodiff(views, nets):
    model, shape = _LiteZoo(), (15, 13, 3)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape)))
    params = jax.tree_util.tree_map(lambda a: a + 0.3, nets.random_params(model, shape))  # scales off 1
    state = {"batch_stats": _random_stats(abstract["batch_stats"], 1)}
    loss_fn = nets.image_loss(model)
    batch = nets.image_batch(views, 4, views, shape, classes=5)
    calls = plan_layers(loss_fn, params, state, jax.tree.map(lambda a: a[0], batch))
    assert {type(c.module).__name__ for c in calls} == {"Conv", "DepthwiseConv", "BatchNorm", "Dense"}
    _assert_equal_to_vmap(loss_fn, params, state, batch, nets)


def _lite_top(cut, activation_shape, seed=0):
    """A pretrained top of a random-init EfficientNet-Lite0 (32 x 32 inputs), its parameters and
    statistics moved off their initial values (a zero classifier would zero every other gradient)."""
    model = registry.get_model("efficientnet-lite0", num_classes=10)
    variables = model.init(jax.random.key(seed), jnp.zeros((1, 32, 32, 3)))
    top = cuts.build_top(
        model, cut, "pretrained", variables=variables, num_classes=10, activation_shape=activation_shape
    )
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(
        lambda a: a + jnp.asarray(0.1 * rng.normal(size=a.shape), a.dtype), top.init_params(0)
    )
    state = {"batch_stats": _random_stats(top.model_state["batch_stats"], seed + 1)}

    def loss_fn(p, s, views):
        logits = top.model.apply({"params": p, **s}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    return loss_fn, params, state


TOPS = [("blocks_12", (3, 3, 192)), ("blocks_15", (3, 3, 320))]


@pytest.mark.parametrize(("cut", "shape"), TOPS)
@pytest.mark.parametrize("views", [1, 2])
def test_rules_match_autodiff_on_efficientnet_lite_tops(cut, shape, views, nets):
    loss_fn, params, state = _lite_top(cut, shape)
    _assert_equal_to_vmap(loss_fn, params, state, nets.image_batch(views, 3, views, shape), nets)


@pytest.mark.parametrize(("cut", "shape"), TOPS)
def test_per_layer_clipped_sum_of_a_lite_top_equals_the_vmap_path(cut, shape, nets):
    loss_fn, params, state = _lite_top(cut, shape, seed=2)
    size, batch = 6, nets.image_batch(3, 6, 2, shape)
    mask = jnp.ones(size).at[size - 1].set(0.0)  # one padded slot
    losses, grads = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, state, b))(params, batch)
    norms = np.sort(
        np.linalg.norm(np.concatenate([np.reshape(g, (size, -1)) for g in jax.tree.leaves(grads)], 1), axis=1)[:-1]
    )
    clip = float(norms[1] + norms[2]) / 2  # clips some, not all
    ref = jax.jit(lambda g, m, ls: clipped_sum_from_gradients(g, m, clip_norm=clip, losses=ls))(grads, mask, losses)

    fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=clip, example=(params, state, batch))  # no UnsupportedModelError
    booked = {c.kind for c in fn.layers if c.strategy == "book-keeping"}
    assert booked == {"Conv", "DepthwiseConv", "BatchNorm"} - ({"DepthwiseConv"} if cut == "blocks_15" else set())
    out = jax.jit(fn)(params, state, batch, mask)
    for field in ("num_examples", "num_clipped", "num_nonfinite"):
        assert int(getattr(out, field)) == int(getattr(ref, field)), field
    np.testing.assert_allclose(out.sum_of_norms, ref.sum_of_norms, rtol=1e-4)
    nets.assert_trees_close(out.value, ref.value, rtol=1e-4)


class _Norm(nn.Module):
    """A 1x1 convolution then BatchNorm."""

    use_running_average: bool

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (1, 1), name="conv")(x)
        return jnp.mean(nn.BatchNorm(use_running_average=self.use_running_average, name="bn")(x), axis=(1, 2))


def _refused(model, loss_fn=None) -> str:
    """The reason ``plan_layers`` gives for refusing ``model`` (under ``loss_fn``, default its mean output)."""
    variables = model.init(jax.random.key(0), jnp.zeros((1, 5, 5, 2)))
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def mean_output(p, s, views):
        return jnp.mean(model.apply({"params": p, **s}, views["image"]))

    views = {"image": jax.ShapeDtypeStruct((2, 5, 5, 2), jnp.float32)}
    with pytest.raises(UnsupportedModelError) as error:
        plan_layers(loss_fn or mean_output, params, state, views)
    return str(error.value)


def test_batchnorm_on_batch_statistics_is_refused_whether_or_not_they_may_be_updated():
    model = _Norm(use_running_average=False)
    assert "only frozen ones" in _refused(model)  # the forward fails: statistics it may not update

    def updating(p, s, views):  # the statistics may be written: the forward runs, the check refuses
        out, _ = model.apply({"params": p, **s}, views["image"], mutable=["batch_stats"])
        return jnp.mean(out)

    assert "only frozen ones" in _refused(model, updating)


def test_batchnorm_choosing_its_statistics_at_the_call_is_refused():
    class Called(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(nn.BatchNorm(name="bn")(x, use_running_average=True), axis=(1, 2))

    assert "extra variables or arguments" in _refused(Called())


def test_statistics_computed_from_the_parameters_are_refused():
    model = _Norm(use_running_average=True)

    def leaky(p, s, views):  # the statistics carry a gradient no rule sees
        stats = jax.tree.map(lambda a: a + jnp.sum(p["conv"]["kernel"]), s["batch_stats"])
        return jnp.mean(model.apply({"params": p, "batch_stats": stats}, views["image"]))

    assert "outside the supported layer calls" in _refused(model, leaky)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"feature_group_count": 2}, "grouped"),
        ({"kernel_dilation": 2}, "dilated"),
        ({"input_dilation": (1, 2), "padding": 1}, "dilated"),
        ({"padding": "CIRCULAR"}, "padding 'CIRCULAR'"),
        ({"kernel_size": 3}, "expected 2-d"),
        ({"conv_general_dilated": jax.lax.conv_general_dilated}, "its own convolution"),
    ],
)
def test_convolutions_the_rule_does_not_compute_are_refused(settings, reason):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(nn.Conv(4, **{"kernel_size": (3, 3), **settings})(x), axis=(1, 2))

    assert reason in _refused(Net())
