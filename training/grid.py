"""A grid of training settings: which runs a sweep makes, what each is called, and its simulations.

A grid is a list of axes, each a training option (as ``training.config.training_config`` names
it, e.g. ``augmult`` or ``batch_size``) with the values it takes; epsilon and the learning rate
are always the first two. A point is one value per axis and a repeat, and its settings are the
sweep's base settings with those options replaced (``config.with_options``). Its run directory's
name spells out every gridded value, so two points never share one.

A *simulated* point (Sander et al. 2023, "TAN without a burn") runs the setting at a smaller
expected batch b with the noise multiplier scaled by b / B, the same steps: the noise on the
averaged gradient (sigma C / B) is the target's, so accuracy is predicted at B / b of the cost.
It adds *less* noise per example than the target, so it is not private at the target epsilon:
its epsilon is what its own (sigma b / B, b, T) spends.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Literal

from dpscale.errors import InvalidConfigError
from dpscale.privacy.plan import PrivacyPlan
from dpscale.training.config import TrainingConfig, options_of, with_options
from dpscale.training.release import SIMULATION_FILE, SIMULATION_NOTE  # noqa: F401 - SIMULATION_FILE re-exported

Axis = tuple[str, tuple[Any, ...]]
Kind = Literal["private", "baseline", "simulated"]

#: Options a grid may not vary, and why (every other training option may be gridded).
NOT_GRIDDED = {
    "seed": "each repeat draws a fresh secret seed",
    "noise_multiplier": "the noise is calibrated for each epsilon",
    "delta": "a sweep's runs compose at one delta",
    "accountant": "a sweep's runs compose under one accountant",
    "holdout": "every setting is chosen on the same held-out rows",
    "private_diagnostics": "it changes what is written, not what is learnt",
    "devices": "it changes where a run computes, not what it learns",
    "checkpoint_every": "it changes when a run saves, not what it learns",
}
#: Short names of the first two axes in run names (``eps8-lr2-...``, as sweeps have always named them).
_SHORT = {"epsilon": "eps", "learning_rate": "lr"}


def flag(option: str) -> str:
    """``batch_size`` -> ``batch-size``: how the command line spells an option."""
    return option.replace("_", "-")


def value_text(value: Any) -> str:
    """A value as it appears in a run name: numbers in their shortest exact form, text made path-safe."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return re.sub(r"[^A-Za-z0-9._+-]", "_", str(value))


