"""The misses analysis reuses dedup's verification in memory; its swaps must reproduce it and undo."""

import numpy as np

from dpscale.benchmarks import dedup_census_misses as dm
from dpscale.dedup import verify


def test_half_grid_at_whole_pixels_is_verify_grid():
    for size in (16, 32):
        ours, theirs = dm.half_grid(size, 1.0), verify.alignment_grid(size)
        assert len(ours) == len(theirs)
        for (s0, t0, m0), (s1, t1, m1) in zip(ours, theirs):
            assert s0 == s1 and np.array_equal(t0, t1) and np.allclose(m0, m1)


def test_default_fine_variant_reproduces_verify_and_restores_it():
    rng = np.random.default_rng(0)
    a = np.kron(rng.integers(0, 256, (6, 8, 8, 3)), np.ones((1, 4, 4, 1))).astype(np.uint8)
    noise = rng.integers(-20, 21, a.shape)
    b = np.clip(np.roll(a, 1, axis=2) + noise, 0, 255).astype(np.uint8)  # noisy shifted copies
    _, fine = verify.distances(a, b, np.zeros(6, bool))
    assert np.isfinite(fine).all()
    saved = verify._blur, verify.DETAIL_SIGMA, verify.alignment_grid
    ours = dm.fine_distances(a, b, pre_blur=1.0, detail_sigma=3.0, shift_step=1.0)
    assert np.allclose(ours, fine, atol=1e-5)
    half = dm.fine_distances(a, b, pre_blur=1.0, detail_sigma=3.0, shift_step=0.5)
    assert (half <= ours + 1e-6).all()  # a finer grid contains the whole-pixel one
    assert (verify._blur, verify.DETAIL_SIGMA, verify.alignment_grid) == saved
