"""Each layer's clipping path and precision, chosen by timing the candidates on the device itself
(or, where the device has a measured cost model, by its estimates).

Why: whether a layer's per-example norm is cheapest as ghost Gram matrices, held per-example
gradients (explicit) or a streamed product, and at which precision, depends on the device as much
as on the shapes: a rule measured on a CPU (``ghost.GHOST_RATIO``) says nothing of a GPU's tensor
cores or its kernel launches. As cuDNN times its convolution algorithms, the candidates of each
distinct layer (its module, input and output-gradient shapes) are compiled and timed once, on
random inputs of the micro-batch's shape, when the clipped sum is built; the fastest wins. Only
speed is at stake: every candidate clips with a proven bound of the norm (``privacy.rounding``).

Before any is timed, ``privacy.tuning.cost`` leaves out the candidates whose working set does not fit
the device's memory budget even an example at a time, chunks those that fit only in parts (and
times them chunked, as they will run), and prunes those the device's cost model puts at many times
the cheapest: each compilation saved is seconds of a first run. What was left out and why is in the
layer's reason, with the timings. A candidate that fails to compile or run (out of device memory,
say) is said and never chosen (and timed again by the next process). Timings are the minimum over a few calls after a first, uncounted one. They are kept
between processes in a small JSON file (``timings_file``), keyed by the device kind, the JAX
version, the layer and the candidate, so that a sweep or a resumed run does not time them again:
written owner-only, and read only where it is this user's own file that nobody else may write.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.files import write_json_atomic
from dpscale.privacy import bookkeeping
from dpscale.privacy.ghost import PER_LAYER, LayerName, layer_shape
from dpscale.privacy.layer_bounds import Strategy
from dpscale.privacy.rounding import ClipPrecision
from dpscale.privacy.tuning import cost as path_cost
from dpscale.privacy.tuning.device import DeviceTuning

PyTree = Any
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Measured:
    """The chosen path and precision of one layer, every timed candidate's seconds (``inf``:
    failed), and the candidates not timed and why (``path_cost.plan``)."""

    strategy: Strategy
    precision: ClipPrecision
    seconds: tuple[tuple[str, float], ...]  # ("ghost/tf32", 0.00041), ...
    left_out: tuple[tuple[str, str], ...] = ()  # ("ghost/highest", "pruned: est. 13.6x explicit/tf32"), ...
    how: str = "measured"  # or "estimated": the seconds are the device's cost model's

    def summary(self) -> str:
        """``measured: ghost/tf32 0.41 ms (explicit/highest 1.20 ms, ...); streamed/highest pruned:
        ...``, the winner first."""
        ranked = sorted(self.seconds, key=lambda item: item[1])
        shown = [
            f"{name} {seconds * 1e3:.2f} ms" if math.isfinite(seconds) else f"{name} failed" for name, seconds in ranked
        ]
        said = f"{self.how}: {shown[0]}" + (f" ({', '.join(shown[1:])})" if len(shown) > 1 else "")
        return "; ".join([said, *(f"{name} {why}" for name, why in self.left_out)])


candidate_name = path_cost.name


def _random_like(tree: PyTree, rng: np.random.Generator) -> PyTree:
    """Device arrays of the shapes and dtypes of ``tree``, normal with a small scale (values do not
    change the time; a scale keeps the WS kernels' variance away from zero)."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray((0.1 * rng.standard_normal(a.shape)).astype(a.dtype)), tree)


def _time(fn: Callable[..., Any], args: tuple, repeats: int) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))  # first call: transfers, allocation
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _layer_fn(module: Any, strategy: Strategy, precision: ClipPrecision, chunk_bytes: int) -> Callable[..., Any]:
    rule = PER_LAYER[type(module)].bounds

    def run(own: PyTree, x: jax.Array, g: jax.Array, weights: jax.Array, finite: jax.Array) -> Any:
        square, summer = rule(module, own, x, g, strategy, precision, chunk_bytes=chunk_bytes)
        return square, summer(weights, finite)

    return run


def timings_file() -> str | None:
    """Where timings are kept: ``$DPSCALE_CLIP_TIMINGS`` (empty: nowhere), else
    ``$XDG_CACHE_HOME/dpscale/clip_timings.json`` (``~/.cache`` by default)."""
    named = os.environ.get("DPSCALE_CLIP_TIMINGS")
    if named is not None:
        return named or None
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "dpscale", "clip_timings.json")


