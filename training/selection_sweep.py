"""A sweep whose choice is private: per epsilon, the best of K runs, K random and secret (``privacy.selection``).

Per target epsilon and repeat, one selection ``eps<e>-r<repeat>`` (Papernot & Steinke 2022):

1. its plan (``SelectionPlan.calibrate``): one mechanism for every run, whose noise (or steps) makes the
   selection's epsilon, its repetitions, scores and choice included, at most the target;
2. its secret seed: fresh OS entropy, in the user's key store (named by the workspace's ``key.id``)
   until the selection ends, so an interrupted selection continues with the same draws; never a
   fixed seed but for tests;
3. from that seed (``Stream.SELECTION``): K; each run's setting, uniformly from the grid (i.i.d.: the
   theorem is for independent repetitions of one mechanism, so the settings are not cycled); each
   score's noise; each run's directory name (a keyed digest, so no name says how many came before);
4. K runs of the plan, each scored on the held-out rows by a noisy count of its EMA parameters' correct
   predictions (``privacy.noise.gaussian_release``, sensitivity one row), never written anywhere;
5. the best noisy score wins (the first on a tie); that run moves to ``OUT/chosen/NAME``, its ledger says
   which guarantee covers it, it is scored on the test split, and ``OUT/chosen/NAME.json`` records the
   outcome (``training.selection_report``); then the seed is deleted.

    OUT/selection.NOT-PRIVATE/NAME/   (0700) key.id, selection.json (its plan and grid), runs/: every
                                      other run of the selection, and how many there were: not covered
    OUT/chosen/NAME/                  the chosen run (a run directory like any other)
    OUT/chosen/NAME.json              what the selection publishes, covered by its epsilon

A finished selection is reused as it is, and only for the same data, grid, settings and plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from typing import Any

import numpy as np

from dpscale import files
from dpscale.data import key_store
from dpscale.errors import DataError, InvalidConfigError
from dpscale.files import write_json_atomic
from dpscale.privacy.noise import gaussian_release
from dpscale.privacy.plan import PrivacyTarget
from dpscale.privacy.seeds import resolve_seed
from dpscale.privacy.selection import Selection, SelectionPlan
from dpscale.privacy.streams import Stream, stream_key, stream_rng
from dpscale.progress import within
from dpscale.training import evaluation, selection_report, trainer
from dpscale.training.config import TrainingConfig
from dpscale.training.grid import Axis, GridPoint, flag, grid_points, value_text
from dpscale.training.model import HOLDOUT_SPLIT, build_train_model
from dpscale.training.run_directory import CONFIG, RunDirectory
from dpscale.training.selection_report import CHOSEN_DIR, WORKSPACE, SelectionSweepResult

__all__ = ["SelectionSweepConfig", "SelectionSweepResult", "run", "selection_name"]
from dpscale.training.sweep_directory import SweepDirectory

_RECORD = "selection.json"  # in the workspace: the plan, grid and settings the selection was made with
_MOVED = "chosen.json"  # in the workspace: which run moved to OUT/chosen (written before the move)
_SEED = "selection-seed.json"  # in the key store
_UNGRIDDED = {
    "batch_size": "every run of a selection is one mechanism",
    "steps": "every run of a selection is one mechanism",
    "feature_normalization": "its DP mean release is part of every run's mechanism",
    "feature_mean_noise_multiplier": "its DP mean release is part of every run's mechanism",
}


@dataclasses.dataclass(frozen=True)
class SelectionSweepConfig:
    """Private selections over the settings of ``axes`` (learning rate first), per epsilon and repeat."""

    data: str
    out_dir: str
    training: TrainingConfig  # the shared settings: holdout > 0, batch size and steps given
    epsilons: tuple[float, ...]
    axes: tuple[Axis, ...]  # the settings chosen between (no epsilon)
    selection: Selection = Selection()
    repeats: int = 1  # independent selections per epsilon (their outputs compose in privacy.json)
    seed: int | None = None  # the selections' seed: None = fresh OS entropy (anything else: tests only)

    def __post_init__(self) -> None:
        holdout = self.training.holdout
        if not holdout:
            raise InvalidConfigError("a private selection scores every run on held-out rows: give --holdout N")
        if self.training.batch_size is None or self.training.steps is None:
            raise InvalidConfigError("a private selection needs --batch-size and --steps (each run's noise is solved)")
        for name, _ in self.axes:
            if name in _UNGRIDDED or name == "epsilon":
                why = _UNGRIDDED.get(name, "each epsilon is a selection of its own")
                raise InvalidConfigError(f"--grid {flag(name)}: not gridded in a private selection ({why})")
        if self.training.target.sampling != "poisson":
            raise InvalidConfigError("a private selection is accounted for Poisson sampling only, not 'shuffle'")

    def refusing(self, flags: tuple[str, ...]) -> SelectionSweepConfig:
        """Itself, unless a sweep flag it cannot honour was given (``flags``, as the command line spells them)."""
        if flags:
            raise InvalidConfigError(
                f"{' and '.join(flags)}: not with --private-selection (a baseline or a simulation is not part of "
                "the selection's guarantee, and it writes no held-out scores to print); run them as a sweep of "
                "their own, in another OUT_DIR"
            )
        return self


def selection_name(epsilon: float, repeat: int) -> str:
    return f"eps{value_text(epsilon)}-r{repeat}"


def _request(config: SelectionSweepConfig, plan: SelectionPlan, settings: list[GridPoint], epsilon: float) -> dict:
    """What a selection is made of: refused when asked again with anything else."""
    base = dataclasses.replace(config.training, show_progress=True)
    return {
        "data": files.absolute(config.data),
        "target_epsilon": epsilon,
        "training": repr(base),
        "settings": [dict(p.setting) for p in settings],
        "plan": SelectionPlan.to_json(plan),
    }


def _settings(config: SelectionSweepConfig) -> list[GridPoint]:
    return grid_points(config.training, config.axes, repeats=1)


def _plan(config: SelectionSweepConfig, settings: list[GridPoint], epsilon: float) -> SelectionPlan:
    """One plan for every setting: the runs must share rows and releases (they do unless a grid changes them)."""
    target = dataclasses.replace(config.training.target, epsilon=epsilon)
    models = {}
    for point in settings:
        training = dataclasses.replace(point.training, target=target)  # private: its releases are DP ones
        key = repr((training.mode, training.holdout, training.train_split, training.features))
        if key not in models:
            model = build_train_model(config.data, training)
            models[key] = (model.num_examples, tuple(model.releases))
    if len(set(models.values())) != 1:
        raise InvalidConfigError("the grid's settings make different mechanisms (rows or releases): one per selection")
    ((num_examples, releases),) = set(models.values())
    return SelectionPlan.calibrate(
        target,
        config.selection,
        num_examples=num_examples,
        batch_size=config.training.batch_size,
        steps=config.training.steps,
        releases=releases,
    )


class _Selection:
    """One selection's files, secret seed and draws."""

    def __init__(self, out_dir: str, name: str) -> None:
        self.name = name
        self.out_dir = out_dir
        self.workspace = files.join(out_dir, WORKSPACE, name)
        self.chosen_dir = files.join(out_dir, CHOSEN_DIR, name)
        self.outcome_file = files.join(out_dir, CHOSEN_DIR, f"{name}.json")

    def seed_file(self) -> str:
        return key_store.secret_path(
            key_store.key_id(files.require_local(self.workspace, "a private selection")), _SEED
        )

    def begin(self, request: dict[str, Any], fixed_seed: int | None) -> int:
        """The selection's record and seed: checked and read when it has begun, else made."""
        files.makedirs_owner_only(files.join(self.out_dir, WORKSPACE))
        files.makedirs_owner_only(self.workspace)
        record = files.join(self.workspace, _RECORD)
        hint = "use a new OUT_DIR (or repeat the command that made it)"
        if files.exists(record):
            if json.loads(files.read_text(record)) != json.loads(json.dumps(request)):
                raise DataError(f"{self.workspace!r} holds a selection with other data, grid or settings: {hint}")
            if not files.exists(self.seed_file()):
                raise DataError(
                    f"{self.workspace!r}: the selection's secret seed is not in this user's key store, so it cannot "
                    f"continue with its own draws (new ones would be a second selection): {hint}"
                )
            return int(json.loads(files.read_text(self.seed_file()))["seed"])
        seed = resolve_seed(fixed_seed, purpose="private selection")
        write_json_atomic(self.seed_file(), {"seed": seed}, private=True)
        write_json_atomic(record, request, private=True)
        return seed

    def end(self) -> None:
        if files.exists(files.join(self.workspace, key_store.ID_FILE)) and files.exists(self.seed_file()):
            files.remove(self.seed_file())

    def run_path(self, seed: int, index: int) -> str:
        """Run ``index``'s directory: a keyed digest of its index, or OUT/chosen/NAME once it moved there."""
        moved = files.join(self.workspace, _MOVED)
        if files.exists(moved) and json.loads(files.read_text(moved))["index"] == index:
            return self.chosen_dir
        tag = hmac.new(seed.to_bytes(8, "big"), f"run {index}".encode(), hashlib.sha256).hexdigest()[:16]
        return files.join(self.workspace, "runs", f"run-{tag}")

    def move_chosen(self, seed: int, index: int) -> str:
        path = self.run_path(seed, index)
        if path != self.chosen_dir:
            write_json_atomic(files.join(self.workspace, _MOVED), {"index": index}, private=True)
            files.makedirs(files.join(self.out_dir, CHOSEN_DIR))
            files.replace(path, self.chosen_dir)
        return self.chosen_dir


