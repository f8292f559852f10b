"""The audit stage: empirical lower bounds on epsilon for the real DP-SGD update.

``run(AuditConfig) -> AuditResult``. For each nominal epsilon the noise multiplier
is calibrated exactly as ``dpscale train`` does, then:

* Distinguishing game (Jagielski et al. 2020; Tramer et al. 2022): half of the
  models train on D, half on D plus one canary z, all from the same initialisation
  (``stages.audit_models``). z is scored on every model; the threshold is chosen on
  a held-out part of the models and Clopper-Pearson bounds on the FPR/FNR of the
  rest give the epsilon lower bound (``privacy.audit_bounds``).
* One-run audit (Steinke, Nasr, Jagielski 2023), optional: m canaries each join
  one training run with probability 1/2; the top and bottom scores are guessed
  in / out.

Canaries: ``ood`` is an image that lights only the pixels least used by D (blank
in all of D if possible) at a large norm, so its gradient is always clipped and
points where the data barely pushes: the strongest input-space canary for these
models. ``mislabelled`` is a real image from outside D with a wrong label. Features
are pixels / 255 (not the train stage's [-1, 1]) so that a blank pixel stays 0 and
carries no data gradient.

A lower bound above the nominal epsilon is a bug in the DP code (or the audit):
the result says so loudly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Literal

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from sklearn.metrics import roc_auc_score

from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy import accounting, audit_bounds
from dpscale.privacy.calibration import calibrate_noise_multiplier
from dpscale.privacy.dpsgd import DpsgdStep
from dpscale.privacy.seeds import resolve_seed
from dpscale.stages.audit_models import ModelKind, StepFactory, TrainingSetup, train_and_score

_log = logging.getLogger(__name__)
CanaryKind = Literal["ood", "mislabelled"]
_OOD_PIXELS = 16
_OOD_NORM = 10.0


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
class Data:
    """D (the first ``num_examples`` rows) followed by the canary rows, as features in [0, 1]."""

    features: np.ndarray
    labels: np.ndarray
    num_examples: int

    @property
    def canary_rows(self) -> np.ndarray:
        return np.arange(self.num_examples, len(self.labels))


def make_canaries(
    features: np.ndarray, labels: np.ndarray, spare: tuple[np.ndarray, np.ndarray], *,
    kind: CanaryKind, count: int, num_classes: int, rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` canaries for the data set (features, labels); ``spare`` are real rows outside it."""
    if kind == "mislabelled":
        if len(spare[1]) < count:
            raise DataError(f"need {count} examples outside D for mislabelled canaries")
        shift = rng.integers(1, num_classes, size=count)
        return spare[0][:count], ((spare[1][:count] + shift) % num_classes).astype(labels.dtype)
    pixels = np.argsort(features.sum(axis=0), kind="stable")[: min(_OOD_PIXELS, features.shape[1])]
    directions = np.ones((count, len(pixels))) if count == 1 else rng.normal(size=(count, len(pixels)))
    directions *= _OOD_NORM / np.linalg.norm(directions, axis=1, keepdims=True)
    canaries = np.zeros((count, features.shape[1]), np.float32)
    canaries[:, pixels] = directions
    return canaries, rng.integers(0, num_classes, size=count).astype(labels.dtype)


def load_data(config: AuditConfig, *, canaries: int, rng: np.random.Generator) -> tuple[Data, int]:
    """A random D of ``num_examples`` rows of the ingested split, plus ``canaries`` canary rows."""
    from dpscale.stages.dataset import IngestedDataset
    from dpscale.stages.image_data import InMemorySplit

    dataset = IngestedDataset(config.data)
    if config.split not in dataset.splits:
        raise DataError(f"{config.data!r} has no split {config.split!r} (has {dataset.splits})")
    split = InMemorySplit.load(dataset, config.split)
    spare = canaries if config.canary == "mislabelled" else 0
    if config.num_examples + spare > len(split):
        raise DataError(f"split has {len(split)} examples, need {config.num_examples + spare}")
    order = rng.permutation(len(split))[: config.num_examples + spare]
    images, labels = split.take(order)
    features = images.reshape(len(order), -1).astype(np.float32) / 255.0
    return build_data(features, labels.astype(np.int32), num_examples=config.num_examples,
                      canaries=canaries, kind=config.canary, num_classes=dataset.num_classes,
                      rng=rng), dataset.num_classes


