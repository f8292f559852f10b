"""The flags of the ``dpscale`` commands: their value types, and the flags several commands share.

Numbers are finite and in range (click's ranges let NaN through), every list is written one
way, ``--delta`` is the same everywhere, and the settings of a training run are declared
once for ``train`` and ``sweep``.

A choice list, bound or default that a stage owns is named by its path in the stage
(``"train.ACCOUNTANTS"``) and read from there only when a command's help is shown or its
flags are checked: stage modules import JAX and Beam, which ``dpscale --help`` or a refused
flag should not wait for.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import click


def from_stage(path: str) -> Any:
    """The value at ``path`` (``"STAGE.NAME[.ATTRIBUTE...]"``) in the module ``dpscale.stages.STAGE``."""
    stage, *names = path.split(".")
    value: Any = importlib.import_module(f"dpscale.stages.{stage}")
    for name in names:
        value = getattr(value, name)
    return value


class _Stages(dict):
    """Stage modules by name, imported when a format string first names one."""

    def __missing__(self, stage: str) -> Any:
        return from_stage(stage)


class StageChoice(click.Choice):
    """The choices of a flag, read from the stage that checks them (``StageChoice("train.ACCOUNTANTS")``)."""

    def __init__(self, path: str) -> None:  # no super().__init__: it would read the choices at once
        self.path, self.case_sensitive = path, True

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(from_stage(self.path))

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        """A value other than the flag's default is checked against the stage's list. The default is one of
        them by construction (a test holds it), and reading the list imports the stage (seconds, for the
        accountant's commands) before the command can say a word."""
        if param is not None and value == param.default:
            return value
        return super().convert(value, param, ctx)


class StageHelpOption(click.Option):
    """An option whose help names a stage's values (``[default: {dedup.CopySettings.cut}]``), filled in when shown."""

    @property
    def help(self) -> str | None:
        return None if self._help is None else self._help.format_map(_Stages())

    @help.setter
    def help(self, value: str | None) -> None:
        self._help = value


Bound = float | str | None  # a number, or the path of a stage's number


class FiniteFloat(click.FloatRange):
    """A float in a range, NaN refused (click's ranges let it through) and ``inf`` only where allowed."""

    name = "float"

    def __init__(
        self,
        min: Bound = None,
        max: Bound = None,
        *,
        min_open: bool = False,
        max_open: bool = False,
        allow_inf: bool = False,
    ) -> None:
        super().__init__(min=min, max=max, min_open=min_open, max_open=max_open)
        self.allow_inf = allow_inf

    @property
    def min(self) -> float | None:
        return from_stage(self._min) if isinstance(self._min, str) else self._min

    @min.setter
    def min(self, value: Bound) -> None:
        self._min = value

    @property
    def max(self) -> float | None:
        return from_stage(self._max) if isinstance(self._max, str) else self._max

    @max.setter
    def max(self, value: Bound) -> None:
        self._max = value

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if math.isnan(number) or (math.isinf(number) and not (self.allow_inf and number > 0)):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self) -> str:
        return super()._describe_range() + (" or inf" if self.allow_inf else "")


def floats(
    min: Bound = None,
    max: Bound = None,
    *,
    min_open: bool = False,
    max_open: bool = False,
    allow_inf: bool = False,
) -> click.ParamType:
    """A float flag's type: finite (or ``inf`` when allowed), within the given bounds."""
    return FiniteFloat(min, max, min_open=min_open, max_open=max_open, allow_inf=allow_inf)


def ints(min: int | None = None, max: int | None = None) -> click.ParamType:
    """An integer flag's type within the given bounds (shown as INTEGER in --help)."""
    kind = click.IntRange(min=min, max=max)
    kind.name = "integer"
    return kind


POSITIVE = floats(0, min_open=True)  # finite and > 0
FRACTION = floats(0, 1, max_open=True)  # [0, 1)
COUNT = ints(1)  # a positive integer
SEED = ints(0)


