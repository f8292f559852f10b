"""The bracketing search on cheap synthetic monotone functions: feasible, tight, robust."""

import math

import numpy as np
import pytest

from dpscale.errors import InfeasiblePrivacyTargetError
from dpscale.privacy.bracket_search import MonotoneProblem, solve_boundary


class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, x):
        self.calls += 1
        return self.fn(x)


@pytest.mark.parametrize("seed", range(20))
def test_decreasing_real_boundary_is_feasible_and_within_rtol(seed):
    rng = np.random.default_rng(seed)
    power, scale, target = rng.uniform(0.5, 3), rng.uniform(0.1, 100), rng.uniform(0.05, 20)
    eps = Counted(lambda s: scale * s**-power + 1e-3 * math.sin(s) ** 2 / s)
    problem = MonotoneProblem(
        name="noise multiplier",
        eps_at=eps,
        target=target,
        increasing=False,
        integer=False,
        lower=1e-3,
        upper=1e6,
        rtol=1e-3,
    )
    sigma, _ = solve_boundary(problem, float(rng.uniform(0.1, 10)), slope=-1.0)
    assert eps.fn(sigma) <= target
    assert eps.fn(sigma * (1 - 1e-3)) > target
    assert eps.calls < 40


@pytest.mark.parametrize("seed", range(20))
def test_increasing_integer_boundary_is_the_largest_feasible_integer(seed):
    rng = np.random.default_rng(100 + seed)
    power, scale = rng.uniform(0.3, 1.5), rng.uniform(1e-4, 1)
    target = scale * float(rng.integers(2, 10**6)) ** power * rng.uniform(0.9, 1.1)
    eps = Counted(lambda t: scale * t**power)
    problem = MonotoneProblem(
        name="steps", eps_at=eps, target=target, increasing=True, integer=True, lower=1, upper=10**9
    )
    if eps.fn(1) > target:
        with pytest.raises(InfeasiblePrivacyTargetError):
            solve_boundary(problem, 1000.0, slope=0.5)
        return
    steps, _ = solve_boundary(problem, float(rng.integers(1, 10**5)), slope=0.5)
    assert steps == int(steps)
    assert eps.fn(steps) <= target < eps.fn(steps + 1)
    assert eps.calls < 60


def test_step_function_with_flat_parts_still_converges_to_the_boundary():
    # Flat stretches break interpolation; bisection must take over.
    eps = lambda x: float(math.floor(x / 1000))  # noqa: E731
    problem = MonotoneProblem(
        name="batch size", eps_at=eps, target=7.0, increasing=True, integer=True, lower=1, upper=10**6
    )
    found, _ = solve_boundary(problem, 10.0, slope=1.0)
    assert found == 7999


def test_infinite_and_zero_epsilons_are_handled():
    eps = lambda s: math.inf if s < 1 else (0.0 if s > 50 else 10 / s)  # noqa: E731
    problem = MonotoneProblem(
        name="noise multiplier", eps_at=eps, target=2.0, increasing=False, integer=False, lower=1e-2, upper=1e4
    )
    sigma, _ = solve_boundary(problem, 0.1, slope=-1.0)
    assert eps(sigma) <= 2.0 < eps(sigma * (1 - 1e-3))


def test_the_free_end_is_returned_when_everything_is_feasible():
    problem = MonotoneProblem(
        name="batch size", eps_at=lambda b: b / 1e9, target=1.0, increasing=True, integer=True, lower=1, upper=5000
    )
    assert solve_boundary(problem, 10.0, slope=1.0)[0] == 5000


def test_nothing_feasible_raises_with_the_parameter_in_the_message():
    problem = MonotoneProblem(
        name="noise multiplier",
        eps_at=lambda s: 5.0 / s,
        target=1e-6,
        increasing=False,
        integer=False,
        lower=1e-2,
        upper=1e4,
    )
    with pytest.raises(InfeasiblePrivacyTargetError, match="noise multiplier = 10000"):
        solve_boundary(problem, 1.0, slope=-1.0)
