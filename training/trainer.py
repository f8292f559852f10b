"""A training run from its plan to its parameters: start, loop, checkpoint, resume.

``start(data, run_dir, config)`` builds the model, calibrates the ``PrivacyPlan`` *before*
the first step (refusing a run that cannot meet the target), writes the run directory and
loops: sample the batch of step t (the plan's sampler), feed it as fixed-shape micro-batches,
accumulate clipped sums, add noise once and update (the plan's DP step). ``resume(run_dir)``
continues a killed run from its last checkpoint with the same secret seed, so the noise and
batches of every step are those of the original plan (``training.run_directory``) and the
final epsilon is exactly the planned one.

With several processes (``dpscale.distributed``) every process runs the same code over the
global mesh; only process 0 writes the run's files and shows progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time

import jax
import optax

from dpscale import distributed
from dpscale.data.identity import keyed_identity, seed_secret
from dpscale.errors import DataError, InvalidConfigError, storage_faults
from dpscale.privacy.dpsgd import TrainState
from dpscale.privacy.example_sum import sum_scale
from dpscale.privacy.plan import PrivacyPlan, knob_to_solve
from dpscale.privacy.seeds import resolve_seed
from dpscale.privacy.streams import Stream, stream_key
from dpscale.progress import progress_bar, status
from dpscale.training import release
from dpscale.training.checkpoints import Checkpoints
from dpscale.training.config import TrainingConfig
from dpscale.training.model import HOLDOUT_SPLIT, TrainModel, build_train_model
from dpscale.training.run_directory import RunDirectory, RunSecrets, RunSpec, noise_versions
from dpscale.training.run_lock import RunLock

_log = logging.getLogger(__name__)
# A clip's room for the float32 sum of a micro-batch that costs more than this is said as a warning.
_ROOM_WORTH_SAYING = 0.02


def _log_sum_room(scale: float, slots: int) -> None:
    """What the room for the float32 sum of a step costs each clipped contribution
    (``DpsgdStep.room``), loud where it is large, with what it comes from: the sum over a micro-batch
    (a smaller micro-batch costs less) or the step's total, rounded once (it grows with the batch)."""
    level = logging.WARNING if 1.0 - scale > _ROOM_WORTH_SAYING else logging.INFO
    micro = 1.0 - float(sum_scale(slots))
    why = (
        "most of it the sum over a micro-batch: a smaller --microbatch-size costs less"
        if micro > (1.0 - scale) / 2
        else "most of it the rounding of the step's total, which grows with the batch size"
    )
    _log.log(
        level,
        "each clipped contribution is scaled by %.4f for the float32 sum of the step, in micro-batches of "
        "%d slots (docs/privacy.md, sensitivity under floating point)%s",
        scale,
        slots,
        f"; {why}" if level == logging.WARNING else "",
    )


@dataclasses.dataclass(frozen=True)
class TrainResult:
    run_dir: str
    epsilon: float
    delta: float
    noise_multiplier: float
    steps: int
    batch_size: int
    train_seconds: float
    final_metrics: dict[str, float]  # the last step's metrics that epsilon covers (training.release)
    warnings: tuple[str, ...] = ()  # what the user must know about the guarantee (e.g. delta >= 1/N)
    examples_per_second: float = 0.0  # expected batch size x steps run by this process / train_seconds


def plan_for(config: TrainingConfig, model: TrainModel, *, show_progress: bool = False) -> PrivacyPlan:
    """The run's privacy plan: calibrated to the target over the model's training rows and releases.

    ``show_progress``: a line if the calibration takes more than a few seconds (it can take a minute).
    """
    what = ""
    if config.target.private:
        knob = knob_to_solve(
            num_examples=model.num_examples,
            batch_size=config.batch_size,
            steps=config.steps,
            noise_multiplier=config.noise_multiplier,
        )
        what = f"calibrating the {knob.replace('_', ' ')} for epsilon {config.target.epsilon:g}"
    with status(f"train: {what}", enabled=show_progress and bool(what)):
        return PrivacyPlan.calibrate(
            config.target,
            num_examples=model.num_examples,
            batch_size=config.batch_size,
            steps=config.steps,
            noise_multiplier=config.noise_multiplier,
            releases=tuple(model.releases),
        ).resolved()  # the capacity recorded


