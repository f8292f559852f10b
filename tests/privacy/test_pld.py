"""PLD of bounded size: the default grid where it fits, a coarser one (still an upper bound) where not,
and RDP where PLD cannot answer; epsilon is the smaller of both."""

import math

import dp_accounting
import pytest

from dpscale.errors import InfeasiblePrivacyTargetError
from dpscale.privacy import calibration, pld
from dpscale.privacy.accounting import EpsilonCurve


def _dp_accounting_pld(sigma, q, steps, delta):
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    return acc.compose(dp_accounting.SelfComposedDpEvent(event, steps)).get_epsilon(delta)


def _rdp(sigma, q, steps, delta):
    return EpsilonCurve(noise_multiplier=sigma, sampling_rate=q, delta=delta, accountant="rdp")(steps)


def test_the_grid_is_the_default_where_it_fits_and_a_power_of_two_coarser_where_not():
    assert pld.discretization(step_span=5.0, composed_span=40.0) == pld.DEFAULT_DISCRETIZATION
    coarse = pld.discretization(step_span=500.0, composed_span=40.0)
    assert coarse >= 500.0 / pld.MAX_STEP_POINTS
    assert math.log2(coarse / pld.DEFAULT_DISCRETIZATION) == int(math.log2(coarse / pld.DEFAULT_DISCRETIZATION))
    assert pld.discretization(step_span=5.0, composed_span=1e6) >= 1e6 / pld.MAX_COMPOSED_POINTS
    assert pld.discretization(step_span=5.0, composed_span=math.inf) is None
    assert pld.discretization(step_span=1e12, composed_span=1.0) is None


def test_step_loss_span_is_the_grid_dp_accounting_builds():
    width, high = pld.step_loss_span(1.0, 256 / 50_000)
    assert 0 < high <= width and 4.9 < width < 5.1  # 49,831 points at 1e-4


def test_a_coarser_grid_is_a_slightly_looser_upper_bound(monkeypatch):
    sigma, q, steps, delta = 1.1, 256 / 60_000, 2_000, 1e-5
    fine = _dp_accounting_pld(sigma, q, steps, delta)
    monkeypatch.setattr(pld, "MAX_STEP_POINTS", 2**12)  # 3.8 nats wide: a grid 2^4 times coarser
    bounded = pld.BoundedPld(noise_multiplier=sigma, sampling_rate=q, releases=(), delta=delta)
    assert bounded.grid(40.0) == 16 * pld.DEFAULT_DISCRETIZATION
    coarse = bounded.epsilon(steps, composed_span=40.0)
    assert fine <= coarse <= fine * 1.05


def test_long_compositions_are_made_in_blocks_and_stay_an_upper_bound(monkeypatch):
    sigma, q, delta = 1.5, 0.01, 1e-5
    steps = 3 * 64 + 5
    direct = _dp_accounting_pld(sigma, q, steps, delta)
    monkeypatch.setattr(pld, "SPLIT_STEPS", 100)
    monkeypatch.setattr(pld, "SPLIT_BLOCK", 64)
    blocked = EpsilonCurve(noise_multiplier=sigma, sampling_rate=q, delta=delta)(steps)
    assert direct <= blocked <= direct * 1.001


def test_a_hundred_million_steps_of_a_narrow_step_answer_at_once():
    # dp-accounting alone computes 36 ** 10**8 as an exact integer here (minutes, gigabytes).
    curve = EpsilonCurve(noise_multiplier=32.657, sampling_rate=256 / 50_000, delta=1e-5)
    assert 7 < curve(10**8) < 8 and curve.bound(10**8) == "pld"


def test_tiny_sigma_answers_finitely_and_beats_rdp():
    curve = EpsilonCurve(noise_multiplier=1e-3, sampling_rate=256 / 50_000, delta=1e-5)
    assert math.isfinite(curve(1000)) and curve.bound(1000) == "pld"
    assert curve(1000) < _rdp(1e-3, 256 / 50_000, 1000, 1e-5)


@pytest.mark.parametrize("delta", [1e-14, 1e-15, 1e-20])
def test_below_min_delta_epsilon_is_rdp_and_finite(delta):
    curve = EpsilonCurve(noise_multiplier=0.95, sampling_rate=256 / 50_000, delta=delta)
    assert curve.bound(1000) == "rdp" and curve(1000) == _rdp(0.95, 256 / 50_000, 1000, delta)


def test_epsilon_is_the_smaller_bound():
    curve = EpsilonCurve(noise_multiplier=1.1, sampling_rate=256 / 60_000, delta=1e-5)
    assert curve.bound(2000) == "pld" and curve(2000) < _rdp(1.1, 256 / 60_000, 2000, 1e-5)


def test_calibration_at_delta_1e_15_is_no_worse_than_rdp():
    common = dict(target_epsilon=6.0, delta=1e-15, sampling_rate=256 / 50_000, steps=1000)
    pld_sigma = calibration.calibrate_noise_multiplier(accountant="pld", **common).value
    rdp_sigma = calibration.calibrate_noise_multiplier(accountant="rdp", **common).value
    assert pld_sigma <= rdp_sigma * (1 + 1e-9) and pld_sigma < 1.0


def test_releases_that_alone_exceed_the_target_are_refused_in_one_line():
    with pytest.raises(InfeasiblePrivacyTargetError, match="releases alone"):
        calibration.calibrate_noise_multiplier(
            target_epsilon=1.0, delta=1e-5, sampling_rate=0.01, steps=100, releases=(0.1,)
        )