def build_data(
    features: np.ndarray, labels: np.ndarray, *, num_examples: int, canaries: int,
    kind: CanaryKind, num_classes: int, rng: np.random.Generator,
) -> Data:
    """D = the first ``num_examples`` rows; canaries from the rows after them (mislabelled) or made up."""
    d_x, d_y = features[:num_examples], labels[:num_examples]
    c_x, c_y = make_canaries(d_x, d_y, (features[num_examples:], labels[num_examples:]), kind=kind,
                             count=canaries, num_classes=num_classes, rng=rng)
    return Data(np.concatenate([d_x, c_x]).astype(np.float32), np.concatenate([d_y, c_y]),
                num_examples)


def noise_for(epsilon: float, *, delta: float, batch_size: int, num_examples: int, steps: int
              ) -> tuple[float, float]:
    """(noise multiplier, epsilon it achieves): the train stage's calibration."""
    rate = batch_size / num_examples
    sigma = calibrate_noise_multiplier(target_epsilon=epsilon, delta=delta, sampling_rate=rate,
                                       steps=steps).value
    spec = accounting.DpsgdPrivacySpec(noise_multiplier=sigma, sampling_rate=rate, steps=steps)
    return sigma, accounting.epsilon(spec, delta)


def game_statistics(
    in_scores: np.ndarray, out_scores: np.ndarray, *, delta: float, confidence: float,
    holdout_fraction: float,
) -> dict[str, float]:
    """Threshold on the first ``holdout_fraction`` of each side, bound on the rest."""
    n_in, n_out = int(len(in_scores) * holdout_fraction), int(len(out_scores) * holdout_fraction)
    threshold = audit_bounds.best_threshold(in_scores[:n_in], out_scores[:n_out], delta=delta,
                                            confidence=confidence)
    test_in, test_out = in_scores[n_in:], out_scores[n_out:]
    false_neg, false_pos = int(np.sum(test_in < threshold)), int(np.sum(test_out >= threshold))
    epsilon_lb = audit_bounds.epsilon_lower_bound(
        false_positives=false_pos, negatives=len(test_out), false_negatives=false_neg,
        positives=len(test_in), delta=delta, confidence=confidence,
    )
    truth = np.r_[np.ones(len(in_scores)), np.zeros(len(out_scores))]
    return {
        "epsilon_lower_bound": epsilon_lb,
        "auc": float(roc_auc_score(truth, np.r_[in_scores, out_scores])),
        "advantage": 1 - false_neg / len(test_in) - false_pos / len(test_out),
        "threshold": threshold,
        "false_positives": false_pos, "negatives": len(test_out),
        "false_negatives": false_neg, "positives": len(test_in),
    }


def one_run_statistics(scores: np.ndarray, member: np.ndarray, *, delta: float, confidence: float,
                       guess_fraction: float) -> dict[str, float]:
    """Guess the top scores in and the bottom scores out; bound from Steinke et al. (2023)."""
    m = len(scores)
    k = max(1, int(m * guess_fraction / 2))
    order = np.argsort(scores, kind="stable")
    correct = int(member[order[-k:]].sum() + (~member[order[:k]]).sum())
    epsilon_lb = audit_bounds.one_run_epsilon_lower_bound(
        canaries=m, guesses=2 * k, correct=correct, delta=delta, confidence=confidence)
    return {"one_run_canaries": m, "one_run_guesses": 2 * k, "one_run_correct": correct,
            "one_run_epsilon_lower_bound": epsilon_lb}


@dataclasses.dataclass(frozen=True)
class AuditResult:
    rows: tuple[dict, ...]
    seed: int
    dataset: str

    def as_dict(self) -> dict:
        return {"dataset": self.dataset, "seed": self.seed, "rows": list(self.rows)}


def audit_setting(
    data: Data, setup: TrainingSetup, *, nominal_epsilon: float, delta: float, num_models: int,
    confidence: float, holdout_fraction: float, seed: int, step_factory: StepFactory = DpsgdStep,
    chunk_size: int = 256, progress: Progress | None = None,
) -> dict:
    """One row of the game: train ``num_models`` models (half with the canary), bound epsilon."""
    canary = data.canary_rows[:1]
    present = np.ones((num_models, data.num_examples + 1), bool)
    member = np.arange(num_models) % 2 == 0  # interleaved: holdout and test both get half of each
    present[:, -1] = member
    task = None if progress is None else progress.add_task(f"eps={nominal_epsilon:g}", total=num_models)
    started = time.perf_counter()
    scores = train_and_score(
        data.features[: data.num_examples + 1], data.labels[: data.num_examples + 1], present, canary,
        setup=setup, seed=seed, step_factory=step_factory, chunk_size=chunk_size,
        on_chunk=None if task is None else (lambda n: progress.advance(task, n)),
    )[:, 0]
    stats = game_statistics(scores[member], scores[~member], delta=delta, confidence=confidence,
                            holdout_fraction=holdout_fraction)
    row = {
        "num_examples": data.num_examples, "nominal_epsilon": nominal_epsilon, "delta": delta,
        "noise_multiplier": setup.noise_multiplier, "batch_size": setup.batch_size,
        "steps": setup.steps, "model": setup.model, "num_models": num_models,
        "confidence": confidence, **stats,
        "advantage_bound": audit_bounds.advantage_bound(nominal_epsilon, delta),
        "seconds": time.perf_counter() - started,
    }
    row["violation"] = bool(row["epsilon_lower_bound"] > nominal_epsilon)
    return row


