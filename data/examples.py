"""Per-example work of ingestion: decode, validate, hash, assign splits, (de)serialise.

Plain functions, so the Beam graph in ``pipelines.ingest`` only wires them together and
each is tested on its own.

On-disk record (format version 1), one ArrayRecord record per example, little endian::

    magic   b"DPSX"      4 bytes
    version  uint8       = 1
    encoding uint8       0 = raw uint8 pixels (row-major H, W, C), 1 = PNG
    height   uint16, width uint16, channels uint8
    label    int32       class index into manifest["class_names"]
    digest   32 bytes    sha256 content hash of the decoded image (the example id)
    key_len  uint16, key bytes (utf-8): where the example came from (path or index)
    image    the rest: pixels or PNG bytes

ArrayRecord itself compresses each record (zstd, group size 1 for random access).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import struct
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dpscale.data.raw_items import UNKNOWN_LABEL, RawItem, ReadTask
from dpscale.data.sources import read_task

MAGIC = b"DPSX"
RECORD_VERSION = 1
ENCODINGS = {"raw": 0, "png": 1}
_HEADER = struct.Struct("<4sBBHHBi32sH")
HASH_MODULUS = 2**256


@dataclasses.dataclass(frozen=True)
class Example:
    """A decoded, validated example. ``digest`` (sha256 of shape + pixels) is its id."""

    split: str
    key: str
    label: int
    image: np.ndarray  # uint8 [H, W, C]
    digest: bytes

    @property
    def id(self) -> str:
        return self.digest.hex()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.image.shape)


class Encoded(NamedTuple):
    """An example ready for its shard: the record plus what sorting, checks and hashing use."""

    split: str
    key: str
    label: int
    shape: tuple[int, ...]
    digest: bytes
    record: bytes


@dataclasses.dataclass(frozen=True)
class TaskOutput:
    """One read task's work, batched so Beam moves a few lists instead of every image."""

    batches: dict[tuple[str, int], list[Encoded]]  # (split, shard) -> encoded examples
    shape_counts: dict[tuple[int, ...], int]
    rejections: list[Rejection]
    num_excluded: int = 0  # items of classes left out by a class filter (not rejections)


@dataclasses.dataclass(frozen=True)
class Rejection:
    """An input that did not become an example, and why (goes to report.json)."""

    split: str
    key: str
    reason: str  # "undecodable" | "unknown_label" | "wrong_shape"
    detail: str = ""

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def content_digest(image: np.ndarray) -> bytes:
    """sha256 over the shape and the pixels: equal images get equal ids, whatever the file."""
    shape = "x".join(str(d) for d in image.shape).encode()
    return hashlib.sha256(shape + b"\0" + np.ascontiguousarray(image).tobytes()).digest()


def decode_image(data: bytes) -> np.ndarray:
    """Decode PNG/JPEG/... bytes to uint8 [H, W, C]; grayscale keeps one channel.

    Palette and CMYK-like modes become RGB; alpha is kept (an RGBA image in an RGB set is
    then reported as a wrong shape rather than silently flattened).
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        if img.mode in ("1", "I", "I;16", "F"):
            img = img.convert("L")
        elif img.mode not in ("L", "LA", "RGB", "RGBA"):
            img = img.convert("RGBA" if "A" in img.mode or "transparency" in img.info else "RGB")
        array = np.asarray(img, dtype=np.uint8)
    return array[..., None] if array.ndim == 2 else array


def to_example(item: RawItem) -> Example | Rejection:
    """Decode one raw item, or say why it cannot be an example."""
    if item.label == UNKNOWN_LABEL:
        detail = (
            f"class {item.label_name!r} is not a known class"
            if item.label_name
            else "file is not inside a class folder"
        )
        return Rejection(item.split, item.key, "unknown_label", detail)
    if isinstance(item.payload, np.ndarray):
        image = item.payload
        if image.ndim == 2:
            image = image[..., None]
        if image.ndim != 3 or image.dtype != np.uint8:
            return Rejection(
                item.split, item.key, "undecodable", f"expected uint8 [H,W,C], got {image.dtype} {image.shape}"
            )
    else:
        try:
            image = decode_image(item.payload)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is a data problem
            return Rejection(item.split, item.key, "undecodable", f"{type(exc).__name__}: {exc}"[:200])
    image = np.ascontiguousarray(image)
    return Example(item.split, item.key, item.label, image, content_digest(image))


def majority_shape(shape_counts: list[tuple[tuple[int, ...], int]]) -> tuple[int, ...] | None:
    """The most common image shape; ties go to the smallest shape, so the pick is stable."""
    if not shape_counts:
        return None
    return min(shape_counts, key=lambda sc: (-sc[1], sc[0]))[0]


def check_shape(example: Example | Encoded, shape: Sequence[int] | None) -> Example | Encoded | Rejection:
    """Reject examples whose shape differs from the data set's majority shape."""
    if shape is None or tuple(example.shape) == tuple(shape):
        return example
    return Rejection(
        example.split, example.key, "wrong_shape", f"shape {tuple(example.shape)} != majority shape {tuple(shape)}"
    )


