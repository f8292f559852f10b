"""The evaluate command: top-1 / top-5 accuracy of a run's last and EMA parameters on one split.

``run(EvaluateConfig)`` scores the run (``training.evaluation``) and saves the scores in
the run directory (``metrics.json``). Evaluation is post-processing of the DP parameters
and spends no privacy budget.
"""

from __future__ import annotations

import dataclasses

from dpscale.training.evaluation import Scores, score_run

__all__ = ["EvaluateConfig", "EvaluateResult", "run"]

EvaluateResult = Scores


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    run_dir: str
    split: str = "test"
    batch_size: int = 256
    data: str | None = None  # defaults to the data the run trained on


def run(config: EvaluateConfig) -> EvaluateResult:
    return score_run(config.run_dir, split=config.split, data=config.data, batch_size=config.batch_size)
