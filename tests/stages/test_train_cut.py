"""Training above a cut: `featurize --cut` caches activations (with views), `train` fits a top on them."""

import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cache import feature_store as fstore
from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import cuts, pretrained, registry
from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import evaluate, ingest, train
from dpscale.stages import featurize as stage
from dpscale.training.config import ImageSettings, TrainingConfig
from dpscale.training.model import detect_mode

IN_MEMORY = ("--direct_num_workers=1", "--direct_running_mode=in_memory")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cut")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPSCALE_WEIGHTS_DIR", str(root / "weights"))
        data = str(root / "digits")
        ingest.run(ingest.IngestConfig("digits", data, pipeline_args=IN_MEMORY))

        def featurize(cache, **options):
            config = stage.FeaturizeConfig(
                data,
                "scatternet-linear",
                cache_dir=str(root / cache),
                cut="scattering",
                chunk_rows=options.pop("chunk_rows", 1024),
                batch_size=options.pop("batch_size", 256),
                pipeline_args=IN_MEMORY,
                **options,
            )
            return stage.run(config).path

        entries = {"views2": featurize("cache", augmult_views=2), "views1": featurize("cache")}
        entries["views2-other-batches"] = featurize("cache2", augmult_views=2, chunk_rows=500, batch_size=64)
        yield {"root": root, "data": data, **entries}


def test_a_cut_entry_holds_the_image_then_random_views_of_the_scattering_maps(env):
    fs = fstore.open_features(env["views2"])
    assert fs.key.cut == "scattering" and fs.key.views == 2 and fs.feature_shape == (2, 7, 7, 81)
    assert detect_mode(env["views2"]) == "activations"
    model = registry.get_model("scatternet-linear", num_classes=10)
    prep = pretrained.read_metadata(pretrained.resolve_backbone("scatternet-linear")).preprocessing
    with IngestedDataset(env["data"]) as ds:
        images, _ = ds.get("test", np.arange(16))
    direct = np.asarray(cuts.activations_fn(model, "scattering", {})(prep(images)))
    rows = fs.features("test")[:16].reshape(16, *fs.feature_shape)
    np.testing.assert_allclose(rows[:, 0], direct, rtol=1e-4, atol=1e-4)
    assert np.abs(rows[:, 1] - rows[:, 0]).max() > 0.1  # the second view is a crop or flip, not the image
    # The views do not depend on batch size, chunking or worker (their keys are the rows' indices):
    # the rows agree up to the float rounding of transforms computed in batches of other shapes.
    other = fstore.open_features(env["views2-other-batches"])
    np.testing.assert_allclose(other.features("train")[:], fs.features("train")[:], rtol=0, atol=1e-4)


def _config(**options):
    return TrainingConfig(
        mode="activations",
        target=PrivacyTarget(epsilon=4.0),
        batch_size=options.pop("batch_size", 256),
        steps=options.pop("steps", 12),
        learning_rate=2.0,
        microbatch_size=64,
        show_progress=False,
        images=ImageSettings(**options),
    )


def test_a_top_trains_above_the_cut_with_augmult_and_scores_on_its_own_entry_only(env, tmp_path):
    run_dir = str(tmp_path / "run")
    result = train.run(train.TrainConfig(env["views2"], run_dir, _config(augmult=2)))
    assert 0 < result.epsilon <= 4.0
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir))
    assert scores.ema_top1 > 0.3  # 10 classes: chance is 0.1
    # Activations of another cut, backbone or resolution, or with other views, are not the run's inputs.
    with pytest.raises(DataError, match="not made like the data the run trained on"):
        evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir, data=env["views1"], force_other_data=True))


def test_cut_runs_refuse_more_views_than_cached_a_backbone_flag_and_an_unknown_top(env, tmp_path):
    run = lambda data, **options: train.run(train.TrainConfig(data, str(tmp_path / "r"), _config(**options)))  # noqa: E731
    with pytest.raises(InvalidConfigError, match="featurize with --augmult-views 2"):
        run(env["views1"], augmult=2)
    with pytest.raises(InvalidConfigError, match="--backbone does not apply above a cut"):
        run(env["views1"], backbone="efficientnet-lite0")
    with pytest.raises(InvalidConfigError, match="tops: cnn, cnn-wide"):
        run(env["views1"], model="wrn-16-4")
    features = TrainingConfig(mode="features", batch_size=64, steps=2, show_progress=False)
    with pytest.raises(DataError, match="holds activations at a cut .*, not the pooled features"):
        train.run(train.TrainConfig(env["views1"], str(tmp_path / "f"), features))


def test_featurize_cli_refuses_a_cut_the_backbone_does_not_have_and_views_without_a_cut(env, tmp_path):
    base = ["featurize", env["data"], "--backbone", "scatternet-linear", "--cache-dir", str(tmp_path)]
    for extra, message in (
        (["--cut", "blocks_3"], "has no cut 'blocks_3' (its cuts: scattering)"),
        (["--augmult-views", "2"], "--augmult-views needs --cut"),
    ):
        out = CliRunner().invoke(cli, [*base, *extra], env={"DPSCALE_WEIGHTS_DIR": str(env["root"] / "weights")})
        assert out.exit_code == 2 and message in out.output and out.output.count("\n") == 1, out.output
