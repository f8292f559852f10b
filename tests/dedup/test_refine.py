"""The second decision: zoomed copies the grid cannot align pass; look-alikes and shears do not."""

import numpy as np
import pytest
from PIL import Image

from dpscale.dedup import descriptor, refine, verify


def scene(seed: int, size: int = 96, octaves=(4, 8, 16, 32, 64)) -> np.ndarray:
    """A photo-like random scene: bicubic noise at several scales (layout, edges, texture)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((size, size, 3), np.float32)
    for n in octaves:
        low = rng.integers(0, 256, (n, n, 3), dtype=np.uint8)
        up = Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC)
        out += (np.asarray(up, np.float32) - 128) / len(octaves) ** 0.5
    return np.clip(out + 128, 0, 255).astype(np.uint8)


def view(image: np.ndarray, left: int, top: int, side: int) -> np.ndarray:
    """The square ``side`` at (left, top), downsampled to 32x32 (how CIFAR-10 images were made)."""
    crop = Image.fromarray(image[top : top + side, left : left + side])
    return np.asarray(crop.resize((32, 32), Image.Resampling.BILINEAR))


def decide(public: np.ndarray, private: np.ndarray, mirrored: bool = False) -> refine.Refined:
    return refine.refine(public[None], private[None], np.array([mirrored]))


def test_a_zoomed_and_shifted_copy_fails_the_grid_and_passes_refinement():
    s = scene(0)
    public = view(s, 16, 16, 64)
    private = view(s, 27, 22, 48)  # zoomed in 1.33x and shifted: beyond the grid's 0.78-1.12
    _, fine = verify.distances(public[None], private[None], np.array([False]))
    assert not fine[0] <= verify.THRESHOLD
    r = decide(public, private)
    assert r.accepted[0], r
    assert 1.2 < r.scale[0] < 1.45 and r.anisotropy[0] < 1.2  # true: 1.33, 1.0


def test_the_private_image_is_compared_in_the_candidates_mirror_state():
    s = scene(1)
    public, private = view(s, 16, 16, 64), view(s, 20, 18, 56)[:, ::-1].copy()
    assert decide(public, private, mirrored=True).accepted[0]
    assert not decide(public, private, mirrored=False).accepted[0]


def test_unrelated_scenes_are_rejected():
    for seed in range(2, 8):
        r = decide(view(scene(seed), 16, 16, 64), view(scene(seed + 100), 16, 16, 64))
        assert not r.accepted[0]


def test_a_look_alike_with_the_same_layout_but_other_detail_is_rejected_by_detail():
    """Same coarse picture, independent edges and texture: the ECC cut alone would accept it."""
    layout = scene(10, octaves=(4,))
    detail_a = scene(11, octaves=(32, 64)).astype(np.float32) - 128
    detail_b = scene(12, octaves=(32, 64)).astype(np.float32) - 128
    a = np.clip(layout + 0.5 * detail_a, 0, 255).astype(np.uint8)
    b = np.clip(layout + 0.5 * detail_b, 0, 255).astype(np.uint8)
    r = decide(view(a, 16, 16, 64), view(b, 16, 16, 64))
    assert r.rank_distance[0] <= 1 - refine.MIN_RANK  # the blurred pictures do agree, in rank too
    assert r.detail_distance[0] > 1 - refine.MIN_DETAIL and not r.accepted[0]
    same = decide(view(a, 16, 16, 64), view(a, 18, 17, 60))
    assert same.accepted[0]  # the same construction with the same detail is a copy


def test_a_strongly_sheared_copy_is_not_a_re_crop():
    s = view(scene(20), 16, 16, 64)
    sheared = np.asarray(
        Image.fromarray(s).transform(
            (32, 32), Image.Transform.AFFINE, (1.0, 0.6, -9.0, 0.0, 1.0, 0.0), Image.Resampling.BILINEAR
        )
    )
    r = decide(s, sheared)
    assert r.anisotropy[0] > refine.MAX_ANISOTROPY and not r.accepted[0]


def test_each_cut_alone_rejects_a_pair_that_passes_the_others():
    ok = dict(ecc_distance=0.01, rank_distance=0.01, detail_distance=0.05, scale=1.1, anisotropy=1.1)
    lo, hi = refine.SCALE_RANGE
    breaks = {
        "rank_distance": 1 - refine.MIN_RANK + 0.01,
        "detail_distance": 1 - refine.MIN_DETAIL + 0.01,
        "anisotropy": refine.MAX_ANISOTROPY + 0.01,
        "scale": (lo - 0.01, hi + 0.01),
    }
    rows = [ok]
    for field, bad in breaks.items():
        for value in bad if isinstance(bad, tuple) else (bad,):
            rows.append({**ok, field: value})
    r = refine.Refined(**{f: np.array([row[f] for row in rows], np.float32) for f in ok})
    assert r.accepted.tolist() == [True] + [False] * (len(rows) - 1)


def test_a_zoom_out_beyond_the_re_crop_limit_is_fitted_and_refused():
    s = scene(0, size=128)
    r = decide(view(s, 34, 34, 60), view(s, 8, 8, 112))  # the public image is ~half the private one
    if np.isfinite(r.rank_distance[0]):  # whatever ECC converges to, it is not a re-crop in range
        assert r.scale[0] < refine.SCALE_RANGE[0] or r.detail_distance[0] > 1 - refine.MIN_DETAIL
    assert not r.accepted[0]


def test_a_strong_non_linear_contrast_change_is_accepted_where_pearson_would_refuse_it():
    """Gamma 3 keeps the pixels' order and the detail, not the linear correlation."""
    s = scene(1)
    b = (255 * (view(s, 18, 17, 60).astype(np.float32) / 255) ** 3.0).astype(np.uint8)
    r = decide(view(s, 16, 16, 64), b)
    assert r.ecc_distance[0] > 0.04 and r.accepted[0]


