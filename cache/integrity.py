"""Integrity of a feature-store entry's chunks: every read is checked, and damage is one line.

Each chunk's size and sha256 are recorded when it is written (``cache.chunk_digests``) and every read
is checked against them; Zarr's CRC32C codec also guards each chunk's stored bytes. What Zarr would
read without complaint is what needs looking for: a chunk that is *missing* or *not a file* reads back
as the array's fill value (NaN features, label -1), so opening an entry stats every chunk file (present,
a regular file, the size written), and a read that finds other bytes fails instead of decoding them.
Either way the user gets one ``DataError`` naming the chunk and the ``dpscale featurize`` command that
repairs the entry in place (featurize checks every chunk, drops the damaged ones' markers and redoes
only those).

This module knows nothing of entry layouts beyond what it is given (``splits``: split ->
an object with ``num_chunks`` and ``rows(chunk)``), so ``cache.feature_store`` can use it
without an import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from dpscale import files
from dpscale.cache.chunk_digests import ChunkDamaged, Digest, file_problem
from dpscale.errors import DataError

ARRAYS = ("features", "labels", "ids")


def codecs() -> dict[str, Any]:
    """The ``create_array`` arguments of every array of an entry: zstd, then a CRC32C of the stored bytes."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return {"compressors": (ZstdCodec(), Crc32cCodec())}


#: Writers store every chunk, even one equal to the fill value: absent must mean damaged.
WRITE_CONFIG = {"write_empty_chunks": True}


@dataclasses.dataclass(frozen=True)
class ChunkDamage:
    """One chunk of one array that is missing or cannot be read back."""

    split: str
    array: str
    chunk: int
    rows: tuple[int, int]
    problem: str  # "missing", "not a file", "N bytes where M were written", "corrupt (...)", ...
    key: str = ""  # its store key (``train/features/c/1/0``), where known

    def describe(self) -> str:
        start, stop = self.rows
        return f"chunk {self.chunk} of {self.split}/{self.array} (rows {start}-{stop - 1}) is {self.problem}"


def chunk_key(split: str, name: str, array: Any, chunk: int) -> str:
    """The store key of one chunk of ``split/name`` (``train/features/c/1/0``)."""
    return f"{split}/{name}/" + array.metadata.encode_chunk_key((chunk,) + (0,) * (len(array.shape) - 1))


def missing_chunks(
    data_path: str, group: Any, splits: Mapping[str, Any], digests: Mapping[str, Digest]
) -> list[ChunkDamage]:
    """Chunks whose file is absent, not a file, or not the size written (cheap: one stat per chunk, no reads)."""
    missing = []
    for split, layout in sorted(splits.items()):
        for name in ARRAYS:
            array = group[f"{split}/{name}"]
            for chunk in range(layout.num_chunks):
                key = chunk_key(split, name, array, chunk)
                problem = file_problem(files.join(data_path, key), digests.get(key))
                if problem:
                    missing.append(ChunkDamage(split, name, chunk, layout.rows(chunk), problem, key))
    return missing


def unreadable_chunks(
    data_path: str,
    group: Any,
    splits: Mapping[str, Any],
    *,
    digests: Mapping[str, Digest],
    chunks: Iterable[tuple[str, int]] | None = None,
    arrays: tuple[str, ...] = ARRAYS,
) -> list[ChunkDamage]:
    """Chunks that are missing, not what was written, or fail to decode (reads every chunk asked for).

    ``group`` reads through a ``DigestStore`` holding ``digests``; a chunk without a record (a marker
    written before markers held them) is checked by its file and its CRC32C only.
    """
    damaged = []
    wanted = (
        sorted(chunks)
        if chunks is not None
        else [(s, c) for s, layout in sorted(splits.items()) for c in range(layout.num_chunks)]
    )
    for split, chunk in wanted:
        start, stop = splits[split].rows(chunk)
        for name in arrays:
            array = group[f"{split}/{name}"]
            key = chunk_key(split, name, array, chunk)
            problem = file_problem(files.join(data_path, key), digests.get(key))
            if problem:
                damaged.append(ChunkDamage(split, name, chunk, (start, stop), problem, key))
                continue
            try:
                array[start:stop]
            except ChunkDamaged as exc:
                damaged.append(ChunkDamage(split, name, chunk, (start, stop), exc.problem, key))
            except Exception as exc:  # noqa: BLE001 - any failure to decode stored bytes is damage
                damaged.append(ChunkDamage(split, name, chunk, (start, stop), f"corrupt ({_why(exc)})", key))
    return damaged


def _why(exc: Exception) -> str:
    """Why stored bytes did not decode, in a few words (zarr's checksum message quotes raw bytes)."""
    text = str(exc).lower()
    return "it fails its CRC32C checksum" if "checksum" in text else short(exc)


def short(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def damage_error(path: str, damage: list[ChunkDamage], repair: str) -> DataError:
    """The one-line error for a damaged entry: the first damaged chunk, how many, and the fix."""
    more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
    return DataError(
        f"feature cache {path!r} is damaged: {damage[0].describe()}{more}; recompute the damaged chunks with `{repair}`"
    )


class CheckedArray:
    """A read-only Zarr array whose failed reads become ``damage_error`` naming the damaged chunk."""

    def __init__(
        self,
        group: Any,
        *,
        data_path: str,
        split: str,
        name: str,
        layout: Any,
        path: str,
        repair: str,
        digests: Mapping[str, Digest],
    ) -> None:
        self._group, self._data_path, self._split, self._name = group, data_path, split, name
        self._array = group[f"{split}/{name}"]
        self._layout, self._path, self._repair, self._digests = layout, path, repair, digests

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> Any:
        return self._array.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, selection: Any) -> Any:
        return self._checked(lambda: self._array[selection])

    def get_orthogonal_selection(self, selection: Any) -> Any:
        return self._checked(lambda: self._array.get_orthogonal_selection(selection))

    def _checked(self, read: Any) -> Any:
        try:
            return read()
        except Exception as exc:
            damage = unreadable_chunks(
                self._data_path, self._group, {self._split: self._layout}, digests=self._digests, arrays=(self._name,)
            )
            if not damage:
                raise
            raise damage_error(self._path, damage, self._repair) from exc
