"""Cache keys of the feature store: what makes two sets of features interchangeable.

Features depend on the pixels (the ingested data's identity: its content hash keyed with the
cache's own secret, ``data.identity``, so neither the key nor the entry's path, which runs
record, is a plain hash of possibly private data), the backbone's weights
(their sha256, not a file name), how pixels reach the backbone (resolution, mean, std,
resize method, whether features are averaged with the mirror image's), where the backbone
is cut (``cut``: activations of an inner layer instead of the pooled features, and ``views``
of them per image) and how dpscale lays features out on disk (the feature-format version).
The key is the sha256 of a canonical JSON of exactly those parts; anything else (where
the data lives, batch size, runner) cannot change the features and stays out of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from dpscale.errors import DataError

#: Bump whenever the on-disk layout or the meaning of stored features changes.
FEATURE_FORMAT_VERSION = 3  # 2: keys name the data by a keyed identity; 3: every chunk has a CRC32C
RESIZE_METHODS = ("bilinear", "nearest", "cubic", "lanczos3", "lanczos5")


@dataclasses.dataclass(frozen=True)
class FeatureKey:
    """The parts a feature-store entry is addressed by; ``digest`` is the entry's name."""

    data_identity: str  # data.identity.keyed_identity of the manifest's content hash
    weights_sha256: str
    model: str
    resolution: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize_method: str = "bilinear"
    format_version: int = FEATURE_FORMAT_VERSION
    flip_average: bool = False
    cut: str = ""  # "": the pooled features; else the activations at this named cut (models.cuts)
    views: int = 1  # cut entries: 1 = the image itself; K > 1 = K random crop-and-flip views per image

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        object.__setattr__(self, "flip_average", bool(self.flip_average))
        if self.resize_method not in RESIZE_METHODS:
            raise DataError(f"resize method must be one of {', '.join(RESIZE_METHODS)}, got {self.resize_method!r}")
        if not self.data_identity or not self.weights_sha256:
            raise DataError("a feature key needs the data identity and the weights sha256")
        if not isinstance(self.views, int) or isinstance(self.views, bool) or self.views < 1:
            raise DataError(f"views must be a positive integer, got {self.views!r}")
        if self.views > 1 and not self.cut:
            raise DataError("augmented views are cached at a cut only (pooled features have no augmult)")
        if self.cut and self.flip_average:
            raise DataError("flip averaging applies to pooled features, not to activations at a cut")

    def as_dict(self) -> dict[str, Any]:
        parts = dataclasses.asdict(self)
        parts["mean"], parts["std"] = list(self.mean), list(self.std)
        # Parts at their defaults are absent, so entries made before an option existed keep their names.
        for name, default in (("flip_average", False), ("cut", ""), ("views", 1)):
            if parts[name] == default:
                del parts[name]
        return parts

    @classmethod
    def from_dict(cls, parts: dict[str, Any]) -> FeatureKey:
        try:
            return cls(**parts)
        except TypeError as exc:
            raise DataError(f"malformed feature key {parts!r}: {exc}") from None

    @property
    def digest(self) -> str:
        """sha256 hex of the canonical JSON of every part (floats by their repr)."""
        text = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
