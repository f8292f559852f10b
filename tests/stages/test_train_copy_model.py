"""train-copy-model on a tiny ingested dataset: what it writes and records, and its errors."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dpscale.cli import cli
from dpscale.dedup import copy_model
from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages import train_copy_model as stage
from dpscale.stages.ingest import IngestConfig
from dpscale.stages.ingest import run as ingest

FAST = ("--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy")
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("test", 4)):
        for i in range(n):
            path = root / "src" / split / "a" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    out = root / "public"
    ingest(IngestConfig(f"folder:{root / 'src'}", str(out), pipeline_args=FAST))
    return str(out)


def test_writes_a_loadable_model_that_records_its_training_data(public, tmp_path):
    res = stage.run(
        stage.TrainCopyModelConfig(
            public, str(tmp_path / "m"), splits=("train",), epochs=1, batch=4, show_progress=False
        )
    )
    saved = copy_model.load(res.output_dir)
    params, info = saved.params, saved.info
    assert info["public"]["splits"] == ["train"] and info["images"] == 12 and info["steps"] == 3
    from dpscale.data.dataset import IngestedDataset

    assert saved.trained_on.tolist() == sorted(IngestedDataset(public).ids("train").tolist())
    manifest = json.load(open(os.path.join(public, "manifest.json")))
    assert info["public"]["content_hash"] == manifest["content_hash"]
    assert sorted(os.listdir(res.output_dir)) == sorted(
        [copy_model.INFO, copy_model.WEIGHTS, copy_model.TRAINED_ON]
    )  # no work left
    assert copy_model.embed(params, np.zeros((2, 32, 32, 3), np.uint8)).shape == (2, 128)
    with pytest.raises(DataError, match="already holds a copy model"):
        stage.run(stage.TrainCopyModelConfig(public, res.output_dir, epochs=1, batch=4, show_progress=False))


def test_too_few_images_and_bad_settings_are_clear_errors(public, tmp_path):
    with pytest.raises(DataError, match="fewer than one training batch"):
        stage.run(stage.TrainCopyModelConfig(public, str(tmp_path / "m"), splits=("test",), batch=8))
    with pytest.raises(DataError, match="split 'nope'"):
        stage.run(stage.TrainCopyModelConfig(public, str(tmp_path / "m"), splits=("nope",), batch=8))
    with pytest.raises(InvalidConfigError):
        stage.TrainCopyModelConfig(public, str(tmp_path / "m"), epochs=0)
    with pytest.raises(DataError, match="different directory from the public dataset"):
        stage.run(stage.TrainCopyModelConfig(public, public + "/", batch=4))


def test_cli_says_what_the_model_is_derived_from(public, tmp_path):
    result = CliRunner().invoke(
        cli, ["train-copy-model", public, str(tmp_path / "m"), "--splits", "train", "--epochs", "1", "--batch", "4"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "derived from" in result.output and "(train)" in result.output and "never train it on private" in result.output
    )
    assert json.loads(result.output.strip().splitlines()[-1])["output_dir"] == str(tmp_path / "m")


def test_cli_errors_are_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(cli, ["train-copy-model", str(tmp_path / "missing"), str(tmp_path / "m")])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
