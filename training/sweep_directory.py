"""A sweep's output directory: which data its runs are of, which runs may be reused, what they released.

    OUT_DIR/sweep.json            the data every run here trained on: its path, mode, split and a keyed
                                  identity (``data.identity``), so other data is refused, never reported
    OUT_DIR/runs/NAME/            the private runs (and simulated ones, ``sim-*.NOT-PRIVATE``), of every
                                  invocation
    OUT_DIR/baseline.NOT-PRIVATE/ the non-private baseline's runs and tables (mode 0700: private diagnostics)
    OUT_DIR/privacy.json          the composed (epsilon, delta) of every private run in runs/, ever
    OUT_DIR/key.id                names the key of sweep.json's identity in the per-user key store (``data.key_store``)

A run directory is reused only when its settings are the ones asked for now; the record of what
was released only grows: every run that started counts with its whole plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from dpscale import files
from dpscale.data.identity import keyed_identity
from dpscale.data.key_store import directory_secret
from dpscale.errors import DataError
from dpscale.files import write_json_atomic
from dpscale.privacy.plan import composed_epsilon
from dpscale.training import release
from dpscale.training.config import TrainingConfig, options_of
from dpscale.training.grid import SIMULATION_FILE, SIMULATION_NOTE, GridPoint, Simulation, flag
from dpscale.training.model import data_hash
from dpscale.training.run_directory import CONFIG, LEDGER, RunDirectory, RunSpec

RECORD = "sweep.json"
PRIVACY_JSON = "privacy.json"
RUNS = "runs"
BASELINE_DIR = f"baseline.{release.NOT_PRIVATE}"
SELECTION_DIR = f"selection.{release.NOT_PRIVATE}"  # a private selection's workspace (training.selection_sweep)
_NEW_DIR = "use a new OUT_DIR"


def _relative(path: str, base: str) -> str:
    """``path`` below ``base``, as a name to show (URLs too)."""
    if files.is_url(path):
        return path[len(base.rstrip("/")) + 1 :]
    return os.path.relpath(path, base)


def finite(value: float) -> float | str:
    """A number for JSON: inf as the string ``"inf"`` (strict JSON has no infinity)."""
    return value if math.isfinite(value) else str(value)


def _differences(found: TrainingConfig, asked: TrainingConfig) -> list[str]:
    old = options_of(found) | {"mode": found.mode, "train_split": found.train_split}
    new = options_of(asked) | {"mode": asked.mode, "train_split": asked.train_split}
    return [f"{flag(k)} {old[k]} there, {new[k]} asked" for k in sorted(old) if old[k] != new[k]]


@dataclasses.dataclass(frozen=True)
class SweepDirectory:
    path: str

    def file(self, name: str) -> str:
        return files.join(self.path, name)

    def run_dir(self, point: GridPoint) -> str:
        parent = self.file(BASELINE_DIR) if point.kind == "baseline" else self.path
        return files.join(parent, RUNS, point.name)

    def make_baseline_dir(self) -> str:
        """The baseline's directory, owner-only before its first file."""
        path = self.file(BASELINE_DIR)
        files.makedirs_owner_only(path)
        return path

    # -- what may be reused ---------------------------------------------------------------------

    def check_data(self, data: str, training: TrainingConfig, *, selection: bool = False) -> None:
        """Runs here are of ``data`` only: recorded on first use, and other data refused afterwards.

        ``selection``: a private-selection sweep (``training.selection_sweep``); the two kinds never share a
        directory, whose privacy.json composes one kind only.
        """
        files.makedirs(self.path)
        record = {
            "data": files.absolute(data),
            "mode": training.mode,
            "train_split": training.train_split,
            "data_identity": keyed_identity(directory_secret(self.path), data_hash(data, training)),
            "private_selection": selection,
        }
        hint = f"{_NEW_DIR} (or give the data and settings of the sweep it holds to continue it)"
        if files.exists(self.file(RECORD)):
            try:
                found = json.loads(files.read_text(self.file(RECORD)))
            except (OSError, ValueError) as error:
                raise DataError(f"{self.file(RECORD)!r} is unreadable ({error}); {hint}") from None
            for key, what in (
                ("data", "other data"),
                ("mode", "another mode"),
                ("train_split", "another split"),
                ("data_identity", "other data (at the same path, other content)"),
                ("private_selection", "private selections" if not selection else "a grid without private selection"),
            ):
                if found.get(key, False) != record[key]:
                    shown = "" if key in ("data_identity", "private_selection") else f": {found.get(key)}"
                    raise DataError(
                        f"{self.path!r} holds a sweep on {what}{shown}; its results are not those of {data!r}: {hint}"
                    )
            return
        started = [
            d
            for d in (self.file(RUNS), files.join(self.file(BASELINE_DIR), RUNS), self.file(SELECTION_DIR))
            if files.isdir(d) and files.listdir(d)
        ]
        if started:
            raise DataError(
                f"{self.path!r} holds runs without a record of their data ({RECORD}: made by an older "
                f"dpscale): they cannot be checked against {data!r}; {_NEW_DIR}"
            )
        write_json_atomic(self.file(RECORD), record)

    def check_reusable(self, point: GridPoint, data: str) -> None:
        """A run already here under ``point``'s name must be ``point``'s run (data and every setting), else refuse."""
        run = RunDirectory(files.absolute(self.run_dir(point)))
        if not files.exists(run.file(CONFIG)):
            return
        if run.simulated != (point.kind == "simulated"):
            found = "a TAN simulation" if run.simulated else "not a simulation"
            raise DataError(
                f"{run.path!r} holds a run that is {found}, unlike this sweep's run of that name: its "
                f"results are not this sweep's; {_NEW_DIR}"
            )
        spec = run.read_spec()
        asked = RunSpec.new(data, point.training, spec.plan, {})
        found = dataclasses.replace(spec.training, show_progress=asked.training.show_progress)
        differ = _differences(found, asked.training)
        if spec.data != asked.data:
            differ.insert(0, f"data {spec.data} there, {asked.data} asked")
        if differ or found != asked.training:
            raise DataError(
                f"{run.path!r} holds a run with other settings than this sweep asks for "
                f"({'; '.join(differ) or 'settings differ'}): its results are not this sweep's; "
                f"{_NEW_DIR} (or repeat the command that made it to continue that sweep)"
            )

    @staticmethod
    def finished(run: RunDirectory) -> bool:
        """Trained to the end (parameters saved, secrets gone): nothing left to resume."""
        return files.exists(run.file(CONFIG)) and run.has_params and not run.has_secrets

    @staticmethod
    def mark_simulation(run: RunDirectory, simulation: Simulation) -> None:
        """A simulated run says so in its directory (before its first step), in every JSON file it writes
        (``RunDirectory.mark_simulated``) and in its ledger's ``not_covered``; idempotent."""
        run.mark_simulated(simulation.as_dict())
        if not files.exists(run.file(LEDGER)):
            return
        ledger = run.read_ledger()
        if any(note.startswith(SIMULATION_NOTE) for note in ledger.not_covered):
            return
        target, plan = simulation.target, simulation.plan
        note = (
            f"{SIMULATION_NOTE}: a TAN simulation of batch {target.batch_size} at noise multiplier "
            f"{target.noise_multiplier:.4g} (epsilon {target.epsilon():.4g}), run at batch {plan.batch_size} "
            f"with the noise scaled by {plan.batch_size}/{target.batch_size}; its own epsilon is epsilon_spent"
        )
        run.write_ledger(dataclasses.replace(ledger, not_covered=(*ledger.not_covered, note)))

    # -- what was released ------------------------------------------------------------------------

    def runs(self) -> list[RunDirectory]:
        """Every run that started here (a config.json), finished or not: private ones, then the baseline's."""
        found = []
        for directory in (self.file(RUNS), files.join(self.file(BASELINE_DIR), RUNS)):
            if files.isdir(directory):
                found += [
                    RunDirectory(files.join(files.absolute(directory), name))
                    for name in sorted(files.listdir(directory))
                    if files.isfile(files.join(directory, name, CONFIG))
                ]
        return found

    def privacy_record(self, *, delta: float, accountant: str) -> dict[str, Any]:
        """The composed (epsilon, delta) of every private run here, ever, and what is not covered.

        Every run that started counts with its whole plan (an unfinished one may have released
        some of its steps): the record never covers fewer runs than the directory holds.
        """
        runs, plans, warnings = [], [], []
        for run in self.runs():
            try:
                plan = run.read_spec().plan
            except DataError as error:  # a run we cannot account for: no record rather than a short one
                raise DataError(
                    f"{error}; privacy.json must compose every run in {self.path!r}: repair or remove that run"
                ) from None
            runs.append(
                {
                    "run_dir": _relative(run.path, files.absolute(self.path)),
                    "private": plan.private,
                    "epsilon": finite(plan.epsilon()),
                    "simulated": run.simulated,
                }
            )
            if plan.private:
                plans.append(plan)
                warnings += plan.warnings
        not_covered = []
        if any(r["simulated"] for r in runs):
            not_covered.append(
                f"the simulated runs (sim-*.{release.NOT_PRIVATE}, with {SIMULATION_FILE}): "
                f"{SIMULATION_NOTE}; each spent the epsilon of its row (composed here), not its "
                "target's"
            )
        non_private = [r["run_dir"] for r in runs if not r["private"]]
        if non_private:
            not_covered.append(
                f"the non-private baseline runs ({BASELINE_DIR}/): trained on the same data without "
                "any guarantee; the composed guarantee holds only if their results are not released"
            )
        return {
            "composed_epsilon": composed_epsilon(plans, delta=delta, accountant=accountant),
            "delta": delta,
            "accountant": accountant,
            "private_runs": len(plans),
            "runs": runs,
            "non_private_runs": non_private,
            "not_covered": not_covered,
            "warnings": list(dict.fromkeys(warnings)),
        }

    def write_privacy(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.file(PRIVACY_JSON), record)
