"""Images of one ingested split, held in memory and read by index.

The Poisson sampler asks for arbitrary index sets every step. For data sets that
fit in RAM (CIFAR-10: 150 MB, Fashion-MNIST: 55 MB) one sequential read up front
is far cheaper than thousands of random reads per step; larger splits are read by
index from the ArrayRecord shards on every call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dpscale.data.dataset import IngestedDataset

#: Splits up to this many bytes of uint8 pixels are loaded into memory.
IN_MEMORY_LIMIT_BYTES = 4 * 2**30
_READ_CHUNK = 4096


@dataclasses.dataclass
class InMemorySplit:
    """``take(indices)`` -> (uint8 images, int32 labels); index -1 (padding) yields zeros."""

    dataset: IngestedDataset
    split: str
    images: np.ndarray | None
    labels: np.ndarray | None
    image_shape: tuple[int, ...]
    size: int

    @classmethod
    def load(cls, dataset: IngestedDataset, split: str) -> InMemorySplit:
        size = dataset.num_examples(split)
        shape = tuple(dataset.image_shape)
        images = labels = None
        if size * int(np.prod(shape)) <= IN_MEMORY_LIMIT_BYTES:
            images = np.empty((size, *shape), np.uint8)
            labels = np.empty((size,), np.int32)
            for start in range(0, size, _READ_CHUNK):
                stop = min(size, start + _READ_CHUNK)
                images[start:stop], labels[start:stop] = dataset.get(split, range(start, stop))
        return cls(dataset, split, images, labels, shape, size)

    def __len__(self) -> int:
        return self.size

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices)
        real = indices >= 0
        images = np.zeros((len(indices), *self.image_shape), np.uint8)
        labels = np.zeros((len(indices),), np.int32)
        if self.images is not None:
            images[real], labels[real] = self.images[indices[real]], self.labels[indices[real]]
        elif real.any():
            images[real], labels[real] = self.dataset.get(self.split, indices[real])
        return images, labels


#: ``normalize`` as a per-channel (x - mean) / std in pixel units: the preprocessing an
#: exported backbone (``stages.export_backbone``) records for a model trained here.
PIXEL_MEAN = 127.5
PIXEL_STD = 127.5


def normalize(images: np.ndarray) -> np.ndarray:
    """uint8 ``[0, 255]`` -> float32 ``[-1, 1]``: ``(x - PIXEL_MEAN) / PIXEL_STD``."""
    return (images.astype(np.float32) - np.float32(PIXEL_MEAN)) / np.float32(PIXEL_STD)


def image_inputs(
    dataset: IngestedDataset,
    *,
    resolution: int | None,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    backbone: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What an image run's inputs are made of besides the pixels: the classes, the stored image shape,
    the preprocessing (resize to ``resolution`` if any, then ``(x - mean) / std``) and the backbone.

    A run records it (``config.json``'s ``inputs``) so that scoring it on other data can refuse
    images of other classes or another shape, and a backbone directory replaced since.
    """
    return {
        "class_names": list(dataset.class_names),
        "image_shape": list(dataset.image_shape),
        "preprocessing": {
            "resolution": resolution,
            "resize": "bilinear" if resolution else None,
            "mean": [float(m) for m in mean],
            "std": [float(s) for s in std],
        },
        "backbone": backbone,
    }
