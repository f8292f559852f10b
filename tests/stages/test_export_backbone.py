"""export-backbone: a finished image run becomes a backbone whose features are the run's own."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
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


# -- runs above a cut: the top joined to the frozen part below it ------------------------------------------


def _random_lite(path):
    """A Lite0 backbone with random weights and BatchNorm statistics (nothing downloaded), at 32 px."""
    model = pretrained.build_model("efficientnet-lite0", num_classes=4)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    moved = [leaf + 0.05 * jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves)]
    variables = treedef.unflatten(moved)
    variables["batch_stats"] = jax.tree.map(jnp.abs, variables["batch_stats"])  # variances stay positive
    prep = pretrained.Preprocessing(resolution=32, mean=(120.0, 115.0, 100.0), std=(60.0, 62.0, 64.0))
    pretrained.save_pretrained(path, variables, model="efficientnet-lite0", num_classes=4, preprocessing=prep,
                               source="random weights for a test")  # fmt: skip
    return str(path)


def _cut_run(runs, root, backbone, cut, **images):
    entry = featurize.run(
        featurize.FeaturizeConfig(
            runs["data"], backbone, cache_dir=str(root / "cut-cache"), cut=cut, pipeline_args=IN_MEMORY
        )
    ).path
    config = TrainingConfig(
        mode="activations",
        target=PrivacyTarget(4.0),
        batch_size=64,
        steps=3,
        microbatch_size=32,
        learning_rate=1.0,
        seed=0,
        show_progress=False,
        images=ImageSettings(**images),
    )
    return train.run(train.TrainConfig(entry, str(root / f"run-{cut}-{images.get('model', '')}"), config))


@pytest.fixture(scope="module")
def cut_runs(runs):
    root = runs["root"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPSCALE_WEIGHTS_DIR", str(root / "weights"))
        lite = _cut_run(runs, root, _random_lite(root / "lite"), "blocks_14")
        scatter = _cut_run(runs, root, "scatternet-linear", "scattering", model="cnn")
        yield {"lite": lite, "scatter": scatter, "weights": str(root / "weights")}


def _train_accepts(data, backbone):
    """``train --backbone`` builds its model on the export (checked for DP, sized) and starts from its weights."""
    config = TrainingConfig(batch_size=32, steps=1, microbatch_size=16, show_progress=False,
                            images=ImageSettings(backbone=backbone))  # fmt: skip
    model = build_train_model(data, config)
    _, variables, _ = pretrained.load_pretrained(backbone)
    assert model.num_classes == 3
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, model.init_params(0), variables["params"])))


def _same_logits(result, run_dir, data, which):
    """Cached activations of the test split -> the run's top, vs the test images -> the exported network."""
    spec = RunDirectory(run_dir).read_spec()
    trained = RunDirectory(run_dir).load_params()
    run_model = build_train_model(spec.data, spec.training)
    activations, labels = run_model.eval_inputs("test")
    top_logits = run_model.logits_fn(trained[which], trained.get("model_state") or {}, activations)
    model, variables, prep = pretrained.load_pretrained(result.output_dir)
    with IngestedDataset(data) as ds:
        images = ds.split_images("test")
    np.testing.assert_allclose(np.asarray(model.apply(variables, prep(images))), np.asarray(top_logits),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    return model, variables


def test_a_lite_top_exports_joined_to_the_backbones_own_weights_below_the_cut(runs, cut_runs, tmp_path):
    run_dir = cut_runs["lite"].run_dir
    ema = stage.run(stage.ExportBackboneConfig(run_dir, str(tmp_path / "ema")))
    last = stage.run(stage.ExportBackboneConfig(run_dir, str(tmp_path / "last"), parameters="last"))
    assert ema.private and ema.epsilon == cut_runs["lite"].epsilon and ema.metadata.model == "efficientnet-lite0"
    assert ema.metadata.num_classes == 3 and ema.metadata.preprocessing.resolution == 32
    assert "below it: the pretrained backbone's own layers, unchanged" in ema.metadata.source
    assert "random weights for a test" in ema.metadata.source and "'blocks_14'" in ema.metadata.source
    _, ema_vars = _same_logits(ema, run_dir, runs["data"], "ema_params")
    _, last_vars = _same_logits(last, run_dir, runs["data"], "params")
    assert ema.metadata.weights_sha256 != last.metadata.weights_sha256

    # Below the cut, and every BatchNorm statistic: the backbone's own values; above it: the run's.
    _, backbone, _ = pretrained.load_pretrained(str(runs["root"] / "lite"))
    trained = RunDirectory(run_dir).load_params()
    for name, block in ema_vars["params"]["backbone"].items():
        expected = trained["ema_params"]["backbone"].get(name, backbone["params"]["backbone"][name])
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, block, expected))), name
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, ema_vars["batch_stats"], backbone["batch_stats"])))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, last_vars["params"]["head"], trained["params"]["head"])))

    _train_accepts(runs["data"], ema.output_dir)
    # featurize accepts it: its pooled features are the exported network's own.
    entry = featurize.run(
        featurize.FeaturizeConfig(
            runs["data"], ema.output_dir, cache_dir=str(tmp_path / "cache"), pipeline_args=IN_MEMORY
        )
    )
    model, variables, prep = pretrained.load_pretrained(ema.output_dir)
    with IngestedDataset(runs["data"]) as ds:
        images = ds.split_images("test")
    np.testing.assert_allclose(fstore.open_features(entry.path).features("test")[:],
                               np.asarray(model.apply(variables, prep(images), method="features")),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_a_scattering_top_exports_as_the_registered_maps_then_top_model(runs, cut_runs, tmp_path):
    run_dir = cut_runs["scatter"].run_dir
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPSCALE_WEIGHTS_DIR", cut_runs["weights"])
        out = CliRunner().invoke(cli, ["export-backbone", run_dir, str(tmp_path / "bb")])
        assert out.exit_code == 0, out.output
        line = json.loads(out.stdout)
        assert line["model"] == "scatternet-top-cnn" and line["resolution"] == 28 and line["private"] is True
        result = stage.ExportBackboneResult(str(tmp_path / "bb"), pretrained.read_metadata(tmp_path / "bb"),
                                            "ema", True, line["epsilon"], line["delta"])  # fmt: skip
        _same_logits(result, run_dir, runs["data"], "ema_params")
        assert "fixed transform" in result.metadata.source
        _train_accepts(runs["data"], str(tmp_path / "bb"))


def test_a_tampered_top_is_refused_in_one_line(runs, cut_runs, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(cut_runs["lite"].run_dir, copy)
    trained = RunDirectory(str(copy)).load_params()
    cases = {
        "below the cut": lambda p: p["backbone"].update(blocks_3=p["backbone"]["blocks_15"]),
        "other shape": lambda p: p["head"]["fc"].update(bias=jnp.zeros(7)),
    }
    for what, tamper in cases.items():
        for name in ("params", "ema_params"):
            tamper(trained[name])
        shutil.rmtree(copy / PARAMS)
        RunDirectory(str(copy)).save_params(**trained)
        out = CliRunner().invoke(cli, ["export-backbone", str(copy), str(tmp_path / what)])
        assert out.exit_code == 2 and "not those of a top above 'blocks_14'" in out.stderr, (what, out.output)
        assert len(out.stderr.strip().splitlines()) == 1
        trained = RunDirectory(cut_runs["lite"].run_dir).load_params()
    stats = trained["model_state"]["batch_stats"]["backbone"]["head_bn"]
    stats["mean"] = stats["mean"] + 1.0  # the frozen statistics moved: not the backbone's
    shutil.rmtree(copy / PARAMS)
    RunDirectory(str(copy)).save_params(**trained)
    with pytest.raises(DataError, match="frozen statistics above 'blocks_14' are not the backbone's own"):
        stage.run(stage.ExportBackboneConfig(str(copy), str(tmp_path / "stats")))
