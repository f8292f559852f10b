"""The settings of one training run, shared by ``train``, ``sweep`` and ``quickstart``.

``TrainingConfig`` says *how* to train (privacy target, batch, steps, optimiser, devices);
where the data and the run directory are is the train stage's business. Sweep and quickstart
embed a ``TrainingConfig`` and vary fields of it with ``dataclasses.replace`` rather than
copying them, so a default means the same thing in every command; ``training_config`` nests a
command's flat options into one (``with_options`` replaces some of them, as a sweep's grid does).
Settings that only one mode reads live in ``ImageSettings`` (all layers of a network on images,
or the layers above a cut on cached activations: its ``model`` names the top, its ``augmult``
the cached views per example) and ``FeatureSettings`` (the last layer on cached features).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import Accountant, SamplingScheme, check_clip_norm, check_ema_decay, check_positive
from dpscale.privacy.plan import PrivacyTarget
from dpscale.training.option_use import MODES, unused

Mode = Literal["images", "features", "activations"]
CACHE_MODES = ("features", "activations")  # modes that read a feature-cache entry, not images
FEATURE_NORMALIZATIONS = ("none", "l2", "center-l2")
# Physical batch when none is given: small for networks on images (memory of per-example
# gradients), large for the closed-form last layer (one matrix product per micro-batch).
DEFAULT_MICROBATCH = {"images": 64, "features": 4096, "activations": 256}
_log = logging.getLogger(__name__)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidConfigError(message)


def _finite_positive(value: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """Images mode: which network, and how each example's K augmented views are made."""

    model: str = "cnn-small"  # a registry name, trained from scratch
    backbone: str | None = None  # fine-tune this pretrained backbone (name or directory) instead
    augmult: int = 1  # K views per example, averaged before clipping
    augment_pad: int = 4  # reflect padding of the random crops
    augment_flip: bool = True

    def __post_init__(self) -> None:
        _check(isinstance(self.augmult, int) and self.augmult >= 1, f"augmult must be >= 1, got {self.augmult}")
        _check(
            isinstance(self.augment_pad, int) and self.augment_pad >= 0,
            f"augment pad must be >= 0, got {self.augment_pad}",
        )


