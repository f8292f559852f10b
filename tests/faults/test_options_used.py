"""Every option of every command is used or refused, in every mode: never accepted and dropped.

The walk gives each option of each command, alone, a value other than its default, on data of
each kind a training command reads (ingested images, pooled features, activations at a cut), and
catches what the command hands its stage (the stage's ``run`` is replaced: nothing is computed).
The option is *used* when that differs from what the command hands its stage without it, and
*refused* when the command exits 2 with one line naming it. For ``train`` and ``sweep`` the table
of ``training.option_use`` says which of the two it must be. Anything else (the same config, or a
crash) is an option wired to nothing, the fault this test exists for: a new option fails here until
it reaches its stage or is refused where it does not apply.
"""

import math
import re

import click
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.cli_options import CommaList, StageChoice
from dpscale.training.config import TrainingConfig, options_of
from dpscale.training.option_use import OPTION_USE, unused

#: The stage module whose ``run`` each command calls.
STAGES = {
    "train": "train",
    "evaluate": "evaluate",
    "sweep": "sweep",
    "quickstart": "quickstart",
    "audit": "audit",
    "epsilon": "epsilon",
    "calibrate": "calibrate",
    "ingest": "ingest",
    "dedup": "dedup",
    "train-copy-model": "train_copy_model",
    "import-weights": "import_weights",
    "export-backbone": "export_backbone",
    "featurize": "featurize",
    "models": "list_models",
}
#: What each command needs besides the option walked (a training command's DATA comes per mode).
ARGUMENTS = {
    "train": ["run"],
    "sweep": ["out", "--batch-size", "64", "--steps", "3"],
    "evaluate": ["run"],
    "quickstart": [],
    "audit": ["data"],
    "epsilon": ["--noise-multiplier", "1", "--steps", "10", "--batch-size", "10", "--num-examples", "100"],
    "calibrate": ["--epsilon", "1", "--num-examples", "100", "--batch-size", "10", "--steps", "100"],
    "ingest": ["digits", "out"],
    "dedup": ["a", "b", "c"],
    "train-copy-model": ["public", "out"],
    "import-weights": ["efficientnet-lite0"],
    "export-backbone": ["run", "out"],
    "featurize": ["data", "--backbone", "bb"],
    "models": [],
}
#: Values for options whose type says nothing of what they take.
SAMPLES = {
    "model": "wrn-16-4",
    "backbone": "other-backbone",
    "coordinator_address": "host:1234",
    "data": "other-data",
    "split": "holdout",
    "work_dir": "other-work",
    "out_dir": "other-out",
    "output": "other-output",
    "copy_model": "copy-model",
    "cache_dir": "other-cache",
    "cut": "scattering",
    "tfds_data_dir": "tfds-dir",
    "repair": "entry",
    "resume_dir": "killed-run",
    "grid": "ema-decay=0.9,0.99",
    "public_classes": "0,1",
    "classes": "0,1",
    "public_splits": "train",
    "private_splits": "test",
    "splits": "train",
}
#: Options that change how a result is printed, not what is computed (their output is tested elsewhere).
PRINTING = {("epsilon", "as_json"), ("calibrate", "as_json"), ("models", "as_json")}
#: Options walked without the command's other arguments (they replace them).
ALONE = {("train", "resume_dir")}
NUMBERS = ("2", "0.5", "3", "0.25", "0.9", "1e-6", "5", "0", "-0.5", "100")


class Handed(Exception):
    """What a command handed its stage: raised by the stage's replaced ``run``."""

    def __init__(self, config):
        super().__init__("handed")
        self.config = config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Data of each kind, as far as a command looks before its stage runs (the kind is read off metadata)."""
    root = tmp_path_factory.mktemp("kinds")
    for name, metadata in (("features", '{"key": {}}'), ("activations", '{"key": {"cut": "scattering"}}')):
        (root / name).mkdir()
        (root / name / "dpscale_features.json").write_text(metadata)
    (root / "images").mkdir()
    (root / "images" / "manifest.json").write_text("{}")
    return {kind: str(root / kind) for kind in ("images", "features", "activations")}


@pytest.fixture
def handed(monkeypatch):
    """Every stage's ``run`` raises what it was handed; train's multi-host set-up is recorded with it."""
    import importlib

    joined = []
    for stage in set(STAGES.values()):
        module = importlib.import_module(f"dpscale.stages.{stage}")
        monkeypatch.setattr(module, "run", lambda config=None: (_ for _ in ()).throw(Handed((config, tuple(joined)))))
    monkeypatch.setattr("dpscale.stages.train.initialize_distributed", lambda *args, **kw: joined.append((args, kw)))
    return joined


def _value(command: str, param: click.Option, current: str | None = None) -> list[str]:
    """The command-line words that give ``param`` a value other than its default (and than ``current``,
    the mode a walk is in, for the option that sets it)."""
    if param.is_flag:
        if param.secondary_opts:
            return [param.secondary_opts[0] if param.default else param.opts[0]]
        return [param.opts[0]]
    listed = isinstance(param.type, CommaList)
    kind = param.type.item if listed else param.type
    default = param.default if isinstance(param.default, (int, float, str, tuple)) else None  # click's "none"
    if listed:  # a list flag's default is its text, one item of a tuple
        default = param.type.convert(default[0], param, None) if default else ()
    if isinstance(kind, (click.Choice, StageChoice)):
        candidates = list(kind.choices)
    elif isinstance(kind, (click.types.FloatParamType, click.types.IntParamType)):
        candidates = list(NUMBERS)
    else:
        candidates = [SAMPLES[param.name]] if param.name in SAMPLES else []
    choices = []
    for text in candidates:
        try:
            value = param.type.convert(text, param, None)
        except click.BadParameter:
            continue
        if value != default and text != current:
            choices.append(text)
    assert choices, f"{command} {param.opts[0]}: add a sample value for it to SAMPLES"
    return [param.opts[0], choices[0]]


def _outcome(runner, command, args):
    """('handed', what the stage got) or ('refused', the error line, after any dated progress lines) or
    ('other', what happened)."""
    result = runner.invoke(cli, [command, *args])
    if isinstance(result.exception, Handed):
        return "handed", result.exception.config
    lines = [line for line in result.stderr.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d ", line)]
    if result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("dpscale: error: "):
        return "refused", lines[0]
    return "other", f"exit {result.exit_code}: {result.stderr.strip()[-300:]!r} {result.exception!r}"


KINDS = ("images", "features", "activations")
#: The commands whose options depend on a mode: the option that sets it, and its modes.
MODES = {
    "train": ("mode", KINDS),
    "sweep": ("mode", KINDS),
    "audit": ("threat_model", ("black-box", "white-box", "sampler")),
}


def _expected_refusal(command, mode, param, words) -> str | None:
    """Why the table of its command refuses an option given alone in ``mode`` (None: it is used)."""
    if command == "audit":
        from dpscale.stages.audit import OPTION_USE as AUDIT_USE

        threats, model = AUDIT_USE.get(param.name, (MODES["audit"][1], ""))
        return None if mode in threats and model in ("", "linear") else f"--{param.name.replace('_', '-')}"
    if param.name not in OPTION_USE:
        return None
    flat = options_of(TrainingConfig())
    if not param.is_flag:
        typed = param.type.convert(words[-1], param, None)
        flat[param.name] = typed[0] if isinstance(typed, tuple) else typed
    private = None if command == "sweep" else math.isfinite(flat["epsilon"])
    return unused(mode, flat, {param.name}, private=private)


def _arguments(command: str, mode: str | None, data: dict[str, str]) -> list[str]:
    """A command's arguments in ``mode``: a training command's data of that kind, the audit's threat model."""
    if command == "audit":
        return [*ARGUMENTS[command], "--threat-model", mode]
    return [data[mode], *ARGUMENTS[command]] if mode else ARGUMENTS[command]


