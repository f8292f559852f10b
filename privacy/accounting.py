"""Privacy accounting of DP-SGD with dp-accounting's RDP and PLD accountants.

One training step of DP-SGD is a Poisson-subsampled Gaussian mechanism: every example
joins the batch independently with probability ``q = B / N`` and the clipped sum gets
Gaussian noise of ``sigma`` times the clip norm. A run of ``T`` steps is the T-fold
adaptive composition. Neighbouring data sets differ by adding or removing one example
(ADD_OR_REMOVE_ONE), the relation under which Poisson subsampling amplifies privacy.

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

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import dp_accounting
import numpy as np

from dpscale.errors import InvalidConfigError
from dpscale.privacy.pld import DEFAULT_DISCRETIZATION, MIN_DELTA, NEIGHBORING_RELATION, BoundedPld

Accountant = Literal["pld", "rdp"]
SamplingScheme = Literal["poisson", "shuffle"]

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
SAMPLING_SCHEMES: tuple[str, ...] = ("poisson", "shuffle")
# dp-accounting's own default grid; coarser only where it would not fit in memory (privacy.pld).
PLD_DISCRETIZATION = DEFAULT_DISCRETIZATION
# The most steps an epsilon is computed for. Up to here every setting answers in seconds (the PLD's
# grid and blocked composition are sized for it, privacy.pld); beyond, dp-accounting's own bounds of
# a composition grow with the steps, and with them its time and memory. 10^8 is three orders beyond
# an ImageNet run (~10^5 steps), so a plan past it is refused rather than computed for minutes.
MAX_ACCOUNTED_STEPS = 10**8


def check_batch_size(*, batch_size: int, num_examples: int) -> None:
    """Raise :class:`InvalidConfigError` unless ``1 <= batch_size <= num_examples``."""
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
        raise InvalidConfigError(
            f"number of examples must be a positive integer, got {num_examples}"
        )
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise InvalidConfigError(f"batch size must be a positive integer, got {batch_size}")
    if batch_size > num_examples:
        raise InvalidConfigError(
            f"batch size {batch_size} exceeds the number of examples {num_examples} "
            f"(sampling rate q = {batch_size / num_examples:.4g} > 1)"
        )


def check_mechanism(*, noise_multiplier: float, sampling_rate: float, steps: int,
                    sampling: str = "poisson", releases: tuple[float, ...] = ()) -> None:
    """Raise :class:`InvalidConfigError` unless (sigma, q, T, sampling, releases) describe a DP-SGD run."""
    check_releases(releases)
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise InvalidConfigError(f"noise multiplier must be a positive number, got {noise_multiplier}")
    if not (0 < sampling_rate <= 1):
        raise InvalidConfigError(
            f"sampling rate q = batch size / number of examples must be in (0, 1], got {sampling_rate}")
    check_steps(steps)
    check_accounted_steps(steps)
    if sampling not in SAMPLING_SCHEMES:
        raise InvalidConfigError(f"sampling must be one of {SAMPLING_SCHEMES}, got {sampling!r}")


def check_steps(steps: int) -> None:
    """Raise :class:`InvalidConfigError` unless ``steps`` is a positive integer."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise InvalidConfigError(f"steps must be a positive integer, got {steps}")


def check_accounted_steps(steps: int) -> None:
    """Raise :class:`InvalidConfigError` past ``MAX_ACCOUNTED_STEPS``: an epsilon that would take too long."""
    if steps > MAX_ACCOUNTED_STEPS:
        raise InvalidConfigError(
            f"{steps:,} steps: epsilon is computed for at most {MAX_ACCOUNTED_STEPS:,} steps (10^8, in seconds); "
            "beyond that the accountant's time and memory grow without bound, and no training run needs as many")


def check_releases(releases: tuple[float, ...]) -> None:
    """Raise :class:`InvalidConfigError` unless every release noise multiplier is positive and finite."""
    for sigma in releases:
        if isinstance(sigma, bool) or not (math.isfinite(sigma) and sigma > 0):
            raise InvalidConfigError(f"release noise multipliers must be positive numbers, got {releases}")


def check_delta(delta: float) -> None:
    """Raise :class:`InvalidConfigError` unless ``0 < delta < 1``."""
    if not (0 < delta < 1):
        raise InvalidConfigError(f"delta must be in (0, 1), got {delta}")


