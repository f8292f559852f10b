"""The train command: DP-SGD from a privacy target, on images (all layers) or cached features.

``run(TrainConfig)`` starts a run on ``data`` in ``run_dir`` with the settings of a
``training.config.TrainingConfig``: the missing one of {batch size, steps, noise multiplier}
is calibrated *before* the first step (a run that cannot meet the target does not start),
then ``training.trainer`` loops. ``run(ResumeConfig)`` continues a killed run from its last
checkpoint with its own seed and plan. ``epsilon=inf`` is the non-private baseline: no
clipping, no noise, momentum and weight decay allowed.
"""

from __future__ import annotations

import dataclasses

from dpscale.training import trainer
from dpscale.training.config import TrainingConfig
from dpscale.training.trainer import TrainResult

__all__ = ["ResumeConfig", "TrainConfig", "TrainResult", "run"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A new run: the data (an ingested dataset, or a feature-cache entry in features mode) and where it goes."""

    data: str
    run_dir: str
    training: TrainingConfig = TrainingConfig()


@dataclasses.dataclass(frozen=True)
class ResumeConfig:
    """A killed run to continue in place, with its own data, settings, plan and seed."""

    run_dir: str
    show_progress: bool = True


def run(config: TrainConfig | ResumeConfig) -> TrainResult:
    if isinstance(config, ResumeConfig):
        return trainer.resume(config.run_dir, show_progress=config.show_progress)
    return trainer.start(config.data, config.run_dir, config.training)
