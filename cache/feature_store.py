"""Content-addressed Zarr store of frozen-backbone features, safe against partial writes.

Reading (what the trainer uses)::

    from dpscale.cache.feature_store import open_features

    fs = open_features(result.path)        # FeaturizeResult.path: one entry directory
    fs.splits                              # ["test", "train"]
    fs.feature_dim, fs.class_names         # d, ["airplane", ...]
    fs.num_examples("train")               # N
    x = fs.features("train")               # zarr.Array float32 [N, d]: x[i:j], x[:] -> numpy
    y = fs.labels("train")                 # np.ndarray int32 [N]
    xb, yb = fs.get("train", indices)      # numpy rows at any indices (sampler batches)
    fs.ids("train")                        # example ids (sha256 hex of the pixels), index order
    fs.metadata                            # dict: "key" parts, "digest", data content hash, splits...

    fs = FeatureStore.open(cache_dir, key) # the same, looked up by FeatureKey

Both refuse (``DataError``) an entry that is incomplete (an interrupted run), whose stored
key does not hash to its digest or does not equal the key asked for (stale or moved), whose
arrays do not have the recorded shapes, or one of whose chunks is missing, not a file or not the
size written; a chunk read back as other bytes than were written is refused too (``cache.integrity``),
naming the chunk and the ``dpscale featurize --repair ENTRY`` command that repairs the entry in place.

Layout of one entry, ``<cache_dir>/<key digest>/``::

    dpscale_features.json   key parts, digest, splits (rows, chunk rows), feature dim, classes
    data.zarr/              zarr 3 group: <split>/features [N, d] float32, <split>/labels [N]
                            int32, <split>/ids [N, 32] uint8, all chunked by the same rows,
                            each chunk zstd-compressed with a CRC32C checksum
    chunks/<split>/<i>.done one marker per chunk, written after that chunk's data, with the size and
                            sha256 of each of its objects as written (``cache.chunk_digests``)
    chunk_digests.json      every chunk's size and sha256, gathered from the markers when sealed
    COMPLETE                written last, after every marker is present: the entry is whole

Writers (Beam workers) each write whole chunks (``write_chunk``), so no two touch the same
zarr chunk; a run killed mid-way leaves chunks without markers, which the next run redoes.

An entry *is* the private data (features computed without noise, per-image ids): its directory
is owner-only (0700) and everything the writer side creates in it is too (``files.owner_only``,
whatever the caller's umask); on ``gs://`` the bucket's access control decides instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import zarr

from dpscale import files
from dpscale.cache import chunk_digests, integrity
from dpscale.cache.keys import FEATURE_FORMAT_VERSION, FeatureKey
from dpscale.errors import DataError

STORE_FORMAT = "dpscale-features"
METADATA = "dpscale_features.json"
DATA = "data.zarr"
MARKERS = "chunks"
COMPLETE = "COMPLETE"
ID_BYTES = 32
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def default_cache_dir() -> str:
    """``$DPSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpscale/features`` (``~/.cache/...``)."""
    root = os.environ.get("DPSCALE_CACHE_DIR")
    if root:
        return os.path.expanduser(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return os.path.join(os.path.expanduser(cache), "dpscale", "features")


def _zarr_store(
    path: str,
    *,
    read_only: bool = False,
    digests: dict[str, chunk_digests.Digest] | None = None,
    written: dict[str, chunk_digests.Digest] | None = None,
) -> chunk_digests.DigestStore:
    """What zarr opens: a local path, or a URL through ``dpscale.files``'s file system, behind a store that
    checks every read of a chunk in ``digests`` and records what it writes into ``written``.

    zarr would build its own asynchronous client per call for a URL, whose sessions end in
    errors on stderr at exit; the synchronous one, wrapped, is shared and closes cleanly.
    """
    if not files.is_url(path):
        from zarr.storage import LocalStore

        return chunk_digests.DigestStore(LocalStore(path, read_only=read_only), digests, written)
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    from zarr.storage import FsspecStore

    fs = AsyncFileSystemWrapper(files.filesystem(path), asynchronous=True)
    store = FsspecStore(fs, path=path.split("://", 1)[1], read_only=read_only)
    return chunk_digests.DigestStore(store, digests, written)


def entry_path(cache_dir: str, key: FeatureKey) -> str:
    return files.join(cache_dir, key.digest)


def _write_text(path: str, text: str) -> None:
    """Write-then-rename, so a reader never sees half a file (local); GCS writes are atomic."""
    files.makedirs(os.path.dirname(path))
    files.write_atomic(path, lambda f: f.write(text.encode("utf-8")), binary=True)


@dataclasses.dataclass(frozen=True)
class SplitLayout:
    """Rows of one split and how they are cut into chunks (the unit of work and of resume)."""

    num_examples: int
    chunk_rows: int

    @property
    def num_chunks(self) -> int:
        return -(-self.num_examples // self.chunk_rows)

    def rows(self, chunk: int) -> tuple[int, int]:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} out of range ({self.num_chunks} chunks)")
        start = chunk * self.chunk_rows
        return start, min(start + self.chunk_rows, self.num_examples)


@dataclasses.dataclass(frozen=True)
class EntryLayout:
    """Everything fixed before any feature is computed: the metadata JSON of an entry."""

    key: FeatureKey
    feature_dim: int
    class_names: tuple[str, ...]
    splits: dict[str, SplitLayout]
    # A cut entry's rows are activations of shape (views, H, W, C) stored flat (feature_dim is their
    # product), so chunks stay whole rows for Poisson batches' random reads; () for pooled features.
    feature_shape: tuple[int, ...] = ()
    # Where the ingested data and the backbone were read from: informational (not keyed, not
    # compared), for the command that repairs a damaged entry.
    source: str = dataclasses.field(default="", compare=False)
    backbone: str = dataclasses.field(default="", compare=False)
    # The key id (not secret) of the cache the entry was made in, whose secret keys its data identity:
    # a copy of the entry in another cache is checked and repaired in place with it.
    cache_key_id: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if bool(self.feature_shape) != bool(self.key.cut):
            raise DataError("a feature entry has a row shape exactly when it holds activations at a cut")
        if self.feature_shape and (
            len(self.feature_shape) != 4
            or self.feature_shape[0] != self.key.views
            or int(np.prod(self.feature_shape)) != self.feature_dim
        ):
            raise DataError(
                f"activations of shape {self.feature_shape} do not fit {self.key.views} views of "
                f"{self.feature_dim} values per row"
            )

    def to_metadata(self) -> dict[str, Any]:
        return {
            "format": STORE_FORMAT,
            "format_version": FEATURE_FORMAT_VERSION,
            "digest": self.key.digest,
            "key": self.key.as_dict(),
            "feature_dim": self.feature_dim,
            **({"feature_shape": list(self.feature_shape)} if self.feature_shape else {}),
            "class_names": list(self.class_names),
            "splits": {s: dataclasses.asdict(v) for s, v in sorted(self.splits.items())},
            "source": self.source,
            "backbone": self.backbone,
            "cache_key_id": self.cache_key_id,
        }

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> EntryLayout:
        if meta.get("format") != STORE_FORMAT:
            raise DataError("not a dpscale feature-store entry")
        if meta.get("format_version") != FEATURE_FORMAT_VERSION:
            raise DataError(
                f"feature format version {meta.get('format_version')} is not "
                f"supported (expected {FEATURE_FORMAT_VERSION}); featurize again"
            )
        try:
            return cls(
                key=FeatureKey.from_dict(meta["key"]),
                feature_dim=int(meta["feature_dim"]),
                feature_shape=tuple(int(n) for n in meta.get("feature_shape", ())),
                class_names=tuple(meta["class_names"]),
                splits={s: SplitLayout(**v) for s, v in meta["splits"].items()},
                source=str(meta.get("source", "")),
                backbone=str(meta.get("backbone", "")),
                cache_key_id=str(meta.get("cache_key_id", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"malformed feature-store metadata: {exc}") from None

    def repair_command(self, path: str) -> str:
        """The featurize command that finishes or repairs the entry at ``path`` in place, from any directory."""
        return f"dpscale featurize {self.source or 'DATA'} --backbone {self.backbone or 'BACKBONE'} --repair {files.absolute(path)}"


def read_layout(path: str) -> tuple[EntryLayout, dict[str, Any]]:
    """An entry's layout and metadata, checked against its digest and its directory's name."""
    try:
        meta = json.loads(files.read_text(files.join(path, METADATA)))
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{path!r} is not a feature-cache entry (no readable {METADATA}): give the entry directory that "
            "`dpscale featurize` printed"
        ) from exc
    layout = EntryLayout.from_metadata(meta)
    if meta.get("digest") != layout.key.digest:
        raise DataError(f"{path!r}: stored key does not hash to its digest (stale or edited entry)")
    name = os.path.basename(path.rstrip("/"))
    if _DIGEST.match(name) and name != layout.key.digest:
        raise DataError(
            f"{path!r}: the entry's key digest {layout.key.digest[:16]}... does not "
            "match its directory name (stale or moved entry)"
        )
    return layout, meta


def _arrays_open(path: str, layout: EntryLayout) -> bool:
    """Whether every array of the entry opens (its chunks may still be missing or damaged)."""
    try:
        group = zarr.open_group(store=_zarr_store(files.join(path, DATA), read_only=True), mode="r")
        return all(f"{s}/{name}" in group for s in layout.splits for name in integrity.ARRAYS)
    except Exception:  # noqa: BLE001 - unreadable metadata: the entry is rebuilt
        return False


class FeatureStore:
    """The writer side of one entry (launcher creates it, workers write chunks into it)."""

    def __init__(self, path: str, layout: EntryLayout) -> None:
        self.path = path
        self.layout = layout
        self._arrays: dict[tuple[str, str], Any] = {}
        self._written: dict[str, chunk_digests.Digest] = {}  # what this writer's store wrote, by store key

    # ---- creating and resuming ------------------------------------------------------------
    @classmethod
    @files.owner_only  # the entry is private data
    def create(cls, cache_dir: str, layout: EntryLayout) -> FeatureStore:
        """Make (or reuse, for resume) the entry for ``layout.key`` and its empty arrays.

        An existing entry with the same layout keeps its finished chunks; one with another
        layout (other chunking, or unreadable metadata) is cleared first.
        """
        return cls.create_at(entry_path(cache_dir, layout.key), layout)

    @classmethod
    @files.owner_only
    def create_at(cls, path: str, layout: EntryLayout) -> FeatureStore:
        """``create`` at ``path``: the entry's own directory, wherever it is (an entry repaired in place)."""
        try:
            existing, _ = read_layout(path)
        except DataError:
            existing = None
        store = cls(path, layout)
        if existing == layout and _arrays_open(path, layout):
            files.makedirs_owner_only(path)  # an entry made under a looser umask: closed from now on
            return store
        files.rmtree(path)
        files.makedirs_owner_only(path)
        group = zarr.open_group(store=_zarr_store(files.join(path, DATA)), mode="w")
        for split, rows in sorted(layout.splits.items()):
            n, c = rows.num_examples, rows.chunk_rows
            sub = group.create_group(split)
            sub.create_array(
                "features",
                shape=(n, layout.feature_dim),
                dtype="float32",
                chunks=(c, layout.feature_dim),
                fill_value=np.nan,
                **integrity.codecs(),
            )
            sub.create_array("labels", shape=(n,), dtype="int32", chunks=(c,), fill_value=-1, **integrity.codecs())
            sub.create_array(
                "ids", shape=(n, ID_BYTES), dtype="uint8", chunks=(c, ID_BYTES), fill_value=0, **integrity.codecs()
            )
        _write_text(files.join(path, METADATA), json.dumps(layout.to_metadata(), indent=2) + "\n")
        return store

    @classmethod
    def for_writing(cls, path: str) -> FeatureStore:
        """A worker's handle on an entry the launcher created."""
        layout, _ = read_layout(path)
        return cls(path, layout)

    @classmethod
    def open(cls, cache_dir: str, key: FeatureKey, *, verify: bool = False) -> FeatureSplitSet:
        """Read the complete entry for ``key``; ``DataError`` if absent, partial, stale or damaged."""
        path = entry_path(cache_dir, key)
        if not files.exists(files.join(path, METADATA)):
            raise DataError(f"no features for key {key.digest[:16]}... in {cache_dir!r}: run dpscale featurize first")
        return open_features(path, expected_key=key, verify=verify)

    # ---- chunk bookkeeping -----------------------------------------------------------------
    def _marker(self, split: str, chunk: int) -> str:
        return files.join(self.path, MARKERS, split, f"{chunk:06d}.done")

    def _marker_text(self, split: str, chunk: int, records: dict[str, chunk_digests.Digest]) -> str:
        start, stop = self.layout.splits[split].rows(chunk)
        header = {"digest": self.layout.key.digest, "split": split, "chunk": chunk, "rows": [start, stop]}
        return chunk_digests.marker_text(header, records)

    def marked_records(self, chunks: list[tuple[str, int]]) -> dict[tuple[str, int], dict[str, Any] | None]:
        """The digests each chunk's marker holds (None: a marker of an older dpscale, without them)."""
        return {c: chunk_digests.marker_records(files.read_text(self._marker(*c))) for c in chunks}

    def done_chunks(self) -> set[tuple[str, int]]:
        """Chunks whose marker is present (one directory listing per split)."""
        done = set()
        for split, rows in self.layout.splits.items():
            pattern = files.join(self.path, MARKERS, split, "*.done")
            for match in files.glob(pattern):
                stem = match.rstrip("/").rsplit("/", 1)[-1][: -len(".done")]
                if stem.isdigit() and int(stem) < rows.num_chunks:
                    done.add((split, int(stem)))
        return done

    def all_chunks(self) -> list[tuple[str, int]]:
        return [(s, c) for s, rows in sorted(self.layout.splits.items()) for c in range(rows.num_chunks)]

    def missing_chunks(self) -> list[tuple[str, int]]:
        done = self.done_chunks()
        return [c for c in self.all_chunks() if c not in done]

    def invalidate_damaged(self) -> list[integrity.ChunkDamage]:
        """Check every chunk that has a marker (reads it all); drop the damaged ones' markers.

        They then count as missing, so the next pipeline recomputes exactly those (and the entry is
        sealed again only once they are whole). A whole chunk whose marker predates digests gets them
        recorded from its files (checked by their CRC32C). Returns what was damaged.
        """
        done = sorted(self.done_chunks())
        records = self.marked_records(done)
        digests = {key: value for found in records.values() if found for key, value in found.items()}
        data = files.join(self.path, DATA)
        try:
            group = zarr.open_group(store=_zarr_store(data, read_only=True, digests=digests), mode="r")
            damage = integrity.unreadable_chunks(data, group, self.layout.splits, digests=digests, chunks=done)
        except Exception:  # noqa: BLE001 - unreadable arrays: nothing marked can be trusted
            damage = [
                integrity.ChunkDamage(s, "features", c, self.layout.splits[s].rows(c), "unreadable") for s, c in done
            ]
        bad = sorted({(d.split, d.chunk) for d in damage})
        if bad:
            for path in [files.join(self.path, COMPLETE)] + [self._marker(s, c) for s, c in bad]:
                if files.exists(path):
                    files.remove(path)
        for path in (files.join(data, d.key) for d in damage if d.key):
            if files.exists(path) and files.size(path) is None:  # a directory in a chunk's place blocks its rewrite
                files.rmtree(path)
        for split, chunk in (c for c in done if records[c] is None and c not in bad):
            keys = [integrity.chunk_key(split, name, group[f"{split}/{name}"], chunk) for name in integrity.ARRAYS]
            found = {key: chunk_digests.digest(files.read_bytes(files.join(data, key))) for key in keys}
            _write_text(self._marker(split, chunk), self._marker_text(split, chunk, found))
        return damage

    def is_complete(self) -> bool:
        try:
            return files.read_text(files.join(self.path, COMPLETE)).strip() == self.layout.key.digest
        except OSError:
            return False

    # ---- writing ---------------------------------------------------------------------------
    def _array(self, split: str, name: str) -> Any:
        if (split, name) not in self._arrays:
            self._arrays[split, name] = zarr.open_array(
                store=_zarr_store(files.join(self.path, DATA), written=self._written),
                path=f"{split}/{name}",
                mode="r+",
                config=integrity.WRITE_CONFIG,
            )
        return self._arrays[split, name]

    @files.owner_only
    def write_chunk(
        self, split: str, chunk: int, features: np.ndarray, labels: np.ndarray, ids: Sequence[bytes] | np.ndarray
    ) -> None:
        """Write one whole chunk's rows, then its marker (the marker is the commit)."""
        start, stop = self.layout.splits[split].rows(chunk)
        n = stop - start
        features = np.asarray(features, dtype=np.float32)
        if features.shape != (n, self.layout.feature_dim):
            raise ValueError(
                f"chunk {split}/{chunk}: features {features.shape}, expected {(n, self.layout.feature_dim)}"
            )
        id_array = np.asarray(
            ids if isinstance(ids, np.ndarray) else [np.frombuffer(i, dtype=np.uint8) for i in ids], dtype=np.uint8
        )
        if id_array.shape != (n, ID_BYTES) or np.shape(labels) != (n,):
            raise ValueError(f"chunk {split}/{chunk}: labels/ids do not have {n} rows")
        self._array(split, "features")[start:stop] = features
        self._array(split, "labels")[start:stop] = np.asarray(labels, dtype=np.int32)
        self._array(split, "ids")[start:stop] = id_array
        keys = [integrity.chunk_key(split, name, self._array(split, name), chunk) for name in integrity.ARRAYS]
        records = {key: self._written.pop(key) for key in keys}  # as the store wrote them
        _write_text(self._marker(split, chunk), self._marker_text(split, chunk, records))

    @files.owner_only
    def finalize(self) -> None:
        """Seal the chunks' digests and write ``COMPLETE`` if (and only if) every chunk has its marker."""
        missing = self.missing_chunks()
        if missing:
            raise RuntimeError(
                f"{len(missing)} of {len(self.all_chunks())} chunks were not "
                f"written (first: {missing[0]}); the entry stays incomplete"
            )
        records = self.marked_records(self.all_chunks())
        unrecorded = [chunk for chunk, found in records.items() if found is None]
        if unrecorded:
            raise RuntimeError(f"the markers of {unrecorded[:3]} hold no digests; the entry stays incomplete")
        chunk_digests.write(self.path, {key: value for found in records.values() for key, value in found.items()})
        _write_text(files.join(self.path, COMPLETE), self.layout.key.digest + "\n")


