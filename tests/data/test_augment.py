"""Augmentation views: shapes, crops are shifted copies, flips, identity when disabled."""

import jax
import numpy as np

from dpscale.data.augment import augment_views


def test_views_are_crops_of_the_reflect_padded_image_or_their_flips():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(3, 8, 8, 2)).astype(np.float32)
    views = np.asarray(augment_views(jax.random.key(1), images, views=5, pad=2))
    assert views.shape == (3, 5, 8, 8, 2)
    for b in range(3):
        padded = np.pad(images[b], ((2, 2), (2, 2), (0, 0)), mode="reflect")
        candidates = [padded[t : t + 8, s : s + 8] for t in range(5) for s in range(5)]
        candidates += [c[:, ::-1] for c in candidates]
        for k in range(5):
            assert any(np.allclose(views[b, k], c) for c in candidates)


def test_views_differ_and_flips_happen():
    images = np.random.default_rng(1).normal(size=(64, 6, 6, 1)).astype(np.float32)
    views = np.asarray(augment_views(jax.random.key(2), images, views=2, pad=0, flip=True))
    flipped = np.array([np.allclose(views[i, 0], images[i, :, ::-1]) for i in range(64)])
    assert 16 < flipped.sum() < 48  # about half, Binomial(64, 1/2)


def test_no_augmentation_repeats_the_image():
    images = np.random.default_rng(2).normal(size=(4, 5, 5, 3)).astype(np.float32)
    views = np.asarray(augment_views(jax.random.key(3), images, views=3, pad=0, flip=False))
    np.testing.assert_array_equal(views, np.repeat(images[:, None], 3, axis=1))
