"""What a layer's clipping path costs before it runs: its time by the device's cost model, its memory.

Why: timing each candidate path of each layer shape on the device (``privacy.tuning.timing``) costs a
compilation a candidate (minutes for WRN-16-4 on an H200: benchmarks/results/gpu_step_cost.md), and
ghost, which loses by 10x or more wherever a layer has 1,024 positions an example, was among them; and a whole
micro-batch's per-example work at once can need more memory than the device has (ghost's Gram
matrices grow with the square of the positions: 17 GB in WRN-16-4's first stage at K = 4). From the
shapes alone (P positions an example with the K views stacked, fan-in d, fan-out p, b examples):

* ``estimate``: multiply-adds at the contractions' formats and bytes moved, at the device's rates
  (``device_tuning.CostModel``); ``plan`` leaves out a candidate estimated at the tuning's
  ``prune_factor`` times the cheapest or more, keeping at least two;
* ``working_set``: bytes held for the whole micro-batch (explicit's and grouped's per-example gradients, d*p) and
  in flight an example (patches P*d, products d*p, Gram matrices P^2); ``fit`` the most examples a
  chunk that keep one layer's work within the memory budget, or None where one example at a time
  does not fit (the candidate is dropped).

Only speed and memory are at stake: every path clips with a proven bound of the norm, at any chunk.
"""

from __future__ import annotations

import dataclasses

from dpscale.privacy.ghost import LayerShape
from dpscale.privacy.layer_bounds import Strategy, chunk_work
from dpscale.privacy.rounding import ClipPrecision
from dpscale.privacy.tuning.device import CostModel

# Passes over an example's d*p product (formed, centred, folded, squared, summed) and over its P x P
# Gram matrices (two formed, read for the inner product, |Y| and the bound's terms): what the fit to
# the H200's timings took (device_tuning.H200_COST).
PRODUCT_PASSES = 10
GRAM_PASSES = 8
_FLOAT = 4


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A path and precision, the examples a chunk the memory guard allows (``examples``: at
    once), and its estimated seconds a micro-batch (0 without a cost model)."""

    strategy: Strategy
    precision: ClipPrecision
    chunk: int
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class CandidatePlan:
    """Which candidates of a layer shape are timed, and which are not and why (name, reason)."""

    timed: tuple[Candidate, ...]
    left_out: tuple[tuple[str, str], ...]


def name(strategy: str, precision: ClipPrecision) -> str:
    """``ghost/highest``, ``explicit/tf32+highest``: a candidate as logs and clip_paths.json say it."""
    if precision.norms == precision.sums:
        return f"{strategy}/{precision.norms}"
    return f"{strategy}/{precision.norms}+{precision.sums}"


def working_set(strategy: Strategy, shape: LayerShape) -> tuple[int, int]:
    """(bytes held for the whole micro-batch, bytes in flight an example) of one layer's path: the
    larger of its norm's pass and, for streamed and ghost, its sum's (the product formed again)."""
    positions, d, p = shape.positions, shape.fan_in, shape.fan_out
    patches = positions * d if shape.conv else 0
    if strategy == "explicit":  # a dense layer's explicit product is one contraction, not chunked
        return _FLOAT * shape.examples * d * p, _FLOAT * (patches + 2 * d * p) if shape.conv else 0
    if strategy == "grouped":  # explicit without the patches
        return _FLOAT * shape.examples * d * p, _FLOAT * 2 * d * p if shape.conv else 0
    summing = patches + 3 * d * p
    if strategy == "streamed":
        return 0, _FLOAT * summing
    return 0, _FLOAT * max(2 * patches + 3 * positions * positions, summing)


def fit(strategy: Strategy, shape: LayerShape, budget: int) -> int | None:
    """The most examples a chunk (a divisor of the micro-batch, as ``layer_bounds.chunked`` takes)
    whose working set is within ``budget`` bytes; None where not even one example's is."""
    held, per_example = working_set(strategy, shape)
    if held + per_example > budget:
        return None
    most = shape.examples if per_example == 0 else (budget - held) // per_example
    return max(c for c in range(1, min(most, shape.examples) + 1) if shape.examples % c == 0)


def chunk_bytes(strategy: Strategy, shape: LayerShape, chunk: int, default: int) -> int:
    """The ``chunk_bytes`` that runs ``chunk`` examples at a time through ``layer_bounds.chunked``
    (never more than ``default``, the device's setting, runs)."""
    if chunk >= shape.examples:
        return default
    return min(default, chunk * chunk_work(strategy, shape.positions, shape.fan_in, shape.fan_out))


