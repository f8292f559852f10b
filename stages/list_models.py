"""The models command: the model zoo with parameter counts, input shapes and available weights.

It reads the zoo's listing (``models.catalogue``), not the registry, which would import every model
family with Flax and JAX to print a table.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from dpscale.models import catalogue


@dataclasses.dataclass(frozen=True)
class ListModelsConfig:
    pass


@dataclasses.dataclass(frozen=True)
class ListModelsResult:
    models: tuple[dict[str, Any], ...]  # name, params (default classes and input), input_shape, pretrained


def run(config: ListModelsConfig = ListModelsConfig()) -> ListModelsResult:
    return ListModelsResult(copy.deepcopy(catalogue.MODELS))
