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

Speed (PLD): RDP is cheap (~0.03 s per probe) and close, so we solve with RDP first
and start the PLD search at the RDP answer. Probes are proposed by interpolating
log(eps) against log(parameter) (eps is close to a power law in each parameter),
then straddle the predicted boundary with two probes one tolerance apart; plain
bisection takes over whenever a round fails to halve the bracket. Each probe costs
one PLD composition (single-step distributions are cached per (sigma, q)). The
reported epsilon is recomputed with dp-accounting's standard accountant.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dpscale.errors import InfeasiblePrivacyTargetError, InvalidConfigError
from dpscale.privacy.accounting import (
    Accountant,
    DpsgdPrivacySpec,
    EpsilonCurve,
    check_accountant,
    check_batch_size,
    check_delta,
    epsilon,
)

SIGMA_MIN = 1e-2  # below this "DP" is meaningless; a looser target still gets this much noise
SIGMA_MAX = 1e4  # needing more noise than this means the target is impractical
MAX_STEPS = 2**31 - 1
DEFAULT_RTOL = 1e-3
_MAX_PROBES = 200


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """A calibrated hyper-parameter and the epsilon it achieves (standard accountant)."""

    value: float | int
    epsilon: float
    probes: int


@contextmanager
def quiet_rdp_warnings() -> Iterator[None]:
    """Silence absl's "failed to converge" warnings that RDP emits for tiny sigma.

    They are expected while the search probes small noise multipliers (the affected
    orders are dropped, which only makes the bound looser) and are noise to users.
    """
    loggers = [logging.getLogger("absl")]
    try:
        from absl import logging as absl_logging

        loggers.append(absl_logging.get_absl_logger())
    except ImportError:  # pragma: no cover - absl ships with dp-accounting
        pass
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


class _EpsilonCache:
    """Epsilon of (sigma, q, steps), reusing one EpsilonCurve per (sigma, q)."""

    def __init__(self, *, delta: float, accountant: Accountant) -> None:
        self.delta = delta
        self.accountant = accountant
        self._curves: dict[tuple[float, float], EpsilonCurve] = {}
        self.probes = 0

    def __call__(self, *, noise_multiplier: float, sampling_rate: float, steps: int) -> float:
        key = (float(noise_multiplier), float(sampling_rate))
        curve = self._curves.get(key)
        if curve is None:
            curve = EpsilonCurve(
                noise_multiplier=key[0],
                sampling_rate=key[1],
                delta=self.delta,
                accountant=self.accountant,
            )
            self._curves[key] = curve
        self.probes += 1
        return curve(int(steps))


@dataclasses.dataclass(frozen=True)
class _Problem:
    """A monotone one-parameter search: find the feasible boundary of eps(x) <= target."""

    name: str
    eps_at: Callable[[float], float]
    target: float
    increasing: bool  # eps grows with x (steps, batch size) or shrinks (sigma)
    integer: bool
    lower: float
    upper: float
    rtol: float = DEFAULT_RTOL

    def snap(self, x: float) -> float:
        x = min(max(x, self.lower), self.upper)
        return float(round(x)) if self.integer else x

    def done(self, feasible: float, infeasible: float) -> bool:
        if self.integer:
            return abs(feasible - infeasible) <= 1
        # sigma: the feasible end is the larger one; sigma*(1-rtol) must be infeasible.
        return min(feasible, infeasible) >= max(feasible, infeasible) * (1 - self.rtol)

    @property
    def step(self) -> float:
        """Tolerance in log-space for straddling the boundary (reals only)."""
        return -math.log1p(-self.rtol)


def _log_interpolate(x0: float, e0: float, x1: float, e1: float, target: float) -> float | None:
    """Where the line through (log x, log eps) crosses log(target); None if undefined."""
    if not (0 < e0 < math.inf and 0 < e1 < math.inf) or e0 == e1 or x0 == x1:
        return None
    slope = (math.log(e1) - math.log(e0)) / (math.log(x1) - math.log(x0))
    if slope == 0:
        return None
    return math.exp(math.log(x0) + (math.log(target) - math.log(e0)) / slope)


