"""Each example alone moves every clipped sum by at most 1, exactly: every path, every precision.

The inputs are built to break a rounded norm: per-example gradients along the standardised kernel
(a WS Jacobian with condition number ~10^5), views whose gradients cancel to 10^-6 of their size,
constant images (whose centred gradient is pure rounding), scales from 1e-39 (denormal) to 1e20,
and all of these in one batch; K = 1 and 4 views; WS, dense and EfficientNet-Lite's layers
(plain, depthwise and 1x1 convolutions, frozen BatchNorm). One example at a time is unmasked and the
clipped sum's norm, taken in float64, must be <= 1 with no slack: that is the clip weight times
what the path adds for that example, with every rounding of its norm, weight, product and fold in
it. (The rounding of a sum over *other* examples is not per example: docs/privacy.md,
"Sensitivity under floating point".)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dpscale.models.efficientnet_lite import DepthwiseConv
from dpscale.models.layers import WSConv, standardize_kernel
from dpscale.privacy.bookkeeping import UnsupportedModelError, make_bookkeeping_clipped_sum_fn
from dpscale.privacy.clipping import make_clipped_sum_fn
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.rounding import FORMATS, ClipPrecision

CLIP = 2.0**-60  # every example above it is clipped: its weight is 1 / (its norm's bound)
SIZE = 4
SCALES = (1e-17, 1e-8, 1e8, 1e20)


class WsOnly(nn.Module):
    """One WS convolution on 3x3 images: one position per view, P = K."""

    @nn.compact
    def __call__(self, x):
        return WSConv(2, 3, padding="VALID", name="conv")(x)


class DenseOnly(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, use_bias=False, name="fc")(x)


class WithBiases(nn.Module):
    """A WS convolution and a dense head, both with biases, under a cross-entropy loss."""

    @nn.compact
    def __call__(self, x):
        y = WSConv(2, 3, padding="VALID", use_bias=True, name="conv")(x)
        return nn.Dense(3, name="fc")(y.reshape(y.shape[0], -1))


def _linear_in_output(model):
    """``mean over views of <output, target>``: the output gradient is the (crafted) target / K."""

    def loss_fn(params, model_state, views):
        y = model.apply({"params": params}, views["input"])
        return jnp.mean(jnp.sum((y * views["target"]).reshape(y.shape[0], -1), axis=1))

    return loss_fn


def _cross_entropy(params, model_state, views):
    logits = WithBiases().apply({"params": params}, views["input"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()


def _ws_kernel():
    """Both output channels share one kernel of variance ~1 >> eps = 1e-5: a_o = 1 - 1e-5."""
    column = np.random.default_rng(0).normal(size=(3, 3, 4, 1))
    return jnp.asarray(np.repeat(column, 2, axis=-1), jnp.float32)


def _stack(examples, views):
    """``[SIZE, views, ...]`` from SIZE per-example ``(input [views, ...], target [views, ...])``."""
    return {
        "input": jnp.asarray(np.stack([x for x, _ in examples]), jnp.float32),
        "target": jnp.asarray(np.stack([t for _, t in examples]), jnp.float32),
    }


def _signs(views):
    """+1, -1, +1, ... over the views (all +1 for one view)."""
    return np.array([(-1.0) ** v for v in range(views)]) if views > 1 else np.ones(1)


def ws_case(views):
    params = {"conv": {"kernel": _ws_kernel()}}
    w = np.asarray(standardize_kernel(params["conv"]["kernel"], eps=1e-5))[..., 0]
    rng = np.random.default_rng(1)
    aligned = w * (1 + 1e-6 * rng.normal(size=w.shape))  # the gradient lies along the kernel
    ones = np.ones((views, 1, 1, 2))
    drift = 1 + 1e-6 * np.arange(views)[:, None, None, None]  # views that cancel to 1e-6

    def same(image, target=ones):
        return np.repeat(image[None], views, axis=0), target

    batches = {
        "aligned": [same(aligned * c) for c in (1.0, 3.0, 10.0, 30.0)],
        "cancelling": [
            (aligned[None] * drift * c, _signs(views)[:, None, None, None] * ones) for c in (1.0, 2.0, 5.0, 9.0)
        ],
        "constant": [same(np.full((3, 3, 4), c)) for c in (1.0, -2.0, 5.0, 100.0)],
        "scales": [same(aligned * c) for c in SCALES],
        "mixed": [same(aligned), same(np.full((3, 3, 4), 7.0)), same(rng.normal(size=(3, 3, 4))), same(aligned * 1e15)],
    }
    return _linear_in_output(WsOnly()), params, {k: _stack(v, views) for k, v in batches.items()}


def dense_case(views):
    rng = np.random.default_rng(2)
    params = {"fc": {"kernel": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)}}
    x, g = rng.normal(size=6), rng.normal(size=3)
    drift = 1 + 1e-6 * np.arange(views)[:, None]

    def same(features, target):
        return np.repeat(features[None], views, axis=0), np.repeat(target[None], views, axis=0)

    batches = {
        "cancelling": [(x[None] * drift * c, _signs(views)[:, None] * g) for c in (1.0, 3.0, 10.0, 30.0)],
        "constant": [same(np.full(6, c), g) for c in (1.0, -2.0, 5.0, 100.0)],
        "scales": [same(x * c, g) for c in SCALES],
        "tiny": [same(x * 1e-39, g), same(x, g * 1e-39), same(x * 1e-20, g * 1e-20), same(x, g * 1e-30)],
    }
    return _linear_in_output(DenseOnly()), params, {k: _stack(v, views) for k, v in batches.items()}


def biases_case(views):
    rng = np.random.default_rng(3)
    params = {
        "conv": {"kernel": _ws_kernel(), "bias": jnp.asarray([0.3, -0.1], jnp.float32)},
        "fc": {"kernel": jnp.asarray(rng.normal(size=(2, 3)) * 1e-3, jnp.float32), "bias": jnp.zeros(3, jnp.float32)},
    }
    natural = rng.normal(size=(3, 3, 4))
    images = {
        "scales": [natural * c for c in SCALES],
        "denormal": [natural * c for c in (1e-39, 1e-30, 1e-25, 1.0)],
        "constant": [np.full((3, 3, 4), c) for c in (1.0, -2.0, 5.0, 100.0)],
    }
    batches = {
        kind: {
            "input": jnp.asarray(np.repeat(np.stack(imgs)[:, None], views, axis=1), jnp.float32),
            "label": jnp.asarray(np.tile([[0], [1], [2], [1]], (1, views)), jnp.int32),
        }
        for kind, imgs in images.items()
    }
    return _cross_entropy, params, batches


class LiteLayers(nn.Module):
    """EfficientNet-Lite's layers: a plain convolution, frozen BatchNorm, a depthwise and a 1x1 convolution."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), strides=2, name="plain")(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=1e-3, name="bn")(x)
        x = DepthwiseConv(3, name="dw")(x)
        return nn.Conv(3, (1, 1), use_bias=False, name="project")(x)


