"""A private selection's accounting: Papernot & Steinke's closed forms, dp-accounting, and its calibration."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from dpscale.errors import InfeasiblePrivacyTargetError, InvalidConfigError
from dpscale.privacy import calibration
from dpscale.privacy.accounting import Truncation, make_accountant
from dpscale.privacy.plan import PrivacyTarget
from dpscale.privacy.rdp_accountant import RdpAccountant
from dpscale.privacy.repetitions import Repetitions
from dpscale.privacy.sampling import batch_capacity
from dpscale.privacy.selection import Selection, SelectionPlan, run_event, selection_epsilon, selection_event

ORDERS = np.asarray(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=float)


def _gaussian_rdp(sigma):
    """Q = one Gaussian mechanism of sensitivity 1: RDP lambda / (2 sigma^2) at every order (closed form)."""
    return ORDERS / (2 * sigma**2)


def _selected_rdp(sigma, repetitions):
    accountant = RdpAccountant()
    accountant.compose(selection_event(dp_accounting.GaussianDpEvent(sigma), repetitions))
    return accountant._rdp


def _monotone(rdp):
    """RDP is non-decreasing in the order: a bound at a higher order holds at a lower one."""
    return np.minimum.accumulate(rdp[::-1])[::-1]


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("mean", [2.0, 10.0])
def test_negative_binomial_is_papernot_steinke_theorem_2(shape, mean):
    """eps'(l) = eps(l) + (1 + eta)(1 - 1/l^) eps(l^) + (1 + eta) log(1/gamma) / l^ + log E[K] / (l - 1),
    the best l^, written out here from the paper for a Gaussian Q, on dp-accounting's orders."""
    sigma = 3.0
    reps = Repetitions("negative-binomial", mean, shape)
    eps = _gaussian_rdp(sigma)
    gamma = dp_accounting.rdp.rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean)
    hat = np.min((1 + shape) * ((1 - 1 / ORDERS) * eps + math.log(1 / gamma) / ORDERS))
    with np.errstate(divide="ignore"):
        theorem = np.where(ORDERS > 1, eps + hat + math.log(mean) / (ORDERS - 1), np.inf)
    assert np.allclose(_selected_rdp(sigma, reps), _monotone(theorem), rtol=1e-12)


def test_geometric_repetitions_of_a_pure_dp_mechanism_cost_at_most_three_times_its_epsilon():
    """Liu & Talwar (2019), the paper's Theorem 2 at eta = 1 as the order grows: 3 eps."""
    laplace = dp_accounting.LaplaceDpEvent(1.0)  # eps = 1 pure DP
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(laplace, 10.0, 1.0))
    gamma, top = Repetitions(mean=10.0).gamma, ORDERS[-1]  # at l = l^ = the top order, with eps(l) <= 1:
    bound = 1 + 2 * (1 - 1 / top) + 2 * math.log(1 / gamma) / top + math.log(10.0) / (top - 1)
    assert 2.99 < accountant._rdp[-1] <= bound + 1e-12 and bound < 3.01


@pytest.mark.parametrize("mean", [3.0, 10.0])
def test_poisson_is_papernot_steinke_theorem_6(mean):
    """eps'(l) = eps(l) + mu delta^ + log(mu) / (l - 1), delta^ a delta of Q at eps^ = log(1 + 1/(l - 1)).

    dp-accounting takes delta^ from Q's RDP curve. The exact delta of the Gaussian mechanism is smaller, and the
    plain RDP conversion exp((l' - 1)(eps(l') - eps^)) larger: the bound lies between the theorem with each."""
    sigma = 3.0
    eps = _gaussian_rdp(sigma)
    found = _selected_rdp(sigma, Repetitions("poisson", mean))
    mu = 1 / sigma

    def exact_delta(e):
        return stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)

    def plain_delta(e):
        with np.errstate(over="ignore"):
            return min(1.0, float(np.min(np.exp((ORDERS[ORDERS > 1] - 1) * (eps[ORDERS > 1] - e)))))

    for i, order in enumerate(ORDERS):
        if order <= 1:
            continue
        hat = math.log1p(1 / (order - 1))
        low = eps[i] + mean * exact_delta(hat) + math.log(mean) / (order - 1)
        high = eps[i] + mean * plain_delta(hat) + math.log(mean) / (order - 1)
        assert low - 1e-12 <= found[i] <= high + 1e-12, order


