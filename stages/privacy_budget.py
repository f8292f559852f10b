"""The privacy-budget stages: epsilon of a planned run, and calibration of one knob.

``run_epsilon(EpsilonConfig)`` answers "what does this run spend?";
``run_calibrate(CalibrateConfig)`` answers "what must the missing one of {noise
multiplier, steps, batch size} be so the run spends at most epsilon?". Both are pure
functions of their frozen config; warnings (e.g. delta >= 1/N) come back in the result
so the caller decides how to show them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from dpscale.errors import InvalidConfigError
from dpscale.privacy import accounting, calibration
from dpscale.privacy.accounting import Accountant, SamplingScheme


def _positive(name: str, value: float | None, *, integer: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise InvalidConfigError(f"{name} must be positive, got {value}")
    if integer and int(value) != value:
        raise InvalidConfigError(f"{name} must be an integer, got {value}")


def _common_checks(*, delta: float, num_examples: int, accountant: str) -> None:
    _positive("num_examples", num_examples, integer=True)
    accounting.check_delta(delta)
    accounting.check_accountant(accountant)


def _warnings(*, delta: float, num_examples: int, sampling: str = "poisson") -> tuple[str, ...]:
    notes = []
    if delta >= 1 / num_examples:
        notes.append(
            f"delta = {delta:g} is not below 1/num_examples = {1 / num_examples:g}: a mechanism "
            f"that publishes a random example verbatim meets it; use delta << 1/N"
        )
    if sampling != "poisson":
        notes.append(
            f"sampling {sampling!r} is accounted as Poisson sampling at the same rate; "
            f"that epsilon is not a proven guarantee for {sampling!r} batches"
        )
    return tuple(notes)


@dataclasses.dataclass(frozen=True)
class EpsilonConfig:
    """A planned DP-SGD run: sigma, T steps, expected batch size B out of N examples."""

    noise_multiplier: float
    steps: int
    batch_size: int
    num_examples: int
    delta: float
    accountant: Accountant = "pld"
    sampling: SamplingScheme = "poisson"

    def __post_init__(self) -> None:
        _positive("noise multiplier", self.noise_multiplier)
        _positive("steps", self.steps, integer=True)
        _positive("batch size", self.batch_size, integer=True)
        _common_checks(delta=self.delta, num_examples=self.num_examples, accountant=self.accountant)
        accounting.check_batch_size(batch_size=self.batch_size, num_examples=self.num_examples)

    def spec(self) -> accounting.DpsgdPrivacySpec:
        return accounting.DpsgdPrivacySpec.from_batch_size(
            noise_multiplier=self.noise_multiplier,
            batch_size=int(self.batch_size),
            num_examples=int(self.num_examples),
            steps=int(self.steps),
            sampling=self.sampling,
        )


@dataclasses.dataclass(frozen=True)
class EpsilonResult:
    epsilon: float
    delta: float
    accountant: str
    noise_multiplier: float
    steps: int
    batch_size: int
    num_examples: int
    sampling_rate: float
    sampling: str
    exact: bool
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"warnings": list(self.warnings)}


def run_epsilon(config: EpsilonConfig) -> EpsilonResult:
    """Epsilon (at ``config.delta``) that the planned run spends."""
    spec = config.spec()
    return EpsilonResult(
        epsilon=accounting.epsilon(spec, config.delta, config.accountant),
        delta=config.delta,
        accountant=config.accountant,
        noise_multiplier=spec.noise_multiplier,
        steps=spec.steps,
        batch_size=int(config.batch_size),
        num_examples=int(config.num_examples),
        sampling_rate=spec.sampling_rate,
        sampling=spec.sampling,
        exact=spec.exact,
        warnings=_warnings(
            delta=config.delta, num_examples=config.num_examples, sampling=config.sampling
        ),
    )


_KNOBS = ("noise_multiplier", "steps", "batch_size")


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    """A privacy target and exactly two of {noise multiplier, steps, batch size}."""

    epsilon: float
    delta: float
    num_examples: int
    batch_size: int | None = None
    steps: int | None = None
    noise_multiplier: float | None = None
    accountant: Accountant = "pld"
    rtol: float = calibration.DEFAULT_RTOL  # relative tolerance on the noise multiplier
    # One-off Gaussian releases before training (accounting.DpsgdPrivacySpec): composed in.
    releases: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _positive("epsilon", self.epsilon)
        accounting.check_releases(self.releases)
        _common_checks(delta=self.delta, num_examples=self.num_examples, accountant=self.accountant)
        _positive("noise multiplier", self.noise_multiplier)
        _positive("steps", self.steps, integer=True)
        _positive("batch size", self.batch_size, integer=True)
        if self.batch_size is not None:
            accounting.check_batch_size(batch_size=self.batch_size, num_examples=self.num_examples)
        if not 0 < self.rtol < 0.5:
            raise InvalidConfigError(f"rtol must be in (0, 0.5), got {self.rtol}")
        missing = [k for k in _KNOBS if getattr(self, k) is None]
        if len(missing) != 1:
            given = "none" if len(missing) == 3 else "all three" if not missing else "only one"
            raise InvalidConfigError(
                "give exactly two of noise multiplier, steps and batch size (the third is "
                f"solved for); got {given}"
            )

    @property
    def solve_for(self) -> str:
        return next(k for k in _KNOBS if getattr(self, k) is None)


@dataclasses.dataclass(frozen=True)
class CalibrateResult:
    noise_multiplier: float
    steps: int
    batch_size: int
    num_examples: int
    sampling_rate: float
    epsilon: float  # achieved, from dp-accounting's standard accountant; <= target_epsilon
    target_epsilon: float
    delta: float
    accountant: str
    solved_for: str
    seconds: float
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"warnings": list(self.warnings)}


def run_calibrate(config: CalibrateConfig) -> CalibrateResult:
    """Solve for the missing knob; the achieved epsilon is never above the target."""
    started = time.perf_counter()
    n = int(config.num_examples)
    sigma, steps, batch = config.noise_multiplier, config.steps, config.batch_size
    target = dict(target_epsilon=config.epsilon, delta=config.delta, accountant=config.accountant,
                  releases=tuple(config.releases))
    if config.solve_for == "noise_multiplier":
        found = calibration.calibrate_noise_multiplier(
            sampling_rate=batch / n, steps=int(steps), rtol=config.rtol, **target
        )
        sigma = found.value
    elif config.solve_for == "steps":
        found = calibration.calibrate_steps(noise_multiplier=sigma, sampling_rate=batch / n, **target)
        steps = found.value
    else:
        found = calibration.calibrate_batch_size(
            noise_multiplier=sigma, steps=int(steps), num_examples=n, **target
        )
        batch = found.value
    return CalibrateResult(
        noise_multiplier=float(sigma),
        steps=int(steps),
        batch_size=int(batch),
        num_examples=n,
        sampling_rate=int(batch) / n,
        epsilon=found.epsilon,
        target_epsilon=config.epsilon,
        delta=config.delta,
        accountant=config.accountant,
        solved_for=config.solve_for,
        seconds=time.perf_counter() - started,
        warnings=_warnings(delta=config.delta, num_examples=n),
    )
