"""The white-box audit has teeth: it flags broken privatisers at nominal epsilon 2 and 4, never the real one.

Broken steps run as plans with other parts (``audit.broken_steps.with_parts``):
half the noise, a sensitivity bug (noise for the mean gradient, then divided by B again),
and noise added once per micro-batch with the per-step std split linearly over the
micro-batches (total std sigma / sqrt(K)). One bug sits below the step, in the clipping
library: the canary's clipping path not clipping (``clipping.clip_weights`` without the
max), monkeypatched here.

Each row: 12,000 models of a tiny linear model (|D| = 8, T = 4, K = 2 micro-batches, q = 1).
At confidence 1 - 1e-6 the correct code is flagged with probability <= 1e-6 per row (the
GDP bound is exact for this statistic); the weakest bug (per-micro-batch noise, mu x sqrt 2)
sits about 6 standard errors above the flag line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.audit.broken_steps import HalfNoise, NoiseOverBTwice, with_parts
from dpscale.audit.whitebox import WhiteBoxSetup, white_box_row
from dpscale.privacy import clipping
from dpscale.privacy.dpsgd import DpsgdStep, data_mesh
from dpscale.privacy.noise import add_gaussian_noise, step_key
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget

N, DIM, CLASSES, STEPS, MICRO, DELTA = 8, 16, 3, 4, 2, 1e-5
MODELS, CONFIDENCE = 12_000, 1 - 1e-6


class NoisePerMicrobatch(DpsgdStep):
    """Noise added once per micro-batch (MICRO draws per step), each with the step's std / MICRO.

    The draws are made where the real step makes its one draw; their sum is what reaches the
    update, exactly as if each had been added to its micro-batch's clipped sum.
    """

    def _privatize_impl(self, total, step, base_key):
        std = self.noise_multiplier * total.sensitivity / MICRO
        noisy = total.summed()
        for key in jax.random.split(step_key(base_key, step), MICRO):
            noise = add_gaussian_noise(jax.tree_util.tree_map(jnp.zeros_like, total.value), key, std=std)
            noisy = jax.tree_util.tree_map(jnp.add, noisy, noise)
        return jax.tree_util.tree_map(lambda x: x / self.expected_batch_size, noisy)


def _unclip_the_canary_path(monkeypatch):
    def clip_weights(norms, mask, *, clip_norm, scale=None):
        finite = jnp.isfinite(norms)
        return jnp.where(finite & (mask > 0), 1.0 / clip_norm, 0.0).astype(jnp.float32), finite

    monkeypatch.setattr(clipping, "clip_weights", clip_weights)


STEP_BUGS = {"half-noise": HalfNoise, "noise-over-B-twice": NoiseOverBTwice, "noise-per-microbatch": NoisePerMicrobatch}


@pytest.fixture(scope="module")
def tiny():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, DIM)).astype(np.float32)
    x[:, 3] = 0.0  # a feature D never uses: the canary's direction
    return x, rng.integers(0, CLASSES, N).astype(np.int32)


def _row(tiny, epsilon, seed=11, mesh=None, step=DpsgdStep):
    plan = PrivacyPlan.calibrate(PrivacyTarget(epsilon, DELTA), num_examples=N, batch_size=N, steps=STEPS)
    plan = with_parts(plan, step=step)
    setup = WhiteBoxSetup(plan=plan, clip_norm=2.0, learning_rate=0.5, microbatches=MICRO)
    return white_box_row(
        *tiny,
        CLASSES,
        setup=setup,
        nominal_epsilon=plan.epsilon(),
        delta=DELTA,
        num_models=MODELS,
        confidence=CONFIDENCE,
        holdout_fraction=0.5,
        seed=seed,
        chunk_size=MODELS,
        mesh=mesh,
    )


@pytest.mark.parametrize("epsilon", [2.0, 4.0])
def test_correct_code_is_not_flagged_and_the_bound_is_tight(tiny, epsilon):
    row = _row(tiny, epsilon)
    assert not row["violation"], row
    assert row["best_estimator"] == "gdp"
    assert 0.6 * row["nominal_epsilon"] <= row["gdp_epsilon_lower_bound"] <= row["nominal_epsilon"]
    assert row["mu_estimate"] == pytest.approx(row["mu_nominal"], abs=0.1)  # the statistic is exact


@pytest.mark.parametrize("epsilon", [2.0, 4.0])
@pytest.mark.parametrize("bug", [*STEP_BUGS, "canary-path-unclipped"])
def test_bug_is_flagged(tiny, epsilon, bug, monkeypatch):
    if bug in STEP_BUGS:
        row = _row(tiny, epsilon, step=STEP_BUGS[bug])
    else:
        _unclip_the_canary_path(monkeypatch)
        row = _row(tiny, epsilon)
    assert row["violation"], row
    assert row["gdp_epsilon_lower_bound"] > row["nominal_epsilon"]


@pytest.mark.parametrize("bug", ["none", "half-noise"])
def test_four_device_step_has_teeth(tiny, bug):
    """The sharded step (micro-batches split over 4 devices, clipped sums psum'd, noise added once)."""
    row = _row(tiny, 4.0, mesh=data_mesh(jax.devices()[:4]), step=HalfNoise if bug == "half-noise" else DpsgdStep)
    assert row["devices"] == 4
    assert row["violation"] == (bug == "half-noise"), row
    if bug == "none":
        assert 0.6 * row["nominal_epsilon"] <= row["gdp_epsilon_lower_bound"] <= row["nominal_epsilon"]


@pytest.mark.parametrize("bug", ["none", "half-noise"])
def test_cnn_step_with_per_layer_ghost_norms_has_teeth(bug):
    """The CNN's clipped sum by per-layer norms (ghost and book-keeping layers): half noise is flagged."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(N, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, N).astype(np.int32)
    plan = PrivacyPlan.calibrate(PrivacyTarget(4.0, DELTA), num_examples=N, batch_size=N, steps=3)
    setup = WhiteBoxSetup(
        plan=with_parts(plan, step=HalfNoise if bug == "half-noise" else DpsgdStep),
        model="cnn",
        clip_norm=2.0,
        learning_rate=0.5,
        microbatches=MICRO,
        channels=(4,),
        num_groups=2,
        per_example="ghost",
    )
    row = white_box_row(
        images.reshape(N, -1),
        labels,
        CLASSES,
        setup=setup,
        nominal_epsilon=plan.epsilon(),
        delta=DELTA,
        num_models=2_000,
        confidence=CONFIDENCE,
        holdout_fraction=0.5,
        seed=11,
        chunk_size=2_000,
        image_shape=(8, 8, 1),
    )
    assert row["violation"] == (bug == "half-noise"), row
    if bug == "none":
        assert 0.5 * row["nominal_epsilon"] <= row["gdp_epsilon_lower_bound"] <= row["nominal_epsilon"]
