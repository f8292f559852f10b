"""The audit stage: empirical lower bounds on epsilon for the real DP-SGD update.

``run(AuditConfig) -> AuditResult``. For each nominal epsilon the plan is calibrated exactly
as ``dpscale train`` calibrates its own (``PrivacyPlan.calibrate``), then many small models
are trained on a subset D of the data, with and without a canary (``audit.canaries``), on the
plan's own DP step (``training.vmapped``), and the distinguishing game and optionally the
one-run audit turn their scores into lower bounds (``audit.game``, ``audit.bounds``).

``threat_model="white-box"`` instead inserts a gradient canary into the real step and lets the
adversary see every update (``audit.whitebox``); its Gaussian-DP bound is close to the nominal
epsilon for correct code, so a broken privatiser shows up above it. It runs at q = 1.

``threat_model="sampler"`` audits the sampling at q < 1 (``audit.sampler``): every model draws
its batches from the plan's own sampler, a gradient canary shows when it was drawn, and the
models' error rates are compared with the accounted mechanism's whole privacy profile.

A lower bound above the nominal epsilon is a bug in the DP code (or the audit): the result
says so loudly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal, get_args

from dpscale import distributed
from dpscale.audit.canaries import CanaryKind, Data, load_data
from dpscale.audit.game import audit_setting, markdown_table, one_run, write_reports
from dpscale.audit.sampler import SamplerAuditSetup, sampler_row
from dpscale.audit.whitebox import PerExample, WhiteBoxSetup, white_box_row
from dpscale.errors import InvalidConfigError
from dpscale.privacy.plan import MechanismParts, PrivacyPlan, PrivacyTarget
from dpscale.privacy.seeds import resolve_seed
from dpscale.privacy.streams import Stream, stream_rng
from dpscale.progress import progress_bar
from dpscale.training.vmapped import TrainingSetup

ThreatModel = Literal["black-box", "white-box", "sampler"]
# The choices of the audit's flags, each defined once: by its type, or here.
THREAT_MODELS: tuple[str, ...] = get_args(ThreatModel)
CANARIES: tuple[str, ...] = get_args(CanaryKind)
PER_EXAMPLE: tuple[str, ...] = get_args(PerExample)
MODELS_BY_THREAT: dict[str, tuple[str, ...]] = {
    "black-box": ("linear", "mlp"),
    "white-box": ("linear", "cnn"),
    "sampler": ("linear",),
}
MODELS: tuple[str, ...] = tuple(dict.fromkeys(m for models in MODELS_BY_THREAT.values() for m in models))
#: The options only some audits use: (threat models, the model it needs or ""). An option given to an
#: audit that does not use it is refused, never dropped (every other option applies to every audit).
OPTION_USE: dict[str, tuple[tuple[str, ...], str]] = {
    "canary": (("black-box",), ""),  # white-box and sampler audits insert a gradient canary
    "one_run_canaries": (("black-box",), ""),
    "hidden": (("black-box",), "mlp"),
    "microbatches": (("white-box",), ""),
    "per_example": (("white-box",), "cnn"),
    "devices": (("white-box",), ""),
    "canary_norm": (("white-box", "sampler"), ""),
}

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """An audit of DP-SGD on a subset D of an ingested data set, one row per nominal epsilon."""

    data: str
    out_dir: str | None = None
    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    delta: float = 1e-5
    num_examples: int = 1000  # |D|
    batch_size: int | None = None  # black-box: 100; white-box: |D| (full batches); sampler: (|D| + 1) / 10
    steps: int | None = None  # black-box, white-box: 50; sampler: one epoch, (|D| + 1) / batch size
    learning_rate: float = 1.0
    clip_norm: float = 1.0
    model: str = "linear"  # black-box: linear, mlp; white-box: linear, cnn
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
    threat_model: ThreatModel = "black-box"
    microbatches: int = 2  # white-box: micro-batches per step (accumulation is audited too)
    canary_norm: float = 10.0  # white-box: |canary gradient| / C
    per_example: PerExample = "vmap"  # white-box CNN: vmap, book-keeping or per-layer (ghost) norms
    devices: int = 1  # white-box: data-parallel devices of the audited step (> 1: the shard_map path)
    # The step and sampler the audited plan builds: the real ones, or a deliberately broken one
    # (audit.broken_steps) to prove the audit flags it. Not a flag of the command line.
    parts: MechanismParts = MechanismParts()

    def __post_init__(self) -> None:
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise InvalidConfigError(f"epsilons must be positive, got {self.epsilons}")
        if self.num_models < 8:
            raise InvalidConfigError(f"num_models must be >= 8, got {self.num_models}")
        if not 0 < self.holdout_fraction < 1:
            raise InvalidConfigError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if not 0 < self.confidence < 1:
            raise InvalidConfigError(f"confidence must be in (0, 1), got {self.confidence}")
        if self.canary not in CANARIES:
            raise InvalidConfigError(f"canary must be 'ood' or 'mislabelled', got {self.canary!r}")
        if not 0 < self.one_run_guess_fraction <= 1:
            raise InvalidConfigError("one_run_guess_fraction must be in (0, 1]")
        if self.threat_model not in THREAT_MODELS:
            raise InvalidConfigError(f"threat_model must be one of {THREAT_MODELS}, got {self.threat_model!r}")
        models = MODELS_BY_THREAT[self.threat_model]
        if self.model not in models:
            raise InvalidConfigError(f"the {self.threat_model} audit supports models {models}, got {self.model!r}")
        if self.threat_model == "white-box" and self.batch_size not in (None, self.num_examples):
            raise InvalidConfigError(
                f"the white-box audit uses full batches: --batch-size must be |D| ({self.num_examples}) or left out"
            )
        self._refuse_unused()
        if self.threat_model == "sampler" and not 1 <= self.effective_batch_size <= self.num_examples:
            raise InvalidConfigError(
                "the sampler audit needs q < 1: --batch-size at most |D| (the plan samples "
                f"|D| + 1 rows, D and the canary's slot); got {self.batch_size}"
            )

    def _refuse_unused(self) -> None:
        """Refuse an option (``OPTION_USE``) set away from its default for an audit that does not use it."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, (threats, model) in OPTION_USE.items():
            if getattr(self, name) == defaults[name]:
                continue
            flag = "--" + name.replace("_", "-")
            if self.threat_model not in threats:
                raise InvalidConfigError(
                    f"{flag} does not apply to the {self.threat_model} audit, only to the {' and '.join(threats)} "
                    f"audit{'s' if len(threats) > 1 else ''}: leave it out"
                )
            if model and self.model != model:
                raise InvalidConfigError(f"{flag} applies to --model {model} only: leave it out")

    @property
    def effective_batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        if self.threat_model == "sampler":
            return max(1, (self.num_examples + 1) // 10)
        return self.num_examples if self.threat_model == "white-box" else 100

    @property
    def effective_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        if self.threat_model == "sampler":  # one epoch: where shuffling and Poisson sampling differ most
            return max(1, (self.num_examples + 1) // self.effective_batch_size)
        return 50


@dataclasses.dataclass(frozen=True)
class AuditResult:
    rows: tuple[dict, ...]
    seed: int
    dataset: str

    def as_dict(self) -> dict:
        return {"dataset": self.dataset, "seed": self.seed, "rows": list(self.rows)}

    def markdown(self) -> str:
        """The rows as the Markdown table the command prints (``audit.game.markdown_table``)."""
        return markdown_table(self.rows)


def run(config: AuditConfig) -> AuditResult:
    """Audit every nominal epsilon of ``config``."""
    seed = resolve_seed(config.seed, purpose="audit")
    rng = stream_rng(seed, Stream.AUDIT_DATA)
    canaries = max(1, config.one_run_canaries)
    data, _ = load_data(
        config.data,
        split=config.split,
        num_examples=config.num_examples,
        kind=config.canary,
        canaries=canaries,
        rng=rng,
    )
    rows = []
    for epsilon in config.epsilons:
        sampled = config.num_examples + (config.threat_model == "sampler")  # the sampler's rows: D and a slot
        plan = dataclasses.replace(
            PrivacyPlan.calibrate(
                PrivacyTarget(epsilon, config.delta),
                num_examples=sampled,
                batch_size=config.effective_batch_size,
                steps=config.effective_steps,
            ),
            parts=config.parts,
        )
        nominal = plan.epsilon()
        if config.threat_model == "white-box":
            rows.append(_white_box(config, data, plan, nominal, seed))
            continue
        if config.threat_model == "sampler":
            rows.append(_sampler(config, data, plan, nominal, seed))
            continue
        setup = TrainingSetup(
            plan=plan,
            learning_rate=config.learning_rate,
            clip_norm=config.clip_norm,
            model=config.model,
            hidden=config.hidden,
        )
        with progress_bar(f"audit eps={epsilon:g}", total=config.num_models, enabled=config.show_progress) as bar:
            row = audit_setting(
                data,
                setup,
                nominal_epsilon=nominal,
                delta=config.delta,
                num_models=config.num_models,
                confidence=config.confidence,
                holdout_fraction=config.holdout_fraction,
                seed=seed,
                chunk_size=config.chunk_size,
                bar=bar,
            )
        if config.one_run_canaries:
            row |= one_run(
                data,
                setup,
                delta=config.delta,
                confidence=config.confidence,
                guess_fraction=config.one_run_guess_fraction,
                seed=seed,
                rng=rng,
            )
            row["estimators"]["one-run"] = row["one_run_epsilon_lower_bound"]
            row["violation"] |= row["one_run_epsilon_lower_bound"] > nominal
        if row["violation"]:
            _log.error("AUDIT VIOLATION: lower bound above the nominal epsilon %.3f: %s", nominal, row)
        rows.append(row)
    result = AuditResult(rows=tuple(rows), seed=seed, dataset=config.data)
    if config.out_dir:
        write_reports(result.as_dict(), rows, config.out_dir)
    return result


def _sampler(config: AuditConfig, data: Data, plan: PrivacyPlan, nominal: float, seed: int) -> dict:
    setup = SamplerAuditSetup(
        plan=plan, learning_rate=config.learning_rate, clip_norm=config.clip_norm, canary_norm=config.canary_norm
    )
    n = config.num_examples
    with progress_bar(
        f"sampler audit eps={plan.epsilon():.3g}", total=config.num_models, enabled=config.show_progress
    ) as bar:
        row = sampler_row(
            data.features[:n],
            data.labels[:n],
            int(data.labels.max()) + 1,
            setup=setup,
            nominal_epsilon=nominal,
            delta=config.delta,
            num_models=config.num_models,
            confidence=config.confidence,
            holdout_fraction=config.holdout_fraction,
            seed=seed,
            chunk_size=config.chunk_size,
            bar=bar,
        )
    if row["violation"]:
        _log.error(
            "AUDIT VIOLATION: the sampler includes the canary more often than accounted (nominal epsilon %.3f): %s",
            nominal,
            row,
        )
    return row


def _white_box(config: AuditConfig, data: Data, plan: PrivacyPlan, nominal: float, seed: int) -> dict:
    setup = WhiteBoxSetup(
        plan=plan,
        model=config.model,
        per_example=config.per_example,
        learning_rate=config.learning_rate,
        clip_norm=config.clip_norm,
        microbatches=config.microbatches,
        canary_norm=config.canary_norm,
    )
    n = config.num_examples
    with progress_bar(
        f"white-box audit eps={plan.epsilon():.3g}", total=config.num_models, enabled=config.show_progress
    ) as bar:
        row = white_box_row(
            data.features[:n],
            data.labels[:n],
            int(data.labels.max()) + 1,
            setup=setup,
            nominal_epsilon=nominal,
            delta=config.delta,
            num_models=config.num_models,
            confidence=config.confidence,
            holdout_fraction=config.holdout_fraction,
            seed=seed,
            image_shape=data.image_shape,
            chunk_size=config.chunk_size,
            bar=bar,
            mesh=None if config.devices == 1 else distributed.training_mesh(config.devices),
        )
    if row["violation"]:
        _log.error("AUDIT VIOLATION: lower bound above the nominal epsilon %.3f: %s", nominal, row)
    return row
