"""The knobs of the dedup method, in one place (defaults tuned on realistic planted copies).

``k`` nearest public images per private image become candidates if their descriptor
similarity is at least ``min_similarity``; a candidate is a duplicate when its aligned
verification distance is at most ``threshold``. Rejected candidates up to ``near_factor``
times the threshold are listed in the report, so a user can see what the cut left in.
"""

from __future__ import annotations

import dataclasses

from dpscale.dedup import descriptor, verify

DESCRIPTION = (
    f"descriptor: {descriptor.LUMA}x{descriptor.LUMA} luma + {descriptor.CHROMA}x"
    f"{descriptor.CHROMA} chroma Gaussian thumbnails, zero-mean unit-length, lowest "
    f"{descriptor.LUMA_KEEP}x{descriptor.LUMA_KEEP} / {descriptor.CHROMA_KEEP}x"
    f"{descriptor.CHROMA_KEEP} DCT frequencies; private side as "
    f"{descriptor.NUM_VIEWS} views (whole + 5 crops keeping {descriptor.CROP:.0%} of each side, "
    "each mirrored); exact k nearest public images per private image by blocked matrix "
    "products; verification: 1 - normalised luma correlation of the public centre window "
    "with the private image under the best of a grid of scales 0.78-1.12 and shifts, "
    "coarse 16x16 then fine 32x32")


@dataclasses.dataclass(frozen=True)
class Method:
    k: int = 10
    min_similarity: float = 0.8
    threshold: float = verify.THRESHOLD
    near_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")
        if not -1.0 <= self.min_similarity < 1.0:
            raise ValueError(f"min similarity must be in [-1, 1), got {self.min_similarity}")
        if not 0.0 < self.threshold < verify.COARSE_CUT:
            raise ValueError(f"threshold must be in (0, {verify.COARSE_CUT}), got {self.threshold}")
