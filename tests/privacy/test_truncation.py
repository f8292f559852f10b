"""Truncated Poisson sampling is accounted exactly: dp-accounting's event, our RDP of it, and the plan's capacity."""

import dp_accounting
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy import calibration
from dpscale.privacy.accounting import RdpParts, Truncation, epsilon, rdp_epsilon, step_event, truncated_step_rdp
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget, composed_epsilon
from dpscale.privacy.sampling import batch_capacity


def _eps(sigma, q, steps, *, truncation=None, accountant="pld", delta=1e-5):
    return epsilon(
        noise_multiplier=sigma, sampling_rate=q, steps=steps, delta=delta, accountant=accountant, truncation=truncation
    )


def test_the_step_is_dp_accountings_truncated_event_on_the_larger_neighbour():
    truncation = Truncation(num_examples=1000, capacity=120)
    assert truncation.dataset_size == 1001
    assert step_event(
        noise_multiplier=1.3, sampling_rate=0.1, truncation=truncation
    ) == dp_accounting.TruncatedSubsampledGaussianDpEvent(1001, 0.1, 120, 1.3)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(1001, 0.1, 120, 1.3), 200
    )
    reference = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE).compose(event)
    assert _eps(1.3, 0.1, 200, truncation=truncation) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)


def test_the_larger_neighbour_is_the_worse_one():
    """Epsilon grows with the data-set size at fixed q and capacity: N + 1 covers the removal neighbour (N - 1)."""

    def pld(size):
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(size, 0.1, 105, 1.0), 100
        )
        return (
            dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
            .compose(event)
            .get_epsilon(1e-5)
        )

    values = [pld(size) for size in (999, 1000, 1001)]
    assert values == sorted(values) and values[0] < values[2]


def _pld(size, q, capacity, sigma, steps):
    """dp-accounting's epsilon for the pair whose larger data set has ``size`` examples."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(size, q, capacity, sigma), steps
    )
    return (
        dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        .compose(event)
        .get_epsilon(1e-5)
    )


@pytest.mark.parametrize("num_examples, batch_size", [(1430, 128), (200, 100), (100, 10)])
def test_from_the_batch_size_up_the_larger_neighbour_is_the_worse_one(num_examples, batch_size):
    """Where a capacity is allowed (at least B), N + 1 covers the removal neighbour; below B it does not."""
    q = batch_size / num_examples
    assert _pld(num_examples, q, batch_size, 3.0, 50) < _pld(num_examples + 1, q, batch_size, 3.0, 50)
    below = int(0.7 * batch_size)
    assert _pld(num_examples, q, below, 3.0, 50) > _pld(num_examples + 1, q, below, 3.0, 50)


def test_a_capacity_below_the_batch_size_is_refused_by_every_accounting_path():
    n, b, below = 1430, 128, 100
    q, truncation = b / n, Truncation(n, below)
    plan = PrivacyPlan(num_examples=n, batch_size=b, steps=200, noise_multiplier=1.0, delta=1e-5, batch_capacity=below)
    for compute in (
        lambda: _eps(1.0, q, 200, truncation=truncation),
        lambda: _eps(1.0, q, 200, truncation=truncation, accountant="rdp"),
        lambda: step_event(noise_multiplier=1.0, sampling_rate=q, truncation=truncation),
        lambda: RdpParts.of(noise_multiplier=1.0, sampling_rate=q, truncation=truncation),
        plan.epsilon,
        lambda: plan.ledger(steps_done=1),
        lambda: composed_epsilon([plan], delta=1e-5),
    ):
        with pytest.raises(InvalidConfigError, match="capacity 100 is below the expected batch size 128"):
            compute()
    Truncation(n, b).check_rate(q)  # B itself is allowed


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_truncation_costs_epsilon_and_the_cost_vanishes_as_the_capacity_grows(accountant):
    n, b, sigma, steps = 1000, 100, 1.0, 200
    untruncated = _eps(sigma, b / n, steps, accountant=accountant)
    costs = [
        _eps(sigma, b / n, steps, accountant=accountant, truncation=Truncation(n, capacity)) - untruncated
        for capacity in (100, 110, 125, 160)
    ]
    assert all(c >= -1e-6 * untruncated for c in costs)  # never below untruncated (up to the grid)
    assert costs[0] > costs[1] > costs[2] and costs[0] > 0.01 * untruncated
    assert abs(costs[-1]) < 1e-3 * untruncated


def test_rdp_of_a_step_never_truncated_is_the_poisson_step():
    parts = RdpParts.of(noise_multiplier=1.5, sampling_rate=0.01, truncation=Truncation(10_000, 10_000))
    np.testing.assert_array_equal(parts.step, parts.untruncated)
    assert parts.charge == 0.0


def test_truncated_rdp_lies_between_the_poisson_step_and_the_half_noise_step():
    truncation = Truncation(1000, 105)
    parts = RdpParts.of(noise_multiplier=1.0, sampling_rate=0.1, truncation=truncation)
    half = RdpParts.of(noise_multiplier=0.5, sampling_rate=0.1)
    p = truncation.probability(0.1)
    assert 0 < p == parts.charge < 1
    finite = np.isfinite(half.step)
    assert np.all(parts.step[finite] >= parts.untruncated[finite] * (1 - 1e-12) - 1e-12)
    assert np.all(parts.step[finite] <= half.step[finite] * (1 + 1e-12) + 1e-12)
    # At order 2 the bound is exactly the mixture of exp((alpha - 1) rdp).
    order = int(np.argmin(np.abs(parts.orders - 2.0)))
    assert parts.orders[order] == 2.0
    expected = np.log((1 - p) * np.exp(parts.untruncated[order]) + p * np.exp(half.step[order]))
    assert parts.step[order] == pytest.approx(expected, rel=1e-12)
    assert np.array_equal(
        truncated_step_rdp(
            parts.orders, parts.untruncated, noise_multiplier=1.0, sampling_rate=0.1, truncation=truncation
        ),
        parts.step,
    )


@pytest.mark.parametrize("stds", [6, 7])
def test_rdp_epsilon_is_the_smaller_of_the_mixture_and_the_delta_charge(stds):
    """A truncated run's RDP bound: its own per-order RDP, or the untruncated RDP at delta - T p."""
    n, b, steps, delta = 50_000, 500, 100, 1e-5
    truncation = Truncation(n, batch_capacity(n, b, stds=stds))
    parts = RdpParts.of(noise_multiplier=1.0, sampling_rate=b / n, truncation=truncation)
    assert 0 < steps * parts.charge < delta
    mixture = dp_accounting.rdp.compute_epsilon(parts.orders, steps * parts.step, delta)[0]
    charged = dp_accounting.rdp.compute_epsilon(parts.orders, steps * parts.untruncated, delta - steps * parts.charge)[
        0
    ]
    untruncated = dp_accounting.rdp.compute_epsilon(parts.orders, steps * parts.untruncated, delta)[0]
    bound = rdp_epsilon([(parts, steps)], delta)
    assert bound == min(mixture, charged) and bound >= untruncated


