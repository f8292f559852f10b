"""The distinguishing game and the one-run audit: models trained with and without canaries -> bounds.

* Distinguishing game (Jagielski et al. 2020; Tramer et al. 2022): half of the models
  train on D, half on D plus one canary z, all from the same initialisation
  (``training.vmapped``). z is scored on every model; the threshold is chosen on a
  held-out part of the models and Clopper-Pearson bounds on the FPR/FNR of the rest give
  the epsilon lower bound (``audit.bounds``).
* One-run audit (Steinke, Nasr, Jagielski 2023): m canaries each join one training run
  with probability 1/2; the top and bottom scores are guessed in / out.

A lower bound above the nominal epsilon is a bug in the DP code (or the audit).
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

from dpscale import files
from dpscale.audit import bounds as audit_bounds
from dpscale.audit.canaries import Data
from dpscale.progress import Bar
from dpscale.training.vmapped import TrainingSetup, train_and_score


def game_statistics(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    delta: float,
    confidence: float,
    holdout_fraction: float,
) -> dict[str, float]:
    """Threshold on the first ``holdout_fraction`` of each side, bound on the rest."""
    n_in, n_out = int(len(in_scores) * holdout_fraction), int(len(out_scores) * holdout_fraction)
    threshold = audit_bounds.best_threshold(in_scores[:n_in], out_scores[:n_out], delta=delta, confidence=confidence)
    test_in, test_out = in_scores[n_in:], out_scores[n_out:]
    false_neg, false_pos = int(np.sum(test_in < threshold)), int(np.sum(test_out >= threshold))
    epsilon_lb = audit_bounds.epsilon_lower_bound(
        false_positives=false_pos,
        negatives=len(test_out),
        false_negatives=false_neg,
        positives=len(test_in),
        delta=delta,
        confidence=confidence,
    )
    truth = np.r_[np.ones(len(in_scores)), np.zeros(len(out_scores))]
    return {
        "epsilon_lower_bound": epsilon_lb,
        "auc": float(roc_auc_score(truth, np.r_[in_scores, out_scores])),
        "advantage": 1 - false_neg / len(test_in) - false_pos / len(test_out),
        "threshold": threshold,
        "false_positives": false_pos,
        "negatives": len(test_out),
        "false_negatives": false_neg,
        "positives": len(test_in),
    }


def gdp_rates_statistics(
    in_scores: np.ndarray, out_scores: np.ndarray, *, delta: float, confidence: float, holdout_fraction: float
) -> dict[str, float]:
    """``audit_bounds.gdp_epsilon_from_rates`` at its own best threshold on the held-out models."""
    n_in, n_out = int(len(in_scores) * holdout_fraction), int(len(out_scores) * holdout_fraction)
    threshold = audit_bounds.best_threshold(
        in_scores[:n_in],
        out_scores[:n_out],
        delta=delta,
        confidence=confidence,
        estimator=audit_bounds.gdp_epsilon_from_rates,
    )
    test_in, test_out = in_scores[n_in:], out_scores[n_out:]
    bound = audit_bounds.gdp_epsilon_from_rates(
        false_positives=int(np.sum(test_out >= threshold)),
        negatives=len(test_out),
        false_negatives=int(np.sum(test_in < threshold)),
        positives=len(test_in),
        delta=delta,
        confidence=confidence,
    )
    return {"gdp_rates_epsilon_lower_bound": bound, "gdp_rates_threshold": threshold}


def one_run_statistics(
    scores: np.ndarray, member: np.ndarray, *, delta: float, confidence: float, guess_fraction: float
) -> dict[str, float]:
    """Guess the top scores in and the bottom scores out; bound from Steinke et al. (2023)."""
    m = len(scores)
    k = max(1, int(m * guess_fraction / 2))
    order = np.argsort(scores, kind="stable")
    correct = int(member[order[-k:]].sum() + (~member[order[:k]]).sum())
    epsilon_lb = audit_bounds.one_run_epsilon_lower_bound(
        canaries=m, guesses=2 * k, correct=correct, delta=delta, confidence=confidence
    )
    return {
        "one_run_canaries": m,
        "one_run_guesses": 2 * k,
        "one_run_correct": correct,
        "one_run_epsilon_lower_bound": epsilon_lb,
    }


def audit_setting(
    data: Data,
    setup: TrainingSetup,
    *,
    nominal_epsilon: float,
    delta: float,
    num_models: int,
    confidence: float,
    holdout_fraction: float,
    seed: int,
    chunk_size: int = 256,
    bar: Bar | None = None,
) -> dict:
    """One row of the game: train ``num_models`` models (half with the canary), bound epsilon."""
    canary = data.canary_rows[:1]
    present = np.ones((num_models, data.num_examples + 1), bool)
    member = np.arange(num_models) % 2 == 0  # interleaved: holdout and test both get half of each
    present[:, -1] = member
    started = time.perf_counter()
    scores = train_and_score(
        data.features[: data.num_examples + 1],
        data.labels[: data.num_examples + 1],
        present,
        canary,
        setup=setup,
        seed=seed,
        chunk_size=chunk_size,
        on_chunk=None if bar is None else bar.advance,
    )[:, 0]
    stats = game_statistics(
        scores[member], scores[~member], delta=delta, confidence=confidence, holdout_fraction=holdout_fraction
    )
    if setup.plan.batch_size == setup.plan.num_examples:  # q = 1: the run is mu-GDP, so the rates bound it
        stats |= gdp_rates_statistics(
            scores[member], scores[~member], delta=delta, confidence=confidence, holdout_fraction=holdout_fraction
        )
    row = {
        "threat_model": "black-box",
        "num_examples": data.num_examples,
        "nominal_epsilon": nominal_epsilon,
        "delta": delta,
        "noise_multiplier": setup.plan.noise_multiplier,
        "batch_size": setup.plan.batch_size,
        "steps": setup.plan.steps,
        "model": setup.model,
        "num_models": num_models,
        "confidence": confidence,
        **stats,
        "advantage_bound": audit_bounds.advantage_bound(nominal_epsilon, delta),
        "seconds": time.perf_counter() - started,
    }
    return finish_row(row)


def finish_row(row: dict) -> dict:
    """Which estimator gave which bound, the Clopper-Pearson ceiling of the row, and the verdict.

    ``cp_max_certifiable_epsilon`` is what a perfect test on this row's test models would
    certify; at or above it, Clopper-Pearson cannot detect a violation (GDP has no such ceiling).
    """
    row["estimators"] = {"clopper-pearson": row["epsilon_lower_bound"]}
    if "gdp_epsilon_lower_bound" in row:
        row["estimators"]["gdp"] = row["gdp_epsilon_lower_bound"]
    if "gdp_rates_epsilon_lower_bound" in row:
        row["estimators"]["gdp-rates"] = row["gdp_rates_epsilon_lower_bound"]
    row["best_estimator"], row["best_lower_bound"] = max(row["estimators"].items(), key=lambda kv: kv[1])
    row["cp_max_certifiable_epsilon"] = audit_bounds.cp_max_certifiable_epsilon(
        positives=row["positives"], negatives=row["negatives"], delta=row["delta"], confidence=row["confidence"]
    )
    row["cp_cannot_detect"] = bool(row["nominal_epsilon"] >= row["cp_max_certifiable_epsilon"])
    row["violation"] = bool(row["best_lower_bound"] > row["nominal_epsilon"])
    return row


def one_run(
    data: Data,
    setup: TrainingSetup,
    *,
    delta: float,
    confidence: float,
    guess_fraction: float,
    seed: int,
    rng: np.random.Generator,
) -> dict:
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
    scores = train_and_score(
        data.features, data.labels, np.stack([audited, reference]), data.canary_rows, setup=setup, seed=seed
    )
    return one_run_statistics(
        scores[0] - scores[1], member, delta=delta, confidence=confidence, guess_fraction=guess_fraction
    )


_COLUMNS = (
    ("threat model", "threat_model", "s"),
    ("model", "model", "s"),
    ("|D|", "num_examples", "d"),
    ("T", "steps", "d"),
    ("nominal eps", "nominal_epsilon", ".3f"),
    ("delta", "delta", ".0e"),
    ("sigma", "noise_multiplier", ".3f"),
    ("models", "num_models", "d"),
    ("GDP eps lower bound", "gdp_epsilon_lower_bound", ".3f"),
    ("GDP-rates eps lower bound", "gdp_rates_epsilon_lower_bound", ".3f"),
    ("CP eps lower bound", "epsilon_lower_bound", ".3f"),
    ("CP max certifiable", "cp_max_certifiable_epsilon", ".2f"),
    ("mu nominal", "mu_nominal", ".3f"),
    ("mu estimate", "mu_estimate", ".3f"),
    ("AUC", "auc", ".3f"),
    ("seconds", "seconds", ".1f"),
    ("one-run eps lower bound", "one_run_epsilon_lower_bound", ".3f"),
)


def row_note(row: dict) -> str:
    """The verdict of a row in words."""
    notes = []
    if row.get("violation"):
        notes.append(f"VIOLATION ({row['best_estimator']})")
    if row.get("cp_cannot_detect"):
        others = len(row.get("estimators", {})) > 1
        notes.append("CP: this row cannot detect a violation" + ("" if others else " (no other estimator)"))
    return "; ".join(notes)


def markdown_table(rows: tuple[dict, ...] | list[dict]) -> str:
    """Only the columns some row has, plus the verdict of each row."""
    columns = [c for c in _COLUMNS if any(c[1] in r for r in rows)]
    lines = ["| " + " | ".join(c[0] for c in columns) + " | note |", "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        cells = [format(row[key], fmt) if key in row else "" for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells + [row_note(row)]) + " |")
    return "\n".join(lines) + "\n"


def write_reports(payload: dict[str, Any], rows: list[dict], out_dir: str) -> None:
    """``audit.json`` (everything) and ``audit.md`` (the table) in ``out_dir``, owner-only (0600).

    They are statistics of many models trained on the audited data, with no guarantee for it.
    """
    files.makedirs(out_dir)
    with files.open_for_writing(files.join(out_dir, "audit.json"), private=True) as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    with files.open_for_writing(files.join(out_dir, "audit.md"), private=True) as f:
        f.write(markdown_table(rows))