def _read_timings(path: str | None) -> dict[str, float]:
    """The kept timings, where the file is this user's own and nobody else may write it: a timing
    another user could plant would move layers onto other paths (each of them proven, so at worst a
    slower step; still, nobody else's file is read). Else none, with a warning."""
    if path is None:
        return {}
    try:
        st = os.lstat(path)
    except OSError:  # none yet: time them
        return {}
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        _log.warning(
            "clip path timings in %s ignored: not a regular file of this user that only its owner may write "
            "(mode %o); the candidates are timed again",
            path,
            stat.S_IMODE(st.st_mode),
        )
        return {}
    try:
        with open(path) as handle:
            found = json.load(handle)
        kept = {str(k): float(v) for k, v in found.items()} if isinstance(found, dict) else {}
    except (OSError, ValueError, TypeError, AttributeError):  # unreadable or corrupt: time again
        return {}
    return {k: v for k, v in kept.items() if math.isfinite(v) and v > 0}


def _write_timings(path: str | None, timings: dict[str, float]) -> None:
    """The timings, owner-only (0600, in a folder made 0700 if it is new)."""
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        write_json_atomic(path, timings, private=True)
    except OSError as error:  # a read-only home: time again next time
        _log.info("clip path timings not kept (%s)", error)


def _kept_name(device: Any, key: tuple, strategy: str, precision: ClipPrecision, chunk_bytes: int) -> str:
    """A timing's name in the kept file: the device, JAX, the layer and its shapes, the candidate."""
    fields = (device.platform, device.device_kind, jax.__version__, *key, candidate_name(strategy, precision))
    return "|".join(map(str, (*fields, chunk_bytes)))


@dataclasses.dataclass(frozen=True)
class ShapeGroup:
    """Layer calls of one module and shapes (``indices`` into the calls), timed once."""

    indices: tuple[int, ...]
    shape: path_cost.LayerShape
    candidates: path_cost.CandidatePlan
    key: tuple


def candidate_groups(
    loss_fn: Callable[..., jax.Array],
    calls: Sequence[bookkeeping.LayerCall],
    timed: Sequence[int],
    params: PyTree,
    model_state: PyTree,
    batch: PyTree,
    tuning: DeviceTuning,
    *,
    budget: int,
) -> tuple[list, list, list[ShapeGroup]]:
    """(each call's input and output-gradient shapes, the distinct layer shapes of ``timed`` with the
    candidates worth timing there): from shapes alone, nothing compiled."""

    def shapes(p: PyTree, s: PyTree, b: PyTree) -> tuple[list, list]:
        tape = bookkeeping.record_layers(loss_fn, tuple(calls), p, s, b)
        return tape.inputs, tape.out_grads

    inputs, out_grads = jax.eval_shape(shapes, params, model_state, batch)
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for index in timed:
        own = bookkeeping.layer_params(calls[index], params)
        key = (
            repr(calls[index].module),
            inputs[index].shape,
            out_grads[index].shape,
            tuple((name, leaf.shape) for name, leaf in sorted(own.items())),
        )
        groups[key].append(index)
    found = []
    for key, indices in groups.items():
        kernel = bookkeeping.layer_params(calls[indices[0]], params)["kernel"]
        shape = layer_shape(calls[indices[0]], kernel, out_grads[indices[0]].shape[0])
        plan = path_cost.plan(
            tuning.candidates, shape, budget=budget, cost=tuning.cost, prune_factor=tuning.prune_factor
        )
        found.append(ShapeGroup(tuple(indices), shape, plan, key))
    return inputs, out_grads, found


