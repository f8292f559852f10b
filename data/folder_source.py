"""Folder and tar sources: ``PATH/<split>/<class>/*`` or ``PATH/<class>/*``, or an archive of it.

Planning lists the files (or the archive's members with their byte spans) and assigns a
split and a class to each; reading yields the files' bytes undecoded, so decoding and its
failures happen in one place, ``data.examples``.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator, Sequence

from dpscale.data.raw_items import (
    SPLIT_ALIASES,
    UNKNOWN_LABEL,
    PlanOptions,
    RawItem,
    ReadTask,
    SourceKind,
    SourcePlan,
    SourceSpec,
    location_argument,
    open_maybe_gz,
)
from dpscale.errors import DataError

_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar")


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
    while (
        parts
        and all(len(p) > 2 for p in parts)
        and len({p[0] for p in parts}) == 1
        and parts[0][0].lower() not in SPLIT_ALIASES
    ):
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


def plan_folder(spec: SourceSpec, options: PlanOptions) -> SourcePlan:
    path, chunk_size = spec.location, options.chunk_size
    if not os.path.exists(path):
        raise DataError(f"source path {path!r} does not exist")
    if os.path.isfile(path):
        if not _is_tar(path):
            raise DataError(f"{path!r} is a file but not a .tar/.tar.gz/.tgz archive")
        try:
            with tarfile.open(path) as archive:
                files = [m for m in archive if m.isfile() and not _hidden(m.name)]
                _check_end_of_archive(archive, path)
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
            names += [
                os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/") for f in sorted(files) if not _hidden(f)
            ]
        members, classes = split_layout(names)
    if os.path.isfile(path):
        tasks = tuple(
            ReadTask(
                "tar",
                path=path,
                members=tuple(members[i : i + chunk_size]),
                extra=(("spans", tuple(spans[m[2]] for m in members[i : i + chunk_size])),),
            )
            for i in range(0, len(members), chunk_size)
        )
    else:
        tasks = tuple(
            ReadTask("files", path=path, members=tuple(members[i : i + chunk_size]))
            for i in range(0, len(members), chunk_size)
        )
    if not members:
        raise DataError(f"source {path!r} contains no files")
    sizes: dict[str, int] = {}
    for split, _, _ in members:
        sizes[split] = sizes.get(split, 0) + 1
    return SourcePlan(spec, tuple(classes), tasks, sizes)


def _check_end_of_archive(archive: tarfile.TarFile, path: str) -> None:
    """Refuse an archive that stops without tar's end-of-archive marker (a zero block).

    ``tarfile`` ends its listing quietly at a missing or unreadable header, so an archive cut
    at a member boundary (an interrupted download or copy) would ingest as a smaller data set.
    """
    try:
        archive.fileobj.seek(archive.offset)
        block = archive.fileobj.read(tarfile.BLOCKSIZE)
    except (OSError, EOFError) as exc:
        block = b""
        reason = str(exc)
    else:
        reason = "no end-of-archive marker" if len(block) < tarfile.BLOCKSIZE else "an unreadable header"
    if len(block) < tarfile.BLOCKSIZE or block.count(0) != tarfile.BLOCKSIZE:
        raise DataError(
            f"archive {path!r} is truncated or damaged: {reason} after {len(archive.getmembers())} "
            f"members (byte {archive.offset}); a cut download or copy? Ingesting it would leave the "
            "rest out silently"
        )


def _hidden(name: str) -> bool:
    return os.path.basename(name).startswith(".") or "__MACOSX" in name


def read_files(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    index = {name: i for i, name in enumerate(class_names)}
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


FOLDER = SourceKind(
    name="folder",
    syntax="folder:PATH",
    parse=location_argument,
    plan=plan_folder,
    read=read_files,
    task_kinds=("files", "tar"),
)