def run(config: AuditConfig, *, step_factory: StepFactory = DpsgdStep) -> AuditResult:
    seed = resolve_seed(config.seed, purpose="audit")
    rng = np.random.default_rng(seed)
    canaries = max(1, config.one_run_canaries)
    data, _ = load_data(config, canaries=canaries, rng=rng)
    rows = []
    columns = (TextColumn("audit {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("models"), TimeRemainingColumn())
    with Progress(*columns, disable=not config.show_progress) as progress:
        for epsilon in config.epsilons:
            sigma, nominal = noise_for(epsilon, delta=config.delta, batch_size=config.batch_size,
                                       num_examples=config.num_examples, steps=config.steps)
            setup = TrainingSetup(
                noise_multiplier=sigma, batch_size=config.batch_size, num_examples=config.num_examples,
                steps=config.steps, learning_rate=config.learning_rate, clip_norm=config.clip_norm,
                model=config.model, hidden=config.hidden,
            )
            row = audit_setting(
                data, setup, nominal_epsilon=nominal, delta=config.delta, num_models=config.num_models,
                confidence=config.confidence, holdout_fraction=config.holdout_fraction, seed=seed,
                step_factory=step_factory, chunk_size=config.chunk_size, progress=progress,
            )
            if config.one_run_canaries:
                row |= one_run(data, setup, delta=config.delta, confidence=config.confidence,
                               guess_fraction=config.one_run_guess_fraction, seed=seed, rng=rng,
                               step_factory=step_factory)
            row["violation"] |= row.get("one_run_epsilon_lower_bound", 0.0) > nominal
            if row["violation"]:
                _log.error("AUDIT VIOLATION: lower bound above the nominal epsilon %.3f: %s", nominal, row)
            rows.append(row)
    result = AuditResult(rows=tuple(rows), seed=seed, dataset=config.data)
    if config.out_dir:
        write_reports(result, config.out_dir)
    return result


def one_run(data: Data, setup: TrainingSetup, *, delta: float, confidence: float,
            guess_fraction: float, seed: int, rng: np.random.Generator,
            step_factory: StepFactory = DpsgdStep) -> dict:
    """One training run on D plus each canary with probability 1/2.

    Each canary's score is calibrated by its score on a reference model trained on D
    alone (independent randomness): a real image's margin says more about the image
    than about membership. The reference does not depend on which canaries were
    included, so the guesses stay a post-processing of the audited run, as the
    theorem requires.
    """
    member = rng.random(len(data.canary_rows)) < 0.5
    audited = np.r_[np.ones(data.num_examples, bool), member]
    reference = np.r_[np.ones(data.num_examples, bool), np.zeros_like(member)]
    scores = train_and_score(data.features, data.labels, np.stack([audited, reference]),
                             data.canary_rows, setup=setup, seed=seed, step_factory=step_factory)
    return one_run_statistics(scores[0] - scores[1], member, delta=delta, confidence=confidence,
                              guess_fraction=guess_fraction)


_COLUMNS = (("|D|", "num_examples", "d"), ("nominal eps", "nominal_epsilon", ".3f"),
            ("delta", "delta", ".0e"), ("sigma", "noise_multiplier", ".3f"),
            ("models", "num_models", "d"), ("eps lower bound", "epsilon_lower_bound", ".3f"),
            ("AUC", "auc", ".3f"), ("advantage", "advantage", ".3f"),
            ("advantage bound", "advantage_bound", ".3f"), ("seconds", "seconds", ".1f"))


def markdown_table(rows: tuple[dict, ...] | list[dict]) -> str:
    columns = list(_COLUMNS)
    if any("one_run_epsilon_lower_bound" in r for r in rows):
        columns.append(("one-run eps lower bound", "one_run_epsilon_lower_bound", ".3f"))
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format(row[key], fmt) if key in row else "" for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_reports(result: AuditResult, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "audit.json"), "w") as f:
        json.dump(result.as_dict(), f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "audit.md"), "w") as f:
        f.write(markdown_table(result.rows))
