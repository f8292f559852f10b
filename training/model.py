"""The model side of a training run: data, loss, initial parameters, a feed, and a clipped sum.

``build_train_model(data, config)`` opens the run's data and returns a ``TrainModel``
that the trainer and the evaluation share, so both agree on what a forward pass is.
Both modes plug into the same DP step through the same hook, ``clipped_sum_fn(clip_norm)``
(``None``: the generic ``vmap`` per-example gradients), so the trainer never branches
on the mode:

* ``images``: a registry model (GroupNorm/WS, no layer mixes examples; checked by
  ``models.validation``) trained from scratch, or a pretrained backbone (``backbone``:
  an imported name or a backbone directory) fine-tuned with a zero classifier, its
  BatchNorm statistics frozen, its own preprocessing (resolution, mean/std) applied;
  all layers, with augmentation multiplicity; its clipped sum comes from per-layer norms
  (``privacy.ghost``: ghost norms or book-keeping per layer) where every parameter has a
  rule, else from ``vmap`` per-example gradients.
* ``features``: a softmax classifier ``x @ kernel + bias`` over cached backbone
  features, zero-initialised as in De et al. (2022), optionally normalised
  (``training.feature_normalization``); its clipped sum is closed-form (``privacy.linear``).

In both modes the last ``holdout`` training rows are kept out of training as split
``"holdout"`` (for choosing hyper-parameters without the test split): the plan accounts for
the other rows only, and split ``train`` means those rows too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpscale.data.dataset import IngestedDataset
from dpscale.data.image_data import PIXEL_MEAN, PIXEL_STD, InMemorySplit, image_inputs, normalize
from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import pretrained, registry
from dpscale.models.validation import validate_dp_model
from dpscale.privacy.bookkeeping import UnsupportedModelError
from dpscale.privacy.clipping import ClippedSumFn
from dpscale.privacy.ghost import LayerChoice, make_ghost_clipped_sum_fn
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.streams import Stream, stream_key
from dpscale.privacy.tuning import choose as tuning
from dpscale.training import feature_normalization, memory
from dpscale.training.config import CACHE_MODES, ImageSettings, TrainingConfig
from dpscale.training.data_kind import KINDS, detect_mode
from dpscale.training.feeds import ActivationFeed, FeatureFeed, ImageFeed, resize_views

PyTree = Any
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainModel:
    num_examples: int
    num_classes: int
    data_hash: str  # identifies the data (never released: runs store a keyed hash of it)
    loss_fn: Callable[[PyTree, PyTree, PyTree], jax.Array]
    init_params: Callable[[int], PyTree]
    model_state: PyTree
    make_feed: Callable[..., Any]  # (augmentation key, BatchPlacement, model_state)
    logits_fn: Callable[[PyTree, PyTree, np.ndarray], jax.Array]  # (params, model_state, inputs)
    eval_inputs: Callable[..., tuple[np.ndarray, np.ndarray]]  # (split, model_state) -> (inputs, labels)
    # clip_norm -> this model's clipped sum for the DP step, or None for the vmap(grad) default.
    clipped_sum_fn: Callable[[float], ClippedSumFn | None] = lambda clip_norm: None
    # seed -> model_state computed from the training data with DP (e.g. a feature mean);
    # None: the state is ``model_state``. The privacy cost is in the run's releases.
    private_state: Callable[[int], PyTree] | None = None
    releases: tuple[float, ...] = ()  # noise multipliers of those releases, for the accountant
    # What the inputs are made of besides the data (classes, shape, backbone, preprocessing);
    # the run records it, and evaluation refuses other data whose inputs differ.
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def state_for(self, seed: int) -> PyTree:
        return self.model_state if self.private_state is None else self.private_state(seed)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _registry_model(config: ImageSettings, dataset: IngestedDataset) -> tuple[Any, Callable[[int], PyTree], PyTree]:
    """A registry model trained from scratch: (model, init_params(seed), model_state)."""
    image_shape = tuple(dataset.image_shape)
    model = registry.get_model(config.model, num_classes=len(dataset.class_names))
    sample = jnp.zeros((1, *image_shape), jnp.float32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), sample)
    validate_dp_model(model, image_shape, variables=abstract)
    if any(k != "params" for k in abstract):
        raise DataError(
            f"model {config.model!r} has non-trainable state {sorted(abstract)}; "
            "fine-tune it from a pretrained backbone (--backbone) instead"
        )
    init = jax.jit(model.init)  # one compilation instead of hundreds of op-by-op ones
    return model, lambda seed: init(stream_key(seed, Stream.INIT), sample)["params"], {}


def _backbone_model(
    config: ImageSettings, dataset: IngestedDataset
) -> tuple[Any, Callable[[int], PyTree], PyTree, Any]:
    """A pretrained backbone with a zero classifier; its frozen statistics are model state."""
    model, variables, prep = pretrained.load_pretrained(config.backbone, num_classes=len(dataset.class_names))
    channels = len(prep.mean)
    if dataset.image_shape[-1] not in (1, channels):
        raise DataError(f"the data has {dataset.image_shape[-1]} channels, the backbone expects {channels}")
    validate_dp_model(model, (prep.resolution, prep.resolution, channels), variables=variables)
    params = variables["params"]
    return model, lambda seed: params, {k: v for k, v in variables.items() if k != "params"}, prep


def _check_training_split(data: str, split: str, splits: Sequence[str], num_examples: Callable[[str], int]) -> None:
    """The training split exists and holds examples (images or cached features alike)."""
    if split not in splits:
        raise DataError(f"{data!r} has no split {split!r} (has {splits})")
    if not num_examples(split):
        raise DataError(
            f"{data!r}: split {split!r} holds no examples, nothing to train on "
            "(a dedup output is empty when every public image was a near duplicate of a private one)"
        )


HOLDOUT_SPLIT = "holdout"


def _trained_rows(total: int, holdout: int) -> int:
    """How many leading rows of the training split are trained on (the rest are held out)."""
    if not 0 <= holdout < total:
        raise InvalidConfigError(f"holdout must be in [0, {total}) (the training split's size), got {holdout}")
    return total - holdout


def _rows_of(split: str, *, train_split: str, total: int, holdout: int) -> tuple[str, slice]:
    """(stored split, rows) that ``split`` names: ``holdout`` the training split's last rows, ``train`` the others."""
    if split == HOLDOUT_SPLIT and holdout:
        return train_split, slice(total - holdout, total)
    if split == train_split and holdout:
        return train_split, slice(0, total - holdout)
    return split, slice(None)


