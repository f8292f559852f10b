"""Privacy accounting of DP-SGD with dp-accounting's RDP and PLD accountants.

One training step of DP-SGD is a subsampled Gaussian mechanism: every example joins the
batch independently with probability ``q = B / N`` (Poisson sampling), a batch larger than
the plan's capacity keeps a uniformly random ``capacity`` of its examples (``Truncation``: what
``privacy.sampling`` does so that every step has the same shape and wall time), and the clipped
sum gets Gaussian noise of ``sigma`` times the clip norm. A run of ``T`` steps is the T-fold
adaptive composition. Neighbouring data sets differ by adding or removing one example
(ADD_OR_REMOVE_ONE), the relation under which Poisson subsampling amplifies privacy.

Truncated Poisson sampling is accounted exactly: the PLD is dp-accounting's own
(``TruncatedSubsampledGaussianDpEvent``). dp-accounting's RDP accountant does not support
that event, so its RDP is computed here (``truncated_step_rdp``) from the same decomposition
dp-accounting's PLD uses. Without a truncation the event is the plain Poisson-subsampled one.

:func:`dp_event` is the single source of truth for that event, and :func:`epsilon` the
single way an epsilon is computed (through :class:`EpsilonCurve`): the training ledger, the
calibration and ``dpscale epsilon`` therefore report bit-identical numbers for one setting.
:func:`bounds_for` is the one statement of which accountants' bounds an epsilon is the
minimum of: :class:`EpsilonCurve` (and through it every report and the calibration) and the
epsilon of many runs together (``privacy.plan.composed_epsilon``) ask it.
``privacy.plan.PrivacyPlan`` is what the rest of dpscale holds; this module is its arithmetic.

``sampling="shuffle"`` (fixed-size batches from a shuffled data set) has no exact
accounting: it is accounted as if it were Poisson sampling at the same rate and callers flag
it as inexact. dp-accounting's ``SampledWithoutReplacementDpEvent`` is not a fix: it models
a fresh uniform draw every step (not one permutation per epoch), it only holds under the
REPLACE_ONE relation (epsilons not comparable with ADD_OR_REMOVE_ONE) and only the RDP
accountant supports it. Shuffling can be markedly less private than the Poisson number
suggests (Chua et al., 2024), hence a flag, not a silent number.

A run may also make one-off *releases* before training, each a Gaussian mechanism of
sensitivity 1 over the whole data set (no subsampling), e.g. the DP mean of unit-norm
features used to centre them (``training.feature_normalization``). They are composed into
every epsilon reported and calibrated for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

import dp_accounting
import numpy as np
from scipy import stats

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import (
    Accountant,
    check_accountant,
    check_accounted_steps,
    check_batch_size,
    check_delta,
    check_mechanism,
)
from dpscale.privacy.pld import DEFAULT_DISCRETIZATION, MIN_DELTA, NEIGHBORING_RELATION, BoundedPld

# dp-accounting's own default grid; coarser only where it would not fit in memory (privacy.pld).
PLD_DISCRETIZATION = DEFAULT_DISCRETIZATION


@dataclasses.dataclass(frozen=True)
class Truncation:
    """Poisson batches of the run's ``num_examples`` examples truncated to ``capacity`` (``privacy.sampling``).

    The accounted data set is the larger neighbour, N + 1 examples (the run's N and one added):
    there N others can fill the capacity when the example is in; the removal neighbour
    (N - 1 others) truncates less often and gets a smaller epsilon (dp-accounting's epsilon
    grows with the data-set size at fixed q and capacity, tested). That holds for a capacity
    of at least the expected batch size, not below it: ``check_rate`` refuses such a capacity.
    """

    num_examples: int
    capacity: int

    def __post_init__(self) -> None:
        check_batch_size(batch_size=self.capacity, num_examples=self.dataset_size)

    @property
    def dataset_size(self) -> int:
        return self.num_examples + 1

    def check_rate(self, sampling_rate: float) -> None:
        """Refuse a capacity below the expected batch size q N, where N + 1 is not the worse neighbour.

        Below it, most steps are truncated and epsilon falls as the data set grows (N = 1,430,
        B = 128, capacity 100, sigma 1, 200 steps: 39.014 at 1,430 examples, 38.991 at 1,431), so
        the larger neighbour would understate the removal one. No plan dpscale makes has such a
        capacity (the rule is B plus a few standard deviations); one given by hand is refused.
        """
        expected = sampling_rate * self.num_examples
        if self.capacity < expected * (1 - 1e-12):
            raise InvalidConfigError(
                f"batch capacity {self.capacity} is below the expected batch size {expected:.6g}: most steps "
                "would be truncated, and there epsilon is not monotone in the data-set size, so the accounted "
                "neighbour (N + 1) would not bound the other (N - 1); give a capacity of at least the batch size"
            )

    def probability(self, sampling_rate: float) -> float:
        """P(at least ``capacity`` of the N others join): when the added example may be truncated."""
        return float(stats.binom.sf(self.capacity - 1, self.dataset_size - 1, sampling_rate))


@functools.lru_cache(maxsize=256)  # pure, slow (benchmarks/results/first_hour_speed.md), asked often
def _poisson_rdp(noise_multiplier: float, sampling_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """(orders, per-order RDP) of one Poisson-subsampled Gaussian step, from dp-accounting (read-only arrays).

    dp-accounting has no public accessor for the per-order RDP vector; it is read from its
    accountant (the same series it composes) so that it is computed once per mechanism.
    """
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=NEIGHBORING_RELATION)
    with quiet_rdp_warnings():
        accountant.compose(step_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate))
    orders, rdp = np.array(accountant._orders, dtype=float), np.array(accountant._rdp, dtype=float)
    orders.setflags(write=False)
    rdp.setflags(write=False)
    return orders, rdp


def truncated_step_rdp(
    orders: np.ndarray,
    untruncated: np.ndarray,
    *,
    noise_multiplier: float,
    sampling_rate: float,
    truncation: Truncation,
) -> np.ndarray:
    """Per-order RDP of one truncated-Poisson step, given the untruncated step's RDP at ``orders``.

    Condition on K, how many of the N others join. If K < capacity, the added example never
    causes a truncation: the pair of outputs is the Poisson-subsampled Gaussian's
    (``untruncated``). If K >= capacity (probability p), the example is kept with probability
    q * capacity / (K + 1) <= q, and then replaces a uniformly random one of the others: the
    sums differ by at most 2 clip norms, so the pair is dominated by the Poisson-subsampled
    Gaussian at rate q with half the noise multiplier. K does not depend on the example, so
    both outputs are the same mixture over K, and ``exp((alpha - 1) D_alpha)`` is jointly
    convex: ``exp((a-1) rdp) <= (1-p) exp((a-1) rdp(q, sigma)) + p exp((a-1) rdp(q, sigma/2))``.
    The same decomposition as dp-accounting's PLD of this event, whose second part is
    tighter (a smaller rate); hand-written because dp-accounting's RDP accountant has no
    truncated event.
    """
    p = truncation.probability(sampling_rate)
    if p == 0.0:
        return np.asarray(untruncated, dtype=float)
    half_orders, half_noise = _poisson_rdp(noise_multiplier / 2, sampling_rate)
    if not np.array_equal(half_orders, np.asarray(orders)):
        raise ValueError("RDP orders differ")  # both from dp-accounting's default orders: a bug
    if p >= 1.0:  # e.g. q = 1: the added example always meets a full batch
        return np.asarray(half_noise, dtype=float)
    scale = np.asarray(orders, dtype=float) - 1
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        both = np.logaddexp(
            math.log1p(-p) + scale * np.asarray(untruncated, dtype=float), math.log(p) + scale * half_noise
        )
        rdp = both / scale
    return np.where(np.isnan(rdp), np.inf, rdp)


def bounds_for(accountant: Accountant, delta: float) -> tuple[str, ...]:
    """The accountants whose bounds are computed under ``accountant`` at ``delta``, cheapest first.

    The epsilon reported is the smallest of them: each is a valid upper bound. ``pld`` means
    the smaller of the PLD and RDP bounds (PLD is the tighter one in ordinary settings, RDP
    still answers where PLD cannot be tight in bounded memory), and RDP alone below
    ``privacy.pld.MIN_DELTA``, where rounding swamps the PLD.
    """
    check_accountant(accountant)
    if accountant == "pld" and delta >= MIN_DELTA:
        return ("rdp", "pld")
    return ("rdp",)


def step_event(
    *, noise_multiplier: float, sampling_rate: float, truncation: Truncation | None = None
) -> dp_accounting.DpEvent:
    """The DpEvent of one DP-SGD step: (truncated) Poisson sampling, then the Gaussian mechanism."""
    if truncation is not None:
        truncation.check_rate(sampling_rate)
        return dp_accounting.TruncatedSubsampledGaussianDpEvent(
            truncation.dataset_size, sampling_rate, truncation.capacity, noise_multiplier
        )
    return dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))


def dp_event(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
) -> dp_accounting.DpEvent:
    """The DpEvent of ``steps`` DP-SGD steps after the one-off ``releases``."""
    training = dp_accounting.SelfComposedDpEvent(
        step_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, truncation=truncation), steps
    )
    if not releases:
        return training
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma) for sigma in releases] + [training])


def make_accountant(accountant: Accountant = "pld") -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant under the add-or-remove-one relation (for composed events)."""
    check_accountant(accountant)
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant(NEIGHBORING_RELATION, value_discretization_interval=PLD_DISCRETIZATION)
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=NEIGHBORING_RELATION)


