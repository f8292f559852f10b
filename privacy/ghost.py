"""The clipped sum from per-layer norms: ghost norms where they are cheaper, book-keeping elsewhere.

Why: book-keeping (``privacy.bookkeeping``) forms every example's gradient of every layer,
``U_i = A_i^T G_i`` for a layer with input patches ``A_i`` (P positions x fan-in d) and output
gradient ``G_i`` (P x fan-out p). Clipping needs only each example's *norm* and then the
weighted sum ``sum_i w_i U_i``. Per layer, two ways to the norm (mixed ghost clipping, Bu et al.
2023; ghost norms, Li et al. 2021):

* explicit: form ``U_i`` (P*d*p multiply-adds and d*p floats per example), keep it, and the
  weighted sum is one contraction over examples;
* streamed: form ``U_i`` a chunk of examples at a time for its norm only, and take the weighted
  sum as ghost does: nothing of the parameter's size is held per example;
* ghost: ``||U_i||^2 = <A_i A_i^T, G_i G_i^T>`` (P^2 (d + p) per example, nothing of the
  parameter's size), and the weighted sum is the layer's own weight gradient over the batch
  (one VJP) with each example's output gradient scaled by ``w_i``.

Ghost wins where positions are few and the kernel large (late, low-resolution convolutions,
dense heads); explicit wins at high resolution, and is streamed where holding ``U_i`` would
take more memory than the input and output gradient the layer already records. ``choose_strategy``
decides from the shapes at trace time. With augmentation multiplicity the K views' positions
are stacked (P = K*T) and the 1/K of the view average is already inside ``G``: the norm is
that of the averaged gradient, exactly what the vmap path clips.

Weight standardisation: a WS convolution uses ``w_o = s_o (k_o - mean(k_o))`` per output
channel o, ``s_o = (var(k_o) + eps)^(-1/2)``, the same map for every example. Its Jacobian is
``J_o = s_o (C - w_o w_o^T / d)`` with the centring projection ``C = I - 11^T/d`` (symmetric),
so the parameter's gradient is ``J^T u`` for ``u`` the gradient w.r.t. the standardised kernel.
Its singular values are ``s_o`` and ``s_o (1 - a_o)``, ``a_o = ||w_o||^2/d = var/(var + eps)``:
a gradient along the kernel loses almost all its size in the fold, and a float32 fold or norm
formed from ``u`` loses as many digits. So:

* explicit folds each example's gradient before the sum (``J^T (C u_i)``, per example), and the
  sum adds exactly the vectors whose norms clip them;
* streamed and ghost sum ``u`` over the batch (one backward contraction) and fold the sum; their
  norms carry proven bounds of the fold's and the contraction's rounding, and the ghost norm
  bounds ``||J_o^T c|| <= s_o max(1, a_o) ||c||`` instead of subtracting the part along ``w_o``.

Norms are proven upper bounds of what each example adds, at the precision the per-example
contractions run at (``precision``: ``privacy.rounding``); the per-layer pieces are in
``privacy.layer_bounds``, the argument in docs/privacy.md ("Sensitivity under floating point").

Layers used by several calls (shared parameters), normalisation layers, plain and depthwise
convolutions (EfficientNet-Lite's) and dense layers with their own product (a custom
``dot_general``) use book-keeping's per-example gradients (``privacy.layer_rules``), held. Coverage
is proven by ``bookkeeping.plan_layers`` exactly as for book-keeping (a layer that computes or
outputs other than float32 is refused, and the model goes to ``vmap``); weights, the NaN guard
and the counts are ``privacy.clipping``'s, and the result has sensitivity 1. Tested against
``vmap(grad)`` (tests/privacy/test_ghost.py) and on adversarial inputs
(tests/privacy/test_sensitivity.py, tests/privacy/test_layer_bounds.py).

Speed: the device decides (``privacy.device_tuning``). On a CPU per-example work runs over
chunks of examples (``lax.map``) sized so one chunk's patches stay in cache (forming a whole
micro-batch's patches at once is memory-bound and cost more than the contraction itself), and the
shape rule ``choose_strategy`` picks each path. On a GPU or TPU a micro-batch's per-example work
runs at once, and each layer's path and precision are chosen, when the clipped sum is built with an
example of the micro-batch, by the device's cost model (NVIDIA GPUs) or by timing the candidates on
the device (``privacy.path_timing``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.layers import WSConv, as_pair
from dpscale.privacy import bookkeeping, layer_bounds, path_cost
from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn, LossFn, clipped_sum_from_norms, hold
from dpscale.privacy.device_tuning import ALL_STRATEGIES, DeviceTuning, memory_budget, tuning_for
from dpscale.privacy.layer_bounds import Strategy
from dpscale.privacy.path_timing import Measured, candidate_name, estimate_paths, measure_paths
from dpscale.privacy.rounding import ClipPrecision, norm_bound

PyTree = Any
Path = tuple[str, ...]
_log = logging.getLogger(__name__)


# Ghost when P^2 (d + p) < GHOST_RATIO * d * p (P positions, fan-in d, fan-out p per example).
# Measured per layer on a 2-core CPU: ghost won at ratios 18-78 (late convolutions of cnn-small and
# WRN-16-4), tied at 284, lost at 569 and above; the whole step's effect is in
# benchmarks/results/dp_step_cost.md.
GHOST_RATIO = 300


def choose_strategy(*, positions: int, fan_in: int, fan_out: int, inputs: int) -> Strategy:
    """Ghost when its Gram matrices cost less than holding the per-example gradient, else explicit.

    Both paths contract P*d*p per example once (explicit: to form ``U_i``; ghost: in the
    batch's weight gradient). On top, ghost forms two P x P Gram matrices, ``P^2 (d + p)``
    multiply-adds, while explicit writes ``d * p`` floats per example and reads them back for
    the norm and the sum: memory traffic, which costs ~GHOST_RATIO multiply-adds a float here.
    Explicit holds ``U_i`` (d*p floats per example) where that is no more than what the tape
    already records for the layer, its input (``inputs`` floats an example) and output gradient
    (P*p): held gradients at most double a layer's recorded memory. Else it is streamed: one more
    contraction, the batch's weight gradient, which on a CPU costs more than holding (WRN-16-4,
    micro-batch 52, a layer alone: (256, 576 -> 128) 64-72 ms streamed against 23-54 ms held at
    K = 1; (1024, 1152 -> 128) 671 against 151 ms at K = 4; benchmarks/results/dp_step_cost.md).
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


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """How one layer call is clipped, for the log and the tests."""

    path: Path
    kind: str  # "WSConv", "Dense", ...
    strategy: str  # "ghost", "explicit", "grouped", "streamed", or "book-keeping" (shared or normalisation layers)
    positions: int = 0
    fan_in: int = 0
    fan_out: int = 0
    precision: ClipPrecision = ClipPrecision()
    reason: str = "rule"  # "rule", "forced", or the times it was chosen from ("measured: ...", "estimated: ...")
    chunk: int = 0  # examples a chunk where the memory guard split the micro-batch (0: it did not)


