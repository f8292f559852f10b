"""The sweep command: a grid of DP training runs over epsilon, learning rate and any training option.

Every run reads the same data (in ``features`` mode the same feature cache, so a sweep over
epsilon never recomputes a feature). Each grid point (``training.grid``) is trained ``repeats``
times with fresh secret seeds; results go to ``runs.csv`` (every run), ``summary.csv`` /
``summary.md`` (median and min-max spread over repeats per grid point, one column per gridded
option) and ``accuracy_vs_epsilon.png`` (``training.sweep_report``).

Honest selection: settings are chosen only on held-out training rows. With ``holdout`` N every
run trains on all but the last N training rows and is scored on those rows; per epsilon the
setting with the best median held-out score is chosen, and only then are the chosen runs scored
on the test split: those test scores are the sweep's result. Held-out scores (and a choice made
from them) are exact statistics of private rows: such a sweep needs ``private_diagnostics``, and
its tables and plot are private diagnostics (``*.NOT-PRIVATE.*``, mode 0600). The choice leaves
no other trace: every run gets the same files (its held-out scores, 0600), the chosen runs' test
scores are computed without being saved in them, and the JSON line withholds every field that
depends on held-out rows (or on the baseline) unless ``print_private_diagnostics`` (then it names
them as not private). A later sweep in OUT_DIR never makes owner-only tables readable again
(``sweep_report.remove_stale_tables``). Without held-out rows nothing is chosen: every grid point
is reported with its test score.

Private selection (``private_selection``, Papernot & Steinke 2022): per epsilon, the best of a random, secret
number of runs, each a setting drawn from the grid and scored on held-out rows with noise; the choice, its
scores and the chosen run are covered by epsilon (``training.selection_sweep``, ``privacy.selection``).

Reuse: a run directory that already holds this sweep's run is reused, so an interrupted sweep
continues where it stopped instead of redoing (or re-spending) finished runs. A directory is
reused only for the data and settings it was made with: ``sweep.json`` records the data (by a
keyed identity, ``data.identity``), and each run's ``config.json`` its settings; anything else
is refused, never reported as this sweep's result.

What it publishes: every DP run is (epsilon, delta)-DP on its own, but the sweep releases all
of them, on the same data. ``privacy.json`` and the head of ``summary.md`` give the composed
(epsilon, delta) of releasing every DP run in OUT_DIR/runs together, from every invocation
(``privacy.plan.composed_epsilon``). The non-private baseline (``baseline``, off by default)
trains on the same private data without any guarantee: it is a private diagnostic, apart in
``baseline.NOT-PRIVATE/`` (mode 0700, tables 0600), and the composed guarantee holds only
without it. Simulated runs (``simulate_batch``) are DP at their own, larger epsilon, not at their
target's: they say so in their names, files, ledgers and the result, and are composed like any run.

Following it: every run's progress line says ``sweep run k of n (NAME)`` and the sweep's time left
(``training.sweep_progress``); ``SweepResult.report`` says at the end where the tables are. A
gridded batch size or number of steps needs no flag of its own; the baseline runs per gridded value.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from dpscale import files
from dpscale.errors import InvalidConfigError
from dpscale.privacy.selection import Selection
from dpscale.stages import evaluate, train
from dpscale.training import release, selection_sweep, sweep_report
from dpscale.training.config import Mode, TrainingConfig, training_config
from dpscale.training.data_kind import resolve_mode
from dpscale.training.grid import SIMULATION_NOTE, Axis, GridPoint, Simulation, check_axes, flag, grid_points, simulate
from dpscale.training.model import HOLDOUT_SPLIT, build_train_model
from dpscale.training.run_directory import CONFIG, RunDirectory
from dpscale.training.sweep_directory import BASELINE_DIR, PRIVACY_JSON, RECORD, RUNS, SweepDirectory, finite
from dpscale.training.sweep_progress import SweepProgress
from dpscale.training.trainer import plan_for

__all__ = [
    "BASELINE_DIR",
    "PLOT",
    "PRIVACY_JSON",
    "RECORD",
    "RUNS",
    "RUNS_CSV",
    "SUMMARY_CSV",
    "SUMMARY_MD",
    "SweepConfig",
    "SweepResult",
    "run",
]
RUNS_CSV, SUMMARY_CSV, SUMMARY_MD, PLOT = (
    sweep_report.RUNS_CSV,
    sweep_report.SUMMARY_CSV,
    sweep_report.SUMMARY_MD,
    sweep_report.PLOT,
)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A grid of runs: ``training`` with epsilon, learning rate and the ``grid``'s options replaced per point.

    ``grid`` holds further axes, each a training option (``training_config``'s name, e.g.
    ``augmult``) and its values. ``training`` (or every point) must give the batch size and the
    steps (the noise multiplier is calibrated for each epsilon); its learning rate is the grid when
    ``learning_rates`` is empty.
    """

    data: str
    out_dir: str
    training: TrainingConfig
    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    learning_rates: tuple[float, ...] = ()  # () = (training.learning_rate,)
    grid: tuple[Axis, ...] = ()
    repeats: int = 3
    baseline: bool = False  # a non-private run per repeat and setting: a private diagnostic
    baseline_learning_rate: float = 0.5
    baseline_momentum: float = 0.9
    simulate_batch: int | None = None  # run every point as a TAN simulation at this expected batch
    print_private_diagnostics: bool = False  # the JSON line carries held-out and baseline scores too
    private_selection: Selection | None = None  # per epsilon, the best of K random runs: covered (selection_sweep)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple((name, tuple(values)) for name, values in self.grid))
        if not self.epsilons or any(not 0 < e < math.inf for e in self.epsilons):
            raise InvalidConfigError(f"epsilons must be positive and finite, got {self.epsilons}")
        if any(not 0 < lr < math.inf for lr in self.grid_learning_rates):
            raise InvalidConfigError(f"learning rates must be positive, got {self.grid_learning_rates}")
        if any(name in ("epsilon", "learning_rate") for name, _ in self.grid):
            raise InvalidConfigError("give epsilon and learning rate values as epsilons and learning_rates")
        check_axes(self.axes)
        if self.repeats < 1:
            raise InvalidConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.simulate_batch is not None and self.simulate_batch < 1:
            raise InvalidConfigError(f"--simulate-batch must be >= 1, got {self.simulate_batch}")
        if self.training.noise_multiplier is not None:
            raise InvalidConfigError(
                "a sweep calibrates the noise multiplier for each epsilon; drop --noise-multiplier"
            )
        if self.private_selection is not None:
            self.as_selection()  # refuses what a private selection cannot do, before anything is written
        elif self.training.holdout and not self.training.private_diagnostics:
            raise InvalidConfigError(
                f"scoring split {HOLDOUT_SPLIT!r} (private training rows) makes the sweep's tables private "
                "diagnostics that epsilon does not cover; pass --private-diagnostics to run it anyway"
            )

    @classmethod
    def from_options(
        cls,
        data: str,
        out_dir: str,
        *,
        epsilons: tuple[float, ...] | None = None,
        learning_rates: tuple[float, ...] = (),
        grid: tuple[Axis, ...] = (),
        repeats: int = 3,
        baseline: bool = False,
        baseline_learning_rate: float = 0.5,
        baseline_momentum: float = 0.9,
        simulate_batch: int | None = None,
        print_private_diagnostics: bool = False,
        private_selection: Selection | None = None,
        mode: Mode | None = None,
        **options: Any,
    ) -> SweepConfig:
        """A sweep from flat options: the grid's, then every run's as ``train`` takes them.

        ``grid`` may name epsilon and the learning rate too (the same as ``epsilons`` and
        ``learning_rates``, not both). The shared ``training`` is non-private (``epsilon=inf``):
        each grid point sets its own epsilon.
        """
        axes = dict(grid)
        if len(axes) != len(grid):
            raise InvalidConfigError("an option is given to --grid more than once")
        for name, given in (("epsilon", epsilons), ("learning_rate", learning_rates)):
            if name in axes and given:
                raise InvalidConfigError(
                    f"give the {flag(name)} values once: --grid {flag(name)}=... or --{flag(name)}s"
                )
        epsilons = tuple(axes.pop("epsilon", epsilons or cls.epsilons))
        learning_rates = tuple(axes.pop("learning_rate", learning_rates))
        if learning_rates:
            options["learning_rate"] = learning_rates[0]
        for name in ("batch_size", "steps"):  # gridded: every point gives its own (the shared one is a stand-in)
            if name in axes and options.get(name) is None and axes[name]:
                options[name] = axes[name][0]
        training = training_config(resolve_mode(data, mode), epsilon=math.inf, **options)
        return cls(
            data=data,
            out_dir=out_dir,
            training=training,
            epsilons=epsilons,
            learning_rates=learning_rates,
            grid=tuple(axes.items()),
            repeats=repeats,
            baseline=baseline,
            baseline_learning_rate=baseline_learning_rate,
            baseline_momentum=baseline_momentum,
            simulate_batch=simulate_batch,
            print_private_diagnostics=print_private_diagnostics,
            private_selection=private_selection,
        )

    def as_selection(self) -> selection_sweep.SelectionSweepConfig:
        """With ``private_selection``: the selections this sweep stands for (no baseline, simulation or diagnostics)."""
        asked = (("--baseline", self.baseline), ("--simulate-batch", self.simulate_batch))
        refused = tuple(f for f, on in (*asked, ("--print-private-diagnostics", self.print_private_diagnostics)) if on)
        return selection_sweep.SelectionSweepConfig(
            self.data, self.out_dir, self.training, self.epsilons, self.axes[1:], self.private_selection, self.repeats
        ).refusing(refused)

    @property
    def grid_learning_rates(self) -> tuple[float, ...]:
        return self.learning_rates or (self.training.learning_rate,)

    @property
    def axes(self) -> tuple[Axis, ...]:
        return (("epsilon", self.epsilons), ("learning_rate", self.grid_learning_rates), *self.grid)

    @property
    def options(self) -> tuple[str, ...]:
        """The gridded options but epsilon: a setting, one column each in the tables."""
        return tuple(name for name, _ in self.axes if name != "epsilon")

    @property
    def scores_private_rows(self) -> bool:
        return bool(self.training.holdout)

    @property
    def split(self) -> str:
        """Where the grid is scored: held-out rows when there are some (and only there is a choice made)."""
        return HOLDOUT_SPLIT if self.training.holdout else "test"


