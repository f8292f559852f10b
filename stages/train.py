"""The train command: DP-SGD from a privacy target, on images (all layers) or cached features.

``run(TrainConfig)`` starts a run on ``data`` in ``run_dir`` with the settings of a
``training.config.TrainingConfig``: the missing one of {batch size, steps, noise multiplier}
is calibrated *before* the first step (a run that cannot meet the target does not start),
then ``training.trainer`` loops. ``run(ResumeConfig)`` continues a killed run from its last
checkpoint with its own seed and plan. ``epsilon=inf`` is the non-private baseline: no
clipping, no noise, momentum and weight decay allowed.

The choice lists of the training flags are the ones the settings check (re-exported here for
the command line), and ``initialize_distributed`` joins a multi-host run; call it before any
JAX computation (importing this module makes none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpscale import files
from dpscale.distributed import initialize as initialize_distributed
from dpscale.privacy.checks import ACCOUNTANTS, SAMPLING_SCHEMES
from dpscale.training import trainer
from dpscale.training.config import (
    FEATURE_NORMALIZATIONS,
    MODES,
    Mode,
    TrainingConfig,
    options_of,
    refuse_unused,
    training_config,
)
from dpscale.training.data_kind import resolve_mode
from dpscale.training.release import SIMULATION_NOTE
from dpscale.training.run_directory import CONFIG, RunDirectory
from dpscale.training.trainer import TrainResult

__all__ = [
    "ACCOUNTANTS",
    "FEATURE_NORMALIZATIONS",
    "MODES",
    "SAMPLING_SCHEMES",
    "ResumeConfig",
    "TrainConfig",
    "TrainResult",
    "initialize_distributed",
    "run",
    "started",
]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A new run: the data (an ingested dataset, or a feature-cache entry in features mode) and where it goes."""

    data: str
    run_dir: str
    training: TrainingConfig = TrainingConfig()

    @classmethod
    def from_options(cls, data: str, run_dir: str, *, mode: Mode | None = None, **options: Any) -> TrainConfig:
        """A run from flat options (``training.config.training_config``) in the mode of the data's kind.

        An option the run would not use is refused (``training.option_use``), here with whether it is
        private known: one run, so a DP-only option given to a non-private one is refused too.
        """
        mode = resolve_mode(data, mode)
        training = training_config(mode, **options)
        refuse_unused(mode, options_of(training), options.get("given", ()), private=training.private)
        return cls(data, run_dir, training)


@dataclasses.dataclass(frozen=True)
class ResumeConfig:
    """A killed run to continue in place, with its own data, settings, plan and seed."""

    run_dir: str
    show_progress: bool = True


def started(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a run that has started, i.e. one ``ResumeConfig`` can continue."""
    return files.isfile(files.join(run_dir, CONFIG))


def run(config: TrainConfig | ResumeConfig) -> TrainResult:
    if isinstance(config, ResumeConfig):
        result = trainer.resume(config.run_dir, show_progress=config.show_progress)
        if RunDirectory.existing(config.run_dir).simulated:  # its files say so; its result line too
            result = dataclasses.replace(
                result,
                warnings=(
                    *result.warnings,
                    f"{SIMULATION_NOTE}: {config.run_dir!r} "
                    "is a TAN simulation (sweep --simulate-batch), DP only at its own epsilon",
                ),
            )
        return result
    return trainer.start(config.data, config.run_dir, config.training)
