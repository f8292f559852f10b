"""What a run publishes is covered by its epsilon, or opt-in, named NOT-PRIVATE and owner-only.

The attacks of the release-hygiene issue are replayed against the real ``dpscale train``: 20
runs on D and 20 on D plus one canary (a row of NaN features, or a row with a huge gradient).
From the default outputs no attack may reach TPR > FPR + 0.05 at FPR 0; from the opt-in
diagnostics the same attacks succeed, which shows they have teeth.
"""

import json
import re
import stat

import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.errors import DataError
from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import train
from dpscale.training.config import TrainingConfig
from dpscale.training.release import COVERED_STEP_FIELDS, DIAGNOSTICS_FILE
from dpscale.training.run_directory import RunDirectory

from ..conftest import write_feature_cache

ROWS, RUNS = 200, 20


def _base(seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, 16)) * 3
    labels = rng.integers(0, 3, size=ROWS)
    return (centers[labels] + rng.normal(size=(ROWS, 16))).astype(np.float32), labels


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """D, D + a NaN canary, D + a huge-gradient canary (all with the same test split)."""
    root = tmp_path_factory.mktemp("caches")
    x, y = _base()
    test = _base(1)
    canaries = {"nan": np.full((1, 16), np.nan, np.float32), "huge": np.full((1, 16), 1e6, np.float32)}
    entries = {
        "none": write_feature_cache(str(root / "d"), {"train": (x, y), "test": test}, chunk_rows=64, data_hash_char="d")
    }
    for name, row in canaries.items():
        entries[name] = write_feature_cache(
            str(root / name),
            {"train": (np.concatenate([x, row]), np.r_[y, 0]), "test": test},
            chunk_rows=64,
            data_hash_char=name[0],
        )
    return entries


# q = 64/201 and 12 steps: the canary is in some batch with probability 0.99, so the attacks on
# the diagnostics (the teeth check) must find it in nearly every run.
ARGS = [
    "--epsilon",
    "2",
    "--batch-size",
    "64",
    "--steps",
    "12",
    "--microbatch-size",
    "128",
    "--accountant",
    "rdp",
    "--checkpoint-every",
    "12",
]


def _train(entry: str, run_dir, *extra: str):
    result = CliRunner().invoke(cli, ["train", entry, str(run_dir), *ARGS, *extra])
    assert result.exit_code == 0, result.output
    return result


def _default_outputs(run_dir, result) -> dict:
    """Everything a run publishes by default: its files (but the parameters) and what it printed."""
    files = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "ledger.json", "config.json")}
    return files | {"stdout": result.stdout, "stderr": result.stderr}


def _numbers(text: str, field: str) -> list[float]:
    return [float(v) for v in re.findall(rf'"{field}": (-?[0-9.e+-]+|NaN|Infinity)', text)]


def _nan_attack(outputs: dict) -> bool:
    """The NaN canary: a non-finite count, or a NaN anywhere."""
    text = " ".join(outputs.values())
    return "NaN" in text or any(v > 0 for v in _numbers(text, "nonfinite"))


def _huge_attack(outputs: dict) -> float:
    """The huge-gradient canary: the largest mean gradient norm reported (0 if none is)."""
    return max(_numbers(" ".join(outputs.values()), "mean_grad_norm"), default=0.0)


