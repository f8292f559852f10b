"""The clipped sum from per-layer norms: ghost norms where they are cheaper, book-keeping elsewhere.

Why: book-keeping (``privacy.bookkeeping``) forms every example's gradient of every layer,
``U_i = A_i^T G_i`` for a layer with input patches ``A_i`` (P positions x fan-in d) and output
gradient ``G_i`` (P x fan-out p). Clipping needs only each example's *norm* and then the
weighted sum ``sum_i w_i U_i``. Per layer, two ways to the norm (mixed ghost clipping, Bu et al.
2023; ghost norms, Li et al. 2021):

* explicit: form ``U_i`` (P*d*p multiply-adds and d*p floats per example), keep it, and the
  weighted sum is one contraction over examples;
* streamed: form ``U_i`` a chunk of examples at a time for its norm, and again for the weighted
  sum: nothing of the parameter's size is held per example;
* ghost: ``||U_i||^2 = <A_i A_i^T, G_i G_i^T>`` (P^2 (d + p) per example, nothing of the
  parameter's size), and the weighted sum forms ``U_i`` a chunk at a time, as streamed does.

The weighted sum is never the layer's own weight gradient over the batch (one contraction of the
inputs with the weighted output gradients): that contraction rounds by an amount no clip weight
bounds (``privacy.layer_bounds`` says why). Ghost wins where positions are few and the kernel large
(late, low-resolution convolutions, dense heads); explicit wins at high resolution, and is streamed
where holding ``U_i`` would take more memory than the input and output gradient the layer already
records; ``privacy.tuning`` chooses. With augmentation multiplicity the K views' positions
are stacked (P = K*T) and the 1/K of the view average is already inside ``G``: the norm is
that of the averaged gradient, exactly what the vmap path clips.

Weight standardisation: a WS convolution uses ``w_o = s_o (k_o - mean(k_o))`` per output
channel o, ``s_o = (var(k_o) + eps)^(-1/2)``, the same map for every example. Its Jacobian is
``J_o = s_o (C - w_o w_o^T / d)`` with the centring projection ``C = I - 11^T/d`` (symmetric),
so the parameter's gradient is ``J^T u`` for ``u`` the gradient w.r.t. the standardised kernel.
Its singular values are ``s_o`` and ``s_o (1 - a_o)``, ``a_o = ||w_o||^2/d = var/(var + eps)``:
a gradient along the kernel loses almost all its size in the fold, and a float32 fold or norm
formed from ``u`` loses as many digits. So:

every path folds each example's gradient before the sum (``J^T (C u_i)``, per example), so the sum
adds vectors whose norms clip them; the streamed and ghost norms carry proven bounds of the fold's
and the products' rounding, and the ghost norm bounds ``||J_o^T c|| <= s_o max(1, a_o) ||c||``
instead of subtracting the part along ``w_o``.

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
(tests/privacy/test_neighbouring_batches.py, tests/privacy/test_layer_bounds.py).

Which path each plain layer takes is a speed and memory choice only, made outside this module
(``privacy.tuning``: a shape rule on a CPU, a cost model or timings on an accelerator) and handed
in as a ``PathChooser``; every choice is checked against ``PROVEN_PATHS`` before it is used, and
without a chooser every plain layer is explicit. Nothing here imports the tuning.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.layers import WSConv
from dpscale.privacy import bookkeeping, layer_bounds
from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn, LossFn, clipped_sum_from_norms, hold
from dpscale.privacy.layer_bounds import Strategy
from dpscale.privacy.rounding import ClipPrecision, norm_bound

PyTree = Any
#: A layer's name: its path in the parameter tree, e.g. ("backbone", "conv_0").
LayerName = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PerLayerKind:
    """A layer kind with per-layer paths of its own: the paths proven for it and the function that
    gives, on each, every example's squared-norm bound and the weighted sum (its docstring's
    "Guarantee:" says what it proves). Every kind of layer (these, plain and depthwise convolutions,
    normalisations) also has book-keeping's held per-example gradient (``privacy.layer_rules.RULES``),
    which shared, normalisation and non-plain layers always take."""

    paths: tuple[Strategy, ...]
    bounds: Callable[..., tuple[jax.Array, layer_bounds.Summer]]


_EVERY_PATH: tuple[Strategy, ...] = ("explicit", "grouped", "streamed", "ghost")
#: The registry of per-layer paths, by exact layer type.
PER_LAYER: dict[type, PerLayerKind] = {
    WSConv: PerLayerKind(_EVERY_PATH, layer_bounds.wsconv),
    nn.Dense: PerLayerKind(_EVERY_PATH, layer_bounds.dense),
}
#: The per-layer paths proven for each plain layer kind.
PROVEN_PATHS: dict[type, tuple[Strategy, ...]] = {kind: entry.paths for kind, entry in PER_LAYER.items()}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One layer's shapes for one device's micro-batch: ``positions`` P an example (the K views
    stacked), fan-in d, fan-out p. ``conv``: a convolution, whose patches (P x d an example) are formed;
    a dense layer reads its recorded input."""

    examples: int
    positions: int
    fan_in: int
    fan_out: int
    conv: bool = True


