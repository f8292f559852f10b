"""Names -> model specs: what ``dpscale models`` lists and what the stages build from a config.

A :class:`ModelSpec` says how to build the Flax module and what it expects (input shape,
default number of classes, feature dimension, whether importable weights exist).

Every model family is listed here the same way: a function below builds that family's specs
from its module, and ``_FAMILIES`` names them in listing order. The model modules only define
networks and never import this one, so importing a model builds no table and the registry
holds no hidden list of modules to import back. Adding a family: write its ``_..._specs``
function and add it to ``_FAMILIES``. WRN-d-k also resolves for any valid ``wrn-D-K`` on demand.

Each spec carries its parameter count as a constant, read from ``models.catalogue`` (the listing
``dpscale models`` prints without importing this module; ``tests/models/test_registry.py``
recomputes every count with ``jax.eval_shape``, ``tests/models/test_cli_models.py`` checks every
row against ``describe``):
tracing all models (JAX, then every model's shapes) is too slow for ``dpscale models``
(benchmarks/results/first_hour.md times ``dpscale models`` before and after it stopped importing JAX). Other class counts and
on-demand WRNs are traced when asked.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models import catalogue, cnn, cuts, efficientnet_lite, nf_resnet, nfnet, scattering, wrn


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything a stage needs to know about a named model before building it.

    ``build(num_classes=...)`` returns a module following the convention of
    :mod:`dpscale.models` (``features`` / ``classify`` methods, logits from ``__call__``).
    ``head_param_key`` is the top-level key of the classifier's parameters, so the
    last-layer-only path can pick them out of ``params``.
    """

    name: str
    build: Callable[..., nn.Module]
    num_classes: int
    input_shape: tuple[int, int, int]
    feature_dim: int
    pretrained: bool = False
    head_param_key: str = "head"
    description: str = ""
    #: True if ``features`` has no parameters (a fixed transform): ``featurize --backbone NAME``
    #: then needs no weights (``models.pretrained`` builds the backbone directory itself).
    parameter_free_backbone: bool = False
    #: Trainable parameters at the default ``num_classes`` and ``input_shape``; a constant so
    #: listing models needs no tracing (a test checks it against the code). None: traced on demand.
    params: int | None = None

    def __post_init__(self) -> None:
        if len(self.input_shape) != 3:
            raise InvalidConfigError(f"{self.name}: input_shape must be (height, width, channels)")


_WRN_NAME = re.compile(r"^wrn-(\d+)-(\d+)$")


def _wrn_spec(depth: int, width: int) -> ModelSpec:
    return ModelSpec(
        name=f"wrn-{depth}-{width}",
        build=functools.partial(wrn.wide_resnet, depth, width),
        num_classes=10,
        input_shape=(32, 32, 3),
        feature_dim=wrn.wrn_feature_dim(width),
        description=f"Wide-ResNet-{depth}-{width}, GroupNorm(16) + WS conv, 32x32 (De et al. 2022)",
    )


#: Parameter counts of the listed models (default classes and input); see ``ModelSpec.params``.
_PARAMS = {row["name"]: row["params"] for row in catalogue.MODELS}


def _wrn_specs() -> Iterable[ModelSpec]:
    for depth, width in ((16, 4), (40, 4), (28, 10)):
        yield dataclasses.replace(_wrn_spec(depth, width), params=_PARAMS[f"wrn-{depth}-{width}"])


def _nf_resnet_specs() -> Iterable[ModelSpec]:
    for depth in nf_resnet.NF_RESNET_DEPTHS:
        yield ModelSpec(
            name=f"nf-resnet-{depth}",
            build=functools.partial(nf_resnet.nf_resnet, depth),
            num_classes=1000,
            input_shape=(224, 224, 3),
            feature_dim=nf_resnet.NF_RESNET_FEATURE_DIM,
            description=f"Normalizer-Free ResNet-{depth} (Brock et al. 2021a)",
            params=_PARAMS[f"nf-resnet-{depth}"],
        )