def estimate(strategy: Strategy, precision: ClipPrecision, shape: LayerShape, chunk: int, cost: CostModel) -> float:
    """Seconds of one micro-batch's norm bounds and weighted sum on the path, by ``cost``'s rates.

    Explicit contracts P*d*p an example once, to form the product it holds; streamed twice (for the
    norm, then again for the sum) and ghost once, for the sum, after its two P x P Gram matrices
    (P^2 (d + p) multiply-adds). Each pass over a d*p product moves its bytes. (The constants were
    fitted when streamed and ghost summed by one batch contraction: the same multiply-adds, fewer
    bytes; benchmarks/results/gpu_step_cost.md.)
    """
    positions, d, p = shape.positions, shape.fan_in, shape.fan_out
    norm_rate, sum_rate = cost.rate(precision.norms), cost.rate(precision.sums)
    product = positions * d * p
    patches = positions * d if shape.conv else 0
    if strategy == "explicit":
        seconds = product / norm_rate + _FLOAT * (2 * patches + PRODUCT_PASSES * d * p) / cost.bytes_per_second
    elif strategy == "grouped":  # not fitted to any timing: optimistic, so timing prunes it never
        seconds = product / norm_rate + _FLOAT * (positions * p + PRODUCT_PASSES * d * p) / cost.bytes_per_second
    elif strategy == "streamed":
        seconds = product / norm_rate + product / sum_rate
        seconds += _FLOAT * (3 * patches + 2 * PRODUCT_PASSES * d * p) / cost.bytes_per_second
    else:
        seconds = positions * positions * (d + p) / norm_rate + product / sum_rate
        passes = GRAM_PASSES * positions * positions + PRODUCT_PASSES * d * p
        seconds += _FLOAT * (3 * patches + passes) / cost.bytes_per_second
    chunks = max(1, shape.examples // chunk)
    return cost.launch_seconds * chunks + shape.examples * seconds


def plan(
    candidates: tuple[tuple[Strategy, ClipPrecision], ...],
    shape: LayerShape,
    *,
    budget: int,
    cost: CostModel | None,
    prune_factor: float,
) -> CandidatePlan:
    """The candidates worth timing: those that fit ``budget`` (chunked where the whole micro-batch
    does not), less those ``cost`` estimates at ``prune_factor`` times the cheapest or more; at
    least two are kept where two fit."""
    fitting, left_out = [], []
    for strategy, precision in candidates:
        if strategy == "grouped" and not shape.conv:  # no patches to spare: explicit's one contraction
            left_out.append((name(strategy, precision), "not timed: explicit's contraction on a dense layer"))
            continue
        chunk = fit(strategy, shape, budget)
        if chunk is None:
            held, per_example = working_set(strategy, shape)
            left_out.append(
                (name(strategy, precision), f"dropped: needs {_gb(held + per_example)} at least, budget {_gb(budget)}")
            )
            continue
        seconds = 0.0 if cost is None else estimate(strategy, precision, shape, chunk, cost)
        fitting.append(Candidate(strategy, precision, chunk, seconds))
    if cost is None or not fitting:
        return CandidatePlan(tuple(fitting), tuple(left_out))
    ranked = sorted(fitting, key=lambda c: c.seconds)
    cheapest = ranked[0]
    keep = {id(c) for i, c in enumerate(ranked) if i < 2 or c.seconds < prune_factor * cheapest.seconds}
    for c in ranked:
        if id(c) not in keep:
            ratio = c.seconds / cheapest.seconds
            left_out.append(
                (
                    name(c.strategy, c.precision),
                    f"pruned: est. {ratio:.1f}x {name(cheapest.strategy, cheapest.precision)}",
                )
            )
    return CandidatePlan(tuple(c for c in fitting if id(c) in keep), tuple(left_out))


def describe_chunk(strategy: Strategy, shape: LayerShape, chunk: int, budget: int) -> str:
    """``chunked 4 x 64 examples (51.4 GB at once > budget 26.3 GB)``, or "" where not chunked."""
    if chunk >= shape.examples:
        return ""
    held, per_example = working_set(strategy, shape)
    whole = held + per_example * shape.examples
    return f"chunked {shape.examples // chunk} x {chunk} examples ({_gb(whole)} at once > budget {_gb(budget)})"


def _gb(size: int) -> str:
    return f"{size / 1e9:.3g} GB"
