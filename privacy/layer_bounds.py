"""One layer's per-example squared-norm bounds and weighted sum, by path (explicit, grouped, streamed,
ghost).

For a WS convolution or a dense layer with input patches ``A_i`` (P x d) and output gradient
``G_i`` (P x p), each path returns ``(q, summer)``: ``q_i`` is an upper bound of the squared norm
of the vector ``v_i`` that ``summer(weights, finite)`` adds for example i. Every summer adds
per-example vectors, one block of examples at a time (``privacy.example_sum``), so the rounding of
the sum over the *other* examples is bounded by their clipped norms too; what differs is how
``v_i`` is formed and how its norm is bounded (``privacy.rounding``):

* explicit holds each example's gradient ``v_i`` as computed and sums exactly those: only the
  rounding of ``||v_i||^2`` enters. With weight standardisation the fold is applied per example
  before the sum (``v_i = fold(centre(A_i^T G_i))``), so the norm and the sum see the same vector.
  ``grouped`` is explicit with ``A_i^T G_i`` formed as the convolution's weight gradient of the one
  example (vmapped: one convolution with the examples as feature groups) instead of from its
  patches, which a GPU would otherwise write out (P x d floats an example): the held vector, and so
  the bound, are of the same kind; how it is formed changes only the speed.
* streamed and ghost hold nothing of the parameter's size: the summer forms ``v_i`` again, a chunk
  of examples at a time, at the sum precision, folds it per example, and adds the chunk. The norm
  is computed from other numbers (streamed: the product formed once more at the norm precision;
  ghost: Gram matrices), so the bound adds, to the computed norm, absolute terms that cover the
  difference to the vector the summer adds: the products' rounding at both precisions, the
  centring and the fold. Each is a multiple of ``||A_i||_F ||G_i||_F`` or of the computed product's
  norm, which is what the cancellation of the WS fold (its Jacobian has singular values s and
  s(1 - a), a = var / (var + eps)) and of a ghost norm needs; a relative margin would not be a proof.
* a dense layer with one position an example (no views) adds ``x_i (w_i g_i)^T`` in block
  contractions without forming it (``example_sum.weighted_outer_sum``): those products are the
  entries of ``w_i v_i`` exactly, so its norm bound is of the exact gradient.

Weight standardisation: ``w_o = s_o (k_o - mean(k_o))``, ``s_o = (var(k_o) + eps)^(-1/2)``; the
kernel's gradient is ``fold(c) = s (c - w (w . c) / d)`` of the centred gradient ``c`` w.r.t. the
standardised kernel. ``||fold(c)_o|| <= s_o max(1, a_o) ||c_o||``, so the ghost norm bounds it by
``sum_o s_o^2 max(1, a_o)^2 ||C u_o||^2`` without subtracting the part along ``w_o`` (the
subtraction cancels, and its error bound needs the forward pass's rounding, which is not ours):
a margin of 0.1-0.2% on those layers (benchmarks/results/norm_bounds.md).

Why not the layer's own weight gradient over the batch, one contraction of ``A`` and the weighted
``G`` over all examples, then one fold: its rounding scales with every example's ``||A_i|| ||G_i||``
(unfolded: up to ``1 / (1 - a)`` times the folded norm; a gradient that cancels over positions or
views: any multiple of it), which no clip weight bounds. Measured before this change: one WS layer,
127 other examples built along its kernel, moved the sum by 1.158 C
(tests/privacy/test_neighbouring_batches.py holds the case).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dpscale.models.layers import WSConv, as_pair, standardize_kernel
from dpscale.privacy import bookkeeping, layer_rules
from dpscale.privacy.clipping import hold
from dpscale.privacy.example_sum import MAX_PARTS, accumulate, weighted_outer_sum, weighted_sum
from dpscale.privacy.rounding import (
    ClipPrecision,
    Format,
    U,
    blocked_depth,
    blocked_sum,
    contract,
    gamma,
    inflate,
    monotone,
    underflow,
    upper_sqrt,
    upper_sum,
    upper_sum_of_squares,
)

PyTree = Any
#: Bytes of one chunk's per-example working set (patches, products, Gram matrices) where nobody chose:
#: about what stays in a CPU's last-level cache. A chunk is a speed choice: every chunk size sums the
#: same vectors under the same bounds (the tuning's device settings choose it: privacy.tuning.device).
DEFAULT_CHUNK_BYTES = 8 * 2**20
Strategy = Literal["ghost", "explicit", "streamed", "grouped"]
#: The paths that hold every example's gradient (their ``chunked`` loop runs ``held``); the others
#: bound a norm and form the weighted sum apart.
HELD_STRATEGIES = ("explicit", "grouped")
Summer = Callable[[jax.Array, jax.Array], dict[str, jax.Array]]
_HIGHEST = jax.lax.Precision.HIGHEST


def chunked(
    fn: Callable[..., PyTree],
    arrays: tuple[jax.Array, ...],
    bytes_per_example: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    held: bool = False,
) -> PyTree:
    """``fn`` over examples (leading axis), ``chunk_bytes`` of working set at a time (a CPU's
    cache; on an accelerator the whole micro-batch: ``privacy.tuning.device``).

    The chunk divides the number of examples: a remainder chunk costs a second program and
    copies of the inputs, more than the chunk size gains. ``held``: at least two chunks where
    there are two examples, so the outputs are a loop's, buffers that no consumer recomputes
    (``clipping.hold``; XLA inlines a loop of one iteration).
    """
    chunk = chunk_size(arrays[0].shape[0], bytes_per_example, chunk_bytes=chunk_bytes, held=held)
    return jax.lax.map(lambda xs: fn(*xs), arrays, batch_size=chunk)


def chunk_size(size: int, bytes_per_example: int, *, chunk_bytes: int, held: bool) -> int:
    """The examples a chunk that ``chunked`` runs ``size`` examples in (the memory check counts the
    same chunk: ``training.memory.with_clip_paths``)."""
    most = (size // 2 or 1) if held else size
    target = max(1, min(most, chunk_bytes // max(1, bytes_per_example)))
    return max(c for c in range(1, target + 1) if size % c == 0)


def chunk_work(strategy: Strategy, positions: int, fan_in: int, fan_out: int) -> int:
    """The bytes per example that a path's ``chunked`` loop sizes its chunks by (patches and output
    gradient; ghost adds its P x P Gram matrices); a dense layer's explicit path is not chunked."""
    if strategy == "grouped":  # no patches: the output gradient and the product, formed and folded
        return 4 * (positions * fan_out + 2 * fan_in * fan_out)
    return 4 * positions * (fan_in + fan_out + (3 * positions if strategy == "ghost" else 0))