def lite_case(views):
    """Inputs at every scale, constant ones, and views whose gradients cancel; one BatchNorm channel's
    variance far below its epsilon. The statistics are constants of the loss."""
    rng = np.random.default_rng(5)
    abstract = jax.eval_shape(LiteLayers().init, jax.random.key(0), jnp.zeros((1, 5, 5, 2)))
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), abstract["params"])
    stats = {"mean": jnp.asarray(rng.normal(size=4), jnp.float32), "var": jnp.asarray([1e-30, 0.5, 2.0, 1e4])}

    def loss_fn(params, model_state, views):
        y = LiteLayers().apply({"params": params, "batch_stats": {"bn": stats}}, views["input"])
        return jnp.mean(jnp.sum((y * views["target"]).reshape(y.shape[0], -1), axis=1))

    natural, target = rng.normal(size=(5, 5, 2)), rng.normal(size=(3, 3, 3))
    drift = 1 + 1e-6 * np.arange(views)[:, None, None, None]

    def same(image, t=target):
        return np.repeat(image[None], views, axis=0), np.repeat(t[None], views, axis=0)

    batches = {
        "scales": [same(natural * c) for c in SCALES],
        "tiny": [
            same(natural * 1e-39),
            same(natural, target * 1e-39),
            same(natural * 1e-20, target * 1e-20),
            same(natural),
        ],
        "constant": [same(np.full((5, 5, 2), c)) for c in (1.0, -2.0, 5.0, 100.0)],
        "cancelling": [
            (natural[None] * drift * c, _signs(views)[:, None, None, None] * target[None]) for c in (1.0, 3.0, 1e3, 1e8)
        ],
    }
    return loss_fn, params, {k: _stack(v, views) for k, v in batches.items()}


CASES = {"ws": ws_case, "dense": dense_case, "biases": biases_case, "lite": lite_case}


