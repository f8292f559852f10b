"""Per-element work of ``dpscale dedup``: descriptors, nearest neighbours, verification.

Plain functions over numpy arrays, so ``pipelines.dedup`` only wires them:

* ``embed_task``: one read task (a range of one split) -> its descriptors (public: the whole
  image; private: every view) in one ``.npy`` file under the run's work directory. Only the
  task comes back through Beam, so the data plane carries kilobytes, not descriptors.
* ``knn_task``: one private task against a group of public tasks -> for each private image
  its ``k`` most similar public images (blocked matrix products, ``dedup.knn``; the
  pipeline asks for ``k * max_pages``, which pages get verified is ``dedup.pages``).
* ``verify_candidates``: a batch of (public, private, view) candidates -> the decision of
  ``dedup.verify`` on the images themselves, and of ``dedup.refine`` for the pairs the
  alignment grid rejects.

Work grows with images (private views x public images), not with candidate pairs: each
private image keeps a fixed number of candidates, whatever the data size.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dpscale import files
from dpscale.data.shards import join as path_join
from dpscale.dedup import descriptor, knn, refine, verify

PUBLIC, PRIVATE = "public", "private"


@dataclasses.dataclass(frozen=True)
class ReadTask:
    """Examples ``start:stop`` of ``split``; ``shard`` is the public shard they sit in."""

    side: str
    split: str
    start: int
    stop: int
    shard: int = 0

    @property
    def name(self) -> str:
        return f"{self.side}-{self.split}-{self.start:012d}-{self.stop:012d}.npy"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A public image among the ``k`` nearest of a private image (by its best view)."""

    public_split: str
    public_index: int
    public_shard: int
    private_split: str
    private_index: int
    view: int
    similarity: float


@dataclasses.dataclass(frozen=True)
class Match:
    """A verified candidate: ``accepted`` when ``fine_distance <= threshold`` or refined, or a
    pair of the copy decision (``dedup.copy_decision``: ``copy_score`` finite, no pixel distances).

    ``ecc_distance`` / ``rank_distance`` / ``detail_distance``: ``dedup.refine``'s, for pairs
    the grid rejected (inf: not refined, or ECC did not converge).
    """

    candidate: Candidate
    coarse_distance: float
    fine_distance: float  # inf: failed the coarse pass
    accepted: bool
    ecc_distance: float = float("inf")
    rank_distance: float = float("inf")
    detail_distance: float = float("inf")
    copy_score: float = float("-inf")

    @property
    def decided_by(self) -> str:
        """Which check accepted the pair: "grid", "refined", "copy", or "" (rejected)."""
        if not self.accepted:
            return ""
        if self.copy_score != float("-inf"):
            return "copy"
        return "grid" if self.ecc_distance == float("inf") else "refined"


def embed_task(task: ReadTask, dataset: Any, work_dir: str) -> int:
    """Write ``task``'s descriptors to ``work_dir``; returns the rows written (images)."""
    images, _ = dataset.get(task.split, np.arange(task.start, task.stop))
    if task.side == PRIVATE:
        d = descriptor.describe_views(images)  # [V, n, D]
    else:
        d = descriptor.describe(images)[None]
    buf = io.BytesIO()
    np.save(buf, d.astype(np.float32))
    # whole or not at all (a rerun of the task may race a reader); owner-only: private images' descriptors
    files.write_atomic(path_join(work_dir, task.name), lambda f: f.write(buf.getvalue()), binary=True, private=True)
    return len(images)


def _load(task: ReadTask, work_dir: str) -> np.ndarray:
    d = np.load(io.BytesIO(files.read_bytes(path_join(work_dir, task.name))))
    if d.shape[1] != task.stop - task.start:  # a partial file would silently drop images
        raise RuntimeError(f"descriptor file {task.name} holds {d.shape[1]} rows, expected {task.stop - task.start}")
    return d


