"""A bracketing search for the boundary of a monotone constraint ``eps(x) <= target``.

Calibration needs the extreme feasible value of one parameter (smallest sigma, largest
steps or batch size) under an epsilon that is monotone in it and costly to evaluate.
The search keeps an explicit [feasible, infeasible] bracket, so its answer (always the
feasible end) can never overshoot the target; it stops when the bracket is within the
tolerance, which makes tightness a testable stopping rule rather than a hope.

Probes come from interpolating log(eps) against log(x) (epsilon is close to a power law
in each DP-SGD parameter), Illinois-weighted so a stale bracket end cannot stall it;
near the boundary two probes one tolerance apart straddle the prediction, and plain
bisection takes over after two rounds that fail to halve the bracket.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from dpscale.errors import InfeasiblePrivacyTargetError


@dataclasses.dataclass(frozen=True)
class MonotoneProblem:
    """A monotone one-parameter search: find the feasible boundary of eps(x) <= target."""

    name: str
    eps_at: Callable[[float], float]
    target: float
    increasing: bool  # eps grows with x (steps, batch size) or shrinks (sigma)
    integer: bool
    lower: float
    upper: float
    rtol: float = 1e-3  # relative tolerance on x for real-valued problems
    # How far past the predicted boundary the first bracketing probe goes (log-space); None: a default
    # for a rough start. A start known to be close (a coarser accountant's answer) takes a small one.
    margin: float | None = None

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


def _gap(eps: float, target: float) -> float:
    """log(eps / target): negative when feasible; +-inf for eps in {0, inf}."""
    if eps <= 0:
        return -math.inf
    return math.log(eps) - math.log(target) if eps < math.inf else math.inf


def _interpolate(x0: float, g0: float, x1: float, g1: float) -> float | None:
    """Where the line through (log x, gap) crosses zero; None if undefined."""
    if not (math.isfinite(g0) and math.isfinite(g1)) or g0 == g1 or x0 == x1:
        return None
    t = -g0 / (g1 - g0)
    return _exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))


def _exp(log_x: float) -> float | None:
    """exp, or None where a wild extrapolation would overflow (the caller then doubles or halves)."""
    return math.exp(log_x) if abs(log_x) < 700 else None


def _slope(x0: float, g0: float, x1: float, g1: float) -> float | None:
    if not (math.isfinite(g0) and math.isfinite(g1)) or g0 == g1 or x0 == x1:
        return None
    return (g1 - g0) / (math.log(x1) - math.log(x0))


def solve_boundary(problem: MonotoneProblem, start: float, *, slope: float) -> tuple[float, float]:
    """Return the feasible end of a bracket that ``problem.done`` accepts, and the
    local slope d log(eps) / d log(x) there (a good first guess for a finer accountant).

    ``slope`` is a guess of that slope, used only to place the first probe on the
    other side of the boundary.
    """
    target = problem.target
    private_end = problem.lower if problem.increasing else problem.upper
    free_end = problem.upper if problem.increasing else problem.lower
    x = problem.snap(start)
    e = problem.eps_at(x)
    # 1. Bracket: step over the predicted boundary, widening the margin on misses.
    margin = problem.margin if problem.margin is not None else 10 * problem.rtol if not problem.integer else 0.002
    feasible: float | None = x if e <= target else None
    infeasible: float | None = None if e <= target else x
    points = [(x, _gap(e, target))]
    while feasible is None or infeasible is None:
        if feasible is None and x == private_end:
            raise InfeasiblePrivacyTargetError(_infeasible_message(problem, x, e))
        if infeasible is None and x == free_end:
            return x, slope
        guess = _interpolate(*points[-2], *points[-1]) if len(points) >= 2 else None
        if guess is None and math.isfinite(points[-1][1]):
            factor = _exp(-points[-1][1] / slope)
            guess = None if factor is None else x * factor
        toward_up = (feasible is None) != problem.increasing
        if guess is None:
            guess = x * 2.0 if toward_up else x / 2.0
        guess *= math.exp(min(margin, 50.0) if toward_up else -min(margin, 50.0))
        if problem.integer:
            guess = math.ceil(guess) if toward_up else math.floor(guess)
        new_x = problem.snap(guess)
        if (new_x > x) != toward_up or new_x == x:  # the prediction pointed the wrong way
            new_x = problem.snap(x * 2.0 if toward_up else x / 2.0)
            if problem.integer and new_x == x:
                new_x = problem.snap(x + (1 if toward_up else -1))
        x = new_x
        e = problem.eps_at(x)
        points.append((x, _gap(e, target)))
        if e <= target:
            feasible = x if feasible is None or _nearer(problem, x, feasible) else feasible
        else:
            infeasible = x if infeasible is None or _nearer(problem, x, infeasible) else infeasible
        margin *= 4
    # 2. Refine: interpolate (Illinois-weighted), straddle the boundary when close, bisect
    # after two rounds in a row that did not halve the bracket. Only feasible points are
    # ever returned.
    gaps = dict(points)
    g_feasible, g_infeasible = gaps[feasible], gaps[infeasible]
    last_side: bool | None = None
    slow_rounds = 0
    while not problem.done(feasible, infeasible):
        width = abs(math.log(infeasible) - math.log(feasible))
        guess = None
        if slow_rounds < 2:
            guess = _interpolate(feasible, g_feasible, infeasible, g_infeasible)
        for probe in _candidates(problem, feasible, infeasible, guess):
            if not min(feasible, infeasible) < probe < max(feasible, infeasible):
                continue
            e = problem.eps_at(probe)
            g = gaps[probe] = _gap(e, target)
            side = e <= target  # decide on eps itself: log() can round a hair above to 0
            if side:
                feasible, g_feasible = probe, g
                if last_side is True:
                    g_infeasible /= 2  # Illinois: keep a stale end from stalling the secant
            else:
                infeasible, g_infeasible = probe, g
                if last_side is False:
                    g_feasible /= 2
            last_side = side
            if not side:
                break
        halved = abs(math.log(infeasible) - math.log(feasible)) <= width / 2
        slow_rounds = 0 if halved else slow_rounds + 1
    found = _slope(feasible, gaps[feasible], infeasible, gaps[infeasible])
    return feasible, (found if found is not None and found * slope > 0 else slope)


def _nearer(problem: MonotoneProblem, x: float, old: float) -> bool:
    """Is x closer to the boundary than old (both on the same side)?"""
    return x > old if problem.increasing else x < old


def _candidates(problem: MonotoneProblem, feasible: float, infeasible: float, guess: float | None) -> list[float]:
    """Next probes: the predicted boundary, straddled by two probes when close."""
    lo, hi = min(feasible, infeasible), max(feasible, infeasible)
    if guess is None or not lo < guess < hi:
        guess = math.sqrt(lo * hi)
    wide = hi - lo > 64 if problem.integer else math.log(hi / lo) > 64 * problem.step
    if wide:  # keep a probe of a wide bracket off its ends: one that hugs an end barely shrinks it
        share = min(max(math.log(guess / lo) / math.log(hi / lo), 1 / 16), 15 / 16)
        guess = lo * (hi / lo) ** share
    up = infeasible > feasible  # direction from the feasible to the infeasible side
    if problem.integer:
        a = math.floor(guess) if up else math.ceil(guess)
        a = min(max(a, lo + 1), hi - 1)
        return [a] if wide else [a, a + 1 if up else a - 1]
    if wide:
        return [guess]
    half = math.exp(0.49 * problem.step)
    return [guess / half, guess * half] if up else [guess * half, guess / half]


def _infeasible_message(problem: MonotoneProblem, x: float, e: float) -> str:
    bound = " (the largest searched)" if problem.name == "noise multiplier" else ""
    return (
        f"target epsilon {problem.target:g} is out of reach: even with {problem.name} = "
        f"{x:g}{bound}, epsilon is {e:.4g}"
    )
