"""What a sweep reports: per-setting summaries, the choice on held-out rows, tables, a plot, privacy.json.

Summaries are the median and min-max over repeats of EMA top-1 per (epsilon, setting). A choice
is made only on held-out training rows (``choose``): the best setting per epsilon by its median
held-out score; the test split is read afterwards, for the chosen runs only. Without held-out rows
nothing is chosen and every grid point is reported.

What the sweep released (``privacy.json``) is the sweep directory's business
(``training.sweep_directory``); ``privacy_note`` says it in words.

Tables of private diagnostics (held-out scores, a choice made on them, simulations) are named
``*.NOT-PRIVATE.*`` and written owner-only (0600). A later sweep in the same directory replaces
an earlier one's tables, but never makes them readable again: if any table it removes was
owner-only, its own are owner-only too (``remove_stale_tables`` says which it removed).
"""

from __future__ import annotations

import csv
import os
import stat
import statistics
from collections.abc import Sequence
from typing import Any

from dpscale import files
from dpscale.files import open_for_writing
from dpscale.training import release
from dpscale.training.grid import flag, value_text

RUNS_CSV = "runs.csv"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
CHOSEN_CSV = "chosen.csv"
PLOT = "accuracy_vs_epsilon.png"
TABLES = (RUNS_CSV, SUMMARY_CSV, SUMMARY_MD, CHOSEN_CSV, PLOT)
NO_CHOICE = ("no setting was chosen: every grid point is reported (choose settings with --holdout N, on held-out "
             "training rows, never on the test split)")


def setting_label(setting: Sequence[tuple[str, Any]]) -> str:
    """``lr 2, augmult 4``: a setting as a reader sees it."""
    short = {"learning_rate": "lr"}
    return ", ".join(f"{short.get(k, flag(k))} {value_text(v)}" for k, v in setting) or "-"


