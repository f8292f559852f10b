"""Neighbouring batches give clipped sums at most 1 apart, exactly: every path, every precision.

The guarantee is a property of the whole sum, not of one example's share: a float32 sum rounds by
an amount that scales with *every* term, so one example j is tested against batches of adversarial
*other* examples too. A batch D holds SIZE subject examples (each built to break a rounded norm)
and OTHERS other examples (built to make the sum round: aligned with a standardised kernel at 1e7,
views that cancel at huge scale, scales from 1e-39 to 1e20, constants); D' is D without one example
j, as the slots hold it (j's slot masked) and as a sampler without j would fill them (the later
examples moved up one slot). ||S(D) - S(D')||, taken in float64, must be <= 1 with no slack: the
clip weight of j, every rounding of its norm, weight and fold, and the rounding of the sums over
the other examples are all in it.

The inputs: per-example gradients along the standardised kernel (a WS Jacobian with condition
number ~10^5), views whose gradients cancel to 10^-6 of their size, constant images (whose centred
gradient is pure rounding), scales from 1e-39 (denormal) to 1e20; K = 1 and 4 views; WS, dense and
EfficientNet-Lite's layers (plain, depthwise and 1x1 convolutions, frozen BatchNorm); the closed-form
last layer.
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
OTHERS = 12  # other examples beside the SIZE subjects
BIG = 1e7  # the review's scale of the others' gradients


def _scaled(batch, factor):
    """The batch with its inputs (images or features) times ``factor``."""
    key = "input" if "input" in batch else "features"
    return {**batch, key: batch[key] * factor}


def _tiled(batch, rows):
    return jax.tree_util.tree_map(lambda a: jnp.concatenate([a] * -(-rows // a.shape[0]))[:rows], batch)


def neighbouring_batches(batches):
    """(name, batch) pairs: each kind's SIZE subjects followed by OTHERS examples of the same kind at
    ``BIG`` times the scale and of the next kind (their roundings are what the sum must pay for)."""
    kinds = list(batches)
    for i, kind in enumerate(kinds):
        nxt = kinds[(i + 1) % len(kinds)]
        for other_name, other in ((f"{kind} x{BIG:g}", _scaled(batches[kind], BIG)), (nxt, batches[nxt])):
            joined = jax.tree_util.tree_map(lambda s, o: jnp.concatenate([s, o]), batches[kind], _tiled(other, OTHERS))
            yield f"{kind} among {other_name}", joined


def _norm64(a, b):
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    diffs = [np.asarray(x, np.float64) - np.asarray(y, np.float64) for x, y in leaves]
    assert all(np.all(np.isfinite(d)) for d in diffs)
    return float(np.sqrt(sum(np.sum(d * d) for d in diffs)))


def largest_move(fn, params, batch, *, js=None, clipped=None):
    """The largest float64 ``||S(D) - S(D')||`` over the examples j of ``js`` (default: the subjects and
    the first and last other), D' = D without j in two ways: j's slot masked, and j removed with the
    later examples moved up one slot and an empty padded slot at the end. ``clipped`` (a list) gets
    how many examples of D were clipped."""
    jitted = jax.jit(fn)
    n = jax.tree_util.tree_leaves(batch)[0].shape[0]
    full = jitted(params, {}, batch, jnp.ones(n))
    if clipped is not None:
        clipped.append(int(full.num_clipped))
    worst = 0.0
    for j in js if js is not None else [*range(SIZE), SIZE, n - 1]:
        masked = jitted(params, {}, batch, jnp.ones(n).at[j].set(0.0))
        moved_up = jax.tree_util.tree_map(lambda a: jnp.concatenate([a[:j], a[j + 1 :], jnp.zeros_like(a[:1])]), batch)
        shifted = jitted(params, {}, moved_up, jnp.ones(n).at[n - 1].set(0.0))
        worst = max(worst, _norm64(full.value, masked.value), _norm64(full.value, shifted.value))
    return worst


def _builders(loss_fn, params, precision):
    kwargs = {} if precision == "highest" else {"precision": ClipPrecision(norms=precision, sums=precision)}
    yield "book-keeping", make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=CLIP, **kwargs)
    for strategy in ("explicit", "grouped", "streamed", "ghost"):
        forced = {path: strategy for path in (("conv",), ("fc",)) if path[0] in params}
        yield strategy, make_ghost_clipped_sum_fn(loss_fn, clip_norm=CLIP, strategies=forced, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("views", [1, 4])
@pytest.mark.parametrize("precision", list(FORMATS))
def test_neighbouring_batches_move_every_per_layer_path_by_at_most_one(case, precision, views):
    loss_fn, params, batches = CASES[case](views)
    for path, fn in _builders(loss_fn, params, precision):
        clipped = []
        for name, batch in neighbouring_batches(batches):
            moved = largest_move(fn, params, batch, clipped=clipped)
            assert moved <= 1.0, (path, name, moved)
        assert sum(clipped) >= sum(SIZE + OTHERS for _ in clipped) // 2, (path, clipped)  # bounds set most weights


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("views", [1, 4])
def test_neighbouring_batches_move_the_vmap_path_by_at_most_one(case, views):
    loss_fn, params, batches = CASES[case](views)
    fn = make_clipped_sum_fn(loss_fn, clip_norm=CLIP)
    for name, batch in neighbouring_batches(batches):
        assert largest_move(fn, params, batch) <= 1.0, name


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
    for name, batch in neighbouring_batches(batches):
        assert largest_move(fn, params, batch) <= 1.0, name


def _linear_problem(scale, *, constant=False, rows=SIZE):
    rng = np.random.default_rng(4)
    params = {"kernel": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), "bias": jnp.zeros(4, jnp.float32)}
    features = np.full((rows, 6), 1.0) if constant else rng.normal(size=(rows, 6))
    labels = np.arange(rows) % 4
    return params, {"features": jnp.asarray(features * scale, jnp.float32), "label": jnp.asarray(labels)}


@pytest.mark.parametrize("given_norms", [False, True])
def test_neighbouring_batches_move_the_closed_form_head_by_at_most_one(given_norms):
    fn = softmax_regression_clipped_sum(clip_norm=CLIP)
    for scale in (1e-39, 1e-20, 1e-3, 1.0, 1e3, 1e18, 1e20):
        for constant in (False, True):
            params, subjects = _linear_problem(scale, constant=constant)
            for other_scale in (1.0, 1e7):  # the others: one feature vector, many times, for rounding
                _, others = _linear_problem(other_scale, constant=True, rows=OTHERS)
                batch = jax.tree_util.tree_map(lambda s, o: jnp.concatenate([s, o]), subjects, others)
                if given_norms:  # as the feed computes it: a float32 sum of squares
                    feats = np.asarray(batch["features"])
                    with np.errstate(over="ignore"):
                        batch["features_sq_norm"] = jnp.asarray(np.einsum("ij,ij->i", feats, feats), jnp.float32)
                moved = largest_move(fn, params, batch)
                assert moved <= 1.0, (scale, constant, other_scale, moved)


class _WideWs(nn.Module):
    """The review's layer: one WS convolution, 3x3x64 -> 2, one position a view."""

    @nn.compact
    def __call__(self, x):
        return WSConv(2, 3, padding="VALID", name="conv")(x)


