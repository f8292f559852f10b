"""The third decision of dedup: pairs the learned copy embedding accepts, on ingested datasets.

``decide`` embeds every image of the chosen public and private splits with a copy model
(``dedup.copy_model``, trained on public images only by ``dpscale train-copy-model``), scores
each private image's nearest public images by the background-normalised cosine of
``dedup.copy_score`` (plus, with a local weight, the pairs' local agreement of
``dedup.local_match``; it keeps every image's 32-px thumbnail in memory: 3 KB each) and
returns the accepted pairs as ``Match``es (``decided_by == "copy"``)
for the Beam graph to remove beside the pixel checks' matches, plus the rejected pairs closest
to the cut for the report. It runs in the launching process before the graph: embeddings
cost ~1 KB per image, and the exact search grows as (private + public) x public, which suits
up to a few hundred thousand public images; beyond that the search belongs in the graph's
blocked neighbour tasks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import copy_model, copy_score, descriptor, local_match
from dpscale.dedup.join import Candidate, Match
from dpscale.dedup.planning import shard_ranges
from dpscale.errors import DataError
from dpscale.progress import progress_bar

log = logging.getLogger(__name__)
NEAR_LISTED = 200  # rejected private images closest to the cut listed in the report
CHUNK = 5_000  # images read and embedded at a time


@dataclasses.dataclass(frozen=True)
class CopyOutcome:
    accepted: tuple[Match, ...]
    near: tuple[Match, ...]  # the best rejected pair of the private images closest to the cut
    model: dict  # what the model was trained on (its info file) and where it lies


def _embed(
    dataset: IngestedDataset,
    splits: Sequence[str],
    params: object,
    label: str,
    show_progress: bool,
    keep_thumbnails: bool,
) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int]], np.ndarray | None]:
    """Unit embeddings in both mirror states, where each row comes from, and (if asked, for the
    local agreement) the 32-px thumbnails the embeddings were computed from."""
    sizes = {s: dataset.num_examples(s) for s in splits}
    plain, mirrored, where, kept = [], [], [], []
    with progress_bar(label, total=sum(sizes.values()), enabled=show_progress) as bar:
        for split, n in sizes.items():
            for lo in range(0, n, CHUNK):
                # resized once for both mirror states (``embed`` passes thumbnails through)
                images = copy_model.thumbnails(np.asarray(dataset.get(split, np.arange(lo, min(n, lo + CHUNK)))[0]))
                for out, flip in ((plain, False), (mirrored, True)):
                    out.append(copy_model.embed(params, images, mirrored=flip))
                    if not np.isfinite(out[-1]).all():
                        raise DataError(
                            f"the copy model gives non-finite embeddings for {split} images "
                            f"{lo}-{lo + len(images) - 1}: its weights are unusable; train it again"
                        )
                where += [(split, i) for i in range(lo, lo + len(images))]
                if keep_thumbnails:
                    kept.append(images)
                bar.advance(len(images))
    return (np.concatenate(plain), np.concatenate(mirrored), where, np.concatenate(kept) if keep_thumbnails else None)


def _ids(dataset: IngestedDataset, splits: Sequence[str]) -> np.ndarray:
    return np.unique(np.concatenate([dataset.ids(s) for s in splits] or [np.zeros(0, np.uint64)]))


def check_model(
    saved: copy_model.SavedModel,
    model_dir: str,
    public: IngestedDataset,
    public_splits: Sequence[str],
    private: IngestedDataset,
    private_splits: Sequence[str],
) -> None:
    """Refuse a model trained on private images: its weights would describe them, and it would
    score its own training images. Images are compared by example id (the pixels' hash), so a
    private image re-ingested under another path, split or label is still recognised. A training
    image that is also in this run's public data is allowed even when it equals a private one:
    dedup removes exactly those public images. Warn when the model was trained on other
    images than this run's public ones (the cut was measured for a model of the public set it
    deduplicates)."""
    public_ids, private_ids = _ids(public, public_splits), _ids(private, private_splits)
    seen_private = np.setdiff1d(
        np.intersect1d(saved.trained_on, private_ids, assume_unique=True), public_ids, assume_unique=True
    )
    if seen_private.size:
        raise DataError(
            f"copy model {model_dir!r} was trained on {seen_private.size} of the private images: its "
            "weights describe private data; train it on the public images only: "
            "dpscale train-copy-model PUBLIC DIR --splits ..."
        )
    others = np.setdiff1d(saved.trained_on, public_ids, assume_unique=True).size
    if others:
        trained = saved.info.get("public", {})
        log.warning(
            "copy model %s was trained on %d images that are not in this run's public data (%s, %s): "
            "its cut was measured for a model of the public set it deduplicates",
            model_dir,
            others,
            trained.get("path"),
            ",".join(trained.get("splits", ())),
        )


@dataclasses.dataclass(frozen=True)
class CopyModel:
    params: Any
    info: dict  # what it was trained on, plus where it lies ("path") and its weights' hash


def open_model(
    model_dir: str,
    public: IngestedDataset,
    public_splits: Sequence[str],
    private: IngestedDataset,
    private_splits: Sequence[str],
) -> CopyModel:
    """Load and check a copy model, and the data it is to score, before any work starts: a
    bad model or an unusable input fails in seconds, before the output is touched."""
    try:
        saved = copy_model.load(model_dir)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    if sum(public.num_examples(s) for s in public_splits) < 2:
        raise DataError("the copy decision needs at least two public images (one as background)")
    if not sum(private.num_examples(s) for s in private_splits):
        raise DataError("the private splits hold no images: nothing for the copy decision to look for")
    check_model(saved, model_dir, public, public_splits, private, private_splits)
    info = {key: value for key, value in saved.info.items() if key != "sha256"}
    return CopyModel(
        saved.params, {"path": model_dir, **info, "weights_sha256": saved.info["sha256"][copy_model.WEIGHTS]}
    )


def decide(
    public: IngestedDataset,
    public_splits: Sequence[str],
    private: IngestedDataset,
    private_splits: Sequence[str],
    model: CopyModel,
    settings: copy_score.CopySettings,
    *,
    show_progress: bool = True,
) -> CopyOutcome:
    """Every (public, private) pair the copy decision accepts, and the near-cut rejections."""
    params, use_local = model.params, bool(settings.local_weight)
    pub, pub_m, pub_where, pub_thumbs = _embed(
        public, public_splits, params, "copy: embed public", show_progress, use_local
    )
    priv, priv_m, priv_where, priv_thumbs = _embed(
        private, private_splits, params, "copy: embed private", show_progress, use_local
    )
    agreement = (
        local_match.Agreement(params, pub_thumbs, priv_thumbs, show_progress=show_progress) if use_local else None
    )
    try:
        pairs = copy_score.decide(
            pub, pub_m, priv, priv_m, settings, local_agreement=agreement, show_progress=show_progress
        )
    except ValueError as exc:
        raise DataError(str(exc)) from None
    shard_starts: dict[str, list[int]] = {}  # per split, the first index of each shard, in order
    for (split, _), (start, _, _) in sorted(shard_ranges(public, public_splits).items()):
        shard_starts.setdefault(split, []).append(start)

    def match(row: int, col: int, mirrored: bool, cosine: float, score: float, accepted: bool) -> Match:
        split, index = pub_where[col]
        shard = int(np.searchsorted(shard_starts[split], index, side="right")) - 1
        candidate = Candidate(
            split,
            index,
            shard,
            *priv_where[row],
            view=len(descriptor.VIEWS) if mirrored else 0,
            similarity=round(float(cosine), 5),
        )
        return Match(candidate, float("inf"), float("inf"), accepted, copy_score=round(float(score), 5))

    accepted = tuple(
        match(int(r), int(c), bool(m), cos, s, True)
        for r, c, m, cos, s in zip(pairs.private, pairs.public, pairs.mirrored, pairs.cosine, pairs.score)
    )
    below = np.flatnonzero(pairs.best_score < settings.cut)
    nearest = below[np.argsort(-pairs.best_score[below], kind="stable")[:NEAR_LISTED]]
    near = tuple(
        match(
            int(r),
            int(pairs.best_public[r]),
            bool(pairs.best_mirrored[r]),
            pairs.best_cosine[r],
            pairs.best_score[r],
            False,
        )
        for r in nearest
    )
    return CopyOutcome(accepted, near, model.info)
