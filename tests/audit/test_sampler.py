"""The sampler audit at q < 1 has teeth: twice the accounted rate and shuffling accounted as Poisson are flagged,
the real truncated Poisson sampler is not, and it comes close to the accounted rate."""

import numpy as np
import pytest

from dpscale.audit.broken_steps import DoubleRate, ShuffledAsPoisson, with_parts
from dpscale.audit.sampler import SamplerAuditSetup, likelihood_ratio, profile_margin, sampler_row
from dpscale.errors import InvalidConfigError
from dpscale.privacy.plan import PrivacyPlan

ROWS, BATCH, MODELS = 60, 6, 400  # plan rows: D (59) and the canary's slot; T = one epoch
#: Little noise per step, so an inclusion is plainly visible: where samplers differ most.
PLAN = PrivacyPlan(num_examples=ROWS, batch_size=BATCH, steps=ROWS // BATCH, noise_multiplier=0.25, delta=1e-5)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS - 1, 6)).astype(np.float32), rng.integers(0, 3, size=ROWS - 1)


def _audit(data, seed=1, plan=PLAN):
    features, labels = data
    setup = SamplerAuditSetup(plan=plan, learning_rate=1.0)
    return sampler_row(
        features,
        labels,
        3,
        setup=setup,
        nominal_epsilon=PLAN.epsilon(),
        delta=1e-5,
        num_models=MODELS,
        confidence=0.95,
        holdout_fraction=0.5,
        seed=seed,
    )


def test_the_real_sampler_is_not_flagged_and_comes_close_to_its_rate(data):
    row = _audit(data)
    assert not row["violation"], row
    assert row["profile_margin"] <= 0 and 0.3 <= row["rate_fraction"] <= 1.0, row
    assert row["batch_capacity"] == PLAN.capacity


@pytest.mark.parametrize("broken", [DoubleRate, ShuffledAsPoisson])
def test_a_sampler_unlike_the_accounted_one_is_flagged(data, broken):
    row = _audit(data, plan=with_parts(PLAN, sampler=broken))
    assert row["violation"] and row["profile_margin"] > 0 and row["rate_fraction"] > 1.0, row


def test_the_verdict_compares_rates_with_the_whole_profile():
    grid = np.zeros(65)  # a mechanism with delta(eps) = 0 everywhere: perfect privacy
    assert profile_margin(0.5, 0.5, grid) <= 0 and profile_margin(0.1, 0.1, grid) > 0
    assert profile_margin(0.1, 0.1, np.ones(65)) <= 0  # delta 1 allows anything


def test_the_statistic_is_the_accounted_likelihood_ratio():
    shifted = np.asarray(likelihood_ratio(np.array([1.0, 0.0]), sampling_rate=0.1, noise_multiplier=1.0))
    assert shifted[0] > 0 > shifted[1]
    np.testing.assert_allclose(shifted[0], np.log(0.9 + 0.1 * np.exp(0.5)), rtol=1e-6)  # float32


def test_a_full_batch_plan_is_refused():
    with pytest.raises(InvalidConfigError, match="q < 1"):
        SamplerAuditSetup(plan=PrivacyPlan(num_examples=10, batch_size=10, steps=1, noise_multiplier=1.0, delta=1e-5))
