"""Proven floating-point bounds for per-example norms, and the precision the contractions run at.

Why: a clip weight ``1 / max(C, n_i)`` keeps example i's contribution ``w_i v_i`` within norm 1
only if ``n_i >= ||v_i||`` for the vector ``v_i`` that is actually summed. A norm computed in
float32 can come out *below* it: a long sum of squares rounds, and a norm formed from other
numbers than the summed vector (ghost norms, the streamed path, the folded weight
standardisation) can lose all its digits to cancellation. So every path clips with an *upper
bound* built here from the standard error bounds, which hold for any order of summation
(Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3-4):

* one rounding: ``fl(x op y) = (x op y)(1 + e) + t``, ``|e| <= u``, ``|t| <= TINY`` (results below
  the smallest normal may be flushed to zero, as XLA does on CPU; inputs below it may be read as
  zero);
* a sum of nonnegative terms whose every term goes through at most D roundings is within a
  factor ``1 + gamma_D`` of the exact sum, ``gamma_D = D u / (1 - D u)``;
* a contraction of length n (``A^T B``, any order, products rounded or exact) is within
  ``gamma_n |A|^T |B|`` entrywise, so within ``gamma_n ||A||_F ||B||_F`` in Frobenius norm.

Long sums are made short on purpose: ``blocked_sum`` adds BLOCK terms at a time and fences
each level's partial sums with an optimisation barrier (so XLA cannot merge the levels into one
reduction of unknown order), which turns ``gamma_n`` for n in the millions into
``gamma_{levels * BLOCK}``, about 10^-5.

Precision. The per-example contractions may run at a reduced precision for speed on GPUs
(``FORMATS``: TF32 or bf16 inputs, float32 accumulation, as tensor cores do). The inputs are
rounded to the format here, explicitly (so the hardware's own conversion is exact, and a CPU runs
the same arithmetic), and the format's roundoff enters the bounds: a lower precision costs a
larger margin, never the bound. Which precision each backend uses is ``privacy.tuning.device``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.privacy.checks import check_choice

#: Unit roundoff of float32 with round-to-nearest (additions, products, reductions).
U = 2.0**-24
#: The smallest normal float32: the absolute error of one rounding near underflow.
TINY = float(np.finfo(np.float32).tiny)
#: Terms added at a time by ``blocked_sum``.
BLOCK = 64


def gamma(n: int, u: float = U) -> float:
    """``n u / (1 - n u)``: the relative error of n roundings of unit roundoff u."""
    if n * u >= 0.5:
        raise ValueError(f"gamma({n}) at u = {u} is not a useful bound")
    return n * u / (1 - n * u)


@dataclasses.dataclass(frozen=True)
class Format:
    """How a contraction's products are formed: its inputs' roundoff and its accumulation's.

    ``input_roundoff`` is 0 for float32 inputs used as they are; TF32 keeps 10 mantissa bits
    (2^-11), bf16 7 (2^-8), rounded to nearest here. Products of such inputs are exact in
    float32; ``accumulate_roundoff`` is one ulp (2^-23) for the reduced formats, because
    tensor cores' adders may truncate instead of rounding (Fasi et al. 2021).
    """

    name: str
    input_roundoff: float
    accumulate_roundoff: float
    lax_precision: jax.lax.Precision
    cast: Callable[[jax.Array], jax.Array]

    def round(self, x: jax.Array) -> jax.Array:
        return self.cast(x.astype(jnp.float32))

    def error(self, length: int) -> float:
        """Relative error of a contraction of ``length`` products: ``|fl(A^T B) - A^T B| <= error |A|^T |B|``."""
        u_in = self.input_roundoff
        return 2 * u_in + u_in * u_in + gamma(length, self.accumulate_roundoff) * (1 + u_in) ** 2


def _tf32(x: jax.Array) -> jax.Array:
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)


def _bf16(x: jax.Array) -> jax.Array:
    # bf16 values kept in float32 arrays: every contraction then has one dtype, and its own
    # conversion of such values (to TF32 or bf16) is exact.
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


FORMATS: dict[str, Format] = {
    "highest": Format("highest", 0.0, U, jax.lax.Precision.HIGHEST, lambda x: x),
    "tf32": Format("tf32", 2.0**-11, 2.0**-23, jax.lax.Precision.HIGH, _tf32),
    "bf16": Format("bf16", 2.0**-8, 2.0**-23, jax.lax.Precision.DEFAULT, _bf16),
}


@dataclasses.dataclass(frozen=True)
class ClipPrecision:
    """The formats of the per-example contractions: ``norms`` (what a norm is computed from: the
    per-example products and Gram matrices) and ``sums`` (the products a streamed or ghost layer
    forms again for its weighted sum). The sums over examples always run at full float32: they
    are memory-bound at any precision, and a TF32 default would round each term beyond its bound."""

    norms: str = "highest"
    sums: str = "highest"

    def __post_init__(self) -> None:
        check_choice(self.norms, tuple(FORMATS), "norm precision")
        check_choice(self.sums, tuple(FORMATS), "sum precision")

    @property
    def norm_format(self) -> Format:
        return FORMATS[self.norms]

    @property
    def sum_format(self) -> Format:
        return FORMATS[self.sums]


def contract(fmt: Format, subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(subscripts, a, b)`` in float32 with the products of format ``fmt``."""
    return jnp.einsum(
        subscripts, fmt.round(a), fmt.round(b), precision=fmt.lax_precision, preferred_element_type=jnp.float32
    )