def _solve(problem: _Problem, start: float, *, slope: float) -> float:
    """Return the feasible end of a bracket that ``problem.done`` accepts.

    ``slope`` is a guess of d log(eps) / d log(x), used only to place the first
    probe on the other side of the boundary.
    """
    target = problem.target
    feasible_end = problem.lower if problem.increasing else problem.upper  # most private
    free_end = problem.upper if problem.increasing else problem.lower  # least private
    x = problem.snap(start)
    e = problem.eps_at(x)
    # 1. Bracket: step over the boundary by extrapolation, doubling the margin on misses.
    margin = 4 * problem.rtol if not problem.integer else 0.01
    feasible: float | None = x if e <= target else None
    infeasible: float | None = None if e <= target else x
    points = [(x, e)]
    for _ in range(_MAX_PROBES):
        if feasible is not None and infeasible is not None:
            break
        if feasible is None and x == feasible_end:
            raise InfeasiblePrivacyTargetError(_infeasible_message(problem, x, e))
        if infeasible is None and x == free_end:
            return x
        guess = None
        if len(points) >= 2:
            guess = _log_interpolate(*points[-2], *points[-1], target)
        if guess is None and 0 < e < math.inf:
            guess = x * math.exp((math.log(target) - math.log(e)) / slope)
        if guess is None:
            guess = x * 2.0 if (e <= target) == problem.increasing else x / 2.0
        # Push past the predicted boundary, towards the side we have not seen yet.
        toward_up = (feasible is None) != problem.increasing
        guess *= math.exp(margin if toward_up else -margin)
        if problem.integer:
            guess = math.ceil(guess) if toward_up else math.floor(guess)
            if guess == x:
                guess = x + (1 if toward_up else -1)
        new_x = problem.snap(guess)
        if (new_x > x) != toward_up or new_x == x:  # prediction pointed the wrong way
            new_x = problem.snap(x * 2.0 if toward_up else x / 2.0)
        x = new_x
        e = problem.eps_at(x)
        points.append((x, e))
        if e <= target:
            feasible = x if feasible is None or _nearer(problem, x, feasible) else feasible
        else:
            infeasible = x if infeasible is None or _nearer(problem, x, infeasible) else infeasible
        margin *= 4
    if feasible is None or infeasible is None:
        raise RuntimeError("calibration could not bracket the privacy target")  # a bug
    # 2. Refine the bracket; only ever keep a feasible point as the answer.
    values = dict(points)
    bisect_next = False
    for _ in range(_MAX_PROBES):
        if problem.done(feasible, infeasible):
            return feasible
        width = abs(math.log(infeasible) - math.log(feasible))
        for probe in _proposals(problem, feasible, infeasible, values, bisect_next):
            if not _inside(problem, probe, feasible, infeasible):
                continue
            values[probe] = problem.eps_at(probe)
            if values[probe] <= target:
                feasible = probe
            else:
                infeasible = probe
                break
        bisect_next = abs(math.log(infeasible) - math.log(feasible)) > width / 2
    raise RuntimeError("calibration did not converge")  # a bug: bisection always does


def _nearer(problem: _Problem, x: float, old: float) -> bool:
    """Is x closer to the boundary than old (both on the same side)?"""
    return x > old if problem.increasing else x < old


def _inside(problem: _Problem, x: float, feasible: float, infeasible: float) -> bool:
    return min(feasible, infeasible) < x < max(feasible, infeasible)


def _proposals(
    problem: _Problem,
    feasible: float,
    infeasible: float,
    values: dict[float, float],
    bisect: bool,
) -> list[float]:
    """Next probes: the interpolated boundary, straddled when the bracket is small."""
    guess = None
    if not bisect:
        guess = _log_interpolate(
            feasible, values[feasible], infeasible, values[infeasible], problem.target
        )
    lo, hi = min(feasible, infeasible), max(feasible, infeasible)
    if guess is None or not lo < guess < hi:
        guess = math.sqrt(lo * hi)
    up = infeasible > feasible  # direction from the feasible to the infeasible side
    if problem.integer:
        if guess <= lo + 1 or guess >= hi - 1:
            guess = (lo + hi) / 2
        a = math.floor(guess) if up else math.ceil(guess)
        a = min(max(a, lo + 1), hi - 1)
        return [a, a + 1 if up else a - 1]
    half = 0.49 * problem.step
    if bisect:
        return [guess]
    a = guess / math.exp(half) if up else guess * math.exp(half)
    b = guess * math.exp(half) if up else guess / math.exp(half)
    return [a, b]


def _infeasible_message(problem: _Problem, x: float, e: float) -> str:
    bound = " (the largest searched)" if problem.name == "noise multiplier" else ""
    return (
        f"target epsilon {problem.target:g} is out of reach: even {problem.name} "
        f"{x:g}{bound} gives epsilon {e:.4g}"
    )


def _finish(
    value: float,
    *,
    spec: Callable[[float], DpsgdPrivacySpec],
    target: float,
    delta: float,
    accountant: Accountant,
    nudge: Callable[[float], float],
    probes: int,
) -> Calibrated:
    """Report the standard accountant's epsilon, nudging the value if it disagrees."""
    for _ in range(64):
        achieved = epsilon(spec(value), delta, accountant)
        if achieved <= target:
            return Calibrated(value=value, epsilon=achieved, probes=probes)
        value = nudge(value)
    raise RuntimeError("standard accountant disagrees with the search")  # a bug


