"""The learned copy embedding: its edits, loss, training (and resuming), saving and loading."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.dedup import copy_model as cm

SMALL = cm.TrainSettings(epochs=2, batch=16, seed=3)


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)


def test_copy_edit_changes_pixels_keeps_shape_and_range_and_is_seeded(images):
    x = jnp.asarray(cm.as_input(images[:4]))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    y = jax.vmap(cm.copy_edit)(keys, x)
    assert y.shape == x.shape and float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    assert float(jnp.abs(y - x).mean()) > 0.02
    np.testing.assert_array_equal(y, jax.vmap(cm.copy_edit)(keys, x))
    assert float(jnp.abs(y - jax.vmap(cm.copy_edit)(jax.random.split(jax.random.PRNGKey(1), 4), x)).mean()) > 0.01


def test_as_input_resizes_and_repeats_grey_images():
    grey = np.full((3, 28, 28, 1), 255, np.uint8)
    x = cm.as_input(grey)
    assert x.shape == (3, cm.RESOLUTION, cm.RESOLUTION, 3) and x.dtype == np.float32
    np.testing.assert_allclose(x, 1.0, atol=1e-5)


def test_nt_xent_is_lower_when_each_view_finds_its_partner():
    z = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
    z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
    assert float(cm.nt_xent(z, z)) < float(cm.nt_xent(z, z[::-1]))


def test_training_lowers_the_loss_and_embeds_to_unit_vectors(images):
    losses = []
    params, info = cm.train(images, SMALL, progress=lambda step, total, loss: losses.append((step, total, loss)))
    assert [s for s, _, _ in losses] == list(range(1, 5)) and losses[0][1] == 4 and info["steps"] == 4
    e = cm.embed(params, images[:5], batch=2)  # partial last batch
    assert e.shape == (5, cm.CopyEmbedding.dim)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    mirrored = cm.embed(params, images[:5], mirrored=True)
    np.testing.assert_allclose(mirrored, cm.embed(params, images[:5, :, ::-1]), atol=1e-6)


def test_an_interrupted_training_resumes_to_the_same_model(images, tmp_path):
    whole, _ = cm.train(images, SMALL)
    calls = []

    def stop_in_the_second_epoch(step, total, loss):
        calls.append(step)
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cm.train(images, SMALL, progress=stop_in_the_second_epoch, work_dir=str(tmp_path))
    resumed, info = cm.train(images, SMALL, progress=lambda *a: calls.append(a[0]), work_dir=str(tmp_path))
    assert info["resumed_at_epoch"] == 1 and calls == [1, 2, 3, 2, 3, 4]
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    # other images or settings never resume from that state
    _, info = cm.train(images[::-1].copy(), SMALL, work_dir=str(tmp_path))
    assert info["resumed_at_epoch"] == 0


@pytest.fixture()
def copy_model_log(caplog):
    """The copy model's log lines (attached directly: the CLI may stop them reaching the root logger)."""
    cm.log.addHandler(caplog.handler)
    yield caplog
    cm.log.removeHandler(caplog.handler)


def test_a_damaged_or_foreign_saved_state_starts_afresh(images, tmp_path, copy_model_log):
    caplog = copy_model_log
    partial = tmp_path / cm.PARTIAL
    partial.write_bytes(b"\x00 half a file")
    _, info = cm.train(images, SMALL, work_dir=str(tmp_path))
    assert info["resumed_at_epoch"] == 0 and "cannot resume" in caplog.text
    # a state of another architecture with the same identity: refused by shape, not half-used
    from flax import serialization

    saved = serialization.msgpack_restore(partial.read_bytes())
    saved["params"]["params"]["head"]["kernel"] = np.zeros((3, 3), np.float32)
    partial.write_bytes(serialization.msgpack_serialize(saved))
    _, info = cm.train(images, SMALL, work_dir=str(tmp_path))
    assert info["resumed_at_epoch"] == 0 and "shape" in caplog.text


def test_save_and_load_round_trip_and_clear_errors(images, tmp_path):
    params, info = cm.train(images[:16], cm.TrainSettings(epochs=1, batch=16))
    ids = np.array([7, 3, 7, 2**63 + 1], np.uint64)
    cm.save(str(tmp_path / "m"), params, info, ids)
    saved = cm.load(str(tmp_path / "m"))
    np.testing.assert_array_equal(cm.embed(params, images[:3]), cm.embed(saved.params, images[:3]))
    assert saved.info["steps"] == 1 and saved.info["format"] == cm.FORMAT
    assert saved.trained_on.tolist() == [3, 7, 2**63 + 1]  # sorted, unique, full 64 bits
    with pytest.raises(ValueError, match="holds no copy model"):
        cm.load(str(tmp_path / "missing"))
    # weights from another save (a save cut short): refused by the description's hash
    other, _ = cm.train(images[16:32], cm.TrainSettings(epochs=1, batch=16, seed=1))
    (tmp_path / "m" / cm.WEIGHTS).write_bytes(__import__("flax").serialization.to_bytes(other))
    with pytest.raises(ValueError, match="does not match its description"):
        cm.load(str(tmp_path / "m"))
    cm.save(str(tmp_path / "m2"), params, info, ids)
    (tmp_path / "m2" / cm.TRAINED_ON).unlink()
    with pytest.raises(ValueError, match="is missing"):
        cm.load(str(tmp_path / "m2"))
    info_v1 = json.loads((tmp_path / "m" / cm.INFO).read_text()) | {"format": 1}
    (tmp_path / "m" / cm.INFO).write_text(json.dumps(info_v1))
    with pytest.raises(ValueError, match="format 1, expected 2: train it again"):
        cm.load(str(tmp_path / "m"))
    (tmp_path / "m" / cm.INFO).write_text("[1, 2]")
    with pytest.raises(ValueError, match="format None"):
        cm.load(str(tmp_path / "m"))


def test_weights_of_another_shape_or_not_finite_are_refused(images, tmp_path):
    params, info = cm.train(images[:16], cm.TrainSettings(epochs=1, batch=16))
    wrong = jax.tree_util.tree_map(lambda a: a, params)
    wrong["params"]["head"]["kernel"] = np.zeros((3, 3), np.float32)
    cm.save(str(tmp_path / "shape"), wrong, info, np.zeros(1, np.uint64))
    with pytest.raises(ValueError, match="cannot be used.*shape"):
        cm.load(str(tmp_path / "shape"))
    nan = jax.tree_util.tree_map(lambda a: np.full_like(a, np.nan), params)
    cm.save(str(tmp_path / "nan"), nan, info, np.zeros(1, np.uint64))
    with pytest.raises(ValueError, match="non-finite"):
        cm.load(str(tmp_path / "nan"))


def test_too_few_images_or_bad_settings_are_refused(images):
    with pytest.raises(ValueError, match="fewer than one batch"):
        cm.train(images[:8], SMALL)
    with pytest.raises(ValueError):
        cm.TrainSettings(epochs=0)


def test_thumbnails_shrink_large_and_grey_images_chunk_by_chunk():
    big = np.zeros((5, 64, 48, 1), np.uint8)
    big[:, :32] = 200
    t = cm.thumbnails(big, chunk=2)
    assert t.shape == (5, cm.RESOLUTION, cm.RESOLUTION, 3) and t.dtype == np.uint8
    assert (t[:, :14] == 200).all() and (t[:, 18:] == 0).all() and (t[..., 0] == t[..., 2]).all()
    same = np.arange(2 * 32 * 32 * 3, dtype=np.uint8).reshape(2, 32, 32, 3)
    assert cm.thumbnails(same) is same or np.array_equal(cm.thumbnails(same), same)
