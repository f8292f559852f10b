"""The audit statistics: Clopper-Pearson, the (FPR, FNR) -> epsilon map, the one-run bound."""

import math

import numpy as np
import pytest

from dpscale.audit import bounds as ab
from dpscale.errors import InvalidConfigError


def test_clopper_pearson_closed_forms_and_coverage():
    # 0 successes: the bound solves (1 - p)^n = alpha.
    assert ab.clopper_pearson_upper(0, 50, alpha=0.01) == pytest.approx(1 - 0.01 ** (1 / 50))
    assert ab.clopper_pearson_upper(7, 7, alpha=0.01) == 1.0
    assert ab.clopper_pearson_lower(50, 50, alpha=0.01) == pytest.approx(0.01 ** (1 / 50))
    # Coverage: the upper bound falls below the true rate in at most ~alpha of trials.
    rng = np.random.default_rng(0)
    draws = rng.binomial(40, 0.3, size=4000)
    misses = np.mean([ab.clopper_pearson_upper(int(k), 40, alpha=0.05) < 0.3 for k in draws])
    assert misses <= 0.05
    with pytest.raises(InvalidConfigError):
        ab.clopper_pearson_upper(3, 2, alpha=0.05)


def test_epsilon_from_rates_is_the_tightest_dp_constraint():
    eps = ab.epsilon_from_rates(0.05, 0.2, delta=0.0)
    assert eps == pytest.approx(max(math.log(0.8 / 0.05), math.log(0.95 / 0.2)))
    assert ab.epsilon_from_rates(0.5, 0.5, delta=0.0) == 0.0  # a coin flip proves nothing
    assert ab.epsilon_from_rates(0.0, 0.3, delta=1e-5) == math.inf
    # A test that meets (eps, delta)-DP's constraint with equality gives back eps.
    e, d = 2.0, 1e-3
    fpr = 0.01
    fnr = 1 - d - math.exp(e) * fpr
    assert ab.epsilon_from_rates(fpr, fnr, delta=d) == pytest.approx(e)


def test_advantage_bound():
    assert ab.advantage_bound(0.0, 0.0) == 0.0
    assert ab.advantage_bound(1.0, 0.0) == pytest.approx((math.e - 1) / (math.e + 1))
    # Achieved by the test with FPR = (1 - delta) / (e^eps + 1) on both sides.
    e, d = 3.0, 1e-4
    fpr = (1 - d) / (math.exp(e) + 1)
    tpr = math.exp(e) * fpr + d
    assert tpr - fpr == pytest.approx(ab.advantage_bound(e, d))


def test_lower_bound_of_a_gaussian_mechanism_stays_below_its_epsilon():
    # Scores N(0,1) vs N(mu,1) are exactly a mu-GDP mechanism; at eps=2 find its delta.
    from scipy.stats import norm

    mu, eps = 2.0, 2.0
    delta = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    rng = np.random.default_rng(1)
    bounds = []
    for _ in range(5):
        out_s, in_s = rng.normal(size=2000), rng.normal(mu, size=2000)
        t = ab.best_threshold(in_s[:1000], out_s[:1000], delta=delta, confidence=0.95)
        bound = ab.epsilon_lower_bound(
            false_positives=int(np.sum(out_s[1000:] >= t)),
            negatives=1000,
            false_negatives=int(np.sum(in_s[1000:] < t)),
            positives=1000,
            delta=delta,
            confidence=0.95,
        )
        bounds.append(bound)
    assert max(bounds) <= eps
    assert min(bounds) > 0.5 * eps  # and it has power


def test_one_run_p_value_closed_forms():
    # delta = 0 and all guesses right: P[Bin(r, p) >= r] = p^r.
    p = 1 / (1 + math.exp(-1.0))
    assert ab.one_run_p_value(canaries=100, guesses=20, correct=20, epsilon=1.0, delta=0.0) == (pytest.approx(p**20))
    # delta only adds: the p-value grows with delta and with epsilon.
    base = ab.one_run_p_value(canaries=1000, guesses=100, correct=80, epsilon=1.0, delta=0.0)
    more = ab.one_run_p_value(canaries=1000, guesses=100, correct=80, epsilon=1.0, delta=1e-5)
    assert more > base
    assert ab.one_run_p_value(canaries=1000, guesses=100, correct=80, epsilon=1.5, delta=0) > base


