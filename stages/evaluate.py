"""The evaluate stage: top-1 / top-5 accuracy of the last and the EMA parameters.

Evaluation reads only the run directory and the test split; it is
post-processing of the DP parameters and spends no privacy budget (the test
split is assumed public or separately budgeted, as in the literature).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.errors import DataError
from dpscale.models import registry
from dpscale.stages import run_files
from dpscale.stages.dataset import IngestedDataset
from dpscale.stages.image_data import InMemorySplit, normalize

METRICS_FILE = "metrics.json"


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    run_dir: str
    split: str = "test"
    batch_size: int = 256
    data: str | None = None  # defaults to the data the run trained on


@dataclasses.dataclass(frozen=True)
class EvaluateResult:
    split: str
    num_examples: int
    top1: float
    top5: float
    ema_top1: float
    ema_top5: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _accuracies(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    k = min(5, logits.shape[1])
    top_k = np.argsort(-logits, axis=1)[:, :k]
    top1 = float(np.mean(top_k[:, 0] == labels))
    top5 = float(np.mean(np.any(top_k == labels[:, None], axis=1)))
    return top1, top5


def run(config: EvaluateConfig) -> EvaluateResult:
    files = run_files.RunFiles(os.path.abspath(config.run_dir))
    try:
        with open(files.path(run_files.CONFIG)) as f:
            train_config = json.load(f)
    except OSError as exc:
        raise DataError(f"{config.run_dir!r} is not a run directory (no {run_files.CONFIG})") from exc
    dataset = IngestedDataset(config.data or train_config["data"])
    if config.split not in dataset.splits:
        raise DataError(f"the data has no split {config.split!r} (has {dataset.splits})")
    split = InMemorySplit.load(dataset, config.split)
    saved = files.load_params()
    model = registry.get_model(train_config["model"], num_classes=len(dataset.class_names))
    forward = jax.jit(lambda variables, x: model.apply(variables, x))

    def logits_of(params: Any) -> np.ndarray:
        variables = {"params": params, **saved.get("model_state", {})}
        out = []
        for start in range(0, len(split), config.batch_size):
            idx = np.arange(start, min(len(split), start + config.batch_size))
            images, _ = split.take(idx)
            out.append(np.asarray(forward(variables, jnp.asarray(normalize(images)))))
        return np.concatenate(out)

    labels = split.take(np.arange(len(split)))[1]
    top1, top5 = _accuracies(logits_of(saved["params"]), labels)
    ema_top1, ema_top5 = _accuracies(logits_of(saved["ema_params"]), labels)
    result = EvaluateResult(config.split, len(split), top1, top5, ema_top1, ema_top5)
    run_files.write_json_atomic(files.path(METRICS_FILE), result.as_dict())
    return result
