"""Clipping tuned for the device: each backend's settings, and paths chosen by a cost model or by
timing them.

A CPU runs the same arithmetic as a GPU, so the GPU's settings (a whole micro-batch at once,
TF32 contractions, each layer's path and precision estimated or timed) are forced here and checked as every
other path is: against ``vmap(grad)`` at K = 1 and 4, and one example moving the sum by at most 1.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models import registry
from dpscale.models.layers import WSConv
from dpscale.privacy.bookkeeping import plan_layers
from dpscale.privacy.clipping import clipped_sum_from_gradients, per_example_gradients
from dpscale.privacy.ghost import LayerShape, make_ghost_clipped_sum_fn
from dpscale.privacy.rounding import ClipPrecision
from dpscale.privacy.tuning import cost as path_cost
from dpscale.privacy.tuning import device as device_tuning
from dpscale.privacy.tuning import timing as path_timing
from dpscale.privacy.tuning.choose import chooser, describe, describe_layers
from dpscale.privacy.tuning.device import (
    ALL_STRATEGIES,
    CPU_CHUNK_BYTES,
    STRATEGIES,
    DeviceTuning,
    memory_budget,
    tuning_for,
)

GPU = tuning_for("gpu")
TIMED = dataclasses.replace(GPU, choose="measure")  # a GPU's candidates timed on the device
SHAPE = (12, 12, 1)


def _cnn(nets, views, size=6, scale=1.0):
    model = registry.get_model("cnn-small", num_classes=4)
    params = nets.random_params(model, SHAPE, seed=4)
    batch = nets.image_batch(5, size, views, SHAPE, classes=4)
    batch["image"] = batch["image"] * scale
    return nets.image_loss(model), params, batch


def _tuned(loss_fn, *, clip_norm, tuning, example=None, strategies=None, precision=None):
    """The clipped sum with each layer's path chosen by ``tuning`` (forced where ``strategies`` says)."""
    choose = chooser(loss_fn, example=example, strategies=strategies, precision=precision, tuning=tuning)
    return make_ghost_clipped_sum_fn(loss_fn, clip_norm=clip_norm, example=example, choose=choose)


@pytest.fixture(autouse=True)
def _timings_kept_nowhere(monkeypatch):
    monkeypatch.setenv("DPSCALE_CLIP_TIMINGS", "")


def test_each_backend_has_its_settings_and_an_unknown_one_the_cpus():
    cpu = tuning_for("cpu")
    assert (cpu.choose, cpu.chunk_bytes, cpu.precision) == ("rule", CPU_CHUNK_BYTES, ClipPrecision())
    assert GPU.choose == "estimate" and GPU.chunk_bytes > 2**40
    # TF32 only for held gradients, whose bound costs no margin at TF32 (ghost's and streamed's do).
    assert GPU.precision == ClipPrecision() and ("explicit", ClipPrecision("tf32", "tf32")) in GPU.candidates
    assert {s for s, _ in GPU.candidates} == set(STRATEGIES)
    assert all(p == ClipPrecision() for s, p in GPU.candidates if s != "explicit")
    assert tuning_for("tpu").choose == "measure"
    assert tuning_for("some-new-backend") == cpu
    with pytest.raises(InvalidConfigError, match="how paths are chosen"):
        DeviceTuning(choose="guess")
    with pytest.raises(InvalidConfigError, match="cost model"):
        DeviceTuning(choose="estimate")
    with pytest.raises(InvalidConfigError, match="candidates non-empty"):
        DeviceTuning(candidates=())
    with pytest.raises(InvalidConfigError, match="a candidate's path"):
        DeviceTuning(candidates=(("guess", ClipPrecision()),))
    with pytest.raises(InvalidConfigError, match="prune_factor"):
        DeviceTuning(prune_factor=1.0)
    with pytest.raises(InvalidConfigError, match="memory_bytes"):
        DeviceTuning(memory_bytes=0)
    # A measured cost model where one was measured (NVIDIA GPUs); elsewhere every candidate is timed.
    assert GPU.cost is not None and tuning_for("tpu").cost is None and cpu.cost is None


def test_a_gpu_not_nvidias_times_its_candidates_rather_than_use_nvidias_cost_model(monkeypatch):
    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for kind, expected in (("NVIDIA H200", "estimate"), ("AMD Instinct MI300X", "measure")):
        monkeypatch.setattr(jax, "devices", lambda kind=kind: [Device(kind)])
        assert tuning_for().choose == expected
    assert tuning_for("gpu").choose == "estimate"  # named, as benchmarks do: that backend's settings


