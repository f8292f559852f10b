"""Statistics of privacy audits: turning guesses about membership into epsilon lower bounds.

Two tests, both *lower* bounds that hold with a stated confidence whatever the
training code does, so an audit result above the nominal epsilon proves a bug:

* The distinguishing game (Jagielski et al. 2020; Nasr et al. 2021; Tramer et al.
  2022): an (eps, delta)-DP mechanism forces every membership test to satisfy
  ``FPR + e^eps FNR >= 1 - delta`` and ``FNR + e^eps FPR >= 1 - delta``. With
  Clopper-Pearson upper bounds on the FPR and FNR measured on fresh models, the
  smallest eps consistent with both is a lower bound on the true epsilon.
* Gaussian DP (Dong, Roth and Su 2019; Nasr et al. 2023, "Tight Auditing of Differentially
  Private Machine Learning"): when each model's score is Gaussian with the same variance in
  and out (the white-box statistic of ``audit.whitebox`` is), the mechanism is at least
  mu-GDP with mu = (mean_in - mean_out) / std. A confidence bound on mu from the two score
  samples (``mu_lower_bound``) is converted to epsilon at the run's delta (``gdp_epsilon``).
  Without the Gaussian-score assumption, a mechanism that is mu-GDP (DP-SGD at q = 1 is, and
  so is anything computed from its output) forces FNR >= Phi(Phi^-1(1 - FPR) - mu) at every
  threshold, so Clopper-Pearson bounds on the two rates give mu >= Phi^-1(1 - FPR) - Phi^-1(FNR)
  (``gdp_epsilon_from_rates``). Its sample-size limit is soft, while Clopper-Pearson can never certify more than
  ``cp_max_certifiable_epsilon`` however separable the scores are.
* One-run auditing (Steinke, Nasr and Jagielski 2023): m canaries enter a single
  training run independently with probability 1/2; r guesses with v correct are
  unlikely under (eps, delta)-DP when v is large. See ``one_run_p_value``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import optimize, special, stats

from dpscale.errors import InvalidConfigError


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise InvalidConfigError(f"significance must be in (0, 1), got {alpha}")


def clopper_pearson_upper(successes: int, trials: int, *, alpha: float) -> float:
    """One-sided upper confidence bound on a binomial rate: P[rate > bound] <= alpha."""
    _check_alpha(alpha)
    if not 0 <= successes <= trials or trials < 1:
        raise InvalidConfigError(f"need 0 <= successes <= trials, trials >= 1; got {successes}/{trials}")
    if successes == trials:
        return 1.0
    return float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes))


def clopper_pearson_lower(successes: int, trials: int, *, alpha: float) -> float:
    """One-sided lower confidence bound on a binomial rate: P[rate < bound] <= alpha."""
    return 1.0 - clopper_pearson_upper(trials - successes, trials, alpha=alpha)


def epsilon_from_rates(fpr: float, fnr: float, *, delta: float) -> float:
    """The smallest eps >= 0 that an (eps, delta)-DP mechanism needs to allow (fpr, fnr).

    Both directions of the hypothesis test are constrained, so the bound is the
    larger of ``log((1 - delta - fnr) / fpr)`` and ``log((1 - delta - fpr) / fnr)``;
    a zero rate with a positive numerator means no finite eps allows it.
    """
    best = 0.0
    for numerator, rate in ((1 - delta - fnr, fpr), (1 - delta - fpr, fnr)):
        if numerator <= 0:
            continue
        best = max(best, math.inf if rate <= 0 else math.log(numerator / rate))
    return best


def epsilon_lower_bound(
    *,
    false_positives: int,
    negatives: int,
    false_negatives: int,
    positives: int,
    delta: float,
    confidence: float,
) -> float:
    """Epsilon lower bound at ``confidence`` from counts of a fixed-threshold membership test.

    The FPR and FNR upper bounds each hold with probability ``1 - (1-confidence)/2``,
    so both hold together with probability ``confidence`` (union bound).
    """
    alpha = (1 - confidence) / 2
    fpr = clopper_pearson_upper(false_positives, negatives, alpha=alpha)
    fnr = clopper_pearson_upper(false_negatives, positives, alpha=alpha)
    return epsilon_from_rates(fpr, fnr, delta=delta)


def advantage_bound(epsilon: float, delta: float) -> float:
    """Largest TPR - FPR any membership test can reach against an (eps, delta)-DP mechanism.

    Adding ``TPR <= e^eps FPR + delta`` and ``1 - FPR <= e^eps (1 - TPR) + delta``
    (each weighted so FPR and TPR cancel) gives ``(e^eps - 1 + 2 delta) / (e^eps + 1)``.
    """
    return min(1.0, (math.expm1(epsilon) + 2 * delta) / (math.exp(epsilon) + 1))


def best_threshold(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    delta: float,
    confidence: float,
    estimator: Callable[..., float] | None = None,
) -> float:
    """The threshold ("member if score >= t") with the largest bound on these scores.

    ``estimator`` takes the counts as ``epsilon_lower_bound`` does (its default).

    Meant for the *held-out* models: the threshold chosen here must be evaluated on
    other models, or the bound would be optimistically biased.
    """
    in_scores, out_scores = np.sort(in_scores), np.sort(out_scores)
    candidates = np.unique(np.concatenate([in_scores, out_scores, [np.inf]]))
    # Counts for every candidate at once: FP = out >= t, FN = in < t.
    false_pos = len(out_scores) - np.searchsorted(out_scores, candidates, side="left")
    false_neg = np.searchsorted(in_scores, candidates, side="left")
    best_t, best_eps = float(candidates[0]), -1.0
    for t, fp, fn in zip(candidates, false_pos, false_neg):
        eps = (estimator or epsilon_lower_bound)(
            false_positives=int(fp),
            negatives=len(out_scores),
            false_negatives=int(fn),
            positives=len(in_scores),
            delta=delta,
            confidence=confidence,
        )
        if eps > best_eps:
            best_t, best_eps = float(t), eps
    return best_t


def one_run_p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P-value of ``correct`` right guesses out of ``guesses`` under (eps, delta)-DP.

    Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run"
    (NeurIPS 2023, arXiv:2305.08846), Theorem 3.1 with the delta term of their
    Section 5 (Corollary 5.4, evaluated as in their Appendix D): if m canaries are
    included independently with probability 1/2 and the auditor makes r guesses
    from the output alone, the number of correct guesses W satisfies

        P[W >= v] <= P[Bin(r, p) >= v] + 2 m delta * max_{1<=i<=v} P[v-i <= Bin(r, p) < v] / i,

    with ``p = e^eps / (1 + e^eps)``: an eps-DP mechanism does no better than
    randomised response on each canary, and delta adds the max-term above. The tail
    sums are accumulated from the probability mass function (not as differences of
    CDFs, which lose all precision far in the tail).
    """
    m, r, v = canaries, guesses, correct
    if not 0 <= v <= r <= m:
        raise InvalidConfigError(f"need 0 <= correct <= guesses <= canaries, got {v}, {r}, {m}")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise InvalidConfigError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Bin(r, p) >= v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)  # P[Bin = v-1], P[Bin = v-2], ...
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * alpha)