def test_one_run_bound_inverts_the_p_value():
    eps = ab.one_run_epsilon_lower_bound(canaries=100, guesses=20, correct=20, delta=0.0, confidence=0.95)
    # p^20 = 0.05 at the bound.
    assert 1 / (1 + math.exp(-eps)) == pytest.approx(0.05 ** (1 / 20), rel=1e-3)
    assert ab.one_run_epsilon_lower_bound(canaries=100, guesses=20, correct=10, delta=0.0, confidence=0.95) == 0.0


def test_one_run_bound_is_sound_and_powerful_on_randomised_response():
    # eps-DP randomised response on every canary: each guess is right w.p. e^eps / (1 + e^eps).
    eps, m = 2.0, 2000
    rng = np.random.default_rng(2)
    bounds = []
    for _ in range(20):
        correct = int(rng.binomial(m, 1 / (1 + math.exp(-eps))))
        bounds.append(
            ab.one_run_epsilon_lower_bound(canaries=m, guesses=m, correct=correct, delta=0.0, confidence=0.95)
        )
    assert max(bounds) <= eps
    assert np.median(bounds) > 1.5


def test_gdp_epsilon_matches_the_gaussian_mechanism_and_inverts():
    from dpscale.audit.bounds import gdp_delta, gdp_epsilon, gdp_mu

    # One Gaussian mechanism with sigma = 1 is 1-GDP: the analytic (eps, delta) curve of Balle & Wang.
    assert gdp_delta(1.0, 1.0) == pytest.approx(0.12693, abs=1e-4)
    for epsilon in (0.5, 2.0, 8.0):
        assert gdp_epsilon(gdp_mu(epsilon, 1e-5), 1e-5) == pytest.approx(epsilon, rel=1e-6)
    assert gdp_epsilon(0.0, 1e-5) == 0.0


def test_mu_lower_bound_covers_the_true_mu_at_its_confidence():
    from dpscale.audit.bounds import mu_lower_bound

    rng = np.random.default_rng(0)
    misses = sum(
        mu_lower_bound(rng.normal(0.7, 2.0, 300) + 5, rng.normal(0.0, 2.0, 300) + 5, confidence=0.9) > 0.35
        for _ in range(400)
    )
    assert 20 <= misses <= 62  # 10% of 400 is 40; mu = 0.7 / 2 = 0.35


def test_cp_ceiling_is_the_bound_of_a_perfect_test():
    from dpscale.audit.bounds import cp_max_certifiable_epsilon, epsilon_lower_bound

    ceiling = cp_max_certifiable_epsilon(positives=500, negatives=500, delta=1e-5, confidence=0.999)
    assert ceiling == pytest.approx(4.18, abs=0.01)
    assert (
        epsilon_lower_bound(
            false_positives=1, negatives=500, false_negatives=0, positives=500, delta=1e-5, confidence=0.999
        )
        < ceiling
    )


def test_gdp_rates_bound_is_below_the_true_mu_and_above_cp_for_a_separable_test():
    from dpscale.audit.bounds import gdp_epsilon, gdp_epsilon_from_rates

    # Scores N(mu, 1) vs N(0, 1), threshold mu / 2: rates Phi(-mu / 2) each.
    rng = np.random.default_rng(1)
    mu, n = 2.0, 5000
    fn, fp = int(np.sum(rng.normal(mu, 1, n) < mu / 2)), int(np.sum(rng.normal(0, 1, n) >= mu / 2))
    counts = dict(false_positives=fp, negatives=n, false_negatives=fn, positives=n, delta=1e-5, confidence=0.999)
    gdp = gdp_epsilon_from_rates(**counts)
    assert ab.epsilon_lower_bound(**counts) < gdp < gdp_epsilon(mu, 1e-5)
