"""The dedup stage: public ingested data minus every near duplicate of a private image.

``run(config)`` opens both ingested datasets (a bad path fails at once with a one-line
``DataError``), plans read tasks along the public shards, runs the Beam graph of
``pipelines.dedup`` and reads back what it wrote into ``output_dir``: a new ingested
dataset (same format, own manifest and content hash, readable by ``IngestedDataset``)
plus ``dedup_report.json`` (every removed public example with its closest private
example, the distance, the view that matched, the threshold and the method). The
private dataset is only read. How images are compared: ``stages.image_hash``; how
candidates are found without all pairs: ``stages.dedup_join``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages import shards
from dpscale.stages.dataset import IngestedDataset
from dpscale.stages.dedup_join import PRIVATE, PUBLIC, Match, ReadTask
from dpscale.stages.examples import Encoded, decode_record
from dpscale.stages.image_hash import HashConfig, view_name
from dpscale.stages.progress import LocalProgress

log = logging.getLogger(__name__)
REPORT = "dedup_report.json"
METHOD = ("YCbCr 32x32 area thumbnail -> low DCT (6x6 luma w/o DC + 3x3 per chroma), unit "
          "length; private side as whole + 5x5-grid crops at several scales + mirrors; "
          "SimHash LSH bands for candidates; Euclidean distance <= threshold; then a finer "
          "check (12x12 luma DCT + chroma, refined alignment) <= verify_threshold")
GROUP_TARGET = 50_000  # entries per (band, partition) group the planner aims for


@dataclasses.dataclass(frozen=True)
class DedupConfig:
    """One dedup run; ``pipeline_args`` go to Beam unchanged."""

    public: str
    private: str
    output_dir: str
    threshold: float = HashConfig.threshold
    verify_threshold: float = HashConfig.verify_threshold
    bands: int = HashConfig.bands
    bits_per_band: int = HashConfig.bits_per_band
    crop_scales: tuple[float, ...] = HashConfig.crop_scales  # () = whole image + mirror only
    public_splits: tuple[str, ...] = ()  # empty: every split
    private_splits: tuple[str, ...] = ()
    examples_per_task: int = 1_000
    overwrite: bool = False
    pipeline_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            self.hash_config
        except ValueError as exc:
            raise InvalidConfigError(str(exc)) from None
        if self.examples_per_task < 1:
            raise InvalidConfigError("examples per task must be at least 1")
        def norm(p: str) -> str:
            return os.path.normpath(p) if shards.is_local(p) else p.rstrip("/")

        if norm(self.output_dir) in (norm(self.public), norm(self.private)):
            raise InvalidConfigError("the output must be a different path from both inputs")
        if norm(self.public) == norm(self.private) and (
                not self.public_splits or not self.private_splits
                or set(self.public_splits) & set(self.private_splits)):
            raise InvalidConfigError("public and private are the same dataset: give disjoint "
                                     "--public-split and --private-split")

    @property
    def hash_config(self) -> HashConfig:
        return HashConfig(threshold=self.threshold, verify_threshold=self.verify_threshold,
                          bands=self.bands,
                          bits_per_band=self.bits_per_band,
                          crop_scales=tuple(self.crop_scales))


@dataclasses.dataclass(frozen=True)
class DedupResult:
    output_dir: str
    manifest: dict[str, Any]
    report: dict[str, Any]
    seconds: float

    @property
    def num_removed(self) -> int:
        return int(self.report["num_removed"])

    @property
    def num_kept(self) -> int:
        return int(self.report["num_kept"])


def select_splits(dataset: IngestedDataset, wanted: Sequence[str]) -> list[str]:
    """``wanted`` (all when empty), each checked to exist."""
    for split in wanted:
        dataset.num_examples(split)  # DataError naming the splits it has
    return list(wanted) or dataset.splits


def read_tasks(dataset: IngestedDataset, side: str, per_task: int,
               splits: Sequence[str]) -> list[ReadTask]:
    """Index ranges of ``splits``, never straddling a shard (public tasks know theirs)."""
    tasks = []
    for split in splits:
        start = 0
        for shard, entry in enumerate(dataset.manifest["splits"][split]["shards"]):
            stop = start + entry["num_examples"]
            tasks += [ReadTask(side, split, s, min(s + per_task, stop), shard)
                      for s in range(start, stop, per_task)]
            start = stop
    return tasks


def shard_ranges(dataset: IngestedDataset,
                 splits: Sequence[str]) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(split, shard) -> (first index, end index, number of shards in the split)."""
    ranges = {}
    for split in splits:
        entries = dataset.manifest["splits"][split]["shards"]
        start = 0
        for shard, entry in enumerate(entries):
            ranges[(split, shard)] = (start, start + entry["num_examples"], len(entries))
            start += entry["num_examples"]
    return ranges