def _plain(module: nn.Module) -> bool:
    """A WS convolution, or a dense layer whose product is the plain ``x @ kernel`` (no custom
    ``dot_general`` or dtype promotion): what the ghost, explicit and streamed rules compute."""
    if type(module) is WSConv:
        return True
    return (
        type(module) is nn.Dense
        and module.dot_general is None
        and module.dot_general_cls is None
        and module.promote_dtype is nn.dtypes.promote_dtype
    )


def _shape_of(call: bookkeeping.LayerCall, kernel: jax.Array) -> tuple[int, int, int]:
    """(positions per example, fan-in, fan-out) of a WS convolution or dense call."""
    positions = math.prod(call.out.shape[:-1])  # one example's output: [K, ..., p]
    return positions, math.prod(kernel.shape[:-1]), kernel.shape[-1]


def plan_strategies(
    calls: tuple[bookkeeping.LayerCall, ...],
    params_of: Callable[[bookkeeping.LayerCall], PyTree],
    overrides: Mapping[Path, Strategy] | None = None,
    *,
    precision: ClipPrecision = ClipPrecision(),
    measured: Mapping[Path, Measured] | None = None,
    examples: int = 0,
    budget: int | None = None,
) -> tuple[LayerChoice, ...]:
    """Each layer call's path and precision: book-keeping for shared or normalisation layers; else
    forced (``overrides``), measured on the device or estimated by its cost model (``measured``), or
    by the shape rule. With ``budget`` (bytes) and ``examples`` (one device's micro-batch), the memory
    guard chunks a layer whose work does not fit at once (``path_cost.fit``)."""
    overrides, measured = dict(overrides or {}), measured or {}
    booked = _booked_paths(calls)
    choices = []
    for call in calls:
        kind = type(call.module).__name__
        if call.path in booked:
            choices.append(
                LayerChoice(
                    call.path,
                    kind,
                    "book-keeping",
                    precision=precision,
                    reason="a normalisation, shared or non-plain layer",
                )
            )
            continue
        kernel = params_of(call)["kernel"]
        positions, fan_in, fan_out = _shape_of(call, kernel)
        shape = {"positions": positions, "fan_in": fan_in, "fan_out": fan_out}
        if call.path in overrides:
            strategy, chosen, reason = overrides.pop(call.path), precision, "forced"
        elif call.path in measured:
            found = measured[call.path]
            strategy, chosen, reason = found.strategy, found.precision, found.summary()
        else:
            inputs = input_floats(call.module, kernel, positions)
            strategy, chosen, reason = choose_strategy(**shape, inputs=inputs), precision, "rule"
        if strategy not in ALL_STRATEGIES:
            raise InvalidConfigError(f"strategy must be one of {ALL_STRATEGIES}, got {strategy!r}")
        chunk = 0
        if budget is not None and examples:
            layer = path_cost.LayerShape(examples, **shape, conv=kind == "WSConv")
            strategy, chunk, reason = _guarded(strategy, layer, budget, reason, where="/".join(call.path))
        choices.append(LayerChoice(call.path, kind, strategy, precision=chosen, reason=reason, chunk=chunk, **shape))
    if overrides:
        raise InvalidConfigError(f"no ghost or explicit layer at {sorted('/'.join(p) for p in overrides)}")
    return tuple(choices)


