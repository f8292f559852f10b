"""Backbone checkpoints: weights and preprocessing travel together and are verified on load."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.errors import DataError
from dpscale.models import efficientnet_lite, pretrained
from dpscale.models.pretrained import Preprocessing

PREP = Preprocessing(resolution=64, mean=(120.0, 110.0, 100.0), std=(60.0, 61.0, 62.0))


@pytest.fixture(scope="module")
def lite0_variables():
    """Random Lite0 variables of the right structure (values are irrelevant here)."""
    model = efficientnet_lite.efficientnet_lite("efficientnet-lite0")
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 64, 64, 3)))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), abstract)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, lite0_variables):
    directory = tmp_path_factory.mktemp("backbone") / "mine"
    meta = pretrained.save_pretrained(
        directory, lite0_variables, model="efficientnet-lite0", num_classes=1000, preprocessing=PREP, source="test"
    )
    return directory, meta


def test_weights_and_preprocessing_round_trip(saved, lite0_variables):
    directory, meta = saved
    assert pretrained.is_complete(directory)
    assert meta.weights_sha256 == pretrained.variables_sha256(lite0_variables)
    model, variables, prep = pretrained.load_pretrained(str(directory))
    assert prep == PREP and prep.fingerprint() == PREP.fingerprint()
    assert isinstance(model.backbone, efficientnet_lite.EfficientNetLiteBackbone)
    restored = jax.tree_util.tree_leaves_with_path(variables)
    original = dict(jax.tree_util.tree_leaves_with_path(lite0_variables))
    assert len(restored) == len(original)
    for path, leaf in restored:
        np.testing.assert_array_equal(np.asarray(leaf), original[path])
    on_disk = json.loads((directory / pretrained.METADATA_FILE).read_text())
    assert on_disk["preprocessing"] == {"resolution": 64, "mean": [120.0, 110.0, 100.0], "std": [60.0, 61.0, 62.0]}
    assert on_disk["model"] == "efficientnet-lite0" and on_disk["weights_sha256"] == meta.weights_sha256


def test_new_task_gets_a_zero_classifier_on_the_pretrained_backbone(saved, lite0_variables):
    directory, _ = saved
    model, variables, _ = pretrained.load_pretrained(directory, num_classes=5)
    assert model.head.num_classes == 5
    head = variables["params"]["head"]["fc"]
    assert head["kernel"].shape == (1280, 5) and not np.any(np.asarray(head["kernel"]))
    assert not np.any(np.asarray(head["bias"]))
    np.testing.assert_array_equal(
        np.asarray(variables["params"]["backbone"]["stem_conv"]["kernel"]),
        lite0_variables["params"]["backbone"]["stem_conv"]["kernel"],
    )
    assert set(variables["batch_stats"]) == {"backbone"}


def test_tampered_weights_hash_is_refused(tmp_path, saved):
    directory, meta = saved
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    bad = json.loads((copy / pretrained.METADATA_FILE).read_text())
    bad["weights_sha256"] = "0" * 64
    (copy / pretrained.METADATA_FILE).write_text(json.dumps(bad))
    with pytest.raises(DataError, match="sha256"):
        pretrained.load_pretrained(copy)


def test_hash_depends_on_every_value(lite0_variables):
    changed = jax.tree.map(np.copy, lite0_variables)
    changed["batch_stats"]["backbone"]["head_bn"]["var"][7] += 1e-3
    assert pretrained.variables_sha256(changed) != pretrained.variables_sha256(lite0_variables)


def test_existing_backbone_is_not_overwritten_without_force(saved, lite0_variables):
    directory, _ = saved
    with pytest.raises(DataError, match="force"):
        pretrained.save_pretrained(
            directory, lite0_variables, model="efficientnet-lite0", num_classes=1000, preprocessing=PREP
        )


def test_missing_or_malformed_metadata_is_a_data_error(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="not a dpscale backbone"):
        pretrained.load_pretrained(tmp_path)
    (tmp_path / pretrained.METADATA_FILE).write_text('{"model": "efficientnet-lite0"}')
    with pytest.raises(DataError, match="malformed"):
        pretrained.load_pretrained(tmp_path)
    monkeypatch.setenv("DPSCALE_WEIGHTS_DIR", str(tmp_path / "cache"))
    assert pretrained.default_weights_dir("efficientnet-lite2") == tmp_path / "cache" / "efficientnet-lite2"
    with pytest.raises(DataError, match="dpscale import-weights efficientnet-lite2"):
        pretrained.load_pretrained("efficientnet-lite2")


def test_preprocessing_resizes_and_normalises():
    pixels = np.full((2, 10, 12, 3), 200, np.uint8)
    out = np.asarray(PREP(pixels))
    assert out.shape == (2, 64, 64, 3)
    np.testing.assert_allclose(out[0, 0, 0], [(200 - 120) / 60, (200 - 110) / 61, (200 - 100) / 62], rtol=1e-6)
    assert PREP.fingerprint() != Preprocessing(resolution=64, mean=(127.0,) * 3, std=(128.0,) * 3).fingerprint()
    with pytest.raises(DataError):
        Preprocessing(resolution=64, mean=(0.0, 0.0, 0.0), std=(1.0, 0.0, 1.0))


def test_any_registry_model_checkpoint_serves_as_a_backbone(tmp_path):
    """A user's own Flax checkpoint (here the grayscale small CNN) loads with its own preprocessing."""
    from dpscale.models import registry

    model = registry.get_model("cnn-small", num_classes=4)
    x = np.random.default_rng(1).uniform(0, 255, size=(2, 28, 28, 1)).astype(np.float32)
    rng = np.random.default_rng(2)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    variables = jax.tree.map(lambda s: (0.1 * rng.normal(size=s.shape)).astype(np.float32), abstract)
    prep = Preprocessing(resolution=28, mean=(72.9,), std=(90.0,))
    pretrained.save_pretrained(tmp_path / "cnn", variables, model="cnn-small", num_classes=4, preprocessing=prep)
    loaded_model, loaded, loaded_prep = pretrained.load_pretrained(str(tmp_path / "cnn"))
    assert loaded_prep == prep
    expected = model.apply(variables, prep(x), method="features")
    np.testing.assert_allclose(
        np.asarray(loaded_model.apply(loaded, loaded_prep(x), method="features")), np.asarray(expected), rtol=1e-6
    )
    bad = json.loads((tmp_path / "cnn" / pretrained.METADATA_FILE).read_text())
    bad["model"] = "no-such-net"
    (tmp_path / "cnn" / pretrained.METADATA_FILE).write_text(json.dumps(bad))
    with pytest.raises(DataError, match="cannot build"):
        pretrained.load_pretrained(tmp_path / "cnn")