def _check_target(target_epsilon: float, delta: float, accountant: Accountant) -> None:
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise InvalidConfigError(f"target epsilon must be positive, got {target_epsilon}")
    check_delta(delta)
    check_accountant(accountant)


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Accountant = "pld",
    rtol: float = DEFAULT_RTOL,
) -> Calibrated:
    """Smallest sigma (within relative ``rtol``) with epsilon <= target."""
    _check_target(target_epsilon, delta, accountant)
    DpsgdPrivacySpec(noise_multiplier=1.0, sampling_rate=sampling_rate, steps=steps)
    start, slope = 1.0, -1.0
    with quiet_rdp_warnings():
        probes = 0
        for acc in ("rdp", accountant) if accountant == "pld" else ("rdp",):
            cache = _EpsilonCache(delta=delta, accountant=acc)
            problem = _Problem(
                name="noise multiplier",
                eps_at=lambda s, c=cache: c(noise_multiplier=s, sampling_rate=sampling_rate, steps=steps),
                target=target_epsilon,
                increasing=False,
                integer=False,
                lower=SIGMA_MIN,
                upper=SIGMA_MAX,
                rtol=rtol,
            )
            start = _solve(problem, start, slope=slope)
            probes += cache.probes
        return _finish(
            start,
            spec=lambda s: DpsgdPrivacySpec(noise_multiplier=s, sampling_rate=sampling_rate, steps=steps),
            target=target_epsilon,
            delta=delta,
            accountant=accountant,
            nudge=lambda s: min(s * (1 + rtol / 4), SIGMA_MAX),
            probes=probes,
        )


def calibrate_steps(
    *,
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sampling_rate: float,
    accountant: Accountant = "pld",
) -> Calibrated:
    """Largest number of steps with epsilon <= target."""
    _check_target(target_epsilon, delta, accountant)
    DpsgdPrivacySpec(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=1)
    start: float = 1000.0
    with quiet_rdp_warnings():
        probes = 0
        for acc in ("rdp", accountant) if accountant == "pld" else ("rdp",):
            cache = _EpsilonCache(delta=delta, accountant=acc)
            problem = _Problem(
                name="steps",
                eps_at=lambda t, c=cache: c(
                    noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=int(t)
                ),
                target=target_epsilon,
                increasing=True,
                integer=True,
                lower=1,
                upper=MAX_STEPS,
            )
            start = _solve(problem, start, slope=0.5)
            probes += cache.probes
        return _finish(
            int(start),
            spec=lambda t: DpsgdPrivacySpec(
                noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=int(t)
            ),
            target=target_epsilon,
            delta=delta,
            accountant=accountant,
            nudge=lambda t: _decrement(t, "steps", target_epsilon),
            probes=probes,
        )


def calibrate_batch_size(
    *,
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    steps: int,
    num_examples: int,
    accountant: Accountant = "pld",
) -> Calibrated:
    """Largest (expected) batch size with epsilon <= target, at most ``num_examples``."""
    _check_target(target_epsilon, delta, accountant)
    check_batch_size(batch_size=1, num_examples=num_examples)
    DpsgdPrivacySpec(noise_multiplier=noise_multiplier, sampling_rate=1.0, steps=steps)
    start: float = max(1.0, num_examples / 100)
    with quiet_rdp_warnings():
        probes = 0
        for acc in ("rdp", accountant) if accountant == "pld" else ("rdp",):
            cache = _EpsilonCache(delta=delta, accountant=acc)
            problem = _Problem(
                name="batch size",
                eps_at=lambda b, c=cache: c(
                    noise_multiplier=noise_multiplier,
                    sampling_rate=int(b) / num_examples,
                    steps=steps,
                ),
                target=target_epsilon,
                increasing=True,
                integer=True,
                lower=1,
                upper=num_examples,
            )
            start = _solve(problem, start, slope=1.0)
            probes += cache.probes
        return _finish(
            int(start),
            spec=lambda b: DpsgdPrivacySpec.from_batch_size(
                noise_multiplier=noise_multiplier,
                batch_size=int(b),
                num_examples=num_examples,
                steps=steps,
            ),
            target=target_epsilon,
            delta=delta,
            accountant=accountant,
            nudge=lambda b: _decrement(b, "batch size", target_epsilon),
            probes=probes,
        )


def _decrement(value: float, name: str, target: float) -> int:
    if value <= 1:
        raise InfeasiblePrivacyTargetError(f"epsilon {target:g} is out of reach even with {name} 1")
    return int(value) - 1