def _guarded(
    strategy: Strategy, shape: path_cost.LayerShape, budget: int, reason: str, *, where: str
) -> tuple[Strategy, int, str]:
    """(path, examples a chunk or 0, reason) within the memory budget: chunked where the whole
    micro-batch does not fit; a path chosen by the rule that does not fit an example at a time gives
    way to one that does (a forced one stays, and is said)."""
    chunk = path_cost.fit(strategy, shape, budget)
    if chunk is None:
        fitting = [s for s in ("streamed", "ghost") if path_cost.fit(s, shape, budget) is not None]
        if reason == "forced" or not fitting:
            _log.warning("clip path %s of %s does not fit the memory budget (%d bytes): kept", strategy, where, budget)
            return strategy, 0, reason
        reason = f"{reason}; {strategy} does not fit the memory budget"
        strategy, chunk = fitting[0], path_cost.fit(fitting[0], shape, budget)
    said = path_cost.describe_chunk(strategy, shape, chunk, budget)
    return strategy, (chunk if said else 0), (f"{reason}; {said}" if said else reason)


def _booked_paths(calls: tuple[bookkeeping.LayerCall, ...]) -> set[Path]:
    """The layers book-keeping clips: shared ones (called more than once) and those not plain."""
    uses = collections.Counter(call.path for call in calls)
    return {call.path for call in calls if uses[call.path] > 1 or not _plain(call.module)}


