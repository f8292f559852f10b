"""Thousands of small DP-SGD models at once, on the real update, for audits and quick searches.

Every model runs the update of ``dpscale train``, built by the same ``PrivacyPlan.dp_step``:
``DpsgdStep.accumulate_pure`` (clipping) and ``DpsgdStep.apply_pure`` (noise once per step,
optax SGD, EMA), ``vmap``-ed over models and ``scan``-ed over steps. What differs between
models is only what DP-SGD randomises and the caller controls:

* which rows of the data set a model may see (``present``: D, or D plus canaries);
* truncated Poisson sampling, the trainer's: every present row joins each step with
  probability q = B / |D|, at most the plan's ``capacity`` of them
  (``privacy.sampling.truncated_poisson_slots``, from ``Stream.SAMPLING`` at (model, step));
* the noise: ``Stream.NOISE`` at (model, step).

Keys come from ``privacy.streams.model_keys``. All models start from the same parameters
(``Stream.INIT`` without a model index: the black-box adversary knows the initialisation). Every
batch is gathered into the plan's ``capacity`` slots (padding has mask 0); a larger draw
keeps a uniformly random ``capacity`` of its rows, exactly as the accountant assumes.

``run_models`` is the harness under both this trainer and the white-box audit
(``audit.whitebox``): models ``vmap``-ped, steps ``scan``-ned, each model's keys from
``model_keys``, models in chunks of one compiled program each, progress per chunk. What a
model carries from step to step and what is kept at the end is the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy.dpsgd import DpsgdStep, TrainState
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.plan import PrivacyPlan
from dpscale.privacy.sampling import truncated_poisson_slots
from dpscale.privacy.streams import ModelKeys, Stream, model_keys, stream_key
from dpscale.training.config import TrainingConfig

PyTree = Any
Carry = Any
ModelKind = Literal["linear", "mlp"]


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """One DP-SGD configuration shared by every model: the plan (|D|, B, T, sigma) and the optimiser."""

    plan: PrivacyPlan
    learning_rate: float = TrainingConfig.learning_rate
    clip_norm: float = TrainingConfig.clip_norm
    model: ModelKind = "linear"
    hidden: int = 32
    ema_decay: float = TrainingConfig.ema_decay

    def __post_init__(self) -> None:
        if self.model not in ("linear", "mlp"):
            raise InvalidConfigError(f"model must be 'linear' or 'mlp', got {self.model!r}")


class _Mlp(nn.Module):
    hidden: int
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(self.num_classes)(jnp.tanh(nn.Dense(self.hidden)(x)))


def _model(setup: TrainingSetup, num_classes: int) -> nn.Module:
    if setup.model == "linear":
        return nn.Dense(num_classes)  # params {"kernel", "bias"}, as privacy.linear expects
    return _Mlp(hidden=setup.hidden, num_classes=num_classes)


def make_dp_step(setup: TrainingSetup, num_classes: int, *, seed: int) -> tuple[nn.Module, DpsgdStep]:
    """The model and its plan's ``DpsgdStep`` (closed-form clipped sum for the linear model)."""
    model = _model(setup, num_classes)

    def loss(params: PyTree, model_state: PyTree, views: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params, **model_state}, views["features"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    linear = setup.model == "linear"
    step = setup.plan.dp_step(
        loss,
        seed=seed,
        clip_norm=setup.clip_norm,
        clipped_sum=(lambda clip_norm: softmax_regression_clipped_sum(clip_norm=clip_norm)) if linear else None,
        optimizer=optax.sgd(setup.learning_rate),
        ema_decay=setup.ema_decay,
    )
    return model, step


def margin(logits: jax.Array, label: jax.Array) -> jax.Array:
    """``logit_y - logsumexp_{j != y} logit_j``: the log-odds of the label, which does not saturate."""
    is_label = jax.nn.one_hot(label, logits.shape[-1], dtype=bool)
    target = jnp.sum(jnp.where(is_label, logits, 0.0), axis=-1)
    return target - jax.nn.logsumexp(jnp.where(is_label, -jnp.inf, logits), axis=-1)


def run_models(
    inputs: PyTree,
    *,
    seed: int,
    steps: int,
    start: Callable[[ModelKeys, PyTree], Carry],
    step: Callable[[Carry, ModelKeys, PyTree, jax.Array], Carry],
    finish: Callable[[Carry], Any],
    chunk_size: int = 256,
    on_chunk: Callable[[int], None] | None = None,
    sequential: bool = False,
) -> list[Any]:
    """Run one model per row of ``inputs`` (leaves [models, ...]) for ``steps`` steps; ``finish`` per chunk.

    Model i has the keys ``model_keys(seed, i)`` and its row of ``inputs``; it starts from
    ``start(keys, row)`` and goes through ``step(carry, keys, row, t)`` for t = 0 .. steps-1.
    ``finish`` sees the final carries of a chunk (leaves with a leading model axis) inside
    ``jit`` and returns what the caller keeps. The result holds one entry per chunk, trimmed
    to its real models: the last chunk is padded by repeating the last row (with fresh
    model indices), so every chunk compiles to one program. ``on_chunk(count)`` follows each
    chunk. ``sequential`` runs a chunk's models one after another (``lax.map``) instead of
    ``vmap``, for steps JAX cannot batch.
    """

    def one_model(model_index: jax.Array, row: PyTree) -> Carry:
        keys = model_keys(seed, model_index)
        carry, _ = jax.lax.scan(lambda c, t: (step(c, keys, row, t), None), start(keys, row), jnp.arange(steps))
        return carry

    if sequential:
        run_chunk = jax.jit(lambda ids, rows: finish(jax.lax.map(lambda pair: one_model(*pair), (ids, rows))))
    else:
        run_chunk = jax.jit(lambda ids, rows: finish(jax.vmap(one_model)(ids, rows)))
    num_models = len(jax.tree_util.tree_leaves(inputs)[0])
    outputs = []
    size = min(chunk_size, num_models)
    for first in range(0, num_models, size):
        stop = min(num_models, first + size)
        ids = np.arange(first, first + size)
        rows = jax.tree_util.tree_map(lambda x: jnp.asarray(x[np.minimum(ids, num_models - 1)]), inputs)
        out = run_chunk(jnp.asarray(ids, jnp.uint32), rows)
        outputs.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[: stop - first], out))
        if on_chunk is not None:
            on_chunk(stop - first)
    return outputs


