"""Nearest public images of each private image, by blocked matrix products.

Exact search, no index: a block of private views times a block of public descriptors is one
BLAS call, and only the ``k`` best public images per private image survive each block, so
memory is (block x block) and the result is (private images x k), whatever the data size.
Work = private views x public images x DIM multiply-adds: it grows with the number of images
on each side, never with candidate pairs. On a cluster the (private block, public block)
products are independent tasks whose top-k lists merge per private image (``merge``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

PUBLIC_BLOCK = 4096  # public rows per matrix product


@dataclasses.dataclass(frozen=True)
class TopK:
    """Per private image (rows): the k most similar public rows, their best view."""

    similarity: np.ndarray  # float32 [m, k], descending; -inf = empty
    public: np.ndarray  # int64 [m, k] public row numbers (global)
    view: np.ndarray  # int8 [m, k]


def search(
    private_views: np.ndarray, public: np.ndarray, k: int, *, offset: int = 0, block: int = PUBLIC_BLOCK
) -> TopK:
    """Top ``k`` rows of ``public`` [n, D] for each private image ([V, m, D] views).

    A pair's similarity is its best view's; public row numbers start at ``offset``.
    """
    v, m, d = private_views.shape
    q = np.ascontiguousarray(private_views.reshape(v * m, d), dtype=np.float32)
    best = TopK(np.full((m, 0), -np.inf, np.float32), np.zeros((m, 0), np.int64), np.zeros((m, 0), np.int8))
    for start in range(0, len(public), block):
        p = np.asarray(public[start : start + block], np.float32)
        s = (q @ p.T).reshape(v, m, len(p))
        view = s.argmax(0).astype(np.int8)
        s = s.max(0)
        kk = min(k, s.shape[1])
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        best = merge(
            best, TopK(np.take_along_axis(s, part, 1), part + offset + start, np.take_along_axis(view, part, 1)), k
        )
    return best


def merge(a: TopK, b: TopK, k: int) -> TopK:
    """The ``k`` best of two top lists for the same private rows (ties: lower public row)."""
    s = np.concatenate([a.similarity, b.similarity], 1)
    i = np.concatenate([a.public, b.public], 1)
    v = np.concatenate([a.view, b.view], 1)
    order = np.lexsort((i, -s), axis=1)[:, :k] if s.size else np.zeros((len(s), 0), int)
    return TopK(np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1), np.take_along_axis(v, order, 1))
