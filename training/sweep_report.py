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

The plot is drawn by ``training.sweep_plot``; the non-private baseline (NOT private) goes into its
own directory's tables and plot, and into OUT_DIR's plot only when that plot is a private
diagnostic too (``write_all``). ``finished_lines`` tells the reader where it all is.
"""

from __future__ import annotations

import csv
import os
import stat
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from dpscale import files
from dpscale.files import open_for_writing
from dpscale.progress import clock
from dpscale.training import release, sweep_plot
from dpscale.training.grid import flag, value_text
from dpscale.training.sweep_directory import BASELINE_DIR, RUNS
from dpscale.training.sweep_plot import setting_label

RUNS_CSV = "runs.csv"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
CHOSEN_CSV = "chosen.csv"
PLOT = "accuracy_vs_epsilon.png"
TABLES = (RUNS_CSV, SUMMARY_CSV, SUMMARY_MD, CHOSEN_CSV, PLOT)
NO_CHOICE = (
    "no setting was chosen: every grid point is reported (choose settings with --holdout N, on held-out "
    "training rows, never on the test split)"
)


def summarize(rows: Sequence[dict[str, Any]], options: Sequence[str]) -> list[dict[str, Any]]:
    """Median and min/max of EMA top-1 over repeats, per (epsilon, value of every gridded option)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in ("epsilon", *options)), []).append(row)
    out = []
    for key, members in groups.items():  # in grid order (dicts keep it)
        accs = [r["ema_top1"] for r in members]
        out.append(
            dict(zip(("epsilon", *options), key))
            | {
                "private": members[0]["private"],
                "split": members[0]["split"],
                "repeats": len(accs),
                "median_top1": statistics.median(accs),
                "min_top1": min(accs),
                "max_top1": max(accs),
            }
        )
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


def _path(out_dir: str, name: str, *, diagnostic: bool) -> str:
    return files.join(out_dir, release.diagnostic_name(name) if diagnostic else name)


def _open(out_dir: str, name: str, *, diagnostic: bool, owner_only: bool = False, binary: bool = False) -> Any:
    """A table file; private diagnostics get their name, and they (or ``owner_only``) mode 0600."""
    return open_for_writing(
        _path(out_dir, name, diagnostic=diagnostic), private=diagnostic or owner_only, binary=binary
    )


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


def _csv(out_dir: str, name: str, table: Sequence[dict[str, Any]], *, diagnostic: bool, owner_only: bool) -> list[str]:
    if not table:
        return []
    with _open(out_dir, name, diagnostic=diagnostic, owner_only=owner_only) as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    return [_path(out_dir, name, diagnostic=diagnostic)]


