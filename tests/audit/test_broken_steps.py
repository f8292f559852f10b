"""The seam for a deliberately broken step: the plan builds it inside the block only."""

import jax.numpy as jnp
import pytest

from dpscale.audit.broken_steps import HalfNoise, NoiseOverBTwice, substituted_step
from dpscale.privacy.dpsgd import DpsgdStep
from dpscale.privacy.plan import PrivacyPlan

PLAN = PrivacyPlan(num_examples=100, batch_size=10, steps=5, noise_multiplier=2.0, delta=1e-5)


def _loss(params, model_state, batch):
    return jnp.sum(params["w"] * batch["x"])


def test_the_plan_builds_the_substituted_step_inside_the_block_only():
    with substituted_step(HalfNoise):
        broken = PLAN.dp_step(_loss, seed=0)
    real = PLAN.dp_step(_loss, seed=0)
    assert type(broken) is HalfNoise and type(real) is DpsgdStep
    assert broken.noise_std == real.noise_std / 2 == 0.1


def test_the_real_step_comes_back_after_an_error():
    with pytest.raises(RuntimeError), substituted_step(NoiseOverBTwice):
        raise RuntimeError("an audit failed")
    assert type(PLAN.dp_step(_loss, seed=0)) is DpsgdStep


def test_only_a_dp_step_can_be_substituted():
    with pytest.raises(TypeError, match="DpsgdStep"), substituted_step(object):
        pass
