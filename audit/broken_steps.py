"""Deliberately broken DP-SGD steps, and the one way to make an audit run one.

An audit's verdict is only worth something if it flags broken code. Its tests and the audit
benchmark's ``--bug`` runs check that it does, by swapping the step that every
``PrivacyPlan.dp_step`` builds for a broken subclass of ``DpsgdStep`` inside
:func:`substituted_step`. That is the only seam for it: no product signature takes a step
class, and no run of dpscale imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax

from dpscale.privacy import plan
from dpscale.privacy.clipping import ClippedSum
from dpscale.privacy.dpsgd import DpsgdStep
from dpscale.privacy.noise import add_gaussian_noise, step_key


@contextmanager
def substituted_step(broken: type[DpsgdStep]) -> Iterator[None]:
    """Within the block, ``PrivacyPlan.dp_step`` builds ``broken`` instead of ``DpsgdStep``."""
    if not (isinstance(broken, type) and issubclass(broken, DpsgdStep)):
        raise TypeError(f"a substituted step must subclass DpsgdStep, got {broken!r}")
    saved = plan.DpsgdStep
    plan.DpsgdStep = broken
    try:
        yield
    finally:
        plan.DpsgdStep = saved


class HalfNoise(DpsgdStep):
    """Half the calibrated noise: std sigma / 2 on the clipped sum (mu doubles)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise_multiplier /= 2


class NoiseOverBTwice(DpsgdStep):
    """The classic sensitivity bug: noise calibrated for the mean gradient (sigma / B), then divided by B again."""

    def _privatize_impl(self, total: ClippedSum, step: jax.Array, base_key: jax.Array) -> Any:
        b = self.expected_batch_size
        noisy = add_gaussian_noise(total.value, step_key(base_key, step), std=self.noise_multiplier / b)
        return jax.tree_util.tree_map(lambda x: x / b, noisy)
