"""Crowded expansion: the next page is verified only after a crowded one."""

import pytest

from dpscale.dedup import pages
from dpscale.dedup.join import Candidate, Match


def _candidates(private_index: int, n: int) -> list[Candidate]:
    # listed worst first: verify_by_page must rank them itself
    return [
        Candidate("train", 100 * private_index + r, 0, "test", private_index, 0, round(0.99 - 0.001 * r, 5))
        for r in reversed(range(n))
    ]


def _verifier(duplicates: set[tuple[int, int]], calls: list[list[Candidate]]):
    """Accepts (private index, rank) pairs in ``duplicates``; records every call."""

    def verify(cs):
        calls.append(list(cs))
        dup = [(c.private_index, c.public_index % 100) in duplicates for c in cs]
        return [Match(c, 0.01, 0.01 if d else 0.3, d) for c, d in zip(cs, dup)]

    return verify


def test_an_uncrowded_images_eleventh_neighbour_is_not_verified():
    calls: list[list[Candidate]] = []
    cands = _candidates(0, 30)
    dupes = {(0, r) for r in (0, 1, 2, 4, 10, 11, 12)}  # 4 of page 1 accepted: 4 < 5
    matches, skipped, expanded = pages.verify_by_page(
        cands, _verifier(dupes, calls), k=10, max_pages=3, crowded_fraction=0.5
    )
    assert len(calls) == 1 and sorted(c.public_index for c in calls[0]) == list(range(10))
    assert [m.candidate.public_index for m in matches if m.accepted] == [0, 1, 2, 4]
    assert skipped == 20 and expanded == 0


def test_a_crowded_page_gets_the_next_one_verified_and_pages_batch_across_images():
    calls: list[list[Candidate]] = []
    cands = _candidates(1, 30) + _candidates(2, 30) + _candidates(3, 7)
    dupes = (
        {(1, r) for r in range(25)}  # pages 1, 2 full, page 3 half: all 25 found
        | {(2, r) for r in range(5)}
        | {(2, 12)}  # page 1 half crowded, page 2 not
        | {(3, r) for r in range(7)}
    )  # fewer than k candidates: nothing more exists
    matches, skipped, expanded = pages.verify_by_page(
        cands, _verifier(dupes, calls), k=10, max_pages=3, crowded_fraction=0.5
    )
    accepted = {(m.candidate.private_index, m.candidate.public_index % 100) for m in matches if m.accepted}
    assert accepted == dupes
    assert [len(c) for c in calls] == [27, 20, 10]  # one call per page round
    assert len(matches) == 27 + 20 + 10 and skipped == 67 - 57 and expanded == 2
    with pytest.raises(RuntimeError, match="at most 20"):
        pages.verify_by_page(cands, _verifier(dupes, []), k=10, max_pages=2, crowded_fraction=0.5)


def test_crowded_count_rounds_up_and_needs_at_least_one():
    assert pages.crowded_count(10, 0.5) == 5
    assert pages.crowded_count(10, 0.55) == 6
    assert pages.crowded_count(10, 1.0) == 10
    assert pages.crowded_count(3, 0.01) == 1
