"""Batch selection: Poisson sampling in fixed-shape padded micro-batches.

The accountant assumes Poisson sampling: every example joins each batch
independently with probability q = B / N, so the realised batch size is
Binomial(N, q). To keep shapes static (one compilation for the whole run), a
batch is cut into micro-batches of a fixed size and the last one is padded with
index -1 and mask 0. Only the *number* of micro-batches varies from step to step;
nothing is ever truncated, so the sampling is exactly what is accounted for.

Each step's sample is a pure function of (seed, step), so a resumed run draws the
same batches it would have drawn without the interruption.

Shuffled fixed-size batches are available for comparison with non-private
baselines, but the Poisson accountant does not describe them: constructing a
``ShuffledSampler`` warns loudly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.errors import InvalidConfigError
from dpscale.privacy.streams import Stream, stream_rng

_log = logging.getLogger(__name__)
PADDING_INDEX = -1


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


def pad_into_microbatches(indices: np.ndarray, microbatch_size: int) -> SampledBatch:
    """Cut ``indices`` into micro-batches, padding the last with -1 (at least one micro-batch)."""
    count = len(indices)
    num_micro = max(1, math.ceil(count / microbatch_size))
    padded = np.full(num_micro * microbatch_size, PADDING_INDEX, dtype=np.int64)
    padded[:count] = indices
    mask = np.zeros(num_micro * microbatch_size, dtype=np.float32)
    mask[:count] = 1.0
    shape = (num_micro, microbatch_size)
    return SampledBatch(indices=padded.reshape(shape), mask=mask.reshape(shape))


def _check_sizes(num_examples: int, batch_size: float, microbatch_size: int) -> None:
    if num_examples <= 0:
        raise InvalidConfigError(f"num_examples must be positive, got {num_examples}")
    if not 0 < batch_size <= num_examples:
        raise InvalidConfigError(
            f"batch size must be in (0, num_examples={num_examples}], got {batch_size}"
        )
    if microbatch_size <= 0:
        raise InvalidConfigError(f"microbatch_size must be positive, got {microbatch_size}")


class PoissonSampler:
    """Poisson sampling with rate ``expected_batch_size / num_examples``."""

    def __init__(
        self, *, num_examples: int, expected_batch_size: float, microbatch_size: int, seed: int
    ) -> None:
        _check_sizes(num_examples, expected_batch_size, microbatch_size)
        self.num_examples = num_examples
        self.expected_batch_size = float(expected_batch_size)
        self.sampling_rate = self.expected_batch_size / num_examples
        self.microbatch_size = microbatch_size
        self._seed = seed

    #: The accountant's Poisson event describes this sampler exactly.
    exact_accounting = True

    def sample(self, step: int) -> SampledBatch:
        """The batch of optimiser step ``step``.

        Drawing the size from Binomial(N, q) and then a uniform subset of that size
        is the same distribution as N independent Bernoulli(q) draws, in O(batch)
        memory rather than O(N).
        """
        rng = stream_rng(self._seed, Stream.SAMPLING, step)
        size = rng.binomial(self.num_examples, self.sampling_rate)
        chosen = np.sort(rng.choice(self.num_examples, size=size, replace=False))
        return pad_into_microbatches(chosen, self.microbatch_size)


class ShuffledSampler:
    """Fixed-size batches from a fresh permutation each epoch (NOT what is accounted for)."""

    exact_accounting = False

    def __init__(self, *, num_examples: int, batch_size: int, microbatch_size: int, seed: int) -> None:
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
        self.microbatch_size = microbatch_size
        self.steps_per_epoch = num_examples // self.batch_size
        self._seed = seed

    def sample(self, step: int) -> SampledBatch:
        epoch, position = divmod(step, self.steps_per_epoch)
        rng = stream_rng(self._seed, Stream.SAMPLING, epoch)
        order = rng.permutation(self.num_examples)
        start = position * self.batch_size
        chosen = np.sort(order[start : start + self.batch_size])
        return pad_into_microbatches(chosen, self.microbatch_size)


def batch_capacity(num_rows: int, rate: float) -> int:
    """Fixed slots for one Poisson batch drawn on device: mean + 8 std (+8), at most all rows.

    A batch that would need more slots is an overflow that callers must refuse (truncating
    it would not be Poisson sampling); at 8 standard deviations it practically never happens.
    """
    mean = num_rows * rate
    return min(num_rows, math.ceil(mean + 8 * math.sqrt(mean * (1 - rate)) + 8))


def poisson_slots(key: jax.Array, sampling_rate: float, eligible: jax.Array,
                  capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Poisson sampling inside ``jit``/``vmap``: every eligible row joins with probability q.

    ``eligible`` is a boolean ``[rows]`` (the data set of this model). Returns the chosen
    rows' indices padded to ``capacity`` (padding points at row 0), their mask, and whether
    the batch overflowed ``capacity`` (see ``batch_capacity``). The same distribution as
    ``PoissonSampler``, for the many small models of an audit that run on device.
    """
    chosen = jax.random.bernoulli(key, sampling_rate, eligible.shape) & eligible
    count = jnp.sum(chosen)
    (index,) = jnp.nonzero(chosen, size=capacity, fill_value=0)
    mask = (jnp.arange(capacity) < count).astype(jnp.float32)
    return index, mask, count > capacity
