"""Crowded expansion: which of a private image's candidates get verified, page by page.

The neighbour search keeps up to ``k * max_pages`` candidates per private image, ranked by
descriptor similarity. Page 1 (ranks 1..k) is always verified; page p + 1 only when at
least ``crowded_fraction`` of page p's k slots were accepted as duplicates. Why: a public
set that holds the same photo many times fills the k slots with its copies and pushes the
rest out of reach; an image whose page is mostly look-alikes (a plane on plain sky) gains
nothing from a deeper look but more look-alikes at the cut, so it stays at k verifications.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from dpscale.dedup.join import Candidate, Match


def crowded_count(k: int, crowded_fraction: float) -> int:
    """Accepted duplicates among a page's k slots that make the page crowded."""
    return max(1, math.ceil(crowded_fraction * k - 1e-9))


def _order(c: Candidate) -> tuple[float, str, int]:
    return -c.similarity, c.public_split, c.public_index


def verify_by_page(
    candidates: Sequence[Candidate],
    verify: Callable[[list[Candidate]], list[Match]],
    *,
    k: int,
    max_pages: int,
    crowded_fraction: float,
) -> tuple[list[Match], int, int]:
    """Verify pages of each private image's candidates while the previous page was crowded.

    ``verify`` decides a list of candidates (any private images; one call per page round, so
    every private image's page p is batched together). Returns (matches, candidates left
    unverified, private images expanded beyond page 1).
    """
    ranked: dict[tuple[str, int], list[Candidate]] = defaultdict(list)
    for c in candidates:
        ranked[(c.private_split, c.private_index)].append(c)
    for cs in ranked.values():
        cs.sort(key=_order)
        if len(cs) > k * max_pages:  # more than the search keeps: a bug upstream
            raise RuntimeError(f"{len(cs)} candidates for one private image, at most {k * max_pages} planned")
    need = crowded_count(k, crowded_fraction)
    matches: list[Match] = []
    active = sorted(ranked)
    expanded = set()
    for page in range(max_pages):
        if page:
            expanded.update(active)
        batch = [c for key in active for c in ranked[key][page * k : (page + 1) * k]]
        if not batch:
            break
        decided = verify(batch)
        matches += decided
        accepted: dict[tuple[str, int], int] = defaultdict(int)
        for m in decided:
            if m.accepted:
                accepted[(m.candidate.private_split, m.candidate.private_index)] += 1
        active = [key for key in active if accepted[key] >= need and len(ranked[key]) > (page + 1) * k]
    return matches, len(candidates) - len(matches), len(expanded)
