"""Scoring a run: top-1 / top-5 accuracy of its last and its EMA parameters on one split.

Evaluation reads only the run directory and the split it scores. On a split outside the
private training data (test, validation) it is post-processing of the DP parameters and
spends no privacy budget (such splits are assumed public or separately budgeted, as in the
literature). On the run's own training split or its held-out rows it is not: the scores are
exact statistics of private rows, a private diagnostic (``training.release``), computed only
when asked for and written to a 0600 file whose name says so. It rebuilds the run's model from
the run's own configuration, so inputs are transformed exactly as in training (e.g. with the
saved DP feature mean).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.errors import DataError, InvalidConfigError
from dpscale.training import release
from dpscale.training.model import HOLDOUT_SPLIT, build_train_model
from dpscale.training.run_directory import RunDirectory


@dataclasses.dataclass(frozen=True)
class Scores:
    split: str
    num_examples: int
    top1: float
    top5: float
    ema_top1: float
    ema_top5: float
    covered_by_epsilon: bool = True  # False: scores on private training rows (a private diagnostic)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def accuracies(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(top-1, top-5) of ``logits`` [n, classes] against integer ``labels`` [n]."""
    k = min(5, logits.shape[1])
    top_k = np.argsort(-logits, axis=1)[:, :k]
    top1 = float(np.mean(top_k[:, 0] == labels))
    top5 = float(np.mean(np.any(top_k == labels[:, None], axis=1)))
    return top1, top5


def _differences(trained: dict[str, Any], given: dict[str, Any]) -> set[str]:
    """The names of the parts (nested one level, e.g. ``feature_key.resolution``) that differ."""
    out = set()
    for name in set(trained) | set(given):
        a, b = trained.get(name), given.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out |= {f"{name}.{k}" for k in set(a) | set(b) if a.get(k) != b.get(k)}
        elif a != b:
            out.add(name)
    return out


def score_run(run_dir: str, *, split: str = "test", data: str | None = None, batch_size: int = 256,
              private_diagnostics: bool = False) -> tuple[Scores, str]:
    """Score the run in ``run_dir`` on ``split`` of its data (or of ``data``); save the scores in the run.

    Returns the scores and the file they were saved to. Scoring the run's private training
    rows needs ``private_diagnostics``.
    """
    run = RunDirectory.existing(run_dir)
    spec = run.read_spec()
    diagnostic = spec.plan.private and split in (spec.training.train_split, HOLDOUT_SPLIT)
    if diagnostic and not private_diagnostics:
        raise InvalidConfigError(
            f"split {split!r} is the run's private training data: its scores are exact statistics that "
            "epsilon does not cover; pass --private-diagnostics to compute them anyway (kept to a 0600 file)")
    model = build_train_model(spec.data_path(data), spec.training)
    if data is not None and spec.inputs and model.inputs != spec.inputs:
        differ = sorted(_differences(spec.inputs, model.inputs))
        raise DataError(f"{data!r} is not made like the data the run trained on ({', '.join(differ)} differ: other "
                        "backbone or preprocessing); featurize it with the run's backbone and preprocessing")
    trained = run.load_params()
    state = trained.get("model_state", {})
    inputs, labels = model.eval_inputs(split, state)  # transformed as in training (e.g. the saved mean)
    forward = jax.jit(model.logits_fn)

    def logits_of(params: Any) -> np.ndarray:
        out = [np.asarray(forward(params, state, jnp.asarray(inputs[start:start + batch_size])))
               for start in range(0, len(labels), batch_size)]
        return np.concatenate(out)

    top1, top5 = accuracies(logits_of(trained["params"]), labels)
    ema_top1, ema_top5 = accuracies(logits_of(trained["ema_params"]), labels)
    scores = Scores(split, len(labels), top1, top5, ema_top1, ema_top5, covered_by_epsilon=not diagnostic)
    return scores, run.write_scores(scores.as_dict(), diagnostic=diagnostic)