class Trainer:
    """Everything built from (spec, seed, model): identical for a fresh run and a resume."""

    def __init__(self, run: RunDirectory, spec: RunSpec, seed: int, model: TrainModel) -> None:
        config, plan = spec.training, spec.plan
        self.run, self.config, self.plan, self.seed, self.model = run, config, plan, seed, model
        if tuple(model.releases) != plan.releases:
            raise DataError(f"the run's releases {plan.releases} differ from the model's {model.releases}")
        self.model_state = model.state_for(seed)  # a DP feature mean is derived from the secret seed
        self.primary = distributed.is_primary()
        mesh = distributed.training_mesh(config.devices)
        count = mesh.devices.size
        if config.effective_microbatch_size % count:
            processes = f" of {jax.process_count()} processes" if jax.process_count() > 1 else ""
            below, above = (
                config.effective_microbatch_size // count * count,
                (config.effective_microbatch_size // count + 1) * count,
            )
            raise InvalidConfigError(
                f"--microbatch-size {config.effective_microbatch_size} must be divisible by the {count} devices{processes}: "
                f"give {f'{below} or ' if below else ''}{above} (or set --devices)"
            )
        self.sampler = plan.sampler(seed=seed, microbatch_size=config.effective_microbatch_size, multiple=count)
        optimizer = optax.chain(
            optax.add_decayed_weights(config.weight_decay) if config.weight_decay else optax.identity(),
            optax.sgd(config.learning_rate, momentum=config.momentum or None),
        )
        self.step = plan.dp_step(
            model.loss_fn,
            seed=seed,
            clip_norm=config.clip_norm,
            clipped_sum=model.clipped_sum_fn,
            optimizer=optimizer,
            mesh=mesh,
            ema_decay=config.ema_decay,
        )
        self.clip_layers = self.step.clipped_sum_fn.layers if plan.private else ()
        if plan.private:
            _log_sum_room(self.step.room(self.sampler.layout.microbatch_size), self.sampler.layout.microbatch_size)
        self.feed = model.make_feed(
            stream_key(seed, Stream.AUGMENTATION), distributed.BatchPlacement(mesh), self.model_state
        )
        self._every = config.checkpoint_every or max(1, math.ceil(plan.steps / 20))
        self._checkpoints: Checkpoints | None = None

    @property
    def checkpoints(self) -> Checkpoints:
        """Opened on first use: building a trainer (validation) writes nothing into the run directory."""
        if self._checkpoints is None:
            self._checkpoints = self.run.checkpoints(every=self._every)
        return self._checkpoints

    @property
    def diagnostics(self) -> bool:
        """Whether this run writes private diagnostics (asked for, and there is a guarantee to lose)."""
        return self.config.private_diagnostics and self.plan.private

    def not_covered(self) -> tuple[str, ...]:
        """What this run reports that its epsilon does not cover, for the ledger."""
        notes = []
        holdout = self.config.holdout
        if holdout and self.plan.private:
            first = self.plan.num_examples
            notes.append(
                f"rows {first}-{first + holdout - 1} of split {self.config.train_split!r} are held out "
                f"(--holdout {holdout}): not trained on, and their scores (evaluate --split "
                f"{HOLDOUT_SPLIT}) are private diagnostics"
            )
        if self.diagnostics:
            notes.append(f"{release.DIAGNOSTICS_FILE}: per-step statistics of the private batches")
        return tuple(notes)

    def warnings(self) -> tuple[str, ...]:
        notes = self.plan.warnings
        if self.diagnostics:
            notes += (release.warning(self.run.file(release.DIAGNOSTICS_FILE)),)
        return notes

    def write_clip_paths(self) -> None:
        """How this process clips each layer (``clip_paths.json``), where it clips per layer."""
        if self.primary and self.clip_layers:
            self.run.write_clip_paths([dataclasses.asdict(choice) for choice in self.clip_layers])

    def write_ledger(self, steps_done: int) -> None:
        if self.primary:
            self.run.write_ledger(self.plan.ledger(steps_done=steps_done, not_covered=self.not_covered()))

    def loop(self, state: TrainState, start: int) -> tuple[TrainState, dict[str, float], float]:
        total = self.plan.steps
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        log_every = max(1, math.ceil(total / 20))
        show = self.config.show_progress and self.primary
        self.steps_run = total - start
        # examples/s: the expected batch size x steps since the loop began over its time, as the result's
        # examples_per_second; the time left: from the steps after the first (which compiles)
        with progress_bar(
            "train",
            total=total,
            completed=start,
            enabled=show,
            fields=("epsilon", "shown"),
            unit=("examples", self.plan.batch_size),
            starting="compiling the DP step" if self.plan.private else "compiling the step",
        ) as bar:
            for step in range(start, total):
                batch = self.sampler.sample(step)
                state, step_metrics = self.step.update(state, self.feed.microbatches(batch, step))
                done = step + 1
                everything = {k: float(v) for k, v in step_metrics.items()} | {
                    "step": done,
                    "seconds": round(time.perf_counter() - started, 3),
                }
                if done == total or done % log_every == 0:
                    everything["epsilon_spent"] = self.plan.epsilon(done)
                metrics, diagnostic = release.split_step_metrics(everything, private=self.plan.private)
                if self.primary:
                    self.run.append_metrics(metrics)
                    if self.diagnostics:
                        self.run.append_metrics(diagnostic, diagnostic=True)
                if self.checkpoints.should_save(done, total):
                    self.write_ledger(done)  # first: a saved checkpoint is never ahead of what the ledger counts
                    self.checkpoints.save(done, state)  # every process: orbax coordinates them
                # Only what epsilon covers: the noisy update's norm (a non-private run shows its loss).
                fields = {
                    "shown": f"loss {metrics['loss']:.3f}"
                    if "loss" in metrics
                    else f"|update| {metrics['update_norm']:.3g}"
                }
                if "epsilon_spent" in metrics:
                    fields["epsilon"] = f"eps {metrics['epsilon_spent']:.3f}"
                bar.advance(**fields)
        return state, metrics, time.perf_counter() - started

    def stopping_cleanly(self) -> contextlib.AbstractContextManager:
        """A full disk (or a file system turned read-only) ends the run in one line that says how to resume.

        Every file of the run is written atomically (orbax renames a finished checkpoint into
        place, the ledger is written before its checkpoint), so what is on disk is the last
        complete checkpoint; a resume redoes the steps since, with the same noise
        (``training.run_directory``).
        """

        def where() -> str:
            try:
                latest = self.checkpoints.latest_step()
            except Exception:  # noqa: BLE001 - the checkpoint directory itself may be unreadable now
                latest = None
            at = f"its checkpoint of step {latest} of {self.plan.steps}" if latest else "its start (no checkpoint yet)"
            return f"training stopped, the run is intact at {at}"

        return storage_faults(
            path=self.run.path, stopped=where, then=f"continue it with `dpscale train --resume {self.run.path}`"
        )

    def finish(self, state: TrainState, metrics: dict[str, float], seconds: float) -> TrainResult:
        self.run.save_params(params=state.params, ema_params=state.ema_params, model_state=state.model_state)
        self.checkpoints.close()
        if self.primary:
            self.run.delete_secrets()  # a finished run needs no resume
        return TrainResult(
            run_dir=self.run.path,
            epsilon=self.plan.epsilon(),
            delta=self.plan.delta,
            noise_multiplier=self.plan.noise_multiplier,
            steps=self.plan.steps,
            batch_size=self.plan.batch_size,
            train_seconds=seconds,
            final_metrics=metrics,
            warnings=self.warnings(),
            examples_per_second=round(self.steps_run * self.plan.batch_size / seconds, 1) if seconds > 0 else 0.0,
        )


def _check_processes_agree(spec: RunSpec, model: TrainModel) -> None:
    """With several processes: the same configuration, plan and data everywhere (else refuse)."""
    training = dataclasses.replace(spec.training, show_progress=True, seed=None)  # the seed is broadcast
    distributed.check_same_everywhere(
        json.dumps(
            {"spec": dataclasses.replace(spec, training=training).to_json(), "data": model.data_hash},
            sort_keys=True,
            default=str,
        ),
        "the training configuration or data",
    )


def _locked(lock: RunLock | None) -> contextlib.AbstractContextManager:
    return lock if lock is not None else contextlib.nullcontext()


def start(data: str, run_dir: str, config: TrainingConfig, *, plan: PrivacyPlan | None = None) -> TrainResult:
    """A fresh run; with several processes, call it on every one with the same arguments.

    Everything is built and validated before the run directory is written, and it is
    written (secrets, then config.json) under the run's lock, held until the run ends.
    ``plan``: the mechanism to run instead of one calibrated from ``config`` (a private
    selection's runs execute exactly the plan its accounting was calibrated for).
    """
    run = RunDirectory.new(run_dir)
    model = build_train_model(data, config)
    if plan is None:
        plan = plan_for(config, model, show_progress=config.show_progress and distributed.is_primary())
    else:
        _check_given_plan(plan, config, model)
    # The seed, even a fixed one, lives only in the run's secrets: config.json is a released file.
    spec = RunSpec.new(data, dataclasses.replace(config, seed=None), plan, inputs=model.inputs)
    _check_processes_agree(spec, model)
    seed = distributed.agree_on_seed(resolve_seed(config.seed))  # process 0's seed everywhere
    trainer = Trainer(run, spec, seed, model)
    secrets = RunSecrets(
        seed=seed, data_identity=keyed_identity(seed_secret(seed), model.data_hash), versions=noise_versions()
    )
    with _locked(distributed.run_on_primary(lambda: run.begin(spec, secrets))):
        state = trainer.step.init(model.init_params(seed), trainer.model_state)
        trainer.write_ledger(0)
        trainer.write_clip_paths()
        with trainer.stopping_cleanly():
            state, metrics, seconds = trainer.loop(state, 0)
            return trainer.finish(state, metrics, seconds)


def _check_given_plan(plan: PrivacyPlan, config: TrainingConfig, model: TrainModel) -> None:
    """A plan given to ``start`` is of this model's rows and releases and of the config's batch size and steps."""
    given = (plan.num_examples, plan.releases, plan.batch_size, plan.steps, plan.private, plan.batch_capacity > 0)
    expected = (model.num_examples, tuple(model.releases), config.batch_size, config.steps, config.private, True)
    if given != expected:
        raise InvalidConfigError(
            f"the plan given (N, releases, B, T, private, capacity recorded: {given}) is not this run's ({expected})"
        )


def _check_redone_steps_keep_their_noise(run: RunDirectory, first: int) -> None:
    """Refuse a resume whose redone steps (logged after the checkpoint) could draw other noise.

    Their update norms were already written; redrawn noise would be a second, uncounted release
    of those steps. The noise is bit-identical only under the versions that computed it.
    """
    redone = [m["step"] for m in run.read_metrics() if m.get("step", 0) > first]
    recorded = run.read_secrets().versions
    if redone and recorded != noise_versions():
        raise DataError(
            f"{run.path!r}: steps {first + 1}-{max(redone)} were logged before the crash and are redone from the "
            f"checkpoint at step {first}; under {noise_versions()} their noise could differ from the first attempt "
            f"({recorded or 'versions not recorded'}), an uncounted second release. Resume with the versions the "
            "run started with, or start a new run"
        )


def resume(run_dir: str, *, show_progress: bool = True) -> TrainResult:
    """Continue a killed run in ``run_dir`` (wherever it is now) from its newest checkpoint."""
    run = RunDirectory.existing(run_dir)
    with _locked(distributed.run_on_primary(run.lock)):
        return _resume(run, show_progress=show_progress)


def _resume(run: RunDirectory, *, show_progress: bool) -> TrainResult:
    spec = run.read_spec()
    spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training, show_progress=show_progress))
    model = build_train_model(spec.data_path(), spec.training)
    _check_processes_agree(spec, model)

    def read_secrets() -> int:  # process 0 only
        secrets = run.read_secrets()
        if (
            model.num_examples != spec.plan.num_examples
            or keyed_identity(seed_secret(secrets.seed), model.data_hash) != secrets.data_identity
        ):
            raise DataError(
                f"the data at {spec.data!r} changed since the run started; resuming would train "
                "on other data than the plan accounts for (start a new run)"
            )
        return secrets.seed

    seed = distributed.run_on_primary(read_secrets)
    trainer = Trainer(run, spec, distributed.agree_on_seed(0 if seed is None else seed), model)
    fresh = trainer.step.init(model.init_params(trainer.seed), trainer.model_state)
    first = trainer.checkpoints.latest_step() or 0
    distributed.run_on_primary(lambda: _check_redone_steps_keep_their_noise(run, first))
    state = trainer.step.replicate(trainer.checkpoints.restore(first, fresh)) if first else fresh
    if trainer.primary:
        run.truncate_metrics(after_step=first)
    _log.info("resuming %s at step %d of %d", run.path, first, spec.plan.steps)
    trainer.write_clip_paths()
    with trainer.stopping_cleanly():
        state, metrics, seconds = trainer.loop(state, first)
        return trainer.finish(state, metrics, seconds)