def test_capacity_stds_picks_the_cheapest_rung_within_the_allowed_cost():
    common = dict(num_examples=50_000, batch_size=500, steps=1000, delta=1e-5)
    k = calibration.capacity_stds(noise_multiplier=1.0, **common)
    assert k in calibration.CAPACITY_LADDER
    untruncated = _eps(1.0, 0.01, 1000)
    chosen = _eps(1.0, 0.01, 1000, truncation=Truncation(50_000, batch_capacity(50_000, 500, stds=k)))
    assert chosen <= untruncated * (1 + 2 * calibration.TRUNCATION_COST)
    lower = calibration.CAPACITY_LADDER.index(k) - 1
    if lower >= 0:  # the rung below costs more than allowed
        cheaper = _eps(
            1.0,
            0.01,
            1000,
            truncation=Truncation(50_000, batch_capacity(50_000, 500, stds=calibration.CAPACITY_LADDER[lower])),
        )
        assert cheaper > untruncated * (1 + calibration.TRUNCATION_COST / 2)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(batch_size=500, steps=1000),
        dict(noise_multiplier=1.0, steps=1000),
        dict(noise_multiplier=1.0, batch_size=500),
    ],
)
def test_a_calibrated_plan_meets_the_target_with_its_truncation_and_records_its_capacity(knobs):
    plan = PrivacyPlan.calibrate(PrivacyTarget(2.0, 1e-5), num_examples=50_000, **knobs)
    assert plan.batch_capacity == plan.capacity > plan.batch_size
    assert plan.epsilon() <= 2.0
    assert plan.epsilon() == _eps(plan.noise_multiplier, plan.sampling_rate, plan.steps, truncation=plan.truncation)
    ledger = plan.ledger(steps_done=plan.steps)
    assert ledger.batch_capacity == plan.capacity and ledger.epsilon_spent == plan.epsilon()
    sampler = plan.sampler(seed=0, microbatch_size=128)
    assert sampler.capacity == plan.capacity and sampler.layout == plan.layout(128)


def test_a_plan_without_a_recorded_capacity_uses_the_rule_and_resolves_to_it():
    plan = PrivacyPlan(num_examples=50_000, batch_size=500, steps=1000, noise_multiplier=1.0, delta=1e-5)
    k = calibration.capacity_stds(noise_multiplier=1.0, num_examples=50_000, batch_size=500, steps=1000, delta=1e-5)
    assert plan.capacity == batch_capacity(50_000, 500, stds=k)
    resolved = plan.resolved()
    assert resolved.batch_capacity == plan.capacity and resolved.epsilon() == plan.epsilon()
    smaller = PrivacyPlan(
        num_examples=50_000, batch_size=500, steps=1000, noise_multiplier=1.0, delta=1e-5, batch_capacity=510
    )
    assert smaller.epsilon() > plan.epsilon()
