"""Filling the feature store: a frozen backbone's features of ingested images, chunk by chunk.

What the featurize pipeline's workers run (``pipelines.featurize`` only wires it): the cache
key from metadata alone (``feature_key``: the data's content hash, the backbone's weights
sha256, the preprocessing, the cut), a ``Featurizer`` (the backbone and one jitted ``uint8 batch ->
features`` function), and ``featurize_chunk`` (read one chunk's rows by index, forward them
in fixed-size batches, write the chunk and its marker). Plain code, tested without Beam.

At a cut (``models.cuts``) a row holds the activations of ``views`` views of the image,
flattened: view 0 is the image itself, the others random crop-and-flip views (4-pixel reflect
padding, as in training) drawn from a public key folded with the row's index, so a row is
the same whatever the batch size, worker or resume, and no randomness depends on the data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpscale.cache import feature_store as fstore
from dpscale.cache.keys import FeatureKey
from dpscale.data.dataset import IngestedDataset
from dpscale.data.identity import keyed_identity
from dpscale.data.key_store import directory_secret
from dpscale.errors import DataError

VIEW_SEED = 0x5C0E  # the public key of the cached views' crops and flips
VIEW_PAD = 4  # reflect padding of the cached views' random crops (training's default)


def preprocess(
    images: Any, *, resolution: int, mean: tuple[float, ...], std: tuple[float, ...], resize_method: str = "bilinear"
) -> Any:
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
            raise DataError(
                f"backbone {backbone!r} changed since the run was planned (weights sha256 differs from the cache key)"
            )
        model, variables, _ = load_pretrained(backbone)
        self.batch_size = batch_size
        prep = dict(resolution=key.resolution, mean=key.mean, std=key.std, resize_method=key.resize_method)
        if key.cut:
            from dpscale.models.cuts import activations_fn

            features = activations_fn(model, key.cut, variables)
        else:

            def features(x: Any) -> Any:
                return model.apply(variables, x, method="features")

        def forward(images: Any, rows: Any) -> Any:
            if key.cut:
                views = cached_views(images, rows, views=key.views)  # [b, V, H, W, C]
                out = features(preprocess(views.reshape(-1, *views.shape[2:]), **prep))
                return out.reshape(len(images), -1)
            x = preprocess(images, **prep)
            if not key.flip_average:
                return features(x)
            return 0.5 * (features(x) + features(x[:, :, ::-1, :]))  # NHWC: mirror the width axis

        self._forward = jax.jit(forward)

    def __call__(self, images: np.ndarray, first_row: int = 0) -> np.ndarray:
        """Features of ``images``, rows ``first_row, first_row + 1, ...`` of their split."""
        n = len(images)
        pending = []
        for start in range(0, n, self.batch_size):
            batch = images[start : start + self.batch_size]
            if len(batch) < self.batch_size:
                pad = np.zeros((self.batch_size - len(batch), *batch.shape[1:]), batch.dtype)
                batch = np.concatenate([batch, pad])
            rows = np.arange(first_row + start, first_row + start + self.batch_size, dtype=np.int32)
            pending.append(self._forward(batch, rows))
        if not pending:
            raise ValueError("no images to featurize")
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in pending])[:n]


def cached_views(images: Any, rows: Any, *, views: int) -> Any:
    """``[b, H, W, C]`` pixels -> ``[b, views, H, W, C]`` float32: the image, then random crop-and-flip views.

    Each row's views come from the public ``VIEW_SEED`` folded with its index (see module doc).
    """
    import jax
    import jax.numpy as jnp

    from dpscale.data.augment import augment_views

    x = jnp.asarray(images, jnp.float32)
    if views == 1:
        return x[:, None]

    def of_row(row: Any, image: Any) -> Any:
        key = jax.random.fold_in(jax.random.key(VIEW_SEED), row)
        return augment_views(key, image[None], views=views - 1, pad=VIEW_PAD, flip=True)[0]

    return jnp.concatenate([x[:, None], jax.vmap(of_row)(rows, x)], axis=1)


def featurize_chunk(
    dataset: IngestedDataset, store: fstore.FeatureStore, featurizer: Featurizer, split: str, chunk: int
) -> int:
    """Read one chunk's rows by index, featurize them, write the chunk. Returns its rows."""
    start, stop = store.layout.splits[split].rows(chunk)
    examples = dataset.examples(split, range(start, stop))
    images = np.stack([e.image for e in examples])
    features = featurizer(images, first_row=start)
    store.write_chunk(
        split, chunk, features, np.array([e.label for e in examples], np.int32), [e.digest for e in examples]
    )
    return stop - start


def feature_key(
    dataset: IngestedDataset,
    backbone: str,
    *,
    cache_dir: str,
    resolution: int | None = None,
    resize_method: str = "bilinear",
    flip_average: bool = False,
    cut: str = "",
    views: int = 1,
) -> tuple[FeatureKey, Any]:
    """The cache key from metadata only (no weights loaded), and the backbone metadata.

    The data enters the key as its content hash keyed with ``cache_dir``'s secret.
    """
    from dpscale.models.pretrained import build_model, read_metadata, resolve_backbone

    meta = read_metadata(resolve_backbone(backbone))
    if cut:
        from dpscale.models.cuts import check_cut

        check_cut(build_model(meta.model, num_classes=meta.num_classes), meta.model, cut)
    prep = meta.preprocessing
    channels = dataset.image_shape[-1] if dataset.image_shape else len(prep.mean)
    if channels not in (len(prep.mean), 1):
        raise DataError(f"images have {channels} channels but the backbone expects {len(prep.mean)}")
    identity = keyed_identity(directory_secret(cache_dir), dataset.content_hash)
    key = FeatureKey(
        data_identity=identity,
        weights_sha256=meta.weights_sha256,
        model=meta.model,
        resolution=resolution or prep.resolution,
        mean=prep.mean,
        std=prep.std,
        resize_method=resize_method,
        flip_average=flip_average,
        cut=cut,
        views=views,
    )
    return key, meta


def row_shape(meta: Any, key: FeatureKey) -> tuple[int, ...]:
    """One stored row's shape at the key's resolution, from shapes alone (nothing computed).

    ``(d,)`` for pooled features; ``(views, h, w, c)`` for activations at a cut.
    """
    import jax
    import jax.numpy as jnp

    from dpscale.models.pretrained import build_model

    model = build_model(meta.model, num_classes=meta.num_classes)
    x = jax.ShapeDtypeStruct((1, key.resolution, key.resolution, len(key.mean)), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    if not key.cut:
        return (int(jax.eval_shape(lambda v, i: model.apply(v, i, method="features"), variables, x).shape[-1]),)
    from dpscale.models.cuts import activations_fn

    shape = jax.eval_shape(lambda v, i: activations_fn(model, key.cut, v)(i), variables, x).shape
    return (key.views, *(int(n) for n in shape[1:]))
