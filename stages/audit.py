"""The audit stage: empirical lower bounds on epsilon for the real DP-SGD update.

``run(AuditConfig) -> AuditResult``. For each nominal epsilon the plan is calibrated exactly
as ``dpscale train`` calibrates its own (``PrivacyPlan.calibrate``), then many small models
are trained on a subset D of the data, with and without a canary (``audit.canaries``), on the
plan's own DP step (``training.vmapped``), and the distinguishing game and optionally the
one-run audit turn their scores into lower bounds (``audit.game``, ``audit.bounds``).

A lower bound above the nominal epsilon is a bug in the DP code (or the audit): the result
says so loudly.
"""

from __future__ import annotations

import dataclasses
import logging

from dpscale.audit.canaries import CanaryKind, load_data
from dpscale.audit.game import audit_setting, one_run, write_reports
from dpscale.errors import InvalidConfigError
from dpscale.privacy.dpsgd import DpsgdStep
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget
from dpscale.privacy.seeds import resolve_seed
from dpscale.privacy.streams import Stream, stream_rng
from dpscale.progress import progress_bar
from dpscale.training.vmapped import ModelKind, StepClass, TrainingSetup

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """An audit of DP-SGD on a subset D of an ingested data set, one row per nominal epsilon."""

    data: str
    out_dir: str | None = None
    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    delta: float = 1e-5
    num_examples: int = 1000  # |D|
    batch_size: int = 100
    steps: int = 50
    learning_rate: float = 1.0
    clip_norm: float = 1.0
    model: ModelKind = "linear"
    hidden: int = 32
    num_models: int = 1000
    holdout_fraction: float = 0.5  # models used only to choose the threshold
    confidence: float = 0.999
    canary: CanaryKind = "ood"
    one_run_canaries: int = 0  # 0: skip the one-run audit
    one_run_guess_fraction: float = 0.2  # guesses: this fraction of canaries, half in, half out
    chunk_size: int = 256
    seed: int | None = None
    split: str = "train"
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise InvalidConfigError(f"epsilons must be positive, got {self.epsilons}")
        if self.num_models < 8:
            raise InvalidConfigError(f"num_models must be >= 8, got {self.num_models}")
        if not 0 < self.holdout_fraction < 1:
            raise InvalidConfigError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if not 0 < self.confidence < 1:
            raise InvalidConfigError(f"confidence must be in (0, 1), got {self.confidence}")
        if self.canary not in ("ood", "mislabelled"):
            raise InvalidConfigError(f"canary must be 'ood' or 'mislabelled', got {self.canary!r}")
        if not 0 < self.one_run_guess_fraction <= 1:
            raise InvalidConfigError("one_run_guess_fraction must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class AuditResult:
    rows: tuple[dict, ...]
    seed: int
    dataset: str

    def as_dict(self) -> dict:
        return {"dataset": self.dataset, "seed": self.seed, "rows": list(self.rows)}


def run(config: AuditConfig, *, step_class: StepClass = DpsgdStep) -> AuditResult:
    """Audit every nominal epsilon of ``config``; ``step_class`` lets tests audit a broken step."""
    seed = resolve_seed(config.seed, purpose="audit")
    rng = stream_rng(seed, Stream.AUDIT_DATA)
    canaries = max(1, config.one_run_canaries)
    data, _ = load_data(config.data, split=config.split, num_examples=config.num_examples, kind=config.canary,
                        canaries=canaries, rng=rng)
    rows = []
    for epsilon in config.epsilons:
        plan = PrivacyPlan.calibrate(PrivacyTarget(epsilon, config.delta), num_examples=config.num_examples,
                                     batch_size=config.batch_size, steps=config.steps)
        nominal = plan.epsilon()
        setup = TrainingSetup(plan=plan, learning_rate=config.learning_rate, clip_norm=config.clip_norm,
                              model=config.model, hidden=config.hidden)
        with progress_bar(f"audit eps={epsilon:g}", total=config.num_models, enabled=config.show_progress) as bar:
            row = audit_setting(
                data, setup, nominal_epsilon=nominal, delta=config.delta, num_models=config.num_models,
                confidence=config.confidence, holdout_fraction=config.holdout_fraction, seed=seed,
                step_class=step_class, chunk_size=config.chunk_size, bar=bar,
            )
        if config.one_run_canaries:
            row |= one_run(data, setup, delta=config.delta, confidence=config.confidence,
                           guess_fraction=config.one_run_guess_fraction, seed=seed, rng=rng,
                           step_class=step_class)
        row["violation"] |= row.get("one_run_epsilon_lower_bound", 0.0) > nominal
        if row["violation"]:
            _log.error("AUDIT VIOLATION: lower bound above the nominal epsilon %.3f: %s", nominal, row)
        rows.append(row)
    result = AuditResult(rows=tuple(rows), seed=seed, dataset=config.data)
    if config.out_dir:
        write_reports(result.as_dict(), rows, config.out_dir)
    return result
