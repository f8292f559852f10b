"""The dedup stage: public ingested data minus every near duplicate of a private image.

``run(config)`` opens both ingested datasets (a bad path fails at once with a one-line
``DataError``), plans read tasks along the public shards, runs the Beam graph of
``pipelines.dedup`` and reads back what it wrote into ``output_dir``: a new ingested
dataset (same format, own manifest and content hash, readable by ``IngestedDataset``)
plus ``dedup_report.json`` (every removed public example with its closest private
example, the distance, the view that matched, the threshold and the method). The
private dataset is only read. How images are compared: ``dedup.image_hash``; how
candidates are found without all pairs: ``dedup.join``; the work plan: ``dedup.planning``;
what is written: ``dedup.output``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from dpscale.data import shards
from dpscale.data.dataset import IngestedDataset
from dpscale.data.manifest import Manifest
from dpscale.dedup.image_hash import HashConfig
from dpscale.dedup.join import PRIVATE, PUBLIC
from dpscale.dedup.output import REPORT
from dpscale.dedup.planning import partitions_per_band, read_tasks, select_splits, shard_ranges
from dpscale.errors import DataError, InvalidConfigError

log = logging.getLogger(__name__)


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
    manifest: Manifest
    report: dict[str, Any]
    seconds: float

    @property
    def num_removed(self) -> int:
        return int(self.report["num_removed"])

    @property
    def num_kept(self) -> int:
        return int(self.report["num_kept"])


def run(config: DedupConfig) -> DedupResult:
    """Write ``config.public`` minus near duplicates of ``config.private`` to the output."""
    from dpscale.pipelines import dedup as graph
    from dpscale.pipelines.runner import run_pipeline

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
    partitions = partitions_per_band(num_public, num_private, hash_config)
    log.info("dedup: %d public vs %d private examples (%d views each), %d read tasks, "
             "%d bands x %d partitions", num_public, num_private, hash_config.num_views,
             len(tasks), hash_config.bands, partitions)

    def build(pipeline: object, progress_dir: str | None) -> None:
        graph.build(pipeline, graph.GraphSettings(
            public=config.public, private=config.private, output_dir=config.output_dir,
            hash_config=hash_config, tasks=tuple(tasks),
            shard_ranges=shard_ranges(public, public_splits), num_public=num_public,
            num_private=num_private, num_classes=public.num_classes, image_shape=public.image_shape,
            partitions=partitions, progress_dir=progress_dir))

    run_pipeline(build, args=config.pipeline_args,
                 parallel=graph.parallel(num_public, num_private),
                 progress_total=num_public + num_private, progress_label="dedup: signatures", log=log)
    manifest = shards.read_manifest(config.output_dir)
    report = shards.read_json(shards.join(config.output_dir, REPORT))
    seconds = time.perf_counter() - start
    log.info("dedup: removed %d of %d public examples (%d candidate pairs checked) in %.1f s",
             report["num_removed"], num_public, report["num_candidate_pairs"], seconds)
    return DedupResult(config.output_dir, manifest, report, seconds)
