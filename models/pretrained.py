"""Pretrained backbones on disk: an orbax checkpoint plus the metadata that must travel with it.

A backbone directory (local path, or any URL orbax / etils ``epath`` can read, e.g.
``gs://...``) holds::

    dpscale_backbone.json   model name, num_classes, preprocessing, sha256 of the weights
    variables/              orbax checkpoint of {"params": ..., "batch_stats": ...}

Preprocessing (resolution, mean/std) is stored next to the weights and handed back
by :func:`load_pretrained` together with the model, so featurization cannot pair
weights with the wrong normalisation. The sha256 is over the weights themselves
(not a source file), so it identifies a backbone whatever its origin and keys the
feature cache; loading re-hashes and refuses a checkpoint that does not match.

Any Flax checkpoint can serve as a backbone if it comes with this JSON and its
``model`` is a name ``dpscale models`` lists (the variables must fit that model).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util

from dpscale import files
from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import efficientnet_lite

METADATA_FILE = "dpscale_backbone.json"
CHECKPOINT_DIR = "variables"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """How raw pixels must be prepared for a backbone.

    ``mean`` and ``std`` are per channel (3 for RGB, 1 for grayscale) in raw pixel
    units (0..255), so ``normalize(x) = (x - mean) / std`` for ``x`` in [0, 255].
    """

    resolution: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        channels = len(self.mean)
        if self.resolution <= 0 or channels not in (1, 3) or len(self.std) != channels or min(self.std) <= 0:
            raise DataError(f"invalid preprocessing: {self}")

    def normalize(self, images: jax.Array | np.ndarray) -> jax.Array:
        """NHWC pixels in [0, 255] (uint8 or float) -> normalised float32."""
        x = jnp.asarray(images, jnp.float32)
        return (x - jnp.asarray(self.mean, jnp.float32)) / jnp.asarray(self.std, jnp.float32)

    def __call__(self, images: jax.Array | np.ndarray) -> jax.Array:
        """Resize NHWC pixels to ``resolution`` x ``resolution`` (bilinear) and normalise."""
        x = jnp.asarray(images, jnp.float32)
        n, h, w, c = x.shape
        if (h, w) != (self.resolution, self.resolution):
            x = jax.image.resize(x, (n, self.resolution, self.resolution, c), method="bilinear")
        return self.normalize(x)

    def fingerprint(self) -> str:
        """A stable string for cache keys: equal iff the preprocessing is equal."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class BackboneMetadata:
    """The JSON saved beside a backbone checkpoint."""

    model: str
    num_classes: int
    preprocessing: Preprocessing
    weights_sha256: str
    source: str = ""
    checkpoint: str = CHECKPOINT_DIR
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> BackboneMetadata:
        try:
            raw = json.loads(text)
            raw["preprocessing"] = Preprocessing(**raw["preprocessing"])
            meta = cls(**raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"malformed {METADATA_FILE}: {exc}") from None
        if meta.format_version != FORMAT_VERSION:
            raise DataError(f"{METADATA_FILE} has format_version {meta.format_version}, expected {FORMAT_VERSION}")
        return meta


def variables_sha256(variables: Any) -> str:
    """sha256 over every array's path, dtype, shape and little-endian bytes, in sorted path order."""
    flat = traverse_util.flatten_dict(jax.device_get(variables), sep="/")
    digest = hashlib.sha256()
    for path in sorted(flat):
        array = np.ascontiguousarray(np.asarray(flat[path]))
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        digest.update(f"{path}|{array.dtype.str}|{array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def default_weights_dir(name: str) -> pathlib.Path:
    """Where ``dpscale import-weights NAME`` writes by default.

    ``$DPSCALE_WEIGHTS_DIR/NAME`` if set, else ``$XDG_CACHE_HOME/dpscale/weights/NAME``
    (``~/.cache/dpscale/weights/NAME``).
    """
    root = os.environ.get("DPSCALE_WEIGHTS_DIR")
    if root:
        return pathlib.Path(root).expanduser() / name
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache).expanduser() / "dpscale" / "weights" / name