@dataclasses.dataclass(frozen=True)
class SweepResult:
    out_dir: str
    rows: tuple[dict[str, Any], ...]  # one per run of this grid
    summary: tuple[dict[str, Any], ...]  # one per (epsilon, setting): median and spread over repeats
    composed_epsilon: float  # of releasing every DP run in OUT_DIR/runs together, at ``delta``
    delta: float
    covered_by_epsilon: bool  # False: the tables hold scores of private rows or simulations
    warnings: tuple[str, ...] = ()
    chosen: tuple[dict[str, Any], ...] = ()  # per epsilon, the setting chosen on held-out rows, and its test score
    selection: str = ""  # how the reported settings were chosen (or that none was)
    private_runs: int = 0  # how many private runs privacy.json composes
    simulation: dict[str, Any] | None = None
    baseline: tuple[dict[str, Any], ...] = ()  # NOT private: the baseline's summary, when asked for
    private_fields: tuple[str, ...] = ()  # fields above that depend on held-out rows or on the baseline
    private_files: tuple[str, ...] = ()  # where those are kept, owner-only
    print_private: bool = False  # whether ``line`` carries the private fields
    files: tuple[str, ...] = ()  # the tables and plots written, summary.md first (owner-only ones named so)
    runs_trained: int = 0  # by this invocation
    runs_reused: int = 0  # finished runs found in OUT_DIR
    seconds: float = 0.0  # this invocation's wall time

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"warnings": list(self.warnings)}

    def report(self) -> list[str]:
        """A few lines for the reader (stderr): what ran, where the tables are; no score (those are in them)."""
        return sweep_report.finished_lines(
            self.out_dir, self.files, trained=self.runs_trained, reused=self.runs_reused, seconds=self.seconds
        )

    def line(self) -> dict[str, Any]:
        """What the command prints: no per-run rows, and the private fields only when asked for, named either way."""
        payload = {
            k: v
            for k, v in self.as_dict().items()
            if k not in ("rows", "private_fields", "private_files", "print_private")
        }
        if not self.private_fields:
            return payload
        what = {"fields": list(self.private_fields), "files": list(self.private_files)}
        if self.print_private:
            return payload | {"not_private": what | {"note": f"{', '.join(self.private_fields)}: {_PRINTED}"}}
        for name in self.private_fields:
            payload.pop(name)
        return payload | {"withheld": what | {"note": _WITHHELD}}