def partitions_per_band(num_public: int, num_private: int, config: HashConfig) -> int:
    """Groups per band so a group holds about GROUP_TARGET entries (>= 1)."""
    entries = num_public + num_private * config.num_views
    return max(1, math.ceil(entries / GROUP_TARGET))


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
                  received: dict[str, int] | None = None) -> dict[str, Any]:
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
        summaries, source=f"dedup:{public.manifest['source']}",
        class_names=public.class_names, image_shape=public.image_shape, rejections=[],
        validation_fraction=public.manifest["validation_fraction"],
        encoding=public.manifest["record_encoding"])
    kept = sum(e["num_examples"] for e in manifest["splits"].values())
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
        "private": {"path": private_path, "content_hash": private.content_hash,
                    "num_examples": num_private},
        "num_candidate_pairs": candidates,
        "num_rejected_by_verification": rejected_by_verification,
        "num_removed": len(pairs), "num_kept": kept,
        "removed_by_split": removed_by_split, "removed": pairs,
    }
    shards.write_json(shards.join(output_dir, REPORT), report)
    shards.write_json(shards.join(output_dir, shards.REPORT), {"num_rejected": 0, "rejected": []})
    manifest["num_inputs"] = num_public
    manifest["dedup"] = {"public_content_hash": public.content_hash,
                         "private_content_hash": private.content_hash,
                         "threshold": config.threshold, "num_removed": len(pairs),
                         "report": REPORT}
    shards.write_json(shards.join(output_dir, shards.MANIFEST), manifest)
    return manifest


def run(config: DedupConfig) -> DedupResult:
    """Write ``config.public`` minus near duplicates of ``config.private`` to the output."""
    import apache_beam as beam

    from dpscale.pipelines import dedup as graph
    from dpscale.pipelines.ingest import is_local_runner, pipeline_options

    start = time.perf_counter()
    public, private = IngestedDataset(config.public), IngestedDataset(config.private)
    if not public.image_shape:
        raise DataError(f"public dataset {config.public!r} holds no examples")
    hash_config = config.hash_config
    public_splits = select_splits(public, config.public_splits)
    private_splits = select_splits(private, config.private_splits)
    num_public = sum(public.num_examples(s) for s in public_splits)
    num_private = sum(private.num_examples(s) for s in private_splits)
    tasks = (read_tasks(public, PUBLIC, config.examples_per_task, public_splits)
             + read_tasks(private, PRIVATE, max(1, config.examples_per_task // 10),
                          private_splits))
    shards.prepare_output(config.output_dir, overwrite=config.overwrite, extra_files=(REPORT,))
    options = pipeline_options(config.pipeline_args,
                               estimated_examples=num_public + num_private * 10)
    progress = (LocalProgress(num_public + num_private, label="dedup: signatures", log=log)
                if is_local_runner(options) else None)
    settings = graph.GraphSettings(
        public=config.public, private=config.private, output_dir=config.output_dir,
        hash_config=hash_config, tasks=tuple(tasks),
        shard_ranges=shard_ranges(public, public_splits), num_public=num_public,
        num_private=num_private,
        num_classes=public.num_classes, image_shape=public.image_shape,
        partitions=partitions_per_band(num_public, num_private, hash_config),
        progress_dir=progress.directory if progress else None)
    log.info("dedup: %d public vs %d private examples (%d views each), %d read tasks, "
             "%d bands x %d partitions", num_public, num_private, hash_config.num_views,
             len(tasks), hash_config.bands, settings.partitions)
    with progress or contextlib.nullcontext(), beam.Pipeline(options=options) as pipeline:
        graph.build(pipeline, settings)
    manifest = shards.read_json(shards.join(config.output_dir, shards.MANIFEST))
    report = shards.read_json(shards.join(config.output_dir, REPORT))
    seconds = time.perf_counter() - start
    log.info("dedup: removed %d of %d public examples (%d candidate pairs checked) in %.1f s",
             report["num_removed"], num_public, report["num_candidate_pairs"], seconds)
    return DedupResult(config.output_dir, manifest, report, seconds)
