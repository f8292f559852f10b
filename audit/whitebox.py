"""White-box audit: a gradient canary on the real DP-SGD step; the adversary sees every update.

Threat model (Nasr et al. 2021 and 2023): the adversary knows D, picks the canary's
per-example gradient (a fixed vector v of norm >= C, which clipping turns into exactly C
along u = v / |v|), and sees every intermediate model. It is the worst case the accountant
covers, so a correct step must give bounds close to the nominal epsilon and a broken one
must give bounds above it.

The canary enters the plan's own step (``PrivacyPlan.dp_step``) through its clipped-sum
hook: D's rows go through the model's real clipped sum (closed-form linear head, ``vmap``,
book-keeping or per-layer ghost norms), the canary row through ``clipping.clipped_sum_from_gradients``
(the library's clip and weighted sum), and the two parts are joined by ``ClippedSum.plus``,
the operator that accumulates micro-batches. Micro-batches, noise, division by B and the
optimiser are ``DpsgdStep.accumulate_traceable`` (one device, or ``shard_map`` over a data mesh) /
``apply_pure`` unchanged.

The score of a model is ``sum_t <p_t - p_{t+1}, u> B / lr - <S_D(p_t), u>``, where S_D is
D's clipped sum at the observed p_t, recomputed by the adversary with the reference ``vmap``
path (skipped when u is a kernel row of a feature that is 0 throughout D, which D provably
never moves). With q = 1 each term is exactly c + sigma xi_t (c = 1 with the canary, else
0), so the score is N(T c, T sigma^2): the run is exactly mu-GDP with mu = sqrt(T) / sigma,
what the accountant charges at q = 1, which is why the bound can be tight.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Literal, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from dpscale.audit import bounds as audit_bounds
from dpscale.audit.game import finish_row, game_statistics
from dpscale.errors import InvalidConfigError
from dpscale.models.cnn import small_cnn
from dpscale.privacy import clipping
from dpscale.privacy.bookkeeping import make_bookkeeping_clipped_sum_fn
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn, make_clipped_sum_fn
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.plan import PrivacyPlan
from dpscale.privacy.streams import ModelKeys
from dpscale.privacy.tuning import choose as tuning
from dpscale.progress import Bar
from dpscale.training.config import TrainingConfig
from dpscale.training.vmapped import run_models

PyTree = Any
WhiteBoxModel = Literal["linear", "cnn"]
PerExample = Literal["vmap", "bookkeeping", "ghost"]


@dataclasses.dataclass(frozen=True)
class WhiteBoxSetup:
    """One white-box configuration: the plan (q must be 1), the model path and the canary."""

    plan: PrivacyPlan
    model: WhiteBoxModel = "linear"
    per_example: PerExample = "vmap"  # the CNN's per-example gradients (the linear head is closed form)
    learning_rate: float = TrainingConfig.learning_rate
    clip_norm: float = TrainingConfig.clip_norm
    microbatches: int = 2  # > 1 so accumulation across micro-batches is audited too
    canary_norm: float = 10.0  # |v| / C: >= 1 so the canary is always clipped
    channels: tuple[int, ...] = (8, 16)
    num_groups: int = 4

    def __post_init__(self) -> None:
        if self.model not in ("linear", "cnn"):
            raise InvalidConfigError(f"white-box model must be 'linear' or 'cnn', got {self.model!r}")
        if self.per_example not in get_args(PerExample):
            raise InvalidConfigError(f"per_example must be one of {get_args(PerExample)}, got {self.per_example!r}")
        if self.plan.batch_size != self.plan.num_examples:
            raise InvalidConfigError(
                "the white-box audit needs full batches (batch size = |D|, q = 1): its statistic is exact "
                f"only then; got batch size {self.plan.batch_size} for |D| = {self.plan.num_examples}"
            )
        if self.microbatches < 1 or not self.canary_norm >= 1:
            raise InvalidConfigError("microbatches must be >= 1 and canary_norm >= 1")


def with_gradient_canary(base_fn: ClippedSumFn, v: PyTree, *, clip_norm: float) -> ClippedSumFn:
    """``base_fn`` for rows whose ``batch["canary"]`` is 0; the row flagged 1 has per-example gradient ``v``.

    A micro-batch holds at most one canary row (the audit's layout), so the canary's
    clipped sum is over one per-example gradient, present when that row is.
    """

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        is_canary = batch["canary"] > 0
        rest = {key: x for key, x in batch.items() if key != "canary"}
        data_part = base_fn(params, model_state, rest, jnp.where(is_canary, 0.0, mask))
        present = jnp.sum(jnp.where(is_canary, mask, 0.0))[None]
        grads = jax.tree_util.tree_map(lambda leaf: leaf[None], v)
        # Looked up at call time, so tests can swap the library's clipping for a broken one.
        canary_part = clipping.clipped_sum_from_gradients(grads, present, clip_norm=clip_norm)
        return data_part.plus(canary_part)

    return ClippedSumFn(clipped_sum, sensitivity=base_fn.sensitivity, layers=base_fn.layers)


@dataclasses.dataclass(frozen=True)
class _Task:
    init: Callable[[jax.Array], PyTree]  # key -> params
    loss_fn: Callable
    base_fn: Callable  # the clipped sum under audit, for D's rows
    rows: Callable[[np.ndarray], dict[str, jax.Array]]  # row indices -> batch for base_fn
    reference: Callable | None  # (params, rows of D) -> the adversary's own S_D, or None if u is untouched
    direction: PyTree  # u, unit norm


def softmax_regression(num_classes: int, example: jax.Array) -> tuple[Callable, Callable]:
    """``(loss_fn, init)`` of a softmax regression on ``views["features"]``: the linear audits' model."""
    model = nn.Dense(num_classes)

    def loss_fn(params: PyTree, model_state: PyTree, views: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, views["features"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    def init(key: jax.Array) -> PyTree:
        return dict(model.init(key, example)["params"])

    return loss_fn, init


def _one_hot_tree(params: PyTree, path: tuple[str, ...], flat_index: int) -> PyTree:
    direction = jax.tree_util.tree_map(jnp.zeros_like, params)
    node = direction
    for key in path[:-1]:
        node = node[key]
    leaf = node[path[-1]]
    node[path[-1]] = leaf.reshape(-1).at[flat_index].set(1.0).reshape(leaf.shape)
    return direction


def _task(
    setup: WhiteBoxSetup,
    features: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    image_shape: tuple[int, ...] | None,
) -> _Task:
    n = len(labels)
    y = jnp.asarray(np.r_[labels, 0], jnp.int32)  # D, then the canary row (its label is unused)
    clip = setup.clip_norm
    if setup.model == "linear":
        x = jnp.asarray(np.concatenate([features.reshape(n, -1), np.zeros((1, features[0].size))]), jnp.float32)
        loss_fn, init = softmax_regression(num_classes, x[:1])
        params = jax.eval_shape(init, jax.random.key(0))
        unused = np.flatnonzero(np.all(features.reshape(n, -1) == 0, axis=0))
        feature = int(unused[0]) if len(unused) else 0
        direction = _one_hot_tree(
            jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), params), ("kernel",), feature * num_classes
        )
        rows = lambda index: {"features": x[index], "label": y[index]}  # noqa: E731
        view_rows = lambda index: {"features": x[index][:, None], "label": y[index][:, None]}  # noqa: E731
        base_fn = softmax_regression_clipped_sum(clip_norm=clip)
        needs_reference = not len(unused)
    else:
        if image_shape is None:
            raise InvalidConfigError("the CNN needs images (an image shape)")
        x = jnp.asarray(np.concatenate([features.reshape(n, *image_shape), np.zeros((1, *image_shape))]), jnp.float32)
        model = small_cnn(num_classes=num_classes, channels=setup.channels, num_groups=setup.num_groups)

        def loss_fn(params: PyTree, model_state: PyTree, views: dict[str, jax.Array]) -> jax.Array:
            logits = model.apply({"params": params, **model_state}, views["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

        init = lambda key: model.init(key, x[:1])["params"]  # noqa: E731
        params = jax.eval_shape(init, jax.random.key(0))
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), params)
        direction = _one_hot_tree(zeros, ("head", "fc", "kernel"), 0)  # any direction works: S_D is subtracted
        view_rows = lambda index: {"image": x[index][:, None], "label": y[index][:, None]}  # noqa: E731
        rows = view_rows
        if setup.per_example in ("bookkeeping", "ghost"):
            example = (
                zeros,
                {},
                jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), view_rows(np.arange(1))),
            )
            if setup.per_example == "bookkeeping":
                base_fn = make_bookkeeping_clipped_sum_fn(loss_fn, clip_norm=clip, example=example)
            else:  # each layer on the path training would take here
                choose = tuning.chooser(loss_fn, example=example)
                base_fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=clip, example=example, choose=choose)
        else:
            base_fn = make_clipped_sum_fn(loss_fn, clip_norm=clip)
        needs_reference = True
    reference = None
    if needs_reference:
        ref_fn = make_clipped_sum_fn(loss_fn, clip_norm=clip)
        d_rows, ones = view_rows(np.arange(n)), jnp.ones((n,), jnp.float32)
        reference = lambda p: ref_fn(p, {}, d_rows, ones).value  # noqa: E731
    return _Task(init=init, loss_fn=loss_fn, base_fn=base_fn, rows=rows, reference=reference, direction=direction)


