"""A second cue of the copy decision: how many cells of two images are each other's nearest.

Why: the copy embedding's cosine, even background-normalised (``dedup.copy_score``), ranks
many look-alikes of common CIFAR-10 scenes (a plane on an empty sky, a frog on leaves) above
real duplicates that were re-cropped and recoloured. Here each image is cut into the 16 x 16
cells of the copy model's early feature maps (``copy_model.LocalFeatures``: 2 px apart at 32
px, each seeing 5 x 5 px, colour- and contrast-robust like the model) and a pair's *agreement*
is the fraction of the public image's cells whose nearest cell in the private image has it as
its own nearest (mutual nearest neighbours; no geometry, so re-crops and shifts keep their
matches). A copy
keeps most of its cells one to one; a look-alike's plain background matches many cells at
once and few of them mutually.

Textured images (grass, frog skin) agree more with *every* image, so the copy decision uses
an agreement relative to the private image's own candidates (``copy_score.decide``): the
pair's agreement minus the median over the private image's nearest public images.
Measured on the by-eye census of CIFAR-10's real duplicates (``benchmarks/results/dedup.md``).
Written here: mutual nearest neighbours over dense cells are a few array operations; no
maintained library matches dense local features of an arbitrary JAX model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.dedup import copy_model
from dpscale.progress import progress_bar

BATCH = 256  # pairs (or images) per jitted call: one compiled shape, ~70 MB of similarities
PAIRS = 1280  # candidate pairs matched together: ~170 MB of cells, whatever the candidates' width


_local_features = jax.jit(copy_model.LocalFeatures().apply)


def cells(params: Any, thumbnails: np.ndarray) -> np.ndarray:
    """Unit feature vectors of every cell: uint8 [n, 32, 32, 3] thumbnails (``copy_model.thumbnails``)
    -> float32 [n, cells, channels]. ``params``: ``copy_model.local_params`` of a copy model."""
    out = []
    for lo in range(0, len(thumbnails), BATCH):
        chunk = thumbnails[lo : lo + BATCH].astype(np.float32) / 255.0
        n = len(chunk)
        if n < BATCH:  # keep one compiled shape
            chunk = np.concatenate([chunk, np.zeros((BATCH - n, *chunk.shape[1:]), chunk.dtype)])
        maps = _local_features(params, chunk)
        maps = maps.reshape(maps.shape[0], -1, maps.shape[-1])
        out.append(np.asarray(maps / jnp.maximum(jnp.linalg.norm(maps, axis=-1, keepdims=True), 1e-6))[:n])
    if not out:
        return np.zeros((0, 0, 0), np.float32)
    return np.concatenate(out)


@jax.jit
def _mutual(a: jax.Array, b: jax.Array) -> jax.Array:
    similarity = jnp.einsum("npc,nqc->npq", a, b)
    a_to_b, b_to_a = similarity.argmax(2), similarity.argmax(1)
    back = jnp.take_along_axis(b_to_a, a_to_b, axis=1)
    return (back == jnp.arange(a.shape[1])[None]).mean(1)


def mutual_fraction(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per pair i: the fraction of a[i]'s cells that are mutual nearest neighbours of b[i]'s
    (cosine over unit cells; float32 [n, cells, channels] each) -> float32 [n] in [0, 1]."""
    if a.shape != b.shape:
        raise ValueError(f"cell arrays differ in shape: {a.shape} and {b.shape}")
    out = np.empty(len(a), np.float32)
    for lo in range(0, len(a), BATCH):
        x, y = a[lo : lo + BATCH], b[lo : lo + BATCH]
        n = len(x)
        if n < BATCH:
            pad = np.zeros((BATCH - n, *x.shape[1:]), x.dtype)
            x, y = np.concatenate([x, pad]), np.concatenate([y, pad])
        out[lo : lo + n] = np.asarray(_mutual(x, y))[:n]
    return out


class Agreement:
    """The agreement of candidate pairs, as ``copy_score.decide`` asks for it: private rows,
    their candidates' public indices and mirror states -> fractions of the same shape.
    Holds both sides' thumbnails (3 KB per image) and the copy model's early parameters."""

    def __init__(
        self, params: Any, public_thumbnails: np.ndarray, private_thumbnails: np.ndarray, *, show_progress: bool = False
    ) -> None:
        self._params = copy_model.local_params(params)
        self._public, self._private = public_thumbnails, private_thumbnails
        self._show_progress = show_progress

    def __call__(self, rows: np.ndarray, public_index: np.ndarray, mirrored: np.ndarray) -> np.ndarray:
        width = public_index.shape[1]
        row_of = np.repeat(np.arange(len(rows)), width)
        flat_index, flat_mirrored = public_index.ravel(), np.asarray(mirrored, bool).ravel()
        out = np.empty(len(flat_index), np.float32)
        with progress_bar("copy: local matches", total=len(out), enabled=self._show_progress) as bar:
            for lo in range(0, len(out), PAIRS):
                part = slice(lo, lo + PAIRS)
                unique_rows, position = np.unique(row_of[part], return_inverse=True)
                private = self._private[rows[unique_rows]]
                # both mirror states of each private image once; each candidate takes its own
                private_cells = cells(self._params, np.concatenate([private, private[:, :, ::-1]]))
                which = position + len(unique_rows) * flat_mirrored[part]
                public_cells = cells(self._params, self._public[flat_index[part]])
                out[part] = mutual_fraction(public_cells, private_cells[which])
                bar.advance(len(which))
        return out.reshape(public_index.shape)
