"""The paths' cost model and memory guard, from shapes alone: what is pruned, what is chunked.

Nothing here may change what is clipped: pruning only leaves candidates out of the timing (at least
two stay), and chunking splits a layer's per-example work into equal parts (tests/privacy/
test_path_timing.py checks the clipped sum against vmap and the sensitivity with a tiny budget).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from dpscale.privacy import layer_bounds
from dpscale.privacy.ghost import LayerShape
from dpscale.privacy.rounding import ClipPrecision
from dpscale.privacy.tuning import cost as path_cost
from dpscale.privacy.tuning.device import H200_COST, UNLIMITED_CHUNK_BYTES, tuning_for

GPU = tuning_for("gpu")


def _plan(shape, *, budget=10**12, tuning=GPU):
    return path_cost.plan(tuning.candidates, shape, budget=budget, cost=tuning.cost, prune_factor=tuning.prune_factor)


def test_ghost_is_pruned_where_its_gram_matrices_dwarf_the_kernel_and_kept_where_they_do_not():
    # WRN-16-4's first stage at micro-batch 256: ghost measured 11x the fastest on an H200.
    first = _plan(LayerShape(256, 1024, 576, 64))
    assert [n for n, _ in first.left_out] == ["ghost/highest"]
    assert first.left_out[0][1].startswith("pruned: est. ") and first.left_out[0][1].endswith("x explicit/tf32")
    assert {c.strategy for c in first.timed} == {"explicit", "streamed"}
    # Its last stage: nothing is pruned. Ghost measured fastest there when its sum was the batch's
    # weight gradient; now it forms each example's product for the sum as explicit does, after its
    # Gram matrices, and the model puts explicit (at TF32) first.
    last = _plan(LayerShape(256, 64, 2304, 256))
    assert not last.left_out and len(last.timed) == len(GPU.candidates)
    assert min(last.timed, key=lambda c: c.seconds).strategy == "explicit"


@pytest.mark.parametrize("factor", [GPU.prune_factor, 1.0001])
def test_pruning_keeps_the_cheapest_by_the_model_and_at_least_two(factor):
    tuning = dataclasses.replace(GPU, prune_factor=factor)
    grid = itertools.product((2, 256), (1, 9, 256, 4096), (9, 576, 2304), (4, 64, 512), (True, False))
    for examples, positions, d, p, conv in grid:
        shape = LayerShape(examples, positions, d, p, conv)
        plan = _plan(shape, tuning=tuning)
        assert len(plan.timed) >= 2 and len(plan.timed) + len(plan.left_out) == len(GPU.candidates)
        every = [
            path_cost.estimate(s, prec, shape, examples, H200_COST) for s, prec in GPU.candidates
        ]  # all fit: the chunk is the whole micro-batch
        assert min(c.seconds for c in plan.timed) == min(every)
        cheapest = min(every)
        for name, why in plan.left_out:
            assert why.startswith("pruned: ")
            index = [path_cost.name(s, prec) for s, prec in GPU.candidates].index(name)
            assert every[index] >= factor * cheapest


def test_without_a_cost_model_every_candidate_that_fits_is_timed():
    tpu = tuning_for("tpu")
    assert tpu.cost is None
    plan = _plan(LayerShape(256, 4096, 576, 64), tuning=tpu)
    assert not plan.left_out and len(plan.timed) == len(tpu.candidates)


def test_one_candidate_is_kept_where_only_one_fits():
    # explicit holds 16.4 MB; ghost's Gram matrices take 13 MB an example; streamed's example 0.3 MB
    shape = LayerShape(1000, 1024, 64, 64)
    plan = _plan(shape, budget=1_000_000)
    assert [c.strategy for c in plan.timed] == ["streamed"]
    assert {n: why.split(":")[0] for n, why in plan.left_out} == {
        "ghost/highest": "dropped",
        "explicit/highest": "dropped",
        "explicit/tf32": "dropped",
    }
    assert not _plan(shape, budget=1000).timed


def test_fit_takes_the_largest_equal_chunk_within_the_budget():
    shape = LayerShape(12, 36, 288, 64)
    for strategy in ("explicit", "streamed", "ghost"):
        held, per = path_cost.working_set(strategy, shape)
        assert path_cost.fit(strategy, shape, held + 12 * per) == 12
        for budget in range(held + per, held + 12 * per, max(1, per // 3)):
            chunk = path_cost.fit(strategy, shape, budget)
            assert 12 % chunk == 0 and held + chunk * per <= budget
            bigger = [c for c in range(chunk + 1, 13) if 12 % c == 0]
            assert not bigger or held + bigger[0] * per > budget
        assert path_cost.fit(strategy, shape, held + per - 1) is None
    dense = LayerShape(12, 1, 128, 10, conv=False)  # one contraction: held, or nothing
    assert path_cost.working_set("explicit", dense) == (4 * 12 * 128 * 10, 0)
    assert path_cost.fit("explicit", dense, 4 * 12 * 1280) == 12
    assert path_cost.fit("explicit", dense, 4 * 12 * 1280 - 1) is None


@pytest.mark.parametrize("strategy", ["streamed", "ghost"])
def test_chunk_bytes_runs_that_many_examples_through_layer_bounds(strategy, nets):
    shape = LayerShape(12, 9, 8, 4)
    work = layer_bounds.chunk_work(strategy, 9, 8, 4)
    assert path_cost.chunk_bytes(strategy, shape, 12, UNLIMITED_CHUNK_BYTES) == UNLIMITED_CHUNK_BYTES
    assert path_cost.chunk_bytes(strategy, shape, 3, 2 * work) == 2 * work  # the device's smaller chunks stay
    for chunk in (1, 2, 3, 4, 6):
        chunk_bytes = path_cost.chunk_bytes(strategy, shape, chunk, UNLIMITED_CHUNK_BYTES)

        def run(x, chunk_bytes=chunk_bytes):
            return layer_bounds.chunked(lambda a: jnp.sum(a * a), (x,), work, chunk_bytes=chunk_bytes)

        assert nets.scan_lengths(jax.make_jaxpr(run)(jnp.ones((12, 9, 8))).jaxpr) == [12 // chunk]


def test_estimates_name_and_describe():
    assert path_cost.name("ghost", ClipPrecision("tf32", "highest")) == "ghost/tf32+highest"
    shape = LayerShape(256, 4096, 576, 64)
    one = path_cost.estimate("ghost", ClipPrecision(), shape, 256, H200_COST)
    # Chunked work pays a launch a chunk.
    assert path_cost.estimate("ghost", ClipPrecision(), shape, 128, H200_COST) == pytest.approx(
        one + H200_COST.launch_seconds
    )
    assert path_cost.describe_chunk("ghost", shape, 256, 10**9) == ""
    said = path_cost.describe_chunk("ghost", shape, 64, 26 * 10**9)
    assert said.startswith("chunked 4 x 64 examples (") and said.endswith(" at once > budget 26 GB)")


def test_grouped_is_timed_on_convolutions_only_and_never_pruned_there():
    from dpscale.privacy.tuning.device import GPU_TIMED

    conv = _plan(LayerShape(256, 1024, 576, 64), tuning=GPU_TIMED)
    assert "grouped" in {c.strategy for c in conv.timed}  # its estimate is no fit: optimistic, so timed
    dense = _plan(LayerShape(256, 1, 256, 10, conv=False), tuning=GPU_TIMED)
    assert "grouped" not in {c.strategy for c in dense.timed}
    assert ("grouped/tf32", "not timed: explicit's contraction on a dense layer") in dense.left_out
