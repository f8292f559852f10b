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
take more memory than the output gradient the layer already records. ``choose_strategy``
decides from the shapes at trace time. With augmentation multiplicity the K views' positions
are stacked (P = K*T) and the 1/K of the view average is already inside ``G``: the norm is
that of the averaged gradient, exactly what the vmap path clips.

Weight standardisation: a WS convolution uses ``w_o = s_o (k_o - mean(k_o))`` per output
channel o, ``s_o = (var(k_o) + eps)^(-1/2)``, the same map for every example. Its Jacobian is
``J_o = s_o (C - w_o w_o^T / d)`` with the centring projection ``C = I - 11^T/d`` (symmetric),
so the parameter's gradient is ``J^T u`` for ``u`` the gradient w.r.t. the standardised kernel:

* weighted sum: ``J^T (sum_i w_i u_i)``, one map after the sum;
* explicit norm: ``C u_i`` is the centred product (``u_i - mean over the fan-in``: d x p numbers
  per example, where centring the patches first reads P x d), then ``||J^T C u_i||``;
* ghost norm: patches are centred first (then ``A^T G = C u``), and
  ``||J_o^T u||^2 = s_o^2 (||C u_o||^2 - (2 - a_o)/d (w_o . u_o)^2)``, ``a_o = ||w_o||^2 / d``,
  where ``w_o . u_o = sum_t y_to g_to`` reads the convolution's output ``y`` (before its bias).

Layers used by several calls (shared parameters) and normalisation layers use book-keeping's
per-example gradients. Coverage is proven by ``bookkeeping.plan_layers`` exactly as for
book-keeping; norms, weights, the NaN guard and the counts are ``privacy.clipping``'s, and the
result has sensitivity 1. Tested against ``vmap(grad)`` (tests/privacy/test_ghost.py).

Speed on CPU: per-example work runs over chunks of examples (``lax.map``) sized so one chunk's
patches stay in cache; forming the patches of a whole micro-batch at once is memory-bound and
cost more than the contraction itself.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.layers import WSConv, as_pair, standardize_kernel
from dpscale.privacy import bookkeeping
from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn, LossFn, clipped_sum_from_norms

PyTree = Any
Path = tuple[str, ...]
Strategy = Literal["ghost", "explicit", "streamed"]
STRATEGIES: tuple[str, ...] = ("ghost", "explicit", "streamed")
_log = logging.getLogger(__name__)
_HIGHEST = jax.lax.Precision.HIGHEST
# Bytes of one chunk's per-example working set (patches, Gram matrices): about what stays in a
# CPU's last-level cache; measured fastest, per layer, on a 2-core CPU when this module was written.
CHUNK_BYTES = 8 * 2**20
# The cancellation in ||C u||^2 - (...)(w.u)^2 can round the ghost norm down; this share of the
# subtracted term is added back so the clip weight never exceeds 1/norm by rounding.
_CANCELLATION_SLACK = 2.0**-18


# Ghost when P^2 (d + p) < GHOST_RATIO * d * p (P positions, fan-in d, fan-out p per example).
# Measured per layer on a 2-core CPU: ghost won at ratios 18-78 (late convolutions of cnn-small and
# WRN-16-4), tied at 284, lost at 569 and above; the whole step's effect is in
# benchmarks/results/dp_step_cost.md.
GHOST_RATIO = 300


def choose_strategy(*, positions: int, fan_in: int, fan_out: int) -> Strategy:
    """Ghost when its Gram matrices cost less than holding the per-example gradient, else explicit.

    Both paths contract P*d*p per example once (explicit: to form ``U_i``; ghost: in the
    batch's weight gradient). On top, ghost forms two P x P Gram matrices, ``P^2 (d + p)``
    multiply-adds, while explicit writes ``d * p`` floats per example and reads them back for
    the norm and the sum: memory traffic, which costs ~GHOST_RATIO multiply-adds a float here.
    Explicit holds ``U_i`` (d*p floats per example) only where that is no more than the
    layer's recorded output gradient (P*p), i.e. d <= P; else it is streamed (one more
    contraction, the batch's weight gradient, instead of the held ``U_i``).
    """
    cost_ghost = positions * positions * (fan_in + fan_out)
    if cost_ghost < GHOST_RATIO * fan_in * fan_out:
        return "ghost"
    return "explicit" if fan_in <= positions else "streamed"


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """How one layer call is clipped, for the log and the tests."""

    path: Path
    kind: str  # "WSConv", "Dense", ...
    strategy: str  # "ghost", "explicit", "streamed", or "book-keeping" (shared or normalisation layers)
    positions: int = 0
    fan_in: int = 0
    fan_out: int = 0


# -- the pieces of one layer: (squared norms [b], weighted sum (weights, finite) -> {name: grad})

