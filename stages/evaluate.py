"""The evaluate stage: top-1 / top-5 accuracy of the last and the EMA parameters.

Evaluation reads only the run directory and the test split; it is
post-processing of the DP parameters and spends no privacy budget (the test
split is assumed public or separately budgeted, as in the literature).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.stages import run_files
from dpscale.stages.train_model import build_train_model

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
    from dpscale.stages.train import TrainConfig  # the run's own config rebuilds its model

    files = run_files.RunFiles.existing(config.run_dir)
    with open(files.path(run_files.CONFIG)) as f:
        saved = json.load(f)["config"]
    train_config = TrainConfig(**(saved | ({"data": config.data} if config.data else {})))
    model = build_train_model(train_config)
    trained = files.load_params()
    state = trained.get("model_state", {})
    inputs, labels = model.eval_inputs(config.split, state)  # transformed as in training (e.g. the saved mean)
    forward = jax.jit(model.logits_fn)

    def logits_of(params: Any) -> np.ndarray:
        out = [
            np.asarray(forward(params, state, jnp.asarray(inputs[start : start + config.batch_size])))
            for start in range(0, len(labels), config.batch_size)
        ]
        return np.concatenate(out)

    top1, top5 = _accuracies(logits_of(trained["params"]), labels)
    ema_top1, ema_top5 = _accuracies(logits_of(trained["ema_params"]), labels)
    result = EvaluateResult(config.split, len(labels), top1, top5, ema_top1, ema_top5)
    run_files.write_json_atomic(files.path(METRICS_FILE), result.as_dict())
    return result