def layer_shape(call: bookkeeping.LayerCall, kernel: jax.Array, examples: int) -> LayerShape:
    """The shapes of a WS convolution or dense call (the one place they are read from a call)."""
    positions = math.prod(call.out.shape[:-1])  # one example's output: [K, ..., p]
    conv = isinstance(call.module, WSConv)
    return LayerShape(examples, positions, math.prod(kernel.shape[:-1]), kernel.shape[-1], conv)


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """How one layer call is clipped: ``strategy`` (the clipping path), ``precision`` and
    ``chunk_bytes`` (one chunk's per-example working set) are all the clipped sum reads; the rest says,
    for the log and clip_paths.json, the layer's shape and why (``reason``: "rule", "forced", or the
    times it was chosen from) and, where the memory guard split the micro-batch, its chunk."""

    layer: LayerName
    kind: str  # "WSConv", "Dense", ...
    strategy: str  # "ghost", "explicit", "grouped", "streamed", or "book-keeping"
    positions: int = 0
    fan_in: int = 0
    fan_out: int = 0
    precision: ClipPrecision = ClipPrecision()
    reason: str = "rule"
    chunk: int = 0  # examples a chunk where the memory guard split the micro-batch (0: it did not)
    chunk_bytes: int = layer_bounds.DEFAULT_CHUNK_BYTES

    def shape(self, examples: int) -> LayerShape:
        return LayerShape(examples, self.positions, self.fan_in, self.fan_out, self.kind == "WSConv")


@dataclasses.dataclass(frozen=True)
class PathChooser:
    """``choose(calls, params_of, examples)``: a ``LayerChoice`` for each plain layer call (by name), at
    trace time; ``precision``: the contractions' format of the book-keeping layers. A layer it leaves
    out is explicit."""

    choose: Callable[[tuple[bookkeeping.LayerCall, ...], Callable[[bookkeeping.LayerCall], PyTree], int], Mapping]
    precision: ClipPrecision = ClipPrecision()


def forced(
    strategies: Mapping[LayerName, Strategy] | None = None, *, precision: ClipPrecision | None = None
) -> PathChooser:
    """Every plain layer on the path ``strategies`` gives it (explicit where it gives none), at
    ``precision``: for tests and measurements, and the default of the clipped sum."""
    strategies, precision = dict(strategies or {}), precision or ClipPrecision()

    def choose(calls: tuple, params_of: Callable, examples: int) -> dict[LayerName, LayerChoice]:
        booked = booked_layers(calls)
        plain = [c for c in calls if c.path not in booked]
        unknown = set(strategies) - {c.path for c in plain}
        if unknown:
            raise InvalidConfigError(f"no ghost or explicit layer at {sorted('/'.join(p) for p in unknown)}")
        return {
            c.path: LayerChoice(
                c.path,
                type(c.module).__name__,
                strategies.get(c.path, "explicit"),
                precision=precision,
                reason="forced" if c.path in strategies else "default",
            )
            for c in plain
        }

    return PathChooser(choose, precision=precision)


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


