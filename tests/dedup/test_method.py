"""Descriptor, nearest neighbours and verification on small arrays."""

import numpy as np
from PIL import Image

from dpscale.dedup import descriptor, knn, verify


def _smooth(seed: int) -> np.ndarray:
    low = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((32, 32), Image.Resampling.BICUBIC))


def _shift(im: np.ndarray, dx: int, dy: int) -> np.ndarray:
    padded = np.pad(im, ((2, 2), (2, 2), (0, 0)), mode="edge")
    return padded[2 - dy : 2 - dy + 32, 2 - dx : 2 - dx + 32].copy()


def test_descriptor_tolerates_shift_brightness_and_a_mirror_view_catches_flips():
    im = _smooth(0)
    d = descriptor.describe(
        np.stack([im, _shift(im, 1, 0), _shift(im, 2, -1), np.clip(im * 0.8 + 20, 0, 255).astype(np.uint8), _smooth(1)])
    )
    assert d.shape == (5, descriptor.DIM)
    np.testing.assert_allclose(np.linalg.norm(d, axis=1), 1, atol=1e-5)
    assert d[0] @ d[1] > 0.95 and d[0] @ d[2] > 0.8 and d[0] @ d[3] > 0.99
    assert d[0] @ d[4] < 0.5
    views = descriptor.describe_views(im[None])  # [12, 1, D]
    flipped = descriptor.describe(im[None, :, ::-1])[0]
    mirrored = [v for v in range(descriptor.NUM_VIEWS) if descriptor.view_of(v)[1]]
    assert views[mirrored[0], 0] @ flipped > 0.999
    assert descriptor.view_name(mirrored[0]) == "whole mirrored"


def test_blocked_search_equals_brute_force_and_merges_blocks():
    rng = np.random.default_rng(0)
    public = rng.normal(size=(300, 8)).astype(np.float32)
    views = rng.normal(size=(3, 20, 8)).astype(np.float32)
    top = knn.search(views, public, 4, offset=1000, block=64)
    sims = np.einsum("vmd,nd->vmn", views, public)
    best = sims.max(0)
    want = np.argsort(-best, axis=1)[:, :4]
    np.testing.assert_array_equal(top.public - 1000, want)
    np.testing.assert_allclose(top.similarity, np.take_along_axis(best, want, 1), rtol=1e-5)
    np.testing.assert_array_equal(top.view, np.take_along_axis(sims.argmax(0), want, 1))


def test_verification_separates_a_shifted_recoloured_copy_from_a_lookalike():
    im = _smooth(3)
    copy = np.clip(_shift(im, -1, 2) * np.array([1.1, 0.9, 1.0]) + 10, 0, 255).astype(np.uint8)
    other = _smooth(4)
    coarse, fine = verify.distances(np.stack([copy, other]), np.stack([im, im]), np.array([False, False]))
    assert fine[0] < verify.THRESHOLD < coarse[1]
    assert np.isinf(fine[1]) or fine[1] > verify.THRESHOLD
