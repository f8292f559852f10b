"""The sweep command: a grid of DP training runs over epsilon and learning rate, repeated.

Every run reads the same data (in ``features`` mode the same feature cache, so a
sweep over epsilon never recomputes a feature). Each grid point is trained
``repeats`` times with fresh secret seeds, plus a non-private baseline; results go
to ``runs.csv`` (every run), ``summary.csv`` / ``summary.md`` (median and min-max
spread over repeats per grid point) and ``accuracy_vs_epsilon.png``.

A run directory that already holds its scores is reused, so an interrupted
sweep continues where it stopped instead of redoing (or re-spending) finished runs.

What it publishes: every DP run is (epsilon, delta)-DP on its own, but the sweep releases all
of them, on the same data. ``privacy.json`` and the head of ``summary.md`` give the composed
(epsilon, delta) of releasing every DP result together (``privacy.plan.composed_epsilon``).
The non-private baseline trains on the same private data without any guarantee: it is
marked NOT private everywhere, and the composed guarantee holds only without it.

With ``holdout`` N (features mode) every run trains on all but the last N training
rows and is scored on those rows (split ``holdout``), so hyper-parameters can be
chosen without touching the test split. Those scores are exact statistics of private rows:
such a sweep needs ``private_diagnostics``, and its tables and plot are private diagnostics
(``*.NOT-PRIVATE.*``, mode 0600).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import statistics
from typing import Any

from dpscale import files
from dpscale.errors import InvalidConfigError
from dpscale.files import open_for_writing, write_json_atomic
from dpscale.privacy.plan import composed_epsilon
from dpscale.stages import evaluate, train
from dpscale.training import release
from dpscale.training.config import Mode, TrainingConfig, training_config
from dpscale.training.model import HOLDOUT_SPLIT, detect_mode
from dpscale.training.run_directory import CONFIG, RunDirectory

RUNS_CSV = "runs.csv"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
PLOT = "accuracy_vs_epsilon.png"
PRIVACY_JSON = "privacy.json"


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A grid of runs: ``training`` with its epsilon and learning rate replaced per grid point.

    ``training`` must give the batch size and the steps (the noise multiplier is calibrated
    for each epsilon); its learning rate is the grid when ``learning_rates`` is empty.
    """

    data: str
    out_dir: str
    training: TrainingConfig
    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    learning_rates: tuple[float, ...] = ()  # () = (training.learning_rate,)
    repeats: int = 3
    baseline: bool = True  # a non-private run per repeat (same steps and batch size)
    baseline_learning_rate: float = 0.5
    baseline_momentum: float = 0.9
    eval_split: str = "test"

    def __post_init__(self) -> None:
        if self.training.features.holdout and self.eval_split != "holdout":
            object.__setattr__(self, "eval_split", "holdout")
        if not self.epsilons or any(not 0 < e < math.inf for e in self.epsilons):
            raise InvalidConfigError(f"epsilons must be positive and finite, got {self.epsilons}")
        if any(not 0 < lr < math.inf for lr in self.grid_learning_rates):
            raise InvalidConfigError(f"learning rates must be positive, got {self.grid_learning_rates}")
        if self.repeats < 1:
            raise InvalidConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.training.batch_size is None or self.training.steps is None:
            raise InvalidConfigError("a sweep needs --batch-size and --steps (the noise is calibrated per epsilon)")
        if self.training.noise_multiplier is not None:
            raise InvalidConfigError("a sweep calibrates the noise multiplier for each epsilon; drop --noise-multiplier")
        if self.scores_private_rows and not self.training.private_diagnostics:
            raise InvalidConfigError(
                f"scoring split {self.eval_split!r} (private training rows) makes the sweep's tables private "
                "diagnostics that epsilon does not cover; pass --private-diagnostics to run it anyway")

    @classmethod
    def from_options(cls, data: str, out_dir: str, *, epsilons: tuple[float, ...], learning_rates: tuple[float, ...],
                     repeats: int, baseline: bool, baseline_learning_rate: float, baseline_momentum: float,
                     mode: Mode | None = None, **options: Any) -> SweepConfig:
        """A sweep from flat options: the grid's, then every run's as ``train`` takes them.

        The shared ``training`` is non-private (``epsilon=inf``): each grid point sets its own
        epsilon, so none is given here.
        """
        if learning_rates:
            options["learning_rate"] = learning_rates[0]
        training = training_config(mode or detect_mode(data), epsilon=math.inf, **options)
        return cls(data=data, out_dir=out_dir, training=training, epsilons=epsilons, learning_rates=learning_rates,
                   repeats=repeats, baseline=baseline, baseline_learning_rate=baseline_learning_rate,
                   baseline_momentum=baseline_momentum)

    @property
    def scores_private_rows(self) -> bool:
        return self.eval_split in (HOLDOUT_SPLIT, self.training.train_split)

    @property
    def grid_learning_rates(self) -> tuple[float, ...]:
        return self.learning_rates or (self.training.learning_rate,)


@dataclasses.dataclass(frozen=True)
class SweepResult:
    out_dir: str
    rows: tuple[dict[str, Any], ...]  # one per run
    summary: tuple[dict[str, Any], ...]  # one per (epsilon, learning rate): median and spread over repeats
    composed_epsilon: float  # of releasing every DP run's result together, at ``delta``
    delta: float
    covered_by_epsilon: bool  # False: the tables hold scores of private rows (private diagnostics)
    warnings: tuple[str, ...] = ()


