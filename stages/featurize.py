"""The featurize stage: ingested images -> frozen-backbone features in the Zarr cache.

``run(config)`` computes the cache key from metadata alone (the manifest's content hash,
the backbone JSON's weights sha256, the preprocessing), so a cache hit costs a few file
reads and no model. On a miss it creates (or resumes) the entry and runs the Beam graph
of ``pipelines.featurize`` over the chunks that have no marker yet; each worker reads its
chunk's rows by index, preprocesses and forwards them in fixed-size batches under one
``jit``, and writes the chunk. Only when every chunk is marked is the entry sealed.

The per-batch work (``preprocess``, ``Featurizer``, ``featurize_chunk``) is plain code,
tested without Beam.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from dpscale.cache import feature_store as fstore
from dpscale.cache.keys import RESIZE_METHODS, FeatureKey
from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages.dataset import IngestedDataset

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
    batch_size: int = 64
    chunk_rows: int = 1024
    pipeline_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.resolution is not None and self.resolution < 1:
            raise InvalidConfigError(f"resolution must be positive, got {self.resolution}")
        if self.resize_method not in RESIZE_METHODS:
            raise InvalidConfigError(f"resize method must be one of {', '.join(RESIZE_METHODS)}")
        if self.batch_size < 1 or self.chunk_rows < 1:
            raise InvalidConfigError("batch size and chunk rows must be at least 1")


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


# ---- per-batch transforms (what the workers run) ---------------------------------------------
def preprocess(images: Any, *, resolution: int, mean: tuple[float, ...], std: tuple[float, ...],
               resize_method: str = "bilinear") -> Any:
    """uint8 NHWC pixels -> resized, normalised float32 at ``resolution`` (traceable in jit).

    Grayscale images fed to an RGB backbone are repeated over the three channels.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(images, jnp.float32)
    n, h, w, c = x.shape
    if c == 1 and len(mean) == 3:
        x = jnp.repeat(x, 3, axis=-1)
    if (h, w) != (resolution, resolution):
        x = jax.image.resize(x, (n, resolution, resolution, x.shape[-1]), method=resize_method)
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


class Featurizer:
    """A loaded backbone and one jitted ``uint8 batch -> features`` function.

    Batches are padded to ``batch_size`` so the function compiles once; all batches of a
    call are dispatched before the first result is fetched, so the host work of one batch
    overlaps the device work of the previous one.
    """

    def __init__(self, backbone: str, key: FeatureKey, *, batch_size: int) -> None:
        import jax

        from dpscale.models.pretrained import load_pretrained, read_metadata, resolve_backbone

        if read_metadata(resolve_backbone(backbone)).weights_sha256 != key.weights_sha256:
            raise DataError(f"backbone {backbone!r} changed since the run was planned "
                            "(weights sha256 differs from the cache key)")
        model, variables, _ = load_pretrained(backbone)
        self.batch_size = batch_size
        prep = dict(resolution=key.resolution, mean=key.mean, std=key.std,
                    resize_method=key.resize_method)

        def features(x: Any) -> Any:
            return model.apply(variables, x, method="features")

        def forward(images: Any) -> Any:
            x = preprocess(images, **prep)
            if not key.flip_average:
                return features(x)
            return 0.5 * (features(x) + features(x[:, :, ::-1, :]))  # NHWC: mirror the width axis

        self._forward = jax.jit(forward)

    def __call__(self, images: np.ndarray) -> np.ndarray:
        n = len(images)
        pending = []
        for start in range(0, n, self.batch_size):
            batch = images[start:start + self.batch_size]
            if len(batch) < self.batch_size:
                pad = np.zeros((self.batch_size - len(batch), *batch.shape[1:]), batch.dtype)
                batch = np.concatenate([batch, pad])
            pending.append(self._forward(batch))
        if not pending:
            raise ValueError("no images to featurize")
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in pending])[:n]


def featurize_chunk(dataset: IngestedDataset, store: fstore.FeatureStore, featurizer: Featurizer,
                    split: str, chunk: int) -> int:
    """Read one chunk's rows by index, featurize them, write the chunk. Returns its rows."""
    start, stop = store.layout.splits[split].rows(chunk)
    examples = dataset.examples(split, range(start, stop))
    images = np.stack([e.image for e in examples])
    features = featurizer(images)
    store.write_chunk(split, chunk, features, np.array([e.label for e in examples], np.int32),
                      [e.digest for e in examples])
    return stop - start


