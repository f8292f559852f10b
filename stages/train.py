"""The train stage: DP-SGD on all layers of an image model, from a privacy target.

``run(TrainConfig) -> TrainResult``. The stage calibrates whichever of
{batch size, steps, noise multiplier} is missing *before* the first step (and
refuses to start a run that cannot meet the target), then loops:
Poisson-sample a batch of indices, read those examples, make K augmented views
on device, accumulate clipped sums over fixed-shape micro-batches, add noise
once and update. The run directory receives the resolved config, the privacy
ledger, per-step metrics (JSONL) and the final parameters.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import registry
from dpscale.models.validation import validate_dp_model
from dpscale.privacy import accounting
from dpscale.privacy.dpsgd import DpsgdConfig, DpsgdStep, data_mesh
from dpscale.privacy.sampling import PoissonSampler, ShuffledSampler
from dpscale.privacy.seeds import resolve_seed
from dpscale.stages import privacy_budget, run_files
from dpscale.stages.augment import augment_views
from dpscale.stages.dataset import IngestedDataset
from dpscale.stages.image_data import InMemorySplit, normalize

_log = logging.getLogger(__name__)
_AUGMENT_STREAM = 0xA06


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A DP training run. Give two of {batch_size, steps, noise_multiplier}; the third is calibrated."""

    data: str
    run_dir: str
    model: str = "cnn-small"
    epsilon: float = 8.0
    delta: float = 1e-5
    batch_size: int | None = None
    steps: int | None = None
    noise_multiplier: float | None = None
    accountant: Literal["pld", "rdp"] = "pld"
    sampling: Literal["poisson", "shuffle"] = "poisson"
    clip_norm: float = 1.0
    learning_rate: float = 2.0
    augmult: int = 1
    augment_pad: int = 4
    augment_flip: bool = True
    microbatch_size: int = 64
    ema_decay: float = 0.999
    seed: int | None = None
    train_split: str = "train"
    devices: int | None = None  # data-parallel devices; None = all local devices
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.augmult < 1:
            raise InvalidConfigError(f"augmult must be >= 1, got {self.augmult}")
        if self.microbatch_size < 1:
            raise InvalidConfigError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        if not self.learning_rate > 0:
            raise InvalidConfigError(f"learning_rate must be positive, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    run_dir: str
    epsilon: float
    delta: float
    noise_multiplier: float
    steps: int
    batch_size: int
    train_seconds: float
    final_metrics: dict[str, float]


def _loss_fn(model: Any):
    def loss(params: Any, model_state: Any, views: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params, **model_state}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    return loss


def _mesh(devices: int | None):
    available = jax.local_devices()
    count = len(available) if devices is None else devices
    if not 1 <= count <= len(available):
        raise InvalidConfigError(f"devices must be in [1, {len(available)}], got {devices}")
    return data_mesh(available[:count])


def run(config: TrainConfig) -> TrainResult:
    dataset = IngestedDataset(config.data)
    if config.train_split not in dataset.splits:
        raise DataError(f"{config.data!r} has no split {config.train_split!r} (has {dataset.splits})")
    train = InMemorySplit.load(dataset, config.train_split)
    num_examples = len(train)

    budget = privacy_budget.run_calibrate(
        privacy_budget.CalibrateConfig(
            epsilon=config.epsilon,
            delta=config.delta,
            num_examples=num_examples,
            batch_size=config.batch_size,
            steps=config.steps,
            noise_multiplier=config.noise_multiplier,
            accountant=config.accountant,
        )
    )
    spec = accounting.DpsgdPrivacySpec.from_batch_size(
        noise_multiplier=budget.noise_multiplier,
        batch_size=budget.batch_size,
        num_examples=num_examples,
        steps=budget.steps,
        sampling=config.sampling,
    )

    mesh = _mesh(config.devices)
    microbatch = config.microbatch_size
    if microbatch % mesh.size:
        raise InvalidConfigError(
            f"microbatch_size {microbatch} must be divisible by the {mesh.size} devices"
        )
    seed = resolve_seed(config.seed)
    num_classes = len(dataset.class_names)
    model = registry.get_model(config.model, num_classes=num_classes)
    sample_input = jnp.zeros((1, *train.image_shape), jnp.float32)
    # One compiled init instead of hundreds of op-by-op compilations.
    variables = jax.jit(model.init)(jax.random.key(seed % 2**32), sample_input)
    validate_dp_model(model, train.image_shape, variables=variables)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}

    sampler_cls = PoissonSampler if config.sampling == "poisson" else ShuffledSampler
    size_kw = "expected_batch_size" if config.sampling == "poisson" else "batch_size"
    sampler = sampler_cls(
        num_examples=num_examples, microbatch_size=microbatch, seed=seed, **{size_kw: budget.batch_size}
    )
    dp_step = DpsgdStep(
        _loss_fn(model),
        DpsgdConfig(
            noise_multiplier=budget.noise_multiplier,
            expected_batch_size=budget.batch_size,
            clip_norm=config.clip_norm,
            ema_decay=config.ema_decay,
        ),
        noise_seed=seed,
        learning_rate=config.learning_rate,
        mesh=mesh,
    )
    state = dp_step.init(params, model_state)
    files = run_files.RunFiles.create(config.run_dir)
    files.write_config(dataclasses.asdict(config) | {"resolved": dataclasses.asdict(budget)})
    curve = accounting.EpsilonCurve(
        noise_multiplier=spec.noise_multiplier,
        sampling_rate=spec.sampling_rate,
        delta=config.delta,
        accountant=config.accountant,
    )
    augment_key = jax.random.key(_AUGMENT_STREAM)
    augment_key = jax.random.fold_in(augment_key, seed % 2**31)

    started = time.perf_counter()
    metrics: dict[str, float] = {}
    with run_files.progress(total=budget.steps, enabled=config.show_progress) as bar:
        for step in range(budget.steps):
            batch = sampler.sample(step)
            step_key = jax.random.fold_in(augment_key, step)
            micro_inputs = []
            for m in range(batch.num_microbatches):
                images, labels = train.take(batch.indices[m])
                views = augment_views(
                    jax.random.fold_in(step_key, m),
                    normalize(images),
                    views=config.augmult,
                    pad=config.augment_pad,
                    flip=config.augment_flip,
                )
                labels = jnp.repeat(jnp.asarray(labels)[:, None], config.augmult, axis=1)
                micro_inputs.append(({"image": views, "label": labels}, jnp.asarray(batch.mask[m])))
            state, step_metrics = dp_step.update(state, micro_inputs)
            spent = curve(step + 1) if _log_epsilon_at(step + 1, budget.steps) else None
            metrics = {k: float(v) for k, v in step_metrics.items()} | {"step": step + 1}
            if spent is not None:
                metrics["epsilon_spent"] = spent
            files.append_metrics(metrics)
            bar.advance(epsilon=metrics.get("epsilon_spent"), loss=metrics["loss"])
    seconds = time.perf_counter() - started

    final_epsilon = curve(budget.steps)
    files.write_ledger(
        accounting_spec=spec,
        delta=config.delta,
        accountant=config.accountant,
        epsilon_spent=final_epsilon,
        steps_done=budget.steps,
        data_hash=dataset.content_hash,
    )
    files.save_params(params=state.params, ema_params=state.ema_params, model_state=state.model_state)
    return TrainResult(
        run_dir=config.run_dir,
        epsilon=final_epsilon,
        delta=config.delta,
        noise_multiplier=budget.noise_multiplier,
        steps=budget.steps,
        batch_size=budget.batch_size,
        train_seconds=seconds,
        final_metrics=metrics,
    )


def _log_epsilon_at(step: int, total: int) -> bool:
    """Epsilon is computed on ~20 evenly spaced steps and the last (PLD is not free)."""
    return step == total or step % max(1, math.ceil(total / 20)) == 0