_WITHHELD = (
    "left out: they depend on held-out training rows or on the non-private baseline, which epsilon does "
    "NOT cover; they are in the owner-only files named (print them with --print-private-diagnostics)"
)
_PRINTED = (
    "printed as asked (--print-private-diagnostics): held-out or baseline scores, private diagnostics that "
    "epsilon does NOT cover; keep this output to yourself"
)


# -- which runs, and whether OUT_DIR may hold them -------------------------------------------


def _check_point(point: GridPoint) -> None:
    if point.training.batch_size is None or point.training.steps is None:
        raise InvalidConfigError("a sweep needs --batch-size and --steps (the noise is calibrated per epsilon)")


def _points(config: SweepConfig) -> tuple[list[GridPoint], dict[str, Simulation]]:
    """Every run of the sweep, checked before anything is written, and the simulations by run name."""
    kind = "simulated" if config.simulate_batch else "private"
    points = grid_points(
        config.training, config.axes, repeats=config.repeats, kind=kind, simulate_batch=config.simulate_batch
    )
    simulations: dict[str, Simulation] = {}
    models: dict[str, Any] = {}
    for i, point in enumerate(points):
        _check_point(point)
        if config.simulate_batch:
            training = point.training
            key = repr((training.mode, training.holdout, training.train_split, training.features))
            if key not in models:  # only the rows and releases matter here: one model per data view
                models[key] = build_train_model(config.data, training)
            model = models[key]
            simulations[point.name] = simulate(training, plan_for(training, model), batch_size=config.simulate_batch)
            points[i] = dataclasses.replace(point, training=simulations[point.name].training)
    if config.baseline:
        axes = (("epsilon", (math.inf,)), ("learning_rate", (config.baseline_learning_rate,)), *config.grid)
        baseline = grid_points(
            config.training,
            axes,
            repeats=config.repeats,
            kind="baseline",
            overrides={"momentum": config.baseline_momentum},
        )
        for point in baseline:
            _check_point(point)
        points += baseline
    return points, simulations