def knn_task(
    private: ReadTask,
    public: Sequence[ReadTask],
    work_dir: str,
    *,
    k: int,
    min_similarity: float,
    searched: Callable[[ReadTask], None] | None = None,
) -> list[Candidate]:
    """The ``k`` nearest public images (of the ``public`` tasks) of each image of ``private``.

    ``searched(t)`` is called after each public task ``t`` (progress within a long task).
    """
    views = _load(private, work_dir)
    best = None
    offsets, start = [], 0
    for t in public:
        offsets.append(start)
        top = knn.search(views, _load(t, work_dir)[0], k, offset=start)
        best = top if best is None else knn.merge(best, top, k)
        start += t.stop - t.start
        if searched is not None:
            searched(t)
    if best is None:
        return []
    offsets_arr = np.array(offsets)
    out = []
    for row, col in zip(*np.nonzero(best.similarity >= min_similarity)):
        g = int(best.public[row, col])
        which = int(np.searchsorted(offsets_arr, g, "right") - 1)
        t = public[which]
        out.append(
            Candidate(
                t.split,
                t.start + g - offsets[which],
                t.shard,
                private.split,
                private.start + int(row),
                int(best.view[row, col]),
                round(float(best.similarity[row, col]), 5),
            )
        )
    return out


def _images(dataset: Any, keys: Sequence[tuple[str, int]]) -> np.ndarray:
    """Images of (split, index) ``keys`` in order, one read per split."""
    out = np.zeros((len(keys), *dataset.image_shape), np.uint8)
    for split in {s for s, _ in keys}:
        slots = [i for i, (s, _) in enumerate(keys) if s == split]
        out[slots] = dataset.get(split, np.array([keys[i][1] for i in slots]))[0]
    return out


def _rounded(x: float) -> float:
    return round(float(x), 5) if np.isfinite(x) else float("inf")


def verify_candidates(
    candidates: Sequence[Candidate], public: Any, private: Any, *, threshold: float, refine_rejected: bool = True
) -> list[Match]:
    """Decide a batch of candidates on the images (``IngestedDataset``s).

    ``refine_rejected``: pairs over the grid's ``threshold`` get ``dedup.refine``'s decision.
    """
    if not candidates:
        return []
    a = _images(public, [(c.public_split, c.public_index) for c in candidates])
    b = _images(private, [(c.private_split, c.private_index) for c in candidates])
    mirrored = np.array([descriptor.view_of(c.view)[1] for c in candidates])
    coarse, fine = verify.distances(a, b, mirrored)
    out = [Match(c, _rounded(co), _rounded(fi), bool(fi <= threshold)) for c, co, fi in zip(candidates, coarse, fine)]
    rejected = np.flatnonzero(~(fine <= threshold))
    if refine_rejected and len(rejected):
        r = refine.refine(a[rejected], b[rejected], mirrored[rejected])
        for j, i in enumerate(rejected):
            out[i] = dataclasses.replace(
                out[i],
                accepted=bool(r.accepted[j]),
                ecc_distance=_rounded(r.ecc_distance[j]),
                rank_distance=_rounded(r.rank_distance[j]),
                detail_distance=_rounded(r.detail_distance[j]),
            )
    return out


def closest(matches: Iterable[Match]) -> Match:
    """The closest accepted private match of one public example (ties: lowest private index)."""

    # grid decisions first (by grid distance), then refined ones by their own detail distance,
    # then the copy decision's by its score
    def key(m: Match) -> tuple:
        closeness = {"grid": m.fine_distance, "refined": m.detail_distance, "copy": -m.copy_score}
        return (
            _DECISION_ORDER[m.decided_by],
            closeness[m.decided_by],
            m.candidate.private_split,
            m.candidate.private_index,
            m.candidate.view,
        )

    return min(matches, key=key)


_DECISION_ORDER = {"grid": 0, "refined": 1, "copy": 2}
