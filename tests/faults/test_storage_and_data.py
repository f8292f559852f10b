"""Faults of the machine and of the data through the real CLI: read-only outputs, a full disk, damaged
ingested shards, a TFDS dataset that is not prepared, evaluation on data that is not the run's.

Each ends in one ``dpscale: error:`` line with exit code 2 that names the path and what to do, and
leaves every file as it was (or, for a full disk, a run that resumes).
"""

import builtins
import errno
import io
import json
import os
import re

import pytest

from dpscale.training.checkpoints import Checkpoints
from dpscale.training.run_directory import CONFIG, LEDGER, SCORES

from .advice import check_advice
from .test_flags_and_limits import snapshot
from .test_runs_and_caches import IN_MEMORY, SIZES, TRAIN, dpscale, ok, refused

IMAGES = ["--epsilon", "4", "--batch-size", "64", "--steps", "2", "--microbatch-size", "32", "--augment-pad", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory, synthetic_feature_cache):
    return synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")), seed=0, sizes=SIZES, chunk_rows=64, data_hash_char="d"
    )


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Ingested digits (all ten classes) and an images run on them (read only by the tests)."""
    from dpscale.cli import cli

    root = tmp_path_factory.mktemp("digits")
    for args in (
        ["ingest", "digits", root / "digits", "--", *IN_MEMORY],
        ["train", root / "digits", root / "run", *IMAGES],
    ):
        with pytest.raises(SystemExit) as info:
            cli.main([str(a) for a in args], prog_name="dpscale")
        assert info.value.code == 0
    return root / "digits", root / "run"


def refused_after_progress(capfd, *args, saying=()):
    """``refused`` for a Beam stage, whose dated progress lines may come first: one error line, at the end."""
    code, out, err = dpscale(capfd, *args)
    lines = [line for line in err.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d ", line)]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dpscale: error: "), err
    assert "Traceback" not in err and out == "" and err.strip().splitlines()[-1] == lines[0]
    for text in (saying,) if isinstance(saying, str) else saying:
        assert text in lines[0], lines[0]
    check_advice(lines[0])
    return lines[0]


def read_only(monkeypatch, root) -> None:
    """Make writes under ``root`` fail as on a read-only directory (the tests run as root, whom
    permissions do not stop): opening for writing and creating directories raise EACCES."""
    root = os.path.realpath(root)

    def inside(path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(path)).startswith(root)

    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def open_(file, mode="r", *args, **kwargs):
        if inside(file) and set(mode) & set("wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if inside(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)


# --- read-only outputs: one line per stage, nothing written -----------------------------------


def test_ingest_into_a_read_only_directory_is_one_line(tmp_path, monkeypatch, capfd):
    read_only(monkeypatch, tmp_path)
    refused_after_progress(
        capfd,
        "ingest",
        "digits",
        tmp_path / "out",
        "--",
        *IN_MEMORY,
        saying=(str(tmp_path), "permission denied", "fix the permissions"),
    )
    monkeypatch.undo()
    assert not (tmp_path / "out").exists() or snapshot(tmp_path / "out") == {}


def test_train_into_a_read_only_directory_is_one_line(cache, tmp_path, monkeypatch, capfd):
    read_only(monkeypatch, tmp_path)
    refused(capfd, "train", cache, tmp_path / "run", *TRAIN, saying=(str(tmp_path), "permission denied"))
    monkeypatch.undo()
    assert snapshot(tmp_path) == {}


def test_featurize_into_a_read_only_cache_is_one_line(digits, tmp_path, monkeypatch, capfd):
    data, _ = digits
    read_only(monkeypatch, tmp_path)
    refused_after_progress(
        capfd,
        "featurize",
        data,
        "--backbone",
        "scatternet-linear",
        "--cache-dir",
        tmp_path / "c",
        "--",
        *IN_MEMORY,
        saying=(str(tmp_path), "permission denied"),
    )
    monkeypatch.undo()
    assert snapshot(tmp_path) == {}


def test_evaluate_in_a_read_only_run_is_one_line_and_keeps_its_scores(cache, tmp_path, monkeypatch, capfd):
    run = tmp_path / "run"
    ok(capfd, "train", cache, run, *TRAIN)
    ok(capfd, "evaluate", run)
    before = snapshot(run)
    read_only(monkeypatch, run)
    refused(capfd, "evaluate", run, saying=(str(run), "permission denied", "the scores were not saved"))
    monkeypatch.undo()
    assert snapshot(run) == before


# --- a full disk during training: stopped at a checkpoint, resumable ------------------------------


def test_a_full_disk_stops_training_at_its_last_checkpoint_and_says_how_to_resume(cache, tmp_path, monkeypatch, capfd):
    save = Checkpoints.save

    def save_until_full(self, step, state):
        if step > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "checkpoints" / str(step)))
        save(self, step, state)

    monkeypatch.setattr(Checkpoints, "save", save_until_full)
    run = tmp_path / "run"
    refused(
        capfd,
        "train",
        cache,
        run,
        *TRAIN,
        "--checkpoint-every",
        2,
        saying=(
            "no space left on device",
            "its checkpoint of step 2 of 6",
            "free some space",
            f"`dpscale train --resume {run}`",
        ),
    )
    monkeypatch.undo()
    assert (run / CONFIG).is_file()
    result = json.loads(ok(capfd, "train", "--resume", run))
    assert result["steps"] == 6 and json.loads((run / LEDGER).read_text())["steps_done"] == 6


# --- damaged ingested shards: the shard and the command that rebuilds it ------------------------


def _first_train_shard(data) -> str:
    manifest = json.loads((data / "manifest.json").read_text())
    return str(data / manifest["splits"]["train"]["shards"][0]["file"])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
@pytest.mark.parametrize("command", ["train", "featurize"])
def test_a_damaged_shard_is_one_line_naming_it_and_the_rebuild(digits, tmp_path, damage, command, capfd):
    import shutil

    data = tmp_path / "digits"
    shutil.copytree(digits[0], data)
    shard = _first_train_shard(data)
    content = bytearray(open(shard, "rb").read())
    if damage == "truncate":
        content = content[: len(content) // 2]
    else:
        for at in range(len(content) // 3, len(content) // 3 + 64):
            content[at] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(content)
    before = snapshot(data)
    args = (
        ["train", data, tmp_path / "run", *IMAGES]
        if command == "train"
        else ["featurize", data, "--backbone", "scatternet-linear", "--cache-dir", tmp_path / "c", "--", *IN_MEMORY]
    )
    refused_after_progress(
        capfd, *args, saying=(os.path.basename(shard), "damaged", f"`dpscale ingest digits {data}", "--overwrite`")
    )
    assert snapshot(data) == before
    assert not (tmp_path / "run" / CONFIG).exists()


# --- a TFDS dataset that is not prepared ----------------------------------------------------------


def test_an_unprepared_tfds_dataset_is_one_line_and_writes_nothing(tmp_path, capfd):
    pytest.importorskip("tensorflow_datasets")
    (tmp_path / "tfds").mkdir()
    refused_after_progress(
        capfd,
        "ingest",
        "tfds:mnist",
        tmp_path / "out",
        "--tfds-data-dir",
        tmp_path / "tfds",
        saying=("'mnist' is not prepared", "never downloads", "tfds build mnist"),
    )
    assert not (tmp_path / "out").exists() and snapshot(tmp_path / "tfds") == {}


# --- evaluate --data on an images run -------------------------------------------------------------


def test_evaluate_refuses_images_of_other_classes_and_keeps_the_runs_scores(digits, tmp_path, capfd):
    data, trained = digits
    run = tmp_path / "run"
    import shutil

    shutil.copytree(trained, run)
    ok(capfd, "evaluate", run)
    before = snapshot(run)
    ok(capfd, "ingest", "digits", tmp_path / "five", "--classes", "5,6,7,8,9", "--", *IN_MEMORY)
    refused(capfd, "evaluate", run, "--data", tmp_path / "five", saying=("not made like the data", "class_names"))
    assert snapshot(run) == before


def test_evaluate_scores_other_data_only_when_forced_and_never_into_metrics_json(digits, tmp_path, capfd):
    data, trained = digits
    run = tmp_path / "run"
    import shutil

    shutil.copytree(trained, run)
    ok(capfd, "evaluate", run)
    scores = (run / SCORES).read_bytes()
    other = tmp_path / "again"  # the same source ingested with another validation split: other rows
    ok(capfd, "ingest", "digits", other, "--validation-fraction", "0.2", "--", *IN_MEMORY)
    before = snapshot(run)
    refused(
        capfd,
        "evaluate",
        run,
        "--data",
        other,
        saying=("is not the data the run trained on", "--force-other-data", "metrics.json kept"),
    )
    assert snapshot(run) == before
    result = json.loads(ok(capfd, "evaluate", run, "--data", other, "--force-other-data"))
    assert result["other_data"] and result["data"] == os.path.realpath(other)
    assert 0 < result["epsilon"] <= 4 and 0 < result["delta"] < 1
    assert (run / SCORES).read_bytes() == scores and (run / "metrics.other-data.again.json").is_file()