def timed_calls(calls: tuple[bookkeeping.LayerCall, ...], forced: Mapping[Path, Strategy]) -> list[int]:
    """The calls whose path is worth timing: those with a path to choose that is not forced."""
    skip = _booked_paths(calls) | set(forced)
    return [i for i, call in enumerate(calls) if call.path not in skip]


def describe(choices: tuple[LayerChoice, ...]) -> str:
    """One line for the log: how many layers take each path and precision, how chosen, which are ghost."""
    counts = collections.Counter(candidate_name(c.strategy, c.precision) for c in choices)
    how = collections.Counter(  # "measured", "estimated", "rule" or "forced", whatever the guard added
        c.reason.split(";")[0].split(":")[0] for c in choices if c.strategy != "book-keeping"
    )
    ghost = ["/".join(c.path) for c in choices if c.strategy == "ghost"]
    return (
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + (f"; chosen by {', '.join(f'{k} ({n})' for k, n in sorted(how.items()))}" if how else "")
        + (f" (ghost: {', '.join(ghost)})" if ghost else "")
    )


def describe_layers(choices: tuple[LayerChoice, ...]) -> list[str]:
    """One log line per layer: its shape, path, precision and why."""
    return [
        f"{'/'.join(c.path)} ({c.kind}, {c.positions} positions, {c.fan_in} -> {c.fan_out}): "
        f"{candidate_name(c.strategy, c.precision)}, {c.reason}"
        for c in choices
        if c.strategy != "book-keeping"
    ]


@dataclasses.dataclass(frozen=True)
class _Planned:
    """What the clipped sum and the norm bounds share: each layer's path, and the pass that gives
    every example's norm bound and the weighted sum over examples."""

    plan: Callable[[PyTree, PyTree, PyTree], tuple[tuple, tuple[LayerChoice, ...]]]
    bounds: Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, Callable[..., PyTree], jax.Array]]