class FeatureSplitSet:
    """A complete entry, read-only: features, labels and ids per split (see module doc)."""

    def __init__(self, path: str, layout: EntryLayout, metadata: dict[str, Any], *, verify: bool = False) -> None:
        """Open the arrays and look for every chunk; ``verify`` also reads every chunk (checksums)."""
        self.path = path
        self.layout = layout
        self.metadata = metadata
        self.repair = layout.repair_command(path)
        self._data = files.join(path, DATA)
        self._digests = chunk_digests.read(path, repair=self.repair)
        try:
            store = _zarr_store(self._data, read_only=True, digests=self._digests)
            self._group = zarr.open_group(store=store, mode="r")
            shapes = {s: {name: self._group[f"{s}/{name}"].shape for name in integrity.ARRAYS} for s in layout.splits}
        except Exception as exc:
            raise DataError(
                f"feature cache {path!r} is damaged: its arrays cannot be opened "
                f"({integrity.short(exc)}); recompute it with `{self.repair}`"
            ) from exc
        for split, rows in layout.splits.items():
            want = {
                "features": (rows.num_examples, layout.feature_dim),
                "labels": (rows.num_examples,),
                "ids": (rows.num_examples, ID_BYTES),
            }
            if shapes[split] != want:
                raise DataError(
                    f"{path!r}: arrays of split {split!r} have shapes {shapes[split]}, metadata says {want}"
                )
        if verify:
            damage = integrity.unreadable_chunks(self._data, self._group, layout.splits, digests=self._digests)
        else:
            damage = integrity.missing_chunks(self._data, self._group, layout.splits, self._digests)
        if damage:
            raise integrity.damage_error(path, damage, self.repair)

    def _checked(self, split: str, name: str) -> integrity.CheckedArray:
        return integrity.CheckedArray(
            self._group,
            data_path=self._data,
            split=split,
            name=name,
            layout=self._split(split),
            path=self.path,
            repair=self.repair,
            digests=self._digests,
        )

    @property
    def key(self) -> FeatureKey:
        return self.layout.key

    @property
    def digest(self) -> str:
        """The entry's key digest: identifies these features (data, backbone, preprocessing)."""
        return self.layout.key.digest

    @property
    def splits(self) -> list[str]:
        return sorted(self.layout.splits)

    @property
    def feature_dim(self) -> int:
        return self.layout.feature_dim

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """One row's shape: ``(d,)`` for pooled features, ``(views, H, W, C)`` for activations at a cut."""
        return self.layout.feature_shape or (self.layout.feature_dim,)

    @property
    def class_names(self) -> list[str]:
        return list(self.layout.class_names)

    @property
    def num_classes(self) -> int:
        return len(self.layout.class_names)

    def _split(self, split: str) -> SplitLayout:
        try:
            return self.layout.splits[split]
        except KeyError:
            raise DataError(
                f"split {split!r} not in the features at {self.path!r} (has {', '.join(self.splits)})"
            ) from None

    def num_examples(self, split: str) -> int:
        return self._split(split).num_examples

    def features(self, split: str) -> integrity.CheckedArray:
        """The lazy array ``[N, d]`` float32; slice it (``[:]``) to get numpy (a damaged chunk: ``DataError``)."""
        return self._checked(split, "features")

    def labels(self, split: str) -> np.ndarray:
        return np.asarray(self._checked(split, "labels")[:], dtype=np.int32)

    def ids(self, split: str) -> list[str]:
        return [bytes(row).hex() for row in self._checked(split, "ids")[:]]

    def get(self, split: str, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Features ``[*indices.shape, d]`` and labels ``[*indices.shape]`` at any indices."""
        idx = np.asarray(indices, dtype=np.int64)
        flat = idx.reshape(-1)
        n = self.num_examples(split)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of range for split {split!r} of size {n}")
        feats = self.features(split).get_orthogonal_selection((flat, slice(None)))
        labels = self._checked(split, "labels").get_orthogonal_selection(flat)
        return (
            np.asarray(feats, np.float32).reshape(*idx.shape, self.feature_dim),
            np.asarray(labels, np.int32).reshape(idx.shape),
        )


def open_features(
    path: str | os.PathLike[str], *, expected_key: FeatureKey | None = None, verify: bool = False
) -> FeatureSplitSet:
    """Open the entry at ``path`` for reading; refuses partial, stale, mismatched or damaged entries.

    Every chunk must be present; ``verify`` also reads each one (checksums), which
    ``featurize`` does before it calls an entry a cache hit.
    """
    path = os.fspath(path)
    layout, meta = read_layout(path)
    if expected_key is not None and layout.key != expected_key:
        mine, theirs = layout.key.as_dict(), expected_key.as_dict()
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise DataError(f"{path!r} holds features for another key (differs in: {', '.join(differ)})")
    store = FeatureStore(path, layout)
    if not store.is_complete():
        total = len(store.all_chunks())
        done = total - len(store.missing_chunks())
        raise DataError(
            f"{path!r} is an incomplete feature entry ({done} of {total} chunks "
            f"written, no COMPLETE marker): finish it with `{layout.repair_command(path)}`"
        )
    return FeatureSplitSet(path, layout, meta, verify=verify)
