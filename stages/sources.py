"""Where images come from: parse a source string, plan the reading work, read it.

A source string names one of four kinds of input:

- ``tfds:NAME[:SPLIT]``  a TFDS builder, read through ``tfds.data_source`` (array_record,
  no TensorFlow needed);
- ``folder:PATH``        ``PATH/<split>/<class>/*`` or ``PATH/<class>/*`` (one split,
  ``train``), or a ``.tar.gz``/``.tgz``/``.tar`` archive of that layout;
- ``idx:DIR``            MNIST-format IDX files (``train-images-idx3-ubyte[.gz]``, ...);
- ``digits``             scikit-learn's bundled 8x8 digits, with a 20% test split carved by
  content hash (the set ships without one).

The array-valued kinds (IDX, TFDS, digits) live in ``stages.array_sources``.

Planning happens once, on the machine that launches the pipeline: it checks the input
exists, finds the class names and cuts the input into small picklable ``ReadTask``s.
``read_task`` runs on the workers and yields ``RawItem``s, still undecoded for files so
that decoding (and its failures) happen in one place, ``stages.examples``.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dpscale.errors import DataError, InvalidConfigError

SPLIT_ALIASES = {"train": "train", "test": "test", "validation": "validation",
                  "val": "validation", "valid": "validation", "t10k": "test"}
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar")
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


def parse_source(text: str) -> SourceSpec:
    """Parse ``tfds:NAME[:SPLIT]``, ``folder:PATH``, ``idx:DIR`` or ``digits``."""
    kind, _, rest = text.partition(":")
    if kind == "digits" and not rest:
        return SourceSpec("digits", text=text)
    if kind == "tfds" and rest:
        name, _, split = rest.partition(":")
        return SourceSpec("tfds", name, split or None, text=text)
    if kind in ("folder", "idx") and rest:
        return SourceSpec(kind, rest, text=text)
    raise InvalidConfigError(
        f"unknown source {text!r}; expected tfds:NAME[:SPLIT], folder:PATH, idx:DIR or digits")


def plan_source(spec: SourceSpec, *, chunk_size: int = 2048,
                tfds_data_dir: str | None = None) -> SourcePlan:
    """Check the source exists and cut it into ``ReadTask``s of about ``chunk_size`` items."""
    from dpscale.stages import array_sources

    if spec.kind == "folder":
        return _plan_folder(spec, chunk_size)
    if spec.kind == "idx":
        return array_sources.plan_idx(spec, chunk_size)
    if spec.kind == "tfds":
        return array_sources.plan_tfds(spec, chunk_size, tfds_data_dir)
    return array_sources.plan_digits(spec)


def select_classes(class_names: Sequence[str],
                   wanted: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A class filter: ``(kept names, label map)`` for keeping only the ``wanted`` classes.

    Kept classes stay in the source's order (so ``3,4`` and ``4,3`` give the same data)
    and are relabelled ``0..k-1``; ``label_map[source label]`` is the new label, or -1
    for a class that is left out.
    """
    unknown = [name for name in wanted if name not in class_names]
    if unknown:
        raise DataError(f"class(es) {', '.join(map(repr, unknown))} not in the source; "
                        f"it has {', '.join(class_names)}")
    keep = set(wanted)
    kept = tuple(name for name in class_names if name in keep)
    new = {name: i for i, name in enumerate(kept)}
    return kept, tuple(new.get(name, -1) for name in class_names)


