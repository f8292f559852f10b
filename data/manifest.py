"""The manifest of an ingested dataset: ``manifest.json`` as a typed object.

Ingest and dedup write it last (a manifest means the dataset is complete); everything that
opens a dataset reads it through ``Manifest.from_json``, which refuses another format,
another version or a malformed file in one line instead of failing later on a missing key.
The JSON layout is the on-disk format (version ``FORMAT_VERSION``), so ``to_json`` writes
exactly the keys that ``from_json`` reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpscale.errors import DataError

FORMAT_NAME = "dpscale-ingest"
FORMAT_VERSION = 1
CONTENT_HASH_METHOD = "sum mod 2**256 of sha256(split, label, sha256(image))"


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One ArrayRecord file of a split and how many records it holds."""

    file: str
    num_examples: int


@dataclasses.dataclass(frozen=True)
class SplitEntry:
    """One split: its size, class counts, content hash and shards (read in this order)."""

    num_examples: int
    class_counts: dict[str, int]
    content_hash: str
    shards: tuple[ShardEntry, ...]


@dataclasses.dataclass(frozen=True)
class ClassFilter:
    """Present when ingest kept only some classes of the source (relabelled 0..k-1)."""

    source_class_names: tuple[str, ...]
    num_excluded: int


@dataclasses.dataclass(frozen=True)
class DedupProvenance:
    """Present when the dataset is a dedup output: the public data it came from (never a hash of the
    private data it was compared with: this dataset may be shared, and such a hash answers membership)."""

    public_content_hash: str
    threshold: float
    num_removed: int
    report: str
    refine: bool = False  # the second decision (dedup.refine) ran; False in manifests from before it
    copy_cut: float | None = None  # the copy decision (dedup.copy_decision) ran at this cut; None: not run
    copy_model_sha256: str | None = None  # ... with the copy model of these weights (a cut means little without them)
    copy_local_weight: float = 0.0  # ... and this weight of the local agreement; 0 in manifests from before it


@dataclasses.dataclass(frozen=True)
class Manifest:
    source: str
    record_encoding: str
    image_shape: tuple[int, ...] | None  # None: every input was rejected
    class_names: tuple[str, ...]
    content_hash: str
    validation_fraction: float
    splits: dict[str, SplitEntry]
    num_inputs: int = 0
    num_rejected: int = 0
    rejected_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    class_filter: ClassFilter | None = None
    dedup: DedupProvenance | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def num_examples(self) -> int:
        return sum(entry.num_examples for entry in self.splits.values())

    def to_json(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "source": self.source,
            "record_encoding": self.record_encoding,
            "image_shape": list(self.image_shape) if self.image_shape else None,
            "class_names": list(self.class_names),
            "num_classes": self.num_classes,
            "content_hash": self.content_hash,
            "content_hash_method": CONTENT_HASH_METHOD,
            "validation_fraction": self.validation_fraction,
            "splits": {
                name: {
                    "num_examples": e.num_examples,
                    "shards": [dataclasses.asdict(s) for s in e.shards],
                    "class_counts": dict(e.class_counts),
                    "content_hash": e.content_hash,
                }
                for name, e in sorted(self.splits.items())
            },
            "num_rejected": self.num_rejected,
            "rejected_by_reason": dict(sorted(self.rejected_by_reason.items())),
            "num_inputs": self.num_inputs,
        }
        if self.class_filter is not None:
            payload["class_filter"] = {
                "source_class_names": list(self.class_filter.source_class_names),
                "num_excluded": self.class_filter.num_excluded,
            }
        if self.dedup is not None:
            payload["dedup"] = dataclasses.asdict(self.dedup)
        return payload

    @classmethod
    def from_json(cls, payload: Any, *, where: str = "manifest") -> Manifest:
        """Parse a manifest, or raise ``DataError`` naming ``where`` and what is wrong."""
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
            raise DataError(f"{where}: not a {FORMAT_NAME} manifest")
        if payload.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{where}: format version {payload.get('format_version')} is not supported (expected {FORMAT_VERSION})"
            )
        try:
            splits = {
                name: SplitEntry(
                    num_examples=int(e["num_examples"]),
                    class_counts=dict(e["class_counts"]),
                    content_hash=str(e["content_hash"]),
                    shards=tuple(ShardEntry(str(s["file"]), int(s["num_examples"])) for s in e["shards"]),
                )
                for name, e in payload["splits"].items()
            }
            class_filter = payload.get("class_filter")
            dedup = payload.get("dedup")
            return cls(
                source=str(payload["source"]),
                record_encoding=str(payload["record_encoding"]),
                image_shape=tuple(payload["image_shape"]) if payload["image_shape"] else None,
                class_names=tuple(payload["class_names"]),
                content_hash=str(payload["content_hash"]),
                validation_fraction=float(payload["validation_fraction"]),
                splits=splits,
                num_inputs=int(payload.get("num_inputs", 0)),
                num_rejected=int(payload["num_rejected"]),
                rejected_by_reason=dict(payload["rejected_by_reason"]),
                class_filter=None
                if class_filter is None
                else ClassFilter(tuple(class_filter["source_class_names"]), int(class_filter["num_excluded"])),
                dedup=None if dedup is None else DedupProvenance(**dedup),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None
