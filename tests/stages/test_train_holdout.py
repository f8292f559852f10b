"""Held-out training rows in images mode, end to end on the bundled digits: as in features mode."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import evaluate, ingest, train
from dpscale.training.config import ImageSettings, TrainingConfig
from dpscale.training.model import build_train_model
from dpscale.training.run_directory import RunDirectory


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data") / "digits")
    ingest.run(ingest.IngestConfig(source="digits", output_dir=out))
    return out


def _training(**overrides):
    base = dict(
        target=PrivacyTarget(epsilon=4.0),
        batch_size=64,
        steps=3,
        microbatch_size=32,
        seed=0,
        show_progress=False,
        images=ImageSettings(augment_pad=1),
    )
    return TrainingConfig(**(base | overrides))


def test_images_holdout_trains_on_the_rest_and_scores_the_held_rows_only_as_a_diagnostic(digits, tmp_path):
    total = IngestedDataset(digits).num_examples("train")
    run = tmp_path / "run"
    train.run(train.TrainConfig(data=digits, run_dir=str(run), training=_training(holdout=100)))
    spec = RunDirectory.existing(str(run)).read_spec()
    assert spec.plan.num_examples == total - 100 and spec.training.holdout == 100
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["sampling_rate"] == pytest.approx(64 / (total - 100))
    (note,) = ledger["not_covered"]
    assert f"rows {total - 100}-{total - 1}" in note and "--holdout 100" in note and "private diagnostics" in note

    with pytest.raises(InvalidConfigError, match="private-diagnostics"):
        evaluate.run(evaluate.EvaluateConfig(run_dir=str(run), split="holdout"))
    assert not (run / "metrics.holdout.NOT-PRIVATE.json").exists()
    held = evaluate.run(evaluate.EvaluateConfig(run_dir=str(run), split="holdout", private_diagnostics=True))
    assert held.num_examples == 100 and not held.covered_by_epsilon
    assert "test_accuracy" not in held.as_dict()  # a held-out score never passes for a test score
    assert held.path.endswith("metrics.holdout.NOT-PRIVATE.json")
    assert os.stat(held.path).st_mode & 0o777 == 0o600 and held.warnings
    assert not (run / "metrics.json").exists()  # the covered scores file holds no held-out score
    test = evaluate.run(evaluate.EvaluateConfig(run_dir=str(run)))
    assert test.covered_by_epsilon and test.num_examples == IngestedDataset(digits).num_examples("test")


def test_the_held_rows_are_the_last_ones_and_never_fed(digits):
    dataset = IngestedDataset(digits)
    total = dataset.num_examples("train")
    model = build_train_model(digits, _training(holdout=40))
    assert model.num_examples == total - 40
    _, held_labels = model.eval_inputs("holdout")
    _, train_labels = model.eval_inputs("train")
    _, stored = dataset.get("train", range(total))
    np.testing.assert_array_equal(held_labels, stored[total - 40 :])
    np.testing.assert_array_equal(train_labels, stored[: total - 40])
    import jax

    feed = model.make_feed(jax.random.key(0))
    feed.split.take(np.array([0, total - 41, -1]))  # trained rows and padding
    with pytest.raises(RuntimeError, match="held-out"):
        feed.split.take(np.array([total - 40]))


def test_holdout_split_without_holdout_and_a_holdout_too_large_are_one_line_errors(digits, tmp_path):
    total = IngestedDataset(digits).num_examples("train")
    with pytest.raises(InvalidConfigError, match="holdout must be in"):
        train.run(train.TrainConfig(data=digits, run_dir=str(tmp_path / "big"), training=_training(holdout=total)))
    assert not (tmp_path / "big").exists()
    train.run(train.TrainConfig(data=digits, run_dir=str(tmp_path / "run"), training=_training(steps=1)))
    with pytest.raises(DataError, match="no split 'holdout'"):
        evaluate.run(evaluate.EvaluateConfig(run_dir=str(tmp_path / "run"), split="holdout", private_diagnostics=True))


def test_train_cli_takes_holdout_in_images_mode(digits, tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "train",
            digits,
            str(tmp_path / "run"),
            "--holdout",
            "50",
            "--batch-size",
            "64",
            "--steps",
            "1",
            "--microbatch-size",
            "32",
            "--epsilon",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    total = IngestedDataset(digits).num_examples("train")
    assert RunDirectory.existing(str(tmp_path / "run")).read_spec().plan.num_examples == total - 50