@pytest.mark.parametrize("value", [0, 128, 255])
def test_flat_images_are_no_evidence(value):
    flat = np.full((32, 32, 3), value, np.uint8)
    r = decide(flat, flat)
    assert not r.accepted[0]


def test_grey_images_and_other_sizes_are_compared_at_32x32():
    s = view(scene(30), 16, 16, 64)
    grey = (s.astype(np.float32) @ np.array([0.299, 0.587, 0.114]))[..., None].astype(np.uint8)
    assert decide(grey, grey).accepted[0]
    big = scene(31)
    public = np.asarray(Image.fromarray(big[16:80, 16:80]).resize((64, 64)))
    zoomed = np.asarray(Image.fromarray(big[21:74, 19:72]).resize((64, 64)))  # zoom 1.21
    assert decide(public, zoomed).accepted[0]
    assert not decide(public, np.asarray(Image.fromarray(scene(32)[16:80, 16:80]))).accepted[0]
    tiny = np.random.default_rng(0).integers(0, 256, (8, 8, 1), dtype=np.uint8)
    decide(tiny, tiny)  # digits-sized images: no error (what they decide is the grid's business)


class _Images:
    """The two methods of ``IngestedDataset`` that verification reads."""

    def __init__(self, images):
        self.images = np.stack(images)
        self.image_shape = self.images.shape[1:]

    def get(self, split, index):
        return self.images[np.asarray(index)], None


def test_verification_refines_only_what_the_grid_rejects_and_says_which_check_decided():
    from dpscale.dedup.join import Candidate, verify_candidates

    s, other = scene(40), scene(41)
    public = _Images([view(s, 16, 16, 64), view(s, 16, 16, 64), view(other, 16, 16, 64)])
    private = _Images([view(s, 17, 16, 62), view(s, 27, 22, 48), view(s, 27, 22, 48)[:, ::-1]])
    mirrored_view = descriptor.NUM_VIEWS // 2  # the whole image, mirrored
    cands = [
        Candidate("train", 0, 0, "test", 0, 0, 0.9),
        Candidate("train", 1, 0, "test", 1, 0, 0.9),
        Candidate("train", 2, 0, "test", 1, 0, 0.85),
        Candidate("train", 1, 0, "test", 2, mirrored_view, 0.9),  # the zoomed copy, flipped
        Candidate("train", 1, 0, "test", 2, 0, 0.9),
    ]  # the same pair in the wrong mirror state
    plain, zoomed, unrelated, flipped, wrong_state = verify_candidates(
        cands, public, private, threshold=verify.THRESHOLD
    )
    assert flipped.accepted and flipped.decided_by == "refined" and not wrong_state.accepted
    assert plain.accepted and plain.decided_by == "grid" and plain.ecc_distance == float("inf")
    assert zoomed.accepted and zoomed.decided_by == "refined"
    assert zoomed.fine_distance > verify.THRESHOLD and zoomed.detail_distance <= 1 - refine.MIN_DETAIL
    assert not unrelated.accepted and unrelated.decided_by == ""
    _, zoomed_off, *_ = verify_candidates(cands, public, private, threshold=verify.THRESHOLD, refine_rejected=False)
    assert not zoomed_off.accepted and zoomed_off.ecc_distance == float("inf")


def test_closest_prefers_grid_decisions_then_the_best_refined_detail():
    from dpscale.dedup.join import Candidate, Match, closest

    def match(private_index, fine, detail, by_grid):
        c = Candidate("train", 0, 0, "test", private_index, 0, 0.9)
        if by_grid:
            return Match(c, 0.05, fine, True)
        return Match(c, 0.2, fine, True, ecc_distance=0.01, rank_distance=0.01, detail_distance=detail)

    weak = match(0, 0.13, 0.199, False)
    strong = match(1, float("inf"), 0.01, False)
    grid = match(2, 0.11, float("inf"), True)
    assert closest([weak, strong]) is strong
    assert closest([weak, strong, grid]) is grid
