"""The featurize stage on digits with a tiny random-weight CNN backbone (no torch needed)."""

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cache import feature_store as fstore
from dpscale.cache import featurizer
from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import pretrained, registry
from dpscale.stages import featurize as stage
from dpscale.stages import ingest

IN_MEMORY = ("--direct_num_workers=1", "--direct_running_mode=in_memory")
PREP = pretrained.Preprocessing(resolution=12, mean=(8.0,), std=(4.0,))


def save_backbone(directory, seed):
    model = registry.get_model("cnn-small", num_classes=10)
    variables = model.init(jax.random.key(seed), jnp.zeros((1, 12, 12, 1)))
    pretrained.save_pretrained(str(directory), variables, model="cnn-small", num_classes=10, preprocessing=PREP)
    return str(directory)


def jitted_forward(backbone):
    """uint8 images -> the backbone's features, computed directly (no cache, no Beam)."""
    model, variables, prep = pretrained.load_pretrained(backbone)
    return jax.jit(lambda x: model.apply(variables, prep(x), method="features"))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("featurize")
    data = str(root / "digits")
    ingest.run(ingest.IngestConfig("digits", data, pipeline_args=IN_MEMORY))
    return {"root": root, "data": data, "backbone": save_backbone(root / "bb", 0)}


def config(env, cache, **kw):
    return stage.FeaturizeConfig(
        env["data"],
        env["backbone"],
        cache_dir=str(cache),
        chunk_rows=kw.pop("chunk_rows", 512),
        batch_size=kw.pop("batch_size", 100),
        pipeline_args=IN_MEMORY,
        **kw,
    )


@pytest.fixture(scope="module")
def done(env):
    """One full run (4 chunks, ragged last batch and last chunk) shared by several tests."""
    cache = env["root"] / "cache"
    return cache, stage.run(config(env, cache))


def test_features_equal_a_direct_forward_pass(env, done):
    _, result = done
    assert not result.cache_hit and result.chunks_computed == result.chunks_total == 4
    fs = fstore.open_features(result.path)
    direct_forward = jitted_forward(env["backbone"])
    with IngestedDataset(env["data"]) as ds:
        assert fs.splits == sorted(ds.splits) and fs.class_names == ds.class_names
        for split in ds.splits:
            n = ds.num_examples(split)
            images, labels = ds.get(split, np.arange(n))
            direct = direct_forward(images)
            assert fs.features(split).shape == (n, direct.shape[-1]) == (n, fs.feature_dim)
            np.testing.assert_allclose(fs.features(split)[:], np.asarray(direct), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(fs.labels(split), labels)
            assert fs.ids(split)[:5] == [e.id for e in ds.examples(split, range(5))]
        # The data enters the key keyed with the cache's secret: never as its plain content hash.
        assert ds.content_hash not in json.dumps(fs.metadata) and ds.content_hash not in fs.path
    assert fs.metadata["key"]["weights_sha256"] == pretrained.read_metadata(env["backbone"]).weights_sha256


def test_flip_average_stores_the_mean_of_the_image_and_its_mirror(env, done, tmp_path):
    _, plain = done
    result = stage.run(config(env, tmp_path / "cache", flip_average=True, chunk_rows=1024))
    assert result.digest != plain.digest and not result.cache_hit
    fs = fstore.open_features(result.path)
    assert fs.metadata["key"]["flip_average"] is True
    direct_forward = jitted_forward(env["backbone"])
    with IngestedDataset(env["data"]) as ds:
        images = ds.split_images("test")
    expected = 0.5 * (direct_forward(images) + direct_forward(images[:, :, ::-1, :]))
    np.testing.assert_allclose(fs.features("test")[:], np.asarray(expected), rtol=1e-5, atol=1e-5)
    unflipped = fstore.open_features(plain.path).features("test")[:]
    assert np.abs(fs.features("test")[:] - unflipped).max() > 1e-3  # digits are not mirror-symmetric


def test_same_key_is_a_fast_hit_that_computes_nothing(env, done, monkeypatch):
    cache, first = done
    markers = os.path.join(first.path, "chunks")
    before = {
        f: os.stat(os.path.join(markers, s, f)).st_mtime_ns
        for s in os.listdir(markers)
        for f in os.listdir(os.path.join(markers, s))
    }

    def forbidden(*args, **kwargs):
        raise AssertionError("a cache hit must not featurize")

    monkeypatch.setattr(featurizer, "featurize_chunk", forbidden)
    monkeypatch.setattr(featurizer, "Featurizer", forbidden)
    start = time.perf_counter()
    again = stage.run(config(env, cache, batch_size=7, chunk_rows=100))  # speed knobs: same key
    assert time.perf_counter() - start < 3.0
    assert again.cache_hit and again.path == first.path and again.chunks_computed == 0
    after = {
        f: os.stat(os.path.join(markers, s, f)).st_mtime_ns
        for s in os.listdir(markers)
        for f in os.listdir(os.path.join(markers, s))
    }
    assert after == before


def test_interrupted_run_finishes_only_the_missing_chunks(env, done, tmp_path, monkeypatch):
    import shutil

    _, first = done
    cache = tmp_path / "cache"
    entry = cache / os.path.basename(first.path)
    shutil.copytree(first.path, entry)
    shutil.copy2(os.path.join(os.path.dirname(first.path), "key.id"), cache)  # the same cache, moved (same owner)
    # what a kill -9 after two chunks leaves: no COMPLETE, two chunks without markers
    # (one of them with garbage rows, as if half written)
    os.remove(entry / fstore.COMPLETE)
    os.remove(entry / "chunks" / "train" / "000001.done")
    os.remove(entry / "chunks" / "test" / "000000.done")
    store = fstore.FeatureStore.for_writing(str(entry))
    store._array("train", "features")[512:1024] = np.float32(np.nan)
    with pytest.raises(DataError, match="incomplete"):
        fstore.open_features(str(entry))
    calls = []
    real = featurizer.featurize_chunk

    def counting(dataset, store, featurizer, split, chunk):
        calls.append((split, chunk))
        return real(dataset, store, featurizer, split, chunk)

    monkeypatch.setattr(featurizer, "featurize_chunk", counting)
    result = stage.run(config(env, cache))
    assert sorted(calls) == [("test", 0), ("train", 1)]
    assert (result.cache_hit, result.chunks_computed, result.chunks_total) == (False, 2, 4)
    resumed, original = fstore.open_features(result.path), fstore.open_features(first.path)
    for split in original.splits:
        np.testing.assert_allclose(resumed.features(split)[:], original.features(split)[:], atol=1e-6)


def test_preprocessing_and_weights_change_the_key(env, tmp_path):
    with IngestedDataset(env["data"]) as ds:

        def key(backbone=env["backbone"], cache=tmp_path / "cache", **options):
            return featurizer.feature_key(ds, backbone, cache_dir=str(cache), **options)[0]

        base = key()
        assert base.resolution == PREP.resolution
        assert key(resolution=16).digest != base.digest
        assert key(resize_method="nearest").digest != base.digest
        assert key(save_backbone(tmp_path / "bb2", 1)).digest != base.digest
        assert key(save_backbone(tmp_path / "bb3", 0)).digest == base.digest  # same weights elsewhere: same features
        # Another cache has another secret: the same data gets another identity there.
        assert key(cache=tmp_path / "other-cache").digest != base.digest


def test_preprocess_resizes_normalises_and_repeats_gray_for_rgb():
    images = np.full((2, 4, 4, 1), 10, np.uint8)
    out = featurizer.preprocess(images, resolution=8, mean=(2.0, 4.0, 6.0), std=(2.0, 2.0, 2.0))
    assert out.shape == (2, 8, 8, 3) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out[0, 3, 5]), [4.0, 3.0, 2.0], rtol=1e-6)


