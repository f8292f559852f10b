"""Bad input through the real CLI: correct behaviour, or one line on stderr and exit code 2.

Every case here was a traceback or a silently wrong result once: flags out of range (NaN,
inf, 0, negative), IDX and tar files that are empty, corrupt or cut short, outputs that are
files or hold other files, a network too big for the memory. Also: stdout holds only the
command's JSON result, and rejecting a flag imports no heavy library.
"""

import io
import json
import math
import os
import struct
import subprocess
import sys
import tarfile

import click
import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dpscale.cli import cli
from dpscale.cli_options import StageChoice
from dpscale.errors import DataError


def _refused(result, *words):
    """Exit code 2, nothing on stdout, one ``dpscale: error:`` line on stderr holding ``words``."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpscale: error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


class _Completed:
    """A subprocess's outcome with CliRunner's attribute names."""

    def __init__(self, done: subprocess.CompletedProcess) -> None:
        self.exit_code, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        self.output = done.stdout + done.stderr


def _dpscale(*args, cwd=None):
    """The console command in a fresh process (what a user runs, logging set-up included)."""
    return _Completed(
        subprocess.run(
            [sys.executable, "-m", "dpscale", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
        )
    )


# --- every numeric flag is checked at the door -------------------------------------------------

BAD_FLAGS = [
    ("train", ["--clip-norm", "0"], "--clip-norm"),
    ("train", ["--clip-norm", "-1"], "--clip-norm"),
    ("train", ["--clip-norm", "nan"], "--clip-norm"),
    ("train", ["--learning-rate", "inf"], "--learning-rate"),
    ("train", ["--momentum", "-1"], "--momentum"),
    ("train", ["--checkpoint-every", "-5"], "--checkpoint-every"),
    ("train", ["--epsilon", "nan"], "--epsilon"),
    ("train", ["--epsilon", "-inf"], "--epsilon"),
    ("train", ["--delta", "1"], "--delta"),
    ("train", ["--noise-multiplier", "0"], "--noise-multiplier"),
    ("train", ["--ema-decay", "1"], "--ema-decay"),
    ("train", ["--weight-decay", "inf"], "--weight-decay"),
    ("train", ["--augmult", "0"], "--augmult"),
    ("train", ["--feature-scale", "nan"], "--feature-scale"),
    ("train", ["--seed", "-1"], "--seed"),
    ("sweep", ["--epsilons", "inf"], "--epsilons"),
    ("sweep", ["--learning-rates", "1,,2"], "--learning-rates"),
    ("sweep", ["--repeats", "0"], "--repeats"),
    ("sweep", ["--clip-norm", "nan"], "--clip-norm"),
    ("audit", ["--clip-norm", "0"], "--clip-norm"),
    ("audit", ["--epsilons", "1,nan"], "--epsilons"),
    ("audit", ["--num-models", "7"], "--num-models"),
    ("audit", ["--confidence", "1"], "--confidence"),
    ("quickstart", ["--epsilon", "inf"], "--epsilon"),
    ("quickstart", ["--public-classes", ","], "--public-classes"),
    ("quickstart", ["--pretrain-steps", "0"], "--pretrain-steps"),
    ("ingest", ["--classes", ","], "--classes"),
    ("ingest", ["--validation-fraction", "1"], "--validation-fraction"),
    ("ingest", ["--examples-per-shard", "0"], "--examples-per-shard"),
    ("dedup", ["--threshold", "0"], "--threshold"),
    ("dedup", ["--min-similarity", "2"], "--min-similarity"),
    ("dedup", ["--k", "0"], "--k"),
    ("dedup", ["--max-pages", "0"], "--max-pages"),
    ("dedup", ["--crowded-fraction", "0"], "--crowded-fraction"),
    ("dedup", ["--crowded-fraction", "1.5"], "--crowded-fraction"),
    ("featurize", ["--resize-method", "foo"], "--resize-method"),
    ("featurize", ["--chunk-rows", "0"], "--chunk-rows"),
    ("epsilon", ["--num-examples", "0"], "--num-examples"),
    ("calibrate", ["--rtol", "0"], "--rtol"),
]
ARGUMENTS = {
    "train": ["data", "run"],
    "sweep": ["data", "out"],
    "audit": ["data"],
    "quickstart": [],
    "ingest": ["digits", "out"],
    "dedup": ["a", "b", "c"],
    "featurize": ["data", "--backbone", "x"],
    "epsilon": ["--noise-multiplier", "1", "--steps", "10", "--batch-size", "10", "--num-examples", "100"],
    "calibrate": ["--epsilon", "1", "--num-examples", "100", "--batch-size", "10"],
}


@pytest.mark.parametrize("command, bad, flag", BAD_FLAGS, ids=[f"{c} {' '.join(b)}" for c, b, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_the_flag(command, bad, flag):
    _refused(CliRunner().invoke(cli, [command, *ARGUMENTS[command], *bad]), f"'{flag}'")  # the last value counts


def _numeric(param):
    kind = param.type
    return isinstance(kind, (click.types.FloatParamType, click.types.IntParamType)) or (
        hasattr(kind, "item") and isinstance(kind.item, (click.types.FloatParamType, click.types.IntParamType))
    )


def test_every_numeric_flag_of_every_command_has_a_range_that_refuses_nan():
    checked = 0
    for name, command in cli.commands.items():
        for param in command.params:
            if not isinstance(param, click.Option) or not _numeric(param):
                continue
            kind = getattr(param.type, "item", param.type)
            assert isinstance(kind, (click.IntRange, click.FloatRange)), f"{name} {param.opts[0]}: no range"
            if isinstance(kind, click.FloatRange):
                with pytest.raises(click.BadParameter):
                    kind.convert("nan", param, None)
            checked += 1
    assert checked >= 60, checked


def test_lists_take_commas_or_repeats_and_the_old_spellings_still_work(monkeypatch):
    from dpscale.stages import audit, dedup

    seen = {}

    def stop(config):
        seen["config"] = config
        raise DataError("stop here")

    for stage in (audit, dedup):
        monkeypatch.setattr(stage, "run", stop)
    runner = CliRunner()
    for args in (["--epsilons", "1,2", "--epsilons", "4"], ["--epsilon", "1", "--epsilon", "2", "--epsilon", "4"]):
        _refused(runner.invoke(cli, ["audit", "data", *args]), "stop here")
        assert seen.pop("config").epsilons == (1.0, 2.0, 4.0)
    for args in (
        ["--public-splits", "train", "--private-splits", "test,validation"],
        ["--public-split", "train", "--private-split", "test", "--private-split", "validation"],
    ):
        _refused(runner.invoke(cli, ["dedup", "data", "data", "out", *args]), "stop here")
        config = seen.pop("config")
        assert config.public_splits == ("train",) and config.private_splits == ("test", "validation")
    help_text = runner.invoke(cli, ["audit", "--help"]).output
    assert "--epsilons" in help_text and "--epsilon " not in help_text  # the old spelling is hidden


def test_delta_has_one_default_everywhere():
    for name in ("train", "sweep", "audit", "quickstart", "epsilon", "calibrate"):
        (delta,) = [p for p in cli.commands[name].params if p.name == "delta"]
        assert delta.default == 1e-5 and not delta.required, name


def test_a_choice_flag_offers_the_list_its_setting_is_checked_against():
    from dpscale.privacy.checks import ACCOUNTANTS, SAMPLING_SCHEMES
    from dpscale.training.config import FEATURE_NORMALIZATIONS, MODES

    def choices(command, name):
        (param,) = [p for p in cli.commands[command].params if p.name == name]
        return param.type.choices

    for command in ("train", "sweep", "epsilon", "calibrate"):
        assert choices(command, "accountant") == ACCOUNTANTS, command
    for command in ("train", "sweep"):
        assert choices(command, "sampling") == SAMPLING_SCHEMES and choices(command, "mode") == MODES
        assert choices(command, "feature_normalization") == FEATURE_NORMALIZATIONS
    # A default is taken without reading the stage's list (which imports the stage): it must be on it.
    for command in cli.commands.values():
        for param in command.params:
            if isinstance(param.type, StageChoice) and isinstance(param.default, str):
                assert param.default in param.type.choices, (command.name, param.name)


def test_rejecting_a_flag_imports_no_heavy_library():
    code = (
        "import sys\nfrom dpscale.cli import cli\n"
        "try:\n    cli.main(['train', 'data', 'run', '--clip-norm', '0'], prog_name='dpscale')\n"
        "except SystemExit as e:\n"
        "    print(e.code, sorted(m for m in ('jax', 'flax', 'apache_beam', 'dpscale.stages') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr


# --- data: IDX and tar files that are empty, corrupt or cut short ------------------------------


def _idx(path, array):
    array = np.asarray(array, np.uint8)
    with open(path, "wb") as f:
        f.write(b"\0\0\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


def _idx_dir(root, name, images, labels):
    directory = root / name
    directory.mkdir()
    _idx(directory / "train-images-idx3-ubyte", images)
    if labels is None:  # a label file with no dimension at all
        (directory / "train-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x00")
    else:
        _idx(directory / "train-labels-idx1-ubyte", labels)
    return directory


def _png(rng):
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    """A complete tar of 4 classes x 10 PNGs, and the same tar cut at the boundary before member 17."""
    root = tmp_path_factory.mktemp("tars")
    rng = np.random.default_rng(0)
    full = root / "full.tar"
    with tarfile.open(full, "w") as archive:
        for label in range(4):
            for i in range(10):
                data = _png(rng)
                info = tarfile.TarInfo(f"class{label}/{i}.png")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    with tarfile.open(full) as archive:
        cut_at = archive.getmembers()[17].offset
    cut = root / "cut.tar"
    cut.write_bytes(full.read_bytes()[:cut_at])
    with tarfile.open(cut) as archive:  # what made it silent: tarfile lists the rest without complaint
        assert len(archive.getmembers()) == 17
    return full, cut


def test_a_tar_cut_at_a_member_boundary_is_refused_and_a_complete_one_is_ingested_whole(tars, tmp_path):
    full, cut = tars
    _refused(_dpscale("ingest", f"folder:{cut}", tmp_path / "cut"), "truncated", "17 members")
    assert not (tmp_path / "cut").exists()
    done = _dpscale("ingest", f"folder:{full}", tmp_path / "full")
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)  # stdout is the JSON result only
    assert result["num_examples"] == {"train": 40} and result["num_classes"] == 4


@pytest.mark.parametrize(
    "case, words",
    [
        ("label file without dimensions", ["label file has 1 dimension"]),
        ("no examples", ["0 labels"]),
        ("one label 255", ["0..255", "classes.txt"]),
    ],
)
def test_broken_idx_files_are_one_line(case, words, tmp_path):
    rng = np.random.default_rng(1)
    labels = np.arange(40) % 4
    labels[7] = 255
    images, labels = {
        "label file without dimensions": (rng.integers(0, 255, (5, 8, 8)), None),
        "no examples": (np.zeros((0, 8, 8)), np.zeros((0,))),
        "one label 255": (rng.integers(0, 255, (40, 8, 8)), labels),
    }[case]
    directory = _idx_dir(tmp_path, "idx", images, labels)
    _refused(_dpscale("ingest", f"idx:{directory}", tmp_path / "out"), *words)


def test_a_label_outside_named_classes_is_rejected_reported_and_summarised(tmp_path):
    rng = np.random.default_rng(2)
    labels = np.arange(40) % 4
    labels[7] = 255
    directory = _idx_dir(tmp_path, "idx", rng.integers(0, 255, (40, 8, 8)), labels)
    (directory / "classes.txt").write_text("a\nb\nc\nd\n")
    done = _dpscale("ingest", f"idx:{directory}", tmp_path / "out")
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert result["num_examples"] == {"train": 39} and result["num_rejected"] == 1
    assert "rejected: 1 (1 " in done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["key"] for r in report["rejected"]] == ["train-images-idx3-ubyte[7]"]


def test_an_output_that_is_a_file_or_holds_other_files_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("keep me")
    _refused(_dpscale("ingest", "digits", tmp_path / "a-file"), "existing file")
    for command in (
        ["featurize", "data", "--backbone", "x", "--cache-dir"],
        ["quickstart", "--work-dir"],
        ["audit", "data", "--out-dir"],
        ["sweep", "data"],
        ["train", "data"],
    ):
        _refused(CliRunner().invoke(cli, [*command, str(tmp_path / "a-file")]), "is a file")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    _refused(_dpscale("ingest", "digits", other, "--overwrite"), "notes.txt", "new or empty directory")
    assert os.listdir(other) == ["notes.txt"]


# --- commands that run: only the JSON result on stdout; a network too big is refused first ----


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits") / "digits"
    result = CliRunner().invoke(cli, ["ingest", "digits", str(out), "--classes", "0,1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_classes"] == 2
    assert json.loads(result.stdout)["images_per_second"] > 0 and "images/s read" in result.stderr
    return str(out)


def _json_only(args):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1, result.stdout
    return json.loads(result.stdout)


def test_stdout_is_one_json_line_for_every_command_that_runs(digits, tmp_path):
    # (train's stdout is checked in tests/training/test_release.py, audit's in tests/stages/test_audit.py)
    entry = _json_only(["featurize", digits, "--backbone", "scatternet-linear", "--cache-dir", str(tmp_path / "c")])
    assert entry["images_per_second"] > 0
    sweep = _json_only(
        [
            "sweep",
            entry["path"],
            str(tmp_path / "sweep"),
            "--epsilons",
            "2",
            "--learning-rates",
            "1",
            "--repeats",
            "1",
            "--no-baseline",
            "--accountant",
            "rdp",
            "--batch-size",
            "64",
            "--steps",
            "2",
        ]
    )
    assert [row["epsilon"] for row in sweep["summary"]] == [2.0]
    (run,) = os.listdir(tmp_path / "sweep" / "runs")
    scores = _json_only(["evaluate", str(tmp_path / "sweep" / "runs" / run)])
    assert "ema" in json.dumps(scores) and 0 < scores["epsilon"] <= 2 and 0 < scores["delta"] < 1  # the run's own
    dedup = _json_only(
        ["dedup", digits, digits, str(tmp_path / "dedup"), "--public-splits", "train", "--private-splits", "test"]
    )
    assert os.path.isfile(os.path.join(dedup["output_dir"], "manifest.json"))


def test_a_network_too_big_for_the_memory_is_refused_before_compiling(digits, tmp_path):
    # NFNet-F0 keeps a 0.5 GiB gradient per example: 4096 of them fit in no machine's memory.
    line = _refused(
        CliRunner().invoke(
            cli,
            [
                "train",
                digits,
                str(tmp_path / "run"),
                "--model",
                "nfnet-f0",
                "--batch-size",
                "64",
                "--steps",
                "2",
                "--microbatch-size",
                "4096",
            ],
        ),
        "nfnet-f0",
        "GiB",
        "--microbatch-size",
    )
    need = float(line.split("needs about ")[1].split(" GiB")[0])
    assert math.isfinite(need) and need > 1000
    assert not (tmp_path / "run").exists()
