"""The checks of the settings a user gives the privacy machinery: one place, one exception type.

Every value that reaches the mechanism (clip norm, delta, sizes, steps, noise multipliers, the
EMA's decay) is validated by a function here and nowhere else, so a bad value gets the same
one-line message whichever command or library function it came through, always as
``InvalidConfigError`` (which the command line turns into one line and exit code 2).
Callers check where a value enters (a config's ``__post_init__``, a builder's first line), not
again on the way down.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from dpscale.errors import InvalidConfigError

Accountant = Literal["pld", "rdp"]
SamplingScheme = Literal["poisson", "shuffle"]
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
SAMPLING_SCHEMES: tuple[str, ...] = ("poisson", "shuffle")

# The most steps an epsilon is computed for. Up to here every setting answers in seconds (the PLD's
# grid and blocked composition are sized for it, privacy.pld); beyond, dp-accounting's own bounds of
# a composition grow with the steps, and with them its time and memory. 10^8 is three orders beyond
# an ImageNet run (~10^5 steps), so a plan past it is refused rather than computed for minutes.
MAX_ACCOUNTED_STEPS = 10**8


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return _is_number(value) and math.isfinite(value) and int(value) == value


def check_positive(value: float, what: str) -> None:
    """``value`` is a positive, finite number."""
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise InvalidConfigError(f"{what} must be positive and finite, got {value}")


def check_positive_integer(value: int, what: str) -> None:
    """``value`` is an integer >= 1 (an integral float counts: sizes read from JSON)."""
    if not (_is_integer(value) and value >= 1):
        raise InvalidConfigError(f"{what} must be a positive integer, got {value}")


def check_choice(value: str, choices: Sequence[str], what: str) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise InvalidConfigError(f"{what} must be one of {tuple(choices)}, got {value!r}")


# The smallest clip norm: the norm bounds of privacy.rounding are relative, up to absolute losses of
# about 10^-32 near float32's underflow, which stay below a unit roundoff of any C from here up.
MIN_CLIP_NORM = 2.0**-64


def check_clip_norm(clip_norm: float) -> None:
    """The clip norm C: positive and finite (every clipped sum divides by it), and not below MIN_CLIP_NORM."""
    check_positive(clip_norm, "clip norm")
    if clip_norm < MIN_CLIP_NORM:
        raise InvalidConfigError(f"clip norm must be at least 2^-64 (about 5.4e-20), got {clip_norm}")


def check_delta(delta: float) -> None:
    """``0 < delta < 1``."""
    if not (_is_number(delta) and 0 < delta < 1):
        raise InvalidConfigError(f"delta must be in (0, 1), got {delta}")


def check_noise_multiplier(noise_multiplier: float, *, zero_allowed: bool = False) -> None:
    """A noise multiplier: positive and finite (0 too where it means a non-private run)."""
    if zero_allowed and _is_number(noise_multiplier) and noise_multiplier == 0:
        return
    if not (_is_number(noise_multiplier) and math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise InvalidConfigError(f"noise multiplier must be a positive number, got {noise_multiplier}")


def check_releases(releases: Sequence[float]) -> None:
    """Every one-off release's noise multiplier is positive and finite."""
    for sigma in releases:
        if not (_is_number(sigma) and math.isfinite(sigma) and sigma > 0):
            raise InvalidConfigError(f"release noise multipliers must be positive numbers, got {tuple(releases)}")


def check_batch_size(*, batch_size: float, num_examples: int) -> None:
    """``1 <= batch_size <= num_examples``, both integers."""
    check_positive_integer(num_examples, "number of examples")
    check_positive_integer(batch_size, "batch size")
    if batch_size > num_examples:
        raise InvalidConfigError(
            f"batch size {batch_size} exceeds the number of examples {num_examples} "
            f"(sampling rate q = {batch_size / num_examples:.4g} > 1)"
        )


def check_sampling_rate(sampling_rate: float) -> None:
    """``0 < q <= 1``."""
    if not (_is_number(sampling_rate) and 0 < sampling_rate <= 1):
        raise InvalidConfigError(
            f"sampling rate q = batch size / number of examples must be in (0, 1], got {sampling_rate}"
        )


def check_steps(steps: int) -> None:
    """A positive integer."""
    check_positive_integer(steps, "steps")


def check_accounted_steps(steps: int) -> None:
    """No more steps than the accountant computes an epsilon for (``MAX_ACCOUNTED_STEPS``)."""
    if steps > MAX_ACCOUNTED_STEPS:
        raise InvalidConfigError(
            f"{steps:,} steps: epsilon is computed for at most {MAX_ACCOUNTED_STEPS:,} steps (10^8, in seconds); "
            "beyond that the accountant's time and memory grow without bound, and no training run needs as many"
        )


def check_ema_decay(ema_decay: float) -> None:
    """The EMA's decay after warm-up: in [0, 1)."""
    if not (_is_number(ema_decay) and 0 <= ema_decay < 1):
        raise InvalidConfigError(f"EMA decay must be in [0, 1), got {ema_decay}")


def check_accountant(accountant: str) -> None:
    check_choice(accountant, ACCOUNTANTS, "accountant")


def check_sampling(sampling: str) -> None:
    check_choice(sampling, SAMPLING_SCHEMES, "sampling")


def check_mechanism(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    sampling: str = "poisson",
    releases: Sequence[float] = (),
) -> None:
    """(sigma, q, T, sampling, releases) describe a DP-SGD run the accountant can compute."""
    check_releases(releases)
    check_noise_multiplier(noise_multiplier)
    check_sampling_rate(sampling_rate)
    check_steps(steps)
    check_accounted_steps(steps)
    check_sampling(sampling)


# The largest mean number of runs of a private selection: past it the runs, not the accounting, are the problem.
MAX_REPETITIONS_MEAN = 10**6


def check_repetitions(distribution: str, mean: float, shape: float, distributions: Sequence[str]) -> None:
    """A private selection's number of runs: a known family, a mean above 1 (>= 1 for Poisson), eta >= 0."""
    check_choice(distribution, distributions, "the distribution of the number of runs")
    if distribution == "poisson":
        if not (_is_number(mean) and 1 <= mean <= MAX_REPETITIONS_MEAN):
            raise InvalidConfigError(f"the mean number of runs must be in [1, {MAX_REPETITIONS_MEAN:g}], got {mean}")
    elif not (_is_number(mean) and 1 < mean <= MAX_REPETITIONS_MEAN):
        raise InvalidConfigError(
            f"the mean number of runs must be in (1, {MAX_REPETITIONS_MEAN:g}] (1 would be a single run), got {mean}"
        )
    if not (_is_number(shape) and 0 <= shape < math.inf):
        raise InvalidConfigError(f"the negative binomial's shape eta must be >= 0 and finite, got {shape}")
