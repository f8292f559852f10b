"""Where images come from: parse a source string, plan the reading work, read it.

A source string names one of four kinds of input:

- ``tfds:NAME[:SPLIT]``  a TFDS builder, read through ``tfds.data_source`` (array_record,
  no TensorFlow needed);
- ``folder:PATH``        ``PATH/<split>/<class>/*`` or ``PATH/<class>/*`` (one split,
  ``train``), or a ``.tar.gz``/``.tgz``/``.tar`` archive of that layout;
- ``idx:DIR``            MNIST-format IDX files (``train-images-idx3-ubyte[.gz]``, ...);
- ``digits``             scikit-learn's bundled 8x8 digits, with a 20% test split carved by
  content hash (the set ships without one).

Planning happens once, on the machine that launches the pipeline: it checks the input
exists, finds the class names and cuts the input into small picklable ``ReadTask``s.
``read_task`` runs on the workers and yields ``RawItem``s, still undecoded for files so
that decoding (and its failures) happen in one place, ``stages.examples``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dpscale.errors import DataError, InvalidConfigError

_SPLIT_ALIASES = {"train": "train", "test": "test", "validation": "validation",
                  "val": "validation", "valid": "validation", "t10k": "test"}
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar")
DIGITS_TEST_FRACTION = 0.2
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
    if spec.kind == "folder":
        return _plan_folder(spec, chunk_size)
    if spec.kind == "idx":
        return _plan_idx(spec, chunk_size)
    if spec.kind == "tfds":
        return _plan_tfds(spec, chunk_size, tfds_data_dir)
    return _plan_digits(spec)


def read_task(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    """Yield the raw items of one task (runs on a Beam worker)."""
    index = {name: i for i, name in enumerate(class_names)}
    if task.kind in ("files", "tar"):
        yield from _read_files(task, index)
    elif task.kind == "idx":
        yield from _read_idx(task, len(class_names))
    elif task.kind == "tfds":
        yield from _read_tfds(task, len(class_names))
    elif task.kind == "digits":
        yield from _read_digits()
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")


# --- folder and tar sources ------------------------------------------------------------

def _is_tar(path: str) -> bool:
    return path.endswith(_TAR_SUFFIXES)


def _split_layout(paths: Sequence[str]) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Assign (split, class) to relative file paths; returns members and class names.

    Single wrapping directories (``cifar10/``) are stripped. If every top-level folder is a
    split name the layout is ``split/class/file``, otherwise ``class/file`` in ``train``.
    Files at any other depth keep an empty class, so they are reported, not dropped.
    """
    parts = [p.split("/") for p in paths]
    while parts and all(len(p) > 1 for p in parts) and len({p[0] for p in parts}) == 1:
        parts = [p[1:] for p in parts]
    tops = {p[0] for p in parts if len(p) > 1}
    by_split = bool(tops) and all(t.lower() in _SPLIT_ALIASES for t in tops)
    depth = 3 if by_split else 2
    members = []
    for full, p in zip(paths, parts):
        split = _SPLIT_ALIASES[p[0].lower()] if by_split and len(p) > 1 else "train"
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
            offsets = {m.name: m.offset for m in files}
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(f"cannot read archive {path!r}: {exc}") from exc
        members, classes = _split_layout(names)
        # Tasks are contiguous runs of members; each decompresses and skips the bytes
        # before its run (cheap) and parses only its own members. (One task for the whole
        # archive lost the tail of its huge fan-out on Beam's multi-process runner.)
    else:
        names = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not _hidden(d))
            rel = os.path.relpath(root, path)
            names += [os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/")
                      for f in sorted(files) if not _hidden(f)]
        members, classes = _split_layout(names)
    if os.path.isfile(path):  # start offset of each run: a task skips the bytes before it
        tasks = tuple(ReadTask("tar", path=path, members=tuple(members[i:i + chunk_size]),
                               start=offsets[members[i][2]])
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
    seen: set[str] = set()
    with _open_maybe_gz(task.path) as raw:
        raw.seek(task.start)  # a header block: the stream reads on from there
        archive = tarfile.open(fileobj=raw, mode="r|")
        for member in archive:
            if member.name in wanted and member.name not in seen:
                seen.add(member.name)
                handle = archive.extractfile(member)
                yield item(member.name, handle.read() if handle else b"")
                if len(seen) == len(wanted):
                    return
    for rel in wanted.keys() - seen:  # vanished since planning: reported as undecodable
        yield item(rel, b"")


# --- IDX (MNIST format) --------------------------------------------------------------

def _open_maybe_gz(path: str):
    gz = path.endswith((".gz", ".tgz"))
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _idx_header(path: str) -> tuple[int, tuple[int, ...]]:
    """Return (header size, dims) of an IDX file of unsigned bytes."""
    with _open_maybe_gz(path) as f:
        magic = f.read(4)
        if len(magic) != 4 or magic[:2] != b"\0\0" or magic[2] != 0x08:
            raise DataError(f"{path!r} is not an IDX file of unsigned bytes")
        ndim = magic[3]
        raw = f.read(4 * ndim)
    if len(raw) != 4 * ndim:
        raise DataError(f"{path!r}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4"))
    return 4 + 4 * ndim, dims


