"""What a source yields before decoding, and the small types that carry the reading work.

Shared by every kind of source (``data.folder_source``, ``data.array_sources``) and by
``data.sources``, which lists the kinds, so none of them needs another: each kind module
describes itself as a :class:`SourceKind`; planning makes picklable ``ReadTask``s on the
launching machine, workers turn each into ``RawItem``s.
"""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

SPLIT_ALIASES = {
    "train": "train",
    "test": "test",
    "validation": "validation",
    "val": "validation",
    "valid": "validation",
    "t10k": "test",
}
UNKNOWN_LABEL = -1


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A parsed source string."""

    kind: str  # "tfds" | "folder" | "idx" | "digits"
    location: str = ""  # path, or TFDS builder name
    split: str | None = None  # TFDS split selection, e.g. "train[:10%]"
    text: str = ""  # the string as the user wrote it


@dataclasses.dataclass(frozen=True)
class ReadTask:
    """A small unit of reading work; picklable so Beam can ship it to a worker."""

    kind: str  # "files" | "tar" | "idx" | "tfds" | "digits"
    path: str = ""
    split: str = ""
    members: tuple[tuple[str, str, str], ...] = ()  # (split, class name, relative path)
    start: int = 0
    stop: int = 0
    extra: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class SourcePlan:
    """What planning learned about a source: class names, work units, expected sizes."""

    spec: SourceSpec
    class_names: tuple[str, ...]
    tasks: tuple[ReadTask, ...]
    split_sizes: dict[str, int]


@dataclasses.dataclass(frozen=True)
class RawItem:
    """One input example before decoding.

    ``payload`` is encoded file bytes (folder sources) or a uint8 array. ``label`` is a
    class index, or ``UNKNOWN_LABEL`` with the offending name kept in ``label_name``.
    """

    split: str
    key: str
    label: int
    payload: bytes | np.ndarray
    label_name: str = ""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How planning cuts a source into tasks (and where TFDS keeps its prepared data sets)."""

    chunk_size: int = 2048
    tfds_data_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """One kind of source: the string that names it, and how it is parsed, planned and read.

    ``parse`` gets the text after ``NAME:`` (``""`` if there is none) and returns
    ``(location, split)``, or None when the text does not fit ``syntax``. ``plan`` runs
    where the pipeline is launched; ``read`` runs on a worker for every ``ReadTask`` whose
    kind is one of ``task_kinds``. Only the tasks travel to workers (they name their task
    kind), so a ``SourceKind`` is never pickled.
    """

    name: str
    syntax: str  # as the user writes it, e.g. "folder:PATH"
    parse: Callable[[str], tuple[str, str | None] | None]
    plan: Callable[[SourceSpec, PlanOptions], SourcePlan]
    read: Callable[[ReadTask, Sequence[str]], Iterator[RawItem]]
    task_kinds: tuple[str, ...]


def location_argument(rest: str) -> tuple[str, str | None] | None:
    """``parse`` of a kind written ``NAME:LOCATION`` (the location may hold colons)."""
    return (rest, None) if rest else None


def open_maybe_gz(path: str):
    gz = path.endswith((".gz", ".tgz"))
    return gzip.open(path, "rb") if gz else open(path, "rb")
