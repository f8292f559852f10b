"""The privacy plan of a run: from an (epsilon, delta) target to the noise, in one object.

A run's guarantee is a statement about four things that must agree: how batches are selected
(Poisson sampling at rate q = B / N, truncated to a fixed capacity so that every step has the
same shape and wall time), how many steps T there are, how much noise sigma every
step adds to the clipped sum (relative to its sensitivity), and the one-off Gaussian releases
made from the data before training (e.g. the DP mean of ``center-l2`` features).
``PrivacyPlan`` holds exactly those. It is calibrated once (``PrivacyPlan.calibrate``: the
missing one of sigma, T, B is solved so that epsilon is never above the target), and
everything that depends on it is built from it:

* ``sampler``: the batch selection the accountant assumes (``privacy.sampling``);
* ``dp_step``: the DP-SGD update, noise sigma on the clipped sum divided by the expected B
  (``privacy.dpsgd``), or the plain gradient for a non-private plan;
* ``epsilon(t)``: epsilon after t steps (and the releases), from ``privacy.accounting``;
* ``ledger(t)``: what a run records about its privacy after t steps.

Nothing else in dpscale assembles the mechanism, so the accountant's event and the update
that runs cannot drift apart.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import dp_accounting

from dpscale.errors import InvalidConfigError
from dpscale.privacy import calibration
from dpscale.privacy.accounting import (
    EpsilonCurve,
    RdpParts,
    Truncation,
    bounds_for,
    dp_event,
    epsilon_curve,
    make_accountant,
    quiet_rdp_warnings,
    rdp_epsilon,
)
from dpscale.privacy.checks import (
    Accountant,
    SamplingScheme,
    check_accountant,
    check_batch_size,
    check_delta,
    check_mechanism,
    check_positive,
    check_positive_integer,
    check_releases,
    check_sampling,
    check_steps,
)
from dpscale.privacy.sampling import Layout, PoissonSampler, ShuffledSampler, batch_capacity

if TYPE_CHECKING:  # the DP step needs JAX, imported when one is built: `dpscale epsilon` needs only the accountant
    import optax

    from dpscale.privacy.clipping import ClippedSumFn, LossFn
    from dpscale.privacy.dpsgd import DpsgdStep

KNOBS = ("noise_multiplier", "steps", "batch_size")


class Solution(NamedTuple):
    """A calibrated setting: the three knobs and ``slope``, where the search for the solved one ended
    (``privacy.calibration``'s answer, given back as a starting point to the next search)."""

    batch_size: int
    steps: int
    noise_multiplier: float
    slope: float


@dataclasses.dataclass(frozen=True)
class MechanismParts:
    """The classes a plan builds its sampler and DP step from.

    The one seam to run a plan with other parts: a privacy audit proves it has teeth by building
    a plan with a deliberately broken step or sampler (``audit.broken_steps``), visibly, where the
    plan is made. A run directory never records a plan with other parts (``PrivacyPlan.to_json``).
    """

    step: type[DpsgdStep] | None = None  # None: DpsgdStep itself (imported where a step is built)
    poisson_sampler: type[PoissonSampler] = PoissonSampler

    def __post_init__(self) -> None:
        if self.step is not None:
            from dpscale.privacy.dpsgd import DpsgdStep

            if not (isinstance(self.step, type) and issubclass(self.step, DpsgdStep)):
                raise TypeError(f"a plan's step must subclass DpsgdStep, got {self.step!r}")
            if self.step is DpsgdStep:
                object.__setattr__(self, "step", None)  # one spelling of the standard parts
        if not (isinstance(self.poisson_sampler, type) and issubclass(self.poisson_sampler, PoissonSampler)):
            raise TypeError(f"a plan's sampler must subclass PoissonSampler, got {self.poisson_sampler!r}")

    @property
    def standard(self) -> bool:
        return self == MechanismParts()


@dataclasses.dataclass(frozen=True)
class PrivacyTarget:
    """What the user asks for: (epsilon, delta) under one accountant and one sampling scheme."""

    epsilon: float = 8.0  # math.inf: a non-private run (no clipping, no noise)
    delta: float = 1e-5
    accountant: Accountant = "pld"
    sampling: SamplingScheme = "poisson"

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise InvalidConfigError(f"epsilon must be positive (inf for non-private), got {self.epsilon}")
        check_delta(self.delta)
        check_accountant(self.accountant)
        check_sampling(self.sampling)

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)