def _review_case(views, *, batch=128):
    """127 examples whose gradients lie along the standardised kernel at 1e7 (their unfolded
    gradients are ~1e5 times their folded norm) and, in one slot at a time, a random image j."""
    rng = np.random.default_rng(7)
    kernel = jnp.asarray(rng.normal(size=(3, 3, 64, 2)), jnp.float32)
    w = np.asarray(standardize_kernel(kernel, eps=1e-5))[..., 0]
    inputs = np.repeat((w * BIG * (1 + 1e-6 * rng.normal(size=(batch,) + w.shape)))[:, None], views, axis=1)
    targets = np.zeros((batch, views, 1, 1, 2))
    targets[..., 0] = 1.0
    loss_fn = _linear_in_output(_WideWs())

    def with_subject(j):
        x, t = inputs.copy(), targets.copy()
        x[j], t[j] = rng.normal(size=x[j].shape), rng.normal(size=t[j].shape)
        return {"input": jnp.asarray(x, jnp.float32), "target": jnp.asarray(t, jnp.float32)}

    return loss_fn, {"conv": {"kernel": kernel}}, with_subject


@pytest.mark.parametrize("views", [1, 2])
def test_a_ws_layer_among_127_others_along_its_kernel_moves_by_at_most_one(views):
    """The independent review's case: the streamed path reached 1.158 C here, when it summed the
    unfolded gradients of the whole batch and folded the sum once."""
    loss_fn, params, with_subject = _review_case(views)
    fns = {
        "book-keeping": make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=1.0),
        "vmap": make_clipped_sum_fn(loss_fn, clip_norm=1.0),
    }
    for strategy in ("explicit", "grouped", "streamed", "ghost"):
        fns[strategy] = make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, strategies={("conv",): strategy})
    for path, fn in fns.items():
        worst = max(largest_move(fn, params, with_subject(j), js=[j]) for j in (0, 5, 64, 117, 127))
        assert worst <= 1.0, (path, worst)


