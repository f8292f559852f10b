"""Local agreement of the copy decision: the copy model's early cells, mutual nearest neighbours."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dpscale.dedup import copy_model as cm
from dpscale.dedup import local_match


@pytest.fixture(scope="module")
def params():
    return cm.CopyEmbedding().init(jax.random.PRNGKey(0), np.zeros((1, cm.RESOLUTION, cm.RESOLUTION, 3)))


@pytest.fixture(scope="module")
def thumbs():
    rng = np.random.default_rng(0)
    # smooth random images (upsampled 8x8 noise): cells differ from each other, as in photographs
    coarse = rng.integers(0, 256, (6, 8, 8, 3)).astype(np.float32)
    return cm.thumbnails(
        np.clip(np.kron(coarse, np.ones((1, 4, 4, 1))) + rng.normal(0, 8, (6, 32, 32, 3)), 0, 255).astype(np.uint8)
    )


def test_local_features_are_the_copy_models_own_early_blocks(params, thumbs):
    x = cm.as_input(thumbs)
    _, state = cm.CopyEmbedding().apply(params, x, capture_intermediates=True)
    inside = jax.nn.relu(state["intermediates"][f"norm_{cm.LOCAL_BLOCKS - 1}"]["__call__"][0])
    np.testing.assert_allclose(cm.LocalFeatures().apply(cm.local_params(params), x), inside, atol=1e-6)


def test_cells_are_unit_vectors_and_match_themselves_one_to_one(params, thumbs):
    c = local_match.cells(cm.local_params(params), thumbs)
    assert c.shape == (6, 256, 64) and np.allclose(np.linalg.norm(c, axis=-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(local_match.mutual_fraction(c, c), 1.0)
    # no geometry: the same cells in another order still match one to one
    shuffled = c[:, np.random.default_rng(1).permutation(256)]
    np.testing.assert_allclose(local_match.mutual_fraction(c, shuffled), 1.0)
    # unrelated images agree on far fewer cells
    assert local_match.mutual_fraction(c, np.roll(c, 1, axis=0)).max() < 0.8


def test_a_flat_image_matches_few_cells_of_anything(params, thumbs):
    flat = np.full((1, 32, 32, 3), 128, np.uint8)
    p = cm.local_params(params)
    # the inner cells of a flat image are one vector (only the border, next to the convolutions'
    # zero padding, differs): they all point at one cell, which points back at one of them
    assert local_match.mutual_fraction(local_match.cells(p, flat), local_match.cells(p, thumbs[:1]))[0] < 0.05


def test_agreement_takes_each_candidates_mirror_state_and_equals_pairwise_matching(params, thumbs, monkeypatch):
    public = thumbs[:4]
    private = np.stack([thumbs[2][:, ::-1], thumbs[5]])  # private 0 is public 2 mirrored
    agreement = local_match.Agreement(params, public, private)
    index = np.array([[2, 0, 1], [3, 2, 0]])
    mirrored = np.array([[True, False, False], [False, True, False]])
    got = agreement(np.array([0, 1]), index, mirrored)
    assert got.shape == (2, 3) and got[0, 0] == 1.0 and got[0, 1:].max() < 0.8
    p = cm.local_params(params)
    for r in range(2):
        for j in range(3):
            b = private[r][:, ::-1] if mirrored[r, j] else private[r]
            want = local_match.mutual_fraction(
                local_match.cells(p, public[index[r, j]][None]), local_match.cells(p, b[None])
            )[0]
            assert got[r, j] == pytest.approx(want)
    # the same image unmirrored is no longer a one-to-one match
    assert agreement(np.array([0]), np.array([[2]]), np.array([[False]]))[0, 0] < 1.0
    # matched a few pairs at a time (rows split across chunks; jitted batches with a padded last one),
    # and for rows given in another order
    monkeypatch.setattr(local_match, "PAIRS", 4)
    monkeypatch.setattr(local_match, "BATCH", 3)
    np.testing.assert_array_equal(agreement(np.array([0, 1]), index, mirrored), got)
    np.testing.assert_array_equal(agreement(np.array([1, 0]), index[::-1], mirrored[::-1]), got[::-1])


def test_mutual_fraction_refuses_arrays_of_different_shapes():
    with pytest.raises(ValueError, match="differ in shape"):
        local_match.mutual_fraction(np.zeros((2, 4, 3), np.float32), np.zeros((1, 4, 3), np.float32))