def write_tables(
    out_dir: str,
    *,
    rows: Sequence[dict[str, Any]],
    summary: Sequence[dict[str, Any]],
    chosen: Sequence[dict[str, Any]],
    options: Sequence[str],
    head: Sequence[str],
    diagnostic: bool,
    owner_only: bool = False,
    epsilon_label: str = "epsilon",
) -> list[str]:
    """runs.csv, summary.csv, summary.md and (after a choice) chosen.csv; ``head`` opens summary.md.

    ``diagnostic``: named ``*.NOT-PRIVATE.*`` and owner-only; ``owner_only``: owner-only whatever they hold.
    Returns the paths written, summary.md first.
    """
    written = [_path(out_dir, SUMMARY_MD, diagnostic=diagnostic)]
    for name, table in ((RUNS_CSV, rows), (SUMMARY_CSV, summary), (CHOSEN_CSV, chosen)):
        written += _csv(out_dir, name, table, diagnostic=diagnostic, owner_only=owner_only)
    split = summary[0]["split"] if summary else "test"
    columns = [epsilon_label, *(flag(o) for o in options), "repeats", f"median {split} top-1 (EMA)", "min", "max"]
    lines = [*head, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for s in summary:
        cells = [
            f"{s['epsilon']:g}",
            *(value_text(s[o]) for o in options),
            str(s["repeats"]),
            _percent(s["median_top1"]),
            _percent(s["min_top1"]),
            _percent(s["max_top1"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if chosen:
        tested = "test_median_top1" in chosen[0]
        lines += [
            "",
            "Chosen on held-out training rows (best median per epsilon)"
            + ("; then scored on the test split:" if tested else " (the test split was not read):"),
            "",
            f"| {epsilon_label} | setting | median holdout top-1 | median test top-1 (EMA) | min | max |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for c in chosen:
            test = [_percent(c[k]) if tested else "-" for k in ("test_median_top1", "test_min_top1", "test_max_top1")]
            lines.append(
                f"| {c['epsilon']:g} | {setting_label([(o, c[o]) for o in options])} "
                f"| {_percent(c['holdout_median_top1'])} | {' | '.join(test)} |"
            )
    with _open(out_dir, SUMMARY_MD, diagnostic=diagnostic, owner_only=owner_only) as f:
        f.write("\n".join(lines) + "\n")
    return written


def plot(
    out_dir: str,
    *,
    summary: Sequence[dict[str, Any]],
    chosen: Sequence[dict[str, Any]],
    options: Sequence[str],
    title: str,
    diagnostic: bool,
    owner_only: bool = False,
    epsilon_label: str = "epsilon",
    baseline: Sequence[dict[str, Any]] = (),
) -> str:
    """Accuracy vs epsilon (``training.sweep_plot``); returns the path written.

    ``baseline`` (the non-private baseline's summary) only into a diagnostic plot: it is NOT private.
    """
    if baseline and not diagnostic:
        raise ValueError("the non-private baseline drawn into a plot that epsilon covers")
    fig = sweep_plot.figure(
        summary=summary, chosen=chosen, options=options, title=title, epsilon_label=epsilon_label, baseline=baseline
    )
    with _open(out_dir, PLOT, diagnostic=diagnostic, owner_only=owner_only, binary=True) as f:  # 0600 before any pixel
        sweep_plot.save(fig, f)
    return _path(out_dir, PLOT, diagnostic=diagnostic)


def title(options: Sequence[str], *, chosen: bool, simulate_batch: int | None, split: str) -> str:
    """The plot's title: what its points are."""
    names = ", ".join(flag(o).replace("learning-rate", "learning rate") for o in options)
    if simulate_batch:
        return (
            f"TAN simulation at batch {simulate_batch}, NOT private at these epsilons: every setting ({split} scores)"
        )
    if chosen:
        return f"best {names} per epsilon, chosen on held-out training rows; test scores of the chosen runs"
    return "every grid point; none chosen (no --holdout): test scores"


def write_all(
    out_dir: str,
    baseline_dir: str | None,
    *,
    options: Sequence[str],
    rows: Sequence[dict[str, Any]],
    summary: Sequence[dict[str, Any]],
    chosen: Sequence[dict[str, Any]],
    plotted: Sequence[dict[str, Any]],
    head: Sequence[str],
    title: str,
    diagnostic: bool,
    owner_only: bool,
    epsilon_label: str,
    baseline_rows: Sequence[dict[str, Any]],
    baseline_summary: Sequence[dict[str, Any]],
    make_baseline_dir: Callable[[], str],
) -> list[str]:
    """A sweep's tables and plot in ``out_dir``, then the baseline's in ``baseline_dir``; the paths written.

    The baseline is drawn only into plots that are private diagnostics: ``out_dir``'s when its tables
    are (held-out or simulated scores), and always the one in the baseline's directory, beside the DP runs.
    """
    written = write_tables(
        out_dir,
        rows=rows,
        summary=summary,
        chosen=chosen,
        options=options,
        head=head,
        diagnostic=diagnostic,
        owner_only=owner_only,
        epsilon_label=epsilon_label,
    )
    written.append(
        plot(
            out_dir,
            summary=summary,
            chosen=plotted,
            options=options,
            title=title,
            diagnostic=diagnostic,
            owner_only=owner_only,
            epsilon_label=epsilon_label,
            baseline=baseline_summary if diagnostic else (),
        )
    )
    if baseline_dir is None:
        return written
    make_baseline_dir()
    remove_stale_tables(baseline_dir)
    written += write_tables(
        baseline_dir,
        rows=baseline_rows,
        summary=baseline_summary,
        chosen=[],
        options=options,
        diagnostic=True,
        head=[BASELINE_HEAD],
    )
    written.append(
        plot(
            baseline_dir,
            summary=summary,
            chosen=plotted,
            options=options,
            diagnostic=True,
            title=f"{title}; with the non-private baseline (NOT private)",
            epsilon_label=epsilon_label,
            baseline=baseline_summary,
        )
    )
    return written


BASELINE_HEAD = (
    "Non-private baseline: NOT private. Trained on the same private data without any guarantee; keep "
    "these results to yourself."
)


def finished_lines(out_dir: str, written: Sequence[str], *, trained: int, reused: int, seconds: float) -> list[str]:
    """What a finished sweep tells its reader on stderr: what ran and where its tables are (no score)."""
    lines = [
        f"sweep finished: {trained + reused} runs ({trained} trained, {reused} reused) in {clock(seconds)}; "
        f"each run in {files.join(out_dir, RUNS)}/NAME"
    ]
    apart = files.join(out_dir, BASELINE_DIR)
    tables = [f for f in written if not f.startswith(apart)]
    baseline = [f for f in written if f.startswith(apart)]
    if tables:
        lines.append(f"the results: {tables[0]} (median and min-max per setting); also {', '.join(tables[1:])}")
    if baseline:
        lines.append(f"the non-private baseline, NOT private: {baseline[0]}; also {', '.join(baseline[1:])}")
    return lines


def privacy_note(record: dict[str, Any]) -> str:
    note = (
        f"Releasing all {record['private_runs']} DP results in this sweep's directory together is "
        f"({record['composed_epsilon']:.4g}, {record['delta']:g})-DP ({record['accountant'].upper()} "
        "composition of every private run it holds, from every invocation); each run alone is the epsilon "
        "of its row."
    )
    if record["non_private_runs"]:
        note += (
            " The non-private baseline trained on the same data without any guarantee: its scores are "
            "NOT private, and the composed guarantee holds only if they are not released."
        )
    return note