def _find_idx_pairs(directory: str) -> dict[str, tuple[str, str]]:
    """Map split -> (images file, labels file) by the usual MNIST file names."""
    files = sorted(os.listdir(directory))
    pairs = {}
    for name in files:
        base = name[:-3] if name.endswith(".gz") else name
        for marker in ("-images-idx3-ubyte", "-images.idx3-ubyte"):
            if base.endswith(marker):
                prefix = base[: -len(marker)]
                labels = [f for f in files if f.startswith(prefix) and "labels" in f
                          and "idx1" in f]
                split = _SPLIT_ALIASES.get(prefix.lower(), prefix.lower())
                if not labels:
                    raise DataError(f"no labels file for {name!r} in {directory!r}")
                pairs[split] = (os.path.join(directory, name),
                                os.path.join(directory, labels[0]))
    return pairs


def _read_idx_labels(path: str) -> np.ndarray:
    header, dims = _idx_header(path)
    with _open_maybe_gz(path) as f:
        f.seek(header)
        labels = np.frombuffer(f.read(), dtype=np.uint8)
    if len(dims) != 1 or labels.size != dims[0]:
        raise DataError(f"{path!r}: expected {dims[0]} labels, found {labels.size}")
    return labels


def _plan_idx(spec: SourceSpec, chunk_size: int) -> SourcePlan:
    directory = spec.location
    if not os.path.isdir(directory):
        raise DataError(f"IDX directory {directory!r} does not exist")
    pairs = _find_idx_pairs(directory)
    if not pairs:
        raise DataError(f"no *-images-idx3-ubyte[.gz] files in {directory!r}")
    names_file = os.path.join(directory, "classes.txt")
    if os.path.exists(names_file):
        with open(names_file) as f:
            classes = tuple(line.strip() for line in f if line.strip())
    else:  # IDX carries no names: classes are 0..max label of the training split
        fit = pairs.get("train") or next(iter(pairs.values()))
        classes = tuple(str(i) for i in range(int(_read_idx_labels(fit[1]).max()) + 1))
    tasks, sizes = [], {}
    for split, (images, labels) in sorted(pairs.items()):
        header, dims = _idx_header(images)
        if len(dims) not in (3, 4):
            raise DataError(f"{images!r}: expected [N,H,W] or [N,H,W,C] images, got {dims}")
        n_labels = _idx_header(labels)[1][0]
        if n_labels != dims[0]:
            raise DataError(f"{images!r} has {dims[0]} images but {labels!r} {n_labels} labels")
        sizes[split] = dims[0]
        extra = (("labels", labels), ("header", header), ("dims", dims))
        tasks += [ReadTask("idx", path=images, split=split, start=s,
                           stop=min(s + chunk_size, dims[0]), extra=extra)
                  for s in range(0, dims[0], chunk_size)]
    return SourcePlan(spec, classes, tuple(tasks), sizes)