@dataclasses.dataclass(frozen=True)
class FeatureSettings:
    """Features mode: a zero-initialised softmax layer on cached features, and how rows are normalised."""

    normalization: str = "none"  # "none", "l2" or "center-l2"
    mean_noise_multiplier: float = 20.0  # center-l2 under DP: noise of the mean's Gaussian release
    scale: float = 1.0  # l2 / center-l2: the norm of the normalised rows

    def __post_init__(self) -> None:
        _check(
            self.normalization in FEATURE_NORMALIZATIONS,
            f"feature normalization must be one of {FEATURE_NORMALIZATIONS}, got {self.normalization!r}",
        )
        _check(
            _finite_positive(self.mean_noise_multiplier),
            f"the feature mean's noise multiplier must be positive, got {self.mean_noise_multiplier}",
        )
        _check(_finite_positive(self.scale), f"the feature scale must be positive, got {self.scale}")


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How to train. Give two of {batch_size, steps, noise_multiplier}; the third is calibrated."""

    mode: Mode = "images"
    target: PrivacyTarget = PrivacyTarget()
    batch_size: int | None = None  # expected (Poisson) batch size B
    steps: int | None = None
    noise_multiplier: float | None = None
    clip_norm: float = 1.0
    learning_rate: float = 2.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    microbatch_size: int | None = None  # physical batch; None: DEFAULT_MICROBATCH of the mode
    ema_decay: float = 0.999
    seed: int | None = None  # None: fresh OS entropy (the default, and the only private choice)
    train_split: str = "train"
    devices: int | None = None  # data-parallel devices; None = all local (all global with several processes)
    checkpoint_every: int | None = None  # steps; None = about 20 checkpoints per run
    show_progress: bool = True
    private_diagnostics: bool = False  # write statistics epsilon does not cover (training.release)
    holdout: int = 0  # the last N training rows are not trained on (evaluate split "holdout"), both modes
    images: ImageSettings = ImageSettings()
    features: FeatureSettings = FeatureSettings()

    def __post_init__(self) -> None:
        _check(self.mode in MODES, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_clip_norm(self.clip_norm)
        check_positive(self.learning_rate, "learning rate")
        _check(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        _check(0 <= self.weight_decay < math.inf, f"weight decay must be >= 0 and finite, got {self.weight_decay}")
        check_ema_decay(self.ema_decay)
        for name in ("microbatch_size", "checkpoint_every", "devices"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and value >= 1),
                f"{name.replace('_', ' ')} must be a positive integer, got {value}",
            )
        _check(
            isinstance(self.holdout, int) and not isinstance(self.holdout, bool) and self.holdout >= 0,
            f"holdout must be in [0, N), got {self.holdout}",
        )
        if self.mode != "features":
            _check(self.features == FeatureSettings(), "feature normalization applies to features mode only")
        if not self.private:
            _check(
                self.batch_size is not None and self.steps is not None,
                "a non-private run (epsilon=inf) needs --batch-size and --steps",
            )
        elif self.momentum or self.weight_decay:
            _log.warning("momentum/weight decay under DP: allowed (post-processing), but not the recipe's")

    @property
    def private(self) -> bool:
        return self.target.private

    @property
    def effective_microbatch_size(self) -> int:
        return self.microbatch_size or DEFAULT_MICROBATCH[self.mode]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> TrainingConfig:
        """The inverse of ``to_json``; ``InvalidConfigError`` for unknown or missing fields.

        Runs written before ``holdout`` applied to both modes kept it in ``features``: read there too.
        """
        payload = dict(payload)
        features = dict(payload.get("features") or {})
        if "holdout" in features:
            moved = features.pop("holdout")
            if payload.get("holdout", moved) != moved:
                raise InvalidConfigError("not a training configuration: two different holdouts")
            payload["holdout"], payload["features"] = moved, features
        try:
            nested = {"target": PrivacyTarget, "images": ImageSettings, "features": FeatureSettings}
            values = {k: nested[k](**v) if k in nested else v for k, v in payload.items()}
            return cls(**values)
        except TypeError as exc:
            raise InvalidConfigError(f"not a training configuration: {exc}") from None


def training_config(
    mode: Mode,
    *,
    epsilon: float = PrivacyTarget.epsilon,
    delta: float = PrivacyTarget.delta,
    accountant: Accountant = PrivacyTarget.accountant,
    sampling: SamplingScheme = PrivacyTarget.sampling,
    batch_size: int | None = TrainingConfig.batch_size,
    steps: int | None = TrainingConfig.steps,
    noise_multiplier: float | None = TrainingConfig.noise_multiplier,
    clip_norm: float = TrainingConfig.clip_norm,
    learning_rate: float = TrainingConfig.learning_rate,
    momentum: float = TrainingConfig.momentum,
    weight_decay: float = TrainingConfig.weight_decay,
    microbatch_size: int | None = TrainingConfig.microbatch_size,
    ema_decay: float = TrainingConfig.ema_decay,
    seed: int | None = TrainingConfig.seed,
    checkpoint_every: int | None = TrainingConfig.checkpoint_every,
    devices: int | None = TrainingConfig.devices,
    private_diagnostics: bool = TrainingConfig.private_diagnostics,
    model: str = ImageSettings.model,
    backbone: str | None = ImageSettings.backbone,
    augmult: int = ImageSettings.augmult,
    augment_pad: int = ImageSettings.augment_pad,
    augment_flip: bool = ImageSettings.augment_flip,
    holdout: int = TrainingConfig.holdout,
    feature_normalization: str = FeatureSettings.normalization,
    feature_mean_noise_multiplier: float = FeatureSettings.mean_noise_multiplier,
    feature_scale: float = FeatureSettings.scale,
    given: Iterable[str] = (),
) -> TrainingConfig:
    """A ``TrainingConfig`` from flat options, one per flag of ``train`` and ``sweep``.

    Commands take every setting side by side; this nests them. An option that a run of ``mode``
    would not use (``training.option_use``) is refused, not dropped: one that differs from its
    default, or that is named in ``given`` (the flags a user typed, its default value included).
    Whether the run is private is left to the caller (a sweep's settings serve its baseline too).
    """
    _check(mode in MODES, f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    flat = dict(locals())  # the flat options, as they were passed
    del flat["mode"], flat["given"]
    refuse_unused(mode, flat, given)
    _check(  # above a cut the images default stands for the cut's first top: typed, it names no top
        not (mode == "activations" and "model" in given and model == ImageSettings.model),
        f"--model {model} is a network for images, not a top above a cut: give one of the cut's tops "
        "(`dpscale models` lists them) or leave --model out for the first",
    )
    target = PrivacyTarget(epsilon=epsilon, delta=delta, accountant=accountant, sampling=sampling)
    images = ImageSettings(
        model=model, backbone=backbone, augmult=augmult, augment_pad=augment_pad, augment_flip=augment_flip
    )
    features = FeatureSettings(
        normalization=feature_normalization, mean_noise_multiplier=feature_mean_noise_multiplier, scale=feature_scale
    )
    return TrainingConfig(
        mode=mode,
        target=target,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=noise_multiplier,
        clip_norm=clip_norm,
        learning_rate=learning_rate,
        momentum=momentum,
        weight_decay=weight_decay,
        microbatch_size=microbatch_size,
        ema_decay=ema_decay,
        seed=seed,
        checkpoint_every=checkpoint_every,
        devices=devices,
        private_diagnostics=private_diagnostics,
        holdout=holdout,
        images=images,
        features=features,
    )


def refuse_unused(
    mode: str, flat: Mapping[str, Any], given: Iterable[str] = (), *, private: bool | None = None
) -> None:
    """Refuse the first flat option that a run of ``mode`` would not use (``training.option_use``), of those
    that differ from their defaults and those named in ``given`` (flags typed with their default value).

    ``private``: whether the run is private, where that is known (one run; not a sweep's shared settings).
    """
    defaults = options_of(TrainingConfig())
    asked = {name for name in given if name in flat} | {name for name in flat if flat[name] != defaults[name]}
    refusal = unused(mode, flat, asked, private=private)
    _check(refusal is None, str(refusal))


def options_of(config: TrainingConfig) -> dict[str, Any]:
    """The flat options of ``config``, as ``training_config`` takes them (its inverse, but the mode)."""
    target, images, features = config.target, config.images, config.features
    flat = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in ("mode", "target", "images", "features", "train_split", "show_progress")
    }
    return flat | {
        "epsilon": target.epsilon,
        "delta": target.delta,
        "accountant": target.accountant,
        "sampling": target.sampling,
        "model": images.model,
        "backbone": images.backbone,
        "augmult": images.augmult,
        "augment_pad": images.augment_pad,
        "augment_flip": images.augment_flip,
        "feature_normalization": features.normalization,
        "feature_mean_noise_multiplier": features.mean_noise_multiplier,
        "feature_scale": features.scale,
    }


def with_options(config: TrainingConfig, **options: Any) -> TrainingConfig:
    """``config`` with some flat options replaced (``with_options(c, augmult=4)``), checked as a new config.

    How a sweep varies any training option by its flag's name without knowing where it is nested.
    """
    unknown = sorted(set(options) - set(options_of(TrainingConfig())))
    _check(not unknown, f"not training options: {unknown}")
    changed = training_config(config.mode, **(options_of(config) | options))
    return dataclasses.replace(changed, train_split=config.train_split, show_progress=config.show_progress)
