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
  pairwise, so D is ``SUM_BLOCK`` plus a few levels per doubling of n (``sum_depth``), not n; a
  streamed or ghost layer adds its chunks' sums as two floats (``accumulate``), exact but for the
  lows' own rounding (``u^2 m^2`` of the total for m <= MAX_PARTS chunks).

Every weight is then scaled by ``sum_scale(n) = 1 / (1 + 2 gamma_D n + 2 u^2 MAX_PARTS^2 n)``:
``||t_i|| <= c`` and the difference above is at most 1 (c = 0.99971 at n = 128: the clip pays for the
float32 sum of its whole micro-batch, not only for each example's own rounding).

A step adds its micro-batches' sums too. The sampler puts a step's examples in random slots, so the
neighbour without j is the same step with j's slot empty: only j's micro-batch's sum changes. The DP
step adds the devices' shares of a micro-batch (an all-reduce: ``devices - 1`` more roundings a term)
and the micro-batches' sums exactly, as two floats (``two_sum``: the error of each addition is kept,
and only the errors' own sum rounds, by ``u^2`` of the total), and rounds the total to float32 once
before the noise, which moves it by at most ``u`` of its size, N slots' worth. So ``room`` takes, in a
``step_sums`` block, the step's slots N too:

    c = 1 / (1 + 2 gamma_D n + 2 u^2 MAX_PARTS^2 n + 2 u N + 4 u^2 m^2 N),
    D = sum_depth(n) + devices - 1,  m = ceil(N / n),

and the step's whole sum, rounded for the noise, moves by at most 1 (docs/privacy.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.privacy.rounding import U, gamma

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


#: The most parts whose sums a loop adds as two floats (``accumulate``): their lows' own rounding is
#: then at most ``u^2 MAX_PARTS^2 / 2`` of the total, which ``sum_scale`` covers.
MAX_PARTS = 256


def sum_scale(n: int) -> np.float32:
    """``c <= 1 / (1 + 2 gamma_D n + 2 u^2 MAX_PARTS^2 n)``, D = ``sum_depth(n)``, as a float32 rounded
    down: what every clip weight of a micro-batch of ``n`` slots is multiplied by, so its whole sum moves
    by at most 1 (the last term: the lows of parts added as two floats, ``accumulate``)."""
    return _float32_at_most(1.0 / (1.0 + 2.0 * gamma(sum_depth(n)) * n + 2.0 * U * U * MAX_PARTS**2 * n))


def _float32_at_most(exact: float) -> np.float32:
    """The largest float32 not above ``exact`` (a room rounded up would not be a bound)."""
    scale = np.float32(exact)
    return scale if float(scale) <= exact else np.nextafter(scale, np.float32(0))


@dataclasses.dataclass(frozen=True)
class StepSums:
    """How a DP step adds up its clipped sums: ``slots`` a micro-batch (all devices together),
    ``devices`` whose shares an all-reduce adds, and ``step_slots`` N, the most real examples a step
    holds (its capacity), whose float32 total is rounded once before the noise."""

    slots: int
    devices: int = 1
    step_slots: int = 0


_STEP: contextvars.ContextVar[StepSums | None] = contextvars.ContextVar("step_sums", default=None)


@contextlib.contextmanager
def step_sums(sums: StepSums) -> Iterator[None]:
    """Clipped sums traced inside size their room for the DP step that adds them up (``room``), not
    for the slice of a micro-batch they see: on a mesh each device clips its share, and with the whole
    micro-batch's room the update does not depend on the number of devices."""
    token = _STEP.set(sums)
    try:
        yield
    finally:
        _STEP.reset(token)


def room(local_slots: int) -> np.float32:
    """The scale ``c`` of every clip weight of a clipped sum over ``local_slots`` slots: for the sum
    over its micro-batch (``sum_scale``) or, inside ``step_sums``, for the DP step's whole sum."""
    step = _STEP.get()
    if step is None:
        return sum_scale(local_slots)
    n = max(local_slots, step.slots)
    big, m = max(step.step_slots, n), -(-max(step.step_slots, n) // n)
    parts = 2.0 * U * U * MAX_PARTS**2 * n
    return _float32_at_most(
        1.0
        / (1.0 + 2.0 * gamma(sum_depth(n) + step.devices - 1) * n + parts + 2.0 * U * big + 4.0 * U * U * m * m * big)
    )


def accumulate(total: tuple[jax.Array, jax.Array], part: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(high, low) + part`` as two floats: ``high`` takes the float32 sum and ``low`` its exact
    rounding error (``two_sum``), so ``high + low`` is the exact sum but for the lows' own rounding
    (at most ``u |low|`` an addition). ``high + low``, rounded once, is then within ``u`` of the exact
    sum of the parts, plus ``u^2 m^2 / 2`` of it for m parts: one rounding a term, whatever m."""
    high, low = total
    high, error = two_sum(high, part)
    return high, low + error


def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth's TwoSum: six additions,
    no branch; XLA does not reassociate float additions, tests/privacy/test_example_sum.py checks it)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


def pairwise_sum(x: jax.Array) -> jax.Array:
    """The sum over the leading axis by halving: each level one rounding per element, ``ceil(log2 k)``
    levels for k rows (zero rows pad k to a power of two once: zeros add exactly)."""
    rows = x.shape[0]
    size = 1 << max(rows - 1, 0).bit_length()
    if size != rows:
        x = jnp.pad(x, [(0, size - rows)] + [(0, 0)] * (x.ndim - 1))
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def _blocks(x: jax.Array) -> jax.Array:
    """``x`` [n, ...] as [ceil(n / b), b, ...] with b = min(n, SUM_BLOCK), zero-padded (zeros add
    exactly): fewer than SUM_BLOCK rows are one block as they are, not padded to SUM_BLOCK."""
    n = x.shape[0]
    size = min(n, SUM_BLOCK)
    blocks = -(-n // size)
    if blocks * size != n:
        x = jnp.pad(x, [(0, blocks * size - n)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((blocks, size) + x.shape[1:])


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