def _draws(seed: int, selection: Selection, settings: int) -> list[int]:
    """The setting of each of the K runs (K drawn first), from the selection's secret stream."""
    count = selection.repetitions.sample(stream_rng(seed, Stream.SELECTION, 0))
    return [int(stream_rng(seed, Stream.SELECTION, 1, j).integers(settings)) for j in range(count)]


def _train(config: SelectionSweepConfig, path: str, point: GridPoint, plan: SelectionPlan) -> None:
    """Train (or resume, or reuse) one run of the plan; a run there with other settings is refused."""
    target = PrivacyTarget(
        epsilon=plan.run.epsilon(),
        delta=plan.run.delta,
        accountant=config.training.target.accountant,
        sampling="poisson",
    )
    training = dataclasses.replace(point.training, target=target)
    run = RunDirectory(files.absolute(path))
    if files.exists(run.file(CONFIG)):
        spec = run.read_spec()
        same = dataclasses.replace(spec.training, show_progress=training.show_progress) == training
        if not same or spec.plan != plan.run:
            raise DataError(f"{path!r} holds a run with other settings than this selection's: use a new OUT_DIR")
        if not SweepDirectory.finished(run):
            trainer.resume(path, show_progress=training.show_progress)
        return
    trainer.start(config.data, path, training, plan=plan.run)


