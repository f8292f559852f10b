"""What a dedup run writes: the filtered public shards, the report, and the manifest last.

Per-element work of the Beam graph in ``pipelines.dedup``: ``filter_shard`` copies one
public shard without its removed examples; ``write_outputs`` checks that every signature
row and every public example is accounted for (a runner that lost data is refused), then
writes ``dedup_report.json`` and the new dataset's manifest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from dpscale.data import shards
from dpscale.data.dataset import IngestedDataset
from dpscale.data.examples import Encoded, decode_record
from dpscale.data.manifest import DedupProvenance, Manifest
from dpscale.dedup.image_hash import HashConfig, view_name
from dpscale.dedup.join import PRIVATE, PUBLIC, Match

REPORT = "dedup_report.json"
METHOD = ("YCbCr 32x32 area thumbnail -> low DCT (6x6 luma w/o DC + 3x3 per chroma), unit "
          "length; private side as whole + 5x5-grid crops at several scales + mirrors; "
          "SimHash LSH bands for candidates; Euclidean distance <= threshold; then a finer "
          "check (12x12 luma DCT + chroma, refined alignment) <= verify_threshold")


def filter_shard(public_path: str, output_dir: str, split: str, shard: int,
                 span: tuple[int, int, int], removed: Iterable[Match], *,
                 num_classes: int, shape: Sequence[int]) -> tuple[dict[str, Any], list[dict]]:
    """Copy one public shard without its removed examples; records are reused byte for byte.

    Returns the new shard's summary and the removed examples (index, id, key).
    """
    start, stop, num_shards = span
    drop = {m.public_index for m in removed}
    kept, gone = [], []
    with IngestedDataset(public_path) as ds:
        for index, record in zip(range(start, stop), ds.records(split, range(start, stop))):
            ex = decode_record(record, split=split)
            if index in drop:
                gone.append({"split": split, "index": index, "id": ex.id, "key": ex.key})
            else:
                kept.append(Encoded(split, ex.key, ex.label, ex.shape, ex.digest, record))
    summary, rejected = shards.write_shard(output_dir, split, shard, num_shards, kept,
                                           num_classes=num_classes, shape=shape)
    if rejected:  # the public data set was checked at ingest; a mismatch here is a bug
        raise RuntimeError(f"{len(rejected)} public examples changed shape in {split}/{shard}")
    return summary, gone


def write_outputs(_: Any, *, public_path: str, private_path: str, output_dir: str,
                  summaries: Sequence[dict[str, Any]], removed: Sequence[dict[str, Any]],
                  matches: Sequence[Match], candidates: int, rejected_by_verification: int,
                  config: HashConfig, num_public: int, num_private: int,
                  received: dict[str, int] | None = None) -> Manifest:
    """Report first, manifest last (a manifest means complete); refuse a lossy run.

    ``received`` counts the signature rows that reached the bucket join per side: every
    image gives ``bands`` rows per view, so a runner that lost signatures (and would
    silently remove nothing) is caught here.
    """
    expected = {PUBLIC: num_public * config.bands,
                PRIVATE: num_private * config.num_views * config.bands}
    got = {side: (received or {}).get(side, 0) for side in expected}
    if got != expected:
        raise RuntimeError(f"dedup: the bucket join received {got} signature rows, expected "
                           f"{expected}; the runner lost or duplicated data, no manifest written")
    public, private = IngestedDataset(public_path), IngestedDataset(private_path)
    by_public = {(m.public_split, m.public_index): m for m in matches}
    pairs = []
    for r in sorted(removed, key=lambda r: (r["split"], r["index"])):
        m = by_public[(r["split"], r["index"])]
        (priv,) = private.examples(m.private_split, [m.private_index])
        pairs.append({"public_split": r["split"], "public_index": r["index"],
                      "public_id": r["id"], "public_key": r["key"],
                      "private_split": m.private_split, "private_index": m.private_index,
                      "private_id": priv.id, "private_key": priv.key,
                      "distance": round(m.distance, 5), "fine_distance": m.fine_distance,
                      "view": view_name(m.view, config)})
    manifest = shards.build_manifest(
        summaries, source=f"dedup:{public.manifest.source}",
        class_names=public.class_names, image_shape=public.image_shape, rejections=[],
        validation_fraction=public.manifest.validation_fraction,
        encoding=public.manifest.record_encoding)
    kept = manifest.num_examples
    if kept + len(pairs) != num_public or len(pairs) != len(by_public):
        raise RuntimeError(f"dedup accounted for {kept} kept + {len(pairs)} removed of "
                           f"{num_public} public examples ({len(by_public)} matched); the "
                           "runner lost or duplicated data, no manifest written")
    removed_by_split: dict[str, int] = {}
    for p in pairs:
        removed_by_split[p["public_split"]] = removed_by_split.get(p["public_split"], 0) + 1
    report = {
        "method": METHOD, "threshold": config.threshold,
        "verify_threshold": config.verify_threshold,
        "distance": "Euclidean between unit embeddings (0 = same, ~1.4 = unrelated)",
        "hash_config": dataclasses.asdict(config), "num_views": config.num_views,
        "public": {"path": public_path, "content_hash": public.content_hash,
                   "num_examples": num_public},
        "private": {"path": private_path,
                    "num_examples": num_private},
        "num_candidate_pairs": candidates,
        "num_rejected_by_verification": rejected_by_verification,
        "num_removed": len(pairs), "num_kept": kept,
        "removed_by_split": removed_by_split, "removed": pairs,
    }
    shards.write_json(shards.join(output_dir, REPORT), report)
    shards.write_json(shards.join(output_dir, shards.REPORT), {"num_rejected": 0, "rejected": []})
    manifest = dataclasses.replace(manifest, num_inputs=num_public, dedup=DedupProvenance(
        public_content_hash=public.content_hash,
        threshold=config.threshold, num_removed=len(pairs), report=REPORT))
    shards.write_manifest(output_dir, manifest)
    return manifest
