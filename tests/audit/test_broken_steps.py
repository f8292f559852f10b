"""A broken step or sampler reaches an audit as a plan with other parts, and only that plan."""

import dataclasses

import jax.numpy as jnp
import optax
import pytest

from dpscale.audit.broken_steps import DoubleRate, HalfNoise, with_parts
from dpscale.errors import InvalidConfigError
from dpscale.privacy.dpsgd import DpsgdStep
from dpscale.privacy.plan import MechanismParts, PrivacyPlan
from dpscale.privacy.sampling import PoissonSampler

PLAN = PrivacyPlan(num_examples=100, batch_size=10, steps=5, noise_multiplier=2.0, delta=1e-5)


def _loss(params, model_state, batch):
    return jnp.sum(params["w"] * batch["x"])


def _step(plan):
    return plan.dp_step(_loss, seed=0, clip_norm=1.0, optimizer=optax.sgd(1.0), ema_decay=0.9)


def test_a_plan_with_a_broken_step_builds_it_and_the_original_plan_does_not():
    broken = _step(with_parts(PLAN, step=HalfNoise))
    real = _step(PLAN)
    assert type(broken) is HalfNoise and type(real) is DpsgdStep
    assert broken.noise_std == real.noise_std / 2 == 0.1


def test_a_plan_with_a_broken_sampler_builds_it():
    sampler = with_parts(PLAN, sampler=DoubleRate).sampler(seed=0, microbatch_size=8)
    assert type(sampler) is DoubleRate and type(PLAN.sampler(seed=0, microbatch_size=8)) is PoissonSampler


def test_only_a_dp_step_or_a_poisson_sampler_can_be_a_part():
    with pytest.raises(TypeError, match="DpsgdStep"):
        MechanismParts(step=object)
    with pytest.raises(TypeError, match="PoissonSampler"):
        MechanismParts(poisson_sampler=object)


def test_a_plan_with_other_parts_is_never_recorded_as_a_run():
    assert PrivacyPlan(**PLAN.to_json()) == PLAN
    with pytest.raises(InvalidConfigError, match="substituted parts"):
        with_parts(PLAN, step=HalfNoise).to_json()
    assert dataclasses.replace(with_parts(PLAN, step=HalfNoise), parts=MechanismParts()).to_json() == PLAN.to_json()