def booked_layers(calls: tuple[bookkeeping.LayerCall, ...]) -> set[LayerName]:
    """The layers book-keeping clips: shared ones (called more than once) and those not plain."""
    uses = collections.Counter(call.path for call in calls)
    return {call.path for call in calls if uses[call.path] > 1 or not _plain(call.module)}


def _checked(choice: Any, call: bookkeeping.LayerCall) -> LayerChoice:
    """``choice`` if it is a proven path of ``call``'s layer kind (whatever chose it), else an error."""
    proven = PROVEN_PATHS[type(call.module)]
    if not isinstance(choice, LayerChoice) or choice.strategy not in proven:
        got = getattr(choice, "strategy", choice)
        raise InvalidConfigError(f"{'/'.join(call.path)}: clip path {got!r} is not one of {proven}")
    if not isinstance(choice.precision, ClipPrecision) or not choice.chunk_bytes >= 1:
        raise InvalidConfigError(f"{'/'.join(call.path)}: a clip choice needs a ClipPrecision and chunk_bytes >= 1")
    return choice


@dataclasses.dataclass(frozen=True)
class _PerLayer:
    """What the clipped sum and the norm bounds share: each layer's path, and the pass that gives
    every example's norm bound and the weighted sum over examples."""

    choices: Callable[[PyTree, PyTree, PyTree], tuple[tuple, tuple[LayerChoice, ...]]]
    bounds: Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, Callable[..., PyTree], jax.Array]]


