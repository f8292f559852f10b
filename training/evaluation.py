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
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.data import shards
from dpscale.errors import DataError, InvalidConfigError, storage_faults
from dpscale.training.config import CACHE_MODES
from dpscale.training.data_kind import check_kind_for_run
from dpscale.training.model import HOLDOUT_SPLIT, build_train_model
from dpscale.training.run_directory import RunDirectory, RunSpec


@dataclasses.dataclass(frozen=True)
class Scores:
    split: str
    num_examples: int
    top1: float
    top5: float
    ema_top1: float
    ema_top5: float
    covered_by_epsilon: bool = True  # False: scores on private training rows (a private diagnostic)
    data: str = ""  # the data scored (absolute path): a score is never shown without its inputs
    other_data: bool = False  # True: not the data the run trained on (a separate file, never metrics.json)
    epsilon: float = math.inf  # the run's guarantee, restated beside its scores (inf: non-private)
    delta: float = 0.0
    simulated: bool = False  # a TAN simulation (sweep --simulate-batch): DP at its own epsilon, not its target's
    # What the run's ledger says its epsilon does not cover (e.g. a private selection's choice of it).
    not_covered: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        payload = dataclasses.asdict(self)
        payload["epsilon"] = self.epsilon if math.isfinite(self.epsilon) else "inf"  # strict JSON
        payload["not_covered"] = list(self.not_covered)
        if not self.not_covered:
            del payload["not_covered"]
        if self.split == "test" and not self.other_data:
            # The headline figure under the name quickstart gives it: the EMA parameters' top-1 on the
            # run's own test split (the recipe scores the EMA, not the last iterate).
            payload["test_accuracy"] = self.ema_top1
        return payload


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


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.realpath(path)


def _stored_inputs(spec: RunSpec) -> dict[str, Any]:
    """What the run's inputs are made of: as recorded, or for an images run of an older dpscale (which
    recorded nothing) the classes and image shape of its own data, while that data is still there."""
    if spec.inputs or spec.training.mode != "images":
        return dict(spec.inputs)
    try:
        manifest = shards.read_manifest(spec.data)
    except DataError:
        return {}
    return {"class_names": list(manifest.class_names), "image_shape": list(manifest.image_shape or ())}


def _brief(value: Any) -> str:
    """A list cut to its first items, so that 100 class names still fit in one line."""
    if isinstance(value, list) and len(value) > 6:
        return f"[{', '.join(map(repr, value[:5]))}, ... ({len(value)} in all)]"
    return str(value)


def _check_made_alike(
    data: str, trained: dict[str, Any], given: dict[str, Any], *, images: bool = False, backbone: str | None = None
) -> None:
    """Refuse ``data`` whose inputs differ from the run's in anything the run recorded."""
    shared = set(trained) & set(given)  # an older run recorded less
    differ = sorted(_differences({k: trained[k] for k in shared}, {k: given[k] for k in shared}))
    if not differ:
        return
    if {"class_names", "image_shape"} & set(differ):
        shown = "; ".join(
            f"{name} {_brief(given.get(name))} instead of {_brief(trained.get(name))}"
            for name in ("class_names", "image_shape")
            if name in differ
        )
        raise DataError(
            f"{data!r} is not made like the data the run trained on ({shown}); evaluate the run "
            "on data of its own classes and image shape"
        )
    if images and backbone:  # the preprocessing and frozen statistics come from the run's backbone
        raise DataError(
            f"the run's backbone {backbone!r} is not the one it trained with ({', '.join(differ)} "
            "differ): restore that backbone directory to evaluate the run"
        )
    if images:
        raise DataError(
            f"the run was trained with another preprocessing than this dpscale's ({', '.join(differ)} "
            "differ): evaluate it with the dpscale version that trained it"
        )
    raise DataError(
        f"{data!r} is not made like the data the run trained on ({', '.join(differ)} differ: other "
        "backbone or preprocessing); featurize it with the run's backbone and preprocessing"
    )


def _made_like(mode: str, trained: dict[str, Any]) -> str:
    """What data a run of ``mode`` is scored on, and how it is made (its recorded backbone and cut)."""
    key = trained.get("feature_key") or {}
    backbone = key.get("model", "BACKBONE")
    if mode == "activations":
        cut = key.get("cut", "CUT")
        return f"activations at its cut (`dpscale featurize DATA --backbone {backbone} --cut {cut}`)"
    if mode == "features":
        return f"pooled features of its backbone (`dpscale featurize DATA --backbone {backbone}`)"
    return "ingested images of its classes"


