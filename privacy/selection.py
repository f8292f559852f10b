"""A private selection: the best of K DP runs, K random and secret (Papernot & Steinke, ICLR 2022).

The mechanism A: draw K (``privacy.repetitions``); K times, independently, run Q; publish only the
best run's output (nothing when K = 0). One Q is: draw a setting uniformly from the grid, train it
by DP-SGD (the run's ``PrivacyPlan``: one-off releases, then T truncated Poisson-subsampled
Gaussian steps) and score it on held-out private rows by a noisy count, the number of rows its
EMA parameters classify correctly plus N(0, score_noise^2) (sensitivity 1: one row changes the
count by at most 1). Q's event is the composition of its releases, steps and the count, and A's is
dp-accounting's ``RepeatAndSelectDpEvent`` of it: its Theorem 2 (negative binomial) or 6 (Poisson)
applied to Q's RDP curve, through the RDP accountant (``privacy.rdp_accountant``: dp-accounting's,
plus the truncated step, whose RDP bound ``accounting.truncated_step_rdp`` is proven for exactly
the event a run executes). The PLD accountant cannot answer: repeat-and-select is a statement
about Renyi divergences of Q (its pmf's generating function applied to them), and there is no
privacy-loss distribution of A to compose; dp-accounting's PLD accountant refuses the event.

Calibration (``SelectionPlan.calibrate``) finds the missing one of {noise multiplier, steps,
batch size} of each run so that A's epsilon is at most the target, by the bracketing search of
``privacy.bracket_search`` (the feasible end only, so never above the target), first without
truncation, then with the smallest capacity of ``calibration.CAPACITY_LADDER`` that adds at most
``calibration.TRUNCATION_COST`` to A's epsilon; the run's plan records that capacity, so the runs
execute exactly the event accounted.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import dp_accounting

from dpscale.errors import InfeasiblePrivacyTargetError, InvalidConfigError
from dpscale.privacy import calibration
from dpscale.privacy.accounting import Truncation, dp_event, quiet_rdp_warnings
from dpscale.privacy.bracket_search import MonotoneProblem, solve_boundary
from dpscale.privacy.checks import check_delta, check_positive
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget, knob_to_solve
from dpscale.privacy.rdp_accountant import RdpAccountant
from dpscale.privacy.repetitions import Repetitions
from dpscale.privacy.sampling import batch_capacity

#: The score's Gaussian noise in rows (its sensitivity is one row): 0.1% of 10,000 held-out rows.
DEFAULT_SCORE_NOISE = 10.0


@dataclasses.dataclass(frozen=True)
class Selection:
    """What the user picks: the distribution of the number of runs, and the noise of each run's score."""

    repetitions: Repetitions = Repetitions()
    score_noise: float = DEFAULT_SCORE_NOISE

    def __post_init__(self) -> None:
        check_positive(self.score_noise, "the score's noise (--score-noise)")

    @classmethod
    def of(
        cls,
        *,
        repetitions: str | None = None,
        repetitions_mean: float | None = None,
        repetitions_shape: float | None = None,
        score_noise: float | None = None,
    ) -> Selection:
        """From the command line's flat options; None: the default."""
        given = {"distribution": repetitions, "mean": repetitions_mean, "shape": repetitions_shape}
        kept = Repetitions(**{k: v for k, v in given.items() if v is not None})
        return cls(kept, DEFAULT_SCORE_NOISE if score_noise is None else score_noise)

    def to_json(self) -> dict[str, Any]:
        return {"repetitions": self.repetitions.to_json(), "score_noise": self.score_noise}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Selection:
        return cls(Repetitions(**payload["repetitions"]), float(payload["score_noise"]))


def run_event(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    score_noise: float,
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
) -> dp_accounting.DpEvent:
    """The DpEvent of one run Q: its releases and steps (``accounting.dp_event``), then its noisy score."""
    training = dp_event(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        steps=steps,
        releases=releases,
        truncation=truncation,
    )
    return dp_accounting.ComposedDpEvent([training, dp_accounting.GaussianDpEvent(score_noise)])