def test_a_selection_is_dp_accountings_repeat_and_select_of_one_run():
    selection = Selection(Repetitions(mean=8.0), score_noise=10.0)
    run = run_event(noise_multiplier=2.0, sampling_rate=0.05, steps=400, score_noise=10.0, releases=(20.0,))
    stock = dp_accounting.rdp.RdpAccountant()
    stock.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(run, 8.0, 1.0))
    ours = selection_epsilon(
        noise_multiplier=2.0, sampling_rate=0.05, steps=400, delta=1e-5, selection=selection, releases=(20.0,)
    )
    assert ours == stock.get_epsilon(1e-5)
    one_run = dp_accounting.rdp.RdpAccountant().compose(run).get_epsilon(1e-5)
    assert one_run < ours < 8 * one_run  # far below a fixed 8 runs' composition


def test_the_pld_accountant_has_no_answer_for_a_selection():
    """Why the RDP accountant: dp-accounting's PLD accountant refuses repeat-and-select (docs/privacy.md)."""
    run = run_event(noise_multiplier=2.0, sampling_rate=0.05, steps=10, score_noise=10.0)
    assert not make_accountant("pld").supports(selection_event(run, Repetitions()))


def test_epsilon_falls_with_the_noise_and_grows_with_the_runs_and_the_scores():
    base = dict(sampling_rate=0.05, steps=200, delta=1e-5)
    eps = [selection_epsilon(noise_multiplier=s, selection=Selection(), **base) for s in (1.0, 1.5, 3.0)]
    assert eps[0] > eps[1] > eps[2]
    more = selection_epsilon(noise_multiplier=1.5, selection=Selection(Repetitions(mean=50.0)), **base)
    louder = selection_epsilon(noise_multiplier=1.5, selection=Selection(score_noise=2.0), **base)
    assert more > eps[1] and louder > eps[1]


@pytest.mark.parametrize("knob", ["noise_multiplier", "steps", "batch_size"])
def test_calibration_meets_the_target_and_stops_one_tolerance_short_of_it(knob):
    n, target = 20000, PrivacyTarget(epsilon=4.0, delta=1e-5, accountant="rdp")
    selection = Selection(Repetitions(mean=5.0), score_noise=10.0)
    given = {"batch_size": 1000, "steps": 300, "noise_multiplier": 2.0}
    given.pop(knob)
    plan = SelectionPlan.calibrate(target, selection, num_examples=n, releases=(20.0,), **given)
    assert plan.epsilon() <= 4.0 and plan.run.batch_capacity > plan.run.batch_size
    run = plan.run
    stds = next(k for k in calibration.CAPACITY_LADDER if batch_capacity(n, run.batch_size, stds=k) == run.capacity)

    def spent(sigma=run.noise_multiplier, steps=run.steps, batch=run.batch_size):
        return selection_epsilon(
            noise_multiplier=sigma,
            sampling_rate=batch / n,
            steps=steps,
            delta=1e-5,
            selection=selection,
            releases=(20.0,),
            truncation=Truncation(n, batch_capacity(n, batch, stds=stds)),
        )

    assert spent() == plan.epsilon()
    beyond = {
        "noise_multiplier": dict(sigma=run.noise_multiplier * (1 - calibration.DEFAULT_RTOL)),
        "steps": dict(steps=run.steps + 1),
        "batch_size": dict(batch=run.batch_size + 1),
    }[knob]
    assert spent(**beyond) > 4.0  # the next value out is over the target: the answer is tight


def test_a_target_the_scores_and_repetitions_alone_exceed_is_refused_in_one_line():
    with pytest.raises(InfeasiblePrivacyTargetError, match="--score-noise"):
        SelectionPlan.calibrate(
            PrivacyTarget(epsilon=0.05, delta=1e-5),
            Selection(score_noise=1.0),
            num_examples=10000,
            batch_size=100,
            steps=10,
        )
    with pytest.raises(InvalidConfigError, match="Poisson sampling"):
        SelectionPlan.calibrate(
            PrivacyTarget(epsilon=4.0, sampling="shuffle"), Selection(), num_examples=1000, batch_size=10, steps=5
        )


def test_a_plan_round_trips_through_json():
    plan = SelectionPlan.calibrate(
        PrivacyTarget(epsilon=3.0, delta=1e-5, accountant="rdp"),
        Selection(Repetitions("poisson", 4.0), score_noise=5.0),
        num_examples=5000,
        batch_size=500,
        steps=100,
    )
    again = SelectionPlan.from_json(plan.to_json())
    assert again == plan and again.epsilon() == plan.epsilon()