def test_the_memory_budget_is_a_fraction_of_what_the_device_says(monkeypatch):
    assert memory_budget(dataclasses.replace(GPU, memory_bytes=123)) == 123
    default = device_tuning.DEFAULT_DEVICE_BYTES
    assert memory_budget(GPU) == int(device_tuning.MEMORY_FRACTION * default)  # a CPU says nothing

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 8 * 10**9}

    monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
    assert memory_budget(GPU) == int(device_tuning.MEMORY_FRACTION * 8 * 10**9)


@pytest.mark.parametrize("views", [1, 4])
def test_the_gpu_settings_time_every_layer_and_clip_as_vmap_does(views, nets):
    loss_fn, params, batch = _cnn(nets, views)
    size = batch["label"].shape[0]
    mask = jnp.ones(size).at[0].set(0.0)
    fn = _tuned(loss_fn, clip_norm=0.05, example=(params, {}, batch), tuning=TIMED)
    timed = [c for c in fn.layers if c.strategy != "book-keeping"]
    assert timed and all(c.reason.startswith("measured: ") for c in timed)
    for choice in timed:  # every candidate was timed (none is hopeless here), the chosen one named first
        assert choice.reason.count(" ms") == len(TIMED.candidates) and choice.chunk == 0
        chosen = path_timing.candidate_name(choice.strategy, choice.precision)
        assert choice.reason.startswith(f"measured: {chosen} ")
    assert "chosen by measured" in describe(fn.layers) and len(describe_layers(fn.layers)) == len(timed)
    out = jax.jit(fn)(params, {}, batch, mask)
    losses, grads = per_example_gradients(loss_fn, params, {}, batch)
    ref = clipped_sum_from_gradients(grads, mask, clip_norm=0.05, losses=losses)
    assert int(out.num_clipped) == int(ref.num_clipped) and int(out.num_examples) == size - 1
    # Bounds a little above the norms (ghost's most: privacy/layer_bounds.py).
    nets.assert_trees_close(out.value, ref.value, rtol=3e-2)


@pytest.mark.parametrize("views", [1, 4])
def test_the_gpu_default_chooses_by_its_cost_model_compiling_nothing_and_clips_as_vmap_does(views, nets, monkeypatch):
    def never(*args):
        raise AssertionError("a candidate was timed")

    monkeypatch.setattr(path_timing, "_time", never)
    loss_fn, params, batch = _cnn(nets, views)
    size = batch["label"].shape[0]
    fn = _tuned(loss_fn, clip_norm=0.05, example=(params, {}, batch), tuning=GPU)
    chosen = [c for c in fn.layers if c.strategy != "book-keeping"]
    assert chosen and "chosen by estimated" in describe(fn.layers)
    for c in chosen:  # the cheapest of the candidates by the model, named first with every estimate
        shape = LayerShape(size, c.positions, c.fan_in, c.fan_out, c.kind == "WSConv")
        estimates = {path_cost.name(s, p): path_cost.estimate(s, p, shape, size, GPU.cost) for s, p in GPU.candidates}
        name = path_timing.candidate_name(c.strategy, c.precision)
        assert estimates[name] == min(estimates.values())
        assert c.reason.startswith(f"estimated: {name} ") and c.reason.count(" ms") >= 2
    mask = jnp.ones(size).at[0].set(0.0)
    out = jax.jit(fn)(params, {}, batch, mask)
    losses, grads = per_example_gradients(loss_fn, params, {}, batch)
    ref = clipped_sum_from_gradients(grads, mask, clip_norm=0.05, losses=losses)
    assert int(out.num_clipped) == int(ref.num_clipped) and int(out.num_examples) == size - 1
    nets.assert_trees_close(out.value, ref.value, rtol=3e-2)


@pytest.mark.parametrize("precision", ["highest", "tf32"])
@pytest.mark.parametrize("strategy", list(ALL_STRATEGIES))
def test_a_whole_micro_batch_at_once_moves_the_sum_by_at_most_one(strategy, precision, nets):
    loss_fn, params, batch = _cnn(nets, 2, scale=30.0)  # large inputs: every example is clipped
    size = batch["label"].shape[0]
    one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
    paths = [c.path for c in plan_layers(loss_fn, params, {}, one) if type(c.module) in (WSConv, nn.Dense)]
    tuning = dataclasses.replace(GPU, choose="rule")
    fn = jax.jit(
        _tuned(
            loss_fn,
            clip_norm=0.01,
            strategies={p: strategy for p in paths},
            precision=ClipPrecision(precision, precision),
            tuning=tuning,
        )
    )
    full = fn(params, {}, batch, jnp.ones(size))
    assert int(full.num_clipped) == size
    for i in range(size):
        without = fn(params, {}, batch, jnp.ones(size).at[i].set(0.0))
        diff = [
            np.asarray(a, np.float64) - np.asarray(b, np.float64)
            for a, b in zip(jax.tree_util.tree_leaves(full.value), jax.tree_util.tree_leaves(without.value))
        ]
        assert np.sqrt(sum(np.sum(d * d) for d in diff)) <= 1.0