class CommaList(click.ParamType):
    """A comma-separated list (``1,2,4``): every list flag of every command is written this way.

    An empty item (``1,,2`` or ``,``) is an error, not silently dropped; ``''`` is the empty
    list only where ``allow_empty`` (a flag whose default means "all" is simply left out).
    """

    name = "list"

    def __init__(self, item: click.ParamType = click.STRING, *, allow_empty: bool = False) -> None:
        self.item, self.allow_empty = item, allow_empty

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if not text:
            if self.allow_empty:
                return ()
            self.fail("an empty list: give comma-separated values, or leave the flag out", param, ctx)
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            self.fail(f"{text!r} has an empty item: give comma-separated values, e.g. a,b", param, ctx)
        return tuple(self.item.convert(part, param, ctx) for part in parts)

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return f"{self.item.name.upper()},..."


class ListOption(click.Option):
    """A list flag: ``--flag a,b`` and repeats (``--flag a --flag b``) give one flat tuple.

    Names after the first are deprecated spellings: accepted, but left out of ``--help``
    and of error messages.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("type", CommaList())
        default = kwargs.pop("default", None)
        if default is not None:
            kwargs["default"] = (default,)
            kwargs["help"] = f"{kwargs.get('help', '')}  [default: {default or chr(39) * 2}]".strip()
        super().__init__(*args, multiple=True, **kwargs)

    def type_cast_value(self, ctx: Any, value: Any) -> Any:
        lists = super().type_cast_value(ctx, value)
        return tuple(item for items in lists for item in items) if lists else ()

    def _primary(self) -> list[str]:
        return self.opts[:1]

    def get_help_record(self, ctx: Any) -> Any:
        opts, self.opts = self.opts, self._primary()
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts

    def get_error_hint(self, ctx: Any) -> str:
        return f"'{self.opts[0]}'"


_DELTA_HELP = (
    "delta of (epsilon, delta)-DP; every command defaults to 1e-5. Keep it well below 1/N "
    "(the command warns when delta >= 1/N)."
)
ACCOUNTANT_HELP = "pld: tight numerical accountant (default); rdp: looser upper bound, faster."


def delta_option() -> Any:
    """``--delta``: the same type, default and help in every command."""
    return click.option(
        "--delta", type=floats(0, 1, min_open=True, max_open=True), default=1e-5, show_default=True, help=_DELTA_HELP
    )


#: ``--verbose`` of every command that runs a Beam pipeline (the line of a failed one names the flag).
VERBOSE = click.option(
    "--verbose", is_flag=True, help="Show Beam's own logging (by default it goes to a log file named on failure)."
)


def options(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Apply click option decorators in the order they are listed (as they read in --help)."""

    def apply(command: Any) -> Any:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