def _nfnet_specs() -> Iterable[ModelSpec]:
    for variant, row in nfnet.NFNET_VARIANTS.items():
        yield ModelSpec(
            name=f"nfnet-{variant.lower()}",
            build=functools.partial(nfnet.nfnet, variant),
            num_classes=1000,
            input_shape=(row.train_size, row.train_size, 3),
            feature_dim=nfnet.NFNET_FEATURE_DIM,
            description=f"NFNet-{variant} (Brock et al. 2021b), train resolution {row.train_size}",
            params=_PARAMS[f"nfnet-{variant.lower()}"],
        )


def _cnn_specs() -> Iterable[ModelSpec]:
    yield ModelSpec(
        name="cnn-small",
        build=cnn.small_cnn,
        num_classes=10,
        input_shape=(28, 28, 1),
        feature_dim=cnn.DEFAULT_CHANNELS[-1],
        description="Small GroupNorm + WS CNN for 28x28 grayscale (Fashion-MNIST)",
        params=_PARAMS["cnn-small"],
    )
    yield ModelSpec(
        name="cnn-tanh",
        build=cnn.tanh_cnn,
        num_classes=10,
        input_shape=(28, 28, 1),
        feature_dim=32,
        description="Tramer & Boneh (2021)'s end-to-end DP CNN (tanh, no normalisation), 28x28 grayscale",
        params=_PARAMS["cnn-tanh"],
    )


def _scattering_specs() -> Iterable[ModelSpec]:
    scatter_maps = scattering.num_channels(2, 8)  # J=2, L=8: 81 maps of 7x7 per grey channel
    yield ModelSpec(
        name="scatternet-linear",
        build=scattering.scatter_linear,
        num_classes=10,
        input_shape=(28, 28, 1),
        feature_dim=scatter_maps * 7 * 7,
        description="Softmax regression on a fixed scattering transform, 28x28 grayscale (Tramer & Boneh 2021)",
        parameter_free_backbone=True,
        params=_PARAMS["scatternet-linear"],
    )
    yield ModelSpec(
        name="scatternet-linear-rgb",
        build=functools.partial(scattering.scatter_linear, input_channels=3),
        num_classes=10,
        input_shape=(32, 32, 3),
        feature_dim=3 * scatter_maps * 8 * 8,
        description="Softmax regression on a fixed scattering transform, 32x32 RGB (Tramer & Boneh 2021)",
        parameter_free_backbone=True,
        params=_PARAMS["scatternet-linear-rgb"],
    )
    yield ModelSpec(
        name="scatternet-cnn",
        build=scattering.scatter_cnn,
        num_classes=10,
        input_shape=(28, 28, 1),
        feature_dim=64,
        description="GroupNorm + WS CNN on a fixed scattering transform, 28x28 grayscale (Tramer & Boneh 2021)",
        params=_PARAMS["scatternet-cnn"],
    )
    for top, spec in cuts.SCATTER_TOPS.items():  # what export-backbone writes for a run of that top
        yield ModelSpec(
            name=cuts.SCATTER_TOP_MODELS[top],
            build=functools.partial(scattering.scatter_top_cnn, channels=spec.channels, activation=spec.activation),
            num_classes=10,
            input_shape=(28, 28, 1),
            feature_dim=spec.channels[-1] * 4 * 4,  # 7x7 maps, one 2x2 max-pool (SAME), flattened
            description=f"The {top!r} top above the scattering cut with the maps below it, 28x28 grayscale",
            params=_PARAMS[cuts.SCATTER_TOP_MODELS[top]],
        )


def _efficientnet_lite_specs() -> Iterable[ModelSpec]:
    for name, variant in efficientnet_lite.VARIANTS.items():
        yield ModelSpec(
            name=name,
            build=functools.partial(efficientnet_lite.efficientnet_lite, name),
            num_classes=1000,
            input_shape=(variant.resolution, variant.resolution, 3),
            feature_dim=efficientnet_lite.HEAD_CHANNELS,
            pretrained=True,  # dpscale import-weights NAME
            description=f"EfficientNet-Lite (no SE, ReLU6, frozen-statistics BatchNorm), {variant.resolution}px",
            params=_PARAMS[name],
        )


