"""The decision on a candidate pair: correlation after the best alignment.

The public image's central window (24x24 of 32x32) is compared with the private image
warped by every similarity transform of a grid (scale x translation), in the mirror state of
the view that made the pair a candidate. Both are luma, lightly blurred (sigma 1 px:
tolerates JPEG noise and sub-pixel misalignment); each window is normalised to zero mean and
unit variance, so brightness, contrast and colour casts do not count. Distance =
1 - correlation, minimised over the grid.

Grid (public coordinates x -> private coordinates centre + s (x - centre) + t): s from 0.78
to 1.12 (a crop keeping 78-95% of each side is s < 1, a zoom-out s > 1); whole-pixel t with
|t| <= 3 px, plus the room a crop leaves for s < 1. The central window keeps every sample
inside the private image, so a re-crop's new border never enters the comparison.

Two passes: every candidate at 16x16 (~20x cheaper, steps of 2 px), the survivors of
``COARSE_CUT`` at 32x32 on *detail* (luma minus its 3 px blur): on CIFAR-10 the plain luma
correlation accepted ships on a sea and planes in a sky that were different photos; their
detail does not correlate, a real duplicate's does. Why this and not the descriptor: unrelated pictures with the same
layout (a plane on plain sky) share a blurred thumbnail but not their aligned detail.
Tuned on realistic planted copies (``benchmarks/dedup_planted.py``), not on any list of
known duplicates.
"""

from __future__ import annotations

import functools

import numpy as np

from dpscale.dedup.descriptor import sampling_matrix

SIZE = 32
WINDOW = 24
SCALES = (0.78, 0.82, 0.86, 0.90, 0.93, 0.96, 1.0, 1.04, 1.08, 1.12)
MAX_SHIFT = 3
COARSE_CUT = 0.15  # coarse distance above which a pair cannot pass (planted copies: 99.5% <= 0.14)
THRESHOLD = 0.12  # default cut on the fine (detail) distance
DETAIL_SIGMA = 3.0  # px (of 32): the fine pass compares luma minus this blur
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


def _interpolation(positions: np.ndarray, size: int) -> np.ndarray:
    """[len(positions), size]: linear-interpolation weights at ``positions`` (clamped)."""
    p = np.clip(positions, 0, size - 1)
    lo = np.floor(p).astype(int)
    hi = np.minimum(lo + 1, size - 1)
    m = np.zeros((len(p), size), np.float32)
    m[np.arange(len(p)), lo] += 1 - (p - lo)
    m[np.arange(len(p)), hi] += p - lo
    return m


@functools.lru_cache(maxsize=4)
def alignment_grid(size: int) -> tuple[tuple[float, np.ndarray, np.ndarray], ...]:
    """Per scale: (scale, shifts [T], sampling matrices [T, window, size])."""
    window, step = size * WINDOW // SIZE, SIZE // size
    centre = (size - 1) / 2
    x = np.arange(size)[(size - window) // 2 : (size + window) // 2]
    grid = []
    for s in SCALES:
        limit = MAX_SHIFT + (int(16 * (1 - s)) if s < 1 else 0)
        limit = int(np.ceil(limit / step))
        shifts, mats = [], []
        for t in range(-limit, limit + 1):
            pos = centre + s * (x - centre) + t
            if pos.min() >= -0.01 and pos.max() <= size - 1 + 0.01:
                shifts.append(t)
                mats.append(_interpolation(pos, size))
        grid.append((s, np.array(shifts), np.stack(mats)))
    return tuple(grid)


def _blur(n: int, size: int) -> np.ndarray:
    """[size, n]: resample an axis of n pixels to SIZE with a 1 px Gaussian; 2x2 means at 16."""
    m = sampling_matrix(n, SIZE, 0.0, 1.0, 1.0)
    return m.reshape(size, SIZE // size, n).mean(1)


def _luma(images: np.ndarray, size: int, *, detail: bool = False) -> np.ndarray:
    """uint8 [n, H, W, C] -> blurred luma float32 [n, size, size].

    ``detail``: minus its own blur at ``DETAIL_SIGMA`` px (a band-pass), so what correlates is
    edges and texture, not the layout (sky above sea) that unrelated pictures share.
    """
    x = images.astype(np.float32) / 255.0
    y = x[..., 0] if x.shape[-1] == 1 else x[..., :3] @ _LUMA
    y = np.einsum("ij,njk,lk->nil", _blur(y.shape[1], size), y, _blur(y.shape[2], size), optimize=True)
    if detail:
        g = sampling_matrix(size, size, 0.0, 1.0, DETAIL_SIGMA * size / SIZE)
        y = y - np.einsum("ij,njk,lk->nil", g, y, g, optimize=True)
    return y


def _distances(public: np.ndarray, private: np.ndarray, size: int) -> np.ndarray:
    """1 - best correlation over the grid, for pairs (public[i], private[i]) of luma maps."""
    window = size * WINDOW // SIZE
    lo = (size - window) // 2
    p = public[:, lo : lo + window, lo : lo + window]
    p = p - p.mean(axis=(1, 2), keepdims=True)
    p = p / np.maximum(np.sqrt(np.square(p).sum(axis=(1, 2), keepdims=True)), 1e-6)
    n_pix = window * window
    best = np.full(len(p), np.inf, np.float32)
    for _, shifts, m in alignment_grid(size):
        t = len(shifts)
        rows = np.matmul(m[:, None], private[None])  # [T, b, window, size]
        w = rows.reshape(-1, size) @ m.reshape(-1, size).T  # [T*b*window, T*window]
        w = w.reshape(t, len(p), window, t, window)  # [ty, b, i, tx, j]
        dot = np.einsum("ybixj,bij->ybx", w, p, optimize=True)
        s1 = w.sum(axis=(2, 4))
        s2 = np.square(w).sum(axis=(2, 4))
        var = np.maximum(s2 - s1 * s1 / n_pix, 1e-12)
        best = np.minimum(best, (1 - dot / np.sqrt(var)).min(axis=(0, 2)))
    return best


def distances(
    public: np.ndarray, private: np.ndarray, mirrored: np.ndarray, *, batch: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """(coarse, fine) distances of pairs (public[i], private[i]); fine = inf where coarse fails.

    ``mirrored[i]``: compare with the private image's mirror (the candidate's view).
    """
    coarse = np.empty(len(public), np.float32)
    fine = np.full(len(public), np.inf, np.float32)
    for s in range(0, len(public), batch):
        a = public[s : s + batch]
        b = private[s : s + batch]
        m = np.asarray(mirrored[s : s + batch], bool)
        b = np.where(m[:, None, None, None], b[:, :, ::-1], b)
        coarse[s : s + len(a)] = _distances(_luma(a, SIZE // 2), _luma(b, SIZE // 2), SIZE // 2)
    keep = np.flatnonzero(coarse <= COARSE_CUT)
    for s in range(0, len(keep), batch // 4):
        idx = keep[s : s + batch // 4]
        b = private[idx]
        m = np.asarray(mirrored, bool)[idx]
        b = np.where(m[:, None, None, None], b[:, :, ::-1], b)
        fine[idx] = _distances(_luma(public[idx], SIZE, detail=True), _luma(b, SIZE, detail=True), SIZE)
    return coarse, fine
