"""A private selection against the held-out choice it replaces, from two finished sweeps of one grid.

    python -m benchmarks.private_selection --selection OUT_SEL --heldout OUT_HO

OUT_SEL: ``dpscale sweep ... --private-selection --holdout N``: per repeat, one selection whose epsilon
covers the chosen model and its choice. OUT_HO: ``dpscale sweep ... --holdout N --private-diagnostics``
of the same grid at the same epsilon: every run gets the whole budget, and the choice, made on exact
held-out scores, is not covered by any epsilon. Per repeat r the held-out choice here is the best run
of repeat r by its held-out top-1 (EMA), scored on the test split without saving it (one seed's
choice, like one selection); the sweep's own choice (best median over all repeats) is printed too.
Prints Markdown: per repeat, each procedure's chosen learning rate (or setting), its test top-1 and the
epsilon of what it publishes, then medians.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from dpscale.stages import evaluate
from dpscale.training import release
from dpscale.training.sweep_report import CHOSEN_CSV, RUNS_CSV

SETTING = ("learning_rate",)  # the benchmark's grid; other gridded options are listed when present


def selections(out: str) -> list[dict[str, Any]]:
    """Each selection's published outcome (``OUT/chosen/NAME.json``), in repeat order."""
    chosen = os.path.join(out, "chosen")
    found = []
    for name in sorted(n for n in os.listdir(chosen) if n.endswith(".json")):
        with open(os.path.join(chosen, name)) as f:
            found.append(json.load(f))
    return sorted(found, key=lambda o: (o["target_epsilon"], o["repeat"]))


def heldout_choices(out: str) -> list[dict[str, Any]]:
    """Per repeat of a held-out sweep: its best run by held-out top-1 (EMA), with that run's test top-1."""
    with open(os.path.join(out, release.diagnostic_name(RUNS_CSV)), newline="") as f:
        rows = list(csv.DictReader(f))
    choices = []
    for repeat in sorted({int(r["repeat"]) for r in rows}):
        mine = [r for r in rows if int(r["repeat"]) == repeat]
        best = max(mine, key=lambda r: float(r["ema_top1"]))  # the first in grid order on a tie
        test = evaluate.run(evaluate.EvaluateConfig(run_dir=best["run_dir"], split="test", save=False))
        choices.append(
            {
                "repeat": repeat,
                "setting": {k: best[k] for k in SETTING},
                "holdout_top1": float(best["ema_top1"]),
                "test_top1": test.ema_top1,
                "run_epsilon": float(best["achieved_epsilon"]),
            }
        )
    return choices


def sweep_choice(out: str) -> dict[str, Any] | None:
    """The held-out sweep's own choice (the best median over repeats) and its runs' test scores."""
    path = os.path.join(out, release.diagnostic_name(CHOSEN_CSV))
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        return next(csv.DictReader(f))


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def table(chosen: Sequence[dict[str, Any]], heldout: Sequence[dict[str, Any]], own: dict[str, Any] | None) -> str:
    lines = [
        "| repeat | private selection: chosen lr | test top-1 (EMA) | noisy held-out top-1 | epsilon (covers the "
        "choice) | held-out choice: chosen lr | test top-1 (EMA) | exact held-out top-1 | epsilon per run "
        "(choice NOT covered) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, h in zip(chosen, heldout):
        c = s["chosen"]
        private = (
            ["nothing (K = 0)", "-", "-"]
            if c is None
            else [
                f"{c['learning_rate']:g}",
                _pct(c["test_top1"]),
                _pct(c["holdout_noisy_top1"]),
            ]
        )
        lines.append(
            f"| {s['repeat']} | {' | '.join(private)} | {s['epsilon']:.4g} | {float(h['setting']['learning_rate']):g} | "
            f"{_pct(h['test_top1'])} | {_pct(h['holdout_top1'])} | {h['run_epsilon']:.4g} |"
        )
    tests = [s["chosen"]["test_top1"] for s in chosen if s["chosen"]]
    held = [h["test_top1"] for h in heldout]
    lines.append(
        f"| median | | {_pct(statistics.median(tests)) if tests else '-'} | | | | {_pct(statistics.median(held))} | | |"
    )
    if own is not None:
        lines += [
            "",
            f"The held-out sweep's own choice (best median held-out top-1 over all repeats): lr "
            f"{float(own['learning_rate']):g}, test top-1 (EMA) median {_pct(float(own['test_median_top1']))} "
            f"({_pct(float(own['test_min_top1']))}-{_pct(float(own['test_max_top1']))}).",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selection", required=True, help="a finished `sweep --private-selection` OUT_DIR")
    parser.add_argument("--heldout", required=True, help="a finished `sweep --holdout N --private-diagnostics` OUT_DIR")
    args = parser.parse_args(argv)
    print(table(selections(args.selection), heldout_choices(args.heldout), sweep_choice(args.heldout)))


if __name__ == "__main__":
    main()
