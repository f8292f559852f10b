"""A learned copy embedding: a small CNN trained on the PUBLIC images only, so that an image and
copy-like edits of it land close together and other public images land apart.

Why: the pixel checks of ``dedup.verify`` and ``dedup.refine`` compare aligned pixels; the real
duplicates they lose changed their pixels (strong recolouring, re-sharpening, zooms beyond the
affine fit). A contrastive embedding can be taught those edits directly: SimCLR's NT-Xent loss
(Chen et al. 2020), used for copy detection as in SSCD (Pizzi et al. 2022). No label and no
private image enters the model, so its weights are public data and one model serves every
private set deduplicated against the same public set.

Images are resized to ``RESOLUTION`` (the model is built for CIFAR-sized thumbnails; copy
detection needs the layout, not fine detail) and grey images are repeated to three channels.
Written here rather than taken from a library: no maintained JAX package trains copy
embeddings; the pieces it uses (flax, optax) are.

Why its own small training loop rather than ``training/``'s:

* Layering: ``dedup`` sits below ``training`` in the package order (``tests/test_architecture.py``)
  and ``dedup.copy_decision`` and ``dedup.local_match`` use this module's model, ``embed`` and
  ``load``, so nothing here may import from ``training``.
* No privacy: it trains on public images only, so it needs none of what shapes ``training``'s
  loop (the privacy plan's sampler, per-example clipping, noise, the accountant, secret seeds).
* No labels: the loss is NT-Xent between two random copy edits (``copy_edit``) of each image,
  every other image of the batch a negative. ``data.augment``'s views (small shifted crops,
  mirror flips) are not the edits a copy model must learn, and ``training.evaluation``
  measures accuracy, which has no meaning here.
* Its state is small (344k weights and AdamW's moments), so one msgpack file per finished
  epoch (``PARTIAL``) resumes it deterministically; ``training.run_directory``'s orbax
  checkpoints, lock, ledger and secrets exist for what a DP run must keep.

What it shares: ``dpscale.files.write_atomic`` for every file it writes, the caller's progress
bar (``train`` reports through its ``progress`` callback, which ``stages.train_copy_model``
feeds to ``dpscale.progress.progress_bar``), and flax/optax. It does not build on
``models.layers``: weight standardisation is there for DP training, and using it here would
change this model's numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import serialization

from dpscale.files import write_atomic

log = logging.getLogger(__name__)
RESOLUTION = 32
WEIGHTS = "copy_model.msgpack"
TRAINED_ON = "copy_model_trained_on.npy"  # the example ids (uint64) of every image it was trained on
INFO = "copy_model.json"
FORMAT = 2  # 2: the training images' ids and the files' hashes are saved with the weights


BLOCKS = ((1, 1), (2, 2), (2, 1), (4, 2), (4, 1))  # per conv block: (width multiple, stride)
LOCAL_BLOCKS = 2  # the blocks ``LocalFeatures`` returns: 16x16 cells at 32 px, 2 px apart, each seeing 5x5 px


def _blocks(x: jax.Array, width: int, count: int) -> jax.Array:
    """The first ``count`` conv blocks (called inside a compact module: the names are the parameters')."""
    h = (x - 0.5) / 0.25
    for i, (multiple, stride) in enumerate(BLOCKS[:count]):
        h = nn.Conv(multiple * width, (3, 3), strides=stride, padding=1, use_bias=False, name=f"conv_{i}")(h)
        h = nn.relu(nn.GroupNorm(num_groups=8, name=f"norm_{i}")(h))
    return h


class CopyEmbedding(nn.Module):
    """Five 3x3 conv blocks (GroupNorm, ReLU; two of stride 2), a 2x2 average pool that keeps
    the coarse layout (a copy shares it, a look-alike often does not), a linear head, unit norm."""

    width: int = 32
    dim: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = _blocks(x, self.width, len(BLOCKS))
        n, height, width, c = h.shape
        h = h.reshape(n, 2, height // 2, 2, width // 2, c).mean((2, 4)).reshape(n, -1)
        z = nn.Dense(self.dim, name="head")(h)
        return z / jnp.maximum(jnp.linalg.norm(z, axis=1, keepdims=True), 1e-12)


class LocalFeatures(nn.Module):
    """The copy model's first ``LOCAL_BLOCKS`` blocks, applied with its parameters: a feature
    vector per cell of the image, for ``dedup.local_match``."""

    width: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _blocks(x, self.width, LOCAL_BLOCKS)


def local_params(params: Any) -> Any:
    """The part of a ``CopyEmbedding``'s variables that ``LocalFeatures`` uses."""
    names = [f"{kind}_{i}" for i in range(LOCAL_BLOCKS) for kind in ("conv", "norm")]
    return {"params": {name: params["params"][name] for name in names}}


def thumbnails(images: np.ndarray, *, chunk: int = 2048) -> np.ndarray:
    """uint8 [n, H, W, C] -> uint8 [n, RESOLUTION, RESOLUTION, 3] (grey repeated to three channels),
    resized a chunk at a time, so large images never sit in memory as floats all at once."""
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[1:] == (RESOLUTION, RESOLUTION, 3):
        return images
    out = np.empty((len(images), RESOLUTION, RESOLUTION, 3), np.uint8)
    for lo in range(0, len(images), chunk):
        x = images[lo : lo + chunk].astype(np.float32)
        if x.shape[-1] == 1:
            x = np.repeat(x, 3, axis=-1)
        if x.shape[1:3] != (RESOLUTION, RESOLUTION):
            x = np.asarray(jax.image.resize(x, (len(x), RESOLUTION, RESOLUTION, 3), "linear", antialias=True))
        out[lo : lo + chunk] = np.clip(np.rint(x), 0, 255).astype(np.uint8)
    return out


def as_input(images: np.ndarray) -> np.ndarray:
    """uint8 [n, H, W, C] -> float32 [n, RESOLUTION, RESOLUTION, 3] in [0, 1]."""
    return thumbnails(images).astype(np.float32) / 255.0


def _uniform(key: jax.Array, lo: float, hi: float, shape: tuple[int, ...] = ()) -> jax.Array:
    return jax.random.uniform(key, shape, minval=lo, maxval=hi)


def copy_edit(key: jax.Array, x: jax.Array) -> jax.Array:
    """One copy-like edit of one float image in [0, 1] (H, W, 3): re-crop to 55-100% of a side at
    aspect 0.74-1.35 and rescale back, per-channel gains, contrast, brightness, saturation (10%
    grey), gamma, blur or sharpen, noise. The realistic copy edits of dedup's planted benchmark,
    made stronger; no mirroring (dedup compares both mirror states itself)."""
    keys = jax.random.split(key, 12)
    height, width = x.shape[:2]
    side, aspect = _uniform(keys[0], 0.55, 1.0), jnp.exp(_uniform(keys[1], -0.3, 0.3))
    sx, sy = jnp.minimum(side * jnp.sqrt(aspect), 1.0), jnp.minimum(side / jnp.sqrt(aspect), 1.0)
    # the crop's centre, in units of the free margin: the crop stays inside the image
    cx, cy = (1 - sx) * _uniform(keys[2], -1, 1), (1 - sy) * _uniform(keys[3], -1, 1)
    # output pixel centres in [-1, 1] -> input coordinates (pixel index units)
    gy = (jnp.arange(height) + 0.5) / height * 2 - 1
    gx = (jnp.arange(width) + 0.5) / width * 2 - 1
    ys = ((gy * sy + cy) + 1) / 2 * height - 0.5
    xs = ((gx * sx + cx) + 1) / 2 * width - 0.5
    yy, xx = jnp.meshgrid(ys, xs, indexing="ij")
    x = jnp.stack(
        [jax.scipy.ndimage.map_coordinates(x[..., c], [yy, xx], order=1, mode="nearest") for c in range(3)], axis=-1
    )
    x = x * _uniform(keys[4], 0.8, 1.2, (1, 1, 3))
    mean = x.mean()
    x = (x - mean) * _uniform(keys[5], 0.6, 1.4) + mean * _uniform(keys[6], 0.7, 1.3)
    grey = x.mean(-1, keepdims=True)
    saturation = jnp.where(jax.random.uniform(keys[7]) < 0.1, 0.0, _uniform(keys[8], 0.3, 1.5))
    x = jnp.clip(grey + (x - grey) * saturation, 0, 1) ** jnp.exp(_uniform(keys[9], -0.4, 0.4))
    padded = jnp.pad(x, ((1, 1), (1, 1), (0, 0)), mode="edge")
    k = jnp.array([1.0, 2.0, 1.0]) / 4
    blurred = sum(k[i] * k[j] * padded[i : i + height, j : j + width] for i in range(3) for j in range(3))
    x = x + _uniform(keys[10], -0.8, 1.0) * (blurred - x)  # < 0: sharpen, > 0: blur
    x = x + jax.random.normal(keys[11], x.shape) * _uniform(jax.random.fold_in(keys[11], 1), 0.0, 0.03)
    return jnp.clip(x, 0, 1)


def nt_xent(z1: jax.Array, z2: jax.Array, temperature: float = 0.07) -> jax.Array:
    """SimCLR's loss: each view must pick its partner among the 2n - 1 other views of the batch."""
    n = z1.shape[0]
    z = jnp.concatenate([z1, z2])
    logits = jnp.where(jnp.eye(2 * n, dtype=bool), -jnp.inf, z @ z.T / temperature)
    target = jnp.concatenate([jnp.arange(n) + n, jnp.arange(n)])
    return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    epochs: int = 6
    batch: int = 256
    learning_rate: float = 2e-3
    weight_decay: float = 1e-4
    temperature: float = 0.07
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch < 2:
            raise ValueError(f"need at least 1 epoch and a batch of 2, got {self.epochs} and {self.batch}")
        if not self.learning_rate > 0 or self.weight_decay < 0 or not self.temperature > 0:
            raise ValueError("learning rate and temperature must be positive, weight decay not negative")


Step = Callable[[Any, Any, jax.Array, jax.Array], tuple[Any, Any, jax.Array]]


def contrastive_step(optimiser: optax.GradientTransformation, temperature: float) -> Step:
    """A jitted training step ``(params, optimiser state, batch, key) -> (params, state, loss)``:
    two fresh copy edits of every image of the batch (float [n, H, W, 3] in [0, 1]), NT-Xent."""
    model, edits = CopyEmbedding(), jax.vmap(copy_edit)

    @jax.jit
    def step(params: Any, state: Any, batch: jax.Array, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        k1, k2 = jax.random.split(key)
        n = batch.shape[0]
        v1, v2 = edits(jax.random.split(k1, n), batch), edits(jax.random.split(k2, n), batch)

        def loss_fn(p: Any) -> jax.Array:
            return nt_xent(model.apply(p, v1), model.apply(p, v2), temperature)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = optimiser.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


PARTIAL = "copy_model.partial.msgpack"  # the state after the last finished epoch


def train(
    images: np.ndarray,
    settings: TrainSettings = TrainSettings(),
    *,
    progress: Callable[[int, int, float], None] | None = None,
    work_dir: str | None = None,
) -> tuple[Any, dict]:
    """Train on ``images`` (uint8 [n, H, W, C]: public images only); returns (params, info).

    One-cycle learning rate (AdamW), a fresh pair of copy edits of every image each epoch.
    ``progress(step, total, loss)`` is called after every step. With ``work_dir``, the state
    after each epoch is kept there and a rerun with the same images and settings resumes from
    it (every random draw is derived from the seed, the epoch and the step, so a resumed run
    gives the same model as an uninterrupted one).
    """
    x = thumbnails(images)  # uint8: 3 KB per image; a batch becomes floats only when it is used
    per_epoch = len(x) // settings.batch
    if per_epoch == 0:
        raise ValueError(f"{len(x)} public images are fewer than one batch of {settings.batch}")
    total = settings.epochs * per_epoch
    model = CopyEmbedding()
    init_key, root = jax.random.split(jax.random.PRNGKey(settings.seed))
    params = model.init(init_key, jnp.zeros((1, RESOLUTION, RESOLUTION, 3)))
    schedule = optax.cosine_onecycle_schedule(total, settings.learning_rate)
    optimiser = optax.adamw(schedule, weight_decay=settings.weight_decay)
    state = optimiser.init(params)
    step = contrastive_step(optimiser, settings.temperature)

    identity = {"format": FORMAT, "images": len(x), "digest": _digest(x), **dataclasses.asdict(settings)}
    first_epoch, losses = 0, []
    partial = None if work_dir is None else os.path.join(work_dir, PARTIAL)
    if partial is not None and os.path.isfile(partial):
        resumed = _restore(partial, identity, {"params": params, "state": state})
        if resumed is not None:
            (params, state), first_epoch, losses = resumed
    done = first_epoch * per_epoch
    if progress is not None and done:
        progress(done, total, losses[-1] if losses else float("nan"))
    for epoch in range(first_epoch, settings.epochs):
        order = np.random.default_rng((settings.seed, epoch)).permutation(len(x))
        for i in range(per_epoch):
            batch = x[order[i * settings.batch : (i + 1) * settings.batch]].astype(np.float32) / 255.0
            params, state, loss = step(params, state, batch, jax.random.fold_in(root, done))
            done += 1
            losses.append(float(loss))
            if not np.isfinite(losses[-1]):
                raise FloatingPointError(f"copy model training diverged at step {done} (loss {losses[-1]})")
            if progress is not None:
                progress(done, total, losses[-1])
        if partial is not None and epoch + 1 < settings.epochs:
            blob = serialization.msgpack_serialize(
                {
                    "identity": json.dumps(identity),
                    "epoch": epoch + 1,
                    "losses": np.asarray(losses),
                    "params": serialization.to_state_dict(params),
                    "state": serialization.to_state_dict(state),
                }
            )
            _write_atomically(partial, blob)  # a crash mid-write keeps the previous epoch
    tail = losses[-min(50, len(losses)) :]
    return params, {
        "steps": total,
        "images": len(x),
        "final_loss": round(float(np.mean(tail)), 4),
        "resumed_at_epoch": first_epoch,
        **dataclasses.asdict(settings),
    }


def _restore(partial: str, identity: dict, template: dict) -> tuple[tuple[Any, Any], int, list[float]] | None:
    """The state of an interrupted run with the same ``identity``, or None (start afresh): another
    run's state, or a damaged or foreign file, is never half-used."""
    try:
        with open(partial, "rb") as f:
            saved = serialization.msgpack_restore(f.read())
        if json.loads(saved["identity"]) != identity:
            log.info("copy model: the saved state in %s is of other images or settings; starting afresh", partial)
            return None
        restored = serialization.from_state_dict(template, {"params": saved["params"], "state": saved["state"]})
        _check_like(template, restored)
        return (restored["params"], restored["state"]), int(saved["epoch"]), [float(v) for v in saved["losses"]]
    except Exception as exc:  # noqa: BLE001 - any unreadable state means: start afresh, say so
        log.warning("copy model: cannot resume from %s (%s); starting afresh", partial, exc)
        return None


def _check_like(template: Any, tree: Any) -> None:
    """``ValueError`` unless ``tree`` has the template's structure, shapes and finite values
    (flax's restore keeps whatever leaves it is given)."""
    if jax.tree_util.tree_structure(template) != jax.tree_util.tree_structure(tree):
        raise ValueError("its structure is not this model's")
    for a, b in zip(jax.tree_util.tree_leaves(template), jax.tree_util.tree_leaves(tree)):
        if np.shape(a) != np.shape(b):
            raise ValueError(f"a weight of shape {np.shape(b)} where this model has {np.shape(a)}")
        if np.issubdtype(np.asarray(b).dtype, np.floating) and not np.isfinite(b).all():
            raise ValueError("it holds non-finite weights")


def _write_atomically(path: str, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data), binary=True)


def _digest(images: np.ndarray) -> str:
    """A fingerprint of every training image: a resumed run must train on the same ones."""
    h = hashlib.sha256(str(images.shape).encode())
    h.update(np.ascontiguousarray(images).tobytes())
    return h.hexdigest()


_apply = jax.jit(CopyEmbedding().apply)  # one jitted function: every embed call reuses its compilations


def embed(params: Any, images: np.ndarray, *, mirrored: bool = False, batch: int = 1024) -> np.ndarray:
    """Unit embeddings float32 [n, dim] of uint8 images (mirrored left-right first if asked)."""
    out = []
    for lo in range(0, len(images), batch):
        chunk = as_input(images[lo : lo + batch])
        if mirrored:
            chunk = chunk[:, :, ::-1]
        n = len(chunk)
        if n < batch and lo > 0:  # keep one compiled shape for the last partial batch
            chunk = np.concatenate([chunk, np.zeros((batch - n, *chunk.shape[1:]), chunk.dtype)])
        out.append(np.asarray(_apply(params, chunk))[:n])
    return np.concatenate(out) if out else np.zeros((0, CopyEmbedding.dim), np.float32)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save(directory: str, params: Any, info: dict, trained_on: np.ndarray) -> None:
    """Weights (flax msgpack), the ids of the images they were trained on (``trained_on``: uint64
    example ids, see ``IngestedDataset.ids``) and a description (json) into ``directory``. Each
    file is replaced atomically and the description, written last, holds the other two's
    hashes: a save cut short is refused by ``load``, never paired with an older description."""
    os.makedirs(directory, exist_ok=True)
    weights = serialization.to_bytes(params)
    ids = io.BytesIO()
    np.save(ids, np.unique(np.asarray(trained_on, np.uint64)), allow_pickle=False)
    _write_atomically(os.path.join(directory, WEIGHTS), weights)
    _write_atomically(os.path.join(directory, TRAINED_ON), ids.getvalue())
    described = {"format": FORMAT, **info, "sha256": {WEIGHTS: _sha256(weights), TRAINED_ON: _sha256(ids.getvalue())}}
    _write_atomically(os.path.join(directory, INFO), (json.dumps(described, indent=1) + "\n").encode())


@dataclasses.dataclass(frozen=True)
class SavedModel:
    params: Any
    info: dict  # what ``save`` was given, with the format and the files' hashes
    trained_on: np.ndarray  # sorted unique uint64 example ids of its training images


def load(directory: str) -> SavedModel:
    """A model written by ``save``, checked (hashes, shapes, finite weights); ``ValueError`` if it is not one."""
    paths = {name: os.path.join(directory, name) for name in (WEIGHTS, TRAINED_ON, INFO)}
    if not (os.path.isfile(paths[WEIGHTS]) and os.path.isfile(paths[INFO])):
        raise ValueError(
            f"{directory!r} holds no copy model ({WEIGHTS} and {INFO}); train one with "
            "`dpscale train-copy-model PUBLIC DIR`"
        )
    try:
        with open(paths[INFO]) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"copy model description {paths[INFO]!r} cannot be read: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else None
        raise ValueError(
            f"copy model {directory!r} has format {found}, expected {FORMAT}: train it again "
            "with `dpscale train-copy-model PUBLIC DIR --overwrite`"
        )
    blobs = {}
    for name in (WEIGHTS, TRAINED_ON):
        if not os.path.isfile(paths[name]):
            raise ValueError(f"copy model file {paths[name]!r} is missing: train the model again")
        with open(paths[name], "rb") as f:
            blobs[name] = f.read()
        expected = info.get("sha256")
        if not isinstance(expected, dict) or _sha256(blobs[name]) != expected.get(name):
            raise ValueError(
                f"copy model file {paths[name]!r} does not match its description (damaged, or "
                "from another save): train the model again"
            )
    template = CopyEmbedding().init(jax.random.PRNGKey(0), jnp.zeros((1, RESOLUTION, RESOLUTION, 3)))
    try:
        params = serialization.from_bytes(template, blobs[WEIGHTS])
        _check_like(template, params)
        trained_on = np.load(io.BytesIO(blobs[TRAINED_ON]), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - msgpack / shape / npy errors all mean an unusable file
        raise ValueError(f"copy model {directory!r} cannot be used: {exc}") from None
    if trained_on.dtype != np.uint64 or trained_on.ndim != 1:
        raise ValueError(f"copy model file {paths[TRAINED_ON]!r} does not hold example ids")
    return SavedModel(params, info, trained_on)