def _read_idx(task: ReadTask, num_classes: int) -> Iterator[RawItem]:
    extra = dict(task.extra)
    dims = extra["dims"]
    shape = tuple(dims[1:]) if len(dims) == 4 else (dims[1], dims[2], 1)
    size = int(np.prod(shape))
    labels = _read_idx_labels(extra["labels"])[task.start:task.stop]
    with _open_maybe_gz(task.path) as f:
        f.seek(extra["header"] + task.start * size)
        data = f.read((task.stop - task.start) * size)
    count = len(data) // size  # a truncated file yields fewer images; rest is reported
    images = np.frombuffer(data[: count * size], dtype=np.uint8).reshape((count, *shape))
    base = os.path.basename(task.path)
    for i, label in enumerate(labels):
        key = f"{base}[{task.start + i}]"
        payload = images[i] if i < count else b""
        known = int(label) < num_classes
        yield RawItem(task.split, key, int(label) if known else UNKNOWN_LABEL, payload,
                      label_name=str(int(label)))


# --- TFDS ------------------------------------------------------------------------------

def _tfds_keys(features: Any) -> tuple[str, str]:
    """Pick the image and label feature names of a TFDS builder."""
    import tensorflow_datasets as tfds

    image = [k for k, f in features.items() if isinstance(f, tfds.features.Image)]
    label = [k for k, f in features.items() if isinstance(f, tfds.features.ClassLabel)]
    if not image or not label:
        raise DataError("TFDS dataset needs an Image and a ClassLabel feature")
    pick = lambda keys, pref: pref if pref in keys else keys[0]  # noqa: E731
    return pick(image, "image"), pick(label, "label")


def _plan_tfds(spec: SourceSpec, chunk_size: int, data_dir: str | None) -> SourcePlan:
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(spec.location, data_dir=data_dir)
        splits = [spec.split] if spec.split else sorted(builder.info.splits.keys())
        sources = {s: tfds.data_source(spec.location, split=s, data_dir=data_dir)
                   for s in splits}
    except Exception as exc:  # noqa: BLE001 - TFDS raises many kinds; all are user-facing
        raise DataError(f"cannot load TFDS dataset {spec.location!r}: {exc}") from exc
    image_key, label_key = _tfds_keys(builder.info.features)
    classes = tuple(builder.info.features[label_key].names)
    tasks, sizes = [], {}
    for split, source in sources.items():
        name = _SPLIT_ALIASES.get(split.split("[")[0], split.split("[")[0])
        sizes[name] = len(source)
        extra = (("name", spec.location), ("selection", split), ("data_dir", data_dir),
                 ("image_key", image_key), ("label_key", label_key))
        tasks += [ReadTask("tfds", split=name, start=s, stop=min(s + chunk_size, len(source)),
                           extra=extra) for s in range(0, len(source), chunk_size)]
    return SourcePlan(spec, classes, tuple(tasks), sizes)


def _read_tfds(task: ReadTask, num_classes: int) -> Iterator[RawItem]:
    import tensorflow_datasets as tfds

    extra = dict(task.extra)
    source = tfds.data_source(extra["name"], split=extra["selection"],
                              data_dir=extra["data_dir"], download=False)
    for i in range(task.start, task.stop):
        record = source[i]
        label = int(record[extra["label_key"]])
        known = 0 <= label < num_classes
        yield RawItem(task.split, f"{extra['selection']}[{i}]",
                      label if known else UNKNOWN_LABEL,
                      np.asarray(record[extra["image_key"]]), label_name=str(label))


# --- scikit-learn digits ---------------------------------------------------------------

def _plan_digits(spec: SourceSpec) -> SourcePlan:
    items = list(_read_digits())
    sizes: dict[str, int] = {}
    for item in items:
        sizes[item.split] = sizes.get(item.split, 0) + 1
    return SourcePlan(spec, tuple(str(i) for i in range(10)), (ReadTask("digits"),), sizes)


def _read_digits() -> Iterator[RawItem]:
    """The 1,797 8x8 digits, scaled 0..16 -> 0..255; test split by content hash."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = np.round(data.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    for i, (image, label) in enumerate(zip(images, data.target)):
        digest = hashlib.sha256(b"digits-test\0" + image.tobytes()).digest()
        is_test = int.from_bytes(digest[:8], "big") < DIGITS_TEST_FRACTION * 2**64
        yield RawItem("test" if is_test else "train", f"digits[{i}]", int(label), image)