def _grid(config: SweepConfig) -> list[dict[str, Any]]:
    points = [
        {"epsilon": eps, "learning_rate": lr, "momentum": config.training.momentum, "repeat": r}
        for eps in config.epsilons
        for lr in config.grid_learning_rates
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
    run_dir = files.join(config.out_dir, "runs", _run_name(point))
    existing = RunDirectory(files.absolute(run_dir))
    diagnostic = config.scores_private_rows and math.isfinite(point["epsilon"])
    if existing.read_scores(config.eval_split, diagnostic=diagnostic) is None:
        if files.exists(existing.file(CONFIG)):
            train.run(train.ResumeConfig(run_dir, show_progress=config.training.show_progress))
        else:
            base = config.training
            training = dataclasses.replace(
                base, target=dataclasses.replace(base.target, epsilon=point["epsilon"]),
                learning_rate=point["learning_rate"], momentum=point["momentum"], seed=None)
            train.run(train.TrainConfig(data=config.data, run_dir=run_dir, training=training))
        evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir, split=config.eval_split,
                                             private_diagnostics=config.training.private_diagnostics))
    scores = existing.read_scores(config.eval_split, diagnostic=diagnostic)
    ledger = existing.read_ledger()
    return point | {
        "private": ledger.private,
        "achieved_epsilon": ledger.epsilon_spent,
        "noise_multiplier": ledger.noise_multiplier,
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
        {"epsilon": eps, "private": math.isfinite(eps), "learning_rate": lr, "repeats": len(accs),
         "median_top1": statistics.median(accs), "min_top1": min(accs), "max_top1": max(accs)}
        for (eps, lr), accs in sorted(groups.items())
    ]


def _open(out_dir: str, name: str, *, diagnostic: bool, newline: str | None = None) -> Any:
    """A table file of the sweep; private diagnostics get their name and mode 0600."""
    path = files.join(out_dir, release.diagnostic_name(name) if diagnostic else name)
    return open_for_writing(path, private=diagnostic, newline=newline)


def _privacy_note(privacy: dict[str, Any]) -> str:
    note = (f"Releasing all {privacy['private_runs']} DP results of this sweep together is "
            f"({privacy['composed_epsilon']:.4g}, {privacy['delta']:g})-DP ({privacy['accountant'].upper()} "
            "composition of every run); each run alone is the epsilon of its row.")
    if privacy["non_private_runs"]:
        note += (" The non-private baseline trained on the same data without any guarantee: its scores are "
                 "NOT private, and the composed guarantee holds only if they are not released.")
    return note


def _write_tables(out_dir: str, rows: list[dict[str, Any]], summary: list[dict[str, Any]],
                  privacy: dict[str, Any], *, diagnostic: bool) -> None:
    for name, table in ((RUNS_CSV, rows), (SUMMARY_CSV, summary)):
        with _open(out_dir, name, diagnostic=diagnostic, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    lines = [_privacy_note(privacy), "",
             "| epsilon | learning rate | repeats | median top-1 (EMA) | min | max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        eps = "non-private (NOT private)" if math.isinf(s["epsilon"]) else f"{s['epsilon']:g}"
        lines.append(f"| {eps} | {s['learning_rate']:g} | {s['repeats']} | {100 * s['median_top1']:.2f}% "
                     f"| {100 * s['min_top1']:.2f}% | {100 * s['max_top1']:.2f}% |")
    with _open(out_dir, SUMMARY_MD, diagnostic=diagnostic) as f:
        f.write("\n".join(lines) + "\n")


def _plot(out_dir: str, summary: list[dict[str, Any]], *, split: str, diagnostic: bool) -> None:
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
            ax.axhline(100 * s["median_top1"], color="gray", linestyle="--", label="non-private (NOT private)")
            break
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon")
    ax.set_ylabel(f"{split} top-1 (%)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = files.join(out_dir, release.diagnostic_name(PLOT) if diagnostic else PLOT)
    with open_for_writing(path, private=diagnostic, binary=True) as f:  # 0600 before any pixel
        fig.savefig(f, format="png")
    plt.close(fig)


def run(config: SweepConfig) -> SweepResult:
    files.makedirs(config.out_dir)
    rows = [_one(config, point) for point in _grid(config)]
    summary = summarize(rows)
    plans = [RunDirectory(files.absolute(r["run_dir"])).read_spec().plan for r in rows]
    dp_plans = [plan for plan in plans if plan.private]
    delta = config.training.target.delta
    privacy = {
        "composed_epsilon": composed_epsilon(dp_plans, delta=delta, accountant=config.training.target.accountant),
        "delta": delta, "accountant": config.training.target.accountant, "private_runs": len(dp_plans),
        "runs": [{"run_dir": r["run_dir"], "private": r["private"], "epsilon": r["achieved_epsilon"]} for r in rows],
        "non_private_runs": [r["run_dir"] for r in rows if not r["private"]],
        "scores_private_rows": config.scores_private_rows,
    }
    privacy["note"] = _privacy_note(privacy)
    write_json_atomic(files.join(config.out_dir, PRIVACY_JSON), privacy)
    diagnostic = config.scores_private_rows
    _write_tables(config.out_dir, rows, summary, privacy, diagnostic=diagnostic)
    _plot(config.out_dir, summary, split=config.eval_split, diagnostic=diagnostic)
    warnings = tuple(dict.fromkeys(w for plan in dp_plans for w in plan.warnings))
    if diagnostic:
        warnings += (release.warning(f"the sweep's tables and plot in {config.out_dir!r} ({config.eval_split} scores)"),)
    return SweepResult(out_dir=config.out_dir, rows=tuple(rows), summary=tuple(summary),
                       composed_epsilon=privacy["composed_epsilon"], delta=delta,
                       covered_by_epsilon=not diagnostic, warnings=warnings)
