"""Which training options each kind of run uses: the one table that decides whether an option given to
``train`` or ``sweep`` is used or refused, never silently dropped.

A run trains all layers of a network on ingested images (``images``), a last layer on pooled features
(``features``), or the layers above a cut on cached activations (``activations``). Some options mean
something in one kind only (``--feature-normalization``: a features run; ``--augment-pad``: the crops an
images run draws, where above a cut the views were drawn when the activations were cached), some only
beside another option (``--feature-scale`` with a normalisation, ``--model`` without ``--backbone``), and
some only under DP (the clip norm of a run that clips nothing). Such an option given where it is not
used leaves the run as it would be without it while its user believes otherwise (and its config records
a value nothing read), so it is refused, in one line saying where it applies.

``OPTION_USE`` has a row for every flat option of ``training.config.training_config`` (a test holds
them equal), and ``unused`` is the only reader of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

MODES = ("images", "features", "activations")
#: What a run of each mode trains, as a refusal names it.
TRAINS = {
    "images": "all layers of a network on ingested images",
    "features": "a last layer on pooled features",
    "activations": "the layers above a cut on cached activations",
}


@dataclasses.dataclass(frozen=True)
class Use:
    """Where an option is used: the modes, a condition on the run's other options, and DP only or not."""

    modes: tuple[str, ...] = MODES
    needs: str = ""  # a key of NEEDS: the run uses the option only when that condition holds
    private: bool = False  # used only by a private run (a finite epsilon): clipping, noise, accounting


#: Conditions an option's use may have on the others: (how a refusal says it, the test on the flat options).
NEEDS: dict[str, tuple[str, Callable[[Mapping[str, Any]], bool]]] = {
    "normalized": ("with --feature-normalization l2 or center-l2", lambda o: o["feature_normalization"] != "none"),
    "centred": ("with --feature-normalization center-l2", lambda o: o["feature_normalization"] == "center-l2"),
    "no_backbone": ("without --backbone (a backbone is the network)", lambda o: not o["backbone"]),
}
_PRIVATE = Use(private=True)
_ABOVE_IMAGES = ("images", "activations")

#: Every flat training option and where a run uses it.
OPTION_USE: dict[str, Use] = {
    "epsilon": Use(),
    "delta": _PRIVATE,
    "accountant": _PRIVATE,
    "sampling": Use(),
    "batch_size": Use(),
    "steps": Use(),
    "noise_multiplier": _PRIVATE,
    "clip_norm": _PRIVATE,
    "learning_rate": Use(),
    "momentum": Use(),
    "weight_decay": Use(),
    "microbatch_size": Use(),
    "ema_decay": Use(),
    "seed": Use(),
    "checkpoint_every": Use(),
    "devices": Use(),
    "private_diagnostics": _PRIVATE,
    "holdout": Use(),
    "backbone": Use(("images",)),
    "model": Use(_ABOVE_IMAGES, needs="no_backbone"),
    "augmult": Use(_ABOVE_IMAGES),
    "augment_pad": Use(("images",)),
    "augment_flip": Use(("images",)),
    "feature_normalization": Use(("features",)),
    "feature_mean_noise_multiplier": Use(("features",), needs="centred", private=True),
    "feature_scale": Use(("features",), needs="normalized"),
}
_FLAGS = {"augment_flip": "--no-flip"}  # options whose flag is not their name


def flag(option: str) -> str:
    """How the command line spells ``option``."""
    return _FLAGS.get(option, f"--{option.replace('_', '-')}")


def _modes(modes: tuple[str, ...]) -> str:
    return " and ".join(modes) + (" modes" if len(modes) > 1 else " mode")


def unused(mode: str, options: Mapping[str, Any], given: Iterable[str], *, private: bool | None = None) -> str | None:
    """Why the first of ``given`` that a ``mode`` run with the flat ``options`` would not use is refused.

    None when every given option is used. ``private`` None: whether the run is private is not known
    here (a sweep's settings, shared by its DP runs and its non-private baseline).
    """
    for name in (n for n in OPTION_USE if n in set(given)):
        use = OPTION_USE[name]
        if mode not in use.modes:
            return (
                f"{flag(name)} does not apply to {mode} mode ({TRAINS[mode]}), only to {_modes(use.modes)} "
                f"({'; '.join(TRAINS[m] for m in use.modes)}): leave it out"
            )
        if use.needs and not NEEDS[use.needs][1](options):
            return f"{flag(name)} is used only {NEEDS[use.needs][0]}; leave it out"
        if use.private and private is False:
            return (
                f"{flag(name)} is used only under DP; a non-private run (--epsilon inf) does not use it: leave it out"
            )
    return None
