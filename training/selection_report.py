"""What a private-selection sweep publishes: each selection's outcome, the tables, privacy.json, the JSON line.

A selection (``training.selection_sweep``) publishes one thing: its chosen run (``OUT/chosen/NAME``,
a run directory like any other), with the setting it has, its noisy held-out top-1 (the score the
choice was made on, part of the accounted mechanism) and its test-split scores (post-processing,
the test split held apart), all covered by the selection's (epsilon, delta). Nothing here names
or counts the other runs: their number K is secret, and their scores are never written. Those
runs stay in ``OUT/selection.NOT-PRIVATE/`` (owner-only), each DP on its own but not covered by the
selection's epsilon if released. The tables hold only outcomes, so they are not private
diagnostics; privacy.json composes every selection that began in OUT.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
from collections.abc import Sequence
from typing import Any

from dpscale import files
from dpscale.files import open_for_writing, write_json_atomic
from dpscale.privacy.selection import SelectionPlan, composed_selection_epsilon
from dpscale.training import sweep_report
from dpscale.training.grid import GridPoint
from dpscale.training.run_directory import RunDirectory
from dpscale.training.sweep_directory import PRIVACY_JSON, SELECTION_DIR, finite
from dpscale.training.sweep_plot import setting_label

WORKSPACE = SELECTION_DIR
CHOSEN_DIR = "chosen"
MECHANISM = "private selection (Papernot & Steinke 2022)"
COVERS = (
    "each selection's (epsilon, delta) covers what it publishes: the chosen run (OUT/chosen/NAME: its "
    "parameters, EMA parameters, config, ledger and metrics), its setting, its noisy held-out top-1 and its "
    "test-split scores (the test split held apart from the training data); composed_epsilon covers publishing "
    "every selection's output in OUT together"
)
NOT_COVERED = (
    f"OUT/{WORKSPACE}/ (owner-only): every other run of each selection, how many there were, their settings, "
    "models, ledgers and anything computed from them; each run is DP on its own, but releasing any of it is "
    "not covered by a selection's epsilon",
    "the number of runs of a selection and whatever shows it: the progress lines on stderr (run k of a "
    "selection) and the sweep's wall time",
)


def mark_chosen(run: RunDirectory, name: str, plan: SelectionPlan) -> None:
    """The chosen run's ledger says which guarantee covers it with its choice (idempotent)."""
    ledger = run.read_ledger()
    note = (
        f"chosen by the {MECHANISM} {name}: this model with its choice is ({plan.epsilon():.4g}, "
        f"{plan.run.delta:g})-DP (RDP; the selection's repetitions and scores included); epsilon_spent is "
        "this run's alone and does not cover the choice"
    )
    if note not in ledger.not_covered:
        run.write_ledger(dataclasses.replace(ledger, not_covered=(*ledger.not_covered, note)))


def outcome(
    name: str,
    epsilon: float,
    repeat: int,
    plan: SelectionPlan,
    *,
    holdout: int,
    settings: Sequence[GridPoint],
    chosen: dict[str, Any] | None,
) -> dict[str, Any]:
    """What a selection publishes (``OUT/chosen/NAME.json``): its guarantee, how it chose, and its choice."""
    repetitions = plan.selection.repetitions
    return {
        "selection": name,
        "target_epsilon": epsilon,
        "repeat": repeat,
        "epsilon": plan.epsilon(),
        "delta": plan.run.delta,
        "accountant": "rdp",
        "mechanism": (
            f"{MECHANISM}: the best of K runs, K {repetitions.describe()} (secret); each run a setting drawn "
            f"uniformly from the grid, trained with the run plan, scored on the last {holdout} training rows "
            f"(held out) by its count of correct EMA predictions plus Gaussian noise of {plan.selection.score_noise:g}"
        ),
        "repetitions": repetitions.to_json(),
        "score_noise": plan.selection.score_noise,
        "holdout": holdout,
        "run_plan": plan.run.to_json(),
        "run_epsilon": plan.run.epsilon(),
        "settings": [dict(p.setting) for p in settings],
        "chosen": chosen,  # None: K = 0 (Poisson), the selection published nothing
    }


def _selection_plans(out_dir: str) -> list[tuple[str, SelectionPlan]]:
    """Every selection that began in ``out_dir`` (its workspace record), by name."""
    workspace = files.join(out_dir, WORKSPACE)
    found = []
    for name in sorted(files.listdir(workspace)) if files.isdir(workspace) else []:
        record = files.join(workspace, name, "selection.json")
        if files.isfile(record):
            found.append((name, SelectionPlan.from_json(json.loads(files.read_text(record))["plan"])))
    return found


def privacy_record(out_dir: str, outcomes: Sequence[dict[str, Any]], *, delta: float) -> dict[str, Any]:
    """privacy.json: each selection's guarantee and the composition of all that began in ``out_dir``."""
    began = _selection_plans(out_dir)
    ended = {o["selection"]: o for o in outcomes}
    warnings = [w for _, plan in began for w in plan.run.warnings]
    return {
        "kind": MECHANISM,
        "composed_epsilon": composed_selection_epsilon([plan for _, plan in began], delta=delta),
        "delta": delta,
        "accountant": "rdp",
        "selections": [
            {
                "selection": name,
                "epsilon": plan.epsilon(delta),
                "finished": name in ended,
                "chosen_run": (ended[name]["chosen"] or {}).get("run_dir") if name in ended else None,
            }
            for name, plan in began
        ],
        "covers": COVERS,
        "not_covered": list(NOT_COVERED),
        "warnings": list(dict.fromkeys(warnings)),
    }


