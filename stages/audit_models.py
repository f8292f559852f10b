"""Thousands of small DP-SGD models in parallel, for privacy audits.

Every model runs the real update of ``dpscale train``: ``DpsgdStep.accumulate_pure``
(clipping) and ``DpsgdStep.apply_pure`` (noise once per step, optax SGD), ``vmap``-ed
over models and ``scan``-ed over steps. What differs between models is only what
DP-SGD randomises and the audit controls:

* which rows of the data set the model may see (``present``: D, or D plus canaries);
* Poisson sampling: every present row joins each step with probability q = B / |D|;
* the noise: model ``i`` uses ``fold_in(noise_key, i)``, then ``DpsgdStep`` folds in the step.

All models start from the same parameters. A Poisson batch has a random size; to
keep shapes static it is gathered into ``capacity`` slots (padding has mask 0). The
capacity is 8 standard deviations above the mean, and a batch that would not fit
is counted and makes the audit fail instead of being truncated silently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy.dpsgd import DpsgdConfig, DpsgdStep
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.noise import key_from_seed

PyTree = Any
ModelKind = Literal["linear", "mlp"]
StepFactory = Callable[..., DpsgdStep]
_SAMPLING_STREAM = 0x5A4
_INIT_STREAM = 0x1A1


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """One DP-SGD configuration shared by every model of an audit."""

    noise_multiplier: float
    batch_size: float  # expected Poisson batch size B
    num_examples: int  # |D|, so q = B / |D|
    steps: int
    learning_rate: float = 1.0
    clip_norm: float = 1.0
    model: ModelKind = "linear"
    hidden: int = 32

    def __post_init__(self) -> None:
        if self.model not in ("linear", "mlp"):
            raise InvalidConfigError(f"audit model must be 'linear' or 'mlp', got {self.model!r}")
        if not 0 < self.batch_size <= self.num_examples:
            raise InvalidConfigError(
                f"batch size must be in (0, |D|={self.num_examples}], got {self.batch_size}"
            )
        if self.steps < 1:
            raise InvalidConfigError(f"steps must be >= 1, got {self.steps}")

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.num_examples


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


def make_dp_step(
    setup: TrainingSetup, num_classes: int, *, noise_seed: int, step_factory: StepFactory = DpsgdStep
) -> tuple[nn.Module, DpsgdStep]:
    """The model and its ``DpsgdStep`` (closed-form clipped sum for the linear model).

    ``step_factory`` exists so tests can audit a deliberately broken subclass.
    """
    model = _model(setup, num_classes)

    def loss(params: PyTree, model_state: PyTree, views: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params, **model_state}, views["features"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    clipped_sum_fn = (
        softmax_regression_clipped_sum(clip_norm=setup.clip_norm) if setup.model == "linear" else None
    )
    config = DpsgdConfig(
        noise_multiplier=setup.noise_multiplier,
        expected_batch_size=setup.batch_size,
        clip_norm=setup.clip_norm,
    )
    step = step_factory(
        loss, config, noise_seed=noise_seed, learning_rate=setup.learning_rate,
        clipped_sum_fn=clipped_sum_fn,
    )
    return model, step


def batch_capacity(num_rows: int, rate: float) -> int:
    """Slots for one Poisson batch: mean + 8 standard deviations (+8), at most all rows."""
    mean = num_rows * rate
    return min(num_rows, math.ceil(mean + 8 * math.sqrt(mean * (1 - rate)) + 8))


def margin(logits: jax.Array, label: jax.Array) -> jax.Array:
    """``logit_y - logsumexp_{j != y} logit_j``: the log-odds of the label, which does not saturate."""
    is_label = jax.nn.one_hot(label, logits.shape[-1], dtype=bool)
    target = jnp.sum(jnp.where(is_label, logits, 0.0), axis=-1)
    return target - jax.nn.logsumexp(jnp.where(is_label, -jnp.inf, logits), axis=-1)


def train_and_score(
    features: np.ndarray,
    labels: np.ndarray,
    present: np.ndarray,
    score_rows: np.ndarray,
    *,
    setup: TrainingSetup,
    seed: int,
    step_factory: StepFactory = DpsgdStep,
    chunk_size: int = 256,
    on_chunk: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Train one model per row of ``present`` [models, rows]; return scores [models, len(score_rows)].

    The score of row j on a model is ``margin`` of its label under the final
    parameters: higher means the model fits that example better.
    """
    features = jnp.asarray(features, jnp.float32)
    labels = jnp.asarray(labels, jnp.int32)
    num_models, num_rows = present.shape
    if num_rows != features.shape[0]:
        raise DataError(f"present has {num_rows} rows but there are {features.shape[0]} examples")
    num_classes = int(labels.max()) + 1
    model, dp_step = make_dp_step(setup, num_classes, noise_seed=seed, step_factory=step_factory)
    init_key = jax.random.fold_in(key_from_seed(seed), _INIT_STREAM)
    params = jax.jit(model.init)(init_key, features[:1])["params"]  # shared by all models
    state0 = dp_step.init(params)
    noise_key = key_from_seed(seed)
    sample_key = jax.random.fold_in(key_from_seed(seed), _SAMPLING_STREAM)
    capacity = batch_capacity(num_rows, setup.sampling_rate)
    slots = jnp.arange(capacity)
    score_x, score_y = features[score_rows], labels[score_rows]

    def one_step(state: Any, model_index: jax.Array, rows_present: jax.Array, step: jax.Array):
        key = jax.random.fold_in(jax.random.fold_in(sample_key, model_index), step)
        chosen = jax.random.bernoulli(key, setup.sampling_rate, (num_rows,)) & rows_present
        count = jnp.sum(chosen)
        (index,) = jnp.nonzero(chosen, size=capacity, fill_value=0)
        mask = (slots < count).astype(jnp.float32)
        batch = {"features": features[index], "label": labels[index]}
        if setup.model == "mlp":  # the generic path wants a view axis (augmult K = 1)
            batch = jax.tree_util.tree_map(lambda x: x[:, None], batch)
        total = dp_step.accumulate_pure(
            state.params, dp_step.zero_sum(state), batch, mask, state.model_state
        )
        state, _ = dp_step.apply_pure(state, total, jax.random.fold_in(noise_key, model_index))
        return state, count > capacity

    @jax.jit
    def run_chunk(model_indices: jax.Array, rows_present: jax.Array) -> tuple[jax.Array, jax.Array]:
        states = jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (model_indices.shape[0], *x.shape)), state0
        )

        def body(carry, step):
            states, overflow = carry
            states, over = jax.vmap(one_step, in_axes=(0, 0, 0, None))(
                states, model_indices, rows_present, step
            )
            return (states, overflow + over), None

        overflow = jnp.zeros(model_indices.shape, jnp.int32)
        (states, overflow), _ = jax.lax.scan(body, (states, overflow), jnp.arange(setup.steps))
        logits = jax.vmap(lambda p: model.apply({"params": p}, score_x))(states.params)
        return margin(logits, score_y), jnp.sum(overflow)

    scores = np.empty((num_models, len(score_rows)), np.float32)
    size = min(chunk_size, num_models)
    for start in range(0, num_models, size):
        stop = min(num_models, start + size)
        ids = np.arange(start, start + size)
        rows = present[np.minimum(ids, num_models - 1)]  # the last chunk is padded by repeats
        chunk_scores, overflow = run_chunk(jnp.asarray(ids, jnp.int32), jnp.asarray(rows))
        if int(overflow):
            raise RuntimeError(f"{int(overflow)} Poisson batches exceeded {capacity} slots")
        scores[start:stop] = np.asarray(chunk_scores)[: stop - start]
        if on_chunk is not None:
            on_chunk(stop - start)
    return scores
