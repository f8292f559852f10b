"""What the train loop feeds the DP step: fixed-shape micro-batches for a sampled batch.

Three feeds, one interface (``microbatches(batch, step)``):

* ``ImageFeed`` reads images by index, normalises them and makes K augmented
  views per example on device: leaves ``[b, K, H, W, C]`` and labels ``[b, K]``.
* ``ActivationFeed`` gathers activations cached at a cut (``V`` views per example)
  by index and takes K of the V views: the same leaves as ``ImageFeed``, so the
  layers above the cut train with the images mode's DP step.
* ``FeatureFeed`` gathers cached backbone features by index: ``[b, d]``, their
  squared norms ``[b]`` (computed once, see ``privacy/linear.py``) and labels
  ``[b]`` (no augmentation axis: the features are fixed).

Padded slots (index -1) carry zeros and mask 0; the DP step gives them weight 0.

Both read only the rows their ``BatchPlacement`` says this process's devices hold
and assemble them into global, data-sharded arrays: with several processes
(multi-host) each one reads a slice of every micro-batch. Augmentation runs on the
global array with the shared key (threefry is partitionable), so every view is the
one a single process would make.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dpscale.data.augment import augment_views
from dpscale.data.image_data import InMemorySplit, normalize
from dpscale.distributed import BatchPlacement
from dpscale.privacy.sampling import SampledBatch

Microbatch = tuple[dict[str, Any], jax.Array]


def resize_views(views: jax.Array, resolution: int | None) -> jax.Array:
    """``[..., H, W, C]`` -> ``[..., R, R, C]`` (bilinear); a no-op when ``resolution`` is None.

    Crops and flips happen at the data's own resolution, then views are resized to
    the backbone's (bilinear resizing is linear, so it commutes with normalisation).
    """
    if resolution is None or views.shape[-3:-1] == (resolution, resolution):
        return views
    shape = (*views.shape[:-3], resolution, resolution, views.shape[-1])
    return jax.image.resize(views, shape, method="bilinear")


class ImageFeed:
    def __init__(
        self,
        split: InMemorySplit,
        *,
        augmult: int,
        pad: int,
        flip: bool,
        key: jax.Array,
        normalize_fn: Callable[[np.ndarray], Any] = normalize,
        resolution: int | None = None,
        placement: BatchPlacement | None = None,
    ) -> None:
        self.split = split
        self.augmult, self.pad, self.flip = augmult, pad, flip
        self.normalize_fn, self.resolution = normalize_fn, resolution
        self.placement = placement or BatchPlacement(None)
        self._key = self.placement.replicate(key)

    def microbatches(self, batch: SampledBatch, step: int) -> list[Microbatch]:
        step_key = jax.random.fold_in(self._key, step)
        size = batch.indices.shape[1]
        rows = self.placement.rows(size)
        out = []
        for m in range(batch.num_microbatches):
            images, labels = self.split.take(batch.indices[m][rows])
            labels = np.repeat(labels[:, None], self.augmult, axis=1)
            images, labels, mask = self.placement.put(
                (np.asarray(self.normalize_fn(images)), labels, batch.mask[m][rows]), size
            )
            views = augment_views(
                jax.random.fold_in(step_key, m),
                images,
                views=self.augmult,
                pad=self.pad,
                flip=self.flip,
            )
            views = resize_views(views, self.resolution)
            out.append(({"image": views, "label": labels}, mask))
        return out


class FeatureFeed:
    def __init__(self, features: np.ndarray, labels: np.ndarray, placement: BatchPlacement | None = None) -> None:
        self.placement = placement or BatchPlacement(None)
        self.features = np.asarray(features, np.float32)
        self.labels = np.asarray(labels, np.int32)
        # A non-finite row gives a non-finite norm, which the clipped sum treats as non-finite; its
        # features are zeroed once here, so no step carries a NaN into the product.
        with np.errstate(over="ignore", invalid="ignore"):
            self.sq_norms = np.einsum("ij,ij->i", self.features, self.features)
        finite = np.isfinite(self.sq_norms)
        if not finite.all():
            self.features = np.where(finite[:, None], self.features, np.float32(0))

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Features, squared norms and labels of ``indices``; padded slots (-1) are zeros."""
        real = indices >= 0
        safe = np.where(real, indices, 0)
        feats = self.features[safe]
        feats[~real] = 0.0
        return {
            "features": feats,
            "features_sq_norm": np.where(real, self.sq_norms[safe], 0.0).astype(np.float32),
            "label": np.where(real, self.labels[safe], 0).astype(np.int32),
        }

    def microbatches(self, batch: SampledBatch, step: int) -> list[Microbatch]:
        del step
        size = batch.indices.shape[1]
        rows = self.placement.rows(size)
        return [
            self.placement.put((self.take(batch.indices[m][rows]), batch.mask[m][rows]), size)
            for m in range(batch.num_microbatches)
        ]


class ActivationFeed:
    """Cached activations ``[N, V, h, w, c]`` -> micro-batches of K views per example.

    With K = V every cached view is used; with K < V each example gets K distinct views drawn
    afresh every step from the augmentation stream (the same draw in every process).
    """

    def __init__(
        self,
        activations: np.ndarray,
        labels: np.ndarray,
        *,
        augmult: int,
        key: jax.Array,
        placement: BatchPlacement | None = None,
    ) -> None:
        if not 1 <= augmult <= activations.shape[1]:
            raise ValueError(f"augmult {augmult} needs 1 to {activations.shape[1]} cached views")
        self.activations, self.labels = activations, np.asarray(labels, np.int32)
        self.augmult = augmult
        self.placement = placement or BatchPlacement(None)
        self._key = key

    def __len__(self) -> int:
        return len(self.labels)

    def _views(self, key: jax.Array, size: int) -> np.ndarray:
        """``[size, K]`` view indices: all V in order, or K distinct ones per example drawn with ``key``."""
        available = self.activations.shape[1]
        if self.augmult == available:
            return np.broadcast_to(np.arange(available), (size, available))
        draws = np.asarray(jax.random.uniform(key, (size, available)))
        return np.argsort(draws, axis=1)[:, : self.augmult]

    def microbatches(self, batch: SampledBatch, step: int) -> list[Microbatch]:
        size = batch.indices.shape[1]
        rows = self.placement.rows(size)
        out = []
        for m in range(batch.num_microbatches):
            key = jax.random.fold_in(jax.random.fold_in(self._key, step), m)
            views = self._views(key, size)[rows]  # drawn for the whole micro-batch, then this process's rows
            indices = batch.indices[m][rows]
            real = indices >= 0
            safe = np.where(real, indices, 0)
            images = self.activations[safe[:, None], views]
            images[~real] = 0.0
            labels = np.repeat(np.where(real, self.labels[safe], 0)[:, None], self.augmult, axis=1)
            images, labels, mask = self.placement.put((images, labels, batch.mask[m][rows]), size)
            out.append(({"image": images, "label": labels}, mask))
        return out