def _planned(
    loss_fn: LossFn,
    example: tuple[PyTree, PyTree, PyTree] | None,
    strategies: Mapping[Path, Strategy] | None,
    precision: ClipPrecision | None,
    tuning: DeviceTuning | None,
) -> _Planned:
    tuning = tuning or tuning_for()
    if precision is not None:
        tuning = tuning.with_precision(precision)
    forced = dict(strategies or {})

    def calls_of(params: PyTree, model_state: PyTree, batch: PyTree) -> tuple[bookkeeping.LayerCall, ...]:
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
        return bookkeeping.plan_layers(loss_fn, params, model_state, one)

    measured: dict[Path, Measured] = {}
    budget = memory_budget(tuning)
    if example is not None and tuning.choose != "rule":
        calls = calls_of(*example)
        choose = measure_paths if tuning.choose == "measure" else estimate_paths
        measured = choose(loss_fn, calls, timed_calls(calls, forced), *example, tuning, budget=budget)

    def plan(params: PyTree, model_state: PyTree, batch: PyTree) -> tuple[tuple, tuple[LayerChoice, ...]]:
        calls = calls_of(params, model_state, batch)
        return calls, plan_strategies(
            calls,
            lambda call: bookkeeping.layer_params(call, params),
            forced,
            precision=tuning.precision,
            measured=measured,
            examples=jax.tree_util.tree_leaves(batch)[0].shape[0],
            budget=budget,
        )

    def bounds(
        params: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[jax.Array, Callable[..., PyTree], jax.Array]:
        """(each example's norm bound, ``weighted(weights, finite)``, each example's loss)."""
        calls, choices = plan(params, model_state, batch)
        tape = bookkeeping.record_layers(loss_fn, calls, params, model_state, batch)
        by_path: dict[Path, list[int]] = collections.defaultdict(list)
        for index, call in enumerate(calls):
            by_path[call.path].append(index)
        squares, summers, booked = [], [], {}
        for path, indices in by_path.items():
            first, choice = calls[indices[0]], choices[indices[0]]
            own = bookkeeping.layer_params(first, params)
            x, g = tape.inputs[indices[0]], tape.out_grads[indices[0]]
            if choice.strategy == "book-keeping":
                booked[path] = layer_bounds.book_keeping_gradients(
                    [calls[i] for i in indices],
                    params,
                    [tape.inputs[i] for i in indices],
                    [tape.out_grads[i] for i in indices],
                    [tape.states[i] for i in indices],
                    choice.precision,
                )
                continue
            rule = layer_bounds.wsconv if isinstance(first.module, WSConv) else layer_bounds.dense
            chunk_bytes = tuning.chunk_bytes
            if choice.chunk:  # the memory guard's chunks
                shape = path_cost.LayerShape(x.shape[0], choice.positions, choice.fan_in, choice.fan_out)
                chunk_bytes = path_cost.chunk_bytes(choice.strategy, shape, choice.chunk, chunk_bytes)
            part, summer = rule(first.module, own, x, g, choice.strategy, choice.precision, chunk_bytes=chunk_bytes)
            squares.append(part)
            summers.append((path, summer))
        for path, per_example in hold(booked).items():  # one loop holds them all (clipping.hold)
            if per_example:  # a normalisation may have neither scale nor bias
                squares.append(layer_bounds.held_square_bound(per_example))
                summers.append((path, functools.partial(layer_bounds.held_sum, per_example)))

        def weighted(weights: jax.Array, finite: jax.Array) -> PyTree:
            grads = {path + (name,): grad for path, summer in summers for name, grad in summer(weights, finite).items()}
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            return jax.tree_util.tree_unflatten(treedef, [grads[bookkeeping.key_path(p)] for p, _ in flat])

        return norm_bound(squares), weighted, tape.losses

    return _Planned(plan, bounds)


def make_ghost_clipped_sum_fn(
    loss_fn: LossFn,
    *,
    clip_norm: float,
    example: tuple[PyTree, PyTree, PyTree] | None = None,
    strategies: Mapping[Path, Strategy] | None = None,
    precision: ClipPrecision | None = None,
    tuning: DeviceTuning | None = None,
) -> ClippedSumFn:
    """Drop-in for ``make_clipped_sum_fn`` on models book-keeping covers (else UnsupportedModelError).

    ``example = (params, model_state, batch)`` (arrays or ``ShapeDtypeStruct``; batch leaves
    ``[b, K, ...]`` with b the micro-batch per device) checks support now, as book-keeping does,
    fills the result's ``layers`` (a ``LayerChoice`` per layer call: how it is clipped and why) and,
    where the device's tuning chooses (``privacy.device_tuning``: GPUs, TPUs), picks each layer's
    path at that micro-batch by the device's cost model or by timing the candidates on the device
    (``privacy.path_timing``). ``strategies`` forces a layer's path (``{("backbone", "conv_0"):
    "ghost"}``), for tests and benchmarks.
    ``precision`` forces the per-example contractions' precision (``privacy.rounding``); ``tuning``
    the device settings (default: the backend's).
    """
    check_clip_norm(clip_norm)
    planned = _planned(loss_fn, example, strategies, precision, tuning)

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        norms, weighted, losses = planned.bounds(params, model_state, batch)
        return clipped_sum_from_norms(norms, mask, clip_norm=clip_norm, weighted=weighted, losses=losses)

    choices = () if example is None else planned.plan(*example)[1]
    return ClippedSumFn(clipped_sum, sensitivity=1.0, layers=choices)


def make_ghost_norm_bounds_fn(
    loss_fn: LossFn,
    *,
    example: tuple[PyTree, PyTree, PyTree] | None = None,
    strategies: Mapping[Path, Strategy] | None = None,
    precision: ClipPrecision | None = None,
    tuning: DeviceTuning | None = None,
) -> Callable[[PyTree, PyTree, PyTree], jax.Array]:
    """``(params, model_state, batch) -> [b]``: each example's norm bound, what the clipped sum of the
    same arguments clips with (for measuring the bounds' margin, ``benchmarks/norm_bounds.py``)."""
    planned = _planned(loss_fn, example, strategies, precision, tuning)
    return lambda params, model_state, batch: planned.bounds(params, model_state, batch)[0]