def test_config_and_backbone_errors(env, tmp_path):
    with pytest.raises(InvalidConfigError):
        stage.FeaturizeConfig(env["data"], env["backbone"], resolution=0)
    with pytest.raises(InvalidConfigError):
        stage.FeaturizeConfig(env["data"], env["backbone"], resize_method="area")
    with pytest.raises(DataError, match="not a dpscale backbone"):
        stage.run(dataclasses.replace(config(env, tmp_path), backbone=str(tmp_path)))


def test_cli_prints_the_entry_and_errors_are_one_line(env, done):
    cache, first = done
    ok = CliRunner().invoke(cli, ["featurize", env["data"], "--backbone", env["backbone"], "--cache-dir", str(cache)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout) | {"seconds": 0} == {
        "path": first.path,
        "cache_hit": True,
        "chunks_computed": 0,
        "chunks_total": 0,
        "num_examples": first.num_examples,
        "seconds": 0,
        "images_per_second": 0.0,
    }  # none computed
    assert "cache hit" in ok.stderr
    bad = CliRunner().invoke(cli, ["featurize", str(cache / "nowhere"), "--backbone", env["backbone"]])
    assert bad.exit_code == 2
    assert bad.output.count("\n") == 1 and bad.output.startswith("dpscale: error: ")


def test_a_parameter_free_backbone_featurizes_by_name_without_weights(env, tmp_path, monkeypatch):
    """``--backbone scatternet-linear``: the backbone directory is built on first use, the digits
    are resized to its 28 px, and the cached rows equal the model applied to the same input."""
    monkeypatch.setenv("DPSCALE_WEIGHTS_DIR", str(tmp_path / "weights"))
    result = stage.run(
        stage.FeaturizeConfig(
            env["data"],
            "scatternet-linear",
            cache_dir=str(tmp_path / "cache"),
            chunk_rows=2048,
            batch_size=256,
            pipeline_args=IN_MEMORY,
        )
    )
    fs = fstore.open_features(result.path)
    assert fs.feature_dim == registry.get_spec("scatternet-linear").feature_dim
    with IngestedDataset(env["data"]) as ds:
        images, _ = ds.get("test", np.arange(8))
    prep = pretrained.read_metadata(pretrained.resolve_backbone("scatternet-linear")).preprocessing
    direct = registry.get_model("scatternet-linear").apply({}, prep(images), method="features")
    np.testing.assert_allclose(fs.features("test")[:8], np.asarray(direct), rtol=1e-4, atol=1e-4)
