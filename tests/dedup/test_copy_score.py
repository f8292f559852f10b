"""The copy-embedding decision of dedup: nearest public images, backgrounds, normalised scores."""

from __future__ import annotations

import numpy as np
import pytest

from dpscale.dedup.copy_score import CopySettings, decide, normalised, top_k


def test_top_k_takes_each_reference_at_the_better_mirror_state_and_can_exclude_itself():
    ref = np.eye(4, dtype=np.float32)
    queries = np.array([[1, 0, 0, 0], [0, 0.6, 0.8, 0]], np.float32)
    mirror = np.array([[0, 0, 0, 1], [0, 0.8, 0.6, 0]], np.float32)
    sims, index, mirrored = top_k(queries, mirror, ref, k=3, block=1)
    assert index[0, :2].tolist() in ([0, 3], [3, 0]) and sims[0, 0] == sims[0, 1] == 1.0
    assert set(index[1, :2].tolist()) == {1, 2} and index[1, 2] in (0, 3)  # 0 and 3 tie at 0
    np.testing.assert_allclose(sims[1], [0.8, 0.8, 0.0])
    assert mirrored[1, index[1].tolist().index(1)] and not mirrored[1, index[1].tolist().index(2)]
    sims, index, _ = top_k(ref, ref, ref, k=2, exclude_self=True)
    assert (index != np.arange(4)[:, None]).all() and (sims == 0.0).all()


def test_normalised_scores_lower_a_pair_in_a_crowded_neighbourhood():
    score = normalised(np.array([0.9, 0.9]), np.array([0.2, 0.8]), np.array([0.2, 0.8]), beta=1.0)
    np.testing.assert_allclose(score, [0.7, 0.1])
    np.testing.assert_allclose(normalised(np.array([0.9]), np.array([0.8]), np.array([0.8]), 0.0), [0.9])


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_decide_accepts_a_twin_but_not_a_look_alike_of_a_crowded_scene():
    rng = np.random.default_rng(0)
    spread = _unit(rng.normal(size=(200, 32)))  # unrelated public images
    scene = rng.normal(size=32)
    crowd = _unit(scene + 0.08 * rng.normal(size=(30, 32)))  # 30 public look-alikes of one scene
    public = np.concatenate([spread, crowd])
    twin = _unit(spread[7:8] + 0.05 * rng.normal(size=(1, 32)))  # a copy of public 7
    look_alike = _unit(scene[None] + 0.08 * rng.normal(size=(1, 32)))
    mirrored_copy = _unit(spread[11:12] + 0.05 * rng.normal(size=(1, 32)))
    private = np.concatenate([twin, look_alike, _unit(rng.normal(size=(1, 32)))])
    private_mirror = np.concatenate([_unit(rng.normal(size=(2, 32))), mirrored_copy])
    cos_twin = float(twin[0] @ spread[7])
    cos_look_alike = float((public @ look_alike[0]).max())
    assert cos_look_alike > cos_twin  # the raw cosine prefers the look-alike ...
    pairs = decide(
        public, public, private, private_mirror, CopySettings(cut=0.5, k=5, beta=1.0, candidates=10, local_weight=0.0)
    )
    accepted = {(int(a), int(b)) for a, b in zip(pairs.private, pairs.public)}
    assert accepted == {(0, 7), (2, 11)}  # ... the normalised score does
    assert pairs.mirrored[list(pairs.private).index(2)] and not pairs.mirrored[list(pairs.private).index(0)]
    assert pairs.best_public[0] == 7 and pairs.best_score[1] < 0.5 <= pairs.best_score[0]


def test_the_candidates_widen_while_every_one_is_accepted():
    """A private image with 30 public copies and 10 candidates: all 30 are found, nearest first."""
    rng = np.random.default_rng(1)
    spread = _unit(rng.normal(size=(200, 32)))
    photo = rng.normal(size=32)
    public = np.concatenate([spread[:100], _unit(photo + 0.05 * rng.normal(size=(30, 32))), spread[100:]])
    private = _unit(np.concatenate([photo[None] + 0.05 * rng.normal(size=(1, 32)), spread[5:6]]))
    pairs = decide(
        public, public, private, private, CopySettings(cut=0.9, k=5, beta=0.0, candidates=10, local_weight=0.0)
    )
    assert sorted(pairs.public[pairs.private == 0].tolist()) == list(range(100, 130))
    assert pairs.public[pairs.private == 1].tolist() == [5] and pairs.private.tolist() == sorted(pairs.private)
    assert (np.diff(-pairs.cosine[pairs.private == 0]) >= 0).all()  # nearest first
    everything = decide(public, public, private, private, CopySettings(cut=-1.9, k=5, candidates=10, local_weight=0.0))
    assert len(everything.public) == 2 * len(public)  # widened until the whole public set


def test_copy_settings_refuse_impossible_values():
    with pytest.raises(ValueError, match="k must be"):
        CopySettings(k=30, candidates=20)
    with pytest.raises(ValueError, match="beta"):
        CopySettings(beta=-1)
    with pytest.raises(ValueError, match="one private"):
        two = _unit(np.ones((2, 4)))
        decide(two, two, two[:0], two[:0], CopySettings(local_weight=0.0))
    with pytest.raises(ValueError, match="two public"):
        one = _unit(np.ones((1, 4)))
        decide(one, one, one, one, CopySettings(local_weight=0.0))


