"""Per-layer clipping (ghost norms or book-keeping per layer) equals the vmap(grad) path.

Checked on every model of the registry that trains from scratch (its smallest input), with
K = 1 and K = 4 views, on the 4-device sharded step, with a poisoned view and a padded slot;
each layer forced to either path on a zoo of strides, paddings, biases and a shared layer;
the sensitivity of one example; and the strategy rule on the shapes it was measured on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models import registry
from dpscale.models.layers import GroupNorm, WSConv
from dpscale.privacy.bookkeeping import UnsupportedModelError, plan_layers
from dpscale.privacy.clipping import ClippedSum, clipped_sum_from_gradients, per_example_gradients
from dpscale.privacy.dpsgd import DpsgdStep, data_mesh
from dpscale.privacy.ghost import LayerChoice, PathChooser, make_ghost_clipped_sum_fn
from dpscale.privacy.tuning.choose import choose_strategy, chooser, input_floats

RTOL = 1e-5
# The ghost, streamed and explicit norms are proven upper bounds, a little above the vmap path's
# (privacy/layer_bounds.py): the clip weights, and so the sums, may differ by this much. A ghost
# WS norm leaves out the part along the kernel, about 1/fan-in of it: more on the zoo's small layers.
MARGIN = 5e-3
GHOST_MARGIN = 3e-2


def _reference(loss_fn, params, batch, mask, clip):
    losses, grads = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, {}, b))(params, batch)
    return jax.jit(lambda g, m, losses: clipped_sum_from_gradients(g, m, clip_norm=clip, losses=losses))(
        grads, mask, losses
    ), grads


def _median_clip(grads, size):
    norms = np.linalg.norm(
        np.concatenate([np.reshape(g, (size, -1)) for g in jax.tree_util.tree_leaves(grads)], axis=1), axis=1
    )
    finite = np.sort(norms[np.isfinite(norms)])
    return float(finite[len(finite) // 2 - 1] + finite[len(finite) // 2]) / 2  # clips some, not all


def _assert_same(out: ClippedSum, ref: ClippedSum, nets, margin=MARGIN):
    for field in ("num_examples", "num_clipped", "num_nonfinite"):
        assert int(getattr(out, field)) == int(getattr(ref, field)), field
    assert float(ref.sum_of_norms) * (1 - RTOL) <= float(out.sum_of_norms) <= float(ref.sum_of_norms) * (1 + margin)
    np.testing.assert_allclose(out.sum_of_losses, ref.sum_of_losses, rtol=RTOL)
    nets.assert_trees_close(out.value, ref.value, rtol=margin)


FROM_SCRATCH = [name for name in registry.list_models() if not registry.get_spec(name).pretrained]
# The smallest input each family runs on (the registry's own is up to 320 px).
# First match wins: cnn-tanh's 8x8 and 4x4 strided kernels need its own 28 px.
SMALL_INPUT = {
    "wrn": (8, 8, 3),
    "cnn-tanh": (28, 28, 1),
    "cnn": (12, 12, 1),
    "scatternet": (28, 28, 1),
    "nf": (32, 32, 3),
}


def _family(name):
    return next(prefix for prefix in SMALL_INPUT if name.startswith(prefix))


def test_the_registry_models_are_all_tested():
    assert FROM_SCRATCH and all(_family(name) for name in FROM_SCRATCH)


# The wider and deeper WRNs repeat WRN-16-4's layers: one view count each keeps the suite fast.
CASES = [
    (name, views) for name in FROM_SCRATCH for views in (1, 4) if views == 4 or name not in ("wrn-40-4", "wrn-28-10")
]


@pytest.mark.parametrize("name,views", CASES)
def test_equals_vmap_on_every_from_scratch_model_on_four_devices(name, views, nets):
    shape = SMALL_INPUT[_family(name)]
    model = registry.get_model(name, num_classes=10)
    loss_fn = nets.image_loss(model)
    size = 8
    batch = nets.image_batch(1, size, views, shape)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape)))["params"]
    try:
        plan_layers(
            loss_fn, abstract, {}, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
        )
    except UnsupportedModelError:
        # No rule covers its layers (e.g. the NF nets' scaled WS): training uses the vmap path
        # itself, which is the reference here, and says so in its log.
        with pytest.raises(UnsupportedModelError):
            make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(abstract, {}, batch))
        return
    params = nets.random_params(model, shape)
    batch["image"] = batch["image"].at[2, views - 1, 0, 0, 0].set(jnp.nan)  # one poisoned view
    mask = jnp.ones(size).at[size - 1].set(0.0)  # one padded slot
    _, grads = _reference(loss_fn, params, batch, mask, 1.0)
    clip = _median_clip(grads, size)
    ref, _ = _reference(loss_fn, params, batch, mask, clip)
    example = (params, {}, batch)
    fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=clip, example=example, choose=chooser(loss_fn, example=example))
    assert {c.strategy for c in fn.layers} >= {"book-keeping"}
    step = DpsgdStep(
        fn,
        noise_multiplier=1.0,
        expected_batch_size=size,
        seed=0,
        optimizer=optax.sgd(1.0),
        ema_decay=0.9999,
        capacity=size,
        mesh=data_mesh(jax.devices()[:4]),
    )
    state = step.init(params)
    out = step.accumulate(state, step.zero_sum(state), batch, mask)  # shard_map: 2 examples per device
    assert int(out.num_nonfinite) == 1 and 0 < int(out.num_clipped) < size - 2
    _assert_same(out, ref, nets)


class _Zoo(nn.Module):
    """Strides, paddings, kernel shapes, biases, a shared (twice-called) layer, a dense head."""

    @nn.compact
    def __call__(self, x):
        x = WSConv(8, (3, 2), strides=2, padding="SAME", use_bias=True, name="a")(x)
        x = nn.relu(GroupNorm(num_groups=4, name="n")(x))
        x = WSConv(8, 3, strides=(2, 1), padding="VALID", name="b")(x)
        x = WSConv(8, 3, strides=1, padding=((2, 0), (1, 1)), use_bias=True, name="c")(x)
        shared = WSConv(8, 1, strides=1, name="shared")
        x = shared(nn.relu(shared(x)))
        x = WSConv(12, 1, strides=2, name="d")(x)
        return nn.Dense(5, name="fc")(jnp.mean(x, axis=(1, 2)))


@pytest.mark.parametrize("strategy", ["ghost", "explicit", "streamed", "grouped"])
@pytest.mark.parametrize("views", [1, 3])
def test_each_path_equals_vmap_on_every_layer_kind(strategy, views, nets):
    model = _Zoo()
    shape = (11, 9, 3)
    params = nets.random_params(model, shape)
    loss_fn = nets.image_loss(model)
    size = 6
    batch = nets.image_batch(2, size, views, shape, classes=5)
    batch["image"] = batch["image"].at[1, 0, 3, 3, 0].set(jnp.inf)
    mask = jnp.ones(size).at[0].set(0.0)
    _, grads = _reference(loss_fn, params, batch, mask, 1.0)
    clip = _median_clip(grads, size)
    ref, _ = _reference(loss_fn, params, batch, mask, clip)
    forced = {(name,): strategy for name in ("a", "b", "c", "d", "fc")}
    fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=clip, example=(params, {}, batch), strategies=forced)
    assert {c.layer: c.strategy for c in fn.layers} == {**forced, ("n",): "book-keeping", ("shared",): "book-keeping"}
    out = jax.jit(fn)(params, {}, batch, mask)
    assert fn.sensitivity == out.sensitivity == 1.0
    _assert_same(out, ref, nets, margin=GHOST_MARGIN if strategy == "ghost" else MARGIN)


@pytest.mark.parametrize("strategy", ["ghost", "explicit", "streamed", "grouped"])
def test_one_example_moves_the_sum_by_at_most_one(strategy, nets):
    model = registry.get_model("cnn-small", num_classes=4)
    shape = (12, 12, 1)
    params = nets.random_params(model, shape, seed=4)
    loss_fn = nets.image_loss(model)
    size = 6
    batch = nets.image_batch(5, size, 2, shape, classes=4)
    batch["image"] = batch["image"] * 30.0  # large inputs: every example is clipped
    one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
    paths = [c.path for c in plan_layers(loss_fn, params, {}, one) if type(c.module) in (WSConv, nn.Dense)]
    fn = jax.jit(make_ghost_clipped_sum_fn(loss_fn, clip_norm=0.01, strategies={p: strategy for p in paths}))
    full = fn(params, {}, batch, jnp.ones(size))
    assert int(full.num_clipped) == size
    for i in range(size):
        without = fn(params, {}, batch, jnp.ones(size).at[i].set(0.0))
        diff = jax.tree_util.tree_map(
            lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), full.value, without.value
        )
        assert np.sqrt(sum(np.sum(d * d) for d in jax.tree_util.tree_leaves(diff))) <= 1.0


def _planting(strategy):
    """A chooser that puts every plain layer on ``strategy``, whatever it is."""

    def choose(calls, params_of, examples):
        return {c.path: LayerChoice(c.path, type(c.module).__name__, strategy, reason="planted") for c in calls}

    return PathChooser(choose)


def test_a_choice_off_the_proven_paths_is_refused_whatever_made_it(nets):
    """The tuning only chooses among the registry's proven paths: the clipped sum checks each choice."""
    model = registry.get_model("cnn-small", num_classes=4)
    shape = (12, 12, 1)
    params, batch = nets.random_params(model, shape), nets.image_batch(0, 4, 1, shape, classes=4)
    loss_fn = nets.image_loss(model)
    for bad in ("vmap-free", "book-keeping", "none"):
        with pytest.raises(InvalidConfigError, match="is not one of"):
            make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch), choose=_planting(bad))
    fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch), choose=_planting("ghost"))
    assert {c.strategy for c in fn.layers} == {"ghost", "book-keeping"}
    with pytest.raises(InvalidConfigError, match="not both"):
        make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, choose=_planting("ghost"), strategies={("x",): "ghost"})