# ---- planning ---------------------------------------------------------------------------------
def feature_key(dataset: IngestedDataset, backbone: str, *, resolution: int | None = None,
                resize_method: str = "bilinear", flip_average: bool = False) -> tuple[FeatureKey, Any]:
    """The cache key from metadata only (no weights loaded), and the backbone metadata."""
    from dpscale.models.pretrained import read_metadata, resolve_backbone

    meta = read_metadata(resolve_backbone(backbone))
    prep = meta.preprocessing
    channels = dataset.image_shape[-1] if dataset.image_shape else len(prep.mean)
    if channels not in (len(prep.mean), 1):
        raise DataError(f"images have {channels} channels but the backbone expects "
                        f"{len(prep.mean)}")
    key = FeatureKey(data_content_hash=dataset.content_hash, weights_sha256=meta.weights_sha256,
                     model=meta.model, resolution=resolution or prep.resolution, mean=prep.mean,
                     std=prep.std, resize_method=resize_method, flip_average=flip_average)
    return key, meta


def _feature_dim(meta: Any, key: FeatureKey) -> int:
    import jax
    import jax.numpy as jnp

    from dpscale.models.pretrained import build_model

    model = build_model(meta.model, num_classes=meta.num_classes)
    x = jax.ShapeDtypeStruct((1, key.resolution, key.resolution, len(key.mean)), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    return int(jax.eval_shape(lambda v, i: model.apply(v, i, method="features"), variables, x).shape[-1])


def run(config: FeaturizeConfig) -> FeaturizeResult:
    """Featurize ``config.data`` with ``config.backbone`` into the cache (or find it there)."""
    start = time.perf_counter()
    cache_dir = config.cache_dir or fstore.default_cache_dir()
    dataset = IngestedDataset(config.data)
    key, meta = feature_key(dataset, config.backbone, resolution=config.resolution,
                            resize_method=config.resize_method, flip_average=config.flip_average)
    path = fstore.entry_path(cache_dir, key)
    sizes = {s: dataset.num_examples(s) for s in dataset.splits}
    with contextlib.suppress(DataError):
        fstore.FeatureStore.open(cache_dir, key)
        log.info("featurize: cache hit %s", path)
        return FeaturizeResult(path, key.digest, True, 0, 0, sizes, time.perf_counter() - start)
    layout = fstore.EntryLayout(
        key=key, feature_dim=_feature_dim(meta, key), class_names=tuple(dataset.class_names),
        splits={s: fstore.SplitLayout(n, config.chunk_rows) for s, n in sizes.items()},
        source=config.data)
    store = fstore.FeatureStore.create(cache_dir, layout)
    missing = store.missing_chunks()
    total = len(store.all_chunks())
    log.info("featurize %s with %s at %d px%s: %d of %d chunks to compute -> %s", config.data,
             meta.model, key.resolution, ", flip-averaged" if key.flip_average else "", len(missing),
             total, path)
    if missing:
        _run_pipeline(config, store, missing)
    store.finalize()
    return FeaturizeResult(path, key.digest, False, len(missing), total, sizes,
                           time.perf_counter() - start)


def _run_pipeline(config: FeaturizeConfig, store: fstore.FeatureStore,
                  chunks: list[tuple[str, int]]) -> None:
    import apache_beam as beam

    from dpscale.pipelines import featurize as graph
    from dpscale.stages.progress import LocalProgress

    rows = sum(store.layout.splits[s].rows(c)[1] - store.layout.splits[s].rows(c)[0]
               for s, c in chunks)
    options = graph.pipeline_options(config.pipeline_args, num_chunks=len(chunks))
    progress = (LocalProgress(rows, label="featurize", log=log)
                if graph.is_local_runner(options) else None)
    settings = graph.WorkerSettings(
        data=config.data, backbone=config.backbone, entry=store.path,
        batch_size=config.batch_size, progress_dir=progress.directory if progress else None)
    with progress or contextlib.nullcontext(), beam.Pipeline(options=options) as pipeline:
        graph.build(pipeline, chunks, settings)