#: Every model family, in the order ``dpscale models`` lists them.
_FAMILIES: tuple[Callable[[], Iterable[ModelSpec]], ...] = (
    _wrn_specs,
    _nf_resnet_specs,
    _nfnet_specs,
    _cnn_specs,
    _scattering_specs,
    _efficientnet_lite_specs,
)


def _table(specs: Iterable[ModelSpec]) -> dict[str, ModelSpec]:
    """Name -> spec; two families claiming one name is a programming error, caught at import."""
    table: dict[str, ModelSpec] = {}
    for spec in specs:
        if spec.name in table:
            raise ValueError(f"model name {spec.name!r} is listed twice")
        table[spec.name] = spec
    return table


_REGISTRY: dict[str, ModelSpec] = _table(spec for family in _FAMILIES for spec in family())


def list_models() -> list[str]:
    """Every listed name, in the order of ``_FAMILIES``."""
    return list(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The spec for ``name``; any ``wrn-D-K`` with ``D = 6n + 4`` resolves on demand."""
    key = name.strip().lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    match = _WRN_NAME.match(key)
    if match:
        depth, width = int(match.group(1)), int(match.group(2))
        wrn.wide_resnet(depth, width)  # validates depth/width with a clear error
        return _wrn_spec(depth, width)
    raise InvalidConfigError(f"unknown model {name!r}; known models: {', '.join(_REGISTRY)}")


def get_model(name: str, *, num_classes: int | None = None) -> nn.Module:
    """Build the named model (its default number of classes unless ``num_classes`` is given)."""
    spec = get_spec(name)
    classes = spec.num_classes if num_classes is None else int(num_classes)
    if classes < 1:
        raise InvalidConfigError(f"num_classes must be >= 1, got {num_classes}")
    return spec.build(num_classes=classes)


def abstract_variables(
    name: str, *, num_classes: int | None = None, input_shape: tuple[int, int, int] | None = None
) -> dict:
    """Shapes and dtypes of the model's variables, via ``jax.eval_shape`` (nothing allocated)."""
    spec = get_spec(name)
    model = get_model(name, num_classes=num_classes)
    shape = (1, *(input_shape or spec.input_shape))
    return jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct(shape, jnp.float32))


def param_count(name: str, *, num_classes: int | None = None) -> int:
    """Number of trainable parameters (the ``params`` collection) of the named model.

    The spec's constant when it has one for these classes; traced otherwise.
    """
    spec = get_spec(name)
    if spec.params is not None and (num_classes is None or int(num_classes) == spec.num_classes):
        return spec.params
    return traced_param_count(spec.name, num_classes=num_classes)


@functools.cache
def traced_param_count(name: str, *, num_classes: int | None = None) -> int:
    """``param_count`` from the model code itself (``jax.eval_shape``: seconds for the big models)."""
    variables = abstract_variables(name, num_classes=num_classes)
    return int(sum(leaf.size for leaf in jax.tree.leaves(variables.get("params", {}))))


def describe(name: str) -> dict:
    """A JSON-ready summary of the named model, as ``dpscale models --json`` prints it."""
    spec = get_spec(name)
    return {
        "name": spec.name,
        "params": param_count(spec.name),
        "input_shape": list(spec.input_shape),
        "num_classes": spec.num_classes,
        "feature_dim": spec.feature_dim,
        "pretrained": spec.pretrained,
        "description": spec.description,
        **_cuts_and_tops(spec),
    }


def _cuts_and_tops(spec: ModelSpec) -> dict[str, list[str]]:
    model = spec.build(num_classes=spec.num_classes)
    return {"cuts": list(cuts.cut_names(model)), "tops": list(cuts.top_names(model))}