#: The settings of a training run that `train` and `sweep` share (one definition, one default);
#: their names are the parameters of ``training.config.training_config``.
TRAINING_OPTIONS = options(
    click.option(
        "--mode",
        type=StageChoice("train.MODES"),
        default=None,
        help="images: all layers of --model on ingested DATA; features: the last layer on a feature "
        "cache entry; activations: the layers above the cut on an entry of `featurize --cut`. Default: "
        "read off DATA.",
    ),
    click.option(
        "--model",
        default="cnn-small",
        show_default=True,
        help="A name from `dpscale models` (images mode); above a cut, one of its tops (default: the first).",
    ),
    click.option(
        "--backbone",
        default=None,
        help="Fine-tune a pretrained backbone (imported name or directory) instead of --model.",
    ),
    delta_option(),
    click.option("--batch-size", type=COUNT, default=None, help="Expected (Poisson) batch size B."),
    click.option("--steps", type=COUNT, default=None, help="Number of optimiser steps T."),
    click.option("--accountant", type=StageChoice("train.ACCOUNTANTS"), default="pld", show_default=True),
    click.option(
        "--sampling",
        type=StageChoice("train.SAMPLING_SCHEMES"),
        default="poisson",
        show_default=True,
        help="`shuffle` is NOT what the accountant assumes: for baselines only (warns).",
    ),
    click.option(
        "--clip-norm", type=POSITIVE, default=1.0, show_default=True, help="Per-example gradient norm bound C."
    ),
    click.option(
        "--momentum", type=FRACTION, default=0.0, show_default=True, help="SGD momentum (recipe: 0 under DP)."
    ),
    click.option("--weight-decay", type=floats(0), default=0.0, show_default=True, help="Recipe: 0 under DP."),
    click.option(
        "--augmult",
        type=COUNT,
        default=1,
        show_default=True,
        help="K augmented views per example, averaged before clipping.",
    ),
    click.option("--augment-pad", type=ints(0), default=4, show_default=True, help="Reflect padding of random crops."),
    click.option("--no-flip", "augment_flip", flag_value=False, default=True, help="Do not flip views horizontally."),
    click.option(
        "--microbatch-size",
        type=COUNT,
        default=None,
        help="Physical batch; the logical batch is accumulated over micro-batches "
        "(default: 64 images, 4096 feature rows).",
    ),
    click.option("--ema-decay", type=FRACTION, default=0.999, show_default=True),
    click.option(
        "--holdout",
        type=ints(0),
        default=0,
        show_default=True,
        help="Do not train on the last N training rows (the plan accounts for the rest); score them "
        "with `dpscale evaluate RUN_DIR --split holdout --private-diagnostics`.",
    ),
    click.option(
        "--feature-normalization",
        type=StageChoice("train.FEATURE_NORMALIZATIONS"),
        default="none",
        show_default=True,
        help="features mode: l2 = unit rows (privacy-free); center-l2 = unit rows minus a DP mean, "
        "unit again (the mean's cost is in epsilon).",
    ),
    click.option(
        "--feature-mean-noise-multiplier",
        type=POSITIVE,
        default=20.0,
        show_default=True,
        help="center-l2 under DP: Gaussian noise multiplier of the mean's release (sensitivity 1).",
    ),
    click.option(
        "--feature-scale",
        type=POSITIVE,
        default=1.0,
        show_default=True,
        help="l2 / center-l2: norm of the normalised rows (sets the bias's step relative to the kernel's).",
    ),
    click.option(
        "--checkpoint-every", type=COUNT, default=None, help="Steps between checkpoints (default: ~20 per run)."
    ),
    click.option(
        "--devices",
        type=COUNT,
        default=None,
        help="Data-parallel devices (default: all local; all global ones in a multi-host run).",
    ),
    click.option(
        "--private-diagnostics",
        is_flag=True,
        help="Also write statistics of the private batches that epsilon does NOT cover (loss, gradient "
        "norms, clipped fraction, batch sizes, held-out scores) to *.NOT-PRIVATE.* files (mode 0600).",
    ),
)


def typed_options(ctx: click.Context) -> frozenset[str]:
    """The parameters a user gave (on the command line or in the environment), even at their default value:
    a stage refuses one its run would not use (``training.option_use``) rather than drop it."""
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return frozenset(p.name for p in ctx.command.params if p.name and ctx.get_parameter_source(p.name) in given)