@pytest.fixture(scope="module")
def runs(caches, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, entry in caches.items():
        out[name] = []
        for i in range(RUNS):
            run_dir = root / f"{name}-{i}"
            result = _train(entry, run_dir, "--private-diagnostics")
            diagnostics = (run_dir / DIAGNOSTICS_FILE).read_text()
            out[name].append((_default_outputs(run_dir, result), {"diagnostics": diagnostics}))
    return out


def _tpr_at_fpr_zero(statistic, out_runs, in_runs) -> float:
    threshold = max(statistic(o) for o in out_runs)  # no run without the canary is flagged
    return float(np.mean([statistic(o) > threshold for o in in_runs]))


@pytest.mark.parametrize("canary, attack", [("nan", _nan_attack), ("huge", _huge_attack)])
def test_the_issues_attacks_find_nothing_in_default_outputs_and_everything_in_diagnostics(runs, canary, attack):
    default = {name: [d for d, _ in rs] for name, rs in runs.items()}
    diagnostics = {name: [g for _, g in rs] for name, rs in runs.items()}
    assert _tpr_at_fpr_zero(attack, default["none"], default[canary]) <= 0.05
    assert _tpr_at_fpr_zero(attack, diagnostics["none"], diagnostics[canary]) >= 0.8  # the attack has teeth


def test_default_outputs_hold_only_covered_fields_and_no_secret(caches, tmp_path):
    run_dir = tmp_path / "run"
    result = _train(caches["none"], run_dir, "--seed", str(2**62 + 12345))
    run = RunDirectory(str(run_dir))
    assert {k for line in run.read_metrics() for k in line} <= set(COVERED_STEP_FIELDS)
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(line["final_metrics"]) <= set(COVERED_STEP_FIELDS)
    assert result.stdout.count("\n") == 1 and "loss" not in result.stderr  # progress shows no loss
    assert not (run_dir / DIAGNOSTICS_FILE).exists() and run.read_ledger().not_covered == ()
    # The seed is gone with the run's end, and no file left behind holds it in any form.
    assert not (run_dir / "seed.json").exists() and not run.has_secrets
    seed = 2**62 + 12345
    forms = [
        str(seed).encode(),
        f"{seed:x}".encode(),
        seed.to_bytes(8, "big"),
        seed.to_bytes(8, "little"),
        (seed >> 32).to_bytes(4, "little") + (seed & 0xFFFFFFFF).to_bytes(4, "little"),
    ]
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(form in data for form in forms), path
    again = CliRunner().invoke(cli, ["train", "--resume", str(run_dir)])
    assert again.exit_code == 2 and "finished run" in again.stderr


def test_private_diagnostics_are_named_owner_only_and_announced(caches, tmp_path):
    run_dir = tmp_path / "run"
    result = _train(caches["none"], run_dir, "--private-diagnostics")
    path = run_dir / DIAGNOSTICS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 13)) and {"loss", "mean_grad_norm", "batch_size"} <= set(
        lines[0]
    )
    assert "NOT cover" in result.stderr and DIAGNOSTICS_FILE in result.stderr
    assert DIAGNOSTICS_FILE in " ".join(RunDirectory(str(run_dir)).read_ledger().not_covered)
    assert set(json.loads(result.stdout.strip())["final_metrics"]) <= set(COVERED_STEP_FIELDS)


def test_delta_not_below_one_over_n_warns_and_is_in_the_result_line(caches, tmp_path):
    result = _train(caches["none"], tmp_path / "run", "--delta", "0.01")
    assert "1/num_examples" in result.stderr
    assert any("1/num_examples" in w for w in json.loads(result.stdout.strip())["warnings"])


def test_resume_refuses_other_data_of_the_same_size(tmp_path, monkeypatch):
    """Changed data with the same number of rows would continue the noise stream on other data."""
    import shutil

    def cache(seed):
        return write_feature_cache(
            str(tmp_path / f"cache{seed}"), {"train": _base(seed), "test": _base(1)}, chunk_rows=64, data_hash_char="d"
        )

    data = tmp_path / "data"
    shutil.copytree(cache(0), data)
    # A run killed after its last checkpoint: its secrets are still there, its parameters not yet.
    monkeypatch.setattr(RunDirectory, "delete_secrets", lambda self: None)
    train.run(
        train.TrainConfig(
            str(data),
            str(tmp_path / "run"),
            TrainingConfig(mode="features", target=PrivacyTarget(2.0), batch_size=64, steps=4, show_progress=False),
        )
    )
    shutil.rmtree(tmp_path / "run" / "params")
    shutil.rmtree(data)
    shutil.copytree(cache(7), data)  # other rows, as many, at the same path
    with pytest.raises(DataError, match="changed since the run started"):
        train.run(train.ResumeConfig(str(tmp_path / "run"), show_progress=False))
    shutil.rmtree(data)
    shutil.copytree(cache(0), data)  # the original data again: the resume goes through
    assert train.run(train.ResumeConfig(str(tmp_path / "run"), show_progress=False)).steps == 4


def test_resume_refuses_to_redo_logged_steps_under_other_noise_versions(caches, tmp_path, monkeypatch):
    """A redone step whose update norm was already logged must get the same noise, or it is a second release."""
    import dataclasses
    import shutil

    from dpscale.training.run_directory import noise_versions

    monkeypatch.setattr(RunDirectory, "delete_secrets", lambda self: None)
    run_dir = tmp_path / "run"
    train.run(
        train.TrainConfig(
            caches["none"],
            str(run_dir),
            TrainingConfig(
                mode="features",
                target=PrivacyTarget(2.0),
                batch_size=64,
                steps=4,
                checkpoint_every=2,
                show_progress=False,
            ),
        )
    )
    run = RunDirectory(str(run_dir))
    assert run.read_secrets().versions == noise_versions()
    # A crash after step 4 was logged but before its checkpoint: steps 3-4 are redone from step 2.
    shutil.rmtree(run_dir / "params")
    shutil.rmtree(run_dir / "checkpoints" / "4")
    secrets = run.read_secrets()
    run.write_secrets(dataclasses.replace(secrets, versions={"jax": "0.0.1", "jaxlib": "0.0.1"}))
    with pytest.raises(DataError, match="steps 3-4 .* could differ"):
        train.run(train.ResumeConfig(str(run_dir), show_progress=False))
    run.write_secrets(secrets)  # the versions it started with: the redo is the same computation
    assert train.run(train.ResumeConfig(str(run_dir), show_progress=False)).steps == 4