def single_example_norms(fn, params, batch, *, clipped=None):
    """The float64 norm of the clipped sum with only example i unmasked, for each i; ``clipped``
    (a list) gets how many of them were clipped (their weight came from their norm's bound)."""
    jitted = jax.jit(fn)
    norms = []
    for i in range(SIZE):
        out = jitted(params, {}, batch, jnp.zeros(SIZE).at[i].set(1.0))
        leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree_util.tree_leaves(out.value)]
        assert all(np.all(np.isfinite(leaf)) for leaf in leaves)
        norms.append(np.sqrt(sum(np.sum(leaf * leaf) for leaf in leaves)))
        if clipped is not None:
            clipped.append(int(out.num_clipped))
    return np.array(norms)


def _builders(loss_fn, params, precision):
    kwargs = {} if precision == "highest" else {"precision": ClipPrecision(norms=precision, sums=precision)}
    yield "book-keeping", make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=CLIP, **kwargs)
    for strategy in ("explicit", "grouped", "streamed", "ghost"):
        forced = {path: strategy for path in (("conv",), ("fc",)) if path[0] in params}
        yield strategy, make_ghost_clipped_sum_fn(loss_fn, clip_norm=CLIP, strategies=forced, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("views", [1, 4])
@pytest.mark.parametrize("precision", list(FORMATS))
def test_each_example_alone_moves_every_per_layer_path_by_at_most_one(case, precision, views):
    loss_fn, params, batches = CASES[case](views)
    for path, fn in _builders(loss_fn, params, precision):
        clipped = []
        for kind, batch in batches.items():
            norms = single_example_norms(fn, params, batch, clipped=clipped)
            assert np.all(norms <= 1.0), (path, kind, norms)
        assert sum(clipped) >= len(clipped) // 2, (path, clipped)  # the bound, not C, sets most weights


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("views", [1, 4])
def test_each_example_alone_moves_the_vmap_path_by_at_most_one(case, views):
    loss_fn, params, batches = CASES[case](views)
    fn = make_clipped_sum_fn(loss_fn, clip_norm=CLIP)
    for kind, batch in batches.items():
        assert np.all(single_example_norms(fn, params, batch) <= 1.0), kind


class _Bf16Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = WSConv(2, 3, padding="VALID", name="conv")(x)
        return nn.Dense(3, dtype=jnp.bfloat16, name="fc")(y.reshape(y.shape[0], -1))


def test_a_layer_computing_in_bf16_is_refused_per_layer_and_safe_under_vmap():
    def bf16_loss(params, model_state, views):
        logits = _Bf16Head().apply({"params": params}, views["input"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    _, params, batches = biases_case(2)
    params = {"conv": {"kernel": params["conv"]["kernel"]}, "fc": params["fc"]}
    for build in (make_bookkeeping_clipped_sum_fn, make_ghost_clipped_sum_fn):
        with pytest.raises(UnsupportedModelError, match="not float32"):
            build(bf16_loss, clip_norm=CLIP, example=(params, {}, batches["scales"]))
    fn = make_clipped_sum_fn(bf16_loss, clip_norm=CLIP)
    for kind, batch in batches.items():
        assert np.all(single_example_norms(fn, params, batch) <= 1.0), kind


def _linear_problem(scale, *, constant=False):
    rng = np.random.default_rng(4)
    params = {"kernel": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), "bias": jnp.zeros(4, jnp.float32)}
    features = np.full((SIZE, 6), 1.0) if constant else rng.normal(size=(SIZE, 6))
    return params, {"features": jnp.asarray(features * scale, jnp.float32), "label": jnp.asarray([0, 1, 2, 3])}


@pytest.mark.parametrize("given_norms", [False, True])
def test_each_example_alone_moves_the_closed_form_head_by_at_most_one(given_norms):
    fn = softmax_regression_clipped_sum(clip_norm=CLIP)
    for scale in (1e-39, 1e-20, 1e-3, 1.0, 1e3, 1e18, 1e20):
        for constant in (False, True):
            params, batch = _linear_problem(scale, constant=constant)
            if given_norms:  # as the feed computes it: a float32 sum of squares
                feats = np.asarray(batch["features"])
                with np.errstate(over="ignore"):
                    batch["features_sq_norm"] = jnp.asarray(np.einsum("ij,ij->i", feats, feats), jnp.float32)
            assert np.all(single_example_norms(fn, params, batch) <= 1.0), (scale, constant)