def one_run_epsilon_lower_bound(
    *,
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float,
    tolerance: float = 1e-4,
) -> float:
    """Largest eps rejected at level ``1 - confidence`` by ``one_run_p_value`` (0 if none).

    The p-value increases with eps, so bisection finds the crossing; the low end of
    the final bracket is returned, which keeps the bound conservative.
    """
    alpha = 1 - confidence
    _check_alpha(alpha)

    def rejected(eps: float) -> bool:
        value = one_run_p_value(canaries=canaries, guesses=guesses, correct=correct, epsilon=eps, delta=delta)
        return value < alpha

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2 * high
        if high > 1e3:
            return math.inf
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if rejected(mid) else (low, mid)
    return low


def cp_max_certifiable_epsilon(*, positives: int, negatives: int, delta: float, confidence: float) -> float:
    """The largest epsilon ``epsilon_lower_bound`` can give with these counts: that of a perfect test.

    A row whose nominal epsilon is at or above this cannot detect a violation with
    Clopper-Pearson, whatever the code does.
    """
    return epsilon_lower_bound(
        false_positives=0,
        negatives=negatives,
        false_negatives=0,
        positives=positives,
        delta=delta,
        confidence=confidence,
    )


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) of mu-GDP: Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Dong et al., Cor. 2.13).

    In log space, so a large epsilon or a small mu does not cancel to garbage.
    """
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    first = float(special.log_ndtr(-epsilon / mu + mu / 2))
    second = epsilon + float(special.log_ndtr(-epsilon / mu - mu / 2))
    return 0.0 if second >= first else math.exp(first) * -math.expm1(second - first)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon >= 0 with ``gdp_delta(epsilon, mu) <= delta`` (delta falls as epsilon grows)."""
    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    high = 1.0
    while gdp_delta(high, mu) > delta:
        high *= 2
    return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, high, xtol=1e-12))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu whose ``gdp_epsilon`` at ``delta`` is ``epsilon`` (the inverse of ``gdp_epsilon``)."""
    if epsilon <= 0:
        return 0.0
    high = 1.0
    while gdp_epsilon(high, delta) < epsilon:
        high *= 2
    return float(optimize.brentq(lambda m: gdp_epsilon(m, delta) - epsilon, 1e-9, high, xtol=1e-12))


def mu_estimate(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
    """(mean_in - mean_out) / pooled standard deviation."""
    x, y = np.asarray(in_scores, float), np.asarray(out_scores, float)
    pooled = ((len(x) - 1) * x.var(ddof=1) + (len(y) - 1) * y.var(ddof=1)) / (len(x) + len(y) - 2)
    diff = x.mean() - y.mean()
    if pooled == 0:
        return math.inf if diff > 0 else 0.0
    return float(diff / math.sqrt(pooled))


def mu_lower_bound(in_scores: np.ndarray, out_scores: np.ndarray, *, confidence: float) -> float:
    """One-sided lower confidence bound on mu, exact when both samples are Gaussian with one variance.

    The two-sample t statistic has a noncentral t distribution with n + m - 2 degrees of
    freedom and noncentrality mu / sqrt(1/n + 1/m); the bound is the noncentrality whose
    upper tail at the observed t is ``1 - confidence`` (the tail grows with it), rescaled.
    """
    alpha = 1 - confidence
    _check_alpha(alpha)
    n, m = len(in_scores), len(out_scores)
    if n < 2 or m < 2:
        raise InvalidConfigError(f"need at least 2 scores on each side, got {n} and {m}")
    scale, df = math.sqrt(1 / n + 1 / m), n + m - 2
    estimate = mu_estimate(in_scores, out_scores)
    if math.isinf(estimate):
        return math.inf
    observed = estimate / scale
    if stats.t.sf(observed, df) >= alpha:  # mu = 0 explains the scores
        return 0.0

    def excess(noncentrality: float) -> float:
        return float(stats.nct.sf(observed, df, noncentrality)) - alpha

    high = max(observed, 1.0)
    while excess(high) < 0:
        high *= 2
    return float(optimize.brentq(excess, 0.0, high, xtol=1e-10)) * scale


def gdp_epsilon_lower_bound(
    in_scores: np.ndarray, out_scores: np.ndarray, *, delta: float, confidence: float
) -> dict[str, float]:
    """Epsilon at ``delta`` of the mu lower bound, with the point estimate beside it."""
    estimate = mu_estimate(in_scores, out_scores)
    lower = mu_lower_bound(in_scores, out_scores, confidence=confidence)
    return {
        "mu_estimate": estimate,
        "mu_lower_bound": lower,
        "gdp_epsilon_estimate": gdp_epsilon(max(estimate, 0.0), delta),
        "gdp_epsilon_lower_bound": gdp_epsilon(lower, delta),
    }


def gdp_epsilon_from_rates(
    *,
    false_positives: int,
    negatives: int,
    false_negatives: int,
    positives: int,
    delta: float,
    confidence: float,
) -> float:
    """Epsilon at ``delta`` of the smallest mu that allows these counts, for a mu-GDP mechanism.

    Valid only for mechanisms that are mu-GDP for some mu (DP-SGD with full batches); the
    rates' Clopper-Pearson bounds hold together at ``confidence``, as in ``epsilon_lower_bound``.
    """
    alpha = (1 - confidence) / 2
    fpr = clopper_pearson_upper(false_positives, negatives, alpha=alpha)
    fnr = clopper_pearson_upper(false_negatives, positives, alpha=alpha)
    mu = float(stats.norm.isf(fpr) - stats.norm.ppf(fnr))
    return gdp_epsilon(max(mu, 0.0), delta)
