"""export-backbone: a finished image run becomes a backbone whose features are the run's own."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cache import feature_store as fstore
from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError
from dpscale.models import pretrained
from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import export_backbone as stage
from dpscale.stages import featurize, ingest, train
from dpscale.training.config import ImageSettings, TrainingConfig
from dpscale.training.model import build_train_model
from dpscale.training.run_directory import LEDGER, PARAMS, RunDirectory

IN_MEMORY = ("--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    data = str(root / "digits")
    ingest.run(ingest.IngestConfig("digits", data, classes=("0", "1", "2"), pipeline_args=IN_MEMORY))
    common = dict(
        batch_size=64,
        steps=4,
        microbatch_size=32,
        images=ImageSettings(augment_pad=1),
        seed=0,
        checkpoint_every=4,
        show_progress=False,
    )
    dp = train.run(train.TrainConfig(data, str(root / "dp"), TrainingConfig(target=PrivacyTarget(4.0), **common)))
    public = train.run(
        train.TrainConfig(
            data,
            str(root / "public"),
            TrainingConfig(target=PrivacyTarget(math.inf), momentum=0.9, learning_rate=0.1, **common),
        )
    )
    return {"root": root, "data": data, "dp": dp, "public": public}


def test_exported_backbone_reproduces_the_runs_features_and_logits(runs):
    root, run_dir = runs["root"], runs["dp"].run_dir
    result = stage.run(stage.ExportBackboneConfig(run_dir, str(root / "bb")))
    assert result.private and result.epsilon == runs["dp"].epsilon and result.parameters == "ema"
    meta = result.metadata
    assert meta.model == "cnn-small" and meta.num_classes == 3
    assert meta.preprocessing.resolution == 8 and "(" in meta.source and run_dir in meta.source

    trained = RunDirectory(run_dir).load_params()
    model, variables, prep = pretrained.load_pretrained(str(root / "bb"))
    same = jax.tree.map(np.array_equal, variables["params"], trained["ema_params"])
    assert all(jax.tree.leaves(same))

    # The run's own model on its own (training-time) preprocessing of the test split.
    spec = RunDirectory(run_dir).read_spec()
    run_model = build_train_model(spec.data, spec.training)
    inputs, labels = run_model.eval_inputs("test")
    run_logits = run_model.logits_fn(trained["ema_params"], {}, inputs)
    run_features = model.apply({"params": trained["ema_params"]}, inputs, method="features")

    # The exported backbone through the featurize stage (raw pixels -> its preprocessing).
    entry = featurize.run(
        featurize.FeaturizeConfig(
            runs["data"], str(root / "bb"), cache_dir=str(root / "cache"), pipeline_args=IN_MEMORY
        )
    )
    store = fstore.open_features(entry.path)
    np.testing.assert_array_equal(store.labels("test"), labels)
    np.testing.assert_allclose(store.features("test")[:], np.asarray(run_features), rtol=1e-5, atol=1e-5)
    with IngestedDataset(runs["data"]) as ds:
        images = ds.split_images("test")
    np.testing.assert_allclose(
        np.asarray(model.apply(variables, prep(images))), np.asarray(run_logits), rtol=1e-5, atol=1e-5
    )


def test_cli_last_iterate_and_non_private_warning(runs, tmp_path):
    run_dir = runs["public"].run_dir
    out = CliRunner().invoke(cli, ["export-backbone", run_dir, str(tmp_path / "bb"), "--last"])
    assert out.exit_code == 0, out.output
    assert "no privacy guarantee" in out.stderr and "last parameters" in out.stderr
    line = json.loads(out.stdout)  # exactly one JSON line on stdout, like every command
    assert out.stdout.count("\n") == 1
    assert line["parameters"] == "last" and line["private"] is False and line["epsilon"] == "inf"
    assert line["output_dir"] == str(tmp_path / "bb") and line["model"] == "cnn-small"
    trained = RunDirectory(run_dir).load_params()
    meta = pretrained.read_metadata(str(tmp_path / "bb"))
    assert meta.weights_sha256 == pretrained.variables_sha256({"params": trained["params"]}) == line["weights_sha256"]
    assert meta.weights_sha256 != pretrained.variables_sha256({"params": trained["ema_params"]})
    assert "NON-PRIVATE" in meta.source
    again = CliRunner().invoke(cli, ["export-backbone", run_dir, str(tmp_path / "bb")])
    assert again.exit_code == 2 and "--force" in again.stderr


def test_refuses_unfinished_and_features_mode_runs(runs, tmp_path):
    killed = tmp_path / "killed"  # what a killed run leaves: a ledger short of its plan, no params/
    shutil.copytree(runs["dp"].run_dir, killed)
    shutil.rmtree(killed / PARAMS)
    ledger = json.loads((killed / LEDGER).read_text())
    (killed / LEDGER).write_text(json.dumps(ledger | {"steps_done": 2}))
    with pytest.raises(DataError, match="not finished.*--resume"):
        stage.run(stage.ExportBackboneConfig(str(killed), str(tmp_path / "a")))

    entry = featurize.run(
        featurize.FeaturizeConfig(
            runs["data"], str(_exported(runs)), pipeline_args=IN_MEMORY, cache_dir=str(runs["root"] / "cache")
        )
    )
    features_run = train.run(
        train.TrainConfig(
            entry.path,
            str(tmp_path / "f"),
            TrainingConfig(
                mode="features",
                target=PrivacyTarget(4.0),
                batch_size=64,
                steps=1,
                microbatch_size=64,
                show_progress=False,
            ),
        )
    )
    result = CliRunner().invoke(cli, ["export-backbone", features_run.run_dir, str(tmp_path / "b")])
    assert result.exit_code == 2 and "features-mode" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _exported(runs):
    path = runs["root"] / "bb-for-features"
    if not pretrained.is_complete(path):
        stage.run(stage.ExportBackboneConfig(runs["dp"].run_dir, str(path)))
    return path
