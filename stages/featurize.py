"""The featurize stage: ingested images -> frozen-backbone features in the Zarr cache.

``run(config)`` computes the cache key from metadata alone (the manifest's content hash,
the backbone JSON's weights sha256, the preprocessing), so a cache hit costs a few file
reads and no model, plus one read of every chunk: a hit is only a hit if every chunk is
present and passes its checksum. On a miss it creates (or resumes) the entry, drops the
markers of chunks that are damaged (deleted or corrupt after the entry was sealed) and runs
the Beam graph of ``pipelines.featurize`` over the chunks that have no marker (the per-chunk
work is ``cache.featurizer``): so featurize is also the repair of a damaged entry, and it
recomputes only what is missing. Only when every chunk is marked is the entry sealed.

``repair`` names an entry to repair in place, wherever it is (a copy in another cache keeps the key
it was made with, which this cache's secret would not give): its key, preprocessing and chunking are
the entry's own, and the data and backbone given must be the ones it was made from (the backbone by
its weights, the data by its identity under the secret of the cache the entry records).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from typing import Any

from dpscale.cache import feature_store as fstore
from dpscale.cache import featurizer
from dpscale.cache.keys import RESIZE_METHODS  # also --resize-method's choices
from dpscale.data.dataset import IngestedDataset
from dpscale.data.identity import keyed_identity
from dpscale.data.key_store import existing_secret, key_id
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
    repair: str | None = None  # an entry to finish or repair in place, with its own key and chunking

    def __post_init__(self) -> None:
        if self.repair is not None:
            fixed = ("cache_dir", "resolution", "resize_method", "flip_average", "cut", "augmult_views", "chunk_rows")
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            given = [f"--{name.replace('_', '-')}" for name in fixed if getattr(self, name) != defaults[name]]
            if given:
                raise InvalidConfigError(
                    f"--repair keeps the entry's own key, preprocessing and chunking: leave out {', '.join(given)}"
                )
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
    dataset = IngestedDataset(config.data)
    if config.repair is not None:
        return _repair(config, dataset, since=start)
    cache_dir = config.cache_dir or fstore.default_cache_dir()
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
        cache_key_id=key_id(cache_dir),
    )
    return _fill(config, fstore.FeatureStore.create(cache_dir, layout), meta, shape, sizes, since=start)


def _repair(config: FeaturizeConfig, dataset: IngestedDataset, *, since: float) -> FeaturizeResult:
    """Finish or repair the entry ``config.repair`` in place, from the data and backbone it was made from."""
    from dpscale.models.pretrained import read_metadata, resolve_backbone

    path = config.repair
    layout, _ = fstore.read_layout(path)
    key = layout.key
    sizes = {s: dataset.num_examples(s) for s in dataset.splits}
    meta = read_metadata(resolve_backbone(config.backbone))
    if (meta.weights_sha256, meta.model) != (key.weights_sha256, key.model):
        raise DataError(
            f"backbone {config.backbone!r} is not the one {path!r} was made with (other weights or model): "
            f"give that backbone ({layout.backbone or 'its directory'})"
        )
    secret = existing_secret(layout.cache_key_id or _key_id(os.path.dirname(path.rstrip("/"))))
    if secret is None:
        raise DataError(
            f"{path!r} was made in a cache whose secret is not in your key store, so its data cannot be checked: "
            f"featurize {config.data} into a cache of your own (`dpscale featurize {config.data} --backbone "
            f"{config.backbone} --cache-dir DIR`)"
        )
    if keyed_identity(secret, dataset.content_hash) != key.data_identity:
        raise DataError(f"{config.data!r} is not the data {path!r} was made from: give that data ({layout.source})")
    with contextlib.suppress(DataError):
        fstore.open_features(path, verify=True)
        log.info("featurize: %s is whole", path)
        return FeaturizeResult(path, key.digest, True, 0, 0, sizes, time.monotonic() - since)
    return _fill(config, fstore.FeatureStore.create_at(path, layout), meta, layout.feature_shape, sizes, since=since)


def _fill(
    config: FeaturizeConfig,
    store: fstore.FeatureStore,
    meta: Any,
    shape: tuple[int, ...],
    sizes: dict[str, int],
    *,
    since: float,
) -> FeaturizeResult:
    """Compute the entry's missing and damaged chunks, then seal it."""
    start, key, layout, path = since, store.layout.key, store.layout, store.path
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


def _key_id(cache_dir: str) -> str:
    """The key id of the cache an older entry is in (it recorded none), "" if it has none."""
    try:
        return key_id(cache_dir, create=False)
    except DataError:
        return ""


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
