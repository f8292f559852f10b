"""The calibrate command: the missing one of {noise multiplier, steps, batch size} for a target.

``run(CalibrateConfig)`` calibrates a ``PrivacyPlan`` (the same call ``dpscale train`` makes
before its first step): the smallest noise multiplier, or the largest number of steps or
batch size, whose epsilon is at most the target. Never above it. A search that takes more than a
few seconds (PLD with truncated batches: several seconds, more under load) says so on stderr. With
``private_selection`` the target is that of the selection's output (the best of a random number of runs, each
scored with noise: ``privacy.selection``), and each run gets the knob that meets it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dpscale.errors import InvalidConfigError
from dpscale.privacy import calibration
from dpscale.privacy.checks import (  # ACCOUNTANTS: --accountant's choices, read by the CLI  # noqa: F401
    ACCOUNTANTS,
    Accountant,
    check_releases,
)
from dpscale.privacy.plan import PlanReport, PrivacyPlan, PrivacyTarget, knob_to_solve
from dpscale.privacy.selection import Selection, SelectionPlan
from dpscale.progress import status


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
    releases: tuple[float, ...] = ()  # one-off Gaussian releases before training, composed in
    show_progress: bool = True  # a line on stderr if the search takes more than a few seconds
    private_selection: Selection | None = None  # the target is the best of K runs' (privacy.selection)

    def __post_init__(self) -> None:
        if self.epsilon == float("inf"):
            raise InvalidConfigError("calibration needs a finite target epsilon")
        _ = self.target  # checks epsilon, delta and the accountant
        _ = self.solve_for  # checks the knobs
        check_releases(tuple(self.releases))
        if not 0 < self.rtol < 0.5:
            raise InvalidConfigError(f"rtol must be in (0, 0.5), got {self.rtol}")

    @property
    def target(self) -> PrivacyTarget:
        return PrivacyTarget(self.epsilon, self.delta, self.accountant)

    @property
    def solve_for(self) -> str:
        return knob_to_solve(
            num_examples=self.num_examples,
            batch_size=self.batch_size,
            steps=self.steps,
            noise_multiplier=self.noise_multiplier,
        )


@dataclasses.dataclass(frozen=True)
class CalibrateResult(PlanReport):
    """The calibrated plan (its epsilon is the achieved one, <= ``target_epsilon``) and what was solved."""

    target_epsilon: float
    solved_for: str
    seconds: float
    private_selection: dict[str, Any] | None = None  # SelectionPlan.report(): the epsilon above, one run's beside


def run(config: CalibrateConfig) -> CalibrateResult:
    """Solve for the missing knob; the achieved epsilon is never above the target."""
    started = time.perf_counter()
    what = f"calibrate: solving for the {config.solve_for.replace('_', ' ')} ({config.accountant.upper()} accountant)"
    if config.private_selection is not None:
        with status(f"{what} of a private selection", enabled=config.show_progress):
            selection = SelectionPlan.calibrate(
                config.target,
                config.private_selection,
                num_examples=config.num_examples,
                batch_size=config.batch_size,
                steps=config.steps,
                noise_multiplier=config.noise_multiplier,
                releases=tuple(config.releases),
                rtol=config.rtol,
            )
        report = selection.report()
        result = CalibrateResult.of(
            selection.run,
            target_epsilon=config.epsilon,
            solved_for=config.solve_for,
            seconds=time.perf_counter() - started,
            private_selection=report,
        )
        return dataclasses.replace(result, epsilon=report["epsilon"], accountant="rdp", epsilon_bound="rdp")
    with status(what, enabled=config.show_progress):
        plan = PrivacyPlan.calibrate(
            config.target,
            num_examples=config.num_examples,
            batch_size=config.batch_size,
            steps=config.steps,
            noise_multiplier=config.noise_multiplier,
            releases=tuple(config.releases),
            rtol=config.rtol,
        )
    return CalibrateResult.of(
        plan, target_epsilon=config.epsilon, solved_for=config.solve_for, seconds=time.perf_counter() - started
    )
