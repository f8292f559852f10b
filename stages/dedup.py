"""The dedup stage: public ingested data minus every near duplicate of a private image.

``run(config)`` opens both ingested datasets (a bad path fails at once with a one-line
``DataError``), plans read and neighbour tasks, runs the Beam graph of ``pipelines.dedup``
and reads back what it wrote into ``output_dir``: a new ingested dataset (same format, own
manifest and content hash, readable by ``IngestedDataset``) plus the report
``dedup_report.NOT-PRIVATE.json`` (removed pairs, near-threshold rejections, distances,
views). The report is a private diagnostic (it describes the private data, 0600); the output
dataset depends on the private data too, by design. The private dataset is only read.
How images are compared: ``dedup.descriptor`` and ``dedup.verify``; nearest neighbours:
``dedup.knn``; the work plan: ``dedup.planning``; what is written: ``dedup.output``. With
``copy_model`` (a model of ``dpscale train-copy-model``), the pairs of the learned copy
decision (``dedup.copy_decision``) are removed too; it runs before the graph.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from dpscale import files
from dpscale.data import shards
from dpscale.data.dataset import IngestedDataset
from dpscale.data.manifest import Manifest
from dpscale.dedup.copy_score import CopySettings  # also the defaults --copy-cut and --copy-local-weight show
from dpscale.dedup.join import PRIVATE, PUBLIC
from dpscale.dedup.method import Method
from dpscale.dedup.output import REPORT
from dpscale.dedup.planning import (
    PRIVATE_PER_VERIFY_TASK,
    knn_tasks,
    public_positions,
    read_tasks,
    select_splits,
    shard_ranges,
    verify_blocks,
)
from dpscale.dedup.verify import COARSE_CUT  # the upper bound of --threshold, for the CLI  # noqa: F401
from dpscale.errors import DataError, InvalidConfigError
from dpscale.files import owner_only
from dpscale.training import release

log = logging.getLogger(__name__)
WORK = "_dedup_work"  # descriptor files of a running dedup, inside the output directory


@dataclasses.dataclass(frozen=True)
class DedupConfig:
    """One dedup run; ``pipeline_args`` go to Beam unchanged."""

    public: str
    private: str
    output_dir: str
    threshold: float = Method.threshold
    k: int = Method.k
    min_similarity: float = Method.min_similarity
    max_pages: int = Method.max_pages
    crowded_fraction: float = Method.crowded_fraction
    refine: bool = Method.refine
    copy_model: str | None = None  # a directory of ``dpscale train-copy-model``; None: no copy decision
    copy_cut: float | None = None  # None: CopySettings' default; only with copy_model
    copy_local_weight: float | None = None  # None: CopySettings' default; only with copy_model
    public_splits: tuple[str, ...] = ()  # empty: every split
    private_splits: tuple[str, ...] = ()
    examples_per_task: int = 2_000
    overwrite: bool = False
    verbose: bool = False
    pipeline_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            _ = self.method  # checks the method's name and options
        except ValueError as exc:
            raise InvalidConfigError(str(exc)) from None
        if self.examples_per_task < 1:
            raise InvalidConfigError("examples per task must be at least 1")
        if (self.copy_cut is not None or self.copy_local_weight is not None) and self.copy_model is None:
            raise InvalidConfigError("--copy-cut and --copy-local-weight set the copy decision: give --copy-model too")

        def norm(p: str) -> str:
            return os.path.normpath(p) if shards.is_local(p) else p.rstrip("/")

        if norm(self.output_dir) in (norm(self.public), norm(self.private)):
            raise InvalidConfigError("the output must be a different path from both inputs")
        if norm(self.public) == norm(self.private) and (
            not self.public_splits or not self.private_splits or set(self.public_splits) & set(self.private_splits)
        ):
            raise InvalidConfigError(
                "public and private are the same dataset: give disjoint --public-split and --private-split"
            )

    @property
    def method(self) -> Method:
        return Method(
            k=self.k,
            min_similarity=self.min_similarity,
            threshold=self.threshold,
            max_pages=self.max_pages,
            crowded_fraction=self.crowded_fraction,
            refine=self.refine,
            copy=None
            if self.copy_model is None
            else CopySettings(
                **({} if self.copy_cut is None else {"cut": self.copy_cut}),
                **({} if self.copy_local_weight is None else {"local_weight": self.copy_local_weight}),
            ),
        )


@dataclasses.dataclass(frozen=True)
class DedupResult:
    output_dir: str
    manifest: Manifest
    report: dict[str, Any]  # a private diagnostic: never print it
    report_path: str
    seconds: float

    @property
    def num_removed(self) -> int:
        return int(self.report["num_removed"])

    @property
    def num_kept(self) -> int:
        return int(self.report["num_kept"])

    @property
    def report_warning(self) -> str:
        """The line that tells the reader the report describes the private data."""
        return release.warning(self.report_path)


def _remove_work(work_dir: str) -> None:
    files.rmtree(work_dir)


@owner_only  # the output is private data
def run(config: DedupConfig) -> DedupResult:
    """Write ``config.public`` minus near duplicates of ``config.private`` to the output."""
    from dpscale.pipelines import dedup as graph
    from dpscale.pipelines.runner import run_pipeline

    start = time.perf_counter()
    public, private = IngestedDataset(config.public), IngestedDataset(config.private)
    if not public.image_shape:
        raise DataError(f"public dataset {config.public!r} holds no examples")
    public_splits = select_splits(public, config.public_splits)
    private_splits = select_splits(private, config.private_splits)
    num_public = sum(public.num_examples(s) for s in public_splits)
    num_private = sum(private.num_examples(s) for s in private_splits)
    tasks = read_tasks(public, PUBLIC, config.examples_per_task, public_splits) + read_tasks(
        private, PRIVATE, config.examples_per_task, private_splits
    )
    pairs = knn_tasks(tasks)
    copy_model = None
    if config.copy_model is not None:
        from dpscale.dedup import copy_decision

        copy_model = copy_decision.open_model(config.copy_model, public, public_splits, private, private_splits)
    shards.prepare_output(config.output_dir, overwrite=config.overwrite, extra_files=(REPORT,))
    copy = (
        None
        if copy_model is None
        else copy_decision.decide(public, public_splits, private, private_splits, copy_model, config.method.copy)
    )
    work_dir = shards.join(config.output_dir, WORK)
    _remove_work(work_dir)
    if shards.is_local(work_dir):
        os.makedirs(work_dir, mode=0o700)  # private images' descriptors: owner-only
    log.info(
        "dedup: %d public vs %d private examples (%s vs %s), %d read tasks, %d neighbour tasks",
        num_public,
        num_private,
        ",".join(public_splits),
        ",".join(private_splits),
        len(tasks),
        len(pairs),
    )
    log.info("dedup: %s", graph.progress_units(num_public, num_private, config.method.k))

    def build(pipeline: object, progress_dir: str | None) -> None:
        graph.build(
            pipeline,
            graph.GraphSettings(
                public=config.public,
                private=config.private,
                output_dir=config.output_dir,
                work_dir=work_dir,
                method=config.method,
                tasks=tuple(tasks),
                knn_tasks=tuple(pairs),
                shard_ranges=shard_ranges(public, public_splits),
                num_public=num_public,
                num_private=num_private,
                num_classes=public.num_classes,
                image_shape=public.image_shape,
                public_splits=tuple(public_splits),
                private_splits=tuple(private_splits),
                progress_dir=progress_dir,
                public_positions=public_positions(tasks),
                verify_blocks=tuple(verify_blocks(private, private_splits, PRIVATE_PER_VERIFY_TASK)),
                private_per_block=PRIVATE_PER_VERIFY_TASK,
            ),
            copy=copy,
        )

    try:
        run_pipeline(
            build,
            args=config.pipeline_args,
            parallel=graph.parallel(num_public, num_private),
            progress_total=graph.progress_total(num_public, num_private, config.method.k),
            progress_label=graph.PROGRESS_LABEL,
            log=log,
            verbose=config.verbose,
            writes_to=config.output_dir,
            rerun="run the command again with --overwrite",
        )
    finally:
        _remove_work(work_dir)
    manifest = shards.read_manifest(config.output_dir)
    report_path = shards.join(config.output_dir, REPORT)
    report = shards.read_json(report_path)
    seconds = time.perf_counter() - start
    log.info("dedup: finished in %.1f s", seconds)
    return DedupResult(config.output_dir, manifest, report, report_path, seconds)
