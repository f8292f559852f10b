"""The ``dpscale`` command line: one thin subcommand per stage.

Every command parses its flags, builds the stage's frozen config, calls the
stage's ``run`` and prints the result. This module holds the group, the training
commands (train, evaluate, sweep, quickstart) and the privacy tools (epsilon,
calibrate, audit); the commands that prepare training's inputs are in
``cli_prepare``, the flags' types in ``cli_options``, and how results, warnings
and errors are written (a user error is one line and exit code 2, never a
traceback) in ``cli_output``. Of the library it imports only the stages and the
errors: what a flag needs from elsewhere (a choice list, a bound) the stage exposes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any

import click

from dpscale.cli_options import (
    ACCOUNTANT_HELP,
    COUNT,
    FRACTION,
    GRID_SHORTHANDS,
    POSITIVE,
    SEED,
    SELECTION_OPTIONS,
    TRAINING_OPTIONS,
    VERBOSE,
    CommaList,
    ListOption,
    StageChoice,
    delta_option,
    floats,
    grid_axes,
    ints,
    private_selection,
    typed_options,
)
from dpscale.cli_output import (
    DpscaleGroup,
    echo_warnings,
    end_promptly_on_interrupt,
    interrupt_hint,
    print_json_line,
    quiet_library_logs,
    rerun_hint,
    show_stage_progress,
    under_way,
)
from dpscale.cli_prepare import PREPARE_COMMANDS


@click.group(cls=DpscaleGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dpscale")
def cli() -> None:
    """dpscale: train image classifiers with differential privacy, at scale.

    Each subcommand is one stateless stage of the pipeline
    (ingest -> dedup -> featurize -> train -> evaluate), plus the privacy
    tools (epsilon, calibrate) and `quickstart`, which runs the whole path
    offline on a small embedded data set.
    """
    quiet_library_logs()


for _command in PREPARE_COMMANDS:
    cli.add_command(_command)


@cli.command("train")
@click.argument("data", type=click.Path(file_okay=False), required=False)
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Continue the killed run in this directory from its last checkpoint, with the settings it started "
    "with (no other arguments or training options; multi-host flags only).",
)
@click.option(
    "--epsilon",
    type=floats(0, min_open=True, allow_inf=True),
    default=8.0,
    show_default=True,
    help="Target epsilon; `inf` = non-private.",
)
@click.option("--noise-multiplier", type=POSITIVE, default=None, help="sigma; calibrated when left out.")
@click.option(
    "--learning-rate",
    type=POSITIVE,
    default=2.0,
    show_default=True,
    help="SGD step size on the C-normalised gradient (constant).",
)
@TRAINING_OPTIONS
@click.option(
    "--seed", type=SEED, default=None, help="Fix the secret seed (noise and sampling). Default: fresh OS entropy."
)
@click.option(
    "--coordinator-address",
    default=None,
    metavar="HOST:PORT",
    help="Multi-host: process 0's address; give it with --num-processes and --process-id, "
    "the same on every host (see docs/cluster.md, Multi-host).",
)
@click.option("--num-processes", type=COUNT, default=None, help="Multi-host: number of processes (hosts).")
@click.option("--process-id", type=ints(0), default=None, help="Multi-host: this process's index, 0 to N-1.")
@click.option(
    "--distributed",
    "auto_distributed",
    is_flag=True,
    help="Multi-host with the cluster detected by JAX (Cloud TPU pods, Slurm, Open MPI).",
)
def train_command(
    data: str | None,
    run_dir: str | None,
    resume_dir: str | None,
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    auto_distributed: bool,
    **options: Any,
) -> None:
    """Train on DATA with DP-SGD; write the run to RUN_DIR.

    Give the privacy target (--epsilon, --delta) and two of --batch-size, --steps,
    --noise-multiplier; the third is calibrated before the first step. A run that
    cannot meet the target does not start. Prints one JSON line with the achieved
    epsilon and the hyper-parameters. Killed runs continue with --resume RUN_DIR.
    Multi-host: run the same command on every host, adding the multi-host flags.
    """
    from dpscale.stages import train

    if resume_dir is not None:
        _refuse_settings_with_resume(click.get_current_context())
    # Before anything touches a JAX backend (importing the train stage does not).
    train.initialize_distributed(coordinator_address, num_processes, process_id, auto=auto_distributed)
    if resume_dir is not None:
        if data or run_dir:
            raise click.UsageError("--resume RUN_DIR takes no DATA or RUN_DIR arguments")
        with _resume_hint_on_interrupt(resume_dir):
            result = train.run(train.ResumeConfig(resume_dir))
        echo_warnings(result.warnings)
        print_json_line(dataclasses.asdict(result))
        return
    if not (data and run_dir):
        raise click.UsageError("give DATA and RUN_DIR (or --resume RUN_DIR)")
    config = train.TrainConfig.from_options(data, run_dir, given=typed_options(click.get_current_context()), **options)
    with _resume_hint_on_interrupt(run_dir):
        result = train.run(config)
    echo_warnings(result.warnings)
    print_json_line(dataclasses.asdict(result))


def _refuse_settings_with_resume(ctx: click.Context) -> None:
    """A resumed run continues with the settings, plan and seed it started with (its config.json): a
    training option given with --resume would be ignored, so it is refused (the multi-host flags,
    which say how this process joins, are the only ones that apply)."""
    joining = {"resume_dir", "coordinator_address", "num_processes", "process_id", "auto_distributed"}
    given = [
        param.opts[0]
        for param in ctx.command.params
        if param.name not in joining
        and isinstance(param, click.Option)
        and ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise click.UsageError(
            f"--resume continues the run with the settings it started with; {', '.join(given)} "
            "cannot change them (start a new run in a new directory instead)"
        )


def _resume_hint_on_interrupt(run_dir: str) -> contextlib.AbstractContextManager:
    """On Ctrl-C in a run that has started, the interrupted line says how to continue it."""
    from dpscale.stages import train

    started = train.started  # bound now: the hint may be asked from another thread, which must not import
    return interrupt_hint(
        lambda: f"continue the run with `dpscale train --resume {run_dir}`" if started(run_dir) else None
    )


@cli.command("evaluate")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--split", default="test", show_default=True)
@click.option(
    "--data",
    default=None,
    help="Data made like the run's (same classes, image shape, backbone and preprocessing); default: the "
    "data the run trained on.",
)
@click.option(
    "--force-other-data",
    is_flag=True,
    help="Score --data even though it is not the data the run trained on; the scores go to "
    "metrics.other-data.<name>.json, never metrics.json.",
)
@click.option(
    "--private-diagnostics",
    is_flag=True,
    help="Allow scoring the run's own training rows (its train split or held-out rows): exact statistics "
    "of private data that epsilon does NOT cover, written to a *.NOT-PRIVATE.json file (mode 0600).",
)
def evaluate_command(
    run_dir: str, split: str, data: str | None, force_other_data: bool, private_diagnostics: bool
) -> None:
    """Top-1/top-5 of the last and the EMA parameters of RUN_DIR; writes RUN_DIR/metrics.json.

    The JSON line restates the run's (epsilon, delta) and names the data scored.
    """
    from dpscale.stages import evaluate

    result = evaluate.run(
        evaluate.EvaluateConfig(
            run_dir=run_dir,
            split=split,
            data=data,
            private_diagnostics=private_diagnostics,
            force_other_data=force_other_data,
        )
    )
    echo_warnings(result.warnings)
    print_json_line(result.as_dict())


@cli.command("sweep")
@click.argument("data", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--epsilons",
    cls=ListOption,
    type=CommaList(POSITIVE),
    default="1,2,4,8",
    help="Target epsilons of the grid (the same as --grid epsilon=...).",
)
@click.option(
    "--learning-rates",
    cls=ListOption,
    type=CommaList(POSITIVE),
    default="2",
    help="DP learning rates of the grid (the same as --grid learning-rate=...).",
)
@click.option(
    "--grid",
    "grid",
    multiple=True,
    metavar="NAME=V1,V2,...",
    help="Grid over any training option below, e.g. --grid augmult=1,4,8 --grid batch-size=1024,4096 "
    "(repeat for more axes; one column each in the tables; every value is in the run names).",
)
@click.option(
    "--repeats",
    type=COUNT,
    default=3,
    show_default=True,
    help="Runs per grid point, each with a fresh secret seed (median and spread are reported).",
)
@click.option(
    "--baseline/--no-baseline",
    default=False,
    show_default=True,
    help="Also train a non-private baseline per repeat and setting: NOT private, written apart to "
    "OUT_DIR/baseline.NOT-PRIVATE/ (owner-only).",
)
@click.option("--baseline-learning-rate", type=POSITIVE, default=0.5, show_default=True)
@click.option("--baseline-momentum", type=FRACTION, default=0.9, show_default=True)
@click.option(
    "--simulate-batch",
    type=COUNT,
    default=None,
    help="Cheap search (TAN): run every point at this expected batch b < B with the noise multiplier "
    "scaled by b/B, same steps. NOT private at the target epsilons (runs and files say so); each "
    "spends its own epsilon, composed into privacy.json. Train the chosen setting with `dpscale train`.",
)
@click.option(
    "--print-private-diagnostics",
    is_flag=True,
    help="Also print the held-out and baseline scores (and the settings chosen on held-out rows) in the "
    "JSON line: NOT covered by epsilon. Without it the line names the owner-only files that hold them.",
)
@SELECTION_OPTIONS
@TRAINING_OPTIONS
@click.pass_context
def sweep_command(ctx: click.Context, data: str, out_dir: str, grid: tuple[str, ...], **options: Any) -> None:
    """Train a grid over epsilon x learning rate (x any training option, x repeats) on the same DATA.

    Every run uses the training options below (as `dpscale train` reads them), with its own
    grid values and a fresh secret seed; a gridded --batch-size or --steps needs no flag beside it.
    Each run's progress line says which run of how many it is, and the sweep's time left.

    \b
    Writes to OUT_DIR:
      runs/NAME/        every run (NAME: its grid point, e.g. eps8-lr2-r0)
      privacy.json      the composed epsilon of every private run in runs/
      sweep.json        the data the runs are of (reuse checks it)
      summary.md, summary.csv, runs.csv, accuracy_vs_epsilon.png
                        the results, when nothing is chosen (no --holdout)
      summary.NOT-PRIVATE.md, summary.NOT-PRIVATE.csv, runs.NOT-PRIVATE.csv,
      chosen.NOT-PRIVATE.csv, accuracy_vs_epsilon.NOT-PRIVATE.png
                        instead, with --holdout N (chosen.*: the setting chosen
                        per epsilon on held-out rows) or --simulate-batch:
                        private diagnostics, owner-only
      baseline.NOT-PRIVATE/
                        with --baseline: its runs/, the same *.NOT-PRIVATE.*
                        tables and a plot of the DP runs beside it; owner-only
      chosen/NAME/, chosen/NAME.json, summary.md, summary.csv, chosen.csv
                        instead, with --private-selection --holdout N: per
                        epsilon and repeat (NAME, e.g. eps8-r0) the chosen run
                        and what the selection publishes, covered by epsilon
      selection.NOT-PRIVATE/
                        with --private-selection: every other run; owner-only

    At the end, stderr names the tables. Finished runs are reused only for the same data and
    settings, so an interrupted sweep continues where it stopped; anything else is refused.
    """
    from dpscale.stages import sweep

    axes = grid_axes(ctx, grid)  # refuses --epsilons / --learning-rates given beside their --grid
    for name, _ in axes:
        if name in GRID_SHORTHANDS:  # the grid's values replace the flag's default
            options[GRID_SHORTHANDS[name]] = ()
    unused = [
        f"--{name.replace('_', '-')}"
        for name in ("baseline_learning_rate", "baseline_momentum")
        if not options["baseline"] and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    ]
    if unused:  # used by nothing else: refused, not dropped
        raise click.UsageError(
            f"{' and '.join(unused)} apply to the non-private baseline, which runs only with --baseline: "
            "add --baseline, or leave them out"
        )
    options["private_selection"] = private_selection(options, "sweep")
    config = sweep.SweepConfig.from_options(data, out_dir, grid=axes, given=typed_options(ctx), **options)
    with rerun_hint("the sweep", "finished runs are reused, an interrupted one resumes from its last checkpoint"):
        result = sweep.run(config)
    echo_warnings(result.warnings)
    for line in (*result.report(), _privacy_line(result)):
        click.echo(f"dpscale: {line}", err=True)
    print_json_line(result.line())


def _privacy_line(result: Any) -> str:
    if hasattr(result, "privacy_line"):  # a private selection's
        return result.privacy_line()
    line = (
        f"releasing every DP result in this sweep's directory together ({result.private_runs} private runs) is "
        f"({result.composed_epsilon:.4g}, {result.delta:g})-DP (see privacy.json)"
    )
    if result.baseline:
        line += "; the non-private baseline's scores are NOT private"
    return line


@cli.command("quickstart")
@click.option(
    "--data",
    default="digits",
    show_default=True,
    help="Any ingest source: digits (bundled, offline), idx:DIR, folder:PATH, tfds:NAME.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default="dpscale-quickstart",
    show_default=True,
    help="Where the ingested data, backbone, feature cache and run directories go.",
)
@click.option("--public-classes", cls=ListOption, help="Class names used as public data (default: the first half).")
@click.option(
    "--no-dedup",
    "dedup",
    flag_value=False,
    default=True,
    help="Skip removing public near duplicates of private images.",
)
@click.option("--model", default="cnn-small", show_default=True, help="Architecture pre-trained on the public classes.")
@click.option("--pretrain-steps", type=COUNT, default=200, show_default=True)
@click.option("--pretrain-batch-size", type=COUNT, default=128, show_default=True)
@click.option("--pretrain-learning-rate", type=POSITIVE, default=0.01, show_default=True)
@click.option(
    "--epsilon", type=POSITIVE, default=8.0, show_default=True, help="Target epsilon of the private training."
)
@delta_option()
@click.option(
    "--batch-size",
    type=COUNT,
    default=512,
    show_default=True,
    help="Expected batch size of the DP last-layer training.",
)
@click.option("--steps", type=COUNT, default=1000, show_default=True, help="Steps of the DP last-layer training.")
@click.option("--learning-rate", type=POSITIVE, default=0.5, show_default=True, help="Of the DP last-layer training.")
@click.option("--seed", type=SEED, default=None, help="Fix the secret seed (debugging only).")
@click.option(
    "--private-diagnostics",
    is_flag=True,
    help="Also report how many public images dedup removed (depends on the private data; NOT covered).",
)
@VERBOSE
def quickstart_command(**options: Any) -> None:
    """Public pre-training, then DP fine-tuning: the paper's path on a small offline data set.

    ingest (public and private classes) -> dedup -> non-private pre-training on the
    public classes -> export-backbone -> featurize the private images -> DP-SGD on the
    last layer (noise calibrated to --epsilon/--delta) -> evaluate. Ends with one JSON
    line holding epsilon, delta and test_accuracy (EMA parameters, private test split).
    """
    from dpscale.stages import quickstart

    show_stage_progress(quickstart.log)
    result = quickstart.run(quickstart.QuickstartConfig.from_options(**options))
    echo_warnings(result.warnings)
    print_json_line(dataclasses.asdict(result))


@cli.command("audit")
@click.argument("data", type=click.Path(file_okay=False))
@click.option("--out-dir", type=click.Path(file_okay=False), default=None, help="Write audit.json and audit.md here.")
@click.option(
    "--epsilons",
    "--epsilon",
    "epsilons",
    cls=ListOption,
    type=CommaList(POSITIVE),
    default="1,2,4,8",
    help="Nominal epsilons, one row each.",
)
@delta_option()
@click.option("--num-examples", type=COUNT, default=1000, show_default=True, help="|D|: a random subset.")
@click.option(
    "--batch-size",
    type=COUNT,
    default=None,
    help="Expected batch size [black-box: 100; white-box: |D|, the only one it takes; sampler: (|D|+1)/10].",
)
@click.option("--steps", type=COUNT, default=None, help="Steps [50; sampler: one epoch, (|D|+1) / batch size].")
@click.option("--learning-rate", type=POSITIVE, default=1.0, show_default=True)
@click.option("--clip-norm", type=POSITIVE, default=1.0, show_default=True)
@click.option(
    "--threat-model",
    type=StageChoice("audit.THREAT_MODELS"),
    default="black-box",
    show_default=True,
    help="black-box: the adversary sees the final model and a canary input; "
    "white-box: a gradient canary, and the adversary sees every update (q = 1); sampler: the same at "
    "q < 1 with the real sampler, against the accounted privacy profile.",
)
@click.option(
    "--model",
    type=StageChoice("audit.MODELS"),
    default="linear",
    show_default=True,
    help="black-box: linear or mlp; white-box: linear or cnn.",
)
@click.option("--microbatches", type=COUNT, default=2, show_default=True, help="White-box: micro-batches per step.")
@click.option(
    "--canary-norm",
    type=floats(1),
    default=10.0,
    show_default=True,
    help="White-box: norm of the canary gradient in units of the clip norm (>= 1).",
)
@click.option(
    "--per-example",
    type=StageChoice("audit.PER_EXAMPLE"),
    default="vmap",
    show_default=True,
    help="White-box CNN: how per-example gradients are computed.",
)
@click.option(
    "--devices",
    type=COUNT,
    default=1,
    show_default=True,
    help="White-box: data-parallel devices of the audited step (micro-batches sharded, sums psum'd).",
)
@click.option("--hidden", type=COUNT, default=32, show_default=True, help="MLP hidden units.")
@click.option(
    "--num-models",
    type=ints(8),
    default=1000,
    show_default=True,
    help="Models per row, half of them trained with the canary.",
)
@click.option(
    "--holdout-fraction",
    type=floats(0, 1, min_open=True, max_open=True),
    default=0.5,
    show_default=True,
    help="Models used only to choose the threshold.",
)
@click.option(
    "--confidence",
    type=floats(0, 1, min_open=True, max_open=True),
    default=0.999,
    show_default=True,
    help="Confidence level of the Clopper-Pearson and Gaussian-DP bounds.",
)
@click.option("--canary", type=StageChoice("audit.CANARIES"), default="ood", show_default=True)
@click.option(
    "--one-run-canaries",
    type=ints(0),
    default=0,
    show_default=True,
    help="Also run the one-run audit (Steinke et al. 2023) with this many canaries.",
)
@click.option("--seed", type=SEED, default=None, help="Fix the audit seed (reproducible audits).")
def audit_command(data: str, epsilons: tuple[float, ...], **options) -> None:
    """Empirical lower bounds on epsilon for DP-SGD on a subset of the ingested DATA.

    Trains many small models with the same update as `dpscale train`, half of them
    with a canary, and prints a Markdown table (and one JSON line) of the lower
    bounds (which estimator gave which), the largest epsilon Clopper-Pearson could
    certify with that many models, and the nominal epsilon. Exit code 1 if a lower
    bound exceeds its nominal epsilon (a DP bug).
    """
    from dpscale.stages import audit

    result = audit.run(audit.AuditConfig(data=data, epsilons=epsilons, **options))
    click.echo(result.markdown(), nl=False, err=True)
    print_json_line(result.as_dict())
    if any(row["violation"] for row in result.rows):
        click.echo("dpscale: AUDIT FAILED: a lower bound exceeds the nominal epsilon", err=True)
        sys.exit(1)


@cli.command("epsilon")
@click.option(
    "--noise-multiplier", type=POSITIVE, required=True, help="sigma: noise standard deviation divided by the clip norm."
)
@click.option("--steps", type=COUNT, required=True, help="Number of DP-SGD steps T.")
@click.option("--batch-size", type=COUNT, required=True, help="Expected (Poisson) batch size B.")
@click.option("--num-examples", type=COUNT, required=True, help="Training set size N; q = B/N.")
@click.option(
    "--batch-capacity",
    type=COUNT,
    default=None,
    help="Most examples a step holds, at least --batch-size (a run's ledger records it) [the rule train uses].",
)
@delta_option()
@click.option(
    "--accountant", type=StageChoice("epsilon.ACCOUNTANTS"), default="pld", show_default=True, help=ACCOUNTANT_HELP
)
@SELECTION_OPTIONS
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def epsilon_command(
    noise_multiplier: float,
    steps: int,
    batch_size: int,
    num_examples: int,
    batch_capacity: int | None,
    delta: float,
    accountant: str,
    as_json: bool,
    **selection: Any,
) -> None:
    """Epsilon spent by T steps of DP-SGD with (truncated) Poisson sampling.

    Each step samples every example with probability q = B/N, keeps a random subset of
    the batch capacity when more joined, and adds Gaussian noise of sigma times the clip
    norm; neighbouring data sets differ by adding or removing one example. Uses
    dp-accounting's PLD (default) or RDP accountant.

    \b
    Example (an ImageNet-sized run):
      dpscale epsilon --noise-multiplier 2.5 --steps 71589 --batch-size 16384 \\
                      --num-examples 1281167 --delta 5e-7
    """
    under_way(f"epsilon: loading the {accountant.upper()} accountant, then accounting {steps} steps")
    from dpscale.stages import epsilon as stage

    config = stage.EpsilonConfig(
        noise_multiplier=noise_multiplier,
        steps=steps,
        batch_size=batch_size,
        num_examples=num_examples,
        delta=delta,
        accountant=accountant,
        batch_capacity=batch_capacity or 0,
        private_selection=private_selection(selection, "epsilon"),
    )
    result = stage.run(config)
    echo_warnings(result.warnings)
    if as_json:
        print_json_line(result.as_dict())
        return
    if result.private_selection:
        click.echo(_selection_text(result))
        return
    click.echo(
        f"epsilon = {result.epsilon:.6g} at delta = {result.delta:g} "
        f"({result.accountant.upper()} accountant, Poisson sampling q = {result.sampling_rate:.6g} "
        f"truncated to {result.batch_capacity}, sigma = {result.noise_multiplier:g}, {result.steps} steps)"
    )


@cli.command("calibrate")
@click.option("--epsilon", type=POSITIVE, required=True, help="Target epsilon: the result never exceeds it.")
@delta_option()
@click.option("--num-examples", type=COUNT, required=True, help="Training set size N; q = B/N.")
@click.option("--batch-size", type=COUNT, default=None, help="Expected (Poisson) batch size B; solved for if left out.")
@click.option("--steps", type=COUNT, default=None, help="Number of DP-SGD steps T; solved for if left out.")
@click.option("--noise-multiplier", type=POSITIVE, default=None, help="sigma; solved for if left out.")
@click.option(
    "--accountant", type=StageChoice("calibrate.ACCOUNTANTS"), default="pld", show_default=True, help=ACCOUNTANT_HELP
)
@click.option(
    "--rtol",
    type=floats(0, 1, min_open=True, max_open=True),
    default=1e-3,
    show_default=True,
    help="Relative tolerance on a solved noise multiplier (steps and batch size are exact).",
)
@SELECTION_OPTIONS
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def calibrate_command(
    epsilon: float,
    delta: float,
    num_examples: int,
    batch_size: int | None,
    steps: int | None,
    noise_multiplier: float | None,
    accountant: str,
    rtol: float,
    as_json: bool,
    **selection: Any,
) -> None:
    """Solve for the one of --noise-multiplier, --steps, --batch-size left out.

    Finds the smallest noise multiplier, or the largest number of steps, or the largest
    batch size whose epsilon is at most --epsilon (never above it) by a monotone
    bracketing search; the reported epsilon is the achieved one.

    \b
    Example: the noise for an ImageNet-sized run at epsilon 8
      dpscale calibrate --epsilon 8 --delta 5e-7 --num-examples 1281167 \\
                        --batch-size 16384 --steps 71589
    """
    under_way(f"calibrate: loading the {accountant.upper()} accountant, then solving for the setting left out")
    from dpscale.stages import calibrate as stage

    config = stage.CalibrateConfig(
        epsilon=epsilon,
        delta=delta,
        num_examples=num_examples,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
        rtol=rtol,
        private_selection=private_selection(selection, "calibrate"),
    )
    result = stage.run(config)
    echo_warnings(result.warnings)
    if as_json:
        print_json_line(result.as_dict())
        return
    solved = {result.solved_for: "  (solved)"}
    click.echo(f"noise multiplier  {result.noise_multiplier:.6g}{solved.get('noise_multiplier', '')}")
    click.echo(f"steps             {result.steps}{solved.get('steps', '')}")
    click.echo(f"batch size        {result.batch_size}{solved.get('batch_size', '')}  (q = {result.sampling_rate:.6g})")
    click.echo(
        f"epsilon           {result.epsilon:.6g} <= {result.target_epsilon:g} at delta "
        f"{result.delta:g} ({result.accountant.upper()} accountant, {result.seconds:.1f} s)"
    )
    if result.private_selection:
        click.echo(_selection_text(result))


def _selection_text(result: Any) -> str:
    """A private selection's epsilon in words: what it covers, one run's alone, how many runs to expect."""
    s = result.private_selection
    return (
        f"epsilon = {s['epsilon']:.6g} at delta = {result.delta:g} for a private selection (RDP accountant): "
        f"{s['covers']}; one run alone: epsilon {s['run_epsilon']:.6g} ({s['run_accountant'].upper()}, "
        f"sigma = {result.noise_multiplier:g}, {result.steps} steps, q = {result.sampling_rate:.6g} truncated to "
        f"{result.batch_capacity}); 99% of selections make at most {s['runs_99th_percentile']} runs"
    )


def main() -> None:
    """Console-script entry point: the command line as its own process (Ctrl-C ends it at once)."""
    end_promptly_on_interrupt()
    cli()
