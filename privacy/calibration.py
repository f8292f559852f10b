"""Calibrate one DP-SGD hyper-parameter so that epsilon is at most a target.

Given two of {noise multiplier, steps, batch size} and (epsilon, delta), find the
third: the *smallest* noise multiplier, the *largest* number of steps or the
*largest* batch size whose epsilon is <= the target. Epsilon is monotone in each of
them, so a bracketing search that only ever returns the feasible end of its bracket
can never overshoot; it stops when the infeasible end is within the tolerance
(relative ``rtol`` on sigma, the next integer for steps and batch size).

Why not ``dp_accounting.calibrate_dp_mechanism``: it runs Brent's root finder on
``eps - target`` with an absolute tolerance in parameter space, rounds integer
parameters inside the objective and repairs overshoot afterwards by probing
``root +- tol``; it cannot guarantee the *maximal* feasible integer, has no relative
tolerance for sigma, and rebuilds the accountant from scratch at every probe. We
keep an explicit [feasible, infeasible] bracket instead, so "never above the
target" holds by construction and tightness is a stopping rule we can test.

Speed (PLD): a probe at a new (sigma, q) builds that step's PLD on dp-accounting's default grid, a
Python loop per grid point and most of a search's time (a truncated step builds two; timed in
benchmarks/results/calibration.md and first_hour_speed.md). So the search runs three times, each
from where the one before ended (:mod:`dpscale.privacy.bracket_search`, with its local slope): on
RDP (cheap, 5-10% looser), on PLD over a 10x coarser grid (~10x cheaper per probe, within ~0.3% of the
answer), and on the reported epsilon itself, which then usually needs 2-3 probes: the answer
and the next value (an integer) or a value one tolerance below (sigma). Only the last search
decides: its bracket holds probes of the reported epsilon only, so the answer is its feasible end
exactly as before. Curves are the process's shared ones (``accounting.epsilon_curve``), so the
final check by ``accounting.epsilon`` (the one computation every report uses) and the plan's
own report reuse the last probe instead of recomputing it.

``releases`` (noise multipliers of one-off Gaussian releases before training, see
``accounting``) are composed into every probe, so the calibrated
training gets what remains of the budget after them.

``truncation`` (truncated Poisson sampling, ``accounting.Truncation``) enters every probe the
same way; when the batch size is solved for, each probe's capacity is the sampler's rule
(``sampling.batch_capacity``, k standard deviations above B) at that batch size.
``capacity_stds`` picks that k: the smallest of ``CAPACITY_LADDER`` whose truncation adds at
most ``TRUNCATION_COST`` to the untruncated epsilon (a batch is truncated with probability
~3e-5 at k = 4, but with little noise per step a truncated step costs a lot: k = 4 adds 35% to
epsilon at sigma 0.8, q = 0.004, and nothing measurable at sigma 2.3, q = 0.08).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from dpscale.errors import InfeasiblePrivacyTargetError, InvalidConfigError
from dpscale.privacy.accounting import (
    PLD_DISCRETIZATION,
    Truncation,
    bounds_for,
    epsilon,
    epsilon_curve,
    quiet_rdp_warnings,
)
from dpscale.privacy.accounting import clear_caches as accounting_caches
from dpscale.privacy.bracket_search import MonotoneProblem, solve_boundary
from dpscale.privacy.checks import Accountant, check_accountant, check_batch_size, check_delta, check_mechanism
from dpscale.privacy.sampling import batch_capacity

# The search domain. Targets so loose that less noise or more steps would do get the
# bound itself (its epsilon, far below the target, is reported): sigma = 0.1 already
# spends epsilon in the hundreds, and PLD accounting slows down as 1/sigma^2 below it
# (its grid grows); 10^7 steps is two orders beyond an ImageNet run, and PLD
# self-composition beyond it grows without bound in time and memory.
SIGMA_MIN = 0.1
SIGMA_MAX = 1e4  # needing more noise than this means the target is impractical
MAX_STEPS = 10**7
DEFAULT_RTOL = 1e-3
#: Capacities tried, in standard deviations of the batch size above B (cheapest first).
CAPACITY_LADDER = (3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 10.0)
#: The most epsilon truncating batches may add, relative to untruncated Poisson sampling.
TRUNCATION_COST = 1e-3
CHOICE_DISCRETIZATION = 1e-3  # PLD grid of that comparison (the reported epsilon uses the default)


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """A calibrated hyper-parameter and the epsilon it achieves (``accounting.epsilon``)."""

    value: float | int
    epsilon: float
    probes: int
    slope: float = 0.0  # d log(epsilon) / d log(value) near the answer (where a nearby search starts)


class _EpsilonCache:
    """Epsilon of (sigma, q, steps, truncation) on one accountant and PLD grid, counting the probes.

    The curves are the process's shared ones (``accounting.epsilon_curve``): the search's last
    probe, its check and the plan's own report are one computation.
    """

    def __init__(
        self,
        *,
        delta: float,
        accountant: Accountant,
        releases: tuple[float, ...] = (),
        discretization: float = PLD_DISCRETIZATION,
    ) -> None:
        self.delta = delta
        self.accountant = accountant
        self.releases = tuple(releases)
        self.discretization = discretization
        self.probes = 0

    def __call__(
        self, noise_multiplier: float, sampling_rate: float, steps: int, truncation: Truncation | None = None
    ) -> float:
        curve = epsilon_curve(
            noise_multiplier=noise_multiplier,
            sampling_rate=sampling_rate,
            delta=self.delta,
            accountant=self.accountant,
            pld_discretization=self.discretization,
            releases=self.releases,
            truncation=truncation,
        )
        self.probes += 1
        return curve(int(steps))


def _stages(accountant: Accountant, delta: float, *, near: bool) -> tuple[tuple[Accountant, float], ...]:
    """The searches, cheapest first: (accountant, PLD grid). Each starts where the one before ended.

    RDP (cheap: benchmarks/results/calibration.md) then PLD on a 10x coarser grid bring the start close, so the
    search on the reported epsilon (``accountant`` on its own grid) needs only a few probes; with
    ``near`` (a nearby answer given) the RDP search is skipped. Only the last search's answer counts.
    """
    last = (accountant, PLD_DISCRETIZATION)
    if "pld" not in bounds_for(accountant, delta):
        return (last,) if near else tuple(dict.fromkeys((("rdp", PLD_DISCRETIZATION), last)))
    coarse = ("pld", CHOICE_DISCRETIZATION)
    return (coarse, last) if near else (("rdp", PLD_DISCRETIZATION), coarse, last)


# solved value -> (sigma, q, steps, truncation)
Mechanism = Callable[[float], tuple[float, float, int, Truncation | None]]


def _solve(
    name: str,
    mechanism: Mechanism,
    *,
    target: float,
    delta: float,
    accountant: Accountant,
    releases: tuple[float, ...],
    increasing: bool,
    integer: bool,
    lower: float,
    upper: float,
    start: float,
    slope: float,
    nudge: Callable[[float], float],
    rtol: float = DEFAULT_RTOL,
    near: tuple[float, float] | None = None,
) -> Calibrated:
    """The feasible boundary of ``epsilon(mechanism(x)) <= target`` in x, by the search below.

    A cheap RDP search first, then one on the epsilon ``accountant`` reports (``EpsilonCurve``:
    the smallest of ``accounting.bounds_for``'s bounds) from the RDP answer and its slope,
    which refines it even where that epsilon is RDP's own (tiny delta). ``near``: (value,
    slope) of a nearby answer (e.g. the answer without truncation): the second search starts
    there and the first is skipped. The answer is
    re-checked with ``accounting.epsilon`` (what every report uses) and nudged towards the
    private end if it disagrees, a safety net that should never fire: the search's cached
    evaluations are the same computation.
    """
    _check_releases_fit(target=target, delta=delta, accountant=accountant, releases=releases)
    probes = 0
    if near is not None:
        start, slope = near
    stages = _stages(accountant, delta, near=near is not None)
    close = near is not None  # whether the start is a nearby answer (a small first step past it)
    with quiet_rdp_warnings():
        for i, (acc, grid) in enumerate(stages):
            cache = _EpsilonCache(delta=delta, accountant=acc, releases=releases, discretization=grid)
            problem = MonotoneProblem(
                name=name,
                eps_at=lambda x, c=cache: c(*mechanism(x)),
                target=target,
                increasing=increasing,
                integer=integer,
                lower=lower,
                upper=upper,
                rtol=rtol,
                margin=(1e-4 if integer else rtol / 4) if close else None,
            )
            try:
                start, slope = solve_boundary(problem, start, slope=slope)
                close = acc == "pld"  # a PLD answer is close to the next grid's; RDP's is not (5-10% off)
            except InfeasiblePrivacyTargetError:
                if i == len(stages) - 1:
                    raise
                # RDP (and a coarse grid) is looser than the reported bound: out of reach there may still
                # be feasible for it, so let the next search start from the most private setting.
                start, close = (lower if increasing else upper), False
            finally:
                probes += cache.probes
    value = int(start) if integer else start
    for _ in range(64):
        sigma, q, steps, truncation = mechanism(value)
        achieved = epsilon(
            noise_multiplier=sigma,
            sampling_rate=q,
            steps=steps,
            delta=delta,
            accountant=accountant,
            releases=releases,
            truncation=truncation,
        )
        if achieved <= target:
            return Calibrated(value=value, epsilon=achieved, probes=probes, slope=slope)
        value = nudge(value)
    raise RuntimeError("accounting.epsilon disagrees with the search")  # a bug


def _check_releases_fit(*, target: float, delta: float, accountant: Accountant, releases: tuple[float, ...]) -> None:
    """Refuse at once a target that the one-off releases alone exceed (no training fits under it)."""
    if not releases:
        return
    spent = epsilon_curve(
        noise_multiplier=1.0, sampling_rate=1.0, delta=delta, accountant=accountant, releases=releases
    )(0)
    if spent > target:
        raise InfeasiblePrivacyTargetError(
            f"target epsilon {target:g} is out of reach: the one-off releases alone (noise multipliers "
            f"{', '.join(f'{r:g}' for r in releases)}) spend epsilon {spent:.4g}"
        )


def _check_target(target_epsilon: float, delta: float, accountant: Accountant) -> None:
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise InvalidConfigError(f"target epsilon must be positive, got {target_epsilon}")
    check_delta(delta)
    check_accountant(accountant)


@functools.lru_cache(maxsize=128)  # pure; sweeps and repeats ask the same question
def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Accountant = "pld",
    rtol: float = DEFAULT_RTOL,
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
    near: tuple[float, float] | None = None,
) -> Calibrated:
    """Smallest sigma (within relative ``rtol``) with epsilon <= target (``near``: see ``_solve``)."""
    _check_target(target_epsilon, delta, accountant)
    check_mechanism(noise_multiplier=1.0, sampling_rate=sampling_rate, steps=steps, releases=releases)
    return _solve(
        "noise multiplier",
        lambda s: (s, sampling_rate, steps, truncation),
        target=target_epsilon,
        delta=delta,
        accountant=accountant,
        releases=releases,
        increasing=False,
        integer=False,
        lower=SIGMA_MIN,
        upper=SIGMA_MAX,
        start=1.0,
        slope=-1.0,
        rtol=rtol,
        near=near,
        nudge=lambda s: min(s * (1 + rtol / 4), SIGMA_MAX),
    )


@functools.lru_cache(maxsize=128)  # pure; sweeps and repeats ask the same question
def calibrate_steps(
    *,
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sampling_rate: float,
    accountant: Accountant = "pld",
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
    near: tuple[float, float] | None = None,
) -> Calibrated:
    """Largest number of steps with epsilon <= target (``near``: see ``_solve``)."""
    _check_target(target_epsilon, delta, accountant)
    check_mechanism(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=1, releases=releases)
    return _solve(
        "steps",
        lambda t: (noise_multiplier, sampling_rate, int(t), truncation),
        target=target_epsilon,
        delta=delta,
        accountant=accountant,
        releases=releases,
        increasing=True,
        integer=True,
        lower=1,
        upper=MAX_STEPS,
        start=1000.0,
        slope=0.5,
        near=near,
        nudge=lambda t: _decrement(t, "steps", target_epsilon),
    )


@functools.lru_cache(maxsize=128)  # pure; sweeps and repeats ask the same question
def calibrate_batch_size(
    *,
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    steps: int,
    num_examples: int,
    accountant: Accountant = "pld",
    releases: tuple[float, ...] = (),
    capacity_stds: float | None = None,
    near: tuple[float, float] | None = None,
) -> Calibrated:
    """Largest (expected) batch size with epsilon <= target, at most ``num_examples``.

    ``capacity_stds``: Poisson batches truncated to ``sampling.batch_capacity`` (that many
    standard deviations above each probed size); None: untruncated.
    """
    _check_target(target_epsilon, delta, accountant)
    check_batch_size(batch_size=1, num_examples=num_examples)
    check_mechanism(noise_multiplier=noise_multiplier, sampling_rate=1.0, steps=steps, releases=releases)

    def mechanism(b: float) -> tuple[float, float, int, Truncation | None]:
        truncation = (
            None
            if capacity_stds is None
            else Truncation(num_examples, batch_capacity(num_examples, int(b), stds=capacity_stds))
        )
        return noise_multiplier, int(b) / num_examples, steps, truncation

    return _solve(
        "batch size",
        mechanism,
        target=target_epsilon,
        delta=delta,
        accountant=accountant,
        releases=releases,
        increasing=True,
        integer=True,
        lower=1,
        upper=num_examples,
        start=max(1.0, num_examples / 100),
        slope=1.0,
        near=near,
        nudge=lambda b: _decrement(b, "batch size", target_epsilon),
    )


@functools.lru_cache(maxsize=256)  # pure; every plan of a sweep asks it
def capacity_stds(
    *,
    noise_multiplier: float,
    num_examples: int,
    batch_size: int,
    steps: int,
    delta: float,
    accountant: Accountant = "pld",
    releases: tuple[float, ...] = (),
) -> float:
    """The smallest k of ``CAPACITY_LADDER`` whose truncation adds at most ``TRUNCATION_COST`` to epsilon.

    Epsilon falls as the capacity grows (fewer truncations), so the first k that passes is
    found by bisection over the ladder; the last k if none passes.
    """
    check_mechanism(
        noise_multiplier=noise_multiplier, sampling_rate=batch_size / num_examples, steps=steps, releases=releases
    )
    common = dict(
        noise_multiplier=noise_multiplier,
        sampling_rate=batch_size / num_examples,
        delta=delta,
        accountant=accountant,
        releases=releases,
    )

    def spent(truncation: Truncation | None) -> float:  # on a coarser grid: a comparison, not a report
        return epsilon_curve(**common, pld_discretization=CHOICE_DISCRETIZATION, truncation=truncation)(steps)

    with quiet_rdp_warnings():
        allowed = spent(None) * (1 + TRUNCATION_COST)

        def passes(k: float) -> bool:
            capacity = batch_capacity(num_examples, batch_size, stds=k)
            return capacity > num_examples or spent(Truncation(num_examples, capacity)) <= allowed

        low, high = 0, len(CAPACITY_LADDER) - 1  # the answer is in [low, high]
        while low < high:
            middle = (low + high) // 2
            if passes(CAPACITY_LADDER[middle]):
                high = middle
            else:
                low = middle + 1
    return CAPACITY_LADDER[low]


def clear_caches() -> None:
    """Forget every answer and curve this process computed (a benchmark times a cold process this way)."""
    for cached in (calibrate_noise_multiplier, calibrate_steps, calibrate_batch_size, capacity_stds):
        cached.cache_clear()
    accounting_caches()


def _decrement(value: float, name: str, target: float) -> int:
    if value <= 1:
        raise InfeasiblePrivacyTargetError(f"epsilon {target:g} is out of reach even with {name} 1")
    return int(value) - 1
