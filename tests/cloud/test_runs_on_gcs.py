"""Runs, caches and the quickstart with every path on gs://, against a real GCS API server (tests/cloud/conftest.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from click.testing import CliRunner
from PIL import Image

from dpscale import files
from dpscale.cache.feature_store import open_features
from dpscale.cli import cli
from dpscale.stages import featurize, train
from dpscale.training.run_directory import RunDirectory


def _folder_source(root):
    """train/{a,b,c,d}: 12 random 8x8 images each, brightness by class."""
    rng = np.random.default_rng(0)
    for k, cls in enumerate("abcd"):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(12):
            image = np.clip(rng.integers(0, 120, (8, 8)) + 40 * k, 0, 255).astype(np.uint8)
            Image.fromarray(image).save(root / "train" / cls / f"{i}.png")
    return f"folder:{root}"


def _one_error_line(result, *needles):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("dpscale: error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert all(n in errors[0] for n in needles), errors[0]
    return errors[0]


def test_quickstart_with_every_path_on_gcs_then_a_cache_hit_and_a_deleted_chunk(gs_dir, tmp_path, monkeypatch):
    source = _folder_source(tmp_path / "src")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    work = f"{gs_dir}/qs"
    result = CliRunner().invoke(
        cli,
        [
            "quickstart",
            "--data",
            source,
            "--work-dir",
            work,
            "--pretrain-steps",
            "5",
            "--pretrain-batch-size",
            "8",
            "--batch-size",
            "8",
            "--steps",
            "5",
            "--seed",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("run_dir", "pretrain_run_dir", "backbone", "features"):
        assert out[key].startswith(work + "/"), (key, out[key])
    assert not list(cwd.iterdir())  # nothing went to the local disk
    stored = set(files.find(work))
    run = out["run_dir"][len(work) + 1 :]
    for name in ("config.json", "ledger.json", "metrics.jsonl", "metrics.json", "params.sha256.json"):
        assert f"{run}/{name}" in stored, name
    assert f"{run}/seed.json" not in stored and f"{run}/run.lock" not in stored  # finished, released
    assert not [p for p in stored if p.endswith("identity.secret")]  # the cache's key never goes to the bucket
    ledger = json.loads(files.read_text(f"{out['run_dir']}/ledger.json"))
    assert ledger["steps_done"] == 5 and ledger["epsilon_spent"] == out["epsilon"]
    entry = out["features"][len(work) + 1 :]
    assert f"{entry}/COMPLETE" in stored and f"{entry}/dpscale_features.json" in stored
    assert any(p.startswith(f"{out['backbone'][len(work) + 1 :]}/variables/") for p in stored)
    assert [p for p in stored if p.startswith("data/") and p.endswith("/manifest.json")]

    features = open_features(out["features"])
    config = featurize.FeaturizeConfig(data=features.layout.source, backbone=out["backbone"], cache_dir=f"{work}/cache")
    hit = featurize.run(config)
    assert hit.cache_hit and hit.path == out["features"]

    before = features.features("train")[:]
    files.remove(files.join(out["features"], "data.zarr", "train", "features", "c", "0", "0"))
    damaged = CliRunner().invoke(
        cli, ["train", out["features"], f"{gs_dir}/again", "--epsilon", "8", "--steps", "2", "--batch-size", "8"]
    )
    _one_error_line(damaged, "chunk 0 of train/features", "missing", "dpscale featurize")
    assert not files.exists(f"{gs_dir}/again/config.json")
    repaired = featurize.run(config)
    assert not repaired.cache_hit and repaired.chunks_computed == 1
    np.testing.assert_array_equal(open_features(out["features"]).features("train")[:], before)
    assert featurize.run(config).cache_hit


def _train_args(data, run_dir, *, steps, every, seed):
    return [
        "train",
        data,
        run_dir,
        "--epsilon",
        "4",
        "--batch-size",
        "32",
        "--steps",
        str(steps),
        "--learning-rate",
        "0.5",
        "--checkpoint-every",
        str(every),
        "--seed",
        str(seed),
    ]


def test_kill_9_of_a_run_on_gcs_then_resume_gives_the_uninterrupted_result(gs_dir, synthetic_feature_cache):
    data = synthetic_feature_cache(
        f"{gs_dir}/cache", seed=3, sizes={"train": 200, "test": 50}, chunk_rows=64, data_hash_char="c"
    )
    steps, every, seed = 60, 10, 7
    reference = CliRunner().invoke(cli, _train_args(data, f"{gs_dir}/reference", steps=steps, every=every, seed=seed))
    assert reference.exit_code == 0, reference.output

    killed = f"{gs_dir}/killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "dpscale", *_train_args(data, killed, steps=steps, every=every, seed=seed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        done = (
            [int(n) for n in files.listdir(f"{killed}/checkpoints") if n.isdigit()]
            if files.isdir(f"{killed}/checkpoints")
            else []
        )
        if done and max(done) >= 2 * every:
            break
        time.sleep(0.1)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    run = RunDirectory(killed)
    assert not run.has_params and run.read_ledger().steps_done < steps
    assert files.exists(f"{killed}/run.lock")  # left by the killed process: a resume on this host takes it over

    # a lock whose holder still runs (this test process) is refused, in one line
    files.remove(f"{killed}/run.lock")
    assert files.create_exclusive(
        f"{killed}/run.lock", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
    )
    _one_error_line(CliRunner().invoke(cli, ["train", "--resume", killed]), "is in use", str(os.getpid()))
    files.remove(f"{killed}/run.lock")

    resumed = train.run(train.ResumeConfig(killed, show_progress=False))
    assert resumed.steps == steps
    ledger = run.read_ledger()
    assert ledger.steps_done == steps and ledger.finished
    logged = [record["step"] for record in run.read_metrics()]
    assert logged == list(range(1, steps + 1))  # every step exactly once
    assert not files.exists(f"{killed}/run.lock") and not files.exists(f"{killed}/seed.json")
    got, want = run.load_params(), RunDirectory(f"{gs_dir}/reference").load_params()
    for key in ("params", "ema_params"):
        for a, b in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(want[key])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_sweep_on_gcs_writes_its_runs_and_tables_in_the_bucket_and_reuses_them(gs_dir, synthetic_feature_cache):
    data = synthetic_feature_cache(
        f"{gs_dir}/cache", seed=5, sizes={"train": 200, "test": 50}, chunk_rows=64, data_hash_char="d"
    )
    out = f"{gs_dir}/sweep"
    args = [
        "sweep",
        data,
        out,
        "--epsilons",
        "2",
        "--learning-rates",
        "1",
        "--repeats",
        "1",
        "--steps",
        "3",
        "--batch-size",
        "32",
        "--baseline",
    ]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    stored = set(files.find(out))
    for name in ("privacy.json", "runs.csv", "summary.csv", "summary.md", "accuracy_vs_epsilon.png"):
        assert name in stored, (name, sorted(stored))
    baseline = "baseline.NOT-PRIVATE/runs/"
    runs = {p.split("/")[1] for p in stored if p.startswith("runs/")}
    runs = {f"runs/{r}" for r in runs} | {
        baseline + p[len(baseline) :].split("/")[0] for p in stored if p.startswith(baseline)
    }
    assert len(runs) == 2, sorted(stored)  # epsilon 2, and the non-private baseline apart
    assert all(f"{r}/metrics.json" in stored for r in runs)
    stamps = {r: files.filesystem(out).info(f"{out}/{r}/metrics.json")["generation"] for r in runs}
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0, again.output
    assert files.read_text(f"{out}/summary.csv") and stamps == {
        r: files.filesystem(out).info(f"{out}/{r}/metrics.json")["generation"] for r in runs
    }  # reused