def _identity(data: str, mode: str) -> str:
    """What tells two data sets apart without reading them: the content hash of an ingested dataset's
    manifest, the digest of a feature entry (its backbone, preprocessing and keyed data identity)."""
    if mode in CACHE_MODES:
        from dpscale.cache.feature_store import open_features

        return open_features(data).digest
    return shards.read_manifest(data).content_hash


def _is_runs_data(spec: RunSpec, data: str) -> bool:
    """Whether ``data`` is the data the run trained on: the same path, or the same content (a copy)."""
    if _absolute(data) == _absolute(spec.data):
        return True
    if "://" not in spec.data and not os.path.exists(spec.data):
        return False  # the run's data is gone: nothing to compare with, so it counts as other data
    try:
        return _identity(data, spec.training.mode) == _identity(spec.data, spec.training.mode)
    except DataError:
        return False


def other_data_name(data: str) -> str:
    """The name scores on ``data`` get in the run directory: its directory name, safe as a file name."""
    name = os.path.basename(data.rstrip("/")) or "data"
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:64]


def score_run(
    run_dir: str,
    *,
    split: str = "test",
    data: str | None = None,
    batch_size: int = 256,
    private_diagnostics: bool = False,
    force_other_data: bool = False,
    save: bool = True,
) -> tuple[Scores, str]:
    """Score the run in ``run_dir`` on ``split`` of its data (or of ``data``); save the scores in the run.

    Returns the scores and the file they were saved to (``""`` with ``save`` False: nothing is
    written, e.g. for a sweep's choice, which must leave no trace in the runs it chose). Scoring the run's private training
    rows needs ``private_diagnostics``. ``data`` must be made like the run's data (classes, image
    shape, preprocessing, backbone); if it is not the run's own data, the scores are saved only
    with ``force_other_data``, to ``metrics.other-data.<name>.json``: ``metrics.json`` holds
    scores on the run's own data and nothing else.
    """
    run = RunDirectory.existing(run_dir)
    spec = run.read_spec()
    diagnostic = spec.plan.private and split in (spec.training.train_split, HOLDOUT_SPLIT)
    if diagnostic and not private_diagnostics:
        raise InvalidConfigError(
            f"split {split!r} is the run's private training data: its scores are exact statistics that "
            "epsilon does not cover; pass --private-diagnostics to compute them anyway (kept to a 0600 file)"
        )
    path = spec.data_path(data)
    trained = _stored_inputs(spec)
    check_kind_for_run(path, spec.training.mode, made_with=_made_like(spec.training.mode, trained))
    if spec.training.mode == "images":  # before building a model for images it cannot take
        manifest = shards.read_manifest(path)
        _check_made_alike(
            path, trained, {"class_names": list(manifest.class_names), "image_shape": list(manifest.image_shape or ())}
        )
    other = data is not None and not _is_runs_data(spec, data)
    name = other_data_name(path) if other else None
    model = build_train_model(path, spec.training)
    _check_made_alike(
        path, trained, model.inputs, images=spec.training.mode == "images", backbone=spec.training.images.backbone
    )
    if other and not force_other_data:  # data not made alike is refused above, even when forced
        raise DataError(
            f"{data!r} is not the data the run trained on ({spec.data!r}), so its scores are not the "
            f"run's scores; pass --force-other-data to score it anyway (saved to "
            f"{run.scores_file(split, diagnostic=diagnostic, other_data=name)}, metrics.json kept)"
        )
    trained_params = run.load_params()
    state = trained_params.get("model_state", {})
    inputs, labels = model.eval_inputs(split, state)  # transformed as in training (e.g. the saved mean)
    forward = jax.jit(model.logits_fn)

    def logits_of(params: Any) -> np.ndarray:
        out = [
            np.asarray(forward(params, state, jnp.asarray(inputs[start : start + batch_size])))
            for start in range(0, len(labels), batch_size)
        ]
        return np.concatenate(out)

    top1, top5 = accuracies(logits_of(trained_params["params"]), labels)
    ema_top1, ema_top5 = accuracies(logits_of(trained_params["ema_params"]), labels)
    ledger = run.read_ledger()
    scores = Scores(
        split,
        len(labels),
        top1,
        top5,
        ema_top1,
        ema_top5,
        covered_by_epsilon=not diagnostic,
        data=_absolute(path),
        other_data=other,
        epsilon=ledger.epsilon_spent,
        delta=ledger.delta,
        simulated=run.simulated,
        not_covered=ledger.not_covered,
    )
    if not save:
        return scores, ""
    with storage_faults(
        stopped="the scores were not saved", then="evaluate the run again (or a copy of it in a writable directory)"
    ):
        return scores, run.write_scores(scores.as_dict(), diagnostic=diagnostic, other_data=name)