def knob_to_solve(
    *, num_examples: int, batch_size: int | None, steps: int | None, noise_multiplier: float | None
) -> str:
    """Check a calibration request and name the one knob of ``KNOBS`` it leaves out."""
    check_positive_integer(num_examples, "number of examples")
    if noise_multiplier is not None:
        check_positive(noise_multiplier, "noise multiplier")
    if steps is not None:
        check_positive_integer(steps, "steps")
    if batch_size is not None:
        check_batch_size(batch_size=batch_size, num_examples=num_examples)
    given = dict(noise_multiplier=noise_multiplier, steps=steps, batch_size=batch_size)
    missing = [k for k in KNOBS if given[k] is None]
    if len(missing) != 1:
        which = "none" if len(missing) == 3 else "all three" if not missing else "only one"
        raise InvalidConfigError(
            f"give exactly two of noise multiplier, steps and batch size (the third is solved for); got {which}"
        )
    return missing[0]


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """The resolved mechanism of one run; ``noise_multiplier == 0`` is a non-private plan."""

    num_examples: int
    batch_size: int  # the *expected* batch size B of Poisson sampling (q = B / N)
    steps: int
    noise_multiplier: float
    delta: float
    accountant: Accountant = "pld"
    sampling: SamplingScheme = "poisson"
    releases: tuple[float, ...] = ()  # noise multipliers of one-off releases (sensitivity 1, full data)
    # Most examples a step holds (Poisson batches are truncated to it); 0: the rule (``capacity``).
    batch_capacity: int = 0
    # What the sampler and the step are built from; not part of what a run records.
    parts: MechanismParts = dataclasses.field(default=MechanismParts(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "releases", tuple(float(r) for r in self.releases))  # a list from JSON
        check_batch_size(batch_size=self.batch_size, num_examples=self.num_examples)
        if self.sampling == "shuffle":
            object.__setattr__(self, "batch_capacity", self.batch_size)  # fixed-size batches
        if self.batch_capacity:
            check_batch_size(batch_size=self.batch_capacity, num_examples=self.num_examples + 1)
        check_steps(self.steps)
        check_delta(self.delta)
        check_accountant(self.accountant)
        if self.noise_multiplier == 0:
            if self.releases:
                raise InvalidConfigError("a non-private plan makes no DP releases")
            check_sampling(self.sampling)
        else:
            check_mechanism(
                noise_multiplier=self.noise_multiplier,
                sampling_rate=self.sampling_rate,
                steps=self.steps,
                sampling=self.sampling,
                releases=self.releases,
            )

    # -- from a target ------------------------------------------------------------------

    @classmethod
    def calibrate(
        cls,
        target: PrivacyTarget,
        *,
        num_examples: int,
        batch_size: int | None = None,
        steps: int | None = None,
        noise_multiplier: float | None = None,
        releases: tuple[float, ...] = (),
        rtol: float = calibration.DEFAULT_RTOL,
    ) -> PrivacyPlan:
        """The plan that meets ``target`` with two of {sigma, steps, batch size} given.

        The third is solved by ``privacy.calibration``: the smallest sigma, or the largest
        number of steps or batch size, whose epsilon (releases included) is at most the
        target. A non-private target needs batch size and steps and gets no noise.
        """
        if not target.private:
            if batch_size is None or steps is None:
                raise InvalidConfigError("a non-private run (epsilon=inf) needs --batch-size and --steps")
            return cls(
                num_examples=int(num_examples),
                batch_size=int(batch_size),
                steps=int(steps),
                noise_multiplier=0.0,
                delta=target.delta,
                accountant=target.accountant,
                sampling=target.sampling,
            )
        check_releases(tuple(releases))
        if not 0 < rtol < 0.5:
            raise InvalidConfigError(f"rtol must be in (0, 0.5), got {rtol}")
        solve = knob_to_solve(
            num_examples=num_examples, batch_size=batch_size, steps=steps, noise_multiplier=noise_multiplier
        )
        common = dict(
            target_epsilon=target.epsilon, delta=target.delta, accountant=target.accountant, releases=tuple(releases)
        )
        n = int(num_examples)
        solved = cls._solve(
            solve,
            n,
            batch_size=batch_size,
            steps=steps,
            noise_multiplier=noise_multiplier,
            capacity_stds=None,
            rtol=rtol,
            common=common,
        )
        capacity = 0
        if target.sampling == "poisson":
            # The truncation that costs at most ``TRUNCATION_COST`` at the untruncated answer, then the
            # answer again with that truncation accounted.
            stds = calibration.capacity_stds(
                noise_multiplier=solved.noise_multiplier,
                num_examples=n,
                batch_size=solved.batch_size,
                steps=solved.steps,
                delta=target.delta,
                accountant=target.accountant,
                releases=tuple(releases),
            )
            solved = cls._solve(
                solve,
                n,
                batch_size=batch_size,
                steps=steps,
                noise_multiplier=noise_multiplier,
                capacity_stds=stds,
                rtol=rtol,
                common=common,
                near=solved,
            )
            capacity = batch_capacity(n, solved.batch_size, stds=stds)
        return cls(
            num_examples=n,
            batch_size=solved.batch_size,
            steps=solved.steps,
            noise_multiplier=solved.noise_multiplier,
            delta=target.delta,
            accountant=target.accountant,
            sampling=target.sampling,
            releases=tuple(releases),
            batch_capacity=capacity,
        )

    @staticmethod
    def _solve(
        solve: str,
        n: int,
        *,
        batch_size: int | None,
        steps: int | None,
        noise_multiplier: float | None,
        capacity_stds: float | None,
        rtol: float,
        common: dict[str, Any],
        near: Solution | None = None,
    ) -> Solution:
        """The setting with the ``solve`` knob calibrated; batches truncated ``capacity_stds`` standard
        deviations of the batch size above B (None: not). ``near``: an earlier answer (without
        truncation), where the search starts."""
        truncation = None
        if capacity_stds is not None and batch_size is not None:
            truncation = Truncation(n, batch_capacity(n, batch_size, stds=capacity_stds))
        start = None if near is None else (getattr(near, solve), near.slope)
        if solve == "noise_multiplier":
            found = calibration.calibrate_noise_multiplier(
                sampling_rate=batch_size / n, steps=int(steps), rtol=rtol, truncation=truncation, near=start, **common
            )
            noise_multiplier = found.value
        elif solve == "steps":
            found = calibration.calibrate_steps(
                noise_multiplier=noise_multiplier,
                sampling_rate=batch_size / n,
                truncation=truncation,
                near=start,
                **common,
            )
            steps = found.value
        else:
            found = calibration.calibrate_batch_size(
                noise_multiplier=noise_multiplier,
                steps=int(steps),
                num_examples=n,
                capacity_stds=capacity_stds,
                near=start,
                **common,
            )
            batch_size = found.value
        return Solution(
            batch_size=int(batch_size), steps=int(steps), noise_multiplier=float(noise_multiplier), slope=found.slope
        )

    # -- what it guarantees ---------------------------------------------------------------

    @property
    def private(self) -> bool:
        return self.noise_multiplier > 0

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.num_examples

    @property
    def exact(self) -> bool:
        """True when the accountant's event describes the sampling exactly (truncated Poisson)."""
        return self.sampling == "poisson"

    @functools.cached_property
    def capacity(self) -> int:
        """The most examples a step holds: ``batch_capacity``, or when that is 0 the rule: B plus the
        ``calibration.capacity_stds`` standard deviations of the batch size whose truncation costs
        at most 0.1% of epsilon (4 for a non-private plan, which has no epsilon to spend)."""
        if self.batch_capacity:
            return self.batch_capacity
        if not self.private:
            return batch_capacity(self.num_examples, self.batch_size)
        stds = calibration.capacity_stds(
            noise_multiplier=self.noise_multiplier,
            num_examples=self.num_examples,
            batch_size=self.batch_size,
            steps=self.steps,
            delta=self.delta,
            accountant=self.accountant,
            releases=self.releases,
        )
        return batch_capacity(self.num_examples, self.batch_size, stds=stds)

    @property
    def truncation(self) -> Truncation | None:
        """The accounted truncation of Poisson batches (shuffled batches: accounted as untruncated Poisson)."""
        if self.sampling != "poisson":
            return None
        return Truncation(self.num_examples, self.capacity)

    def resolved(self) -> PrivacyPlan:
        """This plan with its capacity written out (what a run records, so a resume never recomputes it)."""
        return dataclasses.replace(self, batch_capacity=self.capacity)

    def layout(self, microbatch_size: int, *, multiple: int = 1) -> Layout:
        """Every step's micro-batches: the capacity in the fewest of at most ``microbatch_size`` slots."""
        return Layout.of(self.capacity, microbatch_size=microbatch_size, multiple=multiple)

    @property
    def _curve(self) -> EpsilonCurve:
        return epsilon_curve(
            noise_multiplier=self.noise_multiplier,
            sampling_rate=self.sampling_rate,
            delta=self.delta,
            accountant=self.accountant,
            releases=self.releases,
            truncation=self.truncation,
        )

    def epsilon(self, steps: int | None = None) -> float:
        """Epsilon after ``steps`` steps (default: all) and the releases; inf for a non-private plan."""
        if not self.private:
            return math.inf
        return self._curve(self.steps if steps is None else steps)

    def epsilon_bound(self, steps: int | None = None) -> str:
        """Which accountant's bound ``epsilon(steps)`` is: with ``pld``, the smaller of PLD and RDP."""
        if not self.private:
            return "none"
        return self._curve.bound(self.steps if steps is None else steps)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the user must know about this plan's guarantee (shown by every command that uses it)."""
        notes = []
        if self.delta >= 1 / self.num_examples:
            notes.append(
                f"delta = {self.delta:g} is not below 1/num_examples = {1 / self.num_examples:g}: a "
                "mechanism that publishes a random example verbatim meets it; use delta << 1/N"
            )
        if self.sampling != "poisson":
            notes.append(
                f"sampling {self.sampling!r} is accounted as Poisson sampling at the same rate; that "
                f"epsilon is not a proven guarantee for {self.sampling!r} batches"
            )
        return tuple(notes)

    def ledger(self, *, steps_done: int, not_covered: tuple[str, ...] = ()) -> Ledger:
        """The privacy ledger of a run that has done ``steps_done`` of the planned steps.

        ``not_covered`` names what the run reports that epsilon does not cover (e.g. held-out rows).
        """
        return Ledger(
            private=self.private,
            accountant=self.accountant if self.private else "none",
            sampling=self.sampling if self.private else None,
            exact_accounting=self.private and self.exact,
            sampling_rate=self.sampling_rate if self.private else None,
            batch_capacity=self.capacity,
            noise_multiplier=self.noise_multiplier,
            releases=self.releases,
            planned_steps=self.steps,
            steps_done=steps_done,
            delta=self.delta,
            epsilon_spent=self.epsilon(steps_done),
            epsilon_bound=self.epsilon_bound(steps_done),
            not_covered=tuple(not_covered),
        )

    # -- what runs ------------------------------------------------------------------------

    def sampler(self, *, seed: int, microbatch_size: int, multiple: int = 1) -> PoissonSampler | ShuffledSampler:
        """The batch selection of this plan, in ``layout(microbatch_size, multiple=multiple)`` at every step
        (a shuffled sampler warns that it is not accounted exactly). A non-private plan samples the same way."""
        if self.sampling == "poisson":
            return self.parts.poisson_sampler(
                num_examples=self.num_examples,
                expected_batch_size=self.batch_size,
                capacity=self.capacity,
                microbatch_size=microbatch_size,
                seed=seed,
                multiple=multiple,
            )
        return ShuffledSampler(
            num_examples=self.num_examples,
            batch_size=self.batch_size,
            microbatch_size=microbatch_size,
            seed=seed,
            multiple=multiple,
        )

    def dp_step(
        self,
        loss_fn: LossFn,
        *,
        seed: int,
        clip_norm: float,
        optimizer: optax.GradientTransformation,
        ema_decay: float,
        clipped_sum: Callable[[float], ClippedSumFn | None] | None = None,
        mesh: Any = None,
    ) -> DpsgdStep:
        """The update of this plan (a ``parts.step``): clipped sums of ``clipped_sum(clip_norm)`` (a
        model's own way to clip to ``clip_norm``; where it gives None, or without it, ``vmap``
        per-example gradients) plus noise sigma, divided by B, then ``optimizer`` and the EMA; a
        non-private plan sums plain gradients. The clip norm is given here once and reaches the
        clipped sum from here only.

        No defaults for the optimiser or the EMA: the recipe's live in ``training.config``.
        """
        from dpscale.privacy.clipping import make_clipped_sum_fn, make_unclipped_sum_fn
        from dpscale.privacy.dpsgd import DpsgdStep

        if not self.private:
            clipped_sum_fn = make_unclipped_sum_fn(loss_fn)
        else:
            own = clipped_sum(clip_norm) if clipped_sum is not None else None
            clipped_sum_fn = own or make_clipped_sum_fn(loss_fn, clip_norm=clip_norm)
        step = self.parts.step or DpsgdStep
        return step(
            clipped_sum_fn,
            noise_multiplier=self.noise_multiplier,
            expected_batch_size=self.batch_size,
            seed=seed,
            optimizer=optimizer,
            ema_decay=ema_decay,
            capacity=self.capacity,
            mesh=mesh,
        )

    def to_json(self) -> dict[str, Any]:
        """What a run records of its plan (``PrivacyPlan(**to_json())`` rebuilds it).

        A plan with other parts (an audit's broken step) is never recorded: a resumed or
        evaluated run would silently get the standard parts back.
        """
        if not self.parts.standard:
            raise InvalidConfigError(
                "a plan with substituted parts (an audit's broken step or sampler) cannot be recorded as a run"
            )
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "parts"}
        return payload | {"releases": list(self.releases)}