def _scores(run: RunDirectory, split: str, *, diagnostic: bool) -> dict[str, Any] | None:
    scores = run.read_scores(split, diagnostic=diagnostic)
    return scores if scores is not None and scores.get("split") == split else None


def _score(config: SweepConfig, run_dir: str, split: str, *, private: bool) -> dict[str, Any]:
    """The run's scores on ``split``: saved ones if they are of that split, else evaluated now."""
    run = RunDirectory(files.absolute(run_dir))
    diagnostic = private and split in (HOLDOUT_SPLIT, config.training.train_split)
    scores = _scores(run, split, diagnostic=diagnostic)
    if scores is None:
        evaluate.run(
            evaluate.EvaluateConfig(
                run_dir=run_dir, split=split, private_diagnostics=config.training.private_diagnostics
            )
        )
        scores = _scores(run, split, diagnostic=diagnostic)
    return scores


def _one(
    config: SweepConfig, directory: SweepDirectory, point: GridPoint, simulation: Simulation | None
) -> dict[str, Any]:
    run_dir = directory.run_dir(point)
    run = RunDirectory(files.absolute(run_dir))
    if simulation is not None:
        directory.mark_simulation(run, simulation)  # before the first step: a crashed simulation is marked too
    if not directory.finished(run):
        if point.kind == "baseline":
            directory.make_baseline_dir()
        if files.exists(run.file(CONFIG)):
            train.run(train.ResumeConfig(run_dir, show_progress=config.training.show_progress))
        else:
            train.run(train.TrainConfig(data=config.data, run_dir=run_dir, training=point.training))
    if simulation is not None:
        directory.mark_simulation(run, simulation)
    split = "test" if point.kind == "baseline" else config.split
    ledger = run.read_ledger()
    scores = _score(config, run_dir, split, private=ledger.private)
    return dict(point.values) | {
        "repeat": point.repeat,
        "kind": point.kind,
        "private": ledger.private,
        "achieved_epsilon": finite(ledger.epsilon_spent),
        "noise_multiplier": ledger.noise_multiplier,
        "batch_size": run.read_spec().plan.batch_size,
        "split": split,
        "top1": scores["top1"],
        "ema_top1": scores["ema_top1"],
        "run_dir": run_dir,
    }