def test_folding_the_batch_sum_instead_of_each_example_fails_the_review_case():
    """The test has teeth: with the same clip weights (and no room for the sum), the batch's own
    weight gradient over the unfolded kernel, folded once, moves by more than 1."""
    from dpscale.privacy.clipping import clip_weights
    from dpscale.privacy.ghost import make_ghost_norm_bounds_fn
    from dpscale.privacy.layer_bounds import WsGeometry

    loss_fn, params, with_subject = _review_case(1)
    kernel = params["conv"]["kernel"]
    geometry = WsGeometry.of(WSConv(2, 3), kernel)
    bounds = jax.jit(make_ghost_norm_bounds_fn(loss_fn, strategies={("conv",): "streamed"}))
    standardized = standardize_kernel(kernel, eps=1e-5)
    worst = 0.0
    for j in (5, 64, 117):
        batch = with_subject(j)
        norms = bounds(params, {}, batch)

        def folded_batch_sum(mask):
            weights, _ = clip_weights(norms, mask, clip_norm=1.0, scale=np.float32(1.0))

            def weighted_loss(w):
                y = jax.lax.conv_general_dilated(
                    batch["input"][:, 0], w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
                return jnp.sum(y * batch["target"][:, 0] * weights[:, None, None, None])

            unfolded = jax.grad(weighted_loss)(standardized).reshape(geometry.d, -1)
            return geometry.fold(geometry.centre(unfolded))

        old = jax.jit(folded_batch_sum)
        worst = max(worst, _norm64(old(jnp.ones(128)), old(jnp.ones(128).at[j].set(0.0))))
    assert worst > 1.0 + 1e-3, worst


@pytest.mark.parametrize("devices", [1, 4])
def test_a_whole_step_of_many_micro_batches_moves_by_at_most_one(devices):
    """The DP step's sum over 16 micro-batches (and over 4 devices' shares of each), rounded once for
    the noise: j's slot empty in one micro-batch, 127 others with one large aligned gradient, among
    which the accumulated total grows to ~127 (the sampler's random slots make this the neighbour)."""
    import optax

    from dpscale.privacy.dpsgd import DpsgdStep, data_mesh

    loss_fn, params, batches = dense_case(1)
    per, count = 8, 16  # 16 micro-batches of 8 slots: 128 in all
    x, g = np.asarray(batches["scales"]["input"][2]), np.asarray(batches["scales"]["target"][2])
    inputs = np.repeat(x[None], per * count, axis=0)
    targets = np.repeat(g[None], per * count, axis=0)
    rng = np.random.default_rng(11)
    step = DpsgdStep(
        make_clipped_sum_fn(loss_fn, clip_norm=CLIP),
        noise_multiplier=1.0,
        expected_batch_size=per * count,
        seed=0,
        optimizer=optax.sgd(1.0),
        ema_decay=0.9,
        capacity=per * count,
        mesh=data_mesh(jax.devices()[:devices]),
    )
    state = step.init(params)
    worst = 0.0
    for j in (0, 77, 127):
        inputs_j, targets_j = inputs.copy(), targets.copy()
        inputs_j[j], targets_j[j] = rng.normal(size=x.shape) * 1e3, rng.normal(size=g.shape)
        sums = []
        for mask in (np.ones(per * count), np.ones(per * count) - np.eye(per * count)[j]):
            total = step.zero_sum(state)
            for m in range(count):
                part = slice(m * per, (m + 1) * per)
                batch = {
                    "input": jnp.asarray(inputs_j[part], jnp.float32),
                    "target": jnp.asarray(targets_j[part], jnp.float32),
                }
                total = step.accumulate(state, total, batch, jnp.asarray(mask[part], jnp.float32))
            sums.append(jax.jit(lambda t: t.summed())(total))
        worst = max(worst, _norm64(*sums))
    assert 0.99 < worst <= 1.0, worst