def walk(command_name: str, command: click.Command, data: dict[str, str], arguments=None) -> list[str]:
    """Every option of ``command`` that is neither used nor refused, in every mode (one line each)."""
    runner = CliRunner()
    setting, modes = MODES.get(command_name, (None, (None,)))
    faults = []
    for mode in modes:
        base_args = _arguments(command_name, mode, data) if arguments is None else arguments
        baseline = _outcome(runner, command_name, base_args)
        if baseline[0] != "handed":
            faults.append(f"{command_name} {' '.join(base_args)}: {baseline[1]}")
            continue
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden or param.name in ("help", "version"):
                continue
            if (command_name, param.name) in PRINTING:
                continue
            words = _value(command_name, param, current=mode if param.name == setting else None)
            args = words if (command_name, param.name) in ALONE else [*base_args, *words]
            if param.opts[0] in base_args:  # replace the base's own value
                at = base_args.index(param.opts[0])
                args = [*base_args[:at], *base_args[at + 2 :], *words]
            outcome, what = _outcome(runner, command_name, args)
            where = f"{command_name} {' '.join(words)}" + (f" in {mode} mode" if mode else "")
            expected = _expected_refusal(command_name, mode, param, words) if mode else None
            if command_name in ("train", "sweep") and param.name in set(options_of(TrainingConfig())) - set(OPTION_USE):
                faults.append(f"{where}: not in training.option_use.OPTION_USE")
            elif expected is not None:
                if outcome != "refused" or param.opts[0] not in what:
                    faults.append(f"{where}: its table refuses it ({expected}), the command: {outcome} {what}")
            elif outcome == "handed" and what == baseline[1]:
                faults.append(f"{where}: accepted, and the stage gets the same as without it (dropped)")
            elif outcome == "other":
                faults.append(f"{where}: {what}")
    return faults


@pytest.mark.parametrize("command", sorted(STAGES))
def test_every_option_is_used_or_refused_in_every_mode(command, data, handed):
    faults = walk(command, cli.commands[command], data)
    assert not faults, "\n".join(faults)


def test_every_command_is_walked():
    assert set(cli.commands) == set(STAGES), "add the new command to STAGES and ARGUMENTS"


def test_the_table_has_a_row_for_every_training_option_and_no_other():
    assert set(OPTION_USE) == set(options_of(TrainingConfig()))


def test_the_walk_finds_an_option_wired_to_nothing(data, handed):
    """A new option that reaches nothing (or that the training options do not know) fails the walk."""
    from dpscale.stages import epsilon

    @click.command("epsilon")
    @click.option("--steps", type=int, default=10)
    @click.option("--new-thing", type=int, default=0, help="Added and wired to nothing.")
    def toy(steps, new_thing):
        epsilon.run(epsilon.EpsilonConfig(1.0, steps, 10, 100, 1e-5))

    original = cli.commands["epsilon"]
    cli.commands["epsilon"] = toy
    try:
        faults = walk("epsilon", toy, data, arguments=[])
    finally:
        cli.commands["epsilon"] = original
    assert faults == ["epsilon --new-thing 2: accepted, and the stage gets the same as without it (dropped)"]
    train = cli.commands["train"]
    extra = click.Option(["--new-training-thing"], type=int, default=0)
    train.params.append(extra)
    try:
        faults = walk("train", train, data)
    finally:
        train.params.remove(extra)
    assert len(faults) == 3 and all("unexpected keyword argument 'new_training_thing'" in f for f in faults), faults