def test_a_candidate_that_fails_is_said_and_never_chosen(nets, monkeypatch):
    loss_fn, params, batch = _cnn(nets, 1)
    real = path_timing._layer_fn

    def ghost_fails(module, strategy, precision, chunk_bytes):
        if strategy != "ghost":
            return real(module, strategy, precision, chunk_bytes)

        def out_of_memory(*args):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

        return out_of_memory

    monkeypatch.setattr(path_timing, "_layer_fn", ghost_fails)
    fn = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    timed = [c for c in fn.layers if c.strategy != "book-keeping"]
    assert timed and all(c.strategy != "ghost" and "ghost/highest failed" in c.reason for c in timed)


def test_timings_are_kept_for_the_next_process_and_a_corrupt_file_is_timed_again(nets, monkeypatch, tmp_path):
    loss_fn, params, batch = _cnn(nets, 1)
    kept = tmp_path / "cache" / "clip_timings.json"
    monkeypatch.setenv("DPSCALE_CLIP_TIMINGS", str(kept))
    first = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    timings = json.loads(kept.read_text())
    assert len(timings) == len(GPU.candidates) * sum(c.strategy != "book-keeping" for c in first.layers)

    def never(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(path_timing, "_time", never)
    again = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    assert again.layers == first.layers
    kept.write_text("{not json")
    monkeypatch.setattr(path_timing, "_time", lambda fn, args, repeats: 1.0)
    _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    assert set(json.loads(kept.read_text()).values()) == {1.0}
    monkeypatch.delenv("DPSCALE_CLIP_TIMINGS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert path_timing.timings_file() == str(tmp_path / "xdg" / "dpscale" / "clip_timings.json")


def test_measured_summary_ranks_the_candidates():
    measured = path_timing.Measured(
        "explicit",
        ClipPrecision(),
        (("ghost/highest", math.inf), ("explicit/highest", 0.002), ("streamed/tf32", 0.003)),
    )
    assert measured.summary() == "measured: explicit/highest 2.00 ms (streamed/tf32 3.00 ms, ghost/highest failed)"
    assert path_timing.candidate_name("ghost", ClipPrecision("tf32", "highest")) == "ghost/tf32+highest"


@pytest.mark.parametrize("views", [1, 4])
def test_a_tiny_memory_budget_chunks_or_drops_and_the_sum_is_still_vmaps(views, nets):
    loss_fn, params, batch = _cnn(nets, views)
    tuning = dataclasses.replace(GPU, memory_bytes=1_000_000)
    fn = _tuned(loss_fn, clip_norm=0.05, example=(params, {}, batch), tuning=tuning)
    timed = [c for c in fn.layers if c.strategy != "book-keeping"]
    chunked = [c for c in timed if c.chunk]
    assert chunked and all("chunked " in c.reason and c.chunk < batch["label"].shape[0] for c in chunked)
    assert any(" dropped: needs " in c.reason for c in timed)
    for c in timed:  # never a path whose working set is known not to fit
        shape = LayerShape(batch["label"].shape[0], c.positions, c.fan_in, c.fan_out, c.kind == "WSConv")
        held, per_example = path_cost.working_set(c.strategy, shape)
        assert held + per_example * (c.chunk or shape.examples) <= tuning.memory_bytes
    size = batch["label"].shape[0]
    mask = jnp.ones(size).at[0].set(0.0)
    loops = nets.scan_lengths(jax.make_jaxpr(fn)(params, {}, batch, mask).jaxpr)

    assert all(size // c.chunk in loops for c in chunked)  # the guard's chunks are the loops that run
    out = jax.jit(fn)(params, {}, batch, mask)
    losses, grads = per_example_gradients(loss_fn, params, {}, batch)
    ref = clipped_sum_from_gradients(grads, mask, clip_norm=0.05, losses=losses)
    assert int(out.num_clipped) == int(ref.num_clipped) and int(out.num_examples) == size - 1
    nets.assert_trees_close(out.value, ref.value, rtol=3e-2)


def test_a_rule_path_that_does_not_fit_gives_way_to_one_that_does(nets):
    loss_fn, params, batch = _cnn(nets, 1)
    # The stem (144 positions, 9 -> 16): the rule's explicit holds 3.5 KB and needs 6.3 KB an example;
    # streamed needs 6.9 KB an example and holds nothing.
    tuning = dataclasses.replace(GPU, choose="rule", memory_bytes=8000)
    fn = _tuned(loss_fn, clip_norm=0.05, example=(params, {}, batch), tuning=tuning)
    stem = next(c for c in fn.layers if c.layer == ("backbone", "conv_0"))
    assert (stem.strategy, stem.chunk) == ("streamed", 1)
    assert stem.reason.startswith("rule; explicit does not fit the memory budget; chunked 6 x 1 examples")
    assert "chosen by rule (" in describe(fn.layers) and "chunked" not in describe(fn.layers)
    size = batch["label"].shape[0]
    mask = jnp.ones(size)
    out = jax.jit(fn)(params, {}, batch, mask)
    losses, grads = per_example_gradients(loss_fn, params, {}, batch)
    ref = clipped_sum_from_gradients(grads, mask, clip_norm=0.05, losses=losses)
    nets.assert_trees_close(out.value, ref.value, rtol=3e-2)


@pytest.mark.parametrize("strategy", list(ALL_STRATEGIES))
def test_chunked_by_the_memory_guard_one_example_moves_the_sum_by_at_most_one(strategy, nets):
    loss_fn, params, batch = _cnn(nets, 2, scale=30.0)  # large inputs: every example is clipped
    size = batch["label"].shape[0]
    one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
    paths = [c.path for c in plan_layers(loss_fn, params, {}, one) if type(c.module) in (WSConv, nn.Dense)]
    tuning = dataclasses.replace(GPU, choose="rule", memory_bytes=300_000, precision=ClipPrecision("tf32", "tf32"))
    made = _tuned(
        loss_fn, clip_norm=0.01, example=(params, {}, batch), strategies={p: strategy for p in paths}, tuning=tuning
    )
    assert any(c.chunk for c in made.layers)
    fn = jax.jit(made)
    full = fn(params, {}, batch, jnp.ones(size))
    assert int(full.num_clipped) == size
    for i in range(size):
        without = fn(params, {}, batch, jnp.ones(size).at[i].set(0.0))
        diff = [
            np.asarray(a, np.float64) - np.asarray(b, np.float64)
            for a, b in zip(jax.tree_util.tree_leaves(full.value), jax.tree_util.tree_leaves(without.value))
        ]
        assert np.sqrt(sum(np.sum(d * d) for d in diff)) <= 1.0


def test_pruned_candidates_are_said_in_the_reason_and_in_clip_paths(nets):
    loss_fn, params, batch = _cnn(nets, 1)
    tuning = dataclasses.replace(TIMED, prune_factor=1.0001)  # all but the two cheapest by the model
    fn = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=tuning)
    timed = [c for c in fn.layers if c.strategy != "book-keeping"]
    for choice in timed:
        assert choice.reason.count(" ms") + choice.reason.count(" pruned: est. ") == len(GPU.candidates)
        assert choice.reason.count(" ms") >= 2
    assert any(" pruned: est. " in c.reason for c in timed)
    written = json.loads(json.dumps([dataclasses.asdict(c) for c in fn.layers]))  # as the trainer writes them
    assert any("pruned: est." in layer["reason"] for layer in written) and all("chunk" in layer for layer in written)


def test_kept_timings_are_owner_only_and_a_planted_file_changes_no_path(nets, monkeypatch, tmp_path, caplog):
    """Timings another user could write are never read: a group- or world-writable file (or one of
    another user, or a link) is ignored with a warning, and the paths are those of no file at all."""
    loss_fn, params, batch = _cnn(nets, 1)
    kept = tmp_path / "cache" / "clip_timings.json"
    monkeypatch.setenv("DPSCALE_CLIP_TIMINGS", str(kept))
    monkeypatch.setattr(path_timing, "_time", lambda fn, args, repeats: 1.0)  # every candidate ties
    honest = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    assert kept.stat().st_mode & 0o777 == 0o600 and kept.parent.stat().st_mode & 0o777 == 0o700
    planted = {name: (1e-9 if "streamed" in name else 1e3) for name in json.loads(kept.read_text())}
    kept.write_text(json.dumps(planted))
    kept.chmod(0o666)
    monkeypatch.setattr(path_timing, "_time", lambda fn, args, repeats: 1.0)
    with caplog.at_level("WARNING"):
        again = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    assert "ignored: not a regular file of this user" in caplog.text
    assert [c.strategy for c in again.layers] == [c.strategy for c in honest.layers]
    assert not any(c.strategy == "streamed" for c in honest.layers)  # ties go to the first candidate
    kept.write_text(json.dumps(planted))  # the same file, now this user's own and owner-only: read
    kept.chmod(0o600)
    monkeypatch.setattr(path_timing, "_time", lambda fn, args, repeats: pytest.fail("timed again"))
    chosen = _tuned(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=TIMED)
    assert {c.strategy for c in chosen.layers} == {"streamed", "book-keeping"}  # still a proven path
