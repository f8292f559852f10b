"""Privacy-loss distributions of bounded size: PLD accounting that always answers.

dp-accounting's PLD represents a privacy loss on a grid of width ``d`` (the discretization
interval). Its cost is the number of grid points: one step of DP-SGD spans roughly
``(1 + 20 sigma) / sigma^2`` in loss (millions of points at ``d = 1e-4`` below sigma ~0.1,
billions at sigma 1e-3: 38 GiB and a crash), and a T-fold composition spans up to T times
the per-step loss. Here the grid is chosen per (mechanism, T) so that both stay below fixed
sizes (``MAX_STEP_POINTS``, ``MAX_COMPOSED_POINTS``): the default ``d`` wherever it fits
(every ordinary DP-SGD setting, so numbers equal dp-accounting's own there), a coarser one
otherwise. A coarser grid is still an upper bound on epsilon (dp-accounting rounds
pessimistically), only a looser one, and ``accounting.EpsilonCurve`` takes the minimum with
RDP anyway.

The spans are known before anything is built: the one-step span from dp-accounting's own
``connect_dots_bounds`` (exactly the grid it will build), the composed one from the RDP
epsilon at the truncated tail mass (a Chernoff bound on the composed loss, which is what RDP
is) or T times the one-step span, whichever is smaller.

Tiny deltas: the composed probabilities come out of an FFT whose rounding error (~1e-16
per point, over up to millions of points) is no longer small against delta below ~1e-12:
there dp-accounting's epsilon jumps between 5 and 15 for noise multipliers 0.3% apart, and
at delta <= 1e-15 (its truncated tail mass) it is inf. Below ``MIN_DELTA`` a PLD is
therefore not computed at all and RDP answers alone (``accounting.EpsilonCurve``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism
from scipy import stats

NEIGHBORING_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
# dp-accounting's own default interval; every ordinary setting keeps it.
DEFAULT_DISCRETIZATION = 1e-4
# Grid points of one step's distribution (built by a Python loop per point, the calibration's
# cost: benchmarks/results/first_hour_speed.md) and of a
# composition (FFT in complex128, a few arrays of 16 bytes per point): ~0.3 GB at most.
MAX_STEP_POINTS = 2**18
MAX_COMPOSED_POINTS = 2**21
TAIL_MASS = 1e-15  # dp-accounting's default truncation per composition (counted as infinite loss)
MIN_DELTA = 1e-11  # 10x above where rounding visibly breaks monotonicity in sigma
SPLIT_STEPS = 10**5  # compositions longer than this are made in blocks (``BoundedPld._self_compose``)
SPLIT_BLOCK = 1024
# Beyond this grid (in nats) dp-accounting's arithmetic overflows (exp of the interval, at
# ~709); RDP then answers alone (epsilon is in the billions there anyway).
MAX_DISCRETIZATION = 500.0


def step_loss_span(
    noise_multiplier: float, sampling_rate: float = 1.0, *, truncation: tuple[int, int] | None = None
) -> tuple[float, float]:
    """(width, highest loss) of one (subsampled) Gaussian step's grid, the wider of its two directions.

    With ``truncation`` (dataset size, capacity), the wider of the two parts dp-accounting mixes
    (``truncated_parts``): the Poisson step, and the replace-one step at half the noise.
    """
    parts = [
        (
            noise_multiplier,
            sampling_rate,
            (privacy_loss_mechanism.AdjacencyType.REMOVE, privacy_loss_mechanism.AdjacencyType.ADD),
        )
    ]
    if truncation is not None:
        truncated = truncated_parts(noise_multiplier, sampling_rate, *truncation)
        if truncated is not None:
            parts.append((noise_multiplier / 2, truncated[1], (privacy_loss_mechanism.AdjacencyType.REPLACE,)))
    width, high = 0.0, 0.0
    for sigma, rate, adjacencies in parts:
        for adjacency in adjacencies:
            bounds = privacy_loss_mechanism.GaussianPrivacyLoss(
                sigma, sampling_prob=rate, adjacency_type=adjacency
            ).connect_dots_bounds()
            width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
            high = max(high, bounds.epsilon_upper)
    return width, high


def truncated_parts(
    noise_multiplier: float, sampling_rate: float, dataset_size: int, capacity: int
) -> tuple[float, float] | None:
    """(truncation probability, sampling rate of the replace-one part) as dp-accounting computes them
    for a truncated-Poisson step (``from_truncated_subsampled_gaussian_mechanism``); None: never truncated."""
    del noise_multiplier
    probability = stats.binom.sf(capacity - 1, dataset_size - 1, sampling_rate)
    if probability == 0.0:
        return None
    rate = stats.binom.sf(capacity, dataset_size, sampling_rate) * capacity / probability / dataset_size
    return float(probability), float(min(1.0, rate))


def discretization(*, step_span: float, composed_span: float, base: float = DEFAULT_DISCRETIZATION) -> float | None:
    """The finest grid, ``base`` times a power of two, on which both spans fit their point budgets.

    Powers of two keep the number of distinct grids (and so of one-step distributions built)
    logarithmic in the span when many step counts are asked for. None: no grid up to
    ``MAX_DISCRETIZATION`` fits (leave it to RDP).
    """
    needed = max(step_span / MAX_STEP_POINTS, composed_span / MAX_COMPOSED_POINTS, base)
    if not needed <= MAX_DISCRETIZATION:  # also catches inf and nan
        return None
    return base * 2.0 ** max(0, math.ceil(math.log2(needed / base) - 1e-12))


class BoundedPld:
    """Epsilon of (one-off releases, then T steps of one subsampled Gaussian) for any T, in bounded memory.

    ``composed_span(t)`` must give an upper estimate of the span of the t-fold composition
    (``accounting.EpsilonCurve`` passes one from RDP); one-step distributions are built per
    grid and cached.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        sampling_rate: float,
        releases: tuple[float, ...],
        delta: float,
        base: float = DEFAULT_DISCRETIZATION,
        truncation: tuple[int, int] | None = None,
    ) -> None:
        self.noise_multiplier, self.sampling_rate, self.releases = noise_multiplier, sampling_rate, releases
        self.truncation = truncation  # (dataset size, capacity) of truncated Poisson sampling, or None
        self.delta, self.base = delta, base
        self.tail = TAIL_MASS
        spans = [step_loss_span(noise_multiplier, sampling_rate, truncation=truncation)] + [
            step_loss_span(s) for s in releases
        ]
        self.step_span = max(width for width, _ in spans)
        self.step_high = max(high for _, high in spans)
        self._built: dict[float, tuple[object, object]] = {}

    def grid(self, composed_span: float) -> float | None:
        """The grid used for a composition spanning ``composed_span`` in loss (None: too wide for any)."""
        return discretization(step_span=self.step_span, composed_span=composed_span, base=self.base)

    def _parts(self, interval: float) -> tuple[object, object]:
        """(one training step, all releases) on the grid ``interval``: built once per grid."""
        if interval not in self._built:
            if self.truncation is None:
                step = privacy_loss_distribution.from_gaussian_mechanism(
                    standard_deviation=self.noise_multiplier,
                    sampling_prob=self.sampling_rate,
                    value_discretization_interval=interval,
                    neighboring_relation=NEIGHBORING_RELATION,
                )
            else:
                dataset_size, capacity = self.truncation
                step = privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
                    dataset_size=dataset_size,
                    sampling_probability=self.sampling_rate,
                    truncated_batch_size=capacity,
                    noise_multiplier=self.noise_multiplier,
                    value_discretization_interval=interval,
                    neighboring_relation=NEIGHBORING_RELATION,
                )
            released = privacy_loss_distribution.identity(value_discretization_interval=interval)
            for sigma in self.releases:
                released = released.compose(
                    privacy_loss_distribution.from_gaussian_mechanism(
                        standard_deviation=sigma,
                        value_discretization_interval=interval,
                        neighboring_relation=NEIGHBORING_RELATION,
                    ),
                    tail_mass_truncation=self.tail,
                )
            self._built[interval] = (step, released)
        return self._built[interval]

    def epsilon(self, steps: int, *, composed_span: float) -> float:
        """Epsilon at ``delta`` after the releases and ``steps`` steps (an upper bound; inf if none fits)."""
        worst = steps * self.step_high + (len(self.releases) + 1) * self.step_span + math.log(2 / self.tail)
        interval = self.grid(min(composed_span, worst))
        if interval is None:
            return math.inf
        step, released = self._parts(interval)
        composed = released
        if steps:
            composed = released.compose(self._self_compose(step, steps), tail_mass_truncation=self.tail)
        return float(composed.get_epsilon_for_delta(self.delta))

    def _self_compose(self, step: object, steps: int) -> object:
        """``step`` composed ``steps`` times.

        dp-accounting sizes a sparse (narrow) distribution's composition by the exact integer
        ``size ** steps``, which takes minutes and gigabytes of big-integer arithmetic at 10^8
        steps. Past ``SPLIT_STEPS`` steps the composition is therefore made of a block of
        ``SPLIT_BLOCK`` steps (dense by then), that block composed ``steps // SPLIT_BLOCK``
        times, and the remainder: the same distribution with up to three tail truncations
        instead of one, each counted as infinite loss (pessimistic), so still an upper bound.
        """
        if steps <= SPLIT_STEPS:
            return step.self_compose(steps, tail_mass_truncation=self.tail)
        blocks = steps // SPLIT_BLOCK
        # The block's dropped tail is counted once per block: drop 1/blocks as much in it.
        block = step.self_compose(SPLIT_BLOCK, tail_mass_truncation=self.tail / blocks)
        composed = block.self_compose(blocks, tail_mass_truncation=self.tail)
        if steps % SPLIT_BLOCK:
            composed = composed.compose(
                step.self_compose(steps % SPLIT_BLOCK, tail_mass_truncation=self.tail), tail_mass_truncation=self.tail
            )
        return composed


