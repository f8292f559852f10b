"""The hard-negative fine-tuning experiment: which neighbours become negatives, how a batch is
built, and that fine-tuning gives a usable copy model."""

from __future__ import annotations

import numpy as np
import pytest

from dpscale.benchmarks import dedup_hard_negatives as hn


def test_hard_negatives_skip_likely_copies_and_keep_the_nearest_rest():
    sims = np.array([[0.95, 0.7, 0.6, 0.5],
                     [0.9, 0.85, 0.8, 0.4],
                     [0.99, 0.98, 0.97, 0.96]])
    index = np.array([[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12]])
    mirrored = np.array([[False, True, False, True]] * 3)
    pick, flip = hn.hard_negatives(sims, index, mirrored, tau=0.75, per_seed=2)
    np.testing.assert_array_equal(pick, [[6, 7], [4, -1], [-1, -1]])
    np.testing.assert_array_equal(flip, [[True, False], [True, False], [False, False]])


def test_a_hard_batch_holds_seeds_with_their_negatives_once_each_and_is_filled_up():
    n = 50
    pick = np.stack([(np.arange(n) + k) % n for k in (1, 2, 3)], 1)
    pick[0] = -1  # an image without hard negatives
    flip = np.zeros_like(pick, bool)
    flip[:, 1] = True  # each image's second negative is nearer mirrored
    for seed in range(20):
        members, flips = hn.hard_batch(np.random.default_rng(seed), pick, flip, batch=16)
        seeds = np.random.default_rng(seed).choice(n, 16 // 4, replace=False)  # the same first draw
        assert len(members) == 16 and len(np.unique(members)) == 16
        wanted = set(seeds.tolist()) | {int(j) for j in pick[seeds].ravel() if j >= 0}
        assert wanted <= set(members.tolist())
        assert set(members[flips].tolist()) <= {int(j) for j in pick[seeds, 1] if j >= 0}
        assert np.array_equal(members[:1], seeds[:1]) and not flips[0]


def test_fine_tuning_gives_unit_embeddings_and_random_batches_are_the_control():
    from dpscale.dedup import copy_model

    images = np.random.default_rng(1).integers(0, 256, (24, 32, 32, 3), dtype=np.uint8)
    params, _ = copy_model.train(images, copy_model.TrainSettings(epochs=1, batch=8, seed=0))
    pick = np.stack([(np.arange(24) + k) % 24 for k in (1, 2, 3)], 1)
    flip = np.zeros_like(pick, bool)
    tuned, info = hn.fine_tune(params, images, pick, flip, steps=2, batch=8, log_every=0)
    control, control_info = hn.fine_tune(params, images, pick, flip, steps=2, batch=8, log_every=0,
                                         random_batches=True)
    assert info["steps"] == 2 and not info["random_batches"] and control_info["random_batches"]
    e, c, before = (copy_model.embed(p, images) for p in (tuned, control, params))
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    assert np.abs(e - before).max() > 1e-4 and np.abs(e - c).max() > 1e-6


def test_tuning_refuses_neighbours_mined_from_other_images(tmp_path, monkeypatch):
    np.savez(tmp_path / "nn.npz", sims=np.zeros((3, 2)), index=np.zeros((3, 2), int), mirrored=np.zeros((3, 2), bool))

    class Fake:
        def ids(self, split):
            return np.arange(5, dtype=np.uint64)

    monkeypatch.setattr(hn, "_public", lambda data: (Fake(), np.zeros((5, 32, 32, 3), np.uint8)))
    with pytest.raises(SystemExit, match="mined from 3 images"):
        hn.tune("d", "m", str(tmp_path / "nn.npz"), str(tmp_path / "out"), tau=0.7, per_seed=1, steps=1,
                learning_rate=1e-3, seed=0, random_batches=False)
