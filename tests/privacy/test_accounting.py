"""Accounting equals dp-accounting's own numbers and behaves like a privacy loss should."""

import dp_accounting
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy.accounting import EpsilonCurve, bounds_for, dp_event, epsilon
from dpscale.privacy.checks import check_batch_size, check_mechanism
from dpscale.privacy.plan import PrivacyPlan, composed_epsilon
from dpscale.privacy.pld import MIN_DELTA


def _eps(sigma, q, steps, delta=1e-5, accountant="pld", releases=(), truncation=None):
    return epsilon(
        noise_multiplier=sigma,
        sampling_rate=q,
        steps=steps,
        delta=delta,
        accountant=accountant,
        releases=releases,
        truncation=truncation,
    )


SETTINGS = [  # (sigma, q, steps, delta)
    (1.1, 256 / 60_000, 2_000, 1e-5),
    (3.0, 4096 / 50_000, 875, 1e-5),
    (2.5, 16384 / 1_281_167, 71_589, 8e-7),
    (1.5, 0.01, 50, 1e-6),
]


def _reference(accountant, sigma, q, steps, delta):
    """dp-accounting used directly, without any dpscale code."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if accountant == "pld":
        acc = dp_accounting.pld.PLDAccountant(relation)
    else:
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return acc.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("sigma,q,steps,delta", SETTINGS)
def test_epsilon_equals_dp_accounting(accountant, sigma, q, steps, delta):
    ours = _eps(sigma, q, steps, delta, accountant)
    assert ours == pytest.approx(_reference(accountant, sigma, q, steps, delta), rel=1e-12)
    assert 0 < ours < 100


def test_dp_event_is_poisson_subsampled_gaussian_composed_t_times():
    expected = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(512 / 50_000, dp_accounting.GaussianDpEvent(1.5)), 300
    )
    assert dp_event(noise_multiplier=1.5, sampling_rate=512 / 50_000, steps=300) == expected
    assert dp_event(noise_multiplier=1.5, sampling_rate=512 / 50_000, steps=7).count == 7
    plan = PrivacyPlan(num_examples=50_000, batch_size=512, steps=300, noise_multiplier=1.5, delta=1e-5)
    assert plan.exact and plan.sampling_rate == 512 / 50_000


def test_shuffled_batches_are_accounted_as_poisson_but_flagged_inexact():
    kwargs = dict(num_examples=10_000, batch_size=100, steps=100, noise_multiplier=1.5, delta=1e-5)
    shuffled = PrivacyPlan(**kwargs, sampling="shuffle")
    poisson = PrivacyPlan(**kwargs)
    assert not shuffled.exact and poisson.exact
    assert shuffled.truncation is None and shuffled.epsilon() == _eps(1.5, 0.01, 100)  # untruncated Poisson
    assert poisson.epsilon() == _eps(1.5, 0.01, 100, truncation=poisson.truncation) >= shuffled.epsilon()
    assert any("shuffle" in w for w in shuffled.warnings)


def test_full_batch_single_step_matches_the_analytic_gaussian_mechanism():
    # q = 1, T = 1 is the plain Gaussian mechanism, whose exact epsilon is known in
    # closed form (Balle & Wang 2018): an independent check of the PLD path.
    exact = dp_accounting.get_epsilon_gaussian(2.0, 1e-5)
    assert _eps(2.0, 1.0, 1, accountant="pld") == pytest.approx(exact, rel=1e-3)
    assert _eps(2.0, 1.0, 1, accountant="rdp") >= exact  # RDP is an upper bound, looser


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_is_monotone_in_each_parameter(accountant):
    def eps(sigma=2.0, q=0.01, steps=500):
        return _eps(sigma, q, steps, accountant=accountant)

    by_sigma = [eps(sigma=s) for s in (1.3, 1.6, 2.0, 4.0)]
    by_q = [eps(q=q) for q in (0.002, 0.005, 0.01, 0.05)]
    by_steps = [eps(steps=t) for t in (10, 100, 500, 5000)]
    assert by_sigma == sorted(by_sigma, reverse=True) and len(set(by_sigma)) == 4
    assert by_q == sorted(by_q) and len(set(by_q)) == 4
    assert by_steps == sorted(by_steps) and len(set(by_steps)) == 4


def test_pld_is_tighter_than_rdp():
    for sigma, q, steps, delta in SETTINGS[1:]:
        assert _eps(sigma, q, steps, delta, "pld") < _eps(sigma, q, steps, delta, "rdp")


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_curve_matches_the_accountant_at_every_step_count(accountant):
    sigma, q, delta = 2.0, 0.02, 1e-5
    curve = EpsilonCurve(noise_multiplier=sigma, sampling_rate=q, delta=delta, accountant=accountant)
    assert curve(0) == 0.0
    values = []
    for steps in (1, 37, 400, 3000):
        values.append(curve(steps))
        assert values[-1] == pytest.approx(_reference(accountant, sigma, q, steps, delta), rel=1e-12)
    assert values == sorted(values)
    assert curve(37) == values[1]  # cached value is returned unchanged


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(noise_multiplier=0.0, sampling_rate=0.1, steps=10),
        dict(noise_multiplier=-1.0, sampling_rate=0.1, steps=10),
        dict(noise_multiplier=float("nan"), sampling_rate=0.1, steps=10),
        dict(noise_multiplier=1.0, sampling_rate=0.0, steps=10),
        dict(noise_multiplier=1.0, sampling_rate=1.5, steps=10),
        dict(noise_multiplier=1.0, sampling_rate=0.1, steps=0),
        dict(noise_multiplier=1.0, sampling_rate=0.1, steps=2.5),
        dict(noise_multiplier=1.0, sampling_rate=0.1, steps=10, sampling="replacement"),
    ],
)
def test_invalid_mechanisms_are_user_errors(kwargs):
    with pytest.raises(InvalidConfigError):
        check_mechanism(**kwargs)


def test_batch_larger_than_data_set_is_rejected():
    with pytest.raises(InvalidConfigError, match="exceeds the number of examples"):
        check_batch_size(batch_size=101, num_examples=100)
    with pytest.raises(InvalidConfigError, match="exceeds the number of examples"):
        PrivacyPlan(num_examples=100, batch_size=101, steps=1, noise_multiplier=1.0, delta=1e-5)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5])
def test_delta_must_be_in_open_unit_interval(delta):
    with pytest.raises(InvalidConfigError):
        _eps(1.0, 0.1, 10, delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_releases_are_composed_into_epsilon_and_the_curve(accountant):
    assert isinstance(
        dp_event(noise_multiplier=2.0, sampling_rate=0.1, steps=50, releases=(5.0,)), dp_accounting.ComposedDpEvent
    )
    with_release = _eps(2.0, 0.1, 50, accountant=accountant, releases=(5.0,))
    assert with_release > _eps(2.0, 0.1, 50, accountant=accountant) + 1e-3  # the release costs something
    curve = EpsilonCurve(noise_multiplier=2.0, sampling_rate=0.1, delta=1e-5, accountant=accountant, releases=(5.0,))
    assert curve(50) == pytest.approx(with_release, rel=1e-9)
    # Before the first step the ledger already shows the release alone.
    alone = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
    assert curve(0) == pytest.approx(alone.compose(dp_accounting.GaussianDpEvent(5.0)).get_epsilon(1e-5), rel=1e-3)


@pytest.mark.parametrize("releases", [(0.0,), (-1.0,), (float("inf"),)])
def test_invalid_releases_are_user_errors(releases):
    with pytest.raises(InvalidConfigError, match="release"):
        check_mechanism(noise_multiplier=1.0, sampling_rate=0.1, steps=10, releases=releases)


def test_bounds_for_names_the_bounds_whose_smallest_is_reported():
    assert bounds_for("pld", 1e-5) == bounds_for("pld", MIN_DELTA) == ("rdp", "pld")
    assert bounds_for("pld", MIN_DELTA / 10) == bounds_for("rdp", 1e-5) == ("rdp",)
    with pytest.raises(InvalidConfigError):
        bounds_for("gdp", 1e-5)


@pytest.mark.parametrize("delta", [1e-5, 1e-13])
def test_one_run_composed_is_its_own_epsilon(delta):
    """Composing many runs follows the rule of one run: the smallest of ``bounds_for``'s bounds."""
    plan = PrivacyPlan(num_examples=60_000, batch_size=256, steps=2_000, noise_multiplier=1.1, delta=delta)
    composed = composed_epsilon([plan], delta=delta)
    untruncated = min(_reference(acc, 1.1, 256 / 60_000, 2_000, delta) for acc in bounds_for("pld", delta))
    assert composed == pytest.approx(plan.epsilon(), rel=1e-9)
    # Truncating batches at the plan's capacity costs at most ~0.1% (calibration.TRUNCATION_COST).
    assert untruncated * (1 - 1e-9) <= composed <= untruncated * 1.002
    assert plan.epsilon_bound() == ("pld" if delta >= MIN_DELTA else "rdp")


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_the_step_zero_ledger_shows_the_release_even_where_a_step_has_infinite_rdp(accountant):
    """0 steps times an infinite per-order RDP is no spending (it was nan, and the ledger showed epsilon 0)."""
    from dpscale.privacy.accounting import RdpParts

    assert np.isinf(RdpParts.of(noise_multiplier=0.3, sampling_rate=0.5).step).any()
    plan = PrivacyPlan(
        num_examples=1000,
        batch_size=500,
        steps=10,
        noise_multiplier=0.3,
        delta=1e-5,
        accountant=accountant,
        releases=(20.0,),
    )
    alone = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
    reference = alone.compose(dp_accounting.GaussianDpEvent(20.0)).get_epsilon(1e-5)
    assert plan.ledger(steps_done=0).epsilon_spent == pytest.approx(reference, rel=1e-3) and reference > 0.1