def read_task(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    """Yield the raw items of one task (runs on a Beam worker)."""
    from dpscale.stages import array_sources

    index = {name: i for i, name in enumerate(class_names)}
    if task.kind in ("files", "tar"):
        yield from _read_files(task, index)
    elif task.kind == "idx":
        yield from array_sources.read_idx(task, len(class_names))
    elif task.kind == "tfds":
        yield from array_sources.read_tfds(task, len(class_names))
    elif task.kind == "digits":
        yield from array_sources.read_digits()
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")


def open_maybe_gz(path: str):
    gz = path.endswith((".gz", ".tgz"))
    return gzip.open(path, "rb") if gz else open(path, "rb")


# --- folder and tar sources ------------------------------------------------------------

def _is_tar(path: str) -> bool:
    return path.endswith(_TAR_SUFFIXES)


def split_layout(paths: Sequence[str]) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Assign (split, class) to relative file paths; returns members and class names.

    Single wrapping directories (``cifar10/``) are stripped, but never a split folder or
    the last folder above the files (a one-class set keeps its class). If every top-level folder is a
    split name the layout is ``split/class/file``, otherwise ``class/file`` in ``train``.
    Files at any other depth keep an empty class, so they are reported, not dropped.
    """
    parts = [p.split("/") for p in paths]
    while (parts and all(len(p) > 2 for p in parts) and len({p[0] for p in parts}) == 1
           and parts[0][0].lower() not in SPLIT_ALIASES):
        parts = [p[1:] for p in parts]
    tops = {p[0] for p in parts if len(p) > 1}
    by_split = bool(tops) and all(t.lower() in SPLIT_ALIASES for t in tops)
    depth = 3 if by_split else 2
    members = []
    for full, p in zip(paths, parts):
        split = SPLIT_ALIASES[p[0].lower()] if by_split and len(p) > 1 else "train"
        cls = p[-2] if len(p) == depth else ""
        members.append((split, cls, full))
    train_classes = {c for s, c, _ in members if c and s == "train"}
    classes = train_classes or {c for _, c, _ in members if c}
    return members, sorted(classes)


def _plan_folder(spec: SourceSpec, chunk_size: int) -> SourcePlan:
    path = spec.location
    if not os.path.exists(path):
        raise DataError(f"source path {path!r} does not exist")
    if os.path.isfile(path):
        if not _is_tar(path):
            raise DataError(f"{path!r} is a file but not a .tar/.tar.gz/.tgz archive")
        try:
            with tarfile.open(path) as archive:
                files = [m for m in archive if m.isfile() and not _hidden(m.name)]
            names = [m.name for m in files]
            spans = {m.name: (m.offset_data, m.size) for m in files}
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(f"cannot read archive {path!r}: {exc}") from exc
        members, classes = split_layout(names)
        # Tasks are contiguous runs of members with their byte spans: a worker skips
        # (decompresses) up to its run and reads the spans, parsing no tar headers. (One
        # task for the whole archive once lost the tail of its fan-out on the
        # multi-process runner.)
    else:
        names = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not _hidden(d))
            rel = os.path.relpath(root, path)
            names += [os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/")
                      for f in sorted(files) if not _hidden(f)]
        members, classes = split_layout(names)
    if os.path.isfile(path):
        tasks = tuple(ReadTask("tar", path=path, members=tuple(members[i:i + chunk_size]),
                               extra=(("spans", tuple(spans[m[2]] for m in
                                                      members[i:i + chunk_size])),))
                      for i in range(0, len(members), chunk_size))
    else:
        tasks = tuple(ReadTask("files", path=path, members=tuple(members[i:i + chunk_size]))
                      for i in range(0, len(members), chunk_size))
    if not members:
        raise DataError(f"source {path!r} contains no files")
    sizes: dict[str, int] = {}
    for split, _, _ in members:
        sizes[split] = sizes.get(split, 0) + 1
    return SourcePlan(spec, tuple(classes), tasks, sizes)


def _hidden(name: str) -> bool:
    return os.path.basename(name).startswith(".") or "__MACOSX" in name


def _read_files(task: ReadTask, index: dict[str, int]) -> Iterator[RawItem]:
    wanted = {rel: (split, cls) for split, cls, rel in task.members}

    def item(rel: str, data: bytes) -> RawItem:
        split, cls = wanted[rel]
        return RawItem(split, rel, index.get(cls, UNKNOWN_LABEL), data, label_name=cls)

    if task.kind == "files":
        for rel in wanted:
            try:
                with open(os.path.join(task.path, rel), "rb") as f:
                    data = f.read()
            except OSError:
                data = b""  # unreadable: reported as undecodable downstream
            yield item(rel, data)
        return
    with open_maybe_gz(task.path) as raw:  # spans ascend: every seek is forward
        for (_, _, rel), (offset, size) in zip(task.members, dict(task.extra)["spans"]):
            try:
                raw.seek(offset)
                data = raw.read(size)
            except (OSError, EOFError):
                data = b""
            yield item(rel, data if len(data) == size else b"")  # short: reported
