"""The models command: the model zoo with parameter counts, input shapes and available weights."""

from __future__ import annotations

import dataclasses
from typing import Any

from dpscale.models import registry


@dataclasses.dataclass(frozen=True)
class ListModelsConfig:
    pass


@dataclasses.dataclass(frozen=True)
class ListModelsResult:
    models: tuple[dict[str, Any], ...]  # name, params (default classes and input), input_shape, pretrained


def run(config: ListModelsConfig = ListModelsConfig()) -> ListModelsResult:
    return ListModelsResult(tuple(registry.describe(name) for name in registry.list_models()))
