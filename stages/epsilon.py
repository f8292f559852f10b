"""The epsilon command: what a planned DP-SGD run spends.

``run(EpsilonConfig)`` builds the ``PrivacyPlan`` of (sigma, T steps, expected batch B out
of N examples, batches truncated to the capacity a run's ledger records, or the rule's) and
reports its epsilon at delta, with the warnings every command shows for such a plan
(delta >= 1/N, shuffled batches). A capacity below B is refused (``accounting.Truncation.check_rate``):
there the accounted neighbour N + 1 is not the worse one. With ``private_selection`` it reports the
epsilon of publishing the best of a random number of such runs, each scored with noise
(``privacy.selection``), beside one run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpscale.errors import InvalidConfigError
from dpscale.privacy import repetitions
from dpscale.privacy.checks import (  # ACCOUNTANTS: --accountant's choices, read by the CLI  # noqa: F401
    ACCOUNTANTS,
    Accountant,
    SamplingScheme,
)
from dpscale.privacy.plan import PlanReport, PrivacyPlan
from dpscale.privacy.selection import DEFAULT_SCORE_NOISE, Selection, SelectionPlan  # noqa: F401 - read by the CLI

#: The private selection flags' choices and defaults, read by the command line (``cli_options.SELECTION_OPTIONS``).
REPETITIONS = repetitions.DISTRIBUTIONS
DEFAULT_REPETITIONS = repetitions.DEFAULT_DISTRIBUTION
DEFAULT_REPETITIONS_MEAN = repetitions.DEFAULT_MEAN
DEFAULT_REPETITIONS_SHAPE = repetitions.DEFAULT_SHAPE


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
    batch_capacity: int = 0  # Poisson batches truncated to this many examples (a run's ledger); 0: the rule
    private_selection: Selection | None = None  # the best of K such runs, scored with noise (privacy.selection)

    def __post_init__(self) -> None:
        plan = self.plan()  # refuses a bad setting at once, in one line
        if not plan.private:  # a plan without noise is valid (non-private), but spends infinite epsilon
            raise InvalidConfigError(f"noise multiplier must be positive, got {self.noise_multiplier}")
        if self.private_selection is not None and self.sampling != "poisson":
            raise InvalidConfigError("a private selection is accounted for Poisson sampling only, not 'shuffle'")

    def plan(self) -> PrivacyPlan:
        return PrivacyPlan(
            num_examples=self.num_examples,
            batch_size=self.batch_size,
            steps=self.steps,
            noise_multiplier=self.noise_multiplier,
            delta=self.delta,
            accountant=self.accountant,
            sampling=self.sampling,
            batch_capacity=self.batch_capacity,
        )


@dataclasses.dataclass(frozen=True)
class EpsilonResult(PlanReport):
    """The plan's epsilon at delta, with its warnings; with a private selection, the selection's (RDP)."""

    private_selection: dict[str, Any] | None = None  # SelectionPlan.report(): the epsilon above, one run's beside


def run(config: EpsilonConfig) -> EpsilonResult:
    """Epsilon (at ``config.delta``) that the planned run (or the best of a random number of them) spends."""
    if config.private_selection is None:
        return EpsilonResult.of(config.plan())
    selection = SelectionPlan(config.plan().resolved(), config.private_selection)
    report = selection.report()
    result = EpsilonResult.of(selection.run, private_selection=report)
    return dataclasses.replace(result, epsilon=report["epsilon"], accountant="rdp", epsilon_bound="rdp")
