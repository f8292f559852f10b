"""The evaluate command: top-1 / top-5 accuracy of a run's last and EMA parameters on one split.

``run(EvaluateConfig)`` scores the run (``training.evaluation``) and saves the scores in
the run directory (``metrics.json``). Other data (``data``) must be made like the run's (classes,
image shape, preprocessing, backbone); scores on data that is not the run's own go, only when
forced, to ``metrics.other-data.<name>.json``, never into ``metrics.json``. A TAN simulation (``sweep
--simulate-batch``) is scored like any run, and its scores say so (``simulated``, a warning). On a split outside the private training data this is
post-processing of the DP parameters and spends no privacy budget; on the run's training rows
(``train``, ``holdout``) it is a private diagnostic, refused unless ``private_diagnostics``.
"""

from __future__ import annotations

import dataclasses

from dpscale.errors import InvalidConfigError
from dpscale.training import release
from dpscale.training.evaluation import Scores, score_run


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    run_dir: str
    split: str = "test"
    batch_size: int = 256
    data: str | None = None  # defaults to the data the run trained on
    private_diagnostics: bool = False  # allow scoring the run's private training rows
    force_other_data: bool = False  # score data other than the run's (made alike) into a file of its own
    save: bool = True  # False: return the scores, write nothing (a sweep's choice leaves no trace in its runs)

    def __post_init__(self) -> None:
        if self.force_other_data and self.data is None:
            raise InvalidConfigError("--force-other-data applies to the data given with --data: give --data")


@dataclasses.dataclass(frozen=True)
class EvaluateResult(Scores):
    path: str = ""  # the file the scores were saved to

    @property
    def warnings(self) -> tuple[str, ...]:
        """Scores of private training rows are a private diagnostic, a simulation's are not its target's
        privacy, and what the run's ledger says its epsilon does not cover (a private selection's choice
        of the run, held-out rows) is said beside the epsilon it restates: the reader is told so."""
        notes = () if self.covered_by_epsilon else (release.warning(self.path),)
        notes += tuple(f"the run's ledger: {note}" for note in self.not_covered)
        if self.simulated:
            notes += (
                f"{release.SIMULATION_NOTE}: the run is a TAN simulation (sweep --simulate-batch), with less "
                f"noise per example than its target; its scores are covered only by its own epsilon "
                f"({self.epsilon:.4g})",
            )
        return notes


def run(config: EvaluateConfig) -> EvaluateResult:
    scores, path = score_run(
        config.run_dir,
        split=config.split,
        data=config.data,
        batch_size=config.batch_size,
        private_diagnostics=config.private_diagnostics,
        force_other_data=config.force_other_data,
        save=config.save,
    )
    return EvaluateResult(**dataclasses.asdict(scores), path=path)