def check_accountant(accountant: str) -> None:
    """Raise :class:`InvalidConfigError` for an unknown accountant name."""
    if accountant not in ACCOUNTANTS:
        raise InvalidConfigError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


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


def step_event(*, noise_multiplier: float, sampling_rate: float) -> dp_accounting.DpEvent:
    """The DpEvent of one DP-SGD step: Poisson sampling, then the Gaussian mechanism."""
    return dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )


def dp_event(*, noise_multiplier: float, sampling_rate: float, steps: int,
             releases: tuple[float, ...] = ()) -> dp_accounting.DpEvent:
    """The DpEvent of ``steps`` DP-SGD steps after the one-off ``releases``."""
    training = dp_accounting.SelfComposedDpEvent(
        step_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate), steps)
    if not releases:
        return training
    return dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma) for sigma in releases] + [training])


def make_accountant(accountant: Accountant = "pld") -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant under the add-or-remove-one relation (for composed events)."""
    check_accountant(accountant)
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant(NEIGHBORING_RELATION,
                                               value_discretization_interval=PLD_DISCRETIZATION)
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


def epsilon(*, noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
            accountant: Accountant = "pld", releases: tuple[float, ...] = ()) -> float:
    """Epsilon at ``delta`` of ``steps`` DP-SGD steps after ``releases``, by ``accountant``."""
    check_mechanism(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps,
                    releases=tuple(releases))
    curve = EpsilonCurve(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, delta=delta,
                         accountant=accountant, releases=tuple(releases))
    return curve(steps)


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
    ) -> None:
        check_mechanism(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=1,
                        releases=tuple(releases))
        check_delta(delta)
        check_accountant(accountant)
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        self.accountant = accountant
        self.releases = tuple(releases)
        self._cache: dict[int, tuple[float, str]] = {}
        one_step = dp_accounting.rdp.RdpAccountant(neighboring_relation=NEIGHBORING_RELATION)
        released = dp_accounting.rdp.RdpAccountant(neighboring_relation=NEIGHBORING_RELATION)
        with quiet_rdp_warnings():
            one_step.compose(step_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate))
            for sigma in self.releases:
                released.compose(dp_accounting.GaussianDpEvent(sigma))
        # dp-accounting has no public accessor for the per-order RDP vector; reading it once
        # saves recomputing the per-order series (~30 ms) at every t.
        self._orders = np.asarray(one_step._orders)  # noqa: SLF001 - read-only use
        self._rdp_one_step = np.asarray(one_step._rdp)  # noqa: SLF001
        self._rdp_releases = np.asarray(released._rdp)  # noqa: SLF001 (same default orders)
        self._pld = None
        if "pld" in bounds_for(accountant, delta):
            self._pld = BoundedPld(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate,
                                   releases=self.releases, delta=delta, base=pld_discretization)

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

    def _rdp(self, steps: int) -> np.ndarray:
        return steps * self._rdp_one_step + self._rdp_releases

    def _compute(self, steps: int) -> tuple[float, str]:
        if steps == 0 and not self.releases:
            return 0.0, self.accountant
        rdp_epsilon = float(dp_accounting.rdp.compute_epsilon(self._orders, self._rdp(steps), self.delta)[0])
        if self._pld is None:
            return rdp_epsilon, "rdp"
        pld_epsilon = self._pld.epsilon(steps, composed_span=self._composed_span(steps))
        return (pld_epsilon, "pld") if pld_epsilon <= rdp_epsilon else (rdp_epsilon, "rdp")

    def _composed_span(self, steps: int) -> float:
        """Span of the composed privacy loss outside which at most the PLD's tail mass lies.

        Chernoff with the RDP orders bounds the upper tail: P(L > x) <= exp((a-1)(rdp_a - x)),
        so x = rdp_a + log(2/tail)/(a-1); the lower tail is below -log(2/tail) because
        E[exp(-L)] <= 1 for a privacy loss L.
        """
        log_tail = math.log(2 / self._pld.tail)
        with np.errstate(over="ignore", invalid="ignore"):
            upper = np.min(self._rdp(steps) + log_tail / (self._orders - 1))
        return float(upper) + log_tail if math.isfinite(upper) else math.inf
