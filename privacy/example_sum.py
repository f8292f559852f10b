"""The sum over a micro-batch's examples, in an order whose rounding is bounded, and what it costs.

Why: a clip weight keeps each example's contribution ``t_i = w_i v_i`` within norm 1, but the
float32 sum ``fl(sum_i t_i)`` rounds by an amount that scales with *all* the terms, the other
examples' included. For neighbouring batches D and D' (one example j in or out; the others in any
slots) the computed sums differ by

    ||fl S(D) - fl S(D')||  <=  ||t_j||  +  gamma_D (sum_{i in D} ||t_i|| + sum_{i in D'} ||t_i||)
                            <=  ||t_j||  +  2 gamma_D n max_i ||t_i||,

where every term passes through at most D roundings on its way to the total (a sum of vectors in
any tree order is within ``gamma_D sum_i |t_i|`` entrywise, so in norm within
``gamma_D sum_i ||t_i||``; Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2) and n is
the number of slots. Two things keep this small and proven:

* every path sums vectors whose norms its clip bounds (held or re-formed per-example gradients,
  folded per example for weight standardisation), never intermediates that a per-example fold or a
  cancellation over positions would shrink afterwards: those can be any size, and their rounding
  with them;
* the sum over examples runs in blocks of ``SUM_BLOCK`` (one contraction each, any order) and then
  pairwise, so D is ``SUM_BLOCK`` plus a few levels per doubling of n (``sum_depth``), not n.

Every weight is then scaled by ``sum_scale(n) = 1 / (1 + 2 gamma_D n)``: ``||t_i|| <= c`` and the
difference above is at most ``c (1 + 2 gamma_D n) <= 1`` (0.99987 at n = 128: the clip pays
for the float32 sum of its whole micro-batch, not only for each example's own rounding).

Not bounded here: the sums over micro-batches and devices that the DP step adds up
(docs/privacy.md, "Sensitivity under floating point").
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.privacy.rounding import gamma

PyTree = Any
#: Examples summed by one contraction before the pairwise levels.
SUM_BLOCK = 8
_HIGHEST = jax.lax.Precision.HIGHEST


def sum_depth(n: int) -> int:
    """The most roundings a term goes through in any sum over ``n`` slots this package forms: a block
    contraction (at most ``SUM_BLOCK``), then at most ``ceil(log2 n) + 4`` pairwise levels (the blocks
    of a chunk, the chunks of a micro-batch, the parts of a held loop: each level halves what is left,
    and each split into uneven pieces adds at most one level)."""
    return SUM_BLOCK + math.ceil(math.log2(max(n, 1))) + 4


def sum_scale(n: int) -> np.float32:
    """``c <= 1 / (1 + 2 gamma_D n)``, D = ``sum_depth(n)``, as a float32 rounded down: what every clip
    weight of a micro-batch of ``n`` slots is multiplied by, so its whole sum moves by at most 1."""
    exact = 1.0 / (1.0 + 2.0 * gamma(sum_depth(n)) * n)
    scale = np.float32(exact)
    return scale if float(scale) <= exact else np.nextafter(scale, np.float32(0))


_SLOTS: contextvars.ContextVar[int] = contextvars.ContextVar("micro_batch_slots", default=0)


@contextlib.contextmanager
def micro_batch_slots(slots: int) -> Iterator[None]:
    """Clipped sums traced inside size their room for a micro-batch of ``slots`` (at least), not for
    the slice they see: on a mesh each device clips its share, and with the whole micro-batch's room
    the update does not depend on the number of devices (a larger n only makes the room safer)."""
    token = _SLOTS.set(slots)
    try:
        yield
    finally:
        _SLOTS.reset(token)


def room(local_slots: int) -> np.float32:
    """``sum_scale`` of the micro-batch a clipped sum belongs to: its own slots, or the whole
    micro-batch's where a ``micro_batch_slots`` block says so."""
    return sum_scale(max(local_slots, _SLOTS.get()))


def pairwise_sum(x: jax.Array) -> jax.Array:
    """The sum over the leading axis by halving: each level one rounding per element, ``ceil(log2 k)``
    levels for k rows (an odd row out waits, unrounded, for a later level)."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        paired = x[:half] + x[half : 2 * half]
        x = paired if x.shape[0] % 2 == 0 else jnp.concatenate([paired, x[2 * half :]])
    return x[0]


def _blocks(x: jax.Array) -> jax.Array:
    """``x`` [n, ...] as [ceil(n / SUM_BLOCK), SUM_BLOCK, ...], zero-padded (zeros add exactly)."""
    n = x.shape[0]
    blocks = -(-n // SUM_BLOCK)
    if blocks * SUM_BLOCK != n:
        x = jnp.pad(x, [(0, blocks * SUM_BLOCK - n)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((blocks, SUM_BLOCK) + x.shape[1:])


def guard(finite: jax.Array, a: jax.Array) -> jax.Array:
    """``a`` with the rows of non-finite examples zeroed (a zero weight alone keeps a NaN: 0 * NaN)."""
    return jnp.where(finite.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros((), a.dtype))


def weighted_sum(v: jax.Array, weights: jax.Array, finite: jax.Array) -> jax.Array:
    """``sum_i w_i v_i`` over the leading axis of ``v`` [n, ...], non-finite rows zeroed first, at full
    float32 (a TF32 default would round each ``v_i`` by 2^-11, beyond its norm's bound)."""
    kept = guard(finite, v.astype(jnp.float32))
    w = _blocks(weights.astype(jnp.float32))
    partial = jnp.einsum("kb,kb...->k...", w, _blocks(kept), precision=_HIGHEST)
    return pairwise_sum(partial).astype(v.dtype)


def weighted_tree_sum(tree: PyTree, weights: jax.Array, finite: jax.Array) -> PyTree:
    """``weighted_sum`` of every leaf of a tree of per-example arrays."""
    return jax.tree_util.tree_map(lambda v: weighted_sum(v, weights, finite), tree)


def weighted_outer_sum(x: jax.Array, g: jax.Array, weights: jax.Array, finite: jax.Array) -> jax.Array:
    """``sum_i x_i (w_i g_i)^T`` for one position an example (``x`` [n, f], ``g`` [n, o]): the sum of
    the per-example rank-one gradients without forming them. Each block is one contraction over
    its examples, whose products ``x_if w_i g_io`` are exactly the entries of ``t_i``, so the bound
    above holds as for held gradients (``||x_i (w_i g_i)^T|| = ||x_i|| ||w_i g_i||``). The blocks'
    [f, o] sums are formed a chunk of about ``sqrt(8 n)`` examples at a time, so at most that many
    are held at once, not n / SUM_BLOCK."""
    n = x.shape[0]
    x = guard(finite, x.astype(jnp.float32))
    scaled = guard(finite, g.astype(jnp.float32) * weights[:, None])

    def one_chunk(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        partial = jnp.einsum("kbf,kbo->kfo", _blocks(xs[0]), _blocks(xs[1]), precision=_HIGHEST)
        return pairwise_sum(partial)

    chunk = max(SUM_BLOCK, 2 ** int(math.log2(math.sqrt(SUM_BLOCK * n))))
    if chunk >= n:
        return one_chunk((x, scaled))
    chunks = -(-n // chunk)
    padded = [jnp.pad(a, [(0, chunks * chunk - n), (0, 0)]).reshape(chunks, chunk, -1) for a in (x, scaled)]
    return pairwise_sum(jax.lax.map(one_chunk, tuple(padded)))
