"""Per-element work of ``dpscale dedup``: signatures into LSH buckets, and the bucket join.

Plain functions over small numpy batches, so ``pipelines.dedup`` only wires them:

* ``signature_entries``: one read task (a range of one split) -> its images' embeddings
  (public: one per image; private: every view), cut into batches keyed by
  ``(band, partition)``. A partition is a hash of the band value modulo the number of
  partitions, so one group holds many buckets and Beam moves a few thousand arrays
  instead of one element per image and band; at 300M images the partitions grow with
  the data and the groups stay small.
* ``join_group``: within one group, public and private entries that share a band value
  are candidates; only those get the exact distance, and pairs under the threshold
  come out. No worker ever compares all pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from dpscale.dedup import image_hash as ih

PUBLIC, PRIVATE = "public", "private"
_BLOCK = 2048  # public rows per distance block
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing spreads SimHash values evenly


@dataclasses.dataclass(frozen=True)
class ReadTask:
    """Examples ``start:stop`` of ``split``; ``shard`` is the public shard they sit in."""

    side: str
    split: str
    start: int
    stop: int
    shard: int = 0


@dataclasses.dataclass(frozen=True)
class Entries:
    """Embeddings of one side in one group: parallel arrays, one row per (image, view)."""

    side: str
    split: str
    index: np.ndarray  # int64 example index within the split
    shard: np.ndarray  # int32 public shard of the example (0 for private)
    view: np.ndarray  # int16 view number (0 for public)
    value: np.ndarray  # uint64 band value
    vector: np.ndarray  # float16 [n, DIM]
    mean: np.ndarray  # float32 mean luma


@dataclasses.dataclass(frozen=True)
class Match:
    """A public example within the threshold of a private one (through ``view``)."""

    public_split: str
    public_index: int
    public_shard: int
    private_split: str
    private_index: int
    view: int
    distance: float
    fine_distance: float = -1.0  # verification distance; -1 = not verified yet


def partition_of(values: np.ndarray, partitions: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return ((values * _MIX) >> np.uint64(40)) % np.uint64(partitions)


def entries_by_group(task: ReadTask, indices: np.ndarray, vectors: np.ndarray,
                     means: np.ndarray, config: ih.HashConfig, *,
                     partitions: int) -> Iterator[tuple[tuple[int, int], Entries]]:
    """Embeddings [n, views, DIM] of ``indices`` -> ((band, partition), Entries) batches."""
    n, views, _ = vectors.shape
    flat = vectors.reshape(n * views, -1)
    values = ih.band_values(flat, config)  # [n * views, bands]
    index = np.repeat(indices.astype(np.int64), views)
    view = np.tile(np.arange(views, dtype=np.int16), n)
    mean = np.repeat(means.astype(np.float32), views)
    shard = np.full(n * views, task.shard, dtype=np.int32)
    half = flat.astype(np.float16)
    for band in range(config.bands):
        part = partition_of(values[:, band], partitions)
        for p in np.unique(part):
            rows = np.flatnonzero(part == p)
            yield (band, int(p)), Entries(task.side, task.split, index[rows], shard[rows],
                                          view[rows], values[rows, band], half[rows],
                                          mean[rows])


def signature_entries(task: ReadTask, dataset: Any, config: ih.HashConfig, *,
                      partitions: int) -> Iterator[tuple[tuple[int, int], Entries]]:
    """Read ``task``'s images from ``dataset`` (an ``IngestedDataset``) and bucket them."""
    indices = np.arange(task.start, task.stop)
    images, _ = dataset.get(task.split, indices)
    if task.side == PRIVATE:
        vectors, means = ih.embed_views(images, config)
    else:
        vectors, means = ih.embed(images)
        vectors = vectors[:, None]
    yield from entries_by_group(task, indices, vectors, means, config, partitions=partitions)


def _concat(batches: Iterable[Entries]) -> tuple[Entries, np.ndarray] | None:
    """One Entries of all ``batches`` plus each row's split (batches come per split)."""
    batches = list(batches)
    if not batches:
        return None
    split = np.concatenate([np.full(len(b.index), b.split, dtype=object) for b in batches])
    return Entries(batches[0].side, "", np.concatenate([b.index for b in batches]),
                   np.concatenate([b.shard for b in batches]),
                   np.concatenate([b.view for b in batches]),
                   np.concatenate([b.value for b in batches]),
                   np.concatenate([b.vector for b in batches]),
                   np.concatenate([b.mean for b in batches])), split


def join_group(public: Iterable[Entries], private: Iterable[Entries], *,
               threshold: float) -> tuple[list[Match], int]:
    """Exact distances for entries sharing a band value; matches and the candidate count."""
    pub, priv = _concat(public), _concat(private)
    if pub is None or priv is None:
        return [], 0
    (pub, pub_split), (priv, priv_split) = pub, priv
    p_order = np.argsort(pub.value, kind="stable")
    q_order = np.argsort(priv.value, kind="stable")
    p_vals, q_vals = pub.value[p_order], priv.value[q_order]
    shared = np.intersect1d(p_vals, q_vals)
    matches, candidates = [], 0
    for value in shared:
        p_rows = p_order[np.searchsorted(p_vals, value):np.searchsorted(p_vals, value, "right")]
        q_rows = q_order[np.searchsorted(q_vals, value):np.searchsorted(q_vals, value, "right")]
        for block in range(0, len(p_rows), _BLOCK):  # a hot bucket stays in memory bounds
            rows = p_rows[block:block + _BLOCK]
            d = ih.distances(pub.vector[rows], pub.mean[rows], priv.vector[q_rows],
                             priv.mean[q_rows])
            candidates += d.size
            for i, j in zip(*np.nonzero(d <= threshold)):
                p, q = rows[i], q_rows[j]
                matches.append(Match(str(pub_split[p]), int(pub.index[p]), int(pub.shard[p]),
                                     str(priv_split[q]), int(priv.index[q]),
                                     int(priv.view[q]), float(d[i, j])))
    return matches, candidates


def verify(match: Match, public: Any, private: Any, config: ih.HashConfig) -> Match | None:
    """Re-check a match on the images themselves (``IngestedDataset``s); None if it fails."""
    if config.verify_threshold <= 0:
        return match
    (a,) = public.examples(match.public_split, [match.public_index])
    (b,) = private.examples(match.private_split, [match.private_index])
    fine = ih.fine_distance(a.image, b.image, match.view, config)
    if fine > config.verify_threshold:
        return None
    return dataclasses.replace(match, fine_distance=round(fine, 5))


def closest(matches: Iterable[Match]) -> Match:
    """The closest private match of one public example (ties: lowest private index)."""
    return min(matches, key=lambda m: (m.distance, m.private_split, m.private_index, m.view))