def _choose(config: SweepConfig, rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per epsilon, the setting chosen on held-out rows; then (real runs only) its runs' test scores."""
    if config.split != HOLDOUT_SPLIT:
        return []
    chosen = []
    for best in sweep_report.choose(summary, config.options):
        setting = {o: best[o] for o in config.options}
        entry = {
            "epsilon": best["epsilon"],
            **setting,
            "chosen_on": HOLDOUT_SPLIT,
            "repeats": best["repeats"],
            "holdout_median_top1": best["median_top1"],
        }
        if not config.simulate_batch:  # the test split is read now, for the chosen runs only
            members = [
                r for r in rows if r["epsilon"] == best["epsilon"] and all(r[o] == v for o, v in setting.items())
            ]
            # Scored, never saved: a metrics.json in the chosen runs only would tell anyone the choice.
            tests = [
                evaluate.run(evaluate.EvaluateConfig(run_dir=r["run_dir"], split="test", save=False)).ema_top1
                for r in members
            ]
            entry |= {
                "test_median_top1": statistics.median(tests),
                "test_min_top1": min(tests),
                "test_max_top1": max(tests),
            }
        chosen.append(entry)
    return chosen


def _selection(config: SweepConfig) -> str:
    if config.split != HOLDOUT_SPLIT:
        return sweep_report.NO_CHOICE
    what = (
        "best setting per epsilon by its median held-out top-1 (EMA) over repeats, chosen on the last "
        f"{config.training.holdout} training rows (split {HOLDOUT_SPLIT!r}, never the test split)"
    )
    if config.simulate_batch:
        return f"{what}; train the chosen setting at the full batch with `dpscale train` (the private run)"
    return f"{what}; the test split was read afterwards, for the chosen runs only"


# -- the whole sweep -------------------------------------------------------------------------------


def _simulation_summary(
    config: SweepConfig, simulations: dict[str, Simulation], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """What each simulated run stands for, and what it actually spent (its ledger's epsilon and sigma)."""
    spent = {r["run_dir"].rstrip("/").rsplit("/", 1)[-1]: r for r in rows}
    return {
        "batch_size": config.simulate_batch,
        "note": SIMULATION_NOTE,
        "runs": [
            s.as_dict()
            | {
                "run": name,
                "noise_multiplier": spent[name]["noise_multiplier"],
                "epsilon": spent[name]["achieved_epsilon"],
            }
            for name, s in simulations.items()
        ],
    }


def _head(config: SweepConfig, record: dict[str, Any], selection: str) -> list[str]:
    """The opening lines of summary.md: what was released, warnings, how settings were chosen."""
    head = [
        record["note"],
        *(f"Warning: {w}" for w in record["warnings"]),
        "",
        f"How settings were chosen: {selection}.",
    ]
    if config.simulate_batch:
        head.append(
            f"Simulated runs at batch {config.simulate_batch} ({SIMULATION_NOTE}): each ran with less noise "
            "per example than its target epsilon allows; the first column is the target it simulates, "
            f"{release.diagnostic_name(RUNS_CSV)}'s achieved_epsilon what it spent."
        )
    return head


def run(config: SweepConfig) -> SweepResult | selection_sweep.SelectionSweepResult:
    if config.private_selection is not None:
        return selection_sweep.run(config.as_selection())
    points, simulations = _points(config)
    directory = SweepDirectory(config.out_dir)
    directory.check_data(config.data, config.training)
    for point in points:  # every refusal before any training
        directory.check_reusable(point, config.data)
    finished = [directory.finished(RunDirectory(files.absolute(directory.run_dir(p)))) for p in points]
    progress = SweepProgress(total=len(points), to_train=finished.count(False))
    results = []
    for index, (point, done) in enumerate(zip(points, finished), 1):
        with progress.run(index, point.name, finished=done):
            results.append(_one(config, directory, point, simulations.get(point.name)))
    rows = [r for r in results if r["kind"] != "baseline"]
    baseline_rows = [r for r in results if r["kind"] == "baseline"]
    summary = sweep_report.summarize(rows, config.options)
    chosen = _choose(config, rows, summary)
    selection = _selection(config)
    diagnostic = config.scores_private_rows or bool(config.simulate_batch)

    delta = config.training.target.delta
    record = directory.privacy_record(delta=delta, accountant=config.training.target.accountant)
    if diagnostic:
        what = (
            f"{config.split} scores, exact statistics of private rows, and the choice made from them"
            if config.scores_private_rows
            else "scores of simulated runs, covered by their own epsilons only"
        )
        record["not_covered"].append(f"the tables and plot named *.{release.NOT_PRIVATE}.* ({what})")
    simulation = _simulation_summary(config, simulations, rows) if config.simulate_batch else None
    record |= {
        "scores_private_rows": config.scores_private_rows,
        "selection": selection,
        "simulation": None if simulation is None else {"batch_size": config.simulate_batch, "note": SIMULATION_NOTE},
    }
    record["note"] = sweep_report.privacy_note(record)
    directory.write_privacy(record)

    closed = sweep_report.remove_stale_tables(config.out_dir)
    baseline_summary = sweep_report.summarize(baseline_rows, config.options) if baseline_rows else []
    simulated = config.simulate_batch
    written = sweep_report.write_all(
        config.out_dir,
        directory.file(BASELINE_DIR) if baseline_rows else None,
        options=config.options,
        rows=[{k: v for k, v in r.items() if k != "kind"} for r in rows],
        summary=summary,
        chosen=chosen,
        plotted=[] if simulated else chosen,
        head=_head(config, record, selection),
        diagnostic=diagnostic,
        owner_only=bool(closed),
        epsilon_label="target epsilon" if simulated else "epsilon",
        title=sweep_report.title(config.options, chosen=bool(chosen), simulate_batch=simulated, split=config.split),
        baseline_rows=[{k: v for k, v in r.items() if k != "kind"} for r in baseline_rows],
        baseline_summary=baseline_summary,
        make_baseline_dir=directory.make_baseline_dir,
    )
    warnings = list(record["warnings"])
    if closed:
        warnings.append(
            f"replaced the owner-only tables of an earlier sweep in {config.out_dir!r} "
            f"({', '.join(closed)}): this sweep's tables are owner-only (mode 0600) too"
        )
    if config.scores_private_rows:
        warnings.append(release.warning(f"the sweep's tables and plot in {config.out_dir!r} ({config.split} scores)"))
    if config.simulate_batch:
        warnings.append(
            f"{SIMULATION_NOTE}: the runs in {config.out_dir!r} ran at batch {config.simulate_batch} with "
            "less noise per example than their target epsilons; each spent its own epsilon (privacy.json)"
        )
    if baseline_rows:
        warnings.append(release.warning(f"the non-private baseline in {directory.file(BASELINE_DIR)!r}"))
    private_fields, private_files = _private_outputs(config, bool(baseline_rows))
    if private_fields and config.print_private_diagnostics:
        warnings.append(f"the JSON line's {', '.join(private_fields)} {_PRINTED}")
    return SweepResult(
        out_dir=config.out_dir,
        rows=tuple(rows),
        summary=tuple(summary),
        composed_epsilon=record["composed_epsilon"],
        delta=delta,
        covered_by_epsilon=not diagnostic,
        warnings=tuple(warnings),
        chosen=tuple(chosen),
        selection=selection,
        private_runs=record["private_runs"],
        simulation=simulation,
        baseline=tuple(baseline_summary),
        private_fields=private_fields,
        private_files=private_files,
        print_private=config.print_private_diagnostics,
        files=tuple(written),
        runs_trained=progress.trained,
        runs_reused=progress.reused,
        seconds=round(progress.seconds, 1),
    )


def _private_outputs(config: SweepConfig, baseline: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The result's fields that depend on held-out rows or on the baseline, and the owner-only files with them."""
    fields, where = [], []
    if config.scores_private_rows:
        fields += ["summary", "chosen"]
        where += [files.join(config.out_dir, release.diagnostic_name(n)) for n in (SUMMARY_MD, sweep_report.CHOSEN_CSV)]
    if baseline:
        fields.append("baseline")
        where.append(files.join(config.out_dir, BASELINE_DIR, release.diagnostic_name(SUMMARY_MD)))
    return tuple(fields), tuple(where)