def check_axes(axes: tuple[Axis, ...]) -> None:
    """Every axis a training option that may vary, named once, with distinct values."""
    known = set(options_of(TrainingConfig()))
    names = [name for name, _ in axes]
    for name, values in axes:
        if name not in known:
            raise InvalidConfigError(
                f"--grid {flag(name)}: not a training option (any option of `dpscale train` "
                f"that takes a value, e.g. augmult, batch-size, ema-decay)"
            )
        if name in NOT_GRIDDED:
            raise InvalidConfigError(f"--grid {flag(name)}: not a grid option ({NOT_GRIDDED[name]})")
        if not values:
            raise InvalidConfigError(f"--grid {flag(name)}: give at least one value")
        if len(set(map(repr, values))) != len(values):
            raise InvalidConfigError(f"--grid {flag(name)}: a value is listed twice ({list(values)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidConfigError(f"--grid {', '.join(map(flag, twice))} given more than once")


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One run of a sweep: its gridded values, repeat, settings and run directory name."""

    values: tuple[tuple[str, Any], ...]  # (option, value) per axis, in axis order
    repeat: int
    training: TrainingConfig  # seed None: each run draws its own
    name: str
    kind: Kind = "private"

    @property
    def setting(self) -> tuple[tuple[str, Any], ...]:
        """The gridded values but epsilon: what a selection chooses between, per epsilon."""
        return tuple((k, v) for k, v in self.values if k != "epsilon")

    @property
    def epsilon(self) -> float:
        return dict(self.values)["epsilon"]


def run_name(values: tuple[tuple[str, Any], ...], repeat: int, *, kind: Kind, simulate_batch: int | None = None) -> str:
    """``eps8-lr2-augmult4-r0``: every gridded value, then the repeat; baselines and simulations say so."""
    parts = []
    for option, value in values:
        if option == "epsilon" and kind == "baseline":
            parts.append("nonprivate")
        elif option in _SHORT:
            parts.append(f"{_SHORT[option]}{value_text(value)}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{flag(option)}{value_text(value)}")
        else:
            parts.append(f"{flag(option)}-{value_text(value)}")
    name = "-".join([*parts, f"r{repeat}"])
    if kind == "simulated":  # not private at its target: the name says so
        name = f"sim-b{simulate_batch}-{name}.NOT-PRIVATE"
    return name


def grid_points(
    base: TrainingConfig,
    axes: tuple[Axis, ...],
    *,
    repeats: int,
    kind: Kind = "private",
    overrides: dict[str, Any] | None = None,
    simulate_batch: int | None = None,
) -> list[GridPoint]:
    """Every point of the grid (axes in order, the last varying fastest, then repeats).

    ``overrides`` replace options on every point unless the grid sets them (a baseline's momentum).
    Refuses points whose names collide and gridded values that change nothing (an images-only
    option in features mode).
    """
    points: list[GridPoint] = []
    names: dict[str, tuple[tuple[str, Any], ...]] = {}
    settings: dict[str, tuple[tuple[str, Any], ...]] = {}
    for combination in itertools.product(*(values for _, values in axes)):
        values = tuple(zip((name for name, _ in axes), combination))
        training = with_options(base, **((overrides or {}) | dict(values) | {"seed": None}))
        applied = options_of(training)
        for option, value in values:
            if applied[option] != value:
                raise InvalidConfigError(f"--grid {flag(option)}: does not apply to {base.mode} mode")
        if repr(training) in settings:
            raise InvalidConfigError(
                f"grid points {dict(settings[repr(training)])} and {dict(values)} are the same "
                "run; an option does not apply to this mode"
            )
        settings[repr(training)] = values
        for repeat in range(repeats):
            name = run_name(values, repeat, kind=kind, simulate_batch=simulate_batch)
            if name in names:
                raise InvalidConfigError(
                    f"grid points {dict(names[name])} and {dict(values)} both get the run "
                    f"name {name!r}; give values that differ in their text"
                )
            names[name] = values
            points.append(GridPoint(values=values, repeat=repeat, training=training, name=name, kind=kind))
    return points


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A target run and its TAN simulation at a smaller batch (same steps, same sigma / B)."""

    target: PrivacyPlan  # what the full run at the target epsilon would be
    plan: PrivacyPlan  # what the simulation runs: batch b, sigma * b / B, the same T
    training: TrainingConfig  # the simulation's settings (its target epsilon is its own spend)

    def as_dict(self) -> dict[str, Any]:
        """What is simulated (the target) and how (batch, scaled noise); the run's own spend is in its ledger."""
        return {
            "note": SIMULATION_NOTE,
            "target_batch_size": self.target.batch_size,
            "target_noise_multiplier": self.target.noise_multiplier,
            "target_epsilon": self.target.epsilon(),
            "batch_size": self.plan.batch_size,
            "scaled_noise_multiplier": self.plan.noise_multiplier,
            "steps": self.plan.steps,
            "delta": self.plan.delta,
        }


def simulate(training: TrainingConfig, target: PrivacyPlan, *, batch_size: int) -> Simulation:
    """The TAN simulation of ``target`` (the plan of ``training``) at expected batch ``batch_size``.

    The run's settings give its batch and steps; its target epsilon is the epsilon its own
    (sigma b / B, b, T) spends, so calibration lands on that sigma (within its tolerance,
    never below it) and every number the run reports is its own spend, not the target's.
    """
    if not target.private:
        raise InvalidConfigError("a simulation needs a private target")
    if not 1 <= batch_size < target.batch_size:
        raise InvalidConfigError(
            f"--simulate-batch {batch_size} must be below the batch size it simulates ({target.batch_size})"
        )
    plan = dataclasses.replace(
        target, batch_size=batch_size, noise_multiplier=target.noise_multiplier * batch_size / target.batch_size
    )
    spent = plan.epsilon()
    if not math.isfinite(spent):
        raise InvalidConfigError(f"--simulate-batch {batch_size}: the simulation's own epsilon is not finite")
    simulated = with_options(training, batch_size=batch_size, steps=target.steps, epsilon=spent)
    return Simulation(target=target, plan=plan, training=simulated)