def selection_event(run: dp_accounting.DpEvent, repetitions: Repetitions) -> dp_accounting.DpEvent:
    """The DpEvent of the best of K runs, K drawn from ``repetitions``."""
    return dp_accounting.dp_event.RepeatAndSelectDpEvent(run, repetitions.mean, repetitions.event_shape)


def events_epsilon(events: tuple[dp_accounting.DpEvent, ...], delta: float) -> float:
    """Epsilon at ``delta`` of ``events`` composed, by the RDP accountant (the only one for repeat-and-select)."""
    check_delta(delta)
    accountant = RdpAccountant()
    with quiet_rdp_warnings():
        accountant.compose(dp_accounting.ComposedDpEvent(list(events)))
        return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=1024)  # pure; a calibration asks for neighbouring settings again
def selection_epsilon(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    selection: Selection,
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
) -> float:
    """Epsilon at ``delta`` of publishing the best of K runs of (sigma, q, T, truncation, releases, score)."""
    run = run_event(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        steps=steps,
        score_noise=selection.score_noise,
        releases=releases,
        truncation=truncation,
    )
    return events_epsilon((selection_event(run, selection.repetitions),), delta)


@dataclasses.dataclass(frozen=True)
class SelectionPlan:
    """A private selection: every run's mechanism (``run``, capacity recorded) and the selection's settings."""

    run: PrivacyPlan
    selection: Selection

    def __post_init__(self) -> None:
        if not self.run.private or self.run.sampling != "poisson":
            raise InvalidConfigError("a private selection needs private runs with Poisson sampling")
        if not self.run.batch_capacity:
            raise InvalidConfigError("a private selection's runs must record their capacity (PrivacyPlan.resolved)")

    @property
    def event(self) -> dp_accounting.DpEvent:
        plan = self.run
        one = run_event(
            noise_multiplier=plan.noise_multiplier,
            sampling_rate=plan.sampling_rate,
            steps=plan.steps,
            score_noise=self.selection.score_noise,
            releases=plan.releases,
            truncation=plan.truncation,
        )
        return selection_event(one, self.selection.repetitions)

    def epsilon(self, delta: float | None = None) -> float:
        """The selection's epsilon (RDP) at ``delta`` (default: the run plan's)."""
        plan = self.run
        return selection_epsilon(
            noise_multiplier=plan.noise_multiplier,
            sampling_rate=plan.sampling_rate,
            steps=plan.steps,
            delta=plan.delta if delta is None else delta,
            selection=self.selection,
            releases=plan.releases,
            truncation=plan.truncation,
        )

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run.to_json(), **self.selection.to_json()}

    def report(self) -> dict[str, Any]:
        """What ``dpscale epsilon`` and ``calibrate`` say of it: the selection's epsilon beside one run's alone."""
        repetitions = self.selection.repetitions
        return {
            "epsilon": self.epsilon(),
            "accountant": "rdp",
            "run_epsilon": self.run.epsilon(),
            "run_accountant": self.run.accountant,
            "repetitions": repetitions.to_json(),
            "runs_99th_percentile": repetitions.quantile(0.99),
            "score_noise": self.selection.score_noise,
            "covers": (
                f"the best of K runs (K {repetitions.describe()}, secret), each scored on held-out rows by a "
                f"count with Gaussian noise of {self.selection.score_noise:g}: the chosen run and its noisy score"
            ),
        }

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> SelectionPlan:
        return cls(PrivacyPlan(**payload["run"]), Selection.from_json(payload))

    @classmethod
    def calibrate(
        cls,
        target: PrivacyTarget,
        selection: Selection,
        *,
        num_examples: int,
        batch_size: int | None = None,
        steps: int | None = None,
        noise_multiplier: float | None = None,
        releases: tuple[float, ...] = (),
        rtol: float = calibration.DEFAULT_RTOL,
    ) -> SelectionPlan:
        """The plan whose selection spends at most ``target``, given two of {sigma, steps, batch size}."""
        if not target.private:
            raise InvalidConfigError("a private selection needs a finite target epsilon")
        if target.sampling != "poisson":
            raise InvalidConfigError("a private selection is accounted for Poisson sampling only (not 'shuffle')")
        if not 0 < rtol < 0.5:
            raise InvalidConfigError(f"rtol must be in (0, 0.5), got {rtol}")
        knob = knob_to_solve(
            num_examples=num_examples, batch_size=batch_size, steps=steps, noise_multiplier=noise_multiplier
        )
        n = int(num_examples)
        given = {"batch_size": batch_size, "steps": steps, "noise_multiplier": noise_multiplier}

        def mechanism(x: float, stds: float | None) -> tuple[float, int, int, Truncation | None]:
            knobs = given | {knob: x}
            b = int(knobs["batch_size"])
            truncation = None if stds is None else Truncation(n, batch_capacity(n, b, stds=stds))
            return float(knobs["noise_multiplier"]), b, int(knobs["steps"]), truncation

        def spent(x: float, stds: float | None) -> float:
            sigma, b, t, truncation = mechanism(x, stds)
            return selection_epsilon(
                noise_multiplier=sigma,
                sampling_rate=b / n,
                steps=t,
                delta=target.delta,
                selection=selection,
                releases=tuple(releases),
                truncation=truncation,
            )

        untruncated = _solve(knob, lambda x: spent(x, None), target=target.epsilon, num_examples=n, rtol=rtol)
        stds = _capacity_stds(lambda k: spent(untruncated, k), allowed=spent(untruncated, None))
        answer = _solve(
            knob, lambda x: spent(x, stds), target=target.epsilon, num_examples=n, rtol=rtol, start=untruncated
        )
        sigma, b, t, truncation = mechanism(answer, stds)
        plan = PrivacyPlan(
            num_examples=n,
            batch_size=b,
            steps=t,
            noise_multiplier=sigma,
            delta=target.delta,
            accountant=target.accountant,
            releases=tuple(releases),
            batch_capacity=truncation.capacity,
        )
        found = cls(plan, selection)
        if found.epsilon() > target.epsilon:  # the search's own evaluations: should never fire
            raise RuntimeError("the selection's epsilon disagrees with its calibration")
        return found


