"""The ingest stage: any supported source -> ArrayRecord shards + manifest + report.

``run(config)`` plans the source on this machine (so a missing path fails at once with a
one-line ``DataError``), runs the Beam graph of ``pipelines.ingest`` on the configured
runner and reads back the manifest the pipeline wrote.

``classes`` keeps only some classes of the source (e.g. digits 0-4 as public data and
5-9 as private data): the kept classes are relabelled 0..k-1 in the source's order, the
manifest's ``class_names`` are the kept ones and ``class_filter`` records the source's.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from dpscale.data import shards
from dpscale.data.examples import ENCODINGS
from dpscale.data.manifest import Manifest
from dpscale.data.sources import parse_source, plan_source, select_classes
from dpscale.errors import DataError, InvalidConfigError
from dpscale.files import owner_only

log = logging.getLogger(__name__)
IMAGE_ENCODINGS = tuple(ENCODINGS)  # how a record may store its pixels: raw, png


@dataclasses.dataclass(frozen=True)
class IngestConfig:
    """Everything one ingest run needs; ``pipeline_args`` go to Beam unchanged."""

    source: str
    output_dir: str
    validation_fraction: float = 0.0
    examples_per_shard: int = 10_000
    image_encoding: str = "raw"
    tfds_data_dir: str | None = None
    overwrite: bool = False
    pipeline_args: tuple[str, ...] = ()
    verbose: bool = False  # Beam's own logging on stderr (else in a log file)
    classes: tuple[str, ...] = ()  # keep only these class names (relabelled 0..k-1); () = all

    def __post_init__(self) -> None:
        if len(set(self.classes)) != len(self.classes) or not all(self.classes):
            raise InvalidConfigError(f"classes must be distinct non-empty names, got {self.classes}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise InvalidConfigError(f"validation fraction must be in [0, 1), got {self.validation_fraction}")
        if self.examples_per_shard < 1:
            raise InvalidConfigError("examples per shard must be at least 1")
        if self.image_encoding not in ENCODINGS:
            raise InvalidConfigError(f"image encoding must be one of {sorted(ENCODINGS)}, got {self.image_encoding!r}")
        if self.tfds_data_dir is not None and not self.source.startswith("tfds:"):
            raise InvalidConfigError(f"--tfds-data-dir applies to tfds:NAME sources only, not {self.source!r}")


@dataclasses.dataclass(frozen=True)
class IngestResult:
    """Where the data went and what the manifest says about it."""

    output_dir: str
    manifest: Manifest
    seconds: float

    @property
    def num_examples(self) -> dict[str, int]:
        return {s: e.num_examples for s, e in self.manifest.splits.items()}

    @property
    def num_rejected(self) -> int:
        return self.manifest.num_rejected

    @property
    def images_read(self) -> int:
        """Every input read: kept, rejected, or of a class left out (what the progress bar counts)."""
        excluded = self.manifest.class_filter.num_excluded if self.manifest.class_filter is not None else 0
        return sum(self.num_examples.values()) + self.num_rejected + excluded


@owner_only  # the output is private data
def run(config: IngestConfig) -> IngestResult:
    """Ingest ``config.source`` into ``config.output_dir``."""
    from dpscale.pipelines import ingest as graph
    from dpscale.pipelines.runner import run_pipeline

    start = time.monotonic()  # also the start of the progress bar's throughput: images/s is the result's
    shards.check_output(config.output_dir, overwrite=config.overwrite)  # before any work
    plan = plan_source(parse_source(config.source), tfds_data_dir=config.tfds_data_dir)
    if config.validation_fraction > 0 and "validation" in plan.split_sizes:
        raise InvalidConfigError("the source already has a validation split; drop --validation-fraction")
    kept, label_map = select_classes(plan.class_names, config.classes) if config.classes else (None, None)
    total = sum(plan.split_sizes.values())
    if not total:  # a dataset with no split would only fail later, as "has no split 'train'"
        raise DataError(f"{config.source!r} holds no images to ingest (splits: {dict(plan.split_sizes) or 'none'})")
    log.info(
        "ingest %s: %d inputs in splits %s, %d classes%s, %d read tasks",
        config.source,
        total,
        plan.split_sizes,
        len(plan.class_names),
        f" (keeping {len(kept)})" if kept else "",
        len(plan.tasks),
    )
    shards.prepare_output(config.output_dir, overwrite=config.overwrite)

    def build(pipeline: object, progress_dir: str | None) -> None:
        graph.build(
            pipeline,
            plan,
            graph.GraphSettings(
                output_dir=config.output_dir,
                validation_fraction=config.validation_fraction,
                shards_per_split=graph.shards_per_split(
                    plan.split_sizes,
                    validation_fraction=config.validation_fraction,
                    examples_per_shard=config.examples_per_shard,
                ),
                encoding=config.image_encoding,
                num_inputs=total,
                progress_dir=progress_dir,
                class_names=kept,
                label_map=label_map,
            ),
        )

    run_pipeline(
        build,
        args=config.pipeline_args,
        parallel=graph.parallel(total),
        progress_total=total,
        progress_label="ingest: read+decode",
        log=log,
        progress_unit="images",
        progress_since=start,
        verbose=config.verbose,
        writes_to=config.output_dir,
        rerun="run the command again with --overwrite",
    )
    manifest = shards.read_manifest(config.output_dir)
    seconds = time.monotonic() - start
    for split, entry in manifest.splits.items():
        log.info("ingest %s: %d examples in %d shards", split, entry.num_examples, len(entry.shards))
    if manifest.num_rejected:
        log.warning(
            "ingest: %d inputs rejected %s, listed in %s",
            manifest.num_rejected,
            manifest.rejected_by_reason,
            shards.join(config.output_dir, shards.REPORT),
        )
    return IngestResult(config.output_dir, manifest, seconds)