Summer = Callable[[jax.Array, jax.Array], dict[str, jax.Array]]


def _guard(finite: jax.Array, a: jax.Array) -> jax.Array:
    """``a`` with the rows of non-finite examples zeroed (a zero weight alone keeps a NaN)."""
    return jnp.where(finite.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros((), a.dtype))


def _chunked(fn: Callable[..., PyTree], arrays: tuple[jax.Array, ...], bytes_per_example: int) -> PyTree:
    """``fn`` over examples (leading axis), a cache-sized chunk of examples at a time.

    The chunk divides the number of examples: a remainder chunk costs a second program and
    copies of the inputs, more than the chunk size gains.
    """
    size = arrays[0].shape[0]
    target = max(1, min(size, CHUNK_BYTES // max(1, bytes_per_example)))
    chunk = max(c for c in range(1, target + 1) if size % c == 0)
    return jax.lax.map(lambda xs: fn(*xs), arrays, batch_size=chunk)


def _batch_vjp_sum(module: nn.Module, params: PyTree, x: jax.Array, g: jax.Array,
                   weights: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
    """``sum_i w_i grad_i`` as one VJP of the layer over the whole batch (outputs scaled by ``w_i``)."""
    flat_x = _guard(finite, x).reshape((-1,) + x.shape[2:])
    scaled = _guard(finite, g * weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype))
    _, vjp = jax.vjp(lambda p: module.apply({"params": p}, flat_x), params)
    return dict(vjp(scaled.reshape((-1,) + g.shape[2:]))[0])


def _held_sum(per_example: dict[str, jax.Array], weights: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
    return {name: jnp.tensordot(weights, _guard(finite, grad), axes=1) for name, grad in per_example.items()}


@dataclasses.dataclass(frozen=True)
class _WsGeometry:
    """A WS convolution's standardised kernel ``w`` [d, p], scales ``s`` [p] and ``a = ||w_o||^2/d``."""

    d: int
    w: jax.Array
    s: jax.Array
    a: jax.Array

    @classmethod
    def of(cls, module: WSConv, kernel: jax.Array) -> _WsGeometry:
        d = math.prod(kernel.shape[:-1])
        w = standardize_kernel(kernel, eps=module.eps).reshape(d, kernel.shape[-1])
        s = jax.lax.rsqrt(jnp.var(kernel, axis=tuple(range(kernel.ndim - 1))) + module.eps)
        return cls(d=d, w=w, s=s, a=jnp.einsum("dp,dp->p", w, w, precision=_HIGHEST) / d)

    def fold(self, u: jax.Array) -> jax.Array:
        """``J^T u`` for ``u`` [..., d, p] whose columns are already centred."""
        wu = jnp.einsum("dp,...dp->...p", self.w, u, precision=_HIGHEST)
        return self.s * (u - self.w * (wu[..., None, :] / self.d))


def _patches(module: WSConv, x_one: jax.Array, d: int) -> jax.Array:
    """``[K*T, d]``: one example's patches (all views' positions)."""
    kh, kw = as_pair(module.kernel_size)
    windows = bookkeeping.shifted_windows(x_one, (kh, kw), as_pair(module.strides), module.padding)
    return windows.reshape(-1, d)


def _centred_patches(module: WSConv, x_one: jax.Array, d: int) -> jax.Array:
    """``[K*T, d]``: one example's patches, each centred over the fan-in."""
    patches = _patches(module, x_one, d)
    return patches - jnp.mean(patches, axis=1, keepdims=True)


def _wsconv(module: WSConv, params: PyTree, x: jax.Array, y: jax.Array, g: jax.Array,
            strategy: Strategy) -> tuple[jax.Array, Summer]:
    kernel = params["kernel"]
    geometry = _WsGeometry.of(module, kernel)
    d, p = geometry.d, kernel.shape[-1]
    positions = math.prod(g.shape[1:-1])
    flat_g = g.reshape(g.shape[0], positions, p)
    bias = jnp.sum(flat_g, axis=1) if module.use_bias else None

    def centred_product(x_one: jax.Array, g_one: jax.Array) -> jax.Array:
        """``C u`` of one example: centring the product (C A^T G = (A C)^T G) reads d x p
        numbers, not the P x d patches."""
        u_one = jnp.einsum("td,tp->dp", _patches(module, x_one, d), g_one, precision=_HIGHEST)
        return u_one - jnp.mean(u_one, axis=0, keepdims=True)

    batch_vjp_sum: Summer = functools.partial(_batch_vjp_sum, module, params, x, g)  # streamed and ghost

    def folded_square(u_one: jax.Array) -> jax.Array:
        folded = geometry.fold(u_one)
        return jnp.einsum("dp,dp->", folded, folded, precision=_HIGHEST)

    if strategy == "explicit":
        def held_and_square(x_one: jax.Array, g_one: jax.Array) -> tuple[jax.Array, jax.Array]:
            # The square inside the chunk: the folded gradients never exist for the whole batch.
            u_one = centred_product(x_one, g_one)
            return u_one, folded_square(u_one)

        u, squares = _chunked(held_and_square, (x, flat_g), 4 * positions * (d + p))

        def summer(weights: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
            u_sum = jnp.tensordot(weights, _guard(finite, u), axes=1)
            grads = {"kernel": geometry.fold(u_sum).reshape(kernel.shape)}
            if bias is not None:
                grads["bias"] = jnp.tensordot(weights, _guard(finite, bias), axes=1)
            return grads
    elif strategy == "streamed":
        squares = _chunked(lambda x_one, g_one: folded_square(centred_product(x_one, g_one)), (x, flat_g),
                           4 * positions * (d + p))
        summer = batch_vjp_sum
    else:
        scaled_g = flat_g * geometry.s

        def one(x_one: jax.Array, g_one: jax.Array) -> jax.Array:
            patches = _centred_patches(module, x_one, d)
            gram_a = jnp.einsum("td,sd->ts", patches, patches, precision=_HIGHEST)
            gram_g = jnp.einsum("tp,sp->ts", g_one, g_one, precision=_HIGHEST)
            return jnp.einsum("ts,ts->", gram_a, gram_g, precision=_HIGHEST)

        centred = _chunked(one, (x, scaled_g), 4 * positions * (d + p + positions))
        conv_out = y.reshape(flat_g.shape) - (params["bias"] if module.use_bias else 0.0)
        wu = jnp.einsum("btp,btp->bp", conv_out, flat_g, precision=_HIGHEST)  # w_o . u_o per example
        along_w = jnp.einsum("p,bp->b", geometry.s**2 * (2 - geometry.a) / d, wu * wu, precision=_HIGHEST)
        squares = jnp.maximum(centred - along_w, 0.0) + _CANCELLATION_SLACK * along_w
        summer = batch_vjp_sum
    if bias is not None:
        squares = squares + jnp.einsum("bp,bp->b", bias, bias, precision=_HIGHEST)
    return squares, summer


def _dense(module: nn.Dense, params: PyTree, x: jax.Array, g: jax.Array,
           strategy: Strategy) -> tuple[jax.Array, Summer]:
    b, fan_in, fan_out = x.shape[0], x.shape[-1], g.shape[-1]
    flat_x, flat_g = x.reshape(b, -1, fan_in), g.reshape(b, -1, fan_out)
    bias = jnp.sum(flat_g, axis=1) if module.use_bias else None
    if strategy == "explicit":
        held = {"kernel": jnp.einsum("btf,bto->bfo", flat_x, flat_g, precision=_HIGHEST)}
        if bias is not None:
            held["bias"] = bias
        squares = sum(jnp.einsum("b...,b...->b", v, v, precision=_HIGHEST) for v in held.values())
        return squares, lambda weights, finite: _held_sum(held, weights, finite)
    if strategy == "streamed":
        def one_square(x_one: jax.Array, g_one: jax.Array) -> jax.Array:
            u_one = jnp.einsum("tf,to->fo", x_one, g_one, precision=_HIGHEST)
            return jnp.einsum("fo,fo->", u_one, u_one, precision=_HIGHEST)

        squares = _chunked(one_square, (flat_x, flat_g), 4 * flat_x.shape[1] * (fan_in + fan_out))
    else:
        gram_x = jnp.einsum("btf,bsf->bts", flat_x, flat_x, precision=_HIGHEST)
        gram_g = jnp.einsum("bto,bso->bts", flat_g, flat_g, precision=_HIGHEST)
        squares = jnp.einsum("bts,bts->b", gram_x, gram_g, precision=_HIGHEST)
    if bias is not None:
        squares = squares + jnp.einsum("bo,bo->b", bias, bias, precision=_HIGHEST)
    return squares, lambda weights, finite: _batch_vjp_sum(module, params, x, g, weights, finite)


def _book_keeping(calls: list[bookkeeping.LayerCall], params: PyTree, xs: list[jax.Array],
                  gs: list[jax.Array]) -> tuple[jax.Array, Summer]:
    """Explicit per-example gradients by book-keeping's rules, summed over the calls of one layer."""
    held: dict[str, jax.Array] = {}
    for call, x, g in zip(calls, xs, gs):
        for name, grad in bookkeeping.per_example_layer_gradients(call, params, x, g).items():
            held[name] = grad if name not in held else held[name] + grad
    squares = sum(jnp.einsum("b...,b...->b", v, v, precision=_HIGHEST) for v in held.values())
    return squares, lambda weights, finite: _held_sum(held, weights, finite)


def _shape_of(call: bookkeeping.LayerCall, params: PyTree) -> tuple[int, int, int]:
    """(positions per example, fan-in, fan-out) of a WS convolution or dense call."""
    kernel = params["kernel"]
    positions = math.prod(call.out.shape[:-1])  # one example's output: [K, ..., p]
    return positions, math.prod(kernel.shape[:-1]), kernel.shape[-1]


def plan_strategies(calls: tuple[bookkeeping.LayerCall, ...], params_of: Callable[[bookkeeping.LayerCall], PyTree],
                    overrides: Mapping[Path, Strategy] | None = None) -> tuple[LayerChoice, ...]:
    """Each layer call's strategy: book-keeping for shared or normalisation layers, else by shape."""
    overrides = dict(overrides or {})
    uses = collections.Counter(call.path for call in calls)
    choices = []
    for call in calls:
        kind = type(call.module).__name__
        if uses[call.path] > 1 or type(call.module) not in (WSConv, nn.Dense):
            choices.append(LayerChoice(call.path, kind, "book-keeping"))
            continue
        positions, fan_in, fan_out = _shape_of(call, params_of(call))
        strategy = overrides.pop(call.path, None) or choose_strategy(positions=positions, fan_in=fan_in,
                                                                        fan_out=fan_out)
        if strategy not in STRATEGIES:
            raise InvalidConfigError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        choices.append(LayerChoice(call.path, kind, strategy, positions, fan_in, fan_out))
    if overrides:
        raise InvalidConfigError(f"no ghost or explicit layer at {sorted('/'.join(p) for p in overrides)}")
    return tuple(choices)


def describe(choices: tuple[LayerChoice, ...]) -> str:
    """One line for the log: how many layers take each path, and which are ghost."""
    counts = collections.Counter(c.strategy for c in choices)
    ghost = ["/".join(c.path) for c in choices if c.strategy == "ghost"]
    return (", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            + (f" (ghost: {', '.join(ghost)})" if ghost else ""))


def make_ghost_clipped_sum_fn(
    loss_fn: LossFn, *, clip_norm: float, example: tuple[PyTree, PyTree, PyTree] | None = None,
    strategies: Mapping[Path, Strategy] | None = None,
) -> ClippedSumFn:
    """Drop-in for ``make_clipped_sum_fn`` on models book-keeping covers (else UnsupportedModelError).

    ``example = (params, model_state, batch)`` checks support now, as book-keeping does, and
    fills the result's ``layers`` (a ``LayerChoice`` per layer call: how it is clipped). ``strategies`` forces a layer's path
    (``{("backbone", "conv_0"): "ghost"}``), for tests and benchmarks.
    """
    check_clip_norm(clip_norm)

    def plan(params: PyTree, model_state: PyTree, batch: PyTree) -> tuple[tuple, tuple[LayerChoice, ...]]:
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
        calls = bookkeeping.plan_layers(loss_fn, params, model_state, one)
        return calls, plan_strategies(calls, lambda call: bookkeeping.layer_params(call, params), strategies)

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        calls, choices = plan(params, model_state, batch)
        tape = bookkeeping.record_layers(loss_fn, calls, params, model_state, batch)
        by_path: dict[Path, list[int]] = collections.defaultdict(list)
        for index, call in enumerate(calls):
            by_path[call.path].append(index)
        squares, summers = jnp.zeros(tape.losses.shape, jnp.float32), []
        for path, indices in by_path.items():
            first, choice = calls[indices[0]], choices[indices[0]]
            own = bookkeeping.layer_params(first, params)
            x, y, g = tape.inputs[indices[0]], tape.outputs[indices[0]], tape.out_grads[indices[0]]
            if choice.strategy == "book-keeping":
                part, summer = _book_keeping([calls[i] for i in indices], params,
                                             [tape.inputs[i] for i in indices], [tape.out_grads[i] for i in indices])
            elif isinstance(first.module, WSConv):
                part, summer = _wsconv(first.module, own, x, y, g, choice.strategy)
            else:
                part, summer = _dense(first.module, own, x, g, choice.strategy)
            squares = squares + part
            summers.append((path, summer))
        def weighted(weights: jax.Array, finite: jax.Array) -> PyTree:
            grads = {path + (name,): grad for path, summer in summers
                     for name, grad in summer(weights, finite).items()}
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            return jax.tree_util.tree_unflatten(treedef, [grads[bookkeeping.key_path(p)] for p, _ in flat])

        return clipped_sum_from_norms(jnp.sqrt(squares), mask, clip_norm=clip_norm, weighted=weighted,
                                      losses=tape.losses)

    choices = () if example is None else plan(*example)[1]
    return ClippedSumFn(clipped_sum, sensitivity=1.0, layers=choices)
