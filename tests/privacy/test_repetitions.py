"""The number of runs of a private selection: the distribution drawn is the one dp-accounting accounts."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp
from scipy import stats

from dpscale.errors import InvalidConfigError
from dpscale.privacy.repetitions import Repetitions, negative_binomial_mean


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("mean", [1.5, 10.0, 200.0])
def test_gamma_gives_at_most_the_mean_and_at_least_dp_accountings_gamma(shape, mean):
    """The bound dp-accounting computes (log of the mean, log of 1/its gamma) covers what is drawn."""
    reps = Repetitions("negative-binomial", mean, shape)
    assert negative_binomial_mean(reps.gamma, shape) <= mean
    assert negative_binomial_mean(reps.gamma, shape) == pytest.approx(mean, rel=1e-9)
    assert reps.gamma >= dp_rdp._gamma_truncated_negative_binomial(shape, mean)
    assert negative_binomial_mean(reps.gamma, shape) == pytest.approx(
        dp_rdp._truncated_negative_binomial_mean(reps.gamma, shape), rel=1e-12
    )


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0])
def test_the_pmf_is_the_papers_and_sums_to_one_with_the_mean_asked(shape):
    reps = Repetitions("negative-binomial", 6.0, shape)
    gamma = reps.gamma
    ks = np.arange(1, 2000)
    pmf = np.array([reps.pmf(int(k)) for k in ks])
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9) and (pmf * ks).sum() == pytest.approx(6.0, rel=1e-8)
    if shape == 1.0:  # geometric: gamma (1 - gamma)^(k - 1)
        assert np.allclose(pmf, gamma * (1 - gamma) ** (ks - 1))
    if shape == 0.0:  # logarithmic: (1 - gamma)^k / (k log(1 / gamma))
        assert np.allclose(pmf, (1 - gamma) ** ks / (ks * math.log(1 / gamma)))
    if shape == 3.0:  # the negative binomial (failures before 3 successes at gamma) given K >= 1
        nb = stats.nbinom.pmf(ks, 3.0, gamma) / (1 - gamma**3.0)
        assert np.allclose(pmf, nb)
    assert reps.pmf(0) == 0.0


@pytest.mark.parametrize(
    "reps", [Repetitions("negative-binomial", 4.0, 0.0), Repetitions(mean=4.0), Repetitions("poisson", 4.0)]
)
def test_draws_follow_the_pmf(reps):
    rng = np.random.default_rng(0)
    draws = np.array([reps.sample(rng) for _ in range(4000)])
    top = 12
    observed = np.array([np.sum(draws == k) for k in range(top)] + [np.sum(draws >= top)])
    expected = np.array([reps.pmf(k) for k in range(top)] + [1 - sum(reps.pmf(k) for k in range(top))]) * len(draws)
    keep = expected > 5
    chi2 = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3
    assert (draws >= 1).all() or reps.distribution == "poisson"


def test_a_quantile_says_how_many_runs_to_be_ready_for():
    geometric = Repetitions(mean=10.0)
    assert geometric.quantile(0.99) == math.ceil(math.log(0.01) / math.log(0.9))  # 1 - 0.9^k >= 0.99
    assert Repetitions("poisson", 10.0).quantile(0.5) == 10


@pytest.mark.parametrize(
    "args",
    [("uniform", 10.0, 1.0), ("negative-binomial", 1.0, 1.0), ("negative-binomial", 10.0, -0.5), ("poisson", 0.5, 1.0)],
)
def test_bad_distributions_are_refused(args):
    with pytest.raises(InvalidConfigError):
        Repetitions(*args)
