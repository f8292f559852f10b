"""The sweep stage: a grid of DP training runs over epsilon and learning rate, repeated.

Every run reads the same data (in ``features`` mode the same feature cache, so a
sweep over epsilon never recomputes a feature). Each grid point is trained
``repeats`` times with fresh secret seeds, plus a non-private baseline; results go
to ``runs.csv`` (every run), ``summary.csv`` / ``summary.md`` (median and min-max
spread over repeats per grid point) and ``accuracy_vs_epsilon.png``.

A run directory that already holds ``metrics.json`` is reused, so an interrupted
sweep continues where it stopped instead of redoing (or re-spending) finished runs.

With ``holdout`` N (features mode) every run trains on all but the last N training
rows and is scored on those rows (split ``holdout``), so hyper-parameters can be
chosen without touching the test split.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
from typing import Any, Literal

from dpscale.errors import InvalidConfigError
from dpscale.stages import evaluate, run_files, train

RUNS_CSV = "runs.csv"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
PLOT = "accuracy_vs_epsilon.png"


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    data: str
    out_dir: str
    mode: Literal["images", "features"] = "features"
    model: str = "cnn-small"
    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    learning_rates: tuple[float, ...] = (4.0,)
    repeats: int = 3
    delta: float = 1e-5
    batch_size: int = 4096
    steps: int = 200
    clip_norm: float = 1.0
    augmult: int = 1
    microbatch_size: int = 4096
    ema_decay: float = 0.999
    baseline: bool = True  # a non-private run per repeat (same steps and batch size)
    baseline_learning_rate: float = 0.5
    baseline_momentum: float = 0.9
    eval_split: str = "test"
    holdout: int = 0  # features mode: train without the last N training rows and score on them
    feature_normalization: str = "none"
    feature_mean_noise_multiplier: float = 20.0
    feature_scale: float = 1.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.holdout and self.eval_split != "holdout":
            object.__setattr__(self, "eval_split", "holdout")
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise InvalidConfigError(f"epsilons must be positive, got {self.epsilons}")
        if not self.learning_rates or any(not lr > 0 for lr in self.learning_rates):
            raise InvalidConfigError(f"learning rates must be positive, got {self.learning_rates}")
        if self.repeats < 1:
            raise InvalidConfigError(f"repeats must be >= 1, got {self.repeats}")


def _grid(config: SweepConfig) -> list[dict[str, Any]]:
    points = [
        {"epsilon": eps, "learning_rate": lr, "momentum": 0.0, "repeat": r}
        for eps in config.epsilons
        for lr in config.learning_rates
        for r in range(config.repeats)
    ]
    if config.baseline:
        points += [
            {"epsilon": math.inf, "learning_rate": config.baseline_learning_rate,
             "momentum": config.baseline_momentum, "repeat": r}
            for r in range(config.repeats)
        ]
    return points


def _run_name(point: dict[str, Any]) -> str:
    eps = "nonprivate" if math.isinf(point["epsilon"]) else f"eps{point['epsilon']:g}"
    return f"{eps}-lr{point['learning_rate']:g}-r{point['repeat']}"


def _one(config: SweepConfig, point: dict[str, Any]) -> dict[str, Any]:
    run_dir = os.path.join(config.out_dir, "runs", _run_name(point))
    metrics_path = os.path.join(run_dir, evaluate.METRICS_FILE)
    if not os.path.exists(metrics_path):
        if os.path.exists(os.path.join(run_dir, run_files.CONFIG)):
            train.resume(run_dir, show_progress=config.show_progress)
        else:
            train.run(train.TrainConfig(
                data=config.data, run_dir=run_dir, mode=config.mode, model=config.model,
                epsilon=point["epsilon"], delta=config.delta, batch_size=config.batch_size,
                steps=config.steps, clip_norm=config.clip_norm, learning_rate=point["learning_rate"],
                momentum=point["momentum"], augmult=config.augmult, microbatch_size=config.microbatch_size,
                ema_decay=config.ema_decay, show_progress=config.show_progress, holdout=config.holdout,
                feature_normalization=config.feature_normalization,
                feature_mean_noise_multiplier=config.feature_mean_noise_multiplier,
                feature_scale=config.feature_scale,
            ))
        evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir, split=config.eval_split))
    with open(metrics_path) as f:
        scores = json.load(f)
    with open(os.path.join(run_dir, run_files.LEDGER)) as f:
        ledger = json.load(f)
    return point | {
        "achieved_epsilon": float(ledger["epsilon_spent"]),
        "noise_multiplier": ledger["noise_multiplier"],
        "top1": scores["top1"],
        "ema_top1": scores["ema_top1"],
        "run_dir": run_dir,
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and min/max of EMA top-1 over repeats, per (epsilon, learning rate)."""
    groups: dict[tuple[float, float], list[float]] = {}
    for row in rows:
        groups.setdefault((row["epsilon"], row["learning_rate"]), []).append(row["ema_top1"])
    return [
        {"epsilon": eps, "learning_rate": lr, "repeats": len(accs),
         "median_top1": statistics.median(accs), "min_top1": min(accs), "max_top1": max(accs)}
        for (eps, lr), accs in sorted(groups.items())
    ]


def _write_tables(out_dir: str, rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> None:
    for path, table in ((RUNS_CSV, rows), (SUMMARY_CSV, summary)):
        with open(os.path.join(out_dir, path), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    lines = ["| epsilon | learning rate | repeats | median top-1 (EMA) | min | max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        eps = "non-private" if math.isinf(s["epsilon"]) else f"{s['epsilon']:g}"
        lines.append(f"| {eps} | {s['learning_rate']:g} | {s['repeats']} | {100 * s['median_top1']:.2f}% "
                     f"| {100 * s['min_top1']:.2f}% | {100 * s['max_top1']:.2f}% |")
    with open(os.path.join(out_dir, SUMMARY_MD), "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(out_dir: str, summary: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private = [s for s in summary if math.isfinite(s["epsilon"])]
    best: dict[float, dict[str, Any]] = {}
    for s in private:  # best learning rate per epsilon, by median
        if s["epsilon"] not in best or s["median_top1"] > best[s["epsilon"]]["median_top1"]:
            best[s["epsilon"]] = s
    eps = sorted(best)
    med = [100 * best[e]["median_top1"] for e in eps]
    low = [m - 100 * best[e]["min_top1"] for m, e in zip(med, eps)]
    high = [100 * best[e]["max_top1"] - m for m, e in zip(med, eps)]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    ax.errorbar(eps, med, yerr=[low, high], marker="o", capsize=3, label="DP-SGD (median, min-max)")
    for s in summary:
        if math.isinf(s["epsilon"]):
            ax.axhline(100 * s["median_top1"], color="gray", linestyle="--", label="non-private")
            break
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon")
    ax.set_ylabel("test top-1 (%)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, PLOT))
    plt.close(fig)


def run(config: SweepConfig) -> list[dict[str, Any]]:
    os.makedirs(config.out_dir, exist_ok=True)
    rows = [_one(config, point) for point in _grid(config)]
    summary = summarize(rows)
    _write_tables(config.out_dir, rows, summary)
    _plot(config.out_dir, summary)
    return summary
