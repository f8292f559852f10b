"""The size and sha256 of every chunk of a feature-store entry as it was written, and the check of every read.

Zarr reads a chunk it cannot find as the array's fill value (NaN features, label -1), and whatever
replaced a chunk file (a directory, another chunk's valid bytes) decoded as data until now: a
present, readable chunk was trusted. So the bytes of each chunk are recorded when they are written
(``DigestStore.set``, in the writer's process: a Beam worker's chunk marker holds its chunk's records,
and sealing the entry gathers them into ``chunk_digests.json``), and every read of a recorded chunk is
checked against them (``DigestStore.get``): a chunk that is missing, not a file, of another size or
other bytes is ``ChunkDamaged``, never data. Opening an entry also looks at every chunk file's size
(one ``stat`` each, ``file_problem``), so damage is found before training reads anything.

The records are not secret and say nothing of the data beyond what the chunks themselves hold.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

from zarr.storage import WrapperStore

from dpscale import files
from dpscale.errors import DataError

FILE = "chunk_digests.json"  # an entry's records, written when it is sealed
Digest = tuple[int, str]  # (size in bytes, sha256 hex) of one stored chunk


class ChunkDamaged(Exception):
    """A recorded chunk that is not what was written (``problem`` says how)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


def digest(data: bytes) -> Digest:
    return len(data), hashlib.sha256(data).hexdigest()


def check(key: str, data: bytes | None, expected: Digest) -> None:
    """Raise ``ChunkDamaged`` unless ``data`` (None: not found) is the chunk recorded as ``expected``."""
    if data is None:
        raise ChunkDamaged(key, "missing")
    size, sha = digest(data)
    if size != expected[0]:
        raise ChunkDamaged(key, f"corrupt ({size} bytes where {expected[0]} were written)")
    if sha != expected[1]:
        raise ChunkDamaged(key, "corrupt (not the bytes written: its sha256 differs)")


def file_problem(path: str, expected: Digest | None) -> str | None:
    """What is wrong with the chunk file at ``path`` from its size alone (None: a regular file of the size written)."""
    size = files.size(path)
    if size is None:
        return "not a file (something else in its place)" if files.exists(path) else "missing"
    if expected is not None and size != expected[0]:
        return f"corrupt ({size} bytes where {expected[0]} were written)"
    return None


class DigestStore(WrapperStore):
    """A zarr store that records the digest of every object it writes (``written``) and checks every read of
    an object recorded in ``expected`` against it."""

    def __init__(self, store: Any, expected: Mapping[str, Digest] | None = None, written: dict | None = None) -> None:
        super().__init__(store)
        self.expected = dict(expected or {})
        self.written: dict[str, Digest] = {} if written is None else written

    def _with_store(self, store: Any) -> DigestStore:
        return type(self)(store, self.expected, self.written)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        found = await self._store.get(key, prototype, byte_range)
        if key in self.expected:
            if byte_range is not None:
                raise ChunkDamaged(key, "read in part, which cannot be checked")
            check(key, None if found is None else found.to_bytes(), self.expected[key])
        return found

    async def get_partial_values(self, prototype: Any, key_ranges: Iterable[tuple[str, Any]]) -> list[Any]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def _get_many(self, requests: Iterable[tuple[str, Any, Any]]) -> AsyncGenerator[tuple[str, Any], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)

    async def set(self, key: str, value: Any) -> None:
        await self._store.set(key, value)
        self.written[key] = digest(value.to_bytes())


def marker_text(header: dict[str, Any], records: Mapping[str, Digest]) -> str:
    """A chunk marker: what the chunk is (``header``) and the digests of its objects."""
    return json.dumps({**header, "chunks": {key: list(value) for key, value in sorted(records.items())}}) + "\n"


def marker_records(text: str) -> dict[str, Digest] | None:
    """The digests a marker holds; None for a marker written before markers held them."""
    try:
        records = json.loads(text)["chunks"]
        return {key: (int(size), str(sha)) for key, (size, sha) in records.items()}
    except (ValueError, KeyError, TypeError):
        return None


def write(path: str, records: Mapping[str, Digest]) -> None:
    """Seal the records of every chunk of the entry at ``path``."""
    text = json.dumps({key: list(value) for key, value in sorted(records.items())}, indent=0) + "\n"
    files.write_atomic(files.join(path, FILE), lambda f: f.write(text.encode("utf-8")), binary=True)


def read(path: str, *, repair: str) -> dict[str, Digest]:
    """The sealed records of the entry at ``path``; ``DataError`` (naming ``repair``) if there are none."""
    try:
        records = json.loads(files.read_text(files.join(path, FILE)))
        return {key: (int(size), str(sha)) for key, (size, sha) in records.items()}
    except FileNotFoundError:
        raise DataError(
            f"feature cache {path!r} records no chunk digests (made by an older dpscale), so its chunks cannot be "
            f"checked; check them once, and record them, with `{repair}` (nothing whole is recomputed)"
        ) from None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise DataError(
            f"feature cache {path!r} is damaged: its {FILE} is unreadable ({exc}); repair it with `{repair}`"
        ) from None