def _summary(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per target epsilon: the selections' epsilon and the median and min-max test top-1 of their chosen runs."""
    groups: dict[float, list[dict[str, Any]]] = {}
    for o in outcomes:
        groups.setdefault(o["target_epsilon"], []).append(o)
    rows = []
    for target, members in groups.items():
        tests = [o["chosen"]["test_top1"] for o in members if o["chosen"]]
        rows.append(
            {
                "target_epsilon": target,
                "epsilon": max(o["epsilon"] for o in members),
                "selections": len(members),
                "published_nothing": sum(not o["chosen"] for o in members),
                "median_test_top1": statistics.median(tests) if tests else None,
                "min_test_top1": min(tests) if tests else None,
                "max_test_top1": max(tests) if tests else None,
            }
        )
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _write_tables(
    out_dir: str, outcomes: Sequence[dict[str, Any]], summary: list[dict], options: Sequence[str], *, owner_only: bool
) -> list[str]:
    chosen_rows = [
        {"target_epsilon": o["target_epsilon"], "repeat": o["repeat"], "epsilon": o["epsilon"], "delta": o["delta"]}
        | {opt: (o["chosen"] or {}).get(opt) for opt in options}
        | {k: (o["chosen"] or {}).get(k) for k in ("holdout_noisy_top1", "test_top1", "test_top1_last", "run_dir")}
        for o in outcomes
    ]
    written = []
    for name, table in ((sweep_report.SUMMARY_CSV, summary), (sweep_report.CHOSEN_CSV, chosen_rows)):
        path = files.join(out_dir, name)
        with open_for_writing(path, private=owner_only) as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        written.append(path)
    lines = [
        f"Private selection (Papernot & Steinke 2022), covered by epsilon: {COVERS}.",
        "",
        "| target epsilon | repeat | epsilon (selection) | chosen setting | noisy held-out top-1 | test top-1 (EMA) | last |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        c = o["chosen"]
        setting = setting_label([(opt, c[opt]) for opt in options]) if c else "nothing published (K = 0)"
        cells = [_percent(c and c[k]) for k in ("holdout_noisy_top1", "test_top1", "test_top1_last")]
        lines.append(
            f"| {o['target_epsilon']:g} | {o['repeat']} | {o['epsilon']:.4g} | {setting} | {' | '.join(cells)} |"
        )
    lines += [
        "",
        "| target epsilon | selections | median test top-1 (EMA) | min | max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in summary:
        cells = " | ".join(_percent(s[k]) for k in ("median_test_top1", "min_test_top1", "max_test_top1"))
        lines.append(f"| {s['target_epsilon']:g} | {s['selections']} | {cells} |")
    path = files.join(out_dir, sweep_report.SUMMARY_MD)
    with open_for_writing(path, private=owner_only) as f:
        f.write("\n".join(lines) + "\n")
    return [path, *written]


@dataclasses.dataclass(frozen=True)
class SelectionSweepResult:
    """A private-selection sweep's result: every line of it is covered by the selections' epsilons."""

    out_dir: str
    selections: tuple[dict[str, Any], ...]  # per (epsilon, repeat): guarantee, how it chose, the chosen run
    summary: tuple[dict[str, Any], ...]  # per target epsilon: median and min-max test top-1 of the chosen runs
    composed_epsilon: float  # of publishing every selection's output in OUT together, at ``delta``
    delta: float
    accountant: str = "rdp"
    covered_by_epsilon: bool = True
    covers: str = COVERS
    not_covered: tuple[str, ...] = NOT_COVERED
    warnings: tuple[str, ...] = ()
    files: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"warnings": list(self.warnings), "not_covered": list(self.not_covered)}

    def line(self) -> dict[str, Any]:
        """What the command prints: no count of runs, no time (either would show K)."""
        return self.as_dict()

    def report(self) -> list[str]:
        """A few lines for the reader (stderr): where the chosen runs and the tables are; no score, no count."""
        return [
            f"private selection finished: each chosen run is in {files.join(self.out_dir, CHOSEN_DIR)}/NAME "
            f"(what it publishes: NAME.json beside it); the results: {', '.join(self.files)}",
            f"{files.join(self.out_dir, WORKSPACE)} holds every other run: NOT covered, keep it to yourself",
        ]

    def privacy_line(self) -> str:
        each = ", ".join(f"{s['selection']} ({s['epsilon']:.4g}, {s['delta']:g})" for s in self.selections)
        return (
            f"each selection's output is DP with its repetitions, scores and choice included: {each}; all of "
            f"them together ({self.composed_epsilon:.4g}, {self.delta:g})-DP (RDP, see privacy.json)"
        )


def finish(
    out_dir: str, outcomes: Sequence[dict[str, Any]], *, options: Sequence[str], delta: float
) -> SelectionSweepResult:
    """privacy.json, then the tables (replacing an earlier sweep's), then the result."""
    record = privacy_record(out_dir, outcomes, delta=delta)
    write_json_atomic(files.join(out_dir, PRIVACY_JSON), record)
    closed = sweep_report.remove_stale_tables(out_dir)
    published = [{k: v for k, v in o.items() if k != "request"} for o in outcomes]
    summary = _summary(published)
    written = _write_tables(out_dir, published, summary, options, owner_only=bool(closed))
    warnings = list(record["warnings"])
    if closed:
        warnings.append(f"replaced the owner-only tables of an earlier sweep ({', '.join(closed)}): these are 0600 too")
    return SelectionSweepResult(
        out_dir=out_dir,
        selections=tuple(published),
        summary=tuple(summary),
        composed_epsilon=finite(record["composed_epsilon"]),
        delta=delta,
        warnings=tuple(warnings),
        files=tuple(written),
    )