class _LeadingRows:
    """The first ``size`` rows of an image split: all a feed may read when the rest are held out."""

    def __init__(self, split: InMemorySplit, size: int) -> None:
        self.split, self.size = split, size

    def __len__(self) -> int:
        return self.size

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if np.any(np.asarray(indices) >= self.size):
            raise RuntimeError(f"a batch reached past the {self.size} trained rows into the held-out ones")
        return self.split.take(indices)


def _image_model(data: str, config: TrainingConfig) -> TrainModel:
    dataset = IngestedDataset(data)
    _check_training_split(data, config.train_split, dataset.splits, dataset.num_examples)
    total = dataset.num_examples(config.train_split)
    trained_rows = _trained_rows(total, config.holdout)
    settings = config.images
    if settings.backbone:
        model, init_params, model_state, prep = _backbone_model(settings, dataset)
        channels = len(prep.mean)

        def normalize_fn(images: np.ndarray) -> np.ndarray:  # grayscale data into an RGB backbone
            pixels = np.repeat(images, channels, axis=-1) if images.shape[-1] != channels else images
            return np.asarray(prep.normalize(pixels))

        resolution = prep.resolution
        input_shape = (resolution, resolution, channels)
        meta = pretrained.read_metadata(pretrained.resolve_backbone(settings.backbone))
        inputs = image_inputs(
            dataset,
            resolution=resolution,
            mean=prep.mean,
            std=prep.std,
            backbone={"model": meta.model, "weights_sha256": meta.weights_sha256},
        )
    else:
        model, init_params, model_state = _registry_model(settings, dataset)
        normalize_fn, resolution = normalize, None
        input_shape = tuple(dataset.image_shape)
        inputs = image_inputs(dataset, resolution=None, mean=(PIXEL_MEAN,), std=(PIXEL_STD,))

    def loss_fn(params: PyTree, state: PyTree, views: dict[str, jax.Array]) -> jax.Array:
        return _cross_entropy(model.apply({"params": params, **state}, views["image"]), views["label"])

    def eval_inputs(split: str, state: PyTree = None) -> tuple[np.ndarray, np.ndarray]:
        source, rows = _rows_of(split, train_split=config.train_split, total=total, holdout=config.holdout)
        if source not in dataset.splits:
            held = f" and {HOLDOUT_SPLIT!r}" if config.holdout else ""
            raise DataError(f"the data has no split {split!r} (has {dataset.splits}{held})")
        data = InMemorySplit.load(dataset, source)
        images, labels = data.take(np.arange(len(data))[rows])
        return np.asarray(resize_views(jnp.asarray(normalize_fn(images)), resolution)), labels

    def make_feed(key: jax.Array, placement: Any = None, state: PyTree = None) -> ImageFeed:  # reads the training split
        train = _LeadingRows(InMemorySplit.load(dataset, config.train_split), trained_rows)
        return ImageFeed(
            train,
            augmult=settings.augmult,
            pad=settings.augment_pad,
            flip=settings.augment_flip,
            key=key,
            normalize_fn=normalize_fn,
            resolution=resolution,
            placement=placement,
        )

    fits = _check_memory(config, loss_fn, init_params, model_state, input_shape)
    return TrainModel(
        num_examples=trained_rows,
        num_classes=len(dataset.class_names),
        data_hash=data_hash(data, config),
        loss_fn=loss_fn,
        init_params=init_params,
        model_state=model_state,
        make_feed=make_feed,
        logits_fn=lambda params, state, x: model.apply({"params": params, **state}, x),
        eval_inputs=eval_inputs,
        clipped_sum_fn=_layerwise_clipped_sum(config, loss_fn, init_params, model_state, input_shape, fits),
        inputs=inputs,
    )


