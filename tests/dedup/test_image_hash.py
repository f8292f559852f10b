"""Signatures: invariances that must be exact, robustness that must hold, LSH behaviour."""

import numpy as np
import pytest
from PIL import Image

from dpscale.dedup import image_hash as ih
from dpscale.dedup import join
from dpscale.dedup.image_hash import HashConfig

CONFIG = HashConfig()


def smooth(seed: int, size: int = 32) -> np.ndarray:
    low = np.random.default_rng(seed).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC))


def nearest_view_distance(public: np.ndarray, private: np.ndarray) -> float:
    v, m = ih.embed(public[None])
    views, vm = ih.embed_views(private[None], CONFIG)
    return float(ih.distances(v, m, views[0], np.repeat(vm, len(views[0]))).min())


def test_embeddings_are_unit_length_and_whole_view_equals_public_embedding():
    images = np.stack([smooth(i) for i in range(4)])
    vectors, means = ih.embed(images)
    assert vectors.shape == (4, ih.DIM)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    views, _ = ih.embed_views(images, CONFIG)
    assert views.shape == (4, CONFIG.num_views, ih.DIM)
    np.testing.assert_allclose(views[:, 0], vectors, atol=1e-5)
    np.testing.assert_allclose(means, images.mean(axis=(1, 2)) @ [0.299, 0.587, 0.114] / 255,
                               atol=1e-4)


def test_mirror_views_match_a_flipped_copy_exactly():
    im = smooth(3)
    assert nearest_view_distance(im[:, ::-1].copy(), im) < 1e-4
    flipped, _ = ih.embed(im[None, :, ::-1])
    views, _ = ih.embed_views(im[None], CONFIG)
    np.testing.assert_allclose(views[0, CONFIG.num_views // 2], flipped[0], atol=1e-5)
    assert ih.view_name(CONFIG.num_views // 2, CONFIG) == "flip+whole"


def test_brightness_and_contrast_do_not_matter_but_content_does():
    im = smooth(5).astype(np.float32)
    brighter = np.clip(im * 0.8 + 30, 0, 255).astype(np.uint8)
    a, _ = ih.embed(np.stack([im.astype(np.uint8), brighter, smooth(6)]))
    d = ih.distances(a, np.zeros(3), a, np.zeros(3))
    assert d[0, 1] < 0.05 and d[0, 2] > 0.5


@pytest.mark.parametrize("left,top,side", [(0, 0, 30), (4, 2, 27), (6, 6, 26), (1, 5, 26)])
def test_crops_and_jpeg_stay_within_the_threshold(left, top, side):
    """Crops keeping >= 80% of each side: the range benchmarks/dedup.py measures."""
    im = smooth(11)
    crop = np.asarray(Image.fromarray(im[top:top + side, left:left + side]).resize(
        (32, 32), Image.Resampling.BICUBIC))
    assert nearest_view_distance(crop, im) < CONFIG.threshold
    assert nearest_view_distance(ih.jpeg_roundtrip(crop, 75), im) < CONFIG.threshold
    assert nearest_view_distance(ih.jpeg_roundtrip(im, 75), im) < 0.05


def test_unrelated_images_are_far_apart():
    private = np.stack([smooth(100 + i) for i in range(20)])
    public = np.stack([smooth(200 + i) for i in range(50)])
    views, vm = ih.embed_views(private, CONFIG)
    p, pm = ih.embed(public)
    d = ih.distances(p, pm, views.reshape(-1, ih.DIM), np.repeat(vm, CONFIG.num_views))
    assert d.min() > CONFIG.threshold


def test_larger_images_use_area_averaging_to_the_same_signature():
    im = smooth(7, size=32)
    big = np.repeat(np.repeat(im, 4, axis=0), 4, axis=1)  # 128x128, same picture
    a, _ = ih.embed(np.stack([im]))
    b, _ = ih.embed(np.stack([big]))
    assert ih.distances(a, np.zeros(1), b, np.zeros(1))[0, 0] < 0.02


def test_grayscale_images_work():
    im = smooth(8)[..., :1]
    v, _ = ih.embed(im[None])
    views, _ = ih.embed_views(im[None], CONFIG)
    assert np.isfinite(v).all() and np.abs(views[0, 0] - v[0]).max() < 1e-5


def test_flat_images_compare_by_mean_gray_level():
    flat = np.stack([np.full((32, 32, 3), g, np.uint8) for g in (100, 103, 180)])
    v, m = ih.embed(flat)
    assert not v.any()
    d = ih.distances(v, m, v, m)
    assert d[0, 1] < CONFIG.threshold < d[0, 2]
    s, sm = ih.embed(smooth(1)[None])
    assert ih.distances(v, m, s, sm)[0, 0] == pytest.approx(1.0)
    assert (ih.band_values(v, CONFIG) == ih.FLAT_BUCKET).all()


def test_band_values_are_deterministic_and_near_vectors_share_bands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, ih.DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    near = x + 0.02 * rng.standard_normal(x.shape).astype(np.float32)
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    a, b = ih.band_values(x, CONFIG), ih.band_values(near, CONFIG)
    np.testing.assert_array_equal(a, ih.band_values(x.copy(), CONFIG))
    assert a.shape == (200, CONFIG.bands) and a.max() < 2 ** CONFIG.bits_per_band
    assert (a == b).any(axis=1).mean() >= 0.99  # near pairs (distance ~0.15) meet
    unrelated = (a == np.roll(a, 1, axis=0)).any(axis=1).mean()
    assert unrelated < 0.3  # random pairs rarely are


def test_join_group_finds_pairs_only_within_shared_buckets():
    cfg = HashConfig(bands=1, bits_per_band=4)
    private = np.stack([smooth(i) for i in range(3)])
    public = np.stack([private[1][:, ::-1], smooth(50)])
    pub_task = join.ReadTask(join.PUBLIC, "train", 0, 2, shard=3)
    priv_task = join.ReadTask(join.PRIVATE, "test", 0, 3)
    pv, pm = ih.embed(public)
    qv, qm = ih.embed_views(private, cfg)
    pub = [e for _, e in join.entries_by_group(pub_task, np.arange(2), pv[:, None], pm, cfg,
                                               partitions=1)]
    priv = [e for _, e in join.entries_by_group(priv_task, np.arange(3), qv, qm, cfg,
                                                partitions=1)]
    matches, candidates = join.join_group(pub, priv, threshold=cfg.threshold)
    assert 0 < candidates < 2 * 3 * cfg.num_views  # a bucket join, not all pairs
    best = join.closest(matches)
    assert (best.public_index, best.public_shard, best.private_index) == (0, 3, 1)
    assert best.distance < 1e-3 and ih.view_name(best.view, cfg).startswith("flip+")
    assert {m.public_index for m in matches} == {0}
    assert join.join_group(pub, [], threshold=0.3) == ([], 0)


def test_partitions_spread_band_values():
    values = np.arange(256, dtype=np.uint64)
    counts = np.bincount(join.partition_of(values, 4).astype(np.int64), minlength=4)
    assert counts.min() >= 40


def test_config_validation():
    with pytest.raises(ValueError, match="threshold"):
        HashConfig(threshold=0)
    with pytest.raises(ValueError, match="crop"):
        HashConfig(crop_scales=(1.2,))
    assert HashConfig(crop_scales=(0.9,)).num_views == 2 * (1 + 25)
