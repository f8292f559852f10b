"""Deliberately broken DP-SGD steps and samplers, and plans that build them.

An audit's verdict is only worth something if it flags broken code. Its tests and the audit
benchmark's ``--bug`` runs check that it does on a plan whose parts (``PrivacyPlan.parts``) are
a broken subclass of ``DpsgdStep`` or of ``PoissonSampler``: :func:`with_parts` builds that
plan, visibly, where the audit is set up. Nothing is swapped for the whole process, and no run
of dpscale imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dpscale.privacy.clipping import ClippedSum
from dpscale.privacy.dpsgd import DpsgdStep
from dpscale.privacy.noise import add_gaussian_noise, step_key
from dpscale.privacy.plan import MechanismParts, PrivacyPlan
from dpscale.privacy.sampling import Layout, PoissonSampler, SampledBatch, batch_capacity, pad_into
from dpscale.privacy.streams import Stream, stream_rng


def with_parts(
    plan: PrivacyPlan, *, step: type[DpsgdStep] = DpsgdStep, sampler: type[PoissonSampler] = PoissonSampler
) -> PrivacyPlan:
    """``plan`` building its DP step from ``step`` and its Poisson sampler from ``sampler``."""
    return dataclasses.replace(plan, parts=MechanismParts(step=step, poisson_sampler=sampler))


class DoubleRate(PoissonSampler):
    """Every example joins with probability 2q (capacity grown to match): twice the accounted rate."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sampling_rate = min(1.0, 2 * self.sampling_rate)
        self.capacity = batch_capacity(self.num_examples, self.sampling_rate * self.num_examples)
        self.layout = Layout.of(self.capacity, microbatch_size=self.microbatch_size)


class ShuffledAsPoisson(PoissonSampler):
    """Fixed-size batches of round(q N) from one permutation per epoch, while the plan accounts Poisson."""

    def sample(self, step: int) -> SampledBatch:
        size = max(1, round(self.expected_batch_size))
        epoch, position = divmod(step, max(1, self.num_examples // size))
        order = stream_rng(self._seed, Stream.SAMPLING, epoch).permutation(self.num_examples)
        return pad_into(np.sort(order[position * size : (position + 1) * size]), self.layout)


class HalfNoise(DpsgdStep):
    """Half the calibrated noise: std sigma / 2 on the clipped sum (mu doubles)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise_multiplier /= 2


class NoiseOverBTwice(DpsgdStep):
    """The classic sensitivity bug: noise calibrated for the mean gradient (sigma / B), then divided by B again."""

    def _privatize_impl(self, total: ClippedSum, step: jax.Array, base_key: jax.Array) -> Any:
        b = self.expected_batch_size
        noisy = add_gaussian_noise(total.summed(), step_key(base_key, step), std=self.noise_multiplier / b)
        return jax.tree_util.tree_map(lambda x: x / b, noisy)