def _dot(a: PyTree, b: PyTree) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def white_box_scores(
    features: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    member: np.ndarray,
    *,
    setup: WhiteBoxSetup,
    seed: int,
    image_shape: tuple[int, ...] | None = None,
    chunk_size: int = 256,
    on_chunk: Callable[[int], None] | None = None,
    mesh: Mesh | None = None,
) -> np.ndarray:
    """One score per model (``member[i]``: model i has the canary); D = ``features``, ``labels``.

    The models run on ``training.vmapped.run_models``: model i draws its initialisation and
    noise from ``privacy.streams.model_keys(seed, i)``, and its per-step observation is the
    canary term of the score. With a ``mesh`` (``privacy.dpsgd.data_mesh``) the step is the
    multi-device one: each micro-batch is split over the devices (the canary row lands on
    one of them), every device clips its own rows, the sums are ``psum``ed under
    ``shard_map`` and the noise is added once. The linear head's models are ``vmap``ped over
    that ``shard_map`` (its batching rule adds the model axis to every device's block); the
    CNN's run sequentially (see below).
    """
    n = len(labels)
    if n != setup.plan.num_examples:
        raise InvalidConfigError(f"the plan is for |D| = {setup.plan.num_examples}, got {n} rows")
    task = _task(setup, features, labels, num_classes, image_shape)
    v = jax.tree_util.tree_map(lambda u: u * setup.canary_norm * setup.clip_norm, task.direction)
    dp_step = setup.plan.dp_step(
        task.loss_fn,
        seed=seed,
        clip_norm=setup.clip_norm,
        optimizer=optax.sgd(setup.learning_rate),
        ema_decay=TrainingConfig.ema_decay,  # unused: the audit scores the parameters, not their EMA
        clipped_sum=lambda clip_norm: with_gradient_canary(task.base_fn, v, clip_norm=clip_norm),
        mesh=mesh,
    )
    accumulate = dp_step.accumulate_traceable
    k = setup.microbatches
    per = k * dp_step.num_devices
    slots = -(-(n + 1) // per) * per  # D and the canary row, padded to k equal micro-batches, each split evenly
    index = np.minimum(np.arange(slots), n)
    real = np.arange(slots) <= n
    is_canary = real & (index == n)
    batch = task.rows(index) | {"canary": jnp.asarray(is_canary, jnp.float32)}
    # Model i trains on D, and on the canary row when member[i]: [models, slots].
    masks = ((real & ~is_canary) | (is_canary & np.asarray(member, bool)[:, None])).astype(np.float32)
    scale = setup.plan.batch_size / setup.learning_rate

    def start(keys: ModelKeys, mask: jax.Array) -> tuple[Any, jax.Array]:
        return dp_step.init(task.init(keys.init)), jnp.zeros((), jnp.float32)

    def step(carry: tuple[Any, jax.Array], keys: ModelKeys, mask: jax.Array, t: jax.Array) -> tuple[Any, jax.Array]:
        state, score = carry
        total = dp_step.zero_sum(state)
        for m in range(k):
            part = slice(m * slots // k, (m + 1) * slots // k)
            micro = jax.tree_util.tree_map(lambda leaf: leaf[part], batch)
            total = accumulate(state.params, total, micro, mask[part], state.model_state)
        new_state, _ = dp_step.apply_pure(state, total, keys.noise)
        moved = jax.tree_util.tree_map(jnp.subtract, state.params, new_state.params)
        observed = _dot(moved, task.direction) * scale
        if task.reference is not None:
            observed = observed - _dot(task.reference(state.params), task.direction)
        return new_state, score + observed

    # JAX cannot batch the per-example convolution gradients traced inside ``shard_map``
    # (``conv_general_dilated``'s batching rule raises NotImplementedError for grouped
    # convolutions with an output sharding), so with a mesh the CNN's models run one after
    # another, still in one compiled program per chunk.
    chunks = run_models(
        masks,
        seed=seed,
        steps=setup.plan.steps,
        start=start,
        step=step,
        finish=lambda carries: carries[1],
        chunk_size=chunk_size,
        on_chunk=on_chunk,
        sequential=mesh is not None and setup.model == "cnn",
    )
    return np.concatenate(chunks).astype(np.float64)


def white_box_row(
    features: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    *,
    setup: WhiteBoxSetup,
    nominal_epsilon: float,
    delta: float,
    num_models: int,
    confidence: float,
    holdout_fraction: float,
    seed: int,
    image_shape: tuple[int, ...] | None = None,
    chunk_size: int = 256,
    bar: Bar | None = None,
    mesh: Mesh | None = None,
) -> dict:
    """One white-box row: scores of ``num_models`` models (half with the canary) -> both estimators."""
    member = np.arange(num_models) % 2 == 0
    started = time.perf_counter()
    scores = white_box_scores(
        features,
        labels,
        num_classes,
        member,
        setup=setup,
        seed=seed,
        image_shape=image_shape,
        chunk_size=chunk_size,
        on_chunk=None if bar is None else bar.advance,
        mesh=mesh,
    )
    seconds = time.perf_counter() - started
    plan = setup.plan
    row = {
        "threat_model": "white-box",
        "model": setup.model if setup.model == "linear" else f"cnn ({setup.per_example})",
        "num_examples": plan.num_examples,
        "nominal_epsilon": nominal_epsilon,
        "delta": delta,
        "noise_multiplier": plan.noise_multiplier,
        "batch_size": plan.batch_size,
        "steps": plan.steps,
        "microbatches": setup.microbatches,
        "num_models": num_models,
        "devices": 1 if mesh is None else mesh.devices.size,
        "confidence": confidence,
        "mu_nominal": math.sqrt(plan.steps) / plan.noise_multiplier,
        **audit_bounds.gdp_epsilon_lower_bound(scores[member], scores[~member], delta=delta, confidence=confidence),
        **game_statistics(
            scores[member], scores[~member], delta=delta, confidence=confidence, holdout_fraction=holdout_fraction
        ),
        "seconds": seconds,
    }
    return finish_row(row)