_DOMAIN = {  # knob -> (increasing in epsilon, integer, lower, upper, start)
    "noise_multiplier": (False, False, calibration.SIGMA_MIN, calibration.SIGMA_MAX, 1.0),
    "steps": (True, True, 1, calibration.MAX_STEPS, 1000.0),
    "batch_size": (True, True, 1, None, None),
}


def _solve(
    knob: str, eps_at: Any, *, target: float, num_examples: int, rtol: float, start: float | None = None
) -> float:
    """The feasible boundary of ``eps_at(x) <= target`` in the knob (``bracket_search``)."""
    increasing, integer, lower, upper, first = _DOMAIN[knob]
    upper = num_examples if upper is None else upper
    first = max(1.0, num_examples / 100) if first is None else first
    problem = MonotoneProblem(
        name=knob.replace("_", " "),
        eps_at=eps_at,
        target=target,
        increasing=increasing,
        integer=integer,
        lower=lower,
        upper=upper,
        rtol=rtol,
    )
    try:
        x, _ = solve_boundary(
            problem, first if start is None else start, slope=-1.0 if knob == "noise_multiplier" else 1.0
        )
    except InfeasiblePrivacyTargetError as error:
        raise InfeasiblePrivacyTargetError(
            f"{error} for the selection (its score's noise and its number of runs cost that much on their own: "
            "raise --score-noise or lower --repetitions-mean)"
        ) from None
    return int(x) if integer else x


def _capacity_stds(spent_at: Any, *, allowed: float) -> float:
    """The smallest k of the ladder whose truncation adds at most ``TRUNCATION_COST`` to ``allowed`` (bisection:
    epsilon falls as the capacity grows); the last k if none does."""
    low, high = 0, len(calibration.CAPACITY_LADDER) - 1
    while low < high:
        middle = (low + high) // 2
        if spent_at(calibration.CAPACITY_LADDER[middle]) <= allowed * (1 + calibration.TRUNCATION_COST):
            high = middle
        else:
            low = middle + 1
    return calibration.CAPACITY_LADDER[low]


def composed_selection_epsilon(plans: list[SelectionPlan], *, delta: float) -> float:
    """Epsilon at ``delta`` of publishing the outputs of every selection in ``plans`` (on the same data)."""
    if not plans:
        return 0.0
    return events_epsilon(tuple(plan.event for plan in plans), delta)
