"""The featurize stage: ingested images -> frozen-backbone features in the Zarr cache.

``run(config)`` computes the cache key from metadata alone (the manifest's content hash,
the backbone JSON's weights sha256, the preprocessing), so a cache hit costs a few file
reads and no model, plus one read of every chunk: a hit is only a hit if every chunk is
present and passes its checksum. On a miss it creates (or resumes) the entry, drops the
markers of chunks that are damaged (deleted or corrupt after the entry was sealed) and runs
the Beam graph of ``pipelines.featurize`` over the chunks that have no marker (the per-chunk
work is ``cache.featurizer``): so featurize is also the repair of a damaged entry, and it
recomputes only what is missing. Only when every chunk is marked is the entry sealed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time

from dpscale.cache import feature_store as fstore
from dpscale.cache import featurizer
from dpscale.cache.keys import RESIZE_METHODS  # also --resize-method's choices
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError, InvalidConfigError
from dpscale.files import owner_only

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FeaturizeConfig:
    """One featurize run; ``pipeline_args`` go to Beam unchanged.

    ``resolution`` overrides the backbone's own (e.g. 128 for a 224 px Lite0), and is then
    part of the key like the rest of the preprocessing. ``flip_average`` stores the mean of
    each image's features and its mirror image's (test-time augmentation folded into the
    features: it reads one example only, so it costs no privacy, and doubles the forward
    passes). ``batch_size`` and ``chunk_rows`` change speed and resume granularity, never
    the features.
    """

    data: str
    backbone: str
    cache_dir: str | None = None
    resolution: int | None = None
    resize_method: str = "bilinear"
    flip_average: bool = False
    cut: str = ""  # "": pooled features; else the activations at this cut (``dpscale models`` lists them)
    augmult_views: int = 1  # at a cut: the image plus K - 1 random crop-and-flip views, K times the disk
    batch_size: int = 64
    chunk_rows: int = 1024
    pipeline_args: tuple[str, ...] = ()
    verbose: bool = False  # Beam's own logging on stderr (else in a log file)

    def __post_init__(self) -> None:
        if self.resolution is not None and self.resolution < 1:
            raise InvalidConfigError(f"resolution must be positive, got {self.resolution}")
        if self.resize_method not in RESIZE_METHODS:
            raise InvalidConfigError(f"resize method must be one of {', '.join(RESIZE_METHODS)}")
        if self.batch_size < 1 or self.chunk_rows < 1:
            raise InvalidConfigError("batch size and chunk rows must be at least 1")
        if self.augmult_views < 1 or (self.augmult_views > 1 and not self.cut):
            raise InvalidConfigError("--augmult-views needs --cut (and is at least 1): pooled features have no views")
        if self.cut and self.flip_average:
            raise InvalidConfigError("--flip-average applies to pooled features, not to activations at a cut")


@dataclasses.dataclass(frozen=True)
class FeaturizeResult:
    """Where the features are (``open_features(path)``) and what this run had to do."""

    path: str
    digest: str
    cache_hit: bool
    chunks_computed: int
    chunks_total: int
    num_examples: dict[str, int]
    seconds: float
    images_computed: int = 0  # rows featurized by this run (0 on a cache hit)


@owner_only  # the output is private data
def run(config: FeaturizeConfig) -> FeaturizeResult:
    """Featurize ``config.data`` with ``config.backbone`` into the cache (or find it there)."""
    start = time.monotonic()  # also the start of the progress bar's throughput: images/s is the result's
    cache_dir = config.cache_dir or fstore.default_cache_dir()
    dataset = IngestedDataset(config.data)
    key, meta = featurizer.feature_key(
        dataset,
        config.backbone,
        cache_dir=cache_dir,
        resolution=config.resolution,
        resize_method=config.resize_method,
        flip_average=config.flip_average,
        cut=config.cut,
        views=config.augmult_views,
    )
    path = fstore.entry_path(cache_dir, key)
    sizes = {s: dataset.num_examples(s) for s in dataset.splits}
    with contextlib.suppress(DataError):
        fstore.FeatureStore.open(cache_dir, key, verify=True)
        log.info("featurize: cache hit %s", path)
        return FeaturizeResult(path, key.digest, True, 0, 0, sizes, time.monotonic() - start)
    shape = featurizer.row_shape(meta, key)
    layout = fstore.EntryLayout(
        key=key,
        feature_dim=math.prod(shape),
        feature_shape=shape if key.cut else (),
        class_names=tuple(dataset.class_names),
        splits={s: fstore.SplitLayout(n, config.chunk_rows) for s, n in sizes.items()},
        source=_absolute(config.data),
        backbone=_absolute(config.backbone, only_if_exists=True),
    )
    store = fstore.FeatureStore.create(cache_dir, layout)
    for damage in store.invalidate_damaged():
        log.warning("featurize: %s: recomputing it", damage.describe())
    missing = store.missing_chunks()
    total = len(store.all_chunks())
    cut = f", cut {key.cut} ({key.views} view{'s' if key.views > 1 else ''} of {shape[1:]})" if key.cut else ""
    log.info(
        "featurize %s with %s at %d px%s%s: %d of %d chunks to compute -> %s (%s float32 before compression)",
        config.data,
        meta.model,
        key.resolution,
        ", flip-averaged" if key.flip_average else "",
        cut,
        len(missing),
        total,
        path,
        _size(sum(sizes.values()) * layout.feature_dim * 4),
    )
    rows = _run_pipeline(config, store, missing, since=start) if missing else 0
    store.finalize()
    return FeaturizeResult(
        path, key.digest, False, len(missing), total, sizes, time.monotonic() - start, images_computed=rows
    )


def _size(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} bytes"
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


def _absolute(path: str, *, only_if_exists: bool = False) -> str:
    """A local path made absolute (so a stored reference works from any directory); URLs and names as given."""
    if "://" in path or (only_if_exists and not os.path.exists(path)):
        return path
    return os.path.abspath(path)


def _run_pipeline(
    config: FeaturizeConfig, store: fstore.FeatureStore, chunks: list[tuple[str, int]], *, since: float
) -> int:
    from dpscale.pipelines import featurize as graph
    from dpscale.pipelines.runner import run_pipeline

    rows = sum(store.layout.splits[s].rows(c)[1] - store.layout.splits[s].rows(c)[0] for s, c in chunks)

    def build(pipeline: object, progress_dir: str | None) -> None:
        graph.build(
            pipeline,
            chunks,
            graph.WorkerSettings(
                data=config.data,
                backbone=config.backbone,
                entry=store.path,
                batch_size=config.batch_size,
                progress_dir=progress_dir,
            ),
        )

    run_pipeline(
        build,
        args=config.pipeline_args,
        parallel=graph.parallel(len(chunks)),
        progress_total=rows,
        progress_label="featurize",
        log=log,
        progress_unit="images",
        progress_since=since,
        verbose=config.verbose,
        writes_to=store.path,
        rerun="run the command again (it computes only the missing chunks)",
    )
    return rows