def privacy_profile(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    epsilons: Sequence[float],
    truncation: tuple[int, int] | None = None,
    discretization: float = 1e-2,
) -> np.ndarray:
    """delta(eps) of ``steps`` (truncated) Poisson-subsampled Gaussian steps at each of ``epsilons``.

    dp-accounting's pessimistic PLD on a grid of ``discretization``: each value is an upper
    bound on the mechanism's delta(eps), the coarser the grid the looser. The whole profile
    (the f-DP trade-off curve in another form) is what an audit compares a test's error
    rates with (``audit.sampler``).
    """
    if truncation is None:
        step = privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=noise_multiplier,
            sampling_prob=sampling_rate,
            value_discretization_interval=discretization,
            neighboring_relation=NEIGHBORING_RELATION,
        )
    else:
        step = privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
            dataset_size=truncation[0],
            sampling_probability=sampling_rate,
            truncated_batch_size=truncation[1],
            noise_multiplier=noise_multiplier,
            value_discretization_interval=discretization,
            neighboring_relation=NEIGHBORING_RELATION,
        )
    composed = step.self_compose(steps, tail_mass_truncation=TAIL_MASS)
    return np.asarray(composed.get_delta_for_epsilon(np.asarray(epsilons, dtype=float)), dtype=float)