def test_ghost_for_late_layers_explicit_or_streamed_for_early_ones():
    # cnn-small on 32x32 images (P = positions, d = fan-in, p = fan-out, inputs: floats of one
    # example's layer input): the measured choices.
    assert choose_strategy(positions=32 * 32, fan_in=27, fan_out=16, inputs=32 * 32 * 3) == "explicit"
    assert choose_strategy(positions=16 * 16, fan_in=144, fan_out=32, inputs=16 * 16 * 16) == "explicit"
    assert choose_strategy(positions=8 * 8, fan_in=288, fan_out=64, inputs=8 * 8 * 32) == "ghost"
    assert choose_strategy(positions=4 * 4, fan_in=576, fan_out=128, inputs=4 * 4 * 64) == "ghost"
    # WRN-16-4: the 8x8 stage is ghost; with K = 4 views it has 256 positions and is ghost still
    # (its per-example gradient is 590k floats).
    assert choose_strategy(positions=8 * 8, fan_in=2304, fan_out=256, inputs=8 * 8 * 256) == "ghost"
    assert choose_strategy(positions=4 * 8 * 8, fan_in=2304, fan_out=256, inputs=4 * 8 * 8 * 256) == "ghost"
    # Its 16x16 stage's per-example gradient (147k floats) is larger than the layer's input and
    # output gradient (33k + 33k): streamed, not held; with K = 4 views those are 131k + 131k: held.
    assert choose_strategy(positions=16 * 16, fan_in=1152, fan_out=128, inputs=16 * 16 * 128) == "streamed"
    assert choose_strategy(positions=4 * 16 * 16, fan_in=1152, fan_out=128, inputs=4 * 16 * 16 * 128) == "explicit"
    # The stage's first, strided layer reads 32x32x64 (65k) for a 74k gradient: held.
    assert choose_strategy(positions=16 * 16, fan_in=576, fan_out=128, inputs=32 * 32 * 64) == "explicit"
    assert choose_strategy(positions=32 * 32, fan_in=576, fan_out=64, inputs=32 * 32 * 64) == "explicit"


def test_the_rule_reads_a_layers_input_size_from_its_module():
    # A 3x3 WS convolution of stride 2 from 64 channels to 128 at 16x16 output positions reads
    # 32x32x64 floats; a dense layer its fan-in at each position.
    kernel = jnp.zeros((3, 3, 64, 128))
    assert input_floats(WSConv(128, (3, 3), strides=2), kernel, 16 * 16) == 32 * 32 * 64
    assert input_floats(WSConv(128, (3, 3)), kernel, 16 * 16) == 16 * 16 * 64
    assert input_floats(nn.Dense(10), jnp.zeros((256, 10)), 1) == 256
