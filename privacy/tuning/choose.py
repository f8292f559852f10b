"""Each layer's clipping path, precision and chunk: the shape rule, the device's cost model or its
timings, within a memory budget.

Why here, apart from the clipped sum: a choice of path is a speed (and memory) choice only. Every
path of every layer kind clips with a proven bound (``privacy.ghost``, ``privacy.layer_bounds``),
so this package may be wrong, stale or fed a planted timings file and the guarantee holds: what it
returns is a ``ghost.LayerChoice`` per layer, which the clipped sum checks against the paths proven
for that kind of layer (``ghost.PROVEN_PATHS``) before it uses it. Nothing in the guarantee imports
this package (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.layers import WSConv, as_pair
from dpscale.privacy import bookkeeping
from dpscale.privacy.ghost import LayerChoice, LayerName, PathChooser, booked_layers, layer_shape
from dpscale.privacy.layer_bounds import Strategy
from dpscale.privacy.rounding import ClipPrecision
from dpscale.privacy.tuning import cost
from dpscale.privacy.tuning.device import ALL_STRATEGIES, DeviceTuning, memory_budget, tuning_for
from dpscale.privacy.tuning.timing import Measured, estimate_paths, measure_paths

PyTree = Any
_log = logging.getLogger(__name__)

# Ghost when P^2 (d + p) < GHOST_RATIO * d * p (P positions, fan-in d, fan-out p per example): what
# ghost's Gram matrices cost against explicit's held product, measured per layer on a 2-core CPU
# (benchmarks/results/dp_step_cost.md).
GHOST_RATIO = 300


def choose_strategy(*, positions: int, fan_in: int, fan_out: int, inputs: int) -> Strategy:
    """Ghost when its Gram matrices cost less than holding the per-example gradient, else explicit.

    Explicit forms ``U_i`` once (P*d*p multiply-adds, d*p floats written and read back for the norm
    and the sum); ghost forms two P x P Gram matrices (``P^2 (d + p)``) for the norm and ``U_i`` once
    more, a chunk at a time, for the sum. Explicit holds ``U_i`` where that is no more than what the
    tape already records for the layer, its input (``inputs`` floats an example) and output gradient
    (P*p): held gradients at most double a layer's recorded memory. Else it is streamed: ``U_i``
    formed twice, a chunk at a time (benchmarks/results/dp_step_cost.md has what each costs).
    """
    cost_ghost = positions * positions * (fan_in + fan_out)
    if cost_ghost < GHOST_RATIO * fan_in * fan_out:
        return "ghost"
    return "explicit" if fan_in * fan_out <= inputs + positions * fan_out else "streamed"


def input_floats(module: nn.Module, kernel: jax.Array, positions: int) -> int:
    """Floats of one example's recorded input to a WS convolution or dense layer with ``positions``
    output positions: a convolution's output position reads ``strides`` input positions of
    ``kernel.shape[-2] * groups`` channels (padding aside: an estimate for the shape rule's memory
    comparison, nothing else)."""
    if isinstance(module, WSConv):
        channels = kernel.shape[-2] * module.feature_group_count
        return positions * math.prod(as_pair(module.strides)) * channels
    return positions * kernel.shape[0]


def choose_paths(
    calls: tuple[bookkeeping.LayerCall, ...],
    params_of: Callable[[bookkeeping.LayerCall], PyTree],
    *,
    tuning: DeviceTuning,
    forced: Mapping[LayerName, Strategy] | None = None,
    measured: Mapping[LayerName, Measured] | None = None,
    examples: int = 0,
    budget: int | None = None,
) -> dict[LayerName, LayerChoice]:
    """Each plain layer call's path and precision: forced (``forced``), measured on the device or
    estimated by its cost model (``measured``), or by the shape rule. With ``budget`` (bytes) and
    ``examples`` (one device's micro-batch), the memory guard chunks a layer whose work does not fit at
    once (``cost.fit``). Book-keeping layers (shared, normalisation, non-plain) are the clipped sum's to
    decide, not this function's."""
    forced, measured = dict(forced or {}), measured or {}
    skip = booked_layers(calls)
    choices: dict[LayerName, LayerChoice] = {}
    for call in calls:
        if call.path in skip:
            continue
        kernel = params_of(call)["kernel"]
        shape = layer_shape(call, kernel, examples)
        if call.path in forced:
            strategy, precision, reason = forced.pop(call.path), tuning.precision, "forced"
        elif call.path in measured:
            found = measured[call.path]
            strategy, precision, reason = found.strategy, found.precision, found.summary()
        else:
            inputs = input_floats(call.module, kernel, shape.positions)
            rule = choose_strategy(positions=shape.positions, fan_in=shape.fan_in, fan_out=shape.fan_out, inputs=inputs)
            strategy, precision, reason = rule, tuning.precision, "rule"
        if strategy not in ALL_STRATEGIES:
            raise InvalidConfigError(f"strategy must be one of {ALL_STRATEGIES}, got {strategy!r}")
        chunk, chunk_bytes = 0, tuning.chunk_bytes
        if budget is not None and examples:
            strategy, chunk, reason = _within_memory(strategy, shape, budget, reason, where="/".join(call.path))
            if chunk:
                chunk_bytes = cost.chunk_bytes(strategy, shape, chunk, tuning.chunk_bytes)
        choices[call.path] = LayerChoice(
            call.path,
            type(call.module).__name__,
            strategy,
            precision=precision,
            reason=reason,
            chunk=chunk,
            chunk_bytes=chunk_bytes,
            positions=shape.positions,
            fan_in=shape.fan_in,
            fan_out=shape.fan_out,
        )
    if forced:
        raise InvalidConfigError(f"no ghost or explicit layer at {sorted('/'.join(p) for p in forced)}")
    return choices


def _within_memory(
    strategy: Strategy, shape: cost.LayerShape, budget: int, reason: str, *, where: str
) -> tuple[Strategy, int, str]:
    """(path, examples a chunk or 0, reason) within the memory budget: chunked where the whole
    micro-batch does not fit; a path chosen by the rule that does not fit an example at a time gives
    way to one that does (a forced one stays, and is said)."""
    chunk = cost.fit(strategy, shape, budget)
    if chunk is None:
        fitting = [s for s in ("streamed", "ghost") if cost.fit(s, shape, budget) is not None]
        if reason == "forced" or not fitting:
            _log.warning("clip path %s of %s does not fit the memory budget (%d bytes): kept", strategy, where, budget)
            return strategy, 0, reason
        reason = f"{reason}; {strategy} does not fit the memory budget"
        strategy, chunk = fitting[0], cost.fit(fitting[0], shape, budget)
    said = cost.describe_chunk(strategy, shape, chunk, budget)
    return strategy, (chunk if said else 0), (f"{reason}; {said}" if said else reason)


def timed_calls(calls: tuple[bookkeeping.LayerCall, ...], forced: Mapping[LayerName, Strategy]) -> list[int]:
    """The calls whose path is worth timing: those with a path to choose that is not forced."""
    skip = booked_layers(calls) | set(forced)
    return [i for i, call in enumerate(calls) if call.path not in skip]


def chooser(
    loss_fn: Callable[..., jax.Array],
    *,
    example: tuple[PyTree, PyTree, PyTree] | None = None,
    strategies: Mapping[LayerName, Strategy] | None = None,
    precision: ClipPrecision | None = None,
    tuning: DeviceTuning | None = None,
) -> PathChooser:
    """The device's choice of every layer's path (``tuning``: the backend's settings by default), as
    ``ghost.make_ghost_clipped_sum_fn(..., choose=...)`` takes it. Where the device measures or
    estimates (GPUs, TPUs), the candidates are timed or estimated now, at ``example``'s micro-batch
    (``(params, model_state, batch)``, arrays or ``ShapeDtypeStruct``); ``strategies`` forces a layer's
    path, ``precision`` every contraction's."""
    tuning = tuning or tuning_for()
    if precision is not None:
        tuning = tuning.with_precision(precision)
    forced = dict(strategies or {})
    budget = memory_budget(tuning)
    measured: dict[LayerName, Measured] = {}
    if example is not None and tuning.choose != "rule":
        calls = bookkeeping.plan_batch_layers(loss_fn, *example)
        choose = measure_paths if tuning.choose == "measure" else estimate_paths
        measured = choose(loss_fn, calls, timed_calls(calls, forced), *example, tuning, budget=budget)

    def choose_now(calls: tuple[bookkeeping.LayerCall, ...], params_of: Callable, examples: int) -> dict:
        return choose_paths(
            calls, params_of, tuning=tuning, forced=forced, measured=measured, examples=examples, budget=budget
        )

    return PathChooser(choose_now, precision=tuning.precision)


def describe(choices: tuple[LayerChoice, ...]) -> str:
    """One line for the log: how many layers take each path and precision, how chosen, which are ghost."""
    counts = collections.Counter(cost.name(c.strategy, c.precision) for c in choices)
    how = collections.Counter(  # "measured", "estimated", "rule" or "forced", whatever the guard added
        c.reason.split(";")[0].split(":")[0] for c in choices if c.strategy != "book-keeping"
    )
    ghost = ["/".join(c.layer) for c in choices if c.strategy == "ghost"]
    return (
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + (f"; chosen by {', '.join(f'{k} ({n})' for k, n in sorted(how.items()))}" if how else "")
        + (f" (ghost: {', '.join(ghost)})" if ghost else "")
    )


def describe_layers(choices: tuple[LayerChoice, ...]) -> list[str]:
    """One log line per layer: its shape, path, precision and why."""
    return [
        f"{'/'.join(c.layer)} ({c.kind}, {c.positions} positions, {c.fan_in} -> {c.fan_out}): "
        f"{cost.name(c.strategy, c.precision)}, {c.reason}"
        for c in choices
        if c.strategy != "book-keeping"
    ]