def composed_epsilon(plans: Sequence[PrivacyPlan], *, delta: float, accountant: Accountant = "pld") -> float:
    """Epsilon at ``delta`` of releasing the results of all ``plans`` together (runs on the same data).

    Each run is its own adaptive composition (releases, then T subsampled Gaussian steps); many
    runs on one data set compose again (dp-accounting's ``ComposedDpEvent``). Inf if any plan is
    non-private: releasing a result without a guarantee forfeits the joint one.
    """
    check_delta(delta)
    if not plans:
        return 0.0
    if not all(plan.private for plan in plans):
        return math.inf
    counts = collections.Counter(plans)  # repeats of one setting compose by self-composition (faster)
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_event(
                    noise_multiplier=p.noise_multiplier,
                    sampling_rate=p.sampling_rate,
                    steps=p.steps,
                    releases=p.releases,
                    truncation=p.truncation,
                ),
                count,
            )
            for p, count in counts.items()
        ]
    )
    bounds = []
    with quiet_rdp_warnings():  # the smallest bound, as for one plan
        for name in bounds_for(accountant, delta):
            if name == "pld":
                bounds.append(float(make_accountant(name).compose(event).get_epsilon(delta)))
            else:  # dp-accounting's RDP accountant has no truncated event: sum the per-order RDP here
                bounds.append(_composed_rdp_epsilon(counts, delta))
    return min(bounds)