def test_the_local_agreement_relative_to_the_candidates_decides_between_close_cosines():
    """Ten public images about as near as each other: the one whose cells agree more than the
    private image's other candidates' passes; a private image whose candidates all agree much
    (a textured scene) gets no lift from it."""
    rng = np.random.default_rng(2)
    scene = rng.normal(size=32)
    public = np.concatenate([_unit(rng.normal(size=(100, 32))), _unit(scene + 0.3 * rng.normal(size=(10, 32)))])
    private = _unit(np.stack([scene, scene]))
    calls = []

    def local(rows, index, mirrored):
        calls.append(index.shape)
        out = np.where(rows[:, None] == 0, 0.3, 0.8).astype(np.float32) * np.ones(index.shape, np.float32)
        out[(rows == 0)[:, None] & (index == 104)] = 0.7  # private 0's cells match public 104's
        return out

    plain = decide(
        public, public, private, private, CopySettings(cut=0.9, k=5, beta=0.5, candidates=10, local_weight=0.0)
    )
    assert len(plain.public) == 0
    pairs = decide(
        public,
        public,
        private,
        private,
        CopySettings(cut=0.9, k=5, beta=0.5, local_weight=2.0, candidates=10),
        local_agreement=local,
    )
    assert pairs.private.tolist() == [0] and pairs.public.tolist() == [104]
    # score = normalised + 2 x (0.7 - the median of private 0's agreements, 0.3)
    every = decide(
        public, public, private, private, CopySettings(cut=-1.9, k=5, beta=0.5, candidates=10, local_weight=0.0)
    )
    normalised_104 = every.score[(every.private == 0) & (every.public == 104)]
    assert pairs.score[0] == pytest.approx(normalised_104[0] + 0.8, abs=1e-5) and pairs.best_public[0] == 104
    assert pairs.best_score[1] == pytest.approx(plain.best_score[1], abs=1e-5)  # no lift for private 1
    assert calls[0] == (2, 10) and all(rows == 1 for rows, _ in calls[1:])  # every candidate, once
    with pytest.raises(ValueError, match="local agreement"):
        decide(public, public, private, private, CopySettings(local_weight=1.0))
    with pytest.raises(ValueError, match="shape"):
        decide(
            public,
            public,
            private,
            private,
            CopySettings(local_weight=1.0, k=5, candidates=10),
            local_agreement=lambda rows, index, mirrored: np.zeros(len(rows)),
        )


def test_a_widened_search_keeps_each_private_images_first_background():
    """Private 1's farthest candidate agrees most: it is searched again, wider; its wider
    candidates are scored against the median of its own first 10 (0.2), not of the 40 and not
    private 0's (0.5)."""
    rng = np.random.default_rng(4)
    public = _unit(rng.normal(size=(60, 16)))
    private = _unit(rng.normal(size=(2, 16)))
    first = {}

    def local(rows, index, mirrored):
        if not first:
            first.update(zip(rows.tolist(), index.tolist()))
        out = np.where(rows[:, None] == 0, 0.5, 0.2).astype(np.float32) * np.ones(index.shape, np.float32)
        for r, row in enumerate(rows.tolist()):
            for c, j in enumerate(index[r].tolist()):
                if row == 0:
                    continue  # private 0 agrees as much with all its candidates: its median, 0.5
                if row == 1 and j == first[1][-1]:
                    out[r, c] = 1.0  # private 1's farthest first candidate
                elif j not in first[row]:
                    out[r, c] = 0.9  # the wider candidates agree a lot
        return out

    settings = CopySettings(cut=1.0, k=5, beta=0.0, local_weight=2.0, candidates=10)
    pairs = decide(public, public, private, private, settings, local_agreement=local)
    cos = np.maximum(private @ public.T, private @ public.T)
    got = {int(j): float(sc) for i, j, sc in zip(pairs.private, pairs.public, pairs.score) if i == 1}
    assert first[1][-1] in got and not any(i == 0 for i in pairs.private)
    for j, sc in got.items():  # median of the first pass is 0.2: a wider candidate scores cos + 2 x 0.7
        want = cos[1, j] + 2.0 * ((1.0 if j == first[1][-1] else 0.9 if j not in first[1] else 0.2) - 0.2)
        assert sc == pytest.approx(want, abs=1e-5)
    assert any(j not in first[1] for j in got)  # the wider search found more


def test_copy_settings_check_the_local_weight_and_widen_the_cut_with_it():
    with pytest.raises(ValueError, match="local weight"):
        CopySettings(local_weight=-0.5)
    with pytest.raises(ValueError, match=r"copy cut must be in \(-2, 2\) at local weight 0"):
        CopySettings(cut=2.5, local_weight=0.0)
    with pytest.raises(ValueError, match="copy cut"):
        CopySettings(cut=4.5, local_weight=2.0)
    assert CopySettings(cut=2.5, local_weight=1.0).cut == 2.5