def summarize(rows: Sequence[dict[str, Any]], options: Sequence[str]) -> list[dict[str, Any]]:
    """Median and min/max of EMA top-1 over repeats, per (epsilon, value of every gridded option)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in ("epsilon", *options)), []).append(row)
    out = []
    for key, members in groups.items():  # in grid order (dicts keep it)
        accs = [r["ema_top1"] for r in members]
        out.append(dict(zip(("epsilon", *options), key)) | {
            "private": members[0]["private"], "split": members[0]["split"], "repeats": len(accs),
            "median_top1": statistics.median(accs), "min_top1": min(accs), "max_top1": max(accs)})
    return out


def choose(summary: Sequence[dict[str, Any]], options: Sequence[str]) -> list[dict[str, Any]]:
    """Per epsilon, the summary row with the best median (the first in grid order on a tie).

    Only ever called on held-out scores: the caller checks the split, so a choice cannot be
    made on the test split by mistake.
    """
    best: dict[float, dict[str, Any]] = {}
    for row in summary:
        if row["split"] == "test":
            raise ValueError("a choice on the test split")
        if row["epsilon"] not in best or row["median_top1"] > best[row["epsilon"]]["median_top1"]:
            best[row["epsilon"]] = row
    return [best[eps] for eps in sorted(best)]


def _percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def _open(out_dir: str, name: str, *, diagnostic: bool, owner_only: bool = False, binary: bool = False) -> Any:
    """A table file; private diagnostics get their name, and they (or ``owner_only``) mode 0600."""
    path = files.join(out_dir, release.diagnostic_name(name) if diagnostic else name)
    return open_for_writing(path, private=diagnostic or owner_only, binary=binary)


def _is_owner_only(path: str) -> bool:
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and not st.st_mode & 0o077


def remove_stale_tables(out_dir: str) -> list[str]:
    """Drop the tables of an earlier invocation: they describe its grid, not this one's (its runs stay).

    Returns the names of those that were owner-only: the tables that replace them must be too.
    """
    closed = []
    for name in TABLES:
        for variant in (name, release.diagnostic_name(name)):
            path = files.join(out_dir, variant)
            if files.is_url(path):  # no modes: the bucket's access control decides
                if files.exists(path):
                    files.remove(path)
            elif os.path.lexists(path):  # lexists: a dangling link too
                if _is_owner_only(path):
                    closed.append(variant)
                files.remove(path)
    return closed


def _csv(out_dir: str, name: str, table: Sequence[dict[str, Any]], *, diagnostic: bool, owner_only: bool) -> None:
    if not table:
        return
    with _open(out_dir, name, diagnostic=diagnostic, owner_only=owner_only) as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


def write_tables(out_dir: str, *, rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]],
                 chosen: Sequence[dict[str, Any]], options: Sequence[str], head: Sequence[str],
                 diagnostic: bool, owner_only: bool = False, epsilon_label: str = "epsilon") -> None:
    """runs.csv, summary.csv, summary.md and (after a choice) chosen.csv; ``head`` opens summary.md.

    ``diagnostic``: named ``*.NOT-PRIVATE.*`` and owner-only; ``owner_only``: owner-only whatever they hold.
    """
    _csv(out_dir, RUNS_CSV, rows, diagnostic=diagnostic, owner_only=owner_only)
    _csv(out_dir, SUMMARY_CSV, summary, diagnostic=diagnostic, owner_only=owner_only)
    _csv(out_dir, CHOSEN_CSV, chosen, diagnostic=diagnostic, owner_only=owner_only)
    split = summary[0]["split"] if summary else "test"
    columns = [epsilon_label, *(flag(o) for o in options), "repeats", f"median {split} top-1 (EMA)", "min", "max"]
    lines = [*head, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for s in summary:
        cells = [f"{s['epsilon']:g}", *(value_text(s[o]) for o in options), str(s["repeats"]),
                 _percent(s["median_top1"]), _percent(s["min_top1"]), _percent(s["max_top1"])]
        lines.append("| " + " | ".join(cells) + " |")
    if chosen:
        tested = "test_median_top1" in chosen[0]
        lines += ["", "Chosen on held-out training rows (best median per epsilon)"
                  + ("; then scored on the test split:" if tested else " (the test split was not read):"), "",
                  f"| {epsilon_label} | setting | median holdout top-1 | median test top-1 (EMA) | min | max |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for c in chosen:
            test = [_percent(c[k]) if tested else "-" for k in ("test_median_top1", "test_min_top1", "test_max_top1")]
            lines.append(f"| {c['epsilon']:g} | {setting_label([(o, c[o]) for o in options])} "
                         f"| {_percent(c['holdout_median_top1'])} | {' | '.join(test)} |")
    with _open(out_dir, SUMMARY_MD, diagnostic=diagnostic, owner_only=owner_only) as f:
        f.write("\n".join(lines) + "\n")


def plot(out_dir: str, *, summary: Sequence[dict[str, Any]], chosen: Sequence[dict[str, Any]],
         options: Sequence[str], title: str, diagnostic: bool, owner_only: bool = False,
         epsilon_label: str = "epsilon") -> None:
    """Accuracy vs epsilon: the chosen setting per epsilon, or one line per setting when none was chosen.

    The epsilon axis is logarithmic, its ticks are the grid's epsilons written plainly (1, 2, 4, 8).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    others = [o for o in options if o != "epsilon"]
    if chosen:
        eps = [c["epsilon"] for c in chosen]
        med = [100 * c["test_median_top1"] for c in chosen]
        err = [[m - 100 * c["test_min_top1"] for m, c in zip(med, chosen)],
               [100 * c["test_max_top1"] - m for m, c in zip(med, chosen)]]
        ax.errorbar(eps, med, yerr=err, marker="o", capsize=3, label="chosen on held-out rows (median, min-max)")
        for e, m, c in zip(eps, med, chosen):
            ax.annotate(setting_label([(o, c[o]) for o in others]), (e, m), textcoords="offset points",
                        xytext=(4, 6), fontsize=7)
        ylabel = "test top-1 (%, EMA)"
    else:
        lines: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for s in summary:
            lines.setdefault(tuple(s[o] for o in others), []).append(s)
        for key, points in lines.items():
            points = sorted(points, key=lambda s: s["epsilon"])
            med = [100 * s["median_top1"] for s in points]
            err = [[m - 100 * s["min_top1"] for m, s in zip(med, points)],
                   [100 * s["max_top1"] - m for m, s in zip(med, points)]]
            ax.errorbar([s["epsilon"] for s in points], med, yerr=err, marker="o", capsize=3,
                        label=setting_label(list(zip(others, key))))
        eps = sorted({s["epsilon"] for s in summary})
        ylabel = f"{summary[0]['split'] if summary else 'test'} top-1 (%, EMA, median and min-max)"
    ax.set_xscale("log", base=2)
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(epsilon_label)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with _open(out_dir, PLOT, diagnostic=diagnostic, owner_only=owner_only, binary=True) as f:  # 0600 before any pixel
        fig.savefig(f, format="png")
    plt.close(fig)


def privacy_note(record: dict[str, Any]) -> str:
    note = (f"Releasing all {record['private_runs']} DP results in this sweep's directory together is "
            f"({record['composed_epsilon']:.4g}, {record['delta']:g})-DP ({record['accountant'].upper()} "
            "composition of every private run it holds, from every invocation); each run alone is the epsilon "
            "of its row.")
    if record["non_private_runs"]:
        note += (" The non-private baseline trained on the same data without any guarantee: its scores are "
                 "NOT private, and the composed guarantee holds only if they are not released.")
    return note