def _per_layer(loss_fn: LossFn, chooser: PathChooser) -> _PerLayer:
    def choices(params: PyTree, model_state: PyTree, batch: PyTree) -> tuple[tuple, tuple[LayerChoice, ...]]:
        calls = bookkeeping.plan_batch_layers(loss_fn, params, model_state, batch)
        examples = jax.tree_util.tree_leaves(batch)[0].shape[0]
        chosen = chooser.choose(calls, lambda call: bookkeeping.layer_params(call, params), examples)
        booked = booked_layers(calls)
        out = []
        for call in calls:
            if call.path in booked:
                why = "a normalisation, shared or non-plain layer"
                out.append(
                    LayerChoice(
                        call.path, type(call.module).__name__, "book-keeping", precision=chooser.precision, reason=why
                    )
                )
            elif call.path in chosen:
                out.append(_checked(chosen[call.path], call))
            else:
                shape = layer_shape(call, bookkeeping.layer_params(call, params)["kernel"], examples)
                out.append(
                    LayerChoice(
                        call.path,
                        type(call.module).__name__,
                        "explicit",
                        shape.positions,
                        shape.fan_in,
                        shape.fan_out,
                        precision=chooser.precision,
                        reason="default",
                    )
                )
        return calls, tuple(out)

    def bounds(
        params: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[jax.Array, Callable[..., PyTree], jax.Array]:
        """(each example's norm bound, ``weighted(weights, finite)``, each example's loss)."""
        calls, chosen = choices(params, model_state, batch)
        tape = bookkeeping.record_layers(loss_fn, calls, params, model_state, batch)
        by_layer: dict[LayerName, list[int]] = collections.defaultdict(list)
        for index, call in enumerate(calls):
            by_layer[call.path].append(index)
        squares, summers, booked = [], [], {}
        for name, indices in by_layer.items():
            first, choice = calls[indices[0]], chosen[indices[0]]
            if choice.strategy == "book-keeping":
                booked[name] = layer_bounds.book_keeping_gradients(
                    [calls[i] for i in indices],
                    params,
                    [tape.inputs[i] for i in indices],
                    [tape.out_grads[i] for i in indices],
                    [tape.states[i] for i in indices],
                    choice.precision,
                )
                continue
            own = bookkeeping.layer_params(first, params)
            x, g = tape.inputs[indices[0]], tape.out_grads[indices[0]]
            part, summer = PER_LAYER[type(first.module)].bounds(
                first.module, own, x, g, choice.strategy, choice.precision, chunk_bytes=choice.chunk_bytes
            )
            squares.append(part)
            summers.append((name, summer))
        for name, per_example in hold(booked).items():  # one loop holds them all (clipping.hold)
            if per_example:  # a normalisation may have neither scale nor bias
                squares.append(layer_bounds.held_square_bound(per_example))
                summers.append((name, functools.partial(layer_bounds.held_sum, per_example)))

        def weighted(weights: jax.Array, finite: jax.Array) -> PyTree:
            grads = {name + (leaf,): grad for name, summer in summers for leaf, grad in summer(weights, finite).items()}
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            return jax.tree_util.tree_unflatten(treedef, [grads[bookkeeping.key_path(p)] for p, _ in flat])

        return norm_bound(squares), weighted, tape.losses

    return _PerLayer(choices, bounds)


def _chooser(
    choose: PathChooser | None, strategies: Mapping[LayerName, Strategy] | None, precision: ClipPrecision | None
) -> PathChooser:
    if choose is not None and (strategies or precision is not None):
        raise InvalidConfigError("give a chooser, or strategies and a precision to force, not both")
    return choose or forced(strategies, precision=precision)


def make_ghost_clipped_sum_fn(
    loss_fn: LossFn,
    *,
    clip_norm: float,
    example: tuple[PyTree, PyTree, PyTree] | None = None,
    choose: PathChooser | None = None,
    strategies: Mapping[LayerName, Strategy] | None = None,
    precision: ClipPrecision | None = None,
) -> ClippedSumFn:
    """Drop-in for ``make_clipped_sum_fn`` on models book-keeping covers (else UnsupportedModelError).

    ``example = (params, model_state, batch)`` (arrays or ``ShapeDtypeStruct``; batch leaves
    ``[b, K, ...]`` with b the micro-batch per device) checks support now, as book-keeping does, and
    fills the result's ``layers`` (a ``LayerChoice`` per layer call: how it is clipped and why).
    ``choose`` picks each plain layer's path (``privacy.tuning.choose.chooser``: the device's); or
    ``strategies`` forces some (``{("backbone", "conv_0"): "ghost"}``, the rest explicit) at
    ``precision`` (``privacy.rounding``), for tests and measurements.
    """
    check_clip_norm(clip_norm)
    per_layer = _per_layer(loss_fn, _chooser(choose, strategies, precision))

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        norms, weighted, losses = per_layer.bounds(params, model_state, batch)
        return clipped_sum_from_norms(norms, mask, clip_norm=clip_norm, weighted=weighted, losses=losses)

    layers = () if example is None else per_layer.choices(*example)[1]
    return ClippedSumFn(clipped_sum, sensitivity=1.0, layers=layers)


def make_ghost_norm_bounds_fn(
    loss_fn: LossFn,
    *,
    choose: PathChooser | None = None,
    strategies: Mapping[LayerName, Strategy] | None = None,
    precision: ClipPrecision | None = None,
) -> Callable[[PyTree, PyTree, PyTree], jax.Array]:
    """``(params, model_state, batch) -> [b]``: each example's norm bound, what the clipped sum of the
    same arguments clips with (for measuring the bounds' margin, ``benchmarks/norm_bounds.py``)."""
    per_layer = _per_layer(loss_fn, _chooser(choose, strategies, precision))
    return lambda params, model_state, batch: per_layer.bounds(params, model_state, batch)[0]
