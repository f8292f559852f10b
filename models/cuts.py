"""A backbone split at a named cut: the frozen part below it, cached once; the top above it, trained.

Training only the top of a pretrained network (or a small CNN on a fixed scattering
transform) under DP needs the frozen part's forward pass once per image, not once per step:
``dpscale featurize --cut NAME`` stores the activations at the cut in the feature cache and
``dpscale train`` trains a top on them with the per-layer clipping of images mode.

Cuts and tops, by backbone:

* EfficientNet-Lite0/1/2: ``blocks_<i>``, the output of MBConv block ``i`` (0-based). Top
  ``pretrained``: the blocks after ``i`` and the head, initialised from the backbone's own
  weights (BatchNorm frozen at its ImageNet statistics, which come from public data), with a
  zero classifier as in De et al. (2022).
* ``scatternet-linear`` / ``scatternet-cnn``: ``scattering``, the per-example normalised
  scattering maps (no parameters). Tops ``cnn``, ``cnn-wide`` and ``cnn-tanh``: GroupNorm + WS-conv
  CNNs from random initialisation (Tramer & Boneh 2021's ScatterNet+CNN; theirs uses tanh).

A trained top joined to the frozen part below its cut (``join``) is one network from images
again, which ``export-backbone`` writes as a backbone: a Lite top's is the backbone's own model
(its weights below the cut, the top's above it); a scattering top's is the model registered as
``scatternet-top-<top>`` (``SCATTER_TOP_MODELS``), the maps and then the top.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import efficientnet_lite, scattering
from dpscale.models.classifier import Classifier, ImageClassifier

PyTree = Any
SCATTERING = "scattering"
PRETRAINED_TOP = "pretrained"
_BLOCK = "blocks_"


@dataclasses.dataclass(frozen=True)
class ScatterTop:
    """A CNN top on scattering maps: its WS-conv channels (GroupNorm of 16 groups after each) and activation."""

    channels: tuple[int, ...]
    activation: str = "relu"


#: The CNN tops on scattering maps, the default first.
SCATTER_TOPS = {
    "cnn": ScatterTop((64, 64)),
    "cnn-wide": ScatterTop((128, 128)),
    "cnn-tanh": ScatterTop((64, 64), "tanh"),
}
#: The registered model each scattering top makes with the maps below it (``scattering.ScatterCNNBackbone``, flattened).
SCATTER_TOP_MODELS = {top: f"scatternet-top-{top}" for top in SCATTER_TOPS}


@dataclasses.dataclass(frozen=True)
class TopModel:
    """What is trained above a cut: the module, its initial parameters, its frozen state."""

    model: ImageClassifier
    init_params: Callable[[int], PyTree]  # the INIT stream's key -> parameters
    model_state: PyTree  # non-trainable collections (frozen BatchNorm statistics), else {}


def _backbone(model: Any) -> Any:
    return model.backbone if isinstance(model, ImageClassifier) else model


_SCATTER_BACKBONES = (scattering.ScatterLinearBackbone, scattering.ScatterCNNBackbone)


def _is_lite(model: Any) -> bool:
    return isinstance(_backbone(model), efficientnet_lite.EfficientNetLiteBackbone)


def _is_scattering(model: Any) -> bool:
    return isinstance(_backbone(model), _SCATTER_BACKBONES)


def _num_blocks(model: Any) -> int:
    backbone = _backbone(model)
    return len(efficientnet_lite.block_specs(backbone.width, backbone.depth))


def cut_names(model: Any) -> tuple[str, ...]:
    """The cuts of a built model (``registry.get_model``), shallowest first; () if it has none."""
    if _is_lite(model):
        return tuple(f"{_BLOCK}{i}" for i in range(_num_blocks(model)))
    if _is_scattering(model):
        return (SCATTERING,)
    return ()


def top_names(model: Any) -> tuple[str, ...]:
    """The tops that can be trained above this model's cuts, the default first."""
    if _is_lite(model):
        return (PRETRAINED_TOP,)
    if _is_scattering(model):
        return tuple(SCATTER_TOPS)
    return ()


def check_cut(model: Any, name: str, cut: str) -> None:
    """``InvalidConfigError`` naming the cuts there are, when ``cut`` is not one of ``model``'s."""
    cuts = cut_names(model)
    if cut not in cuts:
        have = f"its cuts: {', '.join(cuts)}" if cuts else "it has no cuts"
        raise InvalidConfigError(f"{name!r} has no cut {cut!r} ({have})")


def activations_fn(model: Any, cut: str, variables: PyTree) -> Callable[[jax.Array], jax.Array]:
    """Preprocessed images ``(B, H, W, C)`` -> the activations at ``cut`` ``(B, h, w, c)``."""
    backbone = _backbone(model)
    if _is_scattering(model):
        maps = scattering.ScatterMaps(J=backbone.J, L=backbone.L, num_groups=_scatter_groups(backbone))
        return lambda x: maps.apply({}, x)
    index = _block_index(model, cut)
    below = backbone.clone(stop_after=index)
    frozen = {name: collection["backbone"] for name, collection in variables.items() if "backbone" in collection}
    return lambda x: below.apply(frozen, x)


def _scatter_groups(backbone: Any) -> int:
    if isinstance(backbone, scattering.ScatterCNNBackbone):
        return backbone.scatter_groups
    return backbone.num_groups