def _unit_interval(salt: bytes, digest: bytes) -> float:
    return int.from_bytes(hashlib.sha256(salt + digest).digest()[:8], "big") / 2**64


def assign_validation(example: Example, fraction: float) -> Example:
    """Move a ``train`` example to ``validation`` by its content hash, not its position.

    The same image always lands on the same side, whatever the input order, and exact
    duplicates cannot straddle train and validation.
    """
    if example.split != "train" or fraction <= 0:
        return example
    if _unit_interval(b"validation\0", example.digest) < fraction:
        return dataclasses.replace(example, split="validation")
    return example


def shard_index(example: Example | Encoded, num_shards: int) -> int:
    """Shard of an example, from its content hash (independent of input order)."""
    return int.from_bytes(example.digest[8:16], "big") % num_shards


def element_hash(split: str, label: int, digest: bytes) -> int:
    """An example's term in the data set hash: depends on split, label and content only."""
    h = hashlib.sha256(f"{split}\0{label}\0".encode() + digest).digest()
    return int.from_bytes(h, "big")


def combine_hashes(terms: list[int]) -> int:
    """Order-independent multiset hash: the sum of element hashes modulo 2**256.

    A sum (unlike XOR) does not cancel duplicated examples, and partial sums combine
    across shards and workers.
    """
    return sum(terms) % HASH_MODULUS


def encode_record(example: Example, *, encoding: str = "raw") -> bytes:
    """Serialise an example in the record format described in the module docstring."""
    h, w, c = example.image.shape
    key = example.key.encode("utf-8")[:65535]
    if encoding == "png":
        from PIL import Image

        buf = io.BytesIO()
        img = example.image[..., 0] if c == 1 else example.image
        Image.fromarray(img).save(buf, format="PNG")
        body = buf.getvalue()
    else:
        body = example.image.tobytes()
    header = _HEADER.pack(MAGIC, RECORD_VERSION, ENCODINGS[encoding], h, w, c, example.label, example.digest, len(key))
    return header + key + body


def encode(example: Example, *, encoding: str = "raw") -> Encoded:
    return Encoded(
        example.split,
        example.key,
        example.label,
        example.shape,
        example.digest,
        encode_record(example, encoding=encoding),
    )


def process_task(
    task: ReadTask,
    class_names: Sequence[str],
    *,
    validation_fraction: float,
    shards_per_split: dict[str, int],
    encoding: str,
    label_map: Sequence[int] | None = None,
) -> TaskOutput:
    """Read, decode, split, encode and shard-key every item of one read task.

    ``label_map`` (a class filter) maps each source label to its new label, or to -1 to
    leave the item out; left-out items are counted, not decoded and not reported.
    """
    batches: dict[tuple[str, int], list[Encoded]] = {}
    shapes: Counter[tuple[int, ...]] = Counter()
    rejections = []
    excluded = 0
    for item in read_task(task, class_names):
        if label_map is not None and item.label != UNKNOWN_LABEL:
            if label_map[item.label] < 0:
                excluded += 1
                continue
            item = dataclasses.replace(item, label=label_map[item.label])
        result = to_example(item)
        if isinstance(result, Rejection):
            rejections.append(result)
            continue
        encoded = encode(assign_validation(result, validation_fraction), encoding=encoding)
        shapes[encoded.shape] += 1
        shard = shard_index(encoded, shards_per_split.get(encoded.split, 1))
        batches.setdefault((encoded.split, shard), []).append(encoded)
    return TaskOutput(batches, dict(shapes), rejections, excluded)


def decode_record(record: bytes, *, split: str = "") -> Example:
    """Parse a record written by ``encode_record``."""
    magic, version, enc, h, w, c, label, digest, key_len = _HEADER.unpack_from(record)
    if magic != MAGIC or version != RECORD_VERSION:
        raise ValueError(f"not a dpscale v{RECORD_VERSION} record")
    start = _HEADER.size + key_len
    key = record[_HEADER.size : start].decode("utf-8")
    if enc == ENCODINGS["raw"]:
        image = np.frombuffer(record, dtype=np.uint8, offset=start).reshape(h, w, c)
    else:
        image = decode_image(record[start:]).reshape(h, w, c)
    return Example(split, key, label, image, digest)


def record_label(record: bytes) -> int:
    """The label of a record without touching its pixels (cheap, for label-only reads)."""
    return _HEADER.unpack_from(record)[6]


def record_digest(record: bytes) -> bytes:
    """The example id (sha256 of the decoded image) of a record without touching its pixels."""
    return _HEADER.unpack_from(record)[7]