def _layerwise_clipped_sum(
    config: TrainingConfig,
    loss_fn: Callable[..., jax.Array],
    init_params: Callable[[int], PyTree],
    model_state: PyTree,
    input_shape: tuple[int, ...],
    fits: Callable[[tuple[LayerChoice, ...]], None] = lambda layers: None,
) -> Callable[[float], ClippedSumFn | None]:
    """A network's ``clipped_sum_fn``: per-layer norms (ghost or book-keeping) when every parameter has
    a rule, else None (vmap). Inputs are ``{"image": [b, K, *input_shape], "label": [b, K]}``. ``fits``
    refuses layer paths whose working sets would not fit beside the rest of the step."""
    augmult = config.images.augmult

    def clipped_sum(clip_norm: float) -> ClippedSumFn | None:
        # The example has one device's micro-batch: on a GPU or TPU each layer's path is chosen for it.
        examples = _examples_per_device(config)
        batch = {
            "image": jax.ShapeDtypeStruct((examples, augmult, *input_shape), jnp.float32),
            "label": jax.ShapeDtypeStruct((examples, augmult), jnp.int32),
        }
        example = (jax.eval_shape(lambda: init_params(0)), model_state, batch)
        try:
            choose = tuning.chooser(loss_fn, example=example)  # the device's paths: speed only
            fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=clip_norm, example=example, choose=choose)
        except UnsupportedModelError as error:
            _log.info("per-example gradients: vmap(grad) (%s)", error)
            return None
        _log.info("per-example gradients: per-layer norms from one batched backward: %s", tuning.describe(fn.layers))
        fits(fn.layers)
        # What the device's timings or cost model chose, and from what, in the run's log.
        chosen_for_device = any(choice.reason.startswith(("measured", "estimated")) for choice in fn.layers)
        for line in tuning.describe_layers(fn.layers):
            _log.log(logging.INFO if chosen_for_device else logging.DEBUG, "clip path of %s", line)
        return fn

    return clipped_sum


