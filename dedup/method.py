"""The knobs of the dedup method, in one place (defaults tuned on realistic planted copies).

``k`` nearest public images per private image become candidates if their descriptor
similarity is at least ``min_similarity``; a candidate is a duplicate when its aligned
verification distance is at most ``threshold``. Rejected candidates up to ``near_factor``
times the threshold are listed in the report, so a user can see what the cut left in.
Crowded expansion (``dedup.pages``): the search keeps ``k * max_pages`` neighbours; the
next k are verified only for a private image with at least ``crowded_fraction`` of its
current k accepted, so one photo held many times in public is removed up to
``k * max_pages`` times while every other private image still costs k verifications.
Defaults: 0.5 (a majority of the page is the same photo; the realistic planted benchmark
plants 8 copies, and each copy that falls below rank 10 has 5-7 accepted siblings above it,
while a look-alike-prone private image rarely has even 3 accepted); 3 pages = at most 30
removals per private image for 3x the (private images x k) neighbour arrays.
``refine``: a pair the grid rejects gets a second decision by continuous alignment
(``dedup.refine``): re-cropped and zoomed real copies the grid cannot align.
``copy``: when set, a third decision by a learned copy embedding (``dedup.copy_decision``),
on every pair, independent of the first two.
"""

from __future__ import annotations

import dataclasses

from dpscale.dedup import descriptor, refine, verify
from dpscale.dedup.copy_score import CopySettings

DESCRIPTION = (
    f"descriptor: {descriptor.LUMA}x{descriptor.LUMA} luma + {descriptor.CHROMA}x"
    f"{descriptor.CHROMA} chroma Gaussian thumbnails, zero-mean unit-length, lowest "
    f"{descriptor.LUMA_KEEP}x{descriptor.LUMA_KEEP} / {descriptor.CHROMA_KEEP}x"
    f"{descriptor.CHROMA_KEEP} DCT frequencies; private side as "
    f"{descriptor.NUM_VIEWS} views (whole + 5 crops keeping {descriptor.CROP:.0%} of each side, "
    "each mirrored); exact k nearest public images per private image by blocked matrix "
    "products; verification: 1 - normalised luma correlation of the public centre window "
    "with the private image under the best of a grid of scales 0.78-1.12 and shifts, "
    "coarse 16x16 then fine 32x32; pairs it rejects: affine ECC alignment (3 starts), accepted "
    f"if the blurred luma's rank correlation >= {refine.MIN_RANK}, detail (DoG {refine.DETAIL_BAND[0]}-"
    f"{refine.DETAIL_BAND[1]} px) correlation >= {refine.MIN_DETAIL}, warp scale "
    f"{refine.SCALE_RANGE[0]}-{refine.SCALE_RANGE[1]}, anisotropy <= {refine.MAX_ANISOTROPY}"
)
COPY_DESCRIPTION = (
    "copy decision (with a copy model): a small CNN trained contrastively on the public images "
    "only maps copy edits of an image together; each private image's nearest public images "
    "(both mirror states) score cosine - beta x the mean of both ends' k-th nearest public "
    "cosine, + local_weight x (the share of the two images' 16x16 early-feature cells that are "
    "mutual nearest neighbours - the median share over the private image's candidates); a pair is "
    "a duplicate at score >= cut"
)


@dataclasses.dataclass(frozen=True)
class Method:
    k: int = 10
    min_similarity: float = 0.8
    threshold: float = verify.THRESHOLD
    near_factor: float = 2.0
    max_pages: int = 3
    crowded_fraction: float = 0.5
    refine: bool = True
    copy: CopySettings | None = None

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")
        if not -1.0 <= self.min_similarity < 1.0:
            raise ValueError(f"min similarity must be in [-1, 1), got {self.min_similarity}")
        if not 0.0 < self.threshold < verify.COARSE_CUT:
            raise ValueError(f"threshold must be in (0, {verify.COARSE_CUT}), got {self.threshold}")
        if self.max_pages < 1:
            raise ValueError(f"max pages must be at least 1, got {self.max_pages}")
        if not 0.0 < self.crowded_fraction <= 1.0:
            raise ValueError(f"crowded fraction must be in (0, 1], got {self.crowded_fraction}")

    @property
    def neighbours(self) -> int:
        """Candidates the neighbour search keeps per private image (every page)."""
        return self.k * self.max_pages