def estimate_paths(
    loss_fn: Callable[..., jax.Array],
    calls: Sequence[bookkeeping.LayerCall],
    chosen_calls: Sequence[int],
    params: PyTree,
    model_state: PyTree,
    batch: PyTree,
    tuning: DeviceTuning,
    *,
    budget: int,
) -> dict[LayerName, Measured]:
    """The cheapest candidate of each call in ``chosen_calls`` by the device's cost model
    (``tuning.cost``), among those that fit ``budget``: as ``measure_paths`` chooses, from shapes
    alone, with nothing compiled or run."""
    _, _, groups = candidate_groups(loss_fn, calls, chosen_calls, params, model_state, batch, tuning, budget=budget)
    chosen = {}
    for group in groups:
        if not group.candidates.timed:
            continue  # no candidate fits: the shape rule decides, within the memory guard
        best = min(group.candidates.timed, key=lambda c: c.seconds)
        estimated = Measured(
            best.strategy,
            best.precision,
            tuple((candidate_name(c.strategy, c.precision), c.seconds) for c in group.candidates.timed),
            group.candidates.left_out,
            how="estimated",
        )
        for index in group.indices:
            chosen[calls[index].path] = estimated
    return chosen


def measure_paths(
    loss_fn: Callable[..., jax.Array],
    calls: Sequence[bookkeeping.LayerCall],
    timed: Sequence[int],
    params: PyTree,
    model_state: PyTree,
    batch: PyTree,
    tuning: DeviceTuning,
    *,
    budget: int,
    repeats: int = 5,
) -> dict[LayerName, Measured]:
    """The fastest candidate of each call in ``timed`` (indices into ``calls``, WS convolutions and
    plain dense layers), for micro-batches shaped like ``batch`` (leaves ``[b, K, ...]``; arrays or
    ``ShapeDtypeStruct``). Calls with the same module and shapes are timed once; ``budget``: the
    bytes one layer's per-example work may take at once (``tuning.device.memory_budget``)."""
    inputs, out_grads, groups = candidate_groups(
        loss_fn, calls, timed, params, model_state, batch, tuning, budget=budget
    )
    rng = np.random.default_rng(0)
    start, chosen, timed_now = time.perf_counter(), {}, 0
    device = jax.devices()[0]
    cache = timings_file()
    kept = _read_timings(cache)
    for group in groups:
        call, args = calls[group.indices[0]], None
        seconds = []
        for candidate in group.candidates.timed:
            strategy, precision = candidate.strategy, candidate.precision
            chunk_bytes = path_cost.chunk_bytes(strategy, group.shape, candidate.chunk, tuning.chunk_bytes)
            name = _kept_name(device, group.key, strategy, precision, chunk_bytes)
            if name in kept:
                seconds.append((strategy, precision, kept[name]))
                continue
            timed_now += 1
            if args is None:  # random inputs of the micro-batch's shapes, made once a layer shape
                own = _random_like(bookkeeping.layer_params(call, params), rng)
                x, g = _random_like(inputs[group.indices[0]], rng), _random_like(out_grads[group.indices[0]], rng)
                args = (own, x, g, jnp.full((x.shape[0],), 0.5, jnp.float32), jnp.ones((x.shape[0],), bool))
            try:
                taken = _time(_layer_fn(call.module, strategy, precision, chunk_bytes), args, repeats)
            except Exception as error:  # noqa: BLE001  out of memory, say: never chosen, and said
                _log.info(
                    "clip path %s of %s failed: %s",
                    candidate_name(strategy, precision),
                    "/".join(call.path),
                    (str(error).splitlines() or [""])[0][:200],
                )
                taken = math.inf
            seconds.append((strategy, precision, taken))
            if math.isfinite(taken):  # a failure (memory taken by others, say) is tried again next time
                kept[name] = taken
        for left_out, why in group.candidates.left_out:
            _log.info("clip path %s of %s not timed: %s", left_out, "/".join(call.path), why)
        if not seconds:
            continue  # no candidate fits: the shape rule decides, within the memory guard
        strategy, precision, best = min(seconds, key=lambda item: item[2])
        if not math.isfinite(best):
            continue  # every candidate failed: the shape rule decides
        measured = Measured(
            strategy,
            precision,
            tuple((candidate_name(s, p), t) for s, p, t in seconds),
            group.candidates.left_out,
        )
        for index in group.indices:
            chosen[calls[index].path] = measured
    if timed_now:
        _write_timings(cache, kept)
    _log.info(
        "clip paths: %d candidates of %d layer shapes on %s, %d left out (pruned or too large), "
        "%d timed now (%.1f s), the rest from %s",
        len(groups) * len(tuning.candidates),
        len(groups),
        device.device_kind,
        sum(len(group.candidates.left_out) for group in groups),
        timed_now,
        time.perf_counter() - start,
        cache,
    )
    return chosen