def underflow(products: int, *norms: jax.Array) -> jax.Array:
    """Absolute error from underflow in a contraction of ``products`` products whose operands have
    Frobenius norms at most ``norms``: each product may lose TINY times (1 + its operands), an
    input read as zero included, and each addition TINY."""
    return np.float32(4 * products * TINY) * (1 + sum(norms))


def blocked_depth(n: int) -> int:
    """The most roundings a term goes through in ``blocked_sum`` of n terms."""
    depth = 0
    while n > BLOCK:
        n, depth = -(-n // BLOCK), depth + BLOCK - 1
    return depth + max(n - 1, 0)


def blocked_sum(x: jax.Array, axis: int = -1) -> tuple[jax.Array, int]:
    """The sum over ``axis``, BLOCK terms at a time, and ``blocked_depth`` of its length."""
    axis = axis % x.ndim
    depth = blocked_depth(x.shape[axis])
    while x.shape[axis] > BLOCK:
        n = x.shape[axis]
        blocks = -(-n // BLOCK)
        if blocks * BLOCK != n:  # zeros add exactly
            x = jnp.pad(x, [(0, blocks * BLOCK - n if i == axis else 0) for i in range(x.ndim)])
        x = x.reshape(x.shape[:axis] + (blocks, BLOCK) + x.shape[axis + 1 :])
        x = jax.lax.optimization_barrier(jnp.sum(x, axis=axis + 1))
    return jnp.sum(x, axis=axis), depth


def inflate(x: jax.Array, rel: float) -> jax.Array:
    """A float32 value ``>= x (1 + rel)`` for ``x >= 0`` (non-finite stays non-finite).

    The factor ``c = fl(1 + rel + 4u) >= (1 + rel + 4u)(1 - u)`` and ``fl(x c) >= x c (1 - u)``,
    so the result is ``>= x (1 + rel + 4u)(1 - u)^2 >= x (1 + rel)`` for rel < 1/2.
    """
    return x * np.float32(1 + rel + 4 * U)


def upper_sum(x: jax.Array) -> jax.Array:
    """An upper bound of the exact sum of the nonnegative float values ``x`` over its last axis."""
    total, depth = blocked_sum(x)
    n = x.shape[-1]
    # exact <= (computed + 2 n TINY)(1 + gamma_depth); the addition of the TINY term rounds once more.
    return inflate(total + np.float32(4 * n * TINY), gamma(depth + 1) + U)


def upper_sum_of_squares(x: jax.Array, *, keep: int = 1) -> jax.Array:
    """An upper bound of the exact sum of squares of ``x`` over all axes after the first ``keep``.

    Each square rounds once more than the sum (``x^2 <= (fl(x^2) + TINY) / (1 - u)``), which the
    extra TINY per term and one more roundoff cover. Squares that overflow make the bound inf.
    """
    x = x.astype(jnp.float32)
    flat = x.reshape(x.shape[:keep] + (-1,))
    total, depth = blocked_sum(flat * flat)
    n = flat.shape[-1]
    return inflate(total + np.float32(8 * n * TINY), gamma(depth + 2) + U)


def upper_sqrt(q: jax.Array) -> jax.Array:
    """``>= sqrt(q)``: a square root rounds by at most 2u even where it is not correctly rounded."""
    return inflate(jnp.sqrt(q), 2 * U)


def norm_bound(square_bounds: Sequence[jax.Array]) -> jax.Array:
    """``>= sqrt(sum_l q_l)``: the bound of a norm from upper bounds of its parts' squared norms."""
    stacked = jnp.stack([q.astype(jnp.float32) for q in square_bounds], axis=-1)
    return upper_sqrt(upper_sum(stacked))


def monotone(x: jax.Array, operations: int) -> jax.Array:
    """An upper bound of an expression computed by ``operations`` additions, products, square roots
    and divisions by exact constants of nonnegative upper bounds: each rounds by at most 2u, or by
    TINY near underflow."""
    return inflate(x + np.float32(2 * operations * TINY), gamma(2 * operations) + U)
