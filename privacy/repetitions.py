"""How many runs a private selection makes: a random number K, drawn before any run and kept secret.

Papernot & Steinke (ICLR 2022) bound the privacy of "run a DP mechanism K times, publish only the
best" when K is random and hidden: a fixed K would cost up to K times one run's epsilon, a random
one far less. dpscale offers the two families dp-accounting's ``RepeatAndSelectDpEvent`` accounts:

* ``negative-binomial``: the truncated negative binomial D_{eta, gamma} on {1, 2, ...} (their
  Theorem 2), P(K = k) = (1 - gamma)^k / (gamma^-eta - 1) * prod_{l<k} (l + eta) / (l + 1) for
  eta > 0, and the logarithmic distribution (1 - gamma)^k / (k log(1 / gamma)) at eta = 0. eta = 1
  is the geometric distribution (Liu & Talwar 2019). The user gives the mean; gamma follows.
* ``poisson``: K ~ Poisson(mu) (their Theorem 6). K = 0 has probability exp(-mu): the selection
  then publishes nothing (that outcome is part of the accounted mechanism).

The draw and the accounting must be of one distribution. dp-accounting derives gamma from the
mean by its own bisection and keeps the end whose mean is at least the one asked for (a slightly
smaller gamma, a slightly larger cost). ``gamma`` here keeps the other end: a gamma at least as
large and a mean at most the one asked for, so the bound dp-accounting computes covers what is
drawn. Hand-written because dp-accounting does not sample, and its gamma is a private function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import numpy as np
from scipy import stats

from dpscale.privacy.checks import check_repetitions

Distribution = Literal["negative-binomial", "poisson"]
DISTRIBUTIONS: tuple[str, ...] = ("negative-binomial", "poisson")
#: Defaults: geometric (eta = 1), ten runs on average.
DEFAULT_DISTRIBUTION: Distribution = "negative-binomial"
DEFAULT_MEAN = 10.0
DEFAULT_SHAPE = 1.0


def negative_binomial_mean(gamma: float, shape: float) -> float:
    """E[K] of the truncated negative binomial D_{shape, gamma} (gamma in (0, 1])."""
    if gamma >= 1:
        return 1.0
    log_gamma = math.log(gamma)
    if shape == 0:  # logarithmic: (1/gamma - 1) / log(1/gamma)
        return -math.expm1(-log_gamma) / log_gamma
    # shape (1 - gamma) / (gamma (1 - gamma^shape)), with 1 - gamma^shape = -expm1(shape log gamma)
    return shape * (1 - gamma) / (gamma * -math.expm1(shape * log_gamma))


@functools.lru_cache(maxsize=64)
def _gamma(shape: float, mean: float) -> float:
    """The largest gamma (to ~1e-12 relative) whose mean is at most ``mean``: the mean falls as gamma grows."""
    low, high = 0.0, 1.0  # mean(low) > mean (at 0 it is infinite), mean(high) <= mean
    for _ in range(200):
        middle = math.sqrt(low * high) if low > 0 else high / 2
        if negative_binomial_mean(middle, shape) <= mean:
            high = middle
        else:
            low = middle
        if low > 0 and high <= low * (1 + 1e-12):
            break
    return high


@dataclasses.dataclass(frozen=True)
class Repetitions:
    """The distribution of K: ``distribution``, its ``mean``, and eta (``shape``, negative binomial only)."""

    distribution: Distribution = DEFAULT_DISTRIBUTION
    mean: float = DEFAULT_MEAN
    shape: float = DEFAULT_SHAPE

    def __post_init__(self) -> None:
        check_repetitions(self.distribution, self.mean, self.shape, DISTRIBUTIONS)
        object.__setattr__(self, "mean", float(self.mean))
        object.__setattr__(self, "shape", float(self.shape))

    @property
    def event_shape(self) -> float:
        """dp-accounting's ``shape``: eta, or infinity for the Poisson distribution."""
        return math.inf if self.distribution == "poisson" else self.shape

    @property
    def gamma(self) -> float:
        """The negative binomial's gamma (its mean at most ``mean``); refused for Poisson."""
        if self.distribution == "poisson":
            raise ValueError("the Poisson distribution has no gamma")
        return _gamma(self.shape, self.mean)

    def pmf(self, k: int) -> float:
        """P(K = k)."""
        if self.distribution == "poisson":
            return float(stats.poisson.pmf(k, self.mean))
        if k < 1:
            return 0.0
        gamma, eta = self.gamma, self.shape
        if eta == 0:
            return math.exp(k * math.log1p(-gamma) - math.log(k) - math.log(-math.log(gamma)))
        # (1 - gamma)^k * Gamma(k + eta) / (Gamma(eta) k!) / (gamma^-eta - 1), in logs
        log_p = (
            k * math.log1p(-gamma)
            + math.lgamma(k + eta)
            - math.lgamma(eta)
            - math.lgamma(k + 1)
            - math.log(math.expm1(-eta * math.log(gamma)))
        )
        return math.exp(log_p)

    def quantile(self, p: float) -> int:
        """The smallest k with P(K <= k) >= p: how many runs to be ready for."""
        if self.distribution == "poisson":
            return int(stats.poisson.ppf(p, self.mean))
        k, total = 0, 0.0
        while total < p and k < 10**7:
            k += 1
            total += self.pmf(k)
        return k

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K from ``rng`` (a secret stream: ``privacy.streams``)."""
        if self.distribution == "poisson":
            return int(rng.poisson(self.mean))
        # Inverse CDF, the pmf by its ratio P(k + 1) / P(k) = (1 - gamma)(k + eta) / (k + 1): exact for
        # every eta >= 0 (rejecting the zeros of NumPy's negative binomial can take ~1/eta tries).
        u = rng.random()
        gamma, eta = self.gamma, self.shape
        k, pk = 1, self.pmf(1)
        total = pk
        while total < u and pk > 0:
            pk *= (1 - gamma) * (k + eta) / (k + 1)
            k += 1
            total += pk
        return k

    def describe(self) -> str:
        """In words, for tables and notes."""
        if self.distribution == "poisson":
            return f"Poisson, mean {self.mean:g}"
        kind = {0.0: "logarithmic", 1.0: "geometric"}.get(self.shape, "truncated negative binomial")
        return f"{kind} (eta {self.shape:g}), mean {self.mean:g}"

    def to_json(self) -> dict[str, float | str]:
        return dataclasses.asdict(self)