def train_models(
    features: np.ndarray,
    labels: np.ndarray,
    present: np.ndarray,
    *,
    setup: TrainingSetup,
    seed: int,
    read_out: Callable[[nn.Module, TrainState], Any],
    chunk_size: int = 256,
    on_chunk: Callable[[int], None] | None = None,
) -> list[Any]:
    """Train one model per row of ``present`` [models, rows]; ``read_out(model, states)`` per chunk.

    ``read_out`` sees the final states of a chunk of models (leaves with a leading model
    axis) inside ``jit`` and returns what the caller keeps; the result holds one entry per
    chunk (``run_models``).
    """
    features = jnp.asarray(features, jnp.float32)
    labels = jnp.asarray(labels, jnp.int32)
    num_models, num_rows = present.shape
    if num_rows != features.shape[0]:
        raise DataError(f"present has {num_rows} rows but there are {features.shape[0]} examples")
    num_classes = int(labels.max()) + 1
    model, dp_step = make_dp_step(setup, num_classes, seed=seed)
    params = jax.jit(model.init)(stream_key(seed, Stream.INIT), features[:1])["params"]  # shared by all
    state0 = dp_step.init(params)
    rate = setup.plan.sampling_rate
    capacity = min(setup.plan.capacity, num_rows)

    def start(keys: ModelKeys, rows_present: jax.Array) -> TrainState:
        return state0

    def one_step(state: TrainState, keys: ModelKeys, rows_present: jax.Array, step: jax.Array) -> TrainState:
        index, mask = truncated_poisson_slots(jax.random.fold_in(keys.sampling, step), rate, rows_present, capacity)
        batch = {"features": features[index], "label": labels[index]}
        if setup.model == "mlp":  # the generic path wants a view axis (augmult K = 1)
            batch = jax.tree_util.tree_map(lambda x: x[:, None], batch)
        total = dp_step.accumulate_pure(state.params, dp_step.zero_sum(state), batch, mask, state.model_state)
        state, _ = dp_step.apply_pure(state, total, keys.noise)
        return state

    return run_models(
        present,
        seed=seed,
        steps=setup.plan.steps,
        start=start,
        step=one_step,
        finish=lambda states: read_out(model, states),
        chunk_size=chunk_size,
        on_chunk=on_chunk,
    )


def train_and_score(
    features: np.ndarray,
    labels: np.ndarray,
    present: np.ndarray,
    score_rows: np.ndarray,
    *,
    setup: TrainingSetup,
    seed: int,
    chunk_size: int = 256,
    on_chunk: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Train one model per row of ``present``; scores [models, len(score_rows)].

    The score of row j on a model is ``margin`` of its label under the final parameters:
    higher means the model fits that example better.
    """
    score_x = jnp.asarray(features, jnp.float32)[score_rows]
    score_y = jnp.asarray(labels, jnp.int32)[score_rows]

    def read_out(model: nn.Module, states: TrainState) -> jax.Array:
        logits = jax.vmap(lambda p: model.apply({"params": p}, score_x))(states.params)
        return margin(logits, score_y)

    chunks = train_models(
        features, labels, present, setup=setup, seed=seed, read_out=read_out, chunk_size=chunk_size, on_chunk=on_chunk
    )
    return np.concatenate(chunks).astype(np.float32)
