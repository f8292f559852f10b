"""The copy-embedding decision of dedup: background-normalised cosines of ``dedup.copy_model``.

A raw cosine between embeddings confuses copies with look-alikes of common scenes: a dark
plane on a plain sky or a horse on grass is close to *many* public images, a copy is close to
its twin. So a pair's cosine is lowered by how crowded its two ends are (``normalised``): the
mean of each end's ``k``-th nearest *public* cosine (the private image's k-th nearest public
image; the public image's k-th nearest other public image). This is the similarity
normalisation of copy-detection systems (e.g. the DISC 2021 entries), with the public set as
the background: no private image enters the background of a public one.

Each private image keeps its ``candidates`` nearest public images by cosine (both mirror
states, blocked matrix products). With a ``local_weight``, each candidate's score also gains
that weight times its local agreement (``dedup.local_match``) minus the median agreement of
the private image's candidates: how much more of the pair's cells match one to one than the
private image's other near neighbours'. Every candidate whose score reaches ``cut`` is a
duplicate. Exact search: cost grows as private x public plus public x public (the public
background), fine for a few hundred thousand public images in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from dpscale.progress import progress_bar

BLOCK_BYTES = 512 * 2**20  # working memory of one block of ``top_k``: ~21 bytes per query x reference


def top_k(
    queries: np.ndarray,
    queries_mirror: np.ndarray,
    reference: np.ndarray,
    *,
    k: int,
    exclude_self: bool = False,
    block: int = 1000,
    show_progress: bool = False,
    label: str = "nearest",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query: its ``k`` most similar reference rows, most similar first, each reference row at
    the query's better mirror state: (similarities [n, k], reference indices, mirrored flags).
    ``exclude_self``: queries *are* the reference (row i never matches itself, in either state).
    At most ``block`` queries at a time, fewer when the reference is large (``BLOCK_BYTES``)."""
    k = min(k, len(reference) - (1 if exclude_self else 0))
    if k < 1:
        raise ValueError("the reference set is too small to search")
    block = max(1, min(block, BLOCK_BYTES // (21 * len(reference))))
    ref32 = reference.astype(np.float32).T
    n = len(queries)
    sims, index, mirrored = (np.empty((n, k), np.float32), np.empty((n, k), np.int64), np.empty((n, k), bool))
    with progress_bar(label, total=n, enabled=show_progress) as bar:
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            s0 = queries[lo:hi].astype(np.float32) @ ref32
            s1 = queries_mirror[lo:hi].astype(np.float32) @ ref32
            use1 = s1 > s0
            s = np.where(use1, s1, s0)
            del s0, s1
            rows = np.arange(hi - lo)
            if exclude_self:
                s[rows, rows + lo] = -np.inf
            part = np.argpartition(s, s.shape[1] - k, axis=1)[:, -k:]
            order = np.argsort(-s[rows[:, None], part], axis=1, kind="stable")
            top = part[rows[:, None], order]
            sims[lo:hi], index[lo:hi], mirrored[lo:hi] = s[rows[:, None], top], top, use1[rows[:, None], top]
            bar.advance(hi - lo)
    return sims, index, mirrored


def normalised(
    similarity: np.ndarray, query_background: np.ndarray, public_background: np.ndarray, beta: float
) -> np.ndarray:
    """A pair's cosine minus ``beta`` times how crowded its two ends are (the mean of each end's
    k-th nearest public image's cosine); see the module docstring for why."""
    return similarity - beta * 0.5 * (query_background + public_background)


def local_background(agreement: np.ndarray) -> np.ndarray:
    """Per private image: the median local agreement of its candidates [n, candidates] -> [n]."""
    return np.median(agreement, axis=1)


def with_local_agreement(score: np.ndarray, agreement: np.ndarray, weight: float, background: np.ndarray) -> np.ndarray:
    """Candidates' scores [n, w] plus ``weight`` x how much more they agree locally than their
    private image's ``background`` [n]; see the module docstring for why."""
    return score + weight * (agreement - background[:, None])


@dataclasses.dataclass(frozen=True)
class CopySettings:
    """``cut`` on the score; ``k``: which neighbour sets the background; ``beta``: how much of it
    is subtracted; ``local_weight``: the weight of the relative local agreement (0: cosines
    only); ``candidates``: nearest public images scored per private image (more are scored while
    the farthest of them is accepted).
    Limit: an image the public set holds ``k`` times or more has its own copies as background,
    so its pairs score about ``(1 - beta) x`` their cosine: at the defaults the copy decision
    takes them only from a cosine of ~0.96 (the pixel checks do not depend on backgrounds). With a
    local weight, such an image's candidates are mostly its copies, so their median agreement is a
    copy's and lifts none of them: at the defaults its copies need the pixel checks.
    Defaults: measured on CIFAR-10 train vs test with a model of ``dpscale train-copy-model``'s
    defaults (``benchmarks/results/dedup.md``): weight 2 found the most census duplicates on half
    the labels; 0.54 is the cut that adds 16 look-alikes to the pixel checks' on the census labels
    (k = 10, beta = 0.5: 0.531, rounded up), checked on the planted set (~0.01% false positives).
    Without the local weight the same model's cut was 0.48 (4 look-alikes). A model trained
    otherwise, or other data, may need another cut: the report lists the rejected pairs closest to it."""

    cut: float = 0.54
    k: int = 10
    beta: float = 0.5
    local_weight: float = 2.0
    candidates: int = 20

    def __post_init__(self) -> None:
        if not 0.0 <= self.local_weight <= 10.0:  # also refuses nan
            raise ValueError(f"copy local weight must be in [0, 10], got {self.local_weight}")
        bound = 2.0 + self.local_weight  # the score's range: cosine terms in (-2, 2), agreement terms +-weight
        if not -bound < self.cut < bound:
            raise ValueError(
                f"copy cut must be in ({-bound:g}, {bound:g}) at local weight {self.local_weight:g}, got {self.cut}"
            )
        if not 1 <= self.k <= self.candidates:
            raise ValueError(f"copy k must be in [1, candidates = {self.candidates}], got {self.k}")
        if not 0.0 <= self.beta <= 2.0:
            raise ValueError(f"copy beta must be in [0, 2], got {self.beta}")


@dataclasses.dataclass(frozen=True)
class CopyPairs:
    """Accepted pairs (row i: ``private[i]`` duplicates ``public[i]``; by private image, nearest
    first) and every private image's best-scoring candidate (for the report's near-cut listing)."""

    private: np.ndarray
    public: np.ndarray
    mirrored: np.ndarray
    score: np.ndarray
    cosine: np.ndarray
    best_public: np.ndarray
    best_mirrored: np.ndarray
    best_score: np.ndarray
    best_cosine: np.ndarray


LocalAgreement = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
"""(private rows [m], candidates' public indices [m, w], mirrored [m, w]) -> agreements [m, w]."""


def decide(
    public: np.ndarray,
    public_mirror: np.ndarray,
    private: np.ndarray,
    private_mirror: np.ndarray,
    settings: CopySettings,
    *,
    local_agreement: LocalAgreement | None = None,
    show_progress: bool = False,
) -> CopyPairs:
    """The copy decision over all pairs, from unit embeddings of both sides in both mirror states;
    ``local_agreement`` (e.g. ``local_match.Agreement``) is needed when ``settings.local_weight`` is not 0."""
    if settings.local_weight and local_agreement is None:
        raise ValueError("the copy decision's local weight needs the local agreement of its pairs")
    if len(public) < 2:
        raise ValueError("the copy decision needs at least two public images (one as background)")
    if not len(private):
        raise ValueError("the copy decision needs at least one private image")
    public_sims, _, _ = top_k(
        public,
        public_mirror,
        public,
        k=settings.k,
        exclude_self=True,
        show_progress=show_progress,
        label="copy: public background",
    )
    rows, width, label = np.arange(len(private)), settings.candidates, "copy: private neighbours"
    found, best, background = [], None, None
    while rows.size:
        sims, index, mirrored = top_k(
            private[rows], private_mirror[rows], public, k=width, show_progress=show_progress, label=label
        )
        k = min(settings.k, sims.shape[1], public_sims.shape[1])
        score = normalised(sims, sims[:, k - 1 : k], public_sims[index, k - 1], settings.beta)
        if settings.local_weight:
            agreement = np.asarray(local_agreement(rows, index, mirrored))
            if agreement.shape != index.shape:
                raise ValueError(f"the local agreement has shape {agreement.shape}, expected {index.shape}")
            if background is None:  # the first pass holds every private image's candidates
                background = local_background(agreement)
            score = with_local_agreement(score, agreement, settings.local_weight, background[rows])
        accepted = score >= settings.cut
        if best is None:
            col = score.argmax(1)
            every = np.arange(len(rows))
            best = (index[every, col], mirrored[every, col], score[every, col], sims[every, col])
        # a private image whose farthest candidate (by cosine) is accepted may have more: search it
        # again, wider
        full = accepted[:, -1] & (sims.shape[1] < len(public))
        r, c = np.nonzero(accepted & ~full[:, None])
        found.append((rows[r], index[r, c], mirrored[r, c], score[r, c], sims[r, c]))
        rows, width, label = rows[full], min(len(public), 4 * width), "copy: more neighbours"
    flat = [np.concatenate(column) for column in zip(*found)]
    order = np.argsort(flat[0], kind="stable")
    private_rows, public_rows, is_mirrored, scores, cosines = (column[order] for column in flat)
    return CopyPairs(
        private=private_rows,
        public=public_rows,
        mirrored=is_mirrored,
        score=scores,
        cosine=cosines,
        best_public=best[0],
        best_mirrored=best[1],
        best_score=best[2],
        best_cosine=best[3],
    )
