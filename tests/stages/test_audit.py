"""The audit has teeth: it catches a broken privatizer and clears the real one."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from sklearn.datasets import load_digits

from dpscale.audit.broken_steps import NoiseOverBTwice, with_parts
from dpscale.audit.canaries import build_data
from dpscale.audit.game import audit_setting
from dpscale.cli import cli
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget
from dpscale.stages import ingest
from dpscale.training.vmapped import TrainingSetup

NUM_EXAMPLES, BATCH, STEPS, DELTA = 200, 50, 20, 1e-5


@pytest.fixture(scope="module")
def digits_data():
    raw = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(raw.target))[:NUM_EXAMPLES]
    return build_data(
        raw.data[order] / 16.0,
        raw.target[order].astype(np.int32),
        num_examples=NUM_EXAMPLES,
        canaries=1,
        kind="ood",
        num_classes=10,
        rng=rng,
    )


@pytest.fixture(scope="module")
def nominal():
    """The plan of nominal epsilon 1, calibrated as `dpscale train` does."""
    return PrivacyPlan.calibrate(PrivacyTarget(1.0, DELTA), num_examples=NUM_EXAMPLES, batch_size=BATCH, steps=STEPS)


def _row(data, plan):
    setup = TrainingSetup(plan=plan, learning_rate=1.0)
    return audit_setting(
        data,
        setup,
        nominal_epsilon=plan.epsilon(),
        delta=DELTA,
        num_models=400,
        confidence=0.999,
        holdout_fraction=0.25,
        seed=3,
    )


def test_broken_privatizer_is_caught(digits_data, nominal):
    row = _row(digits_data, with_parts(nominal, step=NoiseOverBTwice))
    assert row["epsilon_lower_bound"] > row["nominal_epsilon"]
    assert row["violation"] is True
    assert row["advantage"] > row["advantage_bound"]


def test_correct_privatizer_passes(digits_data, nominal):
    row = _row(digits_data, nominal)
    assert row["nominal_epsilon"] <= 1.0
    assert row["epsilon_lower_bound"] <= row["nominal_epsilon"]
    assert row["violation"] is False
    assert row["advantage"] <= row["advantage_bound"]
    assert row["auc"] < 0.75  # the broken run above reaches ~1
    assert row["num_models"] == 400 and row["positives"] == row["negatives"] == 150


@pytest.fixture(scope="module")
def ingested_digits(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data") / "digits")
    ingest.run(ingest.IngestConfig(source="digits", output_dir=out))
    return out


def test_cli_writes_json_and_markdown_with_one_run(ingested_digits, tmp_path):
    out = tmp_path / "audit"
    args = [
        "audit",
        ingested_digits,
        "--out-dir",
        str(out),
        "--epsilon",
        "2",
        "--num-examples",
        "150",
        "--batch-size",
        "30",
        "--steps",
        "5",
        "--num-models",
        "64",
        "--one-run-canaries",
        "40",
        "--canary",
        "mislabelled",
        "--model",
        "mlp",
        "--hidden",
        "8",
        "--seed",
        "0",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "audit.json").read_text())
    (row,) = report["rows"]
    assert row["num_examples"] == 150 and row["num_models"] == 64 and row["model"] == "mlp"
    assert 0 < row["nominal_epsilon"] <= 2.0
    assert 0 <= row["epsilon_lower_bound"] <= row["nominal_epsilon"]
    assert row["one_run_canaries"] == 40 and row["one_run_guesses"] == 8
    assert 0 <= row["one_run_epsilon_lower_bound"] <= row["nominal_epsilon"]
    table = (out / "audit.md").read_text()
    assert table.startswith("| threat model | model | |D| |") and "| black-box | mlp | 150 |" in table
    assert table in result.stderr and len(json.loads(result.stdout)["rows"]) == 1  # stdout: the JSON only
    assert row["estimators"] == {
        "clopper-pearson": row["epsilon_lower_bound"],
        "one-run": row["one_run_epsilon_lower_bound"],
    }
    # 64 models cannot certify epsilon 2 with Clopper-Pearson, and the row says so.
    assert row["cp_max_certifiable_epsilon"] < row["nominal_epsilon"] and row["cp_cannot_detect"]
    assert "cannot detect a violation" in table


@pytest.mark.parametrize("model", ["linear", "cnn"])
def test_cli_white_box_rows_name_their_estimators(ingested_digits, tmp_path, model):
    out = tmp_path / "audit"
    args = [
        "audit",
        ingested_digits,
        "--out-dir",
        str(out),
        "--threat-model",
        "white-box",
        "--model",
        model,
        "--epsilon",
        "4",
        "--num-examples",
        "20",
        "--steps",
        "3",
        "--num-models",
        "400",
        "--seed",
        "0",
    ]
    if model == "cnn":
        args += ["--per-example", "bookkeeping", "--num-models", "40"]
    else:  # the linear row runs on the 4-device sharded step
        args += ["--devices", "4"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "audit.json").read_text())["rows"]
    assert row["threat_model"] == "white-box" and row["batch_size"] == 20 and row["microbatches"] == 2
    assert row["devices"] == (4 if model == "linear" else 1)
    assert set(row["estimators"]) == {"clopper-pearson", "gdp"}
    assert row["gdp_epsilon_lower_bound"] <= row["nominal_epsilon"] and not row["violation"]
    if model == "linear":  # 200 models per side are enough for a bound well above 0
        assert row["gdp_epsilon_lower_bound"] > 1.0
    assert "| white-box |" in result.output


def test_cli_black_box_rejects_several_devices(ingested_digits):
    result = CliRunner().invoke(cli, ["audit", ingested_digits, "--devices", "2"])
    assert result.exit_code == 2
    assert "white-box" in result.output and "Traceback" not in result.output


def test_cli_white_box_rejects_subsampling(ingested_digits):
    result = CliRunner().invoke(
        cli, ["audit", ingested_digits, "--threat-model", "white-box", "--num-examples", "50", "--batch-size", "10"]
    )
    assert result.exit_code == 2
    assert "full batches" in result.output and "Traceback" not in result.output


def test_black_box_full_batch_rows_add_the_gdp_rates_bound(ingested_digits):
    from dpscale.stages import audit

    config = audit.AuditConfig(
        data=ingested_digits,
        epsilons=(4.0,),
        num_examples=40,
        batch_size=40,
        steps=3,
        num_models=200,
        seed=0,
        show_progress=False,
    )
    (row,) = audit.run(config).rows
    assert set(row["estimators"]) == {"clopper-pearson", "gdp-rates"}
    assert 0 <= row["gdp_rates_epsilon_lower_bound"] <= row["nominal_epsilon"] and not row["violation"]


def test_the_sampler_audit_runs_from_the_command_line_on_the_real_sampler(ingested_digits):
    result = CliRunner().invoke(
        cli,
        [
            "audit",
            ingested_digits,
            "--threat-model",
            "sampler",
            "--epsilons",
            "8",
            "--num-examples",
            "59",
            "--batch-size",
            "6",
            "--num-models",
            "200",
            "--confidence",
            "0.95",
            "--seed",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert row["threat_model"] == "sampler" and row["steps"] == 10 and row["num_examples"] == 60
    assert not row["violation"] and row["batch_capacity"] >= 6