def is_complete(directory: str | os.PathLike[str]) -> bool:
    """True if a backbone was fully written there (the JSON is written last)."""
    path = _path(directory)
    return (path / METADATA_FILE).exists() and (path / CHECKPOINT_DIR).exists()


def _path(directory: str | os.PathLike[str]) -> epath.Path:
    """``directory`` as an ``epath.Path``; a URL is checked first (one line if the gcp extra is missing)."""
    if files.is_url(directory):
        files.filesystem(os.fspath(directory))  # also makes orbax's gs:// paths use dpscale's GCS client
    return epath.Path(directory)


def _absolute(path: epath.Path) -> epath.Path:
    """orbax wants absolute paths; URLs (``gs://``...) already are."""
    return path if "://" in os.fspath(path) else path.resolve()


def build_model(name: str, *, num_classes: int) -> Any:
    """The Flax module a metadata ``model`` name stands for: any name of ``dpscale models``."""
    from dpscale.models import registry

    try:
        return registry.get_model(name, num_classes=num_classes)
    except InvalidConfigError as exc:
        raise DataError(f"backbone metadata names a model dpscale cannot build: {exc}") from None


def save_pretrained(
    directory: str | os.PathLike[str],
    variables: Any,
    *,
    model: str,
    num_classes: int,
    preprocessing: Preprocessing,
    source: str = "",
    force: bool = False,
) -> BackboneMetadata:
    """Write ``variables`` as an orbax checkpoint and, last, the metadata JSON."""
    import orbax.checkpoint as ocp

    path = _path(directory)
    path.mkdir(parents=True, exist_ok=True)
    meta_path = path / METADATA_FILE
    if meta_path.exists():
        if not force:
            raise DataError(f"{path} already holds a backbone; save with force=True to replace it")
        meta_path.unlink()  # an interrupted overwrite must not look complete
    metadata = BackboneMetadata(
        model=model,
        num_classes=num_classes,
        preprocessing=preprocessing,
        weights_sha256=variables_sha256(variables),
        source=source,
    )
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(_absolute(path / CHECKPOINT_DIR), variables, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    files.write_atomic(os.fspath(meta_path), lambda f: f.write(metadata.to_json()))
    return metadata


def read_metadata(directory: str | os.PathLike[str]) -> BackboneMetadata:
    path = _path(directory) / METADATA_FILE
    if not path.exists():
        raise DataError(f"no {METADATA_FILE} in {directory}: not a dpscale backbone (or an unfinished import)")
    return BackboneMetadata.from_json(path.read_text())


def resolve_backbone(path_or_name: str | os.PathLike[str]) -> epath.Path:
    """A known model name means its default import directory; anything else is a path or URL.

    The name of a parameter-free backbone (``ModelSpec.parameter_free_backbone``, e.g.
    ``scatternet-linear``) is built into its default directory on first use: there are no
    weights to import, and the directory gives it the metadata and sha256 that key the cache.
    """
    text = os.fspath(path_or_name)
    if _path(text).exists():
        return _path(text)
    if text in efficientnet_lite.VARIANTS:
        directory = default_weights_dir(text)
        if not is_complete(directory):
            raise DataError(f"no imported weights for {text} in {directory}; run: dpscale import-weights {text}")
        return _path(directory)
    spec = _parameter_free_spec(text)
    if spec is not None:
        directory = default_weights_dir(spec.name)
        if not is_complete(directory):
            _write_parameter_free_backbone(spec, directory)
        return _path(directory)
    if not files.is_url(text):  # a URL that is not there says so when it is read
        raise _no_backbone(text)
    return _path(text)


def _no_backbone(text: str) -> DataError:
    """Why ``text`` names no backbone, with the names that do (a model without weights is not one of them)."""
    import difflib

    from dpscale.models import registry

    names = registry.list_models()
    by_name = [*efficientnet_lite.VARIANTS, *(n for n in names if registry.get_spec(n).parameter_free_backbone)]
    listed = f"backbones by name: {', '.join(by_name)}; or a directory of `dpscale export-backbone`"
    if text in names:
        return DataError(
            f"{text} has no weights to load by name (`dpscale models` lists none for it): train it, export the run "
            f"with `dpscale export-backbone RUN DIR` and give that directory ({listed})"
        )
    close = difflib.get_close_matches(text, [*by_name, *names], n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    return DataError(f"no backbone {text!r}: no such directory, and not a backbone name ({guess}{listed})")


def _parameter_free_spec(name: str) -> Any:
    from dpscale.models import registry

    try:
        spec = registry.get_spec(name)
    except InvalidConfigError:
        return None
    return spec if spec.parameter_free_backbone else None


def _write_parameter_free_backbone(spec: Any, directory: pathlib.Path) -> None:
    """Save the model's deterministic initial variables (seed 0) with [-1, 1] pixel scaling.

    The scaling is the one image-mode training uses (``data.image_data.normalize``:
    ``(x - 127.5) / 127.5``), so cached features equal what the same model computes on
    images in ``train --mode images``. Only the (unused) classifier has parameters.

    The sha256 (the cache key) covers these variables, not the transform's code: after a
    change to the transform, delete this directory and the cache entries made with it.
    """
    model = build_model(spec.name, num_classes=spec.num_classes)
    images = jnp.zeros((1, *spec.input_shape), jnp.float32)
    if jax.tree.leaves(model.init(jax.random.key(0), images, method="features")):
        raise InvalidConfigError(f"{spec.name} is marked parameter-free but its features have parameters")
    variables = model.init(jax.random.key(0), images)
    channels = spec.input_shape[2]
    prep = Preprocessing(resolution=spec.input_shape[0], mean=(127.5,) * channels, std=(127.5,) * channels)
    save_pretrained(
        directory,
        variables,
        model=spec.name,
        num_classes=spec.num_classes,
        preprocessing=prep,
        source=f"{spec.name}: a fixed transform, built by dpscale (no trained weights)",
        force=True,
    )


def load_pretrained(
    path_or_name: str | os.PathLike[str], *, num_classes: int | None = None, verify: bool = True
) -> tuple[Any, Any, Preprocessing]:
    """Load a backbone: returns ``(model, variables, preprocessing)``.

    ``num_classes`` (if it differs from the checkpoint's) swaps the classifier for a
    zero-initialised one of that size, as for DP fine-tuning on a new task.
    ``verify`` re-hashes the restored weights against the metadata's sha256.
    """
    import orbax.checkpoint as ocp

    directory = resolve_backbone(path_or_name)
    metadata = read_metadata(directory)
    model = build_model(metadata.model, num_classes=metadata.num_classes)
    prep = metadata.preprocessing
    shape = (1, prep.resolution, prep.resolution, len(prep.mean))
    abstract = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct(shape, jnp.float32))
    checkpoint = directory / metadata.checkpoint
    if not checkpoint.exists():
        raise DataError(f"backbone checkpoint {checkpoint} is missing")
    checkpointer = ocp.StandardCheckpointer()
    try:
        variables = checkpointer.restore(_absolute(checkpoint), abstract)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise DataError(f"checkpoint {checkpoint} does not fit model {metadata.model}: {exc}") from None
    finally:
        checkpointer.close()
    if verify and variables_sha256(variables) != metadata.weights_sha256:
        raise DataError(f"weights in {checkpoint} do not match the sha256 in {METADATA_FILE}")
    if num_classes is not None and num_classes != metadata.num_classes:
        return (*with_zero_head(metadata.model, variables, num_classes=num_classes, input_shape=shape[1:]), prep)
    return model, variables, prep


def with_zero_head(name: str, variables: Any, *, num_classes: int, input_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """``(model, variables)`` of ``name`` with ``num_classes`` outputs: backbone kept, classifier all zeros.

    A zero classifier makes the first DP steps start from uniform predictions instead of
    ImageNet logits, the usual start for fine-tuning (De et al. 2022).
    """
    from dpscale.models import registry

    head_key = registry.get_spec(name).head_param_key
    model = build_model(name, num_classes=num_classes)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, *input_shape), jnp.float32))
    params = dict(variables["params"])
    params[head_key] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract["params"][head_key])
    return model, {**variables, "params": params}