def _noisy_score(path: str, seed: int, index: int, selection: Selection) -> float:
    """The run's held-out top-1 (EMA) as a noisy count over the held-out rows: (correct + N(0, s^2)) / rows."""
    scores, _ = evaluation.score_run(path, split=HOLDOUT_SPLIT, private_diagnostics=True, save=False)
    correct = round(scores.ema_top1 * scores.num_examples)  # exact: a mean of 0/1 over these rows
    key = stream_key(seed, Stream.SELECTION, 2, index)
    noisy = gaussian_release(np.array([correct], np.float32), key, noise_multiplier=selection.score_noise)
    return float(noisy[0]) / scores.num_examples


def _select(config: SelectionSweepConfig, settings: list[GridPoint], epsilon: float, repeat: int) -> dict[str, Any]:
    """One selection, from its plan to its published outcome (reused when it already ended)."""
    name = selection_name(epsilon, repeat)
    plan = _plan(config, settings, epsilon)
    request = _request(config, plan, settings, epsilon)
    place = _Selection(config.out_dir, name)
    if files.exists(place.outcome_file):
        outcome = json.loads(files.read_text(place.outcome_file))
        if outcome.get("request") != json.loads(json.dumps(request)):
            raise DataError(
                f"{place.outcome_file!r} is a selection with other data, grid or settings: use a new OUT_DIR"
            )
        place.end()
        return outcome
    seed = place.begin(request, config.seed)
    chosen_settings = _draws(seed, config.selection, len(settings))
    scores = []
    for j, setting in enumerate(chosen_settings):
        path = place.run_path(seed, j)
        with within(f"private selection {name}: run {j + 1} (how many there are is secret: keep this log private)"):
            _train(config, path, settings[setting], plan)
            scores.append(_noisy_score(path, seed, j, config.selection))
    chosen = None
    if scores:
        best = int(np.argmax(scores))  # the first of equal scores
        path = place.move_chosen(seed, best)
        test, _ = evaluation.score_run(path, split="test", save=True)
        selection_report.mark_chosen(RunDirectory(files.absolute(path)), name, plan)
        chosen = dict(settings[chosen_settings[best]].setting) | {
            "run_dir": files.join(CHOSEN_DIR, name),
            "holdout_noisy_top1": scores[best],
            "test_top1": test.ema_top1,
            "test_top1_last": test.top1,
        }
    outcome = selection_report.outcome(
        name, epsilon, repeat, plan, holdout=config.training.holdout, settings=settings, chosen=chosen
    )
    write_json_atomic(place.outcome_file, outcome | {"request": request})
    place.end()
    return outcome | {"request": request}


def run(config: SelectionSweepConfig) -> SelectionSweepResult:
    """Every selection of the sweep, then the tables and privacy.json (the caller has checked OUT_DIR's data)."""
    SweepDirectory(config.out_dir).check_data(config.data, config.training, selection=True)
    settings = _settings(config)
    outcomes = [_select(config, settings, eps, r) for eps in config.epsilons for r in range(config.repeats)]
    options = tuple(name for name, _ in config.axes)
    return selection_report.finish(config.out_dir, outcomes, options=options, delta=config.training.target.delta)
