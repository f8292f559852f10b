"""The third decision of dedup: pairs the learned copy embedding accepts, on ingested datasets.

``decide`` embeds every image of the chosen public and private splits with a copy model
(``dedup.copy_model``, trained on public images only by ``dpscale train-copy-model``), scores
each private image's nearest public images by the background-normalised cosine of
``dedup.copy_score`` and returns the accepted pairs as ``Match``es (``decided_by == "copy"``)
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
from dpscale.dedup import copy_model, copy_score, descriptor
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


def _embed(dataset: IngestedDataset, splits: Sequence[str], params: object, label: str,
           show_progress: bool) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int]]]:
    sizes = {s: dataset.num_examples(s) for s in splits}
    plain, mirrored, where = [], [], []
    with progress_bar(label, total=sum(sizes.values()), enabled=show_progress) as bar:
        for split, n in sizes.items():
            for lo in range(0, n, CHUNK):
                images = np.asarray(dataset.get(split, np.arange(lo, min(n, lo + CHUNK)))[0])
                plain.append(copy_model.embed(params, images))
                mirrored.append(copy_model.embed(params, images, mirrored=True))
                where += [(split, i) for i in range(lo, lo + len(images))]
                bar.advance(len(images))
    return np.concatenate(plain), np.concatenate(mirrored), where


def check_model(info: dict, model_dir: str, public: IngestedDataset, public_splits: Sequence[str],
                private: IngestedDataset, private_splits: Sequence[str]) -> None:
    """Refuse a model trained on the private images (its weights would describe them); warn
    when it was trained on other public data than this run's (the cut was measured for a
    model trained on the public set it deduplicates)."""
    trained = info.get("public", {})
    if trained.get("content_hash") == private.content_hash and set(trained.get("splits", ())) & set(private_splits):
        raise DataError(f"copy model {model_dir!r} was trained on the private data (splits "
                        f"{','.join(sorted(set(trained['splits']) & set(private_splits)))}); train it on the "
                        "public splits only: dpscale train-copy-model PUBLIC DIR --splits ...")
    if trained.get("content_hash") != public.content_hash or set(trained.get("splits", ())) != set(public_splits):
        log.warning("copy model %s was trained on %s (%s), not on this run's public data: its "
                    "cut was measured for a model of the public set it deduplicates", model_dir,
                    trained.get("path"), ",".join(trained.get("splits", ())))


@dataclasses.dataclass(frozen=True)
class CopyModel:
    params: Any
    info: dict  # what it was trained on, plus where it lies ("path")


def open_model(model_dir: str, public: IngestedDataset, public_splits: Sequence[str],
               private: IngestedDataset, private_splits: Sequence[str]) -> CopyModel:
    """Load and check a copy model before any work starts: a bad model fails in a second."""
    try:
        params, info = copy_model.load(model_dir)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    check_model(info, model_dir, public, public_splits, private, private_splits)
    return CopyModel(params, {"path": model_dir, **info})


def decide(public: IngestedDataset, public_splits: Sequence[str], private: IngestedDataset,
           private_splits: Sequence[str], model: CopyModel, settings: copy_score.CopySettings, *,
           show_progress: bool = True) -> CopyOutcome:
    """Every (public, private) pair the copy decision accepts, and the near-cut rejections."""
    params = model.params
    pub, pub_m, pub_where = _embed(public, public_splits, params, "copy: embed public", show_progress)
    priv, priv_m, priv_where = _embed(private, private_splits, params, "copy: embed private", show_progress)
    try:
        pairs = copy_score.decide(pub, pub_m, priv, priv_m, settings, show_progress=show_progress)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    shard_starts: dict[str, list[int]] = {}  # per split, the first index of each shard, in order
    for (split, _), (start, _, _) in sorted(shard_ranges(public, public_splits).items()):
        shard_starts.setdefault(split, []).append(start)

    def match(row: int, col: int, mirrored: bool, cosine: float, score: float, accepted: bool) -> Match:
        split, index = pub_where[col]
        shard = int(np.searchsorted(shard_starts[split], index, side="right")) - 1
        candidate = Candidate(split, index, shard, *priv_where[row],
                              view=len(descriptor.VIEWS) if mirrored else 0, similarity=round(float(cosine), 5))
        return Match(candidate, float("inf"), float("inf"), accepted, copy_score=round(float(score), 5))

    accepted = tuple(match(int(r), int(c), bool(m), cos, s, True) for r, c, m, cos, s in
                     zip(pairs.private, pairs.public, pairs.mirrored, pairs.cosine, pairs.score))
    below = np.flatnonzero(pairs.best_score < settings.cut)
    nearest = below[np.argsort(-pairs.best_score[below], kind="stable")[:NEAR_LISTED]]
    near = tuple(match(int(r), int(pairs.best_public[r]), bool(pairs.best_mirrored[r]), pairs.best_cosine[r],
                       pairs.best_score[r], False) for r in nearest)
    return CopyOutcome(accepted, near, model.info)
