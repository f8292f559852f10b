"""A step's work and wall time do not depend on the private data: the timing attack replayed.

The attack: per-step wall time against the realised Poisson batch size (it followed the number
of micro-batches) and against whether the step sampled a NaN row (a ``lax.cond`` took another
path). Here every step has one shape and one code path, checked structurally (identical
micro-batch shapes, no branch in the traced step) and by timing real steps with generous
statistical thresholds (the machine may be loaded: only a dependence on the data fails).
"""

import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dpscale.privacy.example_sum import weighted_tree_sum
from dpscale.privacy.linear import softmax_regression_clipped_sum
from dpscale.privacy.plan import PrivacyPlan
from dpscale.training.feeds import FeatureFeed
from dpscale.training.release import COVERED_STEP_FIELDS

N, DIM, CLASSES, BATCH, MICRO = 400, 32, 5, 100, 32
CANARY = 0  # the row holding NaN


def _setup():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(N, DIM)).astype(np.float32)
    features[CANARY] = np.nan
    labels = rng.integers(0, CLASSES, size=N)
    plan = PrivacyPlan(num_examples=N, batch_size=BATCH, steps=1000, noise_multiplier=1.0, delta=1e-5)
    model = nn.Dense(CLASSES)

    def loss_fn(params, model_state, batch):
        logits = model.apply({"params": params}, batch["features"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    step = plan.dp_step(
        loss_fn,
        seed=0,
        clip_norm=1.0,
        clipped_sum=lambda clip_norm: softmax_regression_clipped_sum(clip_norm=clip_norm),
        optimizer=optax.sgd(0.1),
        ema_decay=0.999,
    )
    params = model.init(jax.random.key(0), features[:1])["params"]
    return plan, step, step.init(params), FeatureFeed(features, labels)


def _has_branch(closed_jaxpr) -> bool:
    """Whether a traced program holds a data-dependent branch or loop (nested ones included)."""
    return re.search(r"\b(cond|switch|while)\[", str(closed_jaxpr)) is not None


def test_the_clipped_sums_have_no_branch_on_the_data():
    clipped = softmax_regression_clipped_sum(clip_norm=1.0)
    params = {"kernel": jnp.zeros((DIM, CLASSES)), "bias": jnp.zeros(CLASSES)}
    batch = {"features": jnp.zeros((8, DIM)), "label": jnp.zeros(8, jnp.int32)}
    assert not _has_branch(jax.make_jaxpr(lambda p, b, m: clipped(p, {}, b, m))(params, batch, jnp.ones(8)))
    grads = {"w": jnp.zeros((8, 3, 4))}
    assert _has_branch(jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0))  # it would see one
    assert not _has_branch(jax.make_jaxpr(weighted_tree_sum)(grads, jnp.ones(8), jnp.ones(8, bool)))


def test_per_step_time_is_not_a_default_output():
    assert "seconds" not in COVERED_STEP_FIELDS


def test_step_time_says_nothing_of_the_batch_size_or_a_nan_row():
    plan, step, state, feed = _setup()
    sampler = plan.sampler(seed=1, microbatch_size=MICRO)
    warm = feed.microbatches(sampler.sample(0), 0)
    for _ in range(3):
        state, _ = step.update(state, warm)
    jax.block_until_ready(state.params)
    sizes, nan_sampled, seconds, shapes = [], [], [], set()
    for t in range(1, 161):
        batch = sampler.sample(t)
        started = time.perf_counter()
        micro = feed.microbatches(batch, t)
        state, metrics = step.update(state, micro)
        jax.block_until_ready(state.params)
        seconds.append(time.perf_counter() - started)
        sizes.append(batch.size)
        nan_sampled.append(bool(np.any(batch.indices[batch.mask > 0] == CANARY)))
        shapes.add(tuple(tuple(x.shape for x in jax.tree_util.tree_leaves(m)) for m in micro))
    sizes, nan_sampled, seconds = np.array(sizes), np.array(nan_sampled), np.array(seconds)
    # Structure: one shape for every step, although the realised sizes span several micro-batches' worth.
    assert len(shapes) == 1
    assert len(set(-(-sizes // MICRO))) >= 2 and sizes.max() <= plan.capacity  # unpadded: several counts
    assert 10 <= nan_sampled.sum() <= 150  # q = 1/4: both kinds of step are well represented
    assert np.all(np.isfinite(np.asarray(state.params["kernel"])))  # the NaN row never reached the update
    # Timing: no detectable dependence (thresholds generous enough for a loaded machine).
    rho, p_size = stats.spearmanr(sizes, seconds)
    auc = stats.mannwhitneyu(seconds[nan_sampled], seconds[~nan_sampled]).statistic / (
        nan_sampled.sum() * (~nan_sampled).sum()
    )
    p_nan = stats.mannwhitneyu(seconds[nan_sampled], seconds[~nan_sampled]).pvalue
    assert p_size > 1e-3 or abs(rho) < 0.3, (rho, p_size)
    assert p_nan > 1e-3 or abs(auc - 0.5) < 0.15, (auc, p_nan)


@pytest.mark.parametrize("multiple", [1, 4])
def test_the_feed_gives_every_step_the_same_micro_batches(multiple):
    plan, _, _, feed = _setup()
    sampler = plan.sampler(seed=2, microbatch_size=MICRO, multiple=multiple)
    counts = {len(feed.microbatches(sampler.sample(t), t)) for t in range(40)}
    assert counts == {plan.layout(MICRO, multiple=multiple).num_microbatches}