def _block_index(model: Any, cut: str) -> int:
    if not cut.startswith(_BLOCK) or not cut[len(_BLOCK) :].isdigit():
        raise InvalidConfigError(f"unknown cut {cut!r}")
    index = int(cut[len(_BLOCK) :])
    if index >= _num_blocks(model):
        raise InvalidConfigError(f"unknown cut {cut!r}: the backbone has {_num_blocks(model)} blocks")
    return index


def build_top(
    model: Any,
    cut: str,
    top: str,
    *,
    variables: PyTree,
    num_classes: int,
    activation_shape: tuple[int, int, int],
) -> TopModel:
    """The top ``top`` above ``cut`` of ``model`` (built by the registry, weights in ``variables``)."""
    if top not in top_names(model):
        raise InvalidConfigError(f"no top {top!r} above cut {cut!r} (tops: {', '.join(top_names(model))})")
    sample = jnp.zeros((1, *activation_shape), jnp.float32)
    if _is_scattering(model):
        spec = SCATTER_TOPS[top]
        module = ImageClassifier(
            backbone=scattering.ScatterCNNTop(channels=spec.channels, activation=spec.activation),
            head=Classifier(num_classes),
        )
        init = jax.jit(module.init)
        return TopModel(module, lambda key: init(key, sample)["params"], {})
    backbone = _backbone(model)
    module = ImageClassifier(
        backbone=efficientnet_lite.EfficientNetLiteTop(
            width=backbone.width, depth=backbone.depth, cut=_block_index(model, cut), dtype=backbone.dtype
        ),
        head=Classifier(num_classes),
    )
    abstract = jax.eval_shape(module.init, jax.random.key(0), sample)
    chosen = {name: _taken(abstract[name]["backbone"], variables[name]["backbone"], name) for name in abstract}
    head = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract["params"]["head"])
    params = {"backbone": chosen.pop("params"), "head": head}
    state = {name: {"backbone": tree} for name, tree in chosen.items()}
    return TopModel(module, lambda key: params, state)


def _taken(wanted: PyTree, have: PyTree, collection: str) -> PyTree:
    """The backbone's variables by the top's names; a missing name or other shape is a broken backbone."""
    out = {}
    for name, sub in wanted.items():
        if name not in have:
            raise DataError(f"the backbone's {collection} have no {name!r}: not the model its metadata names")
        if isinstance(sub, dict):
            out[name] = _taken(sub, have[name], collection)
        elif tuple(sub.shape) != tuple(have[name].shape):
            raise DataError(f"the backbone's {collection} {name!r} have shape {have[name].shape}, expected {sub.shape}")
        else:
            out[name] = jnp.asarray(have[name], sub.dtype)
    return out


def joined_model_name(name: str, model: Any, top: str) -> str:
    """The registered model that a ``top`` above a cut of ``model`` (registered as ``name``) makes with
    the frozen part below the cut: one network from images."""
    return SCATTER_TOP_MODELS[top] if _is_scattering(model) else name


def join(
    model: Any, cut: str, top: TopModel, *, whole: Any, variables: PyTree, params: PyTree, state: PyTree
) -> PyTree:
    """The variables of ``whole`` (``joined_model_name``'s model): the backbone's own ``variables`` below
    ``cut``, the trained top's ``params`` above it.

    ``params`` must have the top's exact names and shapes, and ``state`` (the frozen BatchNorm
    statistics the top trained with) must be the backbone's own, value for value: anything else is not
    a top trained above this cut of this backbone (``DataError``).
    """
    expected = jax.tree.map(
        lambda a: (tuple(a.shape), str(a.dtype)), jax.eval_shape(top.init_params, jax.random.key(0))
    )
    found = jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params)
    if expected != found:
        raise DataError(f"the run's parameters are not those of a top above {cut!r} ({_difference(expected, found)})")
    if not _same_values(state, top.model_state):
        raise DataError(f"the run's frozen statistics above {cut!r} are not the backbone's own")
    if _is_scattering(model):
        below, joined = _backbone(model), _backbone(whole)
        stages = top.model.backbone
        same = (
            isinstance(joined, scattering.ScatterCNNBackbone)
            and joined.flatten
            and (
                (joined.J, joined.L, joined.scatter_groups, joined.channels, joined.num_groups, joined.activation)
                == (below.J, below.L, _scatter_groups(below), stages.channels, stages.num_groups, stages.activation)
            )
        )
        if not same:
            raise DataError("the joined model is not the scattering the activations were cut with, then this top")
        return {"params": params}
    below, joined = _backbone(model), _backbone(whole)
    lite = isinstance(joined, efficientnet_lite.EfficientNetLiteBackbone)
    if not lite or (joined.width, joined.depth) != (below.width, below.depth):
        raise DataError("the joined model is not the backbone the activations were cut from")
    backbone = dict(variables["params"]["backbone"])
    backbone.update(params["backbone"])  # the top's names are a subset: checked against the top above
    return {**variables, "params": {**variables["params"], "backbone": backbone, "head": params["head"]}}


def _difference(expected: PyTree, found: PyTree) -> str:
    """The first path where two trees of (shape, dtype) differ, in words."""

    def leaves(tree: PyTree) -> dict[str, tuple]:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
        return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}

    want, have = leaves(expected), leaves(found)
    for path in sorted(set(want) | set(have)):
        if path not in have:
            return f"{path} is missing"
        if path not in want:
            return f"{path} is not the top's"
        if want[path] != have[path]:
            return f"{path} is {have[path][0]} {have[path][1]}, expected {want[path][0]} {want[path][1]}"
    return "other structure"


def _same_values(a: PyTree, b: PyTree) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        x.shape == y.shape and bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
