"""The Beam graph of ``dpscale featurize``: chunks -> spread -> featurize and write each chunk.

Only wiring lives here; the per-chunk work is ``stages.featurize.featurize_chunk``. The
unit of work is one whole Zarr chunk of rows, so no two workers ever write the same chunk
and a retried bundle simply rewrites its chunk and marker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from dpscale.pipelines import ingest as ingest_graph
from dpscale.stages.progress import mark

#: Fewer chunks than this run in one in-memory worker: a second process would spend
#: longer loading and compiling the backbone than it saves.
MIN_CHUNKS_FOR_TWO_WORKERS = 4


def pipeline_options(args: tuple[str, ...] | list[str], *, num_chunks: int) -> PipelineOptions:
    """Beam options from command-line ``args``; local defaults as for ingest (both cores)."""
    many = num_chunks >= MIN_CHUNKS_FOR_TWO_WORKERS
    return ingest_graph.pipeline_options(
        args, estimated_examples=ingest_graph.SMALL_DATA if many else 0)


def is_local_runner(options: PipelineOptions) -> bool:
    return ingest_graph.is_local_runner(options)


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to set itself up (strings only: cheap to pickle and ship)."""

    data: str
    backbone: str
    entry: str
    batch_size: int
    progress_dir: str | None = None


class _FeaturizeChunk(beam.DoFn):
    """Loads the data, backbone and store once per worker; then one chunk per element."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.rows = beam.metrics.Metrics.counter("featurize", "rows")
        self.chunks = beam.metrics.Metrics.counter("featurize", "chunks")

    def setup(self) -> None:
        import logging

        from dpscale.cache.feature_store import FeatureStore
        from dpscale.stages import featurize as stage
        from dpscale.stages.dataset import IngestedDataset

        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every restore step
        self.dataset = IngestedDataset(self.settings.data)
        self.store = FeatureStore.for_writing(self.settings.entry)
        self.featurizer = stage.Featurizer(self.settings.backbone, self.store.layout.key,
                                           batch_size=self.settings.batch_size)

    def process(self, element: tuple[str, int]) -> Any:
        from dpscale.stages import featurize as stage

        split, chunk = element
        rows = stage.featurize_chunk(self.dataset, self.store, self.featurizer, split, chunk)
        self.rows.inc(rows)
        self.chunks.inc()
        mark(self.settings.progress_dir, rows)
        yield split, chunk, rows

    def teardown(self) -> None:
        dataset = getattr(self, "dataset", None)
        if dataset is not None:
            dataset.close()


def build(pipeline: beam.Pipeline, chunks: list[tuple[str, int]],
          settings: WorkerSettings) -> beam.PCollection:
    """Add the featurize graph over ``chunks`` (``(split, chunk index)`` pairs) to ``pipeline``."""
    return (pipeline
            | "Chunks" >> beam.Create(list(chunks))
            | "SpreadChunks" >> beam.Reshuffle()
            | "FeaturizeChunks" >> beam.ParDo(_FeaturizeChunk(settings)))
