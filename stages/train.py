"""The train stage: DP-SGD from a privacy target, on images (all layers) or cached features.

``run(TrainConfig)`` calibrates whichever of {batch size, steps, noise multiplier}
is missing *before* the first step (refusing a run that cannot meet the target),
then loops: Poisson-sample the batch of step t, feed it as fixed-shape
micro-batches, accumulate clipped sums, add noise once and update. ``resume(run_dir)``
continues a killed run from its last checkpoint with the same secret seed, so the
noise and batches of every step are those of the original plan (see
``stages.checkpointing``) and the final epsilon is exactly the planned one.

Modes: ``images`` trains every layer of a registry model with augmentation
multiplicity; ``features`` trains a zero-initialised softmax classifier on cached
backbone features with closed-form per-example norms (batches up to 2^18 and
more through accumulation), optionally normalised (``feature_normalization``;
``center-l2`` releases a DP mean whose cost the plan composes with training's) and
with ``holdout`` rows kept for validation. ``epsilon=inf`` is the non-private
baseline: no clipping, no noise, momentum and weight decay allowed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Literal

import jax
import optax

from dpscale import distributed
from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy import accounting
from dpscale.privacy.clipping import make_unclipped_sum_fn
from dpscale.privacy.dpsgd import DpsgdConfig, DpsgdStep, TrainState
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.sampling import PoissonSampler, ShuffledSampler
from dpscale.privacy.seeds import resolve_seed
from dpscale.stages import checkpointing, privacy_budget, run_files
from dpscale.stages.train_model import TrainModel, build_train_model

_log = logging.getLogger(__name__)
_AUGMENT_STREAM = 0xA06


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. Give two of {batch_size, steps, noise_multiplier}; the third is calibrated."""

    data: str  # an ingested dataset (images) or a feature-cache entry (features)
    run_dir: str
    mode: Literal["images", "features"] = "images"
    model: str = "cnn-small"  # images mode: a registry name, trained from scratch
    backbone: str | None = None  # images mode: fine-tune this pretrained backbone instead
    epsilon: float = 8.0  # math.inf: non-private baseline
    delta: float = 1e-5
    batch_size: int | None = None
    steps: int | None = None
    noise_multiplier: float | None = None
    accountant: Literal["pld", "rdp"] = "pld"
    sampling: Literal["poisson", "shuffle"] = "poisson"
    clip_norm: float = 1.0
    learning_rate: float = 2.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    augmult: int = 1
    augment_pad: int = 4
    augment_flip: bool = True
    microbatch_size: int = 64
    ema_decay: float = 0.999
    seed: int | None = None
    train_split: str = "train"
    holdout: int = 0  # features mode: the last N training rows are not trained on (evaluate split "holdout")
    feature_normalization: str = "none"  # features mode: "none", "l2" or "center-l2"
    feature_mean_noise_multiplier: float = 20.0  # center-l2 under DP: Gaussian noise on the sum of unit rows
    feature_scale: float = 1.0  # l2 / center-l2: the norm of the normalised rows
    devices: int | None = None  # data-parallel devices; None = all local (all global with several processes)
    checkpoint_every: int | None = None  # steps; None = about 20 checkpoints per run
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("images", "features"):
            raise InvalidConfigError(f"mode must be 'images' or 'features', got {self.mode!r}")
        if self.augmult < 1:
            raise InvalidConfigError(f"augmult must be >= 1, got {self.augmult}")
        if self.microbatch_size < 1:
            raise InvalidConfigError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        if not self.learning_rate > 0:
            raise InvalidConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        if not self.epsilon > 0:
            raise InvalidConfigError(f"epsilon must be positive (inf for non-private), got {self.epsilon}")
        if self.private and (self.momentum or self.weight_decay):
            _log.warning("momentum/weight decay under DP: allowed (post-processing), but not the recipe's")
        if self.mode != "features" and self.feature_normalization != "none":
            raise InvalidConfigError("feature normalization applies to features mode only")
        if not self.private and (self.batch_size is None or self.steps is None):
            raise InvalidConfigError("a non-private run (epsilon=inf) needs --batch-size and --steps")

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The resolved privacy-relevant hyper-parameters of a run."""

    noise_multiplier: float
    steps: int
    batch_size: int
    epsilon: float  # planned epsilon after all steps and releases (inf when non-private)
    num_examples: int
    releases: tuple[float, ...] = ()  # one-off Gaussian releases before training (e.g. a DP feature mean)

    def __post_init__(self) -> None:
        object.__setattr__(self, "releases", tuple(self.releases))  # a list when read back from JSON


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


def _plan(config: TrainConfig, num_examples: int, releases: tuple[float, ...] = ()) -> Plan:
    if not config.private:
        accounting.check_batch_size(batch_size=config.batch_size, num_examples=num_examples)
        return Plan(0.0, int(config.steps), int(config.batch_size), math.inf, num_examples)
    budget = privacy_budget.run_calibrate(
        privacy_budget.CalibrateConfig(
            epsilon=config.epsilon,
            delta=config.delta,
            num_examples=num_examples,
            batch_size=config.batch_size,
            steps=config.steps,
            noise_multiplier=config.noise_multiplier,
            accountant=config.accountant,
            releases=releases,
        )
    )
    return Plan(budget.noise_multiplier, budget.steps, budget.batch_size, budget.epsilon, num_examples, releases)


class _Run:
    """Everything built from (config, plan, seed): identical for a fresh run and a resume.

    With several processes (``distributed``) every process builds the same run over
    the global mesh; only process 0 writes the ledger, metrics and progress.
    """

    def __init__(self, config: TrainConfig, plan: Plan, seed: int, model: TrainModel) -> None:
        self.config, self.plan, self.seed, self.model = config, plan, seed, model
        if tuple(model.releases) != plan.releases:
            raise DataError(f"the run's releases {plan.releases} differ from the model's {model.releases}")
        self.model_state = model.state_for(seed)  # a DP feature mean is derived from the secret seed
        self.primary = distributed.is_primary()
        mesh = distributed.training_mesh(config.devices)
        count = mesh.devices.size
        if config.microbatch_size % count:
            processes = f" of {jax.process_count()} processes" if jax.process_count() > 1 else ""
            raise InvalidConfigError(
                f"microbatch_size {config.microbatch_size} must be divisible by the {count} devices{processes}"
            )
        if config.sampling == "poisson":
            self.sampler = PoissonSampler(num_examples=plan.num_examples, expected_batch_size=plan.batch_size,
                                          microbatch_size=config.microbatch_size, seed=seed)
        else:
            self.sampler = ShuffledSampler(num_examples=plan.num_examples, batch_size=plan.batch_size,
                                           microbatch_size=config.microbatch_size, seed=seed)
        optimizer = optax.chain(
            optax.add_decayed_weights(config.weight_decay) if config.weight_decay else optax.identity(),
            optax.sgd(config.learning_rate, momentum=config.momentum or None),
        )
        if not config.private:
            clipped_sum_fn = make_unclipped_sum_fn(model.loss_fn)
        elif config.mode == "features":
            clipped_sum_fn = softmax_regression_clipped_sum(clip_norm=config.clip_norm)
        else:
            # Per-example gradients through the whole model: book-keeping where it covers the model.
            clipped_sum_fn = model.fast_clipped_sum(config.clip_norm) if model.fast_clipped_sum else None
        self.step = DpsgdStep(
            model.loss_fn,
            DpsgdConfig(noise_multiplier=plan.noise_multiplier, expected_batch_size=plan.batch_size,
                        clip_norm=config.clip_norm, ema_decay=config.ema_decay),
            noise_seed=seed,
            optimizer=optimizer,
            mesh=mesh,
            clipped_sum_fn=clipped_sum_fn,
        )
        self.spec = None
        self.curve = None
        if config.private:
            self.spec = accounting.DpsgdPrivacySpec.from_batch_size(
                noise_multiplier=plan.noise_multiplier, batch_size=plan.batch_size,
                num_examples=plan.num_examples, steps=plan.steps, sampling=config.sampling,
                releases=plan.releases)
            self.curve = accounting.EpsilonCurve(noise_multiplier=plan.noise_multiplier,
                                                 sampling_rate=self.spec.sampling_rate,
                                                 delta=config.delta, accountant=config.accountant,
                                                 releases=plan.releases)
        augment_key = jax.random.fold_in(jax.random.key(_AUGMENT_STREAM), seed % 2**31)
        self.feed = model.make_feed(augment_key, distributed.BatchPlacement(mesh), self.model_state)
        every = config.checkpoint_every or max(1, math.ceil(plan.steps / 20))
        self.files = run_files.RunFiles(config.run_dir)
        self.checkpoints = checkpointing.Checkpoints(config.run_dir, every=every)

    def epsilon_at(self, steps: int) -> float:
        return math.inf if self.curve is None else self.curve(steps)

    def write_ledger(self, steps_done: int) -> None:
        if not self.primary:
            return
        self.files.write_ledger(
            accounting_spec=self.spec, delta=self.config.delta,
            accountant=self.config.accountant if self.config.private else "none",
            epsilon_spent=self.epsilon_at(steps_done), steps_done=steps_done,
            planned_steps=self.plan.steps, data_hash=self.model.data_hash,
        )

    def loop(self, state: TrainState, start: int) -> tuple[TrainState, dict[str, float], float]:
        total = self.plan.steps
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        log_every = max(1, math.ceil(total / 20))
        show = self.config.show_progress and self.primary
        with run_files.progress(total=total, completed=start, enabled=show) as bar:
            for step in range(start, total):
                batch = self.sampler.sample(step)
                state, step_metrics = self.step.update(state, self.feed.microbatches(batch, step))
                done = step + 1
                metrics = {k: float(v) for k, v in step_metrics.items()} | {"step": done}
                if done == total or done % log_every == 0:
                    metrics["epsilon_spent"] = self.epsilon_at(done)
                if self.primary:
                    self.files.append_metrics(metrics)
                if self.checkpoints.should_save(done, total):
                    self.checkpoints.save(done, state)  # every process: orbax coordinates them
                    self.write_ledger(done)
                bar.advance(epsilon=metrics.get("epsilon_spent"), loss=metrics["loss"])
        return state, metrics, time.perf_counter() - started

    def finish(self, state: TrainState, metrics: dict[str, float], seconds: float) -> TrainResult:
        self.files.save_params(params=state.params, ema_params=state.ema_params, model_state=state.model_state)
        self.checkpoints.close()
        return TrainResult(run_dir=self.config.run_dir, epsilon=self.epsilon_at(self.plan.steps),
                           delta=self.config.delta, noise_multiplier=self.plan.noise_multiplier,
                           steps=self.plan.steps, batch_size=self.plan.batch_size, train_seconds=seconds,
                           final_metrics=metrics)


def _check_processes_agree(config: TrainConfig, plan: Plan, model: TrainModel) -> None:
    """With several processes: the same configuration, plan and data everywhere (else refuse)."""
    same = dataclasses.asdict(config) | {"show_progress": None, "seed": None}  # the seed is broadcast
    distributed.check_same_everywhere(
        json.dumps({"config": same, "plan": dataclasses.asdict(plan), "data": model.data_hash},
                   sort_keys=True, default=str),
        "the training configuration or data")


def run(config: TrainConfig) -> TrainResult:
    """A fresh run; with several processes, call it on every one with the same config."""
    model = build_train_model(config)
    plan = _plan(config, model.num_examples, tuple(model.releases))
    config = dataclasses.replace(config, run_dir=os.path.abspath(config.run_dir))
    _check_processes_agree(config, plan, model)
    seed = distributed.agree_on_seed(resolve_seed(config.seed))  # process 0's seed everywhere

    def create_files() -> None:  # process 0 only
        files = run_files.RunFiles.create(config.run_dir)
        checkpointing.write_seed(files.run_dir, seed)
        files.write_config({"config": dataclasses.asdict(config), "resolved": dataclasses.asdict(plan)})

    distributed.run_on_primary(create_files)
    current = _Run(config, plan, seed, model)
    state = current.step.init(model.init_params(seed), current.model_state)
    current.write_ledger(0)
    state, metrics, seconds = current.loop(state, 0)
    return current.finish(state, metrics, seconds)


def resume(run_dir: str, *, show_progress: bool = True) -> TrainResult:
    """Continue a killed run from its newest checkpoint, with its original seed and plan."""
    files = run_files.RunFiles.existing(run_dir)
    try:
        with open(files.path(run_files.CONFIG)) as f:
            saved = json.load(f)
        config = TrainConfig(**(saved["config"] | {"show_progress": show_progress}))
        plan = Plan(**saved["resolved"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{run_dir!r}: unreadable {run_files.CONFIG}; cannot resume") from exc
    model = build_train_model(config)
    if model.num_examples != plan.num_examples:
        raise DataError(f"the data at {config.data!r} changed since the run started "
                        f"({model.num_examples} examples, planned for {plan.num_examples})")
    _check_processes_agree(config, plan, model)
    seed = distributed.run_on_primary(lambda: checkpointing.read_seed(files.run_dir))
    current = _Run(config, plan, distributed.agree_on_seed(0 if seed is None else seed), model)
    fresh = current.step.init(model.init_params(current.seed), current.model_state)
    start = current.checkpoints.latest_step() or 0
    state = current.step.replicate(current.checkpoints.restore(start, fresh)) if start else fresh
    if current.primary:
        files.truncate_metrics(after_step=start)
    _log.info("resuming %s at step %d of %d", run_dir, start, plan.steps)
    state, metrics, seconds = current.loop(state, start)
    return current.finish(state, metrics, seconds)
