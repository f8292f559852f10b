"""Read an ingested dataset by index: what the trainer's Poisson sampler needs.

    ds = IngestedDataset("/data/cifar10")
    images, labels = ds.get("train", [3, 17, 42])   # uint8 [3, H, W, C], int32 [3]
    images, labels = ds.get("train", batch.indices, padding_index=-1)  # sampler batches

Index ``i`` of a split is the ``i``-th record when the split's shards (as listed in the
manifest) are read one after the other; it is stable for the same data. Reads go through
array_record's random-access data source (shards written with group size 1), so a batch
of scattered indices costs one small read per example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dpscale.data import shards
from dpscale.data.examples import Example, decode_record, record_digest, record_label
from dpscale.data.manifest import Manifest, SplitEntry
from dpscale.errors import DataError


class IngestedDataset:
    """An ingest output directory: its manifest plus random access into each split."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.manifest: Manifest = shards.read_manifest(path)
        self._sources: dict[str, Any] = {}

    @property
    def class_names(self) -> list[str]:
        return list(self.manifest.class_names)

    @property
    def num_classes(self) -> int:
        return self.manifest.num_classes

    @property
    def image_shape(self) -> tuple[int, ...]:
        return self.manifest.image_shape or ()  # empty: every input was rejected

    @property
    def splits(self) -> list[str]:
        return list(self.manifest.splits)

    @property
    def content_hash(self) -> str:
        return self.manifest.content_hash

    def __len__(self) -> int:
        return sum(self.num_examples(s) for s in self.splits)

    def num_examples(self, split: str) -> int:
        return self._split(split).num_examples

    def _split(self, split: str) -> SplitEntry:
        try:
            return self.manifest.splits[split]
        except KeyError:
            raise DataError(f"split {split!r} not in {self.path!r} (has {', '.join(self.splits) or 'none'})") from None

    def _source(self, split: str) -> Any:
        if split not in self._sources:
            from array_record.python.array_record_data_source import ArrayRecordDataSource

            files = [shards.join(self.path, s.file) for s in self._split(split).shards if s.num_examples]
            try:
                source = ArrayRecordDataSource(files) if files else []
            except (RuntimeError, OSError) as exc:  # a shard missing, cut off or unreadable
                raise shards.damaged_shard_error(self.path, self.manifest, split, exc) from None
            if len(source) != self.num_examples(split):
                raise shards.damaged_shard_error(
                    self.path,
                    self.manifest,
                    split,
                    ValueError(f"{len(source)} records instead of {self.num_examples(split)}"),
                )
            self._sources[split] = source
        return self._sources[split]

    def records(self, split: str, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """Raw records at ``indices`` (in that order; repeats allowed)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.num_examples(split)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"index out of range for split {split!r} of size {n}")
        if not idx.size:
            return []
        wanted = [int(i) for i in idx]
        source = self._source(split)
        try:
            return list(source.__getitems__(wanted))
        except (RuntimeError, OSError) as exc:  # a checksum or a read failed: name the shard
            raise shards.damaged_shard_error(self.path, self.manifest, split, exc, indices=wanted) from None

    def get(
        self, split: str, indices: Sequence[int] | np.ndarray, *, padding_index: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Images uint8 ``[*indices.shape, H, W, C]`` and labels int32 ``[*indices.shape]``.

        ``indices`` may have any shape, e.g. a Poisson sampler's ``[micro-batches, size]``.
        Slots equal to ``padding_index`` (the sampler's -1) get a zero image and label 0;
        the sampler's mask is what keeps them out of the gradient.
        """
        idx = np.asarray(indices, dtype=np.int64)
        flat = idx.reshape(-1)
        real = np.ones(flat.shape, bool) if padding_index is None else flat != padding_index
        images = np.zeros((flat.size, *self.image_shape), dtype=np.uint8)
        labels = np.zeros((flat.size,), dtype=np.int32)
        for slot, record in zip(np.flatnonzero(real), self.records(split, flat[real])):
            example = decode_record(record)
            images[slot] = example.image
            labels[slot] = example.label
        return images.reshape(*idx.shape, *self.image_shape), labels.reshape(idx.shape)

    def split_images(self, split: str) -> np.ndarray:
        """Every image of ``split`` in index order, uint8 ``[N, H, W, C]``: the whole split in
        memory (1.5 GB for 500,000 CIFAR-sized images), for tools that need it all at once."""
        return self.get(split, np.arange(self.num_examples(split)))[0]

    def examples(self, split: str, indices: Sequence[int] | np.ndarray) -> list[Example]:
        """Full examples (with id and source key) at ``indices``."""
        return [decode_record(r, split=split) for r in self.records(split, indices)]

    def labels(self, split: str) -> np.ndarray:
        """All labels of a split in index order (parses only each record's header)."""
        n = self.num_examples(split)
        return np.array([record_label(r) for r in self.records(split, range(n))], dtype=np.int32)

    def ids(self, split: str, *, chunk: int = 10_000) -> np.ndarray:
        """Every example id of a split as uint64 (the first 8 bytes of its sha256), in index
        order; parses only the headers, ``chunk`` records at a time. The id depends on the
        pixels only, not on the split, label or path: a re-ingested image keeps it."""
        n = self.num_examples(split)
        out = np.empty(n, np.uint64)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            out[lo:hi] = [int.from_bytes(record_digest(r)[:8], "big") for r in self.records(split, range(lo, hi))]
        return out

    def close(self) -> None:
        for source in self._sources.values():
            if hasattr(source, "__exit__"):
                source.__exit__(None, None, None)
        self._sources.clear()

    def __enter__(self) -> IngestedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
