"""Sources whose items are already pixel arrays: IDX files, TFDS builders, sklearn digits.

Each kind has a ``plan_*`` (runs where the pipeline is launched: checks the input, finds
class names, cuts ``ReadTask``s) and a ``read_*`` (runs on a worker, yields ``RawItem``s),
tied together in its :class:`SourceKind` (``IDX``, ``TFDS``, ``DIGITS``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

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

DIGITS_TEST_FRACTION = 0.2


# --- IDX (MNIST format) --------------------------------------------------------------


def _idx_header(path: str) -> tuple[int, tuple[int, ...]]:
    """Return (header size, dims) of an IDX file of unsigned bytes."""
    with open_maybe_gz(path) as f:
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
                labels = [f for f in files if f.startswith(prefix) and "labels" in f and "idx1" in f]
                split = SPLIT_ALIASES.get(prefix.lower(), prefix.lower())
                if not labels:
                    raise DataError(f"no labels file for {name!r} in {directory!r}")
                pairs[split] = (os.path.join(directory, name), os.path.join(directory, labels[0]))
    return pairs


def _idx_labels_header(path: str) -> tuple[int, int]:
    """(header size, number of labels) of an IDX label file: one dimension, at least one label."""
    header, dims = _idx_header(path)
    if len(dims) != 1:
        raise DataError(f"{path!r}: an IDX label file has 1 dimension, this one has {len(dims)} {list(dims)}")
    if dims[0] == 0:
        raise DataError(f"{path!r} holds 0 labels (an empty split)")
    return header, dims[0]


def _read_idx_labels(path: str) -> np.ndarray:
    header, count = _idx_labels_header(path)
    with open_maybe_gz(path) as f:
        f.seek(header)
        labels = np.frombuffer(f.read(), dtype=np.uint8)
    if labels.size != count:
        raise DataError(f"{path!r}: expected {count} labels, found {labels.size}")
    return labels


def _classes_from_labels(path: str) -> tuple[str, ...]:
    """Classes ``0..max label`` of a training label file, refused when some of them have no example.

    IDX carries no class names; one corrupt label (255) would otherwise make 256 classes,
    most of them empty, and a model with that many outputs.
    """
    labels = _read_idx_labels(path)
    counts = np.bincount(labels)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        top = int(labels.max())
        raise DataError(
            f"{path!r}: labels run 0..{top} but {empty.size} of those {top + 1} classes have no example "
            f"(e.g. {', '.join(map(str, empty[:3]))}; {int(counts[top])} example(s) labelled {top}): a corrupt "
            "label? Name the classes in classes.txt (one per line) beside the IDX files; other labels are then "
            "rejected and listed in report.json"
        )
    return tuple(str(i) for i in range(counts.size))


def plan_idx(spec: SourceSpec, options: PlanOptions) -> SourcePlan:
    directory, chunk_size = spec.location, options.chunk_size
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
        classes = _classes_from_labels(fit[1])
    tasks, sizes = [], {}
    for split, (images, labels) in sorted(pairs.items()):
        header, dims = _idx_header(images)
        if len(dims) not in (3, 4):
            raise DataError(f"{images!r}: expected [N,H,W] or [N,H,W,C] images, got {list(dims)}")
        if 0 in dims:
            raise DataError(f"{images!r} holds no images (dimensions {list(dims)})")
        n_labels = _idx_labels_header(labels)[1]
        if n_labels != dims[0]:
            raise DataError(f"{images!r} has {dims[0]} images but {labels!r} {n_labels} labels")
        sizes[split] = dims[0]
        extra = (("labels", labels), ("header", header), ("dims", dims))
        tasks += [
            ReadTask("idx", path=images, split=split, start=s, stop=min(s + chunk_size, dims[0]), extra=extra)
            for s in range(0, dims[0], chunk_size)
        ]
    return SourcePlan(spec, classes, tuple(tasks), sizes)


def read_idx(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    num_classes = len(class_names)
    extra = dict(task.extra)
    dims = extra["dims"]
    shape = tuple(dims[1:]) if len(dims) == 4 else (dims[1], dims[2], 1)
    size = int(np.prod(shape))
    labels = _read_idx_labels(extra["labels"])[task.start : task.stop]
    with open_maybe_gz(task.path) as f:
        f.seek(extra["header"] + task.start * size)
        data = f.read((task.stop - task.start) * size)
    count = len(data) // size  # a truncated file yields fewer images; rest is reported
    images = np.frombuffer(data[: count * size], dtype=np.uint8).reshape((count, *shape))
    base = os.path.basename(task.path)
    for i, label in enumerate(labels):
        key = f"{base}[{task.start + i}]"
        payload = images[i] if i < count else b""
        known = int(label) < num_classes
        yield RawItem(task.split, key, int(label) if known else UNKNOWN_LABEL, payload, label_name=str(int(label)))


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


def _tfds_argument(rest: str) -> tuple[str, str | None] | None:
    """``NAME[:SPLIT]``: the builder name, and the split selection if one is given."""
    if not rest:
        return None
    name, _, split = rest.partition(":")
    return name, split or None


def plan_tfds(spec: SourceSpec, options: PlanOptions) -> SourcePlan:
    """A TFDS dataset already prepared in ``tfds_data_dir`` (or TFDS's default): dpscale never downloads.

    Preparing a dataset (``download_and_prepare``) fetches it from the internet, prints on stdout
    and needs packages that reading a prepared one does not, so a dataset that is not there is
    refused in one line that says how to prepare it, and reads never fall back to preparing.
    """
    import tensorflow_datasets as tfds

    chunk_size, data_dir = options.chunk_size, options.tfds_data_dir
    try:
        builder = tfds.builder(spec.location, data_dir=data_dir)
        available = sorted(builder.info.splits.keys())  # empty when it was never prepared
    except Exception as exc:  # noqa: BLE001 - TFDS raises many kinds; all are user-facing
        reason = " ".join(str(exc).split()).split(" Available datasets:")[0]  # not the whole catalogue
        raise DataError(f"cannot load TFDS dataset {spec.location!r}: {reason[:200]}") from None
    where = data_dir or "TFDS's default data directory"
    not_prepared = DataError(
        f"TFDS dataset {spec.location!r} is not prepared in {where} (dpscale reads prepared TFDS data only, it never "
        f"downloads): prepare it there in ArrayRecord format, e.g. `tfds build {spec.location} "
        f"--file_format=array_record{f' --data_dir={data_dir}' if data_dir else ''}`, or give --tfds-data-dir "
        "where it is"
    )
    if not spec.split and not available:
        raise not_prepared
    splits = [spec.split] if spec.split else available
    try:
        sources = {s: tfds.data_source(spec.location, split=s, data_dir=data_dir, download=False) for s in splits}
    except Exception as exc:  # noqa: BLE001 - e.g. a split that is not there, or not in ArrayRecord format
        if not builder.is_prepared():
            raise not_prepared from None
        raise DataError(
            f"cannot read TFDS dataset {spec.location!r} (splits {', '.join(available) or '?'}): "
            f"{' '.join(str(exc).split())[:200]}"
        ) from None
    image_key, label_key = _tfds_keys(builder.info.features)
    classes = tuple(builder.info.features[label_key].names)
    tasks, sizes = [], {}
    for split, source in sources.items():
        name = SPLIT_ALIASES.get(split.split("[")[0], split.split("[")[0])
        sizes[name] = len(source)
        extra = (
            ("name", spec.location),
            ("selection", split),
            ("data_dir", data_dir),
            ("image_key", image_key),
            ("label_key", label_key),
        )
        tasks += [
            ReadTask("tfds", split=name, start=s, stop=min(s + chunk_size, len(source)), extra=extra)
            for s in range(0, len(source), chunk_size)
        ]
    return SourcePlan(spec, classes, tuple(tasks), sizes)


def read_tfds(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    import tensorflow_datasets as tfds

    num_classes = len(class_names)
    extra = dict(task.extra)
    source = tfds.data_source(extra["name"], split=extra["selection"], data_dir=extra["data_dir"], download=False)
    for i in range(task.start, task.stop):
        record = source[i]
        label = int(record[extra["label_key"]])
        known = 0 <= label < num_classes
        yield RawItem(
            task.split,
            f"{extra['selection']}[{i}]",
            label if known else UNKNOWN_LABEL,
            np.asarray(record[extra["image_key"]]),
            label_name=str(label),
        )


# --- scikit-learn digits ---------------------------------------------------------------


def _no_argument(rest: str) -> tuple[str, str | None] | None:
    return ("", None) if not rest else None


def plan_digits(spec: SourceSpec, options: PlanOptions) -> SourcePlan:
    """One task for the whole (tiny, bundled) set, whatever ``options`` ask."""
    items = list(_digits())
    sizes: dict[str, int] = {}
    for item in items:
        sizes[item.split] = sizes.get(item.split, 0) + 1
    return SourcePlan(spec, tuple(str(i) for i in range(10)), (ReadTask("digits"),), sizes)


def read_digits(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    """The one digits task: every image (the labels are the digits, whatever the names)."""
    return _digits()


def _digits() -> Iterator[RawItem]:
    """The 1,797 8x8 digits, scaled 0..16 -> 0..255; test split by content hash."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = np.round(data.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    for i, (image, label) in enumerate(zip(images, data.target)):
        digest = hashlib.sha256(b"digits-test\0" + image.tobytes()).digest()
        is_test = int.from_bytes(digest[:8], "big") < DIGITS_TEST_FRACTION * 2**64
        yield RawItem("test" if is_test else "train", f"digits[{i}]", int(label), image)


IDX = SourceKind(
    name="idx", syntax="idx:DIR", parse=location_argument, plan=plan_idx, read=read_idx, task_kinds=("idx",)
)
TFDS = SourceKind(
    name="tfds", syntax="tfds:NAME[:SPLIT]", parse=_tfds_argument, plan=plan_tfds, read=read_tfds, task_kinds=("tfds",)
)
DIGITS = SourceKind(
    name="digits", syntax="digits", parse=_no_argument, plan=plan_digits, read=read_digits, task_kinds=("digits",)
)