def _examples_per_device(config: TrainingConfig) -> int:
    """One device's share of a micro-batch."""
    return max(1, config.effective_microbatch_size // (config.devices or jax.device_count()))


def _check_memory(
    config: TrainingConfig,
    loss_fn: Callable[..., jax.Array],
    init_params: Callable[[int], PyTree],
    model_state: PyTree,
    input_shape: tuple[int, ...],
) -> Callable[[tuple[LayerChoice, ...]], None]:
    """Refuse, before anything compiles, a network and micro-batch whose estimate exceeds the memory.

    Returns the same check with the per-layer clipping's working set added, once its paths are chosen
    (``memory.with_clip_paths``): the largest layer's patches, products or Gram matrices in flight, on
    top of what the estimate holds (which already counts the held per-example gradients)."""
    settings = config.images
    views = {
        "image": jax.ShapeDtypeStruct((settings.augmult, *input_shape), jnp.float32),
        "label": jax.ShapeDtypeStruct((settings.augmult,), jnp.int32),
    }
    on_cpu = jax.local_devices()[0].platform == "cpu"  # host devices share one RAM
    devices = config.devices or jax.device_count()
    examples = config.effective_microbatch_size if on_cpu else _examples_per_device(config)
    found = memory.estimate(
        loss_fn,
        jax.eval_shape(lambda: init_params(0)),
        model_state,
        views,
        examples=examples,
        momentum=bool(config.momentum),
    )
    check = functools.partial(
        memory.check_fits,
        model=settings.backbone or settings.model,
        microbatch_size=config.effective_microbatch_size,
        devices=1 if on_cpu else devices,
    )
    check(found)
    per_device = _examples_per_device(config)
    return lambda layers: check(memory.with_clip_paths(found, layers, examples=per_device))


def _feature_model(data: str, config: TrainingConfig) -> TrainModel:
    from dpscale.cache.feature_store import open_features

    store = open_features(data)
    _check_training_split(data, config.train_split, store.splits, store.num_examples)
    dim, classes = store.feature_dim, len(store.class_names)
    total = store.num_examples(config.train_split)
    settings = config.features
    holdout = config.holdout
    trained_rows = _trained_rows(total, holdout)
    kind, sigma_mean, scale = settings.normalization, settings.mean_noise_multiplier, settings.scale
    private = config.private

    def logits_fn(params: PyTree, state: PyTree, x: jax.Array) -> jax.Array:
        return x @ params["kernel"] + params["bias"]

    def loss_fn(params: PyTree, state: PyTree, example: dict[str, jax.Array]) -> jax.Array:
        return _cross_entropy(logits_fn(params, state, example["features"]), example["label"])

    def raw(split: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows of a split as stored; the training split without, ``holdout`` only its last rows."""
        source, rows = _rows_of(split, train_split=config.train_split, total=total, holdout=holdout)
        if source not in store.splits:
            raise DataError(
                f"the feature cache has no split {split!r} (has {store.splits}"
                + (f" and {HOLDOUT_SPLIT!r})" if holdout else ")")
            )
        return np.asarray(store.features(source)[rows], np.float32), np.asarray(store.labels(source)[rows], np.int32)

    def eval_inputs(split: str, state: PyTree = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``split`` under the run's normalisation (``state`` holds a released mean)."""
        x, y = raw(split)
        mean = None if not state else state.get(feature_normalization.MEAN_KEY)
        return feature_normalization.apply(x, kind, mean, scale), y

    def mean_state(seed: int) -> PyTree:
        """The mean of the unit training rows: released with DP (exact for a non-private run)."""
        x, _ = raw(config.train_split)
        noise = sigma_mean if private else None
        return {
            feature_normalization.MEAN_KEY: feature_normalization.feature_mean(x, noise_multiplier=noise, seed=seed)
        }

    return TrainModel(
        num_examples=trained_rows,
        num_classes=classes,
        data_hash=data_hash(data, config),
        loss_fn=loss_fn,
        init_params=lambda seed: {"kernel": jnp.zeros((dim, classes)), "bias": jnp.zeros((classes,))},
        model_state={},
        # The features are read only when a feed is made (training), not for evaluation.
        make_feed=lambda key, placement=None, state=None: FeatureFeed(
            *eval_inputs(config.train_split, state), placement
        ),
        logits_fn=logits_fn,
        eval_inputs=eval_inputs,
        clipped_sum_fn=lambda clip_norm: softmax_regression_clipped_sum(clip_norm=clip_norm),
        private_state=mean_state if feature_normalization.needs_mean(kind) else None,
        releases=feature_normalization.releases(kind, sigma_mean, private=private),
        inputs=feature_inputs(store),
    )


def _activation_model(data: str, config: TrainingConfig) -> TrainModel:
    """A top trained above a cut, on activations cached by ``featurize --cut`` (``models.cuts``)."""
    from dpscale.cache.feature_store import open_features

    store = open_features(data)
    _check_training_split(data, config.train_split, store.splits, store.num_examples)
    views, *activation_shape = store.feature_shape
    activation_shape = tuple(activation_shape)
    settings = config.images
    if settings.backbone:
        raise InvalidConfigError("--backbone does not apply above a cut: the cache entry names its backbone")
    # The images default names no top: above a cut it means the cut's default top.
    sides = cut_top(store, None if settings.model == ImageSettings.model else settings.model)
    top = sides.top
    validate_dp_model(
        top.model, activation_shape, variables={"params": top.init_params(jax.random.key(0)), **top.model_state}
    )
    total = store.num_examples(config.train_split)
    trained_rows = _trained_rows(total, config.holdout)
    model_state = top.model_state

    def init_params(seed: int) -> PyTree:
        return top.init_params(stream_key(seed, Stream.INIT))

    def loss_fn(params: PyTree, state: PyTree, batch: dict[str, jax.Array]) -> jax.Array:
        return _cross_entropy(top.model.apply({"params": params, **state}, batch["image"]), batch["label"])

    def rows_of(split: str) -> tuple[str, slice]:
        source, rows = _rows_of(split, train_split=config.train_split, total=total, holdout=config.holdout)
        if source not in store.splits:
            held = f" and {HOLDOUT_SPLIT!r}" if config.holdout else ""
            raise DataError(f"the cache entry has no split {split!r} (has {store.splits}{held})")
        return source, rows

    def activations(split: str) -> tuple[np.ndarray, np.ndarray]:
        """Every view of the split's rows ``[n, V, h, w, c]`` and their labels."""
        source, rows = rows_of(split)
        flat = np.asarray(store.features(source)[rows], np.float32)
        return flat.reshape(len(flat), views, *activation_shape), store.labels(source)[rows]

    def eval_inputs(split: str, state: PyTree = None) -> tuple[np.ndarray, np.ndarray]:
        """View 0 of every row: the activations of the image itself."""
        cached, labels = activations(split)
        return cached[:, 0], labels

    def make_feed(key: jax.Array, placement: Any = None, state: PyTree = None) -> ActivationFeed:
        if settings.augmult > views:  # checked here, for training: evaluation reads view 0 only
            raise InvalidConfigError(
                f"augmult {settings.augmult} needs {settings.augmult} cached views per image, the entry has "
                f"{views}: featurize with --augmult-views {settings.augmult}"
            )
        cached, labels = activations(config.train_split)
        return ActivationFeed(cached, labels, augmult=settings.augmult, key=key, placement=placement)

    fits = _check_memory(config, loss_fn, init_params, model_state, activation_shape)
    return TrainModel(
        num_examples=trained_rows,
        num_classes=store.num_classes,
        data_hash=data_hash(data, config),
        loss_fn=loss_fn,
        init_params=init_params,
        model_state=model_state,
        make_feed=make_feed,
        logits_fn=lambda params, state, x: top.model.apply({"params": params, **state}, x),
        eval_inputs=eval_inputs,
        clipped_sum_fn=_layerwise_clipped_sum(config, loss_fn, init_params, model_state, activation_shape, fits),
        inputs=feature_inputs(store) | {"top": sides.name},
    )


def cut_backbone(store: Any) -> tuple[Any, PyTree, pretrained.BackboneMetadata]:
    """The backbone an entry was cut from (its recorded directory or name), checked against the key's weights:
    its model, variables and metadata."""
    key, where = store.key, store.layout.backbone or store.key.model
    try:
        meta = pretrained.read_metadata(pretrained.resolve_backbone(where))
    except DataError as error:
        raise DataError(
            f"the backbone this cache entry was cut from ({where!r}) cannot be read ({error}); the layers above "
            "the cut start from its weights: restore it, or featurize again"
        ) from None
    if meta.weights_sha256 != key.weights_sha256 or meta.model != key.model:
        raise DataError(
            f"the backbone at {where!r} is not the one this cache entry was cut from (other weights): "
            "restore that backbone, or featurize again with this one"
        )
    model, variables, _ = pretrained.load_pretrained(where)
    return model, variables, meta


@dataclasses.dataclass(frozen=True)
class CutTop:
    """An activations entry's two sides: the backbone it was cut from (model, variables, metadata) and the
    top named ``name`` above the cut, built for the entry's classes and activation shape."""

    backbone: Any
    variables: PyTree
    metadata: pretrained.BackboneMetadata
    name: str
    top: Any


def cut_top(store: Any, top_name: str | None) -> CutTop:
    """The backbone and the top ``top_name`` (None: the cut's first) of an activations entry: what a run
    above the cut trains, and what ``export-backbone`` joins to the layers below it."""
    from dpscale.models import cuts

    backbone, variables, metadata = cut_backbone(store)
    name = top_name or cuts.top_names(backbone)[0]
    top = cuts.build_top(
        backbone,
        store.key.cut,
        name,
        variables=variables,
        num_classes=store.num_classes,
        activation_shape=tuple(store.feature_shape[1:]),
    )
    return CutTop(backbone, variables, metadata, name, top)


def feature_inputs(store: Any) -> dict[str, Any]:
    """What a feature entry's rows mean: its key without the data's identity, and its classes."""
    key = {k: v for k, v in store.key.as_dict().items() if k != "data_identity"}
    return {"feature_key": key, "class_names": list(store.class_names)}


def data_hash(data: str, config: TrainingConfig) -> str:
    """What identifies the data a run of ``config`` reads (never released: runs and sweeps key it).

    Cheap: no model is built, so a sweep can check its data before it decides what to train.
    """
    if config.mode in CACHE_MODES:
        from dpscale.cache.feature_store import open_features

        store = open_features(data)
        _check_training_split(data, config.train_split, store.splits, store.num_examples)
        return hashlib.sha256((store.digest + "".join(store.ids(config.train_split))).encode()).hexdigest()
    return IngestedDataset(data).content_hash


def build_train_model(data: str, config: TrainingConfig) -> TrainModel:
    """The model of a run on ``data`` (an ingested dataset, or a feature-cache entry)."""
    kind = detect_mode(data)
    if kind != config.mode:  # the commands refuse it first, saying how to make the kind asked for
        raise DataError(f"{data!r} holds {KINDS[kind]}, not the {KINDS[config.mode]} a {config.mode} run reads")
    builders = {"features": _feature_model, "activations": _activation_model, "images": _image_model}
    return builders[config.mode](data, config)