#: A private selection (Papernot & Steinke 2022): the best of a random, secret number of DP runs, accounted
#: with its repetitions and noisy scores (``privacy.selection``); for ``sweep``, ``epsilon`` and ``calibrate``.
SELECTION_OPTIONS = options(
    click.option(
        "--private-selection",
        is_flag=True,
        help="Account (or, in sweep, make) a private selection: per epsilon the best of a random, secret number "
        "of runs, each scored on held-out rows with noise; epsilon covers the chosen model with its choice "
        "(sweep: needs --holdout N; --repeats independent selections per epsilon, composed in privacy.json).",
    ),
    click.option(
        "--repetitions",
        type=StageChoice("epsilon.REPETITIONS"),
        default=None,
        cls=StageHelpOption,
        help="How the number of runs is drawn (with --private-selection) [default: {epsilon.DEFAULT_REPETITIONS}].",
    ),
    click.option(
        "--repetitions-mean",
        type=floats(1),
        default=None,
        cls=StageHelpOption,
        help="Mean number of runs (with --private-selection) [default: {epsilon.DEFAULT_REPETITIONS_MEAN:g}].",
    ),
    click.option(
        "--repetitions-shape",
        type=floats(0),
        default=None,
        cls=StageHelpOption,
        help="negative-binomial's eta: 0 logarithmic, 1 geometric; smaller costs less epsilon but draws more "
        "runs in its tail (with --private-selection) [default: {epsilon.DEFAULT_REPETITIONS_SHAPE:g}].",
    ),
    click.option(
        "--score-noise",
        type=POSITIVE,
        default=None,
        cls=StageHelpOption,
        help="Std of the Gaussian noise on each run's count of correct held-out predictions, in rows "
        "(with --private-selection) [default: {epsilon.DEFAULT_SCORE_NOISE:g}].",
    ),
)
_SELECTION_FLAGS = ("repetitions", "repetitions_mean", "repetitions_shape", "score_noise")


def private_selection(options: dict[str, Any], stage: str) -> Any:
    """Take the selection flags out of ``options``: the stage's ``Selection`` with --private-selection, else
    None (the other selection flags are then refused: they would change nothing)."""
    on = options.pop("private_selection")
    given = {name: value for name in _SELECTION_FLAGS if (value := options.pop(name)) is not None}
    if not on:
        if given:
            names = " ".join(f"--{name.replace('_', '-')}" for name in given)
            raise click.UsageError(f"{names}: only with --private-selection")
        return None
    return from_stage(f"{stage}.Selection").of(**given)


#: ``--grid`` names that stand for a sweep's own list flags (``--epsilons``, ``--learning-rates``).
GRID_SHORTHANDS = {"epsilon": "epsilons", "learning_rate": "learning_rates"}


def grid_axes(ctx: click.Context, items: tuple[str, ...]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """``--grid NAME=V1,V2`` items as (option, typed values), each value read as ``--NAME`` reads it.

    NAME is a training flag of the command (``batch-size``, ``augmult``, ``ema-decay``, ...), or
    ``epsilon`` / ``learning-rate``; an option is gridded or given as a flag, not both.
    """
    params = {p.name: p for p in ctx.command.params}
    axes = []
    for item in items:
        name, sep, values = item.partition("=")
        option = name.strip().lstrip("-").replace("-", "_")
        if not sep or not option or not values.strip():
            raise click.BadParameter(f"{item!r}: give NAME=V1,V2,... (e.g. augmult=1,4,8)", ctx, param_hint="'--grid'")
        shorthand = GRID_SHORTHANDS.get(option)
        param = params.get(shorthand or option)
        if param is None or param.name in GRID_SHORTHANDS or getattr(param, "is_flag", False) or option == "mode":
            raise click.BadParameter(
                f"{name.strip()!r} is not a training option that takes a value (e.g. augmult, "
                "batch-size, ema-decay, learning-rate, epsilon)",
                ctx,
                param_hint="'--grid'",
            )
        item_type = param.type.item if isinstance(param.type, CommaList) else param.type
        typed = CommaList(item_type).convert(values, param, ctx)
        if ctx.get_parameter_source(param.name) == click.core.ParameterSource.COMMANDLINE:
            raise click.BadParameter(
                f"{param.opts[0]} is also given: give {option.replace('_', '-')} either as a flag or in --grid",
                ctx,
                param_hint="'--grid'",
            )
        axes.append((option, typed))
    return tuple(axes)