@contextmanager
def quiet_rdp_warnings() -> Iterator[None]:
    """Silence absl's "failed to converge" warnings of the RDP accountant.

    dp-accounting logs them for small sigma and large q (calibration probes such
    settings routinely). The affected RDP orders are dropped, which can only loosen
    the bound, never invalidate it, so the warnings are noise to our users.
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


def epsilon(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "pld",
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
) -> float:
    """Epsilon at ``delta`` of ``steps`` DP-SGD steps after ``releases``, by ``accountant``."""
    check_mechanism(
        noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps, releases=tuple(releases)
    )
    curve = epsilon_curve(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        delta=delta,
        accountant=accountant,
        releases=tuple(releases),
        truncation=truncation,
    )
    return curve(steps)


def epsilon_curve(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    delta: float,
    accountant: Accountant = "pld",
    pld_discretization: float = PLD_DISCRETIZATION,
    releases: tuple[float, ...] = (),
    truncation: Truncation | None = None,
) -> EpsilonCurve:
    """The process's one ``EpsilonCurve`` of a mechanism (the last ``CURVES`` asked for are kept).

    Building a curve (the one-step PLD) costs up to seconds, and the same mechanism is asked about
    again and again: a calibration's last probe and its check, the plan's report, every ledger
    write, a sweep's repeats. A curve is a pure function of these arguments, so sharing it changes
    no number.
    """
    return _shared_curve(
        float(noise_multiplier),
        float(sampling_rate),
        float(delta),
        accountant,
        float(pld_discretization),
        tuple(float(r) for r in releases),
        truncation,
    )


CURVES = 64


def clear_caches() -> None:
    """Forget every shared curve and one-step RDP (a benchmark times a cold process this way)."""
    _shared_curve.cache_clear()
    _poisson_rdp.cache_clear()


@functools.lru_cache(maxsize=CURVES)
def _shared_curve(
    noise_multiplier: float,
    sampling_rate: float,
    delta: float,
    accountant: Accountant,
    pld_discretization: float,
    releases: tuple[float, ...],
    truncation: Truncation | None,
) -> EpsilonCurve:
    return EpsilonCurve(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        delta=delta,
        accountant=accountant,
        pld_discretization=pld_discretization,
        releases=releases,
        truncation=truncation,
    )


@dataclasses.dataclass(frozen=True)
class RdpParts:
    """One mechanism's RDP on dp-accounting's default orders, composed by adding per order.

    ``step`` is one training step's RDP (with a truncation: ``truncated_step_rdp``),
    ``untruncated`` the same step without it and ``charge`` the probability that the added
    example's step truncates (0 without a truncation).
    """

    orders: np.ndarray
    step: np.ndarray
    untruncated: np.ndarray
    released: np.ndarray
    charge: float

    @classmethod
    def of(
        cls,
        *,
        noise_multiplier: float,
        sampling_rate: float,
        releases: tuple[float, ...] = (),
        truncation: Truncation | None = None,
    ) -> RdpParts:
        orders, untruncated = _poisson_rdp(noise_multiplier, sampling_rate)
        released = dp_accounting.rdp.RdpAccountant(neighboring_relation=NEIGHBORING_RELATION)
        with quiet_rdp_warnings():
            for sigma in releases:
                released.compose(dp_accounting.GaussianDpEvent(sigma))
        step, charge = untruncated, 0.0
        if truncation is not None:
            truncation.check_rate(sampling_rate)
            step = truncated_step_rdp(
                orders,
                untruncated,
                noise_multiplier=noise_multiplier,
                sampling_rate=sampling_rate,
                truncation=truncation,
            )
            charge = truncation.probability(sampling_rate)
        return cls(orders=orders, step=step, untruncated=untruncated, released=np.asarray(released._rdp), charge=charge)


def rdp_epsilon(parts: list[tuple[RdpParts, int]], delta: float) -> float:
    """RDP epsilon at ``delta`` of ``steps`` steps (and the releases) of each ``(parts, steps)``.

    With truncated sampling, the smaller of two bounds: the truncated steps' own RDP, and the
    untruncated steps' RDP at ``delta - sum(steps * charge)``. The second holds because a run
    is a mixture, with the same weights on both neighbours, of "no step truncated the added
    example" (the untruncated pair) and the rest (probability at most steps * charge), so the
    hockey-stick divergence grows by at most that probability at every epsilon.
    """

    def composed(vector: str) -> np.ndarray:
        # 0 steps spend nothing at every order, also where one step's RDP is inf (0 * inf is nan).
        return sum(
            ((steps * getattr(p, vector) if steps else 0.0) + p.released for p, steps in parts),
            np.zeros_like(parts[0][0].orders, dtype=float),
        )

    orders = parts[0][0].orders
    best = float(dp_accounting.rdp.compute_epsilon(orders, composed("step"), delta)[0])
    charge = sum(steps * p.charge for p, steps in parts)
    if 0 < charge < delta:
        best = min(best, float(dp_accounting.rdp.compute_epsilon(orders, composed("untruncated"), delta - charge)[0]))
    return best


class EpsilonCurve:
    """Epsilon after ``t`` steps of one (sigma, q) (after any releases) for many ``t``, without redoing work.

    The per-step ledger needs epsilon at every logged step. Re-running an accountant from
    scratch each time repeats the expensive part, which does not depend on ``t``: the
    per-order RDP of one step (RDP composes by multiplying by ``t``) or the discretised
    privacy-loss distribution of one step (PLD composes by FFT self-convolution). Both are
    computed once here, the same way dp-accounting's own accountants do (equal to them to
    1e-12 wherever dp-accounting's default grid fits in memory, tested).

    Which bounds are computed is :func:`bounds_for`'s answer (with ``"pld"``: PLD and RDP, the
    smaller reported, RDP alone at tiny delta); ``bound(t)`` says which one ``self(t)`` is.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        sampling_rate: float,
        delta: float,
        accountant: Accountant = "pld",
        pld_discretization: float = PLD_DISCRETIZATION,
        releases: tuple[float, ...] = (),
        truncation: Truncation | None = None,
    ) -> None:
        check_mechanism(
            noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=1, releases=tuple(releases)
        )
        check_delta(delta)
        check_accountant(accountant)
        if truncation is not None:
            truncation.check_rate(sampling_rate)
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.accountant = accountant
        self.releases = tuple(releases)
        self.truncation = truncation
        self._cache: dict[int, tuple[float, str]] = {}
        self._rdp_parts = RdpParts.of(
            noise_multiplier=noise_multiplier,
            sampling_rate=sampling_rate,
            releases=self.releases,
            truncation=truncation,
        )
        self._pld = None
        if "pld" in bounds_for(accountant, delta):
            self._pld = BoundedPld(
                noise_multiplier=noise_multiplier,
                sampling_rate=sampling_rate,
                releases=self.releases,
                delta=delta,
                base=pld_discretization,
                truncation=None if truncation is None else (truncation.dataset_size, truncation.capacity),
            )

    def __call__(self, steps: int) -> float:
        """Epsilon after ``steps`` steps (0 steps spend only the releases, if any)."""
        return self.bounded(steps)[0]

    def bound(self, steps: int) -> str:
        """Which accountant's bound ``self(steps)`` is: ``"pld"`` or ``"rdp"``."""
        return self.bounded(steps)[1]

    def bounded(self, steps: int) -> tuple[float, str]:
        """(epsilon, the accountant whose bound it is) after ``steps`` steps."""
        if steps < 0:
            raise InvalidConfigError(f"steps must be >= 0, got {steps}")
        check_accounted_steps(steps)
        if steps not in self._cache:
            with quiet_rdp_warnings():
                self._cache[steps] = self._compute(int(steps))
        return self._cache[steps]

    def _compute(self, steps: int) -> tuple[float, str]:
        if steps == 0 and not self.releases:
            return 0.0, self.accountant
        rdp_bound = rdp_epsilon([(self._rdp_parts, steps)], self.delta)
        if self._pld is None:
            return rdp_bound, "rdp"
        pld_epsilon = self._pld.epsilon(steps, composed_span=self._composed_span(steps))
        return (pld_epsilon, "pld") if pld_epsilon <= rdp_bound else (rdp_bound, "rdp")

    def _composed_span(self, steps: int) -> float:
        """Span of the composed privacy loss outside which at most the PLD's tail mass lies.

        Chernoff with the RDP orders bounds the upper tail: P(L > x) <= exp((a-1)(rdp_a - x)),
        so x = rdp_a + log(2/tail)/(a-1); the lower tail is below -log(2/tail) because
        E[exp(-L)] <= 1 for a privacy loss L.
        """
        log_tail = math.log(2 / self._pld.tail)
        parts = self._rdp_parts
        with np.errstate(over="ignore", invalid="ignore"):
            composed = (steps * parts.step if steps else 0.0) + parts.released
            upper = np.min(composed + log_tail / (parts.orders - 1))
        return float(upper) + log_tail if math.isfinite(upper) else math.inf
