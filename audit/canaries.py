"""What an audit trains on: a random subset D of an ingested split, plus canaries.

Canaries: ``ood`` is an image that lights only the pixels least used by D (blank in all
of D if possible) at a large norm, so its gradient is always clipped and points where the
data barely pushes: the strongest input-space canary for these models. ``mislabelled`` is a
real image from outside D with a wrong label. Features are pixels / 255 (not the train
stage's [-1, 1]) so that a blank pixel stays 0 and carries no data gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from dpscale.data.dataset import IngestedDataset
from dpscale.data.image_data import InMemorySplit
from dpscale.errors import DataError

CanaryKind = Literal["ood", "mislabelled"]
_OOD_PIXELS = 16
_OOD_NORM = 10.0


@dataclasses.dataclass(frozen=True)
class Data:
    """D (the first ``num_examples`` rows) followed by the canary rows, as features in [0, 1]."""

    features: np.ndarray
    labels: np.ndarray
    num_examples: int
    image_shape: tuple[int, ...] | None = None  # of one row before flattening (the white-box CNN needs it)

    @property
    def canary_rows(self) -> np.ndarray:
        return np.arange(self.num_examples, len(self.labels))


def make_canaries(
    features: np.ndarray,
    labels: np.ndarray,
    spare: tuple[np.ndarray, np.ndarray],
    *,
    kind: CanaryKind,
    count: int,
    num_classes: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` canaries for the data set (features, labels); ``spare`` are real rows outside it."""
    if kind == "mislabelled":
        if len(spare[1]) < count:
            raise DataError(f"need {count} examples outside D for mislabelled canaries")
        shift = rng.integers(1, num_classes, size=count)
        return spare[0][:count], ((spare[1][:count] + shift) % num_classes).astype(labels.dtype)
    pixels = np.argsort(features.sum(axis=0), kind="stable")[: min(_OOD_PIXELS, features.shape[1])]
    directions = np.ones((count, len(pixels))) if count == 1 else rng.normal(size=(count, len(pixels)))
    directions *= _OOD_NORM / np.linalg.norm(directions, axis=1, keepdims=True)
    canaries = np.zeros((count, features.shape[1]), np.float32)
    canaries[:, pixels] = directions
    return canaries, rng.integers(0, num_classes, size=count).astype(labels.dtype)


def load_data(
    data: str, *, split: str, num_examples: int, kind: CanaryKind, canaries: int, rng: np.random.Generator
) -> tuple[Data, int]:
    """A random D of ``num_examples`` rows of the ingested ``split``, plus ``canaries`` canary rows."""
    dataset = IngestedDataset(data)
    if split not in dataset.splits:
        raise DataError(f"{data!r} has no split {split!r} (has {dataset.splits})")
    rows = InMemorySplit.load(dataset, split)
    spare = canaries if kind == "mislabelled" else 0
    if num_examples + spare > len(rows):
        raise DataError(
            f"split {split!r} has {len(rows)} examples, fewer than --num-examples {num_examples}"
            + (f" plus {spare} for the mislabelled canaries" if spare else "")
        )
    order = rng.permutation(len(rows))[: num_examples + spare]
    images, labels = rows.take(order)
    features = images.reshape(len(order), -1).astype(np.float32) / 255.0
    data = build_data(
        features,
        labels.astype(np.int32),
        num_examples=num_examples,
        canaries=canaries,
        kind=kind,
        num_classes=dataset.num_classes,
        rng=rng,
    )
    return dataclasses.replace(data, image_shape=tuple(images.shape[1:])), dataset.num_classes


def build_data(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    num_examples: int,
    canaries: int,
    kind: CanaryKind,
    num_classes: int,
    rng: np.random.Generator,
) -> Data:
    """D = the first ``num_examples`` rows; canaries from the rows after them (mislabelled) or made up."""
    d_x, d_y = features[:num_examples], labels[:num_examples]
    c_x, c_y = make_canaries(
        d_x,
        d_y,
        (features[num_examples:], labels[num_examples:]),
        kind=kind,
        count=canaries,
        num_classes=num_classes,
        rng=rng,
    )
    return Data(np.concatenate([d_x, c_x]).astype(np.float32), np.concatenate([d_y, c_y]), num_examples)