def sum_work(positions: int, fan_in: int, fan_out: int) -> int:
    """The bytes per example that the streamed and ghost summers' ``chunked_sum`` sizes its chunks by:
    patches and output gradient, and the product formed, centred and folded."""
    return 4 * (positions * (fan_in + fan_out) + 3 * fan_in * fan_out)


def held_sum(per_example: dict[str, jax.Array], weights: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
    """``sum_i w_i v_i`` of held per-example gradients (``example_sum.weighted_sum``)."""
    return {name: weighted_sum(grad, weights, finite) for name, grad in per_example.items()}


def chunked_sum(
    form: Callable[..., jax.Array],
    arrays: tuple[jax.Array, ...],
    weights: jax.Array,
    finite: jax.Array,
    bytes_per_example: int,
    *,
    chunk_bytes: int,
) -> jax.Array:
    """``sum_i w_i form(arrays_i)`` with ``form`` per example, ``chunk_bytes`` of working set at a time:
    each chunk's vectors are formed, weighted and summed in blocks (``example_sum.weighted_sum``), and
    the chunks' sums added exactly, as two floats, in a loop (``example_sum.accumulate``), so nothing
    of the parameter's size is held per example, nor per chunk."""
    size = arrays[0].shape[0]
    chunk = chunk_size(size, bytes_per_example, chunk_bytes=chunk_bytes, held=False)
    chunk = min(c for c in range(chunk, size + 1) if size % c == 0 and size // c <= MAX_PARTS)

    def one_chunk(total: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]) -> tuple[tuple, None]:
        *parts, w, f = xs
        return accumulate(total, weighted_sum(jax.vmap(form)(*parts), w, f)), None

    split = [a.reshape((size // chunk, chunk) + a.shape[1:]) for a in (*arrays, weights, finite)]
    shape = jax.eval_shape(lambda: jax.vmap(form)(*(a[0, :1] for a in split[: len(arrays)])))
    zero = jnp.zeros(shape.shape[1:], jnp.float32)
    (high, low), _ = jax.lax.scan(one_chunk, (zero, zero), tuple(split))
    return high + low


def held_square_bound(per_example: dict[str, jax.Array]) -> jax.Array:
    """``>= sum over the leaves of ||v_i||^2`` of held per-example gradients."""
    return sum_bounds([upper_sum_of_squares(v) for v in per_example.values()])


def sum_bounds(bounds: list[jax.Array]) -> jax.Array:
    """``>=`` the sum of nonnegative upper bounds (a few terms: one rounding each)."""
    return bounds[0] if len(bounds) == 1 else monotone(sum(bounds), len(bounds))


@dataclasses.dataclass(frozen=True)
class WsGeometry:
    """A WS convolution's standardised kernel ``w`` [d, p] and scales ``s`` [p] (the fold of every
    path uses these same arrays), bounds ``s_hat`` [p] of each channel's fold
    (``>= s_o max(1, ||w_o||^2 / d)``) and their largest, and the relative errors of centring and
    folding one example's gradient (sums over d in blocks, ``privacy.rounding``)."""

    d: int
    w: jax.Array
    s: jax.Array
    s_hat: jax.Array
    s_hat_max: jax.Array

    @classmethod
    def of(cls, module: WSConv, kernel: jax.Array) -> WsGeometry:
        d, p = math.prod(kernel.shape[:-1]), kernel.shape[-1]
        w = standardize_kernel(kernel, eps=module.eps).reshape(d, p)
        s = jax.lax.rsqrt(jnp.var(kernel, axis=tuple(range(kernel.ndim - 1))) + module.eps)
        a = upper_sum_of_squares(w.T) / np.float32(d)
        s_hat = monotone(s * jnp.maximum(1.0, a), 3)
        return cls(d=d, w=w, s=s, s_hat=s_hat, s_hat_max=jnp.max(s_hat))

    @property
    def kappa_centre(self) -> float:
        """``||centre(u) - C u|| <= kappa_centre ||u||`` (the mean's sum, its division, the subtraction)."""
        return gamma(blocked_depth(self.d) + 1) + 4 * U

    @property
    def kappa_fold(self) -> float:
        """``||fold(c) - J^T c|| <= s_hat kappa_fold ||c||`` (the dot product ``w . c``, four roundings)."""
        return gamma(blocked_depth(self.d) + 2) + 8 * U

    @property
    def kappa(self) -> float:
        """Centring then folding: ``||fold(centre(u)) - J^T C u|| <= s_hat kappa ||u||``."""
        return self.kappa_fold * (1 + self.kappa_centre) + self.kappa_centre

    def centre(self, u: jax.Array) -> jax.Array:
        """``u`` [..., d, p] less its mean over the fan-in."""
        total, _ = blocked_sum(u, axis=-2)
        return u - (total / np.float32(self.d))[..., None, :]

    def fold(self, c: jax.Array) -> jax.Array:
        """``J^T c`` for ``c`` [..., d, p]."""
        wc, _ = blocked_sum(self.w * c, axis=-2)
        return self.s * (c - self.w * (wc / np.float32(self.d))[..., None, :])


def _patches(module: WSConv, x_one: jax.Array, d: int) -> jax.Array:
    """``[K*T, d]``: one example's patches (all views' positions)."""
    kh, kw = as_pair(module.kernel_size)
    windows = layer_rules.shifted_windows(x_one, (kh, kw), as_pair(module.strides), module.padding)
    return windows.reshape(-1, d)


def _kernel_gradient(module: WSConv, shape: tuple[int, ...], fmt: Format, x: jax.Array, g: jax.Array) -> jax.Array:
    """``sum_n A_n^T G_n`` over the leading axis of ``x`` (``[n, h, w, c]``) and ``g`` (``[n, h', w', p]``):
    the layer's convolution transposed to its kernel (``shape``: ``[kh, kw, c, p]``), products at ``fmt``
    (the inputs are rounded to it by the caller). Over one example's views it is that example's
    product; vmapped over examples, JAX batches it as one convolution with the examples as feature
    groups."""

    def conv(kernel: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(
            x,
            kernel,
            window_strides=as_pair(module.strides),
            padding=module.padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=module.feature_group_count,
            precision=fmt.lax_precision,
            preferred_element_type=jnp.float32,
        )

    (product,) = jax.linear_transpose(conv, jax.ShapeDtypeStruct(shape, jnp.float32))(g)
    return product


def _patches_square_bound(module: WSConv, x: jax.Array) -> jax.Array:
    """``>= ||A_i||_F^2`` from the layer's input: an input pixel lies in at most
    ``ceil(kh / sh) ceil(kw / sw)`` windows (padding adds zeros)."""
    (kh, kw), (sh, sw) = as_pair(module.kernel_size), as_pair(module.strides)
    return monotone(upper_sum_of_squares(x) * np.float32(-(-kh // sh) * -(-kw // sw)), 1)


def _product_errors(
    fmt: Format, positions: int, fan_in: int, fan_out: int, a2: jax.Array, g2: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(||A|| ||G||, a bound of |fl(A^T G) - A^T G|_F at fmt)`` per example, from upper bounds of
    ``||A||^2`` and ``||G||^2``."""
    a, g = upper_sqrt(a2), upper_sqrt(g2)
    ag = monotone(a * g, 1)
    return ag, monotone(np.float32(fmt.error(positions)) * ag + underflow(positions * fan_in * fan_out, a, g), 3)


def _gram_terms(
    rows_a: jax.Array, bound_a: jax.Array, rows_g: jax.Array, bound_g: jax.Array, fmt: Format
) -> tuple[jax.Array, ...]:
    """One example's ``<X, Y>`` for the Grams ``X = rows_a rows_a^T``, ``Y = rows_g rows_g^T`` at
    ``fmt``, and what its bound needs: ``n^T |Y| n`` and ``(n . m)^2``, for ``n`` and ``m`` upper
    bounds of the norms of the exact rows. Each is a product per row (one contraction over the P
    columns, any order) and a blocked sum of the rows: two passes over the Grams."""
    x = contract(fmt, "td,sd->ts", rows_a, rows_a)
    y = contract(fmt, "tp,sp->ts", rows_g, rows_g)
    inner, _ = blocked_sum(jnp.einsum("ts,ts->t", x, y, precision=_HIGHEST))
    weighted = jnp.einsum("ts,s->t", jnp.abs(y), bound_a, precision=_HIGHEST)  # >= 0: P roundings each
    term_a = monotone(inflate(upper_sum(bound_a * weighted), gamma(2 * x.shape[0])), 1)  # >= 1 / (1 - gamma_P)
    cross = monotone(upper_sum(bound_a * bound_g), 1)
    return inner, term_a, monotone(cross * cross, 1)


def _ghost_square(
    fmt: Format,
    positions: int,
    fan_in: int,
    fan_out: int,
    kappa_rows: float,
    inner: jax.Array,
    term_a: jax.Array,
    cross: jax.Array,
    a2: jax.Array,
    g2: jax.Array,
) -> jax.Array:
    """``>= <X_exact, Y_exact>`` from the computed ``<X, Y>``.

    With ``|X - X_exact| <= alpha n n^T`` and ``|Y - Y_exact| <= beta m m^T`` entrywise, the
    difference is at most ``alpha n^T|Y|n + beta m^T|X|m + alpha beta (n.m)^2``, plus the inner
    product's rounding ``gamma sum |X||Y|``, plus underflow. As ``|X_exact| <= n n^T`` (Cauchy-
    Schwarz), ``|X| <= (1 + alpha) n n^T``: so ``sum |X||Y| <= (1 + alpha) n^T|Y|n`` and
    ``m^T|X|m <= (1 + alpha)(n.m)^2``. ``kappa_rows`` is the relative error of the rows of A
    (their centring); rows of G are scaled by ``s_hat`` (one rounding).
    """
    alpha = 2 * kappa_rows + kappa_rows**2 + fmt.error(fan_in) * (1 + kappa_rows) ** 2
    beta = 2 * U + U * U + fmt.error(fan_out) * (1 + U) ** 2
    inner_error = gamma(positions + blocked_depth(positions))  # a row's P products and sums, then the rows
    a, g = upper_sqrt(a2), upper_sqrt(g2)
    tiny = np.float32(4 * positions * positions * np.finfo(np.float32).tiny)
    absolute = tiny * (fan_in * (1 + 2 * a) * g2 + fan_out * (1 + 2 * g) * a2 + 1)
    slack = (
        np.float32(inner_error * (1 + alpha) + alpha) * term_a
        + np.float32((beta + alpha * beta) * (1 + alpha)) * cross
        + absolute
    )
    return jnp.maximum(monotone(inner + monotone(slack, 8), 1), 0.0)


def _ws_folded(
    module: WSConv, geometry: WsGeometry, kernel_shape: tuple[int, ...], strategy: Strategy
) -> Callable[[Format, jax.Array, jax.Array], jax.Array]:
    """``(fmt, x_one, g_one) ->`` one example's kernel gradient, folded before any sum: what is summed
    is what is bounded (grouped: formed as the convolution's weight gradient; else from patches)."""
    d, p = geometry.d, kernel_shape[-1]

    def folded_one(fmt: Format, x_one: jax.Array, g_one: jax.Array) -> jax.Array:
        if strategy == "grouped":
            product = _kernel_gradient(module, kernel_shape, fmt, fmt.round(x_one), fmt.round(g_one)).reshape(d, p)
        else:
            product = contract(fmt, "td,tp->dp", _patches(module, x_one, d), g_one.reshape(-1, p))
        return geometry.fold(geometry.centre(product))

    return folded_one


def _ws_streamed_norm(
    module: WSConv, geometry: WsGeometry, x: jax.Array, flat_g: jax.Array, fmt: Format, errors: tuple, **chunking: int
) -> jax.Array:
    """``>= ||v'_i||`` for the summer's ``v'_i``, from the product formed once more at the norm format.

    The summer's v' = fold(centre(u')) and the measured v = fold(centre(u~)), u' and u~ two evaluations
    of the product (at the sum and the norm precision): ||v' - v|| <= s_hat (||u' - u~|| + kappa
    (||u'|| + ||u~||)), ||u' - u~|| <= err_norm + err_sum, and the u~ whose norm was taken may be a third
    evaluation, within 2 err_norm of the one folded."""
    d, kappa = geometry.d, geometry.kappa
    norm_error, sum_error = errors

    def norm_one(x_one: jax.Array, g_one: jax.Array) -> tuple[jax.Array, ...]:
        u_one = contract(fmt, "td,tp->dp", _patches(module, x_one, d), g_one)
        folded = geometry.fold(geometry.centre(u_one))
        return upper_sum_of_squares(folded, keep=0), upper_sum_of_squares(u_one, keep=0)

    q_folded, q_u = chunked(norm_one, (x, flat_g), **chunking)
    slack = geometry.s_hat_max * (
        np.float32(1 + kappa) * sum_error
        + np.float32(1 + 5 * kappa) * norm_error
        + np.float32(2 * kappa) * upper_sqrt(q_u)
    )
    return upper_sqrt(q_folded) + monotone(slack, 8)


def _ws_ghost_norm(
    module: WSConv, geometry: WsGeometry, x: jax.Array, flat_g: jax.Array, fmt: Format, errors: tuple, **chunking: int
) -> jax.Array:
    """``>= ||v'_i||`` for the summer's ``v'_i``, from Gram matrices: the ghost norm bounds the exact
    ``||J^T C u||`` (``_ghost_square``), and v' = fold(centre(u')) is within s_hat (err_sum + kappa
    ||u'||) of it, ||u'|| <= ||A|| ||G|| + err_sum."""
    d, p, positions = geometry.d, flat_g.shape[-1], flat_g.shape[1]
    ag, sum_error = errors

    def ghost_one(x_one: jax.Array, g_one: jax.Array) -> tuple[jax.Array, ...]:
        patches = _patches(module, x_one, d)
        rows_a2 = upper_sum_of_squares(patches)
        total, _ = blocked_sum(patches)
        centred = patches - (total / np.float32(d))[:, None]
        rows_g2 = monotone(upper_sum_of_squares(g_one), 1)  # of the exact s_hat G: one rounding more
        terms = _gram_terms(centred, upper_sqrt(rows_a2), g_one, upper_sqrt(rows_g2), fmt)
        return (*terms, upper_sum(rows_a2), upper_sum(rows_g2))

    *terms, a2, scaled_g2 = chunked(ghost_one, (x, flat_g * geometry.s_hat), **chunking)
    square = _ghost_square(fmt, positions, d, p, geometry.kappa_centre, *terms, a2, scaled_g2)
    return upper_sqrt(square) + monotone(
        geometry.s_hat_max * (sum_error + np.float32(geometry.kappa) * (ag + sum_error)), 4
    )


def wsconv(
    module: WSConv,
    params: PyTree,
    x: jax.Array,
    g: jax.Array,
    strategy: Strategy,
    precision: ClipPrecision,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[jax.Array, Summer]:
    """A weight-standardised convolution's ``(q, summer)`` on ``strategy``, from its recorded input
    ``x`` [b, K, h, w, c] and output gradient ``g`` [b, K, h', w', p].

    Guarantee: for every example i, ``q_i >= ||v_i||^2`` exactly, where ``v_i`` is the kernel's (and
    bias's) gradient that ``summer`` adds for i: the fold of i's own centred product, per example, as
    computed (explicit, grouped: held; streamed, ghost: formed again by the summer, its distance to
    what the norm measured bounded by the products' rounding at both precisions and the fold's), and
    ``summer`` adds ``sum_i w_i v_i`` over examples in blocks (``example_sum``), whose rounding is
    bounded by the clipped norms alone. Rounding model: ``privacy.rounding`` (each operation within
    ``u`` relative plus the smallest normal; any order of summation; contractions at ``precision``).
    """
    kernel = params["kernel"]
    geometry = WsGeometry.of(module, kernel)
    d, p, fmt = geometry.d, kernel.shape[-1], precision.norm_format
    positions = math.prod(g.shape[1:-1])
    bias = hold({"bias": jnp.sum(g.reshape(g.shape[0], positions, p), axis=1)}) if module.use_bias else {}
    bias_q = [held_square_bound(bias)] if bias else []
    work = chunk_work(strategy, positions, d, p)
    folded_one = _ws_folded(module, geometry, kernel.shape, strategy)

    if strategy in HELD_STRATEGIES:
        folded = chunked(lambda *xs: folded_one(fmt, *xs), (x, g), work, chunk_bytes=chunk_bytes, held=True)
        if x.shape[0] < 2:  # one example: one iteration, which XLA inlines
            folded = hold(folded)
        per_example = {"kernel": folded.reshape((-1,) + kernel.shape), **bias}
        return held_square_bound(per_example), lambda weights, finite: held_sum(per_example, weights, finite)

    x, g = hold((x, g))  # the norm and the sum read the same recorded values
    flat_g = g.reshape(g.shape[0], positions, p)
    a2, g2 = _patches_square_bound(module, x), upper_sum_of_squares(flat_g)
    ag, norm_error = _product_errors(fmt, positions, d, p, a2, g2)
    _, sum_error = _product_errors(precision.sum_format, positions, d, p, a2, g2)
    chunking = {"bytes_per_example": work, "chunk_bytes": chunk_bytes}
    if strategy == "streamed":
        layer = _ws_streamed_norm(module, geometry, x, flat_g, fmt, (norm_error, sum_error), **chunking)
    else:
        layer = _ws_ghost_norm(module, geometry, x, flat_g, fmt, (ag, sum_error), **chunking)

    def summer(weights: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
        kernel_sum = chunked_sum(
            lambda x_one, g_one: folded_one(precision.sum_format, x_one, g_one),
            (x, g),
            weights,
            finite,
            sum_work(positions, d, p),
            chunk_bytes=chunk_bytes,
        )
        return {"kernel": kernel_sum.reshape(kernel.shape), **held_sum(bias, weights, finite)}

    return sum_bounds([monotone(layer * layer, 1), *bias_q]), summer


def dense(
    module: nn.Dense,
    params: PyTree,
    x: jax.Array,
    g: jax.Array,
    strategy: Strategy,
    precision: ClipPrecision,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[jax.Array, Summer]:
    """A plain dense layer's ``(q, summer)`` on ``strategy``, from its recorded input ``x`` [b, K, ..., f]
    and output gradient ``g`` [b, K, ..., o].

    Guarantee: for every example i, ``q_i >= ||v_i||^2`` exactly, where ``v_i`` is what ``summer``
    adds for i: the held product (explicit, grouped), the product formed again at the sum precision
    (streamed, ghost, several positions), or, with one position an example, the exact rank-one
    ``x_i g_i^T`` whose entries the block contractions multiply out; the sum over examples is in
    blocks (``example_sum``). Rounding model: ``privacy.rounding``, as for ``wsconv``.
    """
    b, fan_in, fan_out = x.shape[0], x.shape[-1], g.shape[-1]
    flat_x, flat_g = x.reshape(b, -1, fan_in), g.reshape(b, -1, fan_out)
    positions, fmt = flat_x.shape[1], precision.norm_format
    bias = hold({"bias": jnp.sum(flat_g, axis=1)}) if module.use_bias else {}
    bias_q = [held_square_bound(bias)] if bias else []
    if strategy in HELD_STRATEGIES:  # a dense layer has no patches: one contraction either way
        per_example = {"kernel": hold(contract(fmt, "btf,bto->bfo", flat_x, flat_g)), **bias}
        return held_square_bound(per_example), lambda weights, finite: held_sum(per_example, weights, finite)

    flat_x, flat_g = hold((flat_x, flat_g))  # the norm and the sum read the same recorded values
    a2, g2 = upper_sum_of_squares(flat_x), upper_sum_of_squares(flat_g)
    _, norm_error = _product_errors(fmt, positions, fan_in, fan_out, a2, g2)
    sum_fmt = precision.sum_format
    # One position: the summer's block contractions add the exact products x_i (w_i g_i)^T, and only
    # the exact gradient's norm needs a bound. Several (views): v' is formed again at the sum
    # precision, within err_sum of the exact gradient.
    _, sum_error = _product_errors(sum_fmt, positions, fan_in, fan_out, a2, g2)
    formed = np.float32(0.0) if positions == 1 else sum_error
    work = chunk_work(strategy, positions, fan_in, fan_out)
    if strategy == "streamed":

        def norm_one(x_one: jax.Array, g_one: jax.Array) -> jax.Array:
            return upper_sum_of_squares(contract(fmt, "tf,to->fo", x_one, g_one), keep=0)

        q = chunked(norm_one, (flat_x, flat_g), work, chunk_bytes=chunk_bytes)
        layer = upper_sqrt(q) + monotone(norm_error + formed, 1)
    else:

        def ghost_one(x_one: jax.Array, g_one: jax.Array) -> tuple[jax.Array, ...]:
            rows_x = upper_sqrt(upper_sum_of_squares(x_one))
            rows_g = upper_sqrt(upper_sum_of_squares(g_one))
            return _gram_terms(x_one, rows_x, g_one, rows_g, fmt)

        terms = chunked(ghost_one, (flat_x, flat_g), work, chunk_bytes=chunk_bytes)
        square = _ghost_square(fmt, positions, fan_in, fan_out, 0.0, *terms, a2, g2)
        layer = upper_sqrt(square) + formed

    def summer(weights: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
        if positions == 1:
            kernel_sum = weighted_outer_sum(flat_x[:, 0], flat_g[:, 0], weights, finite)
        else:
            kernel_sum = chunked_sum(
                lambda x_one, g_one: contract(sum_fmt, "tf,to->fo", x_one, g_one),
                (flat_x, flat_g),
                weights,
                finite,
                sum_work(positions, fan_in, fan_out),
                chunk_bytes=chunk_bytes,
            )
        return {"kernel": kernel_sum, **held_sum(bias, weights, finite)}

    return sum_bounds([monotone(layer * layer, 1), *bias_q]), summer


def book_keeping_gradients(
    calls: list[bookkeeping.LayerCall],
    params: PyTree,
    xs: list[jax.Array],
    gs: list[jax.Array],
    states: list[PyTree],
    precision: ClipPrecision,
) -> dict[str, jax.Array]:
    """Per-example gradients by book-keeping's rules, summed over the calls of one layer: to be held
    (``clipping.hold``, all such layers at once) before ``held_square_bound`` and ``held_sum``."""
    per_example: dict[str, jax.Array] = {}
    for call, x, g, state in zip(calls, xs, gs, states):
        grads = bookkeeping.per_example_layer_gradients(call, params, x, g, state, precision=precision.norm_format)
        for name, grad in grads.items():
            per_example[name] = grad if name not in per_example else per_example[name] + grad
    return per_example
