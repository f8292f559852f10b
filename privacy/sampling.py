"""Batch selection: truncated Poisson sampling in a fixed number of padded micro-batches.

The accountant's event (``privacy.accounting``) is *truncated* Poisson sampling: every example
joins the batch independently with probability q = B / N, and a batch larger than a fixed
``capacity`` keeps a uniformly random subset of ``capacity`` of them. dp-accounting accounts
for exactly this (``TruncatedSubsampledGaussianDpEvent``), so nothing is charged to delta.

Why truncate: a step's wall time must not depend on the private data. With plain Poisson
sampling the number of micro-batches follows the realised batch size, and per-step time
would tell it. Here every step has the same ``[num_microbatches, microbatch_size]`` shape whatever
was drawn. The capacity is ``B + k sqrt(B (1 - q))`` (``batch_capacity``), k standard deviations
of the Binomial batch size above B: the privacy plan picks the smallest k of a short ladder whose
truncation costs at most 0.1% of epsilon (``privacy.calibration.capacity_stds``; docs/privacy.md
gives the numbers and the compute it costs). It does not depend on the micro-batch size, so
``dpscale epsilon`` needs no layout to give a run's exact epsilon.
The capacity is spread over the fewest micro-batches of at most ``microbatch_size`` slots, in
equal slots (``Layout``), so a large micro-batch size wastes no slot. The drawn examples take random
slots, the padding the rest: so the step without one example is the same step with that slot empty,
which is what bounds the float32 sum of a whole step (``privacy.example_sum``).

Each step's sample is a pure function of (seed, step), so a resumed run draws the same batches
it would have drawn without the interruption. ``truncated_poisson_slots`` is the same
distribution inside ``jit``/``vmap`` (the many small models of an audit).

Shuffled fixed-size batches are available for comparison with non-private baselines, but the
Poisson accountant does not describe them: constructing a ``ShuffledSampler`` warns loudly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import TYPE_CHECKING

import numpy as np

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import check_positive, check_positive_integer, check_sampling_rate

if TYPE_CHECKING:  # JAX is imported where a batch is drawn: `dpscale epsilon` needs only the capacity
    import jax

_log = logging.getLogger(__name__)
PADDING_INDEX = -1
#: Standard deviations of the Binomial batch size between B and the capacity, by default.
CAPACITY_STDS = 4.0


def batch_capacity(num_examples: int, expected_batch_size: float, *, stds: float = CAPACITY_STDS) -> int:
    """The most examples a step holds: B plus ``stds`` standard deviations of Binomial(N, q), at most N + 1.

    N + 1 holds every example of the larger neighbour (the accountant's data set): then
    nothing is ever truncated, e.g. at q = 1, where a capacity of N would always truncate it."""
    _check_sizes(num_examples, expected_batch_size, 1)
    rate = expected_batch_size / num_examples
    if rate >= 1:  # full batches: no spread, but the larger neighbour's N + 1 must fit
        return int(num_examples) + 1
    spread = stds * math.sqrt(expected_batch_size * (1 - rate))
    return min(int(num_examples) + 1, math.ceil(expected_batch_size + spread))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How ``capacity`` slots are cut: ``num_microbatches`` micro-batches of ``microbatch_size`` slots.

    The fewest micro-batches of at most ``microbatch_size`` slots that hold the capacity, each
    of equal size rounded up to a multiple of ``multiple`` (the number of devices).
    """

    num_microbatches: int
    microbatch_size: int

    @classmethod
    def of(cls, capacity: int, *, microbatch_size: int, multiple: int = 1) -> Layout:
        if capacity <= 0 or microbatch_size <= 0 or multiple <= 0:
            raise InvalidConfigError(
                f"capacity, micro-batch size and multiple must be positive, got "
                f"{capacity}, {microbatch_size}, {multiple}"
            )
        count = math.ceil(capacity / microbatch_size)
        size = multiple * math.ceil(math.ceil(capacity / count) / multiple)
        return cls(num_microbatches=count, microbatch_size=max(size, 1))

    @property
    def slots(self) -> int:
        return self.num_microbatches * self.microbatch_size


@dataclasses.dataclass(frozen=True)
class SampledBatch:
    """One logical batch as ``[num_microbatches, microbatch_size]`` indices and mask."""

    indices: np.ndarray  # int64, PADDING_INDEX in padded slots
    mask: np.ndarray  # float32, 1 for a real example, 0 for padding

    @property
    def size(self) -> int:
        """Number of real examples in the batch."""
        return int(self.mask.sum())

    @property
    def num_microbatches(self) -> int:
        return int(self.indices.shape[0])


def pad_into(indices: np.ndarray, layout: Layout, *, slots: np.ndarray | None = None) -> SampledBatch:
    """``indices`` in the slots of ``layout`` (the first ones, or ``slots``: one distinct slot each), the
    rest padded with -1 (mask 0)."""
    count = len(indices)
    if count > layout.slots:
        raise ValueError(f"{count} examples do not fit {layout.slots} slots")
    where = np.arange(count) if slots is None else np.asarray(slots)
    padded = np.full(layout.slots, PADDING_INDEX, dtype=np.int64)
    padded[where] = indices
    mask = np.zeros(layout.slots, dtype=np.float32)
    mask[where] = 1.0
    shape = (layout.num_microbatches, layout.microbatch_size)
    return SampledBatch(indices=padded.reshape(shape), mask=mask.reshape(shape))


def _check_sizes(num_examples: int, batch_size: float, microbatch_size: int) -> None:
    check_positive_integer(num_examples, "number of examples")
    check_positive(batch_size, "batch size")
    check_sampling_rate(batch_size / num_examples)
    check_positive_integer(microbatch_size, "micro-batch size")


class PoissonSampler:
    """Poisson sampling at rate ``expected_batch_size / num_examples``, truncated to ``capacity``."""

    def __init__(
        self,
        *,
        num_examples: int,
        expected_batch_size: float,
        microbatch_size: int,
        seed: int,
        capacity: int | None = None,
        multiple: int = 1,
    ) -> None:
        _check_sizes(num_examples, expected_batch_size, microbatch_size)
        self.num_examples = num_examples
        self.expected_batch_size = float(expected_batch_size)
        self.sampling_rate = self.expected_batch_size / num_examples
        self.capacity = batch_capacity(num_examples, expected_batch_size) if capacity is None else int(capacity)
        if not 0 < self.capacity <= num_examples + 1:
            raise InvalidConfigError(f"batch capacity must be in (0, {num_examples + 1}], got {self.capacity}")
        self.layout = Layout.of(self.capacity, microbatch_size=microbatch_size, multiple=multiple)
        self.microbatch_size = self.layout.microbatch_size
        self._seed = seed

    #: The accountant's truncated-Poisson event describes this sampler exactly.
    exact_accounting = True

    def sample(self, step: int) -> SampledBatch:
        """The batch of optimiser step ``step``, always in ``self.layout``.

        Drawing the size from Binomial(N, q), capping it at the capacity and then drawing a
        uniform subset of that size is the same distribution as N independent Bernoulli(q)
        draws followed by a uniform subset of ``capacity`` of them when there are more, in
        O(batch) memory rather than O(N).
        """
        from dpscale.privacy.streams import Stream, stream_rng

        rng = stream_rng(self._seed, Stream.SAMPLING, step)
        size = min(int(rng.binomial(self.num_examples, self.sampling_rate)), self.capacity)
        chosen = np.sort(rng.choice(self.num_examples, size=size, replace=False))
        # Random slots, not the first ones: a neighbour without one example is then the same step
        # with that example's slot empty, and only its micro-batch's clipped sum rounds otherwise
        # (privacy.example_sum). The slots are a uniform injection of the chosen examples, whichever
        # they are, so leaving one out leaves the others' slots uniform too.
        return pad_into(chosen, self.layout, slots=rng.permutation(self.layout.slots)[:size])


class ShuffledSampler:
    """Fixed-size batches from a fresh permutation each epoch (NOT what is accounted for)."""

    exact_accounting = False

    def __init__(
        self, *, num_examples: int, batch_size: int, microbatch_size: int, seed: int, multiple: int = 1
    ) -> None:
        _check_sizes(num_examples, batch_size, microbatch_size)
        message = (
            "Shuffled fixed-size batches are not Poisson sampling: the epsilon reported by "
            "the Poisson accountant is NOT an exact guarantee for this run. Use Poisson "
            "sampling (the default) for a real privacy claim."
        )
        warnings.warn(message, UserWarning, stacklevel=2)
        _log.warning(message)
        self.num_examples = num_examples
        self.batch_size = int(batch_size)
        self.expected_batch_size = float(batch_size)
        self.sampling_rate = batch_size / num_examples
        self.capacity = self.batch_size
        self.layout = Layout.of(self.batch_size, microbatch_size=microbatch_size, multiple=multiple)
        self.microbatch_size = self.layout.microbatch_size
        self.steps_per_epoch = num_examples // self.batch_size
        self._seed = seed

    def sample(self, step: int) -> SampledBatch:
        from dpscale.privacy.streams import Stream, stream_rng

        epoch, position = divmod(step, self.steps_per_epoch)
        rng = stream_rng(self._seed, Stream.SAMPLING, epoch)
        order = rng.permutation(self.num_examples)
        start = position * self.batch_size
        chosen = np.sort(order[start : start + self.batch_size])
        return pad_into(chosen, self.layout)


def truncated_poisson_slots(
    key: jax.Array, sampling_rate: float, eligible: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """``PoissonSampler``'s distribution inside ``jit``/``vmap``: (indices, mask) of ``capacity`` slots.

    Every eligible row (a boolean ``[rows]``: the data set of this model) joins with
    probability q; if more than ``capacity`` joined, a uniformly random ``capacity`` of them are
    kept (those with the smallest of independent uniform priorities), in random slots. Padding
    points at row 0 with mask 0. The work is the same whatever was drawn.
    """
    import jax
    import jax.numpy as jnp

    join_key, order_key, slot_key = jax.random.split(key, 3)
    chosen = jax.random.bernoulli(join_key, sampling_rate, eligible.shape) & eligible
    priority = jnp.where(chosen, jax.random.uniform(order_key, eligible.shape), 2.0)
    neg_top, index = jax.lax.top_k(-priority, capacity)
    mask = (neg_top > -2.0).astype(jnp.float32)
    slots = jax.random.permutation(slot_key, capacity)  # random slots, as PoissonSampler's
    return jnp.where(mask > 0, index, 0)[slots], mask[slots]
