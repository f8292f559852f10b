"""Fault injection through the real CLI: damaged caches and run directories, moved runs, two processes.

Every case either behaves correctly or is refused with exit code 2 and one line on stderr,
never a traceback.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpscale.cache import feature_store as fstore
from dpscale.cli import cli
from dpscale.training.checkpoints import Checkpoints
from dpscale.training.run_directory import CONFIG, LEDGER, PARAMS, PARAMS_DIGESTS, SCORES

from ..conftest import write_feature_cache, write_synthetic_feature_cache
from .advice import check_advice

SIZES = {"train": 300, "test": 100}
TRAIN = ["--epsilon", "4", "--batch-size", "64", "--steps", "6"]


def dpscale(capfd, *args):
    """Run the console script's group in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli.main([str(a) for a in args], prog_name="dpscale")
    out, err = capfd.readouterr()
    return info.value.code, out, err


def ok(capfd, *args):
    code, out, err = dpscale(capfd, *args)
    assert code == 0, err
    return out


def featurized(capfd, *args) -> dict:
    """``dpscale featurize``'s result: the one JSON line on stdout."""
    return json.loads(ok(capfd, *args))


def refused(capfd, *args, saying=()):
    """The command exits 2 with one ``dpscale: error:`` line containing every string of ``saying``, whose
    advice names commands and flags that exist (``check_advice``).

    Progress lines (dated, e.g. ``12:00:00 train: 0/6, compiling the DP step ...``) may come before it:
    they say what was under way, not what went wrong.
    """
    code, out, err = dpscale(capfd, *args)
    lines = [line for line in err.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d ", line)]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dpscale: error: "), err
    assert "Traceback" not in err and out == ""
    for text in (saying,) if isinstance(saying, str) else saying:
        assert text in lines[0], lines[0]
    check_advice(lines[0])  # what it tells the user to type exists
    return lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A pristine synthetic cache entry (copied by each test that damages it)."""
    return write_synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")), seed=0, sizes=SIZES, chunk_rows=64, data_hash_char="f"
    )


@pytest.fixture
def entry(cache, tmp_path):
    """A copy of the cache entry, at the same digest name, that the test may damage."""
    copy = tmp_path / "cache" / os.path.basename(cache)
    shutil.copytree(cache, copy)
    return str(copy)


@pytest.fixture(scope="module")
def finished(cache, tmp_path_factory):
    """A finished features-mode run on ``cache`` (copied by each test that damages it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    code = train_in_process(cache, run)
    assert code == 0
    return run


def train_in_process(data, run, *extra):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", str(data), str(run), *TRAIN, *extra], prog_name="dpscale")
    return info.value.code


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def chunk_file(entry, split, array, chunk):
    return os.path.join(entry, fstore.DATA, split, array, "c", str(chunk), *(["0"] if array != "labels" else []))


def flip_byte(path, at=20):
    data = bytearray(open(path, "rb").read())
    data[min(at, len(data) - 1)] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


# --- 1. the feature cache ------------------------------------------------------------------


def test_a_deleted_features_chunk_is_refused_naming_it_and_the_repair(entry, tmp_path, capfd):
    os.remove(chunk_file(entry, "train", "features", 2))
    refused(
        capfd,
        "train",
        entry,
        tmp_path / "r",
        *TRAIN,
        saying=("chunk 2 of train/features (rows 128-191) is missing", "dpscale featurize"),
    )
    assert not os.path.exists(tmp_path / "r" / CONFIG)


def test_a_deleted_labels_chunk_is_refused_not_read_as_minus_one(entry, tmp_path, capfd):
    os.remove(chunk_file(entry, "train", "labels", 4))
    refused(capfd, "train", entry, tmp_path / "r", *TRAIN, saying="chunk 4 of train/labels (rows 256-299) is missing")


def test_a_chunk_replaced_by_a_directory_is_refused_not_read_as_nan(entry, tmp_path, capfd):
    """B21: zarr reads a chunk it cannot open as the fill value; every recorded chunk must be a file."""
    path = chunk_file(entry, "train", "features", 1)
    os.remove(path)
    os.mkdir(path)
    refused(
        capfd,
        "train",
        entry,
        tmp_path / "r",
        *TRAIN,
        saying=("chunk 1 of train/features (rows 64-127) is not a file", f"--repair {entry}"),
    )
    assert not os.path.exists(tmp_path / "r" / CONFIG)


def test_another_chunks_valid_bytes_in_its_place_are_refused(tmp_path, capfd):
    """A chunk that decodes, and passes its CRC32C, but is not the chunk written there (of the same size)."""
    rng = np.random.default_rng(0)
    labels = {"train": np.repeat([1, 2, 0, 1, 2], 64)[:300], "test": np.arange(100) % 3}
    splits = {split: (rng.normal(size=(len(y), 16)), y) for split, y in labels.items()}
    entry = write_feature_cache(str(tmp_path / "c"), splits, chunk_rows=64, data_hash_char="f")
    shutil.copyfile(chunk_file(entry, "train", "labels", 0), chunk_file(entry, "train", "labels", 1))
    refused(capfd, "train", entry, tmp_path / "r", *TRAIN, saying="chunk 1 of train/labels (rows 64-127) is corrupt")
    fs = fstore.open_features(entry)  # the sizes are alike: opening stats only; the read is what finds it
    with pytest.raises(fstore.DataError, match="not the bytes written: its sha256 differs"):
        fs.labels("train")


def test_corrupt_bytes_fail_their_checksum_instead_of_decoding(entry, run, capfd):
    flip_byte(chunk_file(entry, "test", "features", 1))
    scores = (run / SCORES).read_text() if (run / SCORES).exists() else None
    refused(
        capfd,
        "evaluate",
        run,
        "--data",
        entry,
        saying=("chunk 1 of test/features (rows 64-99) is corrupt", "sha256 differs", "dpscale featurize"),
    )
    assert ((run / SCORES).read_text() if (run / SCORES).exists() else None) == scores


def test_opening_checks_presence_and_reads_check_checksums(entry):
    """Opening costs one existence check per chunk; a corrupt chunk is caught when it is read."""
    flip_byte(chunk_file(entry, "train", "ids", 0))
    fs = fstore.open_features(entry)
    assert fs.features("train")[:].shape == (300, 16)
    with pytest.raises(fstore.DataError, match="chunk 0 of train/ids .* is corrupt"):
        fs.ids("train")
    with pytest.raises(fstore.DataError, match="chunk 0 of train/ids"):
        fstore.open_features(entry, verify=True)


IN_MEMORY = ("--direct_num_workers=1", "--direct_running_mode=in_memory")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Ingested digits and a tiny random-weight CNN backbone at 12 px."""
    import jax
    import jax.numpy as jnp

    from dpscale.models import pretrained, registry
    from dpscale.stages import ingest

    root = tmp_path_factory.mktemp("digits")
    ingest.run(ingest.IngestConfig("digits", str(root / "digits"), pipeline_args=IN_MEMORY))
    model = registry.get_model("cnn-small", num_classes=10)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 12, 12, 1)))
    pretrained.save_pretrained(
        str(root / "bb"),
        variables,
        model="cnn-small",
        num_classes=10,
        preprocessing=pretrained.Preprocessing(resolution=12, mean=(8.0,), std=(4.0,)),
    )
    return str(root / "digits"), str(root / "bb")


def test_featurize_repairs_only_the_damaged_chunks_and_is_no_cache_hit_on_damage(digits, tmp_path, capfd):
    data, backbone = digits
    args = [
        "featurize",
        data,
        "--backbone",
        backbone,
        "--cache-dir",
        tmp_path / "c",
        "--chunk-rows",
        512,
        "--",
        *IN_MEMORY,
    ]
    path = featurized(capfd, *args)["path"]
    whole = fstore.open_features(path)
    before = {s: (whole.features(s)[:], whole.labels(s)) for s in whole.splits}
    assert featurized(capfd, *args)["cache_hit"]
    os.remove(chunk_file(path, "train", "labels", 1))
    flip_byte(chunk_file(path, "train", "features", 2))
    message = refused(capfd, "train", path, tmp_path / "r", *TRAIN)
    repair = message.split("`")[1]  # the command the message gives repairs the entry, from any directory
    assert repair.startswith("dpscale featurize ") and os.path.abspath(data) in repair
    out = featurized(capfd, *repair.split()[1:], "--", *IN_MEMORY)
    assert not out["cache_hit"] and (out["chunks_computed"], out["chunks_total"]) == (2, 4)
    repaired = fstore.open_features(path, verify=True)
    for split, (features, labels) in before.items():
        np.testing.assert_array_equal(repaired.features(split)[:], features)
        np.testing.assert_array_equal(repaired.labels(split), labels)
    assert featurized(capfd, *args)["cache_hit"]


def test_a_copied_entry_is_repaired_in_place_and_an_older_one_gets_its_digests(digits, tmp_path, capfd):
    """The repair command in the error repairs the entry it names, even a copy in another cache (whose own
    secret would key the data otherwise: featurize into that cache made a second entry, the copy stayed
    damaged); an entry made before chunk digests gets them recorded without recomputing anything."""
    data, backbone = digits
    args = ["featurize", data, "--backbone", backbone, "--chunk-rows", 512, "--", *IN_MEMORY]
    original = featurized(capfd, *args[:4], "--cache-dir", tmp_path / "a", *args[4:])["path"]
    copy = str(tmp_path / "b" / os.path.basename(original))
    shutil.copytree(original, copy)
    path = chunk_file(copy, "train", "features", 1)
    os.remove(path)
    os.mkdir(path)
    repair = refused(capfd, "train", copy, tmp_path / "r", *TRAIN, saying="is not a file").split("`")[1]
    assert repair == f"dpscale featurize {data} --backbone {backbone} --repair {copy}"
    out = featurized(capfd, *repair.split()[1:], "--", *IN_MEMORY)
    assert out["path"] == copy and (out["chunks_computed"], out["chunks_total"]) == (1, 4)
    assert os.listdir(tmp_path / "b") == [os.path.basename(original)]  # no second entry
    repaired, whole = fstore.open_features(copy, verify=True), fstore.open_features(original)
    np.testing.assert_array_equal(repaired.features("train")[:], whole.features("train")[:])
    # An entry of an older dpscale: no digests sealed, markers without them.
    os.remove(os.path.join(copy, "chunk_digests.json"))
    for marker in Path(copy, fstore.MARKERS).rglob("*.done"):
        marker.write_text("old marker\n")
    refused(capfd, "train", copy, tmp_path / "r", *TRAIN, saying=("records no chunk digests", f"--repair {copy}"))
    out = featurized(capfd, *repair.split()[1:], "--", *IN_MEMORY)
    assert (out["chunks_computed"], out["cache_hit"]) == (0, False)
    assert featurized(capfd, *repair.split()[1:], "--", *IN_MEMORY)["cache_hit"]
    # Not the data the entry was made from: refused, nothing written.
    other = str(tmp_path / "other")
    ok(capfd, "ingest", "digits", other, "--classes", "0,1", "--", *IN_MEMORY)
    refused(capfd, "featurize", other, "--backbone", backbone, "--repair", copy, saying="is not the data")
    refused(capfd, *repair.split()[1:], "--chunk-rows", 64, saying="keeps the entry's own key, preprocessing and")


# --- 2. evaluate on features made otherwise ---------------------------------------------------


@pytest.mark.parametrize("other", [{"weights_sha256": "v" * 64}, {"resolution": 16}])
def test_evaluate_refuses_features_of_another_backbone_or_preprocessing(run, tmp_path, other, capfd):
    elsewhere = write_synthetic_feature_cache(
        str(tmp_path / "other"), seed=0, sizes=SIZES, chunk_rows=64, data_hash_char="f", **other
    )
    scores = (run / SCORES).read_bytes() if (run / SCORES).exists() else None
    refused(
        capfd,
        "evaluate",
        run,
        "--data",
        elsewhere,
        saying=("not made like the data the run trained on", next(iter(other))),
    )
    assert ((run / SCORES).read_bytes() if (run / SCORES).exists() else None) == scores
    # the same backbone and preprocessing on other rows is scored when asked to, never into metrics.json
    same = write_synthetic_feature_cache(str(tmp_path / "same"), seed=5, sizes=SIZES, chunk_rows=64, data_hash_char="g")
    refused(capfd, "evaluate", run, "--data", same, saying=("is not the data the run trained on", "--force-other-data"))
    assert json.loads(ok(capfd, "evaluate", run, "--data", same, "--force-other-data"))["num_examples"] == 100
    assert ((run / SCORES).read_bytes() if (run / SCORES).exists() else None) == scores


# --- 3. relocatable run directories, 4. the lock, 6. the resume hint --------------------------


def interrupt_after_first_checkpoint(monkeypatch):
    """Make the next training raise KeyboardInterrupt (Ctrl-C) right after its first checkpoint."""
    save = Checkpoints.save

    def save_then_interrupt(self, step, state):
        save(self, step, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpoints, "save", save_then_interrupt)


def test_a_moved_run_resumes_in_place_from_another_directory(cache, tmp_path, monkeypatch, capfd):
    runs = tmp_path / "r"
    monkeypatch.chdir(tmp_path)
    interrupt_after_first_checkpoint(monkeypatch)
    relative = os.path.relpath(cache, tmp_path)
    code, _, err = dpscale(capfd, "train", relative, "r/A", *TRAIN, "--checkpoint-every", 2)
    assert code == 130 and "dpscale train --resume r/A" in err and "Traceback" not in err
    monkeypatch.undo()
    assert (runs / "A" / "checkpoints" / "2").is_dir()
    assert json.loads((runs / "A" / CONFIG).read_text())["data"] == cache  # absolute
    (runs / "A").rename(runs / "Aold")
    monkeypatch.chdir(tmp_path)
    ok(capfd, "train", relative, "r/A", *TRAIN, "--steps", 3)
    fresh = (runs / "A" / LEDGER).read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = json.loads(ok(capfd, "train", "--resume", runs / "Aold"))
    assert result["run_dir"] == str(runs / "Aold") and result["steps"] == 6
    assert json.loads((runs / "Aold" / LEDGER).read_text())["steps_done"] == 6
    assert (runs / "A" / LEDGER).read_text() == fresh  # the new run in r/A is untouched
    assert json.loads(ok(capfd, "evaluate", runs / "Aold"))["num_examples"] == 100


def test_a_run_with_a_relative_data_path_says_so_from_another_directory(run, tmp_path, monkeypatch, capfd):
    spec = json.loads((run / CONFIG).read_text())
    spec["data"] = "cache/entry"  # what an older dpscale stored
    (run / CONFIG).write_text(json.dumps(spec))
    monkeypatch.chdir(tmp_path)
    refused(capfd, "evaluate", run, saying=("relative path", "run the command from the directory"))


def test_a_second_process_is_refused_while_one_trains(run, capfd):
    from dpscale.training.run_directory import RunDirectory

    Path(RunDirectory(str(run)).secrets_file).write_text("{}")  # (resumable as far as the lock check can tell)
    with RunDirectory(str(run)).lock():
        refused(capfd, "train", "--resume", run, saying=("is in use", "another process"))


def test_the_lock_is_released_when_its_process_is_killed(run, tmp_path):
    from dpscale.training.run_directory import RunDirectory

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\nfrom dpscale.training.run_directory import RunDirectory\n"
                f"lock = RunDirectory({str(run)!r}).lock()\nprint('locked', flush=True)\ntime.sleep(600)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(fstore.DataError, match=f"pid {holder.pid}"):
            RunDirectory(str(run)).lock()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    RunDirectory(str(run)).lock().release()  # no stale lock after kill -9


# --- 5. a start that fails validation leaves nothing behind ------------------------------------


@pytest.mark.parametrize("bad", [["--clip-norm", "0"], ["--microbatch-size", "3"]])  # 3 rows on 4 devices
def test_a_start_that_fails_validation_leaves_no_run_behind(cache, tmp_path, bad, capfd):
    target = tmp_path / "r"
    refused(capfd, "train", cache, target, *TRAIN, *bad)
    assert not (target / CONFIG).exists() and not (target / "key.id").exists()
    ok(capfd, "train", cache, target, *TRAIN)  # the directory is free for a run


# --- 6. evaluate on a damaged run -----------------------------------------------------------


def _truncate(run):
    (run / CONFIG).write_text((run / CONFIG).read_text()[:100])


def _unknown_top_key(run):
    spec = json.loads((run / CONFIG).read_text())
    (run / CONFIG).write_text(json.dumps(spec | {"surprise": 1}))


def _unknown_training_key(run):
    spec = json.loads((run / CONFIG).read_text())
    spec["training"]["surprise"] = 1
    (run / CONFIG).write_text(json.dumps(spec))


def _corrupt_param_files(run):
    for folder, _, names in os.walk(run / PARAMS):
        for name in names:
            if os.path.getsize(os.path.join(folder, name)) > 16:
                flip_byte(os.path.join(folder, name), at=8)


def _delete_a_param_file(run):
    os.remove(run / PARAMS / "manifest.ocdbt")


def _corrupt_digests(run):
    (run / PARAMS_DIGESTS).write_text("{")


DAMAGE = {
    "truncated config.json": (_truncate, "unreadable config.json"),
    "unknown key": (_unknown_top_key, "unknown keys ['surprise']"),
    "unknown training key": (_unknown_training_key, "surprise"),
    "corrupt params": (_corrupt_param_files, "saved parameters are damaged"),
    "deleted params file": (_delete_a_param_file, "params/manifest.ocdbt is missing"),
    "corrupt params digests": (_corrupt_digests, PARAMS_DIGESTS),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_evaluate_on_a_damaged_run_is_one_line(run, case, capfd):
    damage, saying = DAMAGE[case]
    damage(run)
    refused(capfd, "evaluate", run, saying=saying)


def test_a_run_without_parameters_suggests_resuming_it(run, capfd):
    shutil.rmtree(run / PARAMS)
    from dpscale.training.run_directory import RunDirectory

    Path(RunDirectory(str(run)).secrets_file).write_text("{}")  # an unfinished run still has its seed
    refused(capfd, "evaluate", run, saying=("has no saved parameters", f"dpscale train --resume {run}"))


# --- 7. accounting answers in bounded time ------------------------------------------------------


def test_epsilon_at_a_tiny_noise_multiplier_answers_in_seconds(capfd):
    started = time.perf_counter()
    out = ok(
        capfd,
        "epsilon",
        "--noise-multiplier",
        "1e-3",
        "--steps",
        "1000",
        "--batch-size",
        "256",
        "--num-examples",
        "50000",
        "--delta",
        "1e-5",
        "--json",
    )
    assert time.perf_counter() - started < 30  # ~2 s unloaded; generous for a shared machine
    assert np.isfinite(json.loads(out)["epsilon"])


def test_export_backbone_of_a_moved_image_run_from_another_directory(digits, tmp_path, monkeypatch, capfd):
    data, _ = digits
    monkeypatch.chdir(os.path.dirname(data))
    ok(
        capfd,
        "train",
        os.path.basename(data),
        tmp_path / "img",
        "--epsilon",
        4,
        "--batch-size",
        64,
        "--steps",
        2,
        "--microbatch-size",
        32,
        "--augment-pad",
        1,
    )
    (tmp_path / "img").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    out = ok(capfd, "export-backbone", "moved", "bb")
    assert json.loads(out)["model"] == "cnn-small" and (tmp_path / "bb").is_dir()
    before = (tmp_path / "bb" / "dpscale_backbone.json").read_bytes()
    line = refused(capfd, "export-backbone", "moved", "bb", saying="already holds a backbone: add --force")
    assert "force=True" not in line  # it said `pass force=True (--force)`
    assert json.loads(ok(capfd, "export-backbone", "moved", "bb", "--force", "--last"))["parameters"] == "last"
    assert (tmp_path / "bb" / "dpscale_backbone.json").read_bytes() != before
