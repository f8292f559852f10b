"""The Beam graph of ``dpscale featurize``: chunks -> spread -> featurize and write each chunk.

Only wiring lives here; the per-chunk work is ``cache.featurizer.featurize_chunk``. The
unit of work is one whole Zarr chunk of rows, so no two workers ever write the same chunk
and a retried bundle simply rewrites its chunk and marker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import apache_beam as beam

from dpscale.pipelines.progress import mark

#: Fewer chunks than this run in one in-memory worker: a second process would spend
#: longer loading and compiling the backbone than it saves.
MIN_CHUNKS_FOR_TWO_WORKERS = 4


def parallel(num_chunks: int) -> bool:
    """Whether two local worker processes pay off for this many chunks."""
    return num_chunks >= MIN_CHUNKS_FOR_TWO_WORKERS


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
        from dpscale.cache.featurizer import Featurizer
        from dpscale.data.dataset import IngestedDataset

        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every restore step
        self.dataset = IngestedDataset(self.settings.data)
        self.store = FeatureStore.for_writing(self.settings.entry)
        self.featurizer = Featurizer(self.settings.backbone, self.store.layout.key, batch_size=self.settings.batch_size)

    def process(self, element: tuple[str, int]) -> Iterable[tuple[str, int, int]]:
        from dpscale.cache.featurizer import featurize_chunk

        split, chunk = element
        rows = featurize_chunk(self.dataset, self.store, self.featurizer, split, chunk)
        self.rows.inc(rows)
        self.chunks.inc()
        mark(self.settings.progress_dir, rows)
        yield split, chunk, rows

    def teardown(self) -> None:
        dataset = getattr(self, "dataset", None)
        if dataset is not None:
            dataset.close()


def build(pipeline: beam.Pipeline, chunks: list[tuple[str, int]], settings: WorkerSettings) -> beam.PCollection:
    """Add the featurize graph over ``chunks`` (``(split, chunk index)`` pairs) to ``pipeline``."""
    return (
        pipeline
        | "Chunks" >> beam.Create(list(chunks))
        | "SpreadChunks" >> beam.Reshuffle()
        | "FeaturizeChunks" >> beam.ParDo(_FeaturizeChunk(settings))
    )
