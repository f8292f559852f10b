"""Accuracy against one gridded option (augmult K, batch size) at a fixed epsilon, from finished sweeps.

    python -m benchmarks.sweep_trend --option augmult --real OUT_K124 --real OUT_K8 --sim OUT_SIM \
        --out benchmarks/results/fmnist_augmult.png

Reads each sweep's runs table (``runs.csv``, or ``runs.NOT-PRIVATE.csv`` when the sweep scored held-out
rows), groups the real runs by the option's value and prints a Markdown table: the median EMA top-1 over
seeds with its min-max, the last iterate's median (the same runs without EMA), and the simulated search's
(``sweep --simulate-batch``) prediction beside each real point. Draws the same as a plot: real medians with
their seed spread, the last iterates, the simulation. A sweep writes its own accuracy-vs-epsilon plot; this
one answers the paper's other question, what an option buys at one epsilon.

Held-out scores are statistics of private training rows: the table and the plot say so when they hold any.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from collections.abc import Sequence
from typing import Any

from dpscale.training import release
from dpscale.training.sweep_report import RUNS_CSV


def read_runs(sweep_dir: str) -> list[dict[str, Any]]:
    """The rows of a sweep's runs table (whichever of the two names it wrote)."""
    for name in (RUNS_CSV, release.diagnostic_name(RUNS_CSV)):
        path = os.path.join(sweep_dir, name)
        if os.path.exists(path):
            with open(path, newline="") as f:
                return list(csv.DictReader(f))
    raise SystemExit(f"sweep_trend: {sweep_dir!r} has no {RUNS_CSV} (is the sweep finished?)")


def trend(real: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]], option: str) -> list[dict[str, Any]]:
    """Per value of ``option`` (ascending): the real runs' EMA and last-iterate statistics, the simulation's median."""
    points = []
    for value in sorted({float(r[option]) for r in real}):
        mine = [r for r in real if float(r[option]) == value]
        ema = [float(r["ema_top1"]) for r in mine]
        last = [float(r["top1"]) for r in mine]
        simulated = [float(r["ema_top1"]) for r in sim if float(r[option]) == value]
        points.append(
            {
                "value": value,
                "seeds": len(ema),
                "split": mine[0]["split"],
                "epsilon": max(float(r["achieved_epsilon"]) for r in mine),
                "ema_median": statistics.median(ema),
                "ema_min": min(ema),
                "ema_max": max(ema),
                "last_median": statistics.median(last),
                "sim_median": statistics.median(simulated) if simulated else None,
            }
        )
    return points


def table(points: Sequence[dict[str, Any]], option: str) -> str:
    """The Markdown table of ``trend``'s points (accuracies in percent)."""
    lines = [
        f"| {option} | seeds | {points[0]['split']} top-1, EMA: median (min-max) | last iterate (no EMA): median "
        "| simulated (TAN, NOT private at the target) | simulated - real |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for p in points:
        sim = p["sim_median"]
        lines.append(
            f"| {p['value']:g} | {p['seeds']} | {100 * p['ema_median']:.2f}% ({100 * p['ema_min']:.2f}-"
            f"{100 * p['ema_max']:.2f}) | {100 * p['last_median']:.2f}% | "
            + (f"{100 * sim:.2f}% | {100 * (sim - p['ema_median']):+.2f} |" if sim is not None else "- | - |")
        )
    return "\n".join(lines)


def plot(points: Sequence[dict[str, Any]], option: str, out: str, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["value"] for p in points]
    med = [100 * p["ema_median"] for p in points]
    spread = [
        [m - 100 * p["ema_min"] for m, p in zip(med, points)],
        [100 * p["ema_max"] - m for m, p in zip(med, points)],
    ]
    fig, ax = plt.subplots(figsize=(6.0, 4.0), dpi=120, layout="constrained")
    ax.errorbar(x, med, yerr=spread, marker="o", capsize=3, label="private runs, EMA (median, min-max over seeds)")
    ax.plot(x, [100 * p["last_median"] for p in points], "s--", alpha=0.7, label="same runs, last iterate (no EMA)")
    sim = [(p["value"], 100 * p["sim_median"]) for p in points if p["sim_median"] is not None]
    if sim:
        ax.plot(*zip(*sim), "x:", markersize=8, label="simulated search (TAN), NOT private at the target")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel(option)
    split = points[0]["split"]
    note = " (held-out training rows: NOT covered by epsilon)" if split != "test" else ""
    ax.set_ylabel(f"{split} top-1 (%)")
    ax.set_title(title + note, fontsize=8, wrap=True)
    ax.grid(alpha=0.3)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2, frameon=False)  # below the axes: covers no point
    fig.savefig(out)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", required=True, help="the gridded column, e.g. augmult or batch_size")
    parser.add_argument("--real", action="append", required=True, help="a finished sweep of private runs")
    parser.add_argument("--sim", action="append", default=[], help="a finished --simulate-batch sweep")
    parser.add_argument("--out", help="write the plot here (PNG)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    real = [r for d in args.real for r in read_runs(d)]  # a sweep's baseline runs are in a table of their own
    sim = [r for d in args.sim for r in read_runs(d)]
    points = trend(real, sim, args.option)
    print(table(points, args.option))
    if args.out:
        plot(points, args.option, args.out, title=args.title or f"accuracy against {args.option}")


if __name__ == "__main__":
    main()
