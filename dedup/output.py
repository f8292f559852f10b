"""What a dedup run writes: the filtered public shards, the report, and the manifest last.

Per-element work of the Beam graph in ``pipelines.dedup``: ``filter_shard`` copies one
public shard without its removed examples; ``write_outputs`` checks that every image was
described and every public example is accounted for (a runner that lost data is refused),
then writes the report and the new dataset's manifest.

The report describes the PRIVATE data (which private images have public twins, how many),
without noise: it is a private diagnostic, written 0600 under a name holding NOT-PRIVATE.
The output dataset itself depends on the private data too (which images are missing);
that is the purpose of dedup, and documented rather than hidden.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from dpscale.data import shards
from dpscale.data.dataset import IngestedDataset
from dpscale.data.examples import Encoded, decode_record
from dpscale.data.manifest import DedupProvenance, Manifest
from dpscale.dedup import refine
from dpscale.dedup.descriptor import view_name
from dpscale.dedup.join import PRIVATE, PUBLIC, Match
from dpscale.dedup.method import COPY_DESCRIPTION, DESCRIPTION, Method
from dpscale.files import open_for_writing

REPORT = "dedup_report.NOT-PRIVATE.json"
NEAR_LISTED = 200  # rejected candidates closest to the cut listed in the report


def filter_shard(
    public_path: str,
    output_dir: str,
    split: str,
    shard: int,
    span: tuple[int, int, int],
    removed: Iterable[Match],
    *,
    num_classes: int,
    shape: Sequence[int],
) -> tuple[dict[str, Any], list[dict]]:
    """Copy one public shard without its removed examples; records are reused byte for byte.

    Returns the new shard's summary and the removed examples (index, id, key).
    """
    start, stop, num_shards = span
    drop = {m.candidate.public_index for m in removed}
    kept, gone = [], []
    with IngestedDataset(public_path) as ds:
        for index, record in zip(range(start, stop), ds.records(split, range(start, stop))):
            ex = decode_record(record, split=split)
            if index in drop:
                gone.append({"split": split, "index": index, "id": ex.id, "key": ex.key})
            else:
                kept.append(Encoded(split, ex.key, ex.label, ex.shape, ex.digest, record))
    summary, rejected = shards.write_shard(
        output_dir, split, shard, num_shards, kept, num_classes=num_classes, shape=shape
    )
    if rejected:  # the public data set was checked at ingest; a mismatch here is a bug
        raise RuntimeError(f"{len(rejected)} public examples changed shape in {split}/{shard}")
    return summary, gone


def _pair(m: Match, public: IngestedDataset, private: IngestedDataset) -> dict[str, Any]:
    c = m.candidate
    (pub,) = public.examples(c.public_split, [c.public_index])
    (priv,) = private.examples(c.private_split, [c.private_index])
    return {
        "public_split": c.public_split,
        "public_index": c.public_index,
        "public_id": pub.id,
        "public_key": pub.key,
        "private_split": c.private_split,
        "private_index": c.private_index,
        "private_id": priv.id,
        "private_key": priv.key,
        "distance": _finite(m.fine_distance),
        "coarse_distance": _finite(m.coarse_distance),
        "decided_by": m.decided_by,
        "refined_ecc_distance": _finite(m.ecc_distance),
        "refined_rank_distance": _finite(m.rank_distance),
        "refined_detail_distance": _finite(m.detail_distance),
        "copy_score": _finite(m.copy_score),
        "similarity": c.similarity,
        "view": view_name(c.view),
    }


def _finite(x: float) -> float | None:
    """JSON has no infinity: a pass not run (or failed) is ``null``."""
    return float(x) if math.isfinite(x) else None


def _write_private(path: str, payload: Any) -> None:
    """A private diagnostic: mode 0600 when local (a remote store has its own ACLs)."""
    if shards.is_local(path):
        with open_for_writing(path, private=True) as f:
            json.dump(payload, f, indent=1, allow_nan=False)
            f.write("\n")
    else:
        shards.write_json(path, payload)


def write_outputs(
    _: Any,
    *,
    public_path: str,
    private_path: str,
    output_dir: str,
    summaries: Sequence[dict[str, Any]],
    removed: Sequence[dict[str, Any]],
    matches: Sequence[Match],
    near: Sequence[Match],
    described: dict[str, int],
    num_candidates: int,
    num_verified: int,
    num_skipped: int,
    num_expanded: int,
    method: Method,
    num_public: int,
    num_private: int,
    public_splits: Sequence[str],
    private_splits: Sequence[str],
    copy_near: Sequence[Match] = (),
    copy_model: dict[str, Any] | None = None,
    matched_private: Sequence[tuple[str, int]] | None = None,
) -> Manifest:
    """Report first, manifest last (a manifest means complete); refuse a lossy run.

    ``matched_private``: every (split, index) of a private image with an accepted pair (None:
    those of the removed pairs); ``described`` counts the images whose descriptors were written per side;
    ``num_verified`` + ``num_skipped`` (pages left unverified: not crowded) must be every
    candidate the search kept: a runner that lost elements anywhere (and would silently
    remove nothing) is caught here.
    """
    expected = {PUBLIC: num_public, PRIVATE: num_private}
    got = {side: described.get(side, 0) for side in expected}
    if got != expected or num_verified + num_skipped != num_candidates:
        raise RuntimeError(
            f"dedup: described {got} images (expected {expected}) and verified "
            f"{num_verified} + left {num_skipped} of {num_candidates} candidates; "
            "the runner lost or duplicated data, no manifest written"
        )
    public, private = IngestedDataset(public_path), IngestedDataset(private_path)
    by_public = {(m.candidate.public_split, m.candidate.public_index): m for m in matches}
    pairs = [
        _pair(by_public[(r["split"], r["index"])], public, private)
        for r in sorted(removed, key=lambda r: (r["split"], r["index"]))
    ]
    near_sorted = sorted(near, key=lambda m: (m.fine_distance, m.candidate.public_index))
    credited = {(p["private_split"], p["private_index"]) for p in pairs}
    private_matched = sorted(credited if matched_private is None else set(matched_private))
    if not credited <= set(private_matched):
        raise RuntimeError(
            "dedup: a removed pair's private image is missing from the matched private images; "
            "the runner lost data, no manifest written"
        )
    manifest = shards.build_manifest(
        summaries,
        source=f"dedup:{public.manifest.source}",
        class_names=public.class_names,
        image_shape=public.image_shape,
        rejections=[],
        validation_fraction=public.manifest.validation_fraction,
        encoding=public.manifest.record_encoding,
    )
    kept = manifest.num_examples
    if kept + len(pairs) != num_public or len(pairs) != len(by_public):
        raise RuntimeError(
            f"dedup accounted for {kept} kept + {len(pairs)} removed of "
            f"{num_public} public examples ({len(by_public)} matched); the "
            "runner lost or duplicated data, no manifest written"
        )
    removed_by_split: dict[str, int] = {}
    for p in pairs:
        removed_by_split[p["public_split"]] = removed_by_split.get(p["public_split"], 0) + 1
    report = {
        "private_diagnostic": "describes the private data without noise; keep it to yourself",
        "method": DESCRIPTION,
        "settings": {**dataclasses.asdict(method), **({"opencv": refine.opencv_version()} if method.refine else {})},
        "distance": "1 - best aligned luma correlation (0 = same image; unrelated ~0.1-0.5); "
        "null: failed the coarse pass",
        "decided_by": "grid: accepted at distance <= threshold; refined: rejected by the grid, "
        "accepted after ECC alignment (refined_* = 1 - the blurred luma's "
        "correlation, its rank correlation, the detail correlation after it; null: "
        "not refined, or ECC did not converge); copy: accepted by the copy model's "
        "normalised score (copy_score; similarity = its cosine; no pixel distances); "
        "empty: rejected by both",
        "public": {
            "path": public_path,
            "content_hash": public.content_hash,
            "splits": list(public_splits),
            "num_examples": num_public,
        },
        "private": {"path": private_path, "splits": list(private_splits), "num_examples": num_private},
        "num_candidate_pairs": num_candidates,
        "num_verified_pairs": num_verified,
        "num_private_expanded": num_expanded,
        "num_removed": len(pairs),
        "num_kept": kept,
        "num_private_matched": len(private_matched),
        "private_matched": [{"split": s, "index": i} for s, i in private_matched],
        "removed_by_split": removed_by_split,
        "removed": pairs,
        "near_threshold_rejected": [_pair(m, public, private) for m in near_sorted[:NEAR_LISTED]],
        "copy_decision": None
        if method.copy is None
        else {
            "method": COPY_DESCRIPTION,
            "model": copy_model,
            "num_removed": sum(p["decided_by"] == "copy" for p in pairs),
            "near_cut_rejected": [_pair(m, public, private) for m in copy_near],
        },
    }
    _write_private(shards.join(output_dir, REPORT), report)
    shards.write_json(shards.join(output_dir, shards.REPORT), {"num_rejected": 0, "rejected": []})
    manifest = dataclasses.replace(
        manifest,
        num_inputs=num_public,
        dedup=DedupProvenance(
            public_content_hash=public.content_hash,
            threshold=method.threshold,
            refine=method.refine,
            num_removed=len(pairs),
            report=REPORT,
            copy_cut=None if method.copy is None else method.copy.cut,
            copy_model_sha256=None if copy_model is None else copy_model.get("weights_sha256"),
            copy_local_weight=0.0 if method.copy is None else method.copy.local_weight,
        ),
    )
    shards.write_manifest(output_dir, manifest)
    return manifest
