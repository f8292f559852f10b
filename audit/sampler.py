"""Sampler audit: is an example in as many batches as the accountant assumes (q < 1)?

The white-box audit (``audit.whitebox``) runs at q = 1, where its Gaussian statistic is exact,
so it never sees the sampler. This audit runs the real one: every model draws its batches from
``PrivacyPlan.sampler`` (truncated Poisson sampling, the sampler ``dpscale train`` uses, or
or a broken one that an audit's own checks put in the plan's parts: ``audit.broken_steps.with_parts``)
and trains on them with the plan's DP step (``DpsgdStep.accumulate_pure`` / ``apply_pure``).

The canary is a gradient canary (as in the white-box audit) along a feature that is 0 in every
row of D, so D never moves it: the adversary, who sees every update, observes per step exactly
``o_t = I_t + sigma xi_t``, where I_t says whether the canary was in the batch. Everything the
sampler decides about the canary is in the I_t, and nothing else is.

The statistic of a model is the Neyman-Pearson likelihood ratio of the accounted mechanism,
``sum_t log((1 - q) + q exp((o_t - 1/2) / sigma^2))``. A threshold is chosen on held-out
models; Clopper-Pearson bounds (FPR, FNR) on the others hold together with the stated
confidence. The verdict compares them with the *accounted* mechanism's whole privacy profile
delta(eps) (dp-accounting's pessimistic PLD of the plan's event, ``privacy.pld.privacy_profile``):
an (eps, delta(eps))-DP mechanism must allow ``FPR + e^eps FNR >= 1 - delta(eps)`` and
``FNR + e^eps FPR >= 1 - delta(eps)`` at every eps. A point outside proves that the run is less
private than accounted (a violation): a Gaussian estimator would not be valid at q < 1, this is.

How close correct code comes: the largest rate q' whose (q', sigma, T) mechanism the point
still violates (``sampling_rate_lower_bound``): the run is provably less private than that
mechanism, so ``rate_fraction = q' / q`` near 1 means the audit is tight, and above 1 is a
violation. ``epsilon_lower_bound`` is the generic bound at delta from the same rates (valid for
any mechanism, capped by what Clopper-Pearson can certify with this many models).

Where it has teeth: little noise per step (an inclusion is plainly visible) and about one epoch
(T = |D| / B), where Poisson sampling leaves an example out of every batch with probability
(1 - q)^T ~ 1/e and shuffling never does. ``SamplerAuditSetup``'s defaults are such a setting.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpscale.audit import bounds as audit_bounds
from dpscale.audit.whitebox import softmax_regression, with_gradient_canary
from dpscale.errors import InvalidConfigError
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.plan import PrivacyPlan
from dpscale.privacy.pld import privacy_profile
from dpscale.privacy.sampling import PADDING_INDEX
from dpscale.privacy.streams import ModelKeys, Stream, stream_rng
from dpscale.progress import Bar
from dpscale.training.config import TrainingConfig
from dpscale.training.vmapped import run_models

PyTree = Any
#: The eps at which a test's rates are compared with the accounted delta(eps).
EPSILON_GRID = np.arange(0.0, 16.0 + 1e-9, 0.25)


@dataclasses.dataclass(frozen=True)
class SamplerAuditSetup:
    """The plan under audit (its sampler draws from ``plan.num_examples`` rows: D and the canary's slot)."""

    plan: PrivacyPlan
    microbatch_size: int = 16
    learning_rate: float = TrainingConfig.learning_rate
    clip_norm: float = TrainingConfig.clip_norm
    canary_norm: float = 10.0  # |canary gradient| / C: >= 1, so it is always clipped to exactly C
    discretization: float = 1e-2  # of the accounted profile's PLD (coarser: looser, never invalid)

    def __post_init__(self) -> None:
        if not self.plan.private:
            raise InvalidConfigError("the sampler audit needs a private plan (noise multiplier > 0)")
        if self.plan.num_examples < 2 or self.plan.batch_size >= self.plan.num_examples:
            raise InvalidConfigError("the sampler audit needs q < 1: batch size below the number of rows")
        if self.microbatch_size < 1 or not self.canary_norm >= 1:
            raise InvalidConfigError("microbatch_size must be >= 1 and canary_norm >= 1")


def model_seed(seed: int, model: int) -> int:
    """The sampler seed of model ``model`` of an audit seeded with ``seed`` (its own sampling stream)."""
    return int(stream_rng(seed, Stream.SAMPLING, model).integers(2**63))


def sampled_batches(
    plan: PrivacyPlan, *, seed: int, num_models: int, microbatch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every model's batches from the plan's sampler: indices and masks ``[models, T, micro, slots]``."""
    indices, masks = [], []
    for model in range(num_models):
        sampler = plan.sampler(seed=model_seed(seed, model), microbatch_size=microbatch_size)
        batches = [sampler.sample(t) for t in range(plan.steps)]
        indices.append(np.stack([b.indices for b in batches]))
        masks.append(np.stack([b.mask for b in batches]))
    return np.stack(indices), np.stack(masks)


def likelihood_ratio(observed: jax.Array, *, sampling_rate: float, noise_multiplier: float) -> jax.Array:
    """log of the accounted mechanism's likelihood ratio for one step's observation ``I_t + sigma xi_t``."""
    shift = (observed - 0.5) / noise_multiplier**2
    return jnp.logaddexp(math.log1p(-sampling_rate), math.log(sampling_rate) + shift)


def sampler_scores(
    features: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    member: np.ndarray,
    *,
    setup: SamplerAuditSetup,
    seed: int,
    chunk_size: int = 256,
    on_chunk: Callable[[int], None] | None = None,
) -> np.ndarray:
    """One likelihood-ratio score per model (``member[i]``: model i's canary slot holds the canary).

    Rows 0 .. N-2 of ``features`` are D; row N-1 (N = ``plan.num_examples``) is the canary's slot.
    A feature column of zeros is appended to D: the canary's direction, which D never moves.
    """
    plan = setup.plan
    n = plan.num_examples
    if len(labels) < n - 1:
        raise InvalidConfigError(f"the plan samples {n} rows (D and the canary's slot); got {len(labels)} rows for D")
    flat = np.asarray(features[: n - 1], np.float32).reshape(n - 1, -1)
    x = np.zeros((n, flat.shape[1] + 1), np.float32)
    x[: n - 1, :-1] = flat
    x, y = jnp.asarray(x), jnp.asarray(np.r_[np.asarray(labels[: n - 1]), 0], jnp.int32)
    loss_fn, init = softmax_regression(num_classes, x[:1])
    shapes = jax.eval_shape(init, jax.random.key(0))
    direction = {
        "kernel": jnp.zeros(shapes["kernel"].shape).at[-1, 0].set(1.0),
        "bias": jnp.zeros(shapes["bias"].shape),
    }
    canary = jax.tree_util.tree_map(lambda u: u * setup.canary_norm * setup.clip_norm, direction)
    dp_step = plan.dp_step(
        loss_fn,
        seed=seed,
        clip_norm=setup.clip_norm,
        optimizer=optax.sgd(setup.learning_rate),
        ema_decay=TrainingConfig.ema_decay,  # unused: the audit scores the parameters
        clipped_sum=lambda clip_norm: with_gradient_canary(
            softmax_regression_clipped_sum(clip_norm=clip_norm), canary, clip_norm=clip_norm
        ),
    )
    indices, masks = sampled_batches(plan, seed=seed, num_models=len(member), microbatch_size=setup.microbatch_size)
    is_canary = indices == n - 1
    masks = np.where(is_canary & ~np.asarray(member, bool)[:, None, None, None], 0.0, masks).astype(np.float32)
    rows = {"index": np.where(indices == PADDING_INDEX, 0, indices), "mask": masks}
    scale = plan.batch_size / setup.learning_rate

    def start(keys: ModelKeys, row: PyTree) -> tuple[Any, jax.Array]:
        return dp_step.init(init(keys.init)), jnp.zeros((), jnp.float32)

    def step(carry: tuple[Any, jax.Array], keys: ModelKeys, row: PyTree, t: jax.Array) -> tuple[Any, jax.Array]:
        state, score = carry
        index, mask = row["index"][t], row["mask"][t]
        total = dp_step.zero_sum(state)
        for m in range(index.shape[0]):
            batch = {"features": x[index[m]], "label": y[index[m]], "canary": (index[m] == n - 1).astype(jnp.float32)}
            total = dp_step.accumulate_pure(state.params, total, batch, mask[m], state.model_state)
        new_state, _ = dp_step.apply_pure(state, total, keys.noise)
        moved = jax.tree_util.tree_map(jnp.subtract, state.params, new_state.params)
        observed = (
            sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(moved), jax.tree_util.tree_leaves(direction)))
            * scale
        )
        return new_state, score + likelihood_ratio(
            observed, sampling_rate=plan.sampling_rate, noise_multiplier=plan.noise_multiplier
        )

    chunks = run_models(
        rows,
        seed=seed,
        steps=plan.steps,
        start=start,
        step=step,
        finish=lambda carries: carries[1],
        chunk_size=chunk_size,
        on_chunk=on_chunk,
    )
    return np.concatenate(chunks).astype(np.float64)


def profile_margin(fpr: float, fnr: float, deltas: np.ndarray) -> float:
    """How far (FPR, FNR) lies outside the region an (eps, deltas[eps])-DP mechanism allows (> 0: outside)."""
    weight = np.exp(EPSILON_GRID)
    allowed = np.minimum(fpr + weight * fnr, fnr + weight * fpr)
    return float(np.max((1 - deltas) - allowed))


class _Profiles:
    """delta(eps) on ``EPSILON_GRID`` of the plan's mechanism at other sampling rates, built once each."""

    def __init__(self, plan: PrivacyPlan, discretization: float) -> None:
        self.plan, self.discretization = plan, discretization
        self._built: dict[float, np.ndarray] = {}

    def __call__(self, rate: float) -> np.ndarray:
        if rate not in self._built:
            truncation = self.plan.truncation
            self._built[rate] = privacy_profile(
                noise_multiplier=self.plan.noise_multiplier,
                sampling_rate=rate,
                steps=self.plan.steps,
                epsilons=EPSILON_GRID,
                discretization=self.discretization,
                truncation=None if truncation is None else (truncation.dataset_size, truncation.capacity),
            )
        return self._built[rate]


def _rates(
    in_scores: np.ndarray, out_scores: np.ndarray, threshold: float, alpha: float
) -> tuple[int, int, float, float]:
    false_pos, false_neg = int(np.sum(out_scores >= threshold)), int(np.sum(in_scores < threshold))
    return (
        false_pos,
        false_neg,
        audit_bounds.clopper_pearson_upper(false_pos, len(out_scores), alpha=alpha),
        audit_bounds.clopper_pearson_upper(false_neg, len(in_scores), alpha=alpha),
    )


def rate_lower_bound(fpr: float, fnr: float, profiles: _Profiles, *, rate: float, iterations: int = 8) -> float:
    """The largest q' (within a factor 2^(1/2^iterations)) whose mechanism (FPR, FNR) still violates; 0 if none
    from q / 16 up (the profile only widens with q', so the violated rates form an interval from 0)."""
    low, high = math.log(rate / 16), math.log(min(1.0, rate * 16))
    if profile_margin(fpr, fnr, profiles(math.exp(low))) <= 0:
        return 0.0
    if profile_margin(fpr, fnr, profiles(math.exp(high))) > 0:
        return math.exp(high)
    for _ in range(iterations):
        middle = (low + high) / 2
        if profile_margin(fpr, fnr, profiles(math.exp(middle))) > 0:
            low = middle
        else:
            high = middle
    return math.exp(low)


def sampler_statistics(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    setup: SamplerAuditSetup,
    delta: float,
    confidence: float,
    holdout_fraction: float,
) -> dict[str, Any]:
    """Threshold on the held-out models (the largest margin there), bounds and verdict on the others."""
    plan = setup.plan
    profiles = _Profiles(plan, setup.discretization)
    accounted = profiles(plan.sampling_rate)
    alpha = (1 - confidence) / 2  # FPR and FNR bounds hold together with probability >= confidence
    n_in, n_out = int(len(in_scores) * holdout_fraction), int(len(out_scores) * holdout_fraction)
    held_in, held_out = in_scores[:n_in], out_scores[:n_out]
    candidates = np.unique(np.quantile(np.r_[held_in, held_out], np.linspace(0.0, 1.0, 401)))
    margins = [profile_margin(*_rates(held_in, held_out, t, alpha)[2:], accounted) for t in candidates]
    threshold = float(candidates[int(np.argmax(margins))])
    test_in, test_out = in_scores[n_in:], out_scores[n_out:]
    false_pos, false_neg, fpr, fnr = _rates(test_in, test_out, threshold, alpha)
    margin = profile_margin(fpr, fnr, accounted)
    rate_lb = rate_lower_bound(fpr, fnr, profiles, rate=plan.sampling_rate)
    return {
        "threshold": threshold,
        "false_positives": false_pos,
        "negatives": len(test_out),
        "false_negatives": false_neg,
        "positives": len(test_in),
        "fpr_upper": fpr,
        "fnr_upper": fnr,
        "profile_margin": margin,
        "sampling_rate_lower_bound": rate_lb,
        "rate_fraction": rate_lb / plan.sampling_rate,
        "epsilon_lower_bound": audit_bounds.epsilon_from_rates(fpr, fnr, delta=delta),
        "violation": bool(margin > 0),
    }


def sampler_row(
    features: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    *,
    setup: SamplerAuditSetup,
    nominal_epsilon: float,
    delta: float,
    num_models: int,
    confidence: float,
    holdout_fraction: float,
    seed: int,
    chunk_size: int = 256,
    bar: Bar | None = None,
) -> dict[str, Any]:
    """One sampler-audit row: ``num_models`` models (half with the canary) -> verdict and bounds."""
    member = np.arange(num_models) % 2 == 0  # interleaved: holdout and test both get half of each
    started = time.perf_counter()
    scores = sampler_scores(
        features,
        labels,
        num_classes,
        member,
        setup=setup,
        seed=seed,
        chunk_size=chunk_size,
        on_chunk=None if bar is None else bar.advance,
    )
    plan = setup.plan
    row = {
        "threat_model": "sampler",
        "model": "linear",
        "num_examples": plan.num_examples,
        "nominal_epsilon": nominal_epsilon,
        "delta": delta,
        "noise_multiplier": plan.noise_multiplier,
        "batch_size": plan.batch_size,
        "sampling_rate": plan.sampling_rate,
        "batch_capacity": plan.capacity,
        "steps": plan.steps,
        "num_models": num_models,
        "confidence": confidence,
        **sampler_statistics(
            scores[member],
            scores[~member],
            setup=setup,
            delta=delta,
            confidence=confidence,
            holdout_fraction=holdout_fraction,
        ),
    }
    row["cp_max_certifiable_epsilon"] = audit_bounds.cp_max_certifiable_epsilon(
        positives=row["positives"], negatives=row["negatives"], delta=delta, confidence=confidence
    )
    row["estimators"] = {"profile": row["sampling_rate_lower_bound"], "clopper-pearson": row["epsilon_lower_bound"]}
    row["best_estimator"], row["best_lower_bound"] = "clopper-pearson", row["epsilon_lower_bound"]
    row["cp_cannot_detect"] = False  # the profile test has no such ceiling: it compares rates, not epsilon
    row["seconds"] = time.perf_counter() - started
    return row