def _composed_rdp_epsilon(counts: collections.Counter, delta: float) -> float:
    """RDP epsilon of every plan's releases and steps, ``count`` times each (RDP adds per order)."""
    parts = []
    for plan, count in counts.items():
        one = RdpParts.of(
            noise_multiplier=plan.noise_multiplier,
            sampling_rate=plan.sampling_rate,
            releases=plan.releases,
            truncation=plan.truncation,
        )
        parts += [(one, plan.steps)] * count
    return rdp_epsilon(parts, delta)


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """A plan and what it spends, as the ``epsilon`` and ``calibrate`` commands report it."""

    epsilon: float
    delta: float
    accountant: str
    epsilon_bound: str  # the accountant whose bound ``epsilon`` is (pld: the smaller of PLD and RDP)
    noise_multiplier: float
    steps: int
    batch_size: int
    num_examples: int
    sampling_rate: float
    sampling: str
    exact: bool
    batch_capacity: int  # the most examples a step holds (Poisson batches truncated to it)
    warnings: tuple[str, ...]

    @classmethod
    def of(cls, plan: PrivacyPlan, **extra: Any) -> Any:
        return cls(
            epsilon=plan.epsilon(),
            delta=plan.delta,
            accountant=plan.accountant,
            epsilon_bound=plan.epsilon_bound(),
            noise_multiplier=plan.noise_multiplier,
            steps=plan.steps,
            batch_size=plan.batch_size,
            num_examples=plan.num_examples,
            sampling_rate=plan.sampling_rate,
            sampling=plan.sampling,
            exact=plan.exact,
            warnings=plan.warnings,
            batch_capacity=plan.capacity,
            **extra,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"warnings": list(self.warnings)}


