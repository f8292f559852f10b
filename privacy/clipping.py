"""Per-example gradients, augmentation multiplicity and the clipped sum.

The one quantity DP-SGD privatises is

    S = sum_i  clip_C(g_i) / C,      g_i = (1/K) sum_k grad l(w, aug_k(x_i), y_i)

Averaging over the K views happens *inside* g_i, before clipping, so one example
still moves S by at most 1 (its sensitivity) however large K is. Dividing by C
after clipping is the normalised form of De et al. (2022): the learning rate
absorbs C, and the noise std is simply ``sigma * sensitivity`` with
sensitivity 1.

Padded slots (mask 0) and examples whose gradient is not finite get weight 0, by selects
that run on every step (no branch on the data, so the step's time does not depend on it).
Non-finite gradients are also counted, so a run can report them.

Speed: per-example norms are computed first and the clipped sum is then one
weighted contraction ``sum_i w_i g_i`` per parameter leaf; clipping each g_i
inside ``vmap`` is slower on CPU (benchmarks/results/model_throughput.md).

Floating point: the norms are proven upper bounds of the exact norms of what is summed
(``privacy.rounding``), and the weights cover their own division and the product ``w_i g_i``,
so each example's contribution has norm at most 1 exactly, not only up to rounding; the weights'
scale (``privacy.example_sum``) pays for the rounding of the sum over the other examples, so two
micro-batches that differ in one example give sums at most 1 apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.example_sum import pairwise_sum, room, two_sum, weighted_tree_sum
from dpscale.privacy.rounding import U, inflate, norm_bound, upper_sum_of_squares

PyTree = Any
# loss_fn(params, model_state, views) -> scalar mean loss over the leading (view) axis.
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


@struct.dataclass
class ClippedSum:
    """A sum of clipped, C-normalised per-example gradients and its sensitivity.

    ``sensitivity`` bounds how much adding or removing one example can change
    ``value`` in L2 norm: the noise must be calibrated against it. It is static
    (not traced), so it survives ``jit`` as a Python number.
    """

    value: PyTree
    num_examples: jax.Array  # real (unmasked) examples that went into the sum
    num_clipped: jax.Array  # real examples whose gradient norm exceeded C
    num_nonfinite: jax.Array  # real examples whose gradient was zeroed (NaN/Inf)
    sum_of_norms: jax.Array  # of the unclipped norms of finite real examples
    sum_of_losses: jax.Array  # of the (view-averaged) losses of finite real examples
    sensitivity: float = struct.field(pytree_node=False, default=1.0)
    # What float32 ``value`` leaves out of the exact sum of the parts added by ``plus`` (None: nothing):
    # a step's micro-batches are added as two floats, so their sum is exact up to u^2 of its size.
    value_error: PyTree = None

    def plus(self, other: ClippedSum) -> ClippedSum:
        """The sum over two *disjoint* sets of examples (e.g. two micro-batches).

        Each example is in one part only, so the sensitivity is the larger of the
        two, not their sum (an empty sum has sensitivity 0). The values are added with
        ``example_sum.two_sum``: the rounding error of each addition is kept in ``value_error``.
        """
        pair = jax.tree_util.tree_map(two_sum, self.value, other.value)
        value = jax.tree_util.tree_map(lambda p: p[0], pair, is_leaf=lambda x: isinstance(x, tuple))
        errors = [jax.tree_util.tree_map(lambda p: p[1], pair, is_leaf=lambda x: isinstance(x, tuple))]
        errors += [e for e in (self.value_error, other.value_error) if e is not None]
        counts = jax.tree_util.tree_map(
            jnp.add,
            self.replace(value=None, value_error=None, sensitivity=0.0),
            other.replace(value=None, value_error=None, sensitivity=0.0),
        )
        return counts.replace(
            value=value,
            value_error=jax.tree_util.tree_map(lambda *e: sum(e[1:], e[0]), *errors),
            sensitivity=max(self.sensitivity, other.sensitivity),
        )

    def summed(self) -> PyTree:
        """``value + value_error`` rounded once to float32: the sum the noise is added to."""
        if self.value_error is None:
            return self.value
        return jax.tree_util.tree_map(jnp.add, self.value, self.value_error)


@dataclasses.dataclass(frozen=True)
class ClippedSumFn:
    """A clipped-sum function ``(params, model_state, batch, mask) -> ClippedSum`` and its stated bound.

    ``sensitivity`` bounds, before any sum is computed, how far one example can move every sum
    ``fn`` returns: the DP step sizes its noise and its accumulators by it, so it must be known
    when the step is built, not read from the first result. ``layers`` says how each layer is
    clipped where that is chosen per layer (``privacy.ghost``), for the run's log and the tests.
    """

    fn: Callable[[PyTree, PyTree, PyTree, jax.Array], ClippedSum]
    sensitivity: float
    layers: tuple[Any, ...] = ()

    def __call__(self, params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        return self.fn(params, model_state, batch, mask)


def per_example_gradients(
    loss_fn: LossFn, params: PyTree, model_state: PyTree, batch: PyTree
) -> tuple[jax.Array, PyTree]:
    """Loss and gradient of each example, averaged over its augmentation views.

    ``batch`` leaves have shape ``[b, K, ...]``: b examples with K augmented views
    each. ``loss_fn`` sees one example's K views as a batch and returns their mean
    loss, so its gradient *is* the mean of the K view gradients: the average
    happens before any clipping. Returns losses ``[b]`` and gradient leaves shaped
    ``[b, *param.shape]``.
    """
    value_and_grad_one = jax.value_and_grad(loss_fn)
    return jax.vmap(value_and_grad_one, in_axes=(None, None, 0))(params, model_state, batch)


def hold(tree: PyTree) -> PyTree:
    """The same per-example values (leading axis), read from one buffer by every consumer.

    XLA may fuse a value's computation into each of its consumers and so compute it once per
    consumer, with different roundings (a multiply-add contracted in one, a reduction ordered
    otherwise in another): a norm would then bound another vector than the one summed (measured:
    2e-6 over on a WS layer, 24% on a constant image's gradient). A loop's outputs are buffers,
    which no consumer recomputes, so the values pass through a scan of at least two iterations
    (an optimisation barrier does not do it: XLA's CPU backend removes it before fusing).
    The values are multiplied by a loop-carried 1, which is exact (a subnormal may be flushed to zero:
    the held value is then the smaller) and which XLA may fold away: what keeps them buffers is the
    loop's two iterations or more (XLA inlines a loop of one).

    One loop a layer, not one for the whole model: tried (2026-11-28), one loop compiled WRN-16-4's DP
    program with an accelerator's settings 15% faster on a CPU, but XLA then kept more of the layers'
    working sets live at once (temporary memory +17-25%, 2.7x with every layer ghost), which the memory
    guard, counting one layer at a time, does not see (benchmarks/results/gpu_step_cost.md).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    size = leaves[0].shape[0]
    _, out = jax.lax.scan(
        lambda one, xs: (one, [x * one.astype(x.dtype) for x in xs]),
        jnp.ones((), jnp.float32),
        [_in_parts(x) for x in leaves],
    )
    return jax.tree_util.tree_unflatten(treedef, [x.reshape((-1,) + x.shape[2:])[:size] for x in out])


def _in_parts(x: jax.Array) -> jax.Array:
    """``x`` [b, ...] as [parts, b / parts, ...] with at least two parts: the fewest that divide b,
    or, for b = 1, the example and an empty one (all zeros) after it."""
    size = x.shape[0]
    if size == 1:
        return jnp.stack([x, jnp.zeros_like(x)])
    parts = next(k for k in range(2, size + 1) if size % k == 0)
    return x.reshape((parts, size // parts) + x.shape[1:])


def per_example_norms(per_example_grads: PyTree) -> jax.Array:
    """An upper bound (within ~10^-5) of each example's global L2 norm across all parameter leaves.

    Proven for any order of summation (``privacy.rounding``); a norm too large for float32 is inf.
    """
    leaves = jax.tree_util.tree_leaves(per_example_grads)
    return norm_bound([upper_sum_of_squares(g) for g in leaves])


# The division c / max(C, n) rounds by at most 2u (correctly rounded or not), and each product
# w_i g_i by u: a bound inflated by this many units of roundoff keeps ||w_i g_i|| <= 1 after both.
_WEIGHT_ULPS = 8


def clip_weights(
    norms: jax.Array, mask: jax.Array, *, clip_norm: float, scale: np.float32 | None = None
) -> tuple[jax.Array, jax.Array]:
    """Weights w_i with ``w_i * g_i = c clip_C(g_i) / C`` and a per-example finiteness flag.

    ``min(1, C/n) / C == 1 / max(C, n)``; ``norms`` must be upper bounds of the norms of what
    the weights multiply. ``c`` (``scale``; by default ``example_sum.room`` of the ``norms``' slots)
    leaves room for the float32 sum over the micro-batch, so the whole sum, not only each example's
    share, moves by at most 1. Masked and non-finite examples get 0.
    """
    scale = room(norms.shape[0]) if scale is None else scale
    finite = jnp.isfinite(norms)
    bound = inflate(norms.astype(jnp.float32), _WEIGHT_ULPS * U)
    weights = jnp.where(finite & (mask > 0), scale / jnp.maximum(jnp.float32(clip_norm), bound), 0.0)
    return weights.astype(jnp.float32), finite


def clipped_sum_from_gradients(
    per_example_grads: PyTree,
    mask: jax.Array,
    *,
    clip_norm: float,
    losses: jax.Array | None = None,
) -> ClippedSum:
    """Clip (to C, then divide by C) and sum given per-example gradients.

    A part of the examples at a time, in a scan of at least two iterations: each part's norms and
    its share of the weighted sum read the part from the scan's input, one buffer, so every norm
    bounds exactly the vector summed (``hold`` says why that takes a loop), with no copy of the
    gradients. The parts' sums are added pairwise (``privacy.example_sum``).
    """
    size = mask.shape[0]
    scale = room(size)  # the whole micro-batch's, not a part's: the sum runs over all of it

    def part(carry: None, xs: tuple[PyTree, jax.Array]) -> tuple[None, tuple[PyTree, jax.Array]]:
        grads, part_mask = xs
        norms = per_example_norms(grads)
        weights, finite = clip_weights(norms, part_mask, clip_norm=clip_norm, scale=scale)
        return carry, (weighted_tree_sum(grads, weights, finite), norms)

    parts = (jax.tree_util.tree_map(_in_parts, per_example_grads), _in_parts(mask))
    _, (sums, norms) = jax.lax.scan(part, None, parts)
    value = jax.tree_util.tree_map(pairwise_sum, sums)
    return clipped_sum_from_norms(
        norms.reshape(-1)[:size], mask, clip_norm=clip_norm, losses=losses, weighted=lambda weights, finite: value
    )


def clipped_sum_from_norms(
    norms: jax.Array,
    mask: jax.Array,
    *,
    clip_norm: float,
    weighted: Callable[[jax.Array, jax.Array], PyTree],
    losses: jax.Array | None = None,
) -> ClippedSum:
    """The clipped sum from each example's gradient norm and ``weighted(weights, finite) = sum_i w_i g_i``.

    One place for the clip weights, the NaN guard's flags and the counts, whichever way the
    norms and the weighted sum are formed (per-example gradients, book-keeping, ghost norms);
    ``weighted`` must leave out the examples whose ``finite`` flag is False.
    """
    weights, finite = clip_weights(norms, mask, clip_norm=clip_norm)
    real = mask > 0
    return ClippedSum(
        value=weighted(weights, finite),
        sensitivity=1.0,
        num_examples=jnp.sum(real).astype(jnp.int32),
        num_clipped=jnp.sum(real & finite & (norms > clip_norm)).astype(jnp.int32),
        num_nonfinite=jnp.sum(real & ~finite).astype(jnp.int32),
        sum_of_norms=jnp.sum(jnp.where(real & finite, norms, 0.0)),
        sum_of_losses=(
            jnp.zeros((), jnp.float32) if losses is None else jnp.sum(jnp.where(real & finite, losses, 0.0))
        ),
    )


def make_clipped_sum_fn(loss_fn: LossFn, *, clip_norm: float) -> ClippedSumFn:
    """The clipped sum through per-example gradients (``vmap(grad)``), sensitivity 1."""
    check_clip_norm(clip_norm)

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        check_float32_params(params)
        losses, grads = per_example_gradients(loss_fn, params, model_state, batch)
        return clipped_sum_from_gradients(grads, mask, clip_norm=clip_norm, losses=losses)

    return ClippedSumFn(clipped_sum, sensitivity=1.0)


def check_float32_params(params: PyTree) -> None:
    """Every parameter is float32: a sum kept in a lower precision would round each example's
    clipped gradient beyond its bound (bf16: by 2^-9)."""
    wrong = sorted({str(jnp.result_type(leaf)) for leaf in jax.tree_util.tree_leaves(params)} - {"float32"})
    if wrong:
        raise InvalidConfigError(f"DP-SGD needs float32 parameters, got {', '.join(wrong)}")


def make_unclipped_sum_fn(loss_fn: LossFn) -> ClippedSumFn:
    """The NON-private counterpart: ``sum_i g_i`` by one batched backward pass.

    For non-private baselines and public pre-training only. Its sensitivity is
    infinite, so ``DpsgdStep`` refuses to pair it with noise (noise multiplier 0).
    """

    def unclipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        def total_loss(p: PyTree) -> tuple[jax.Array, jax.Array]:
            losses = jax.vmap(loss_fn, in_axes=(None, None, 0))(p, model_state, batch)
            return jnp.sum(jnp.where(mask > 0, losses, 0.0)), losses

        (loss_sum, _), grads = jax.value_and_grad(total_loss, has_aux=True)(params)
        zero = jnp.zeros((), jnp.float32)
        return ClippedSum(
            value=grads,
            num_examples=jnp.sum(mask > 0).astype(jnp.int32),
            num_clipped=jnp.zeros((), jnp.int32),
            num_nonfinite=jnp.zeros((), jnp.int32),
            sum_of_norms=zero,
            sum_of_losses=loss_sum,
            sensitivity=float("inf"),
        )

    return ClippedSumFn(unclipped_sum, sensitivity=float("inf"))