@dataclasses.dataclass(frozen=True)
class Ledger:
    """What a run records about its privacy (``ledger.json``): the plan and what it has spent."""

    private: bool
    accountant: str  # "none" for a non-private run
    sampling: str | None
    exact_accounting: bool
    sampling_rate: float | None
    noise_multiplier: float
    releases: tuple[float, ...]  # one-off Gaussian releases (sensitivity 1) composed into epsilon_spent
    planned_steps: int
    steps_done: int
    delta: float
    epsilon_spent: float
    epsilon_bound: str = ""  # whose bound epsilon_spent is: "pld" or "rdp" (the smaller of both under pld)
    not_covered: tuple[str, ...] = ()  # outputs of the run that epsilon does not cover, and why
    neighboring_relation: str = "add_or_remove_one"
    batch_capacity: int = 0  # Poisson batches are truncated to this many examples (0: an older ledger)

    @property
    def finished(self) -> bool:
        return self.steps_done == self.planned_steps

    def to_json(self) -> dict[str, Any]:
        payload = dataclasses.asdict(self)
        payload["releases"] = list(self.releases)
        payload["not_covered"] = list(self.not_covered)
        payload["epsilon_spent"] = "inf" if math.isinf(self.epsilon_spent) else self.epsilon_spent
        return payload

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Ledger:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in payload.items() if k in fields}
        values["releases"] = tuple(values.get("releases", ()))
        values["not_covered"] = tuple(values.get("not_covered", ()))
        values["epsilon_spent"] = float(values["epsilon_spent"])
        return cls(**values)
