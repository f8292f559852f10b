"""The quickstart command: the paper's whole path, offline, in minutes on 2 CPU cores.

De et al. (2022) pre-train on public data, then fine-tune with DP on the private data.
The quickstart does the same on one source split by class (scikit-learn's bundled 8x8
``digits`` by default: classes 0-4 public, 5-9 private), with no downloaded weights:

1. ingest the public and the private classes (``IngestConfig.classes``);
2. dedup: drop public images that are near duplicates of any private image (train or
   test), so the pre-trained model has not seen the private data;
3. pre-train a network (``pretrain``: ``cnn-small``) on the public classes, non-private
   (``epsilon=inf``, momentum allowed: no privacy is claimed for public data);
4. export its EMA parameters as a backbone (``stages.export_backbone``);
5. featurize the private train and test images with it into a Zarr cache;
6. train the last layer on the private features with DP-SGD (``private``: noise calibrated
   to its epsilon and delta) and evaluate it on the private test split.

Only step 6 touches the private labels under DP; the (epsilon, delta) reported is that
run's. ``data`` takes any ingest source (``folder:PATH``, ``idx:DIR``, ``tfds:NAME``)
with at least 4 classes; ``public_classes`` defaults to the first half of its classes.
A source without a test (or validation) split gets a 20% validation split to test on.
Work is reused on a re-run in the same ``work_dir``: ingested and deduplicated data
when their inputs match, the backbone when the public data and pre-training settings
match (then the features are a cache hit too); every run gets its own run directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any

from dpscale import files
from dpscale.data.dataset import IngestedDataset
from dpscale.data.identity import keyed_identity
from dpscale.data.key_store import directory_secret
from dpscale.data.sources import parse_source, plan_source
from dpscale.errors import DataError, DpscaleError, InvalidConfigError
from dpscale.models import pretrained
from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import dedup, evaluate, export_backbone, featurize, ingest, train
from dpscale.training import release
from dpscale.training.config import ImageSettings, TrainingConfig

log = logging.getLogger(__name__)
_VALIDATION_FRACTION = 0.2  # carved from train when the source has no held-out split
_PRETRAIN_FILE = "quickstart_pretrain.json"

#: Non-private pre-training on the public classes (digits are not mirror-symmetric: no flips).
PRETRAIN = TrainingConfig(
    mode="images",
    target=PrivacyTarget(epsilon=math.inf),
    batch_size=128,
    steps=200,
    learning_rate=0.01,
    momentum=0.9,
    microbatch_size=128,
    images=ImageSettings(model="cnn-small", augmult=1, augment_flip=False),
)
#: DP training of the last layer on the private classes' features.
PRIVATE = TrainingConfig(
    mode="features", target=PrivacyTarget(epsilon=8.0, delta=1e-5), batch_size=512, steps=1000, learning_rate=0.5
)
#: The two learning rates above were chosen on held-out rows of the bundled digits' private training split
#: (benchmarks/results/quickstart.md): on those digits epsilon covers the run, not that choice, and the
#: result says so. On any other data they are a fixed choice that has not seen it.
TUNED_ON = "digits"
TUNED_WARNING = (
    "the default learning rates were chosen on held-out private training rows of these digits "
    "(benchmarks/results/quickstart.md): epsilon covers this run, not that choice"
)


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    data: str = "digits"
    work_dir: str = "dpscale-quickstart"
    public_classes: tuple[str, ...] = ()  # () = the first half of the source's classes
    dedup: bool = True
    pretrain: TrainingConfig = PRETRAIN
    private: TrainingConfig = PRIVATE
    # Report how many public images dedup removed: a count that depends on the private data and
    # that epsilon does not cover (training.release); off by default.
    private_diagnostics: bool = False
    verbose: bool = False  # Beam's own logging on stderr in ingest, dedup and featurize (else in a log file)

    def __post_init__(self) -> None:
        if not self.private.private:
            raise InvalidConfigError("the quickstart trains the private data with DP: give a finite epsilon")
        if self.private.mode != "features" or self.pretrain.mode != "images":
            raise InvalidConfigError(
                "the quickstart pre-trains on images and trains the private last layer on features"
            )
        if self.pretrain.batch_size is None or self.pretrain.steps is None:
            raise InvalidConfigError("the quickstart's pre-training needs a batch size and a number of steps")

    @classmethod
    def from_options(
        cls,
        *,
        data: str,
        work_dir: str,
        public_classes: tuple[str, ...],
        dedup: bool,
        private_diagnostics: bool,
        model: str,
        pretrain_steps: int,
        pretrain_batch_size: int,
        pretrain_learning_rate: float,
        epsilon: float,
        delta: float,
        batch_size: int,
        steps: int,
        learning_rate: float,
        seed: int | None,
        verbose: bool = False,
    ) -> QuickstartConfig:
        """A quickstart from flat options: ``model`` and ``pretrain_*`` change ``PRETRAIN``, the privacy
        target and the other knobs change ``PRIVATE``, and ``seed`` (debugging only) fixes both runs."""
        pretrain = dataclasses.replace(
            PRETRAIN,
            steps=pretrain_steps,
            batch_size=pretrain_batch_size,
            learning_rate=pretrain_learning_rate,
            seed=seed,
            images=dataclasses.replace(PRETRAIN.images, model=model),
        )
        private = dataclasses.replace(
            PRIVATE,
            target=PrivacyTarget(epsilon=epsilon, delta=delta),
            batch_size=batch_size,
            steps=steps,
            learning_rate=learning_rate,
            seed=seed,
        )
        return cls(
            data=data,
            work_dir=work_dir,
            public_classes=public_classes,
            dedup=dedup,
            pretrain=pretrain,
            private=private,
            private_diagnostics=private_diagnostics,
            verbose=verbose,
        )


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def _keyed_name(config: QuickstartConfig, payload: Any) -> str:
    """A folder name for outputs of ``payload`` (which holds data-dependent values): keyed, never a plain hash.

    A plain hash of the deduplicated data would let anyone with the public data test which
    images dedup removed (so which private images exist); the HMAC under the work directory's
    secret (in the user's key store) tells them nothing.
    """
    return keyed_identity(directory_secret(config.work_dir), json.dumps(payload, sort_keys=True))[:16]


def _split_classes(config: QuickstartConfig, names: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(public, private) class names, each in the source's order."""
    if config.public_classes:
        unknown = sorted(set(config.public_classes) - set(names))
        if unknown:
            raise DataError(f"public classes {unknown} are not classes of {config.data!r} ({', '.join(names)})")
        public = tuple(n for n in names if n in config.public_classes)
    else:
        public = names[: len(names) // 2]
    private = tuple(n for n in names if n not in public)
    if len(public) < 2 or len(private) < 2:
        raise DataError(
            f"the quickstart needs at least 2 public and 2 private classes; {config.data!r} "
            f"gives {len(public)} public and {len(private)} private of {len(names)}"
        )
    return public, private


def _ingested(config: QuickstartConfig, name: str, classes: tuple[str, ...], validation: float) -> str:
    """Ingest ``classes`` of the source into the work dir, or reuse an earlier identical ingest."""
    data_dir = files.join(config.work_dir, "data", f"{_safe(config.data)}-{name}")
    try:
        manifest = IngestedDataset(data_dir).manifest
        if (
            manifest.source == config.data
            and manifest.class_names == classes
            and manifest.validation_fraction == validation
        ):
            return data_dir
    except DpscaleError:  # nothing there yet, or an unreadable earlier attempt
        pass
    ingest.run(
        ingest.IngestConfig(
            source=config.data,
            output_dir=data_dir,
            classes=classes,
            validation_fraction=validation,
            overwrite=True,
            verbose=config.verbose,
        )
    )
    return data_dir


def _deduplicated(config: QuickstartConfig, public: str, private: str) -> tuple[str, int]:
    """``public`` minus near duplicates of ``private`` (all splits), and how many went."""
    private_identity = keyed_identity(directory_secret(config.work_dir), IngestedDataset(private).content_hash)
    hashes = {"public": IngestedDataset(public).content_hash, "private": private_identity}
    out = files.join(config.work_dir, "data", f"dedup-{_keyed_name(config, hashes)}")
    try:
        provenance = IngestedDataset(out).manifest.dedup
        if provenance is not None and provenance.public_content_hash == hashes["public"]:
            return out, provenance.num_removed
    except DpscaleError:
        pass
    result = dedup.run(dedup.DedupConfig(public, private, out, overwrite=True, verbose=config.verbose))
    return out, result.num_removed


def _pretrained_backbone(config: QuickstartConfig, public: str, runs: str) -> tuple[str, dict[str, Any]]:
    """Pre-train on ``public`` (non-private), export the backbone; reuse a matching earlier one."""
    dataset = IngestedDataset(public)
    training = dataclasses.replace(
        config.pretrain,
        checkpoint_every=config.pretrain.steps,  # minutes-long runs: a checkpoint at the end only
        images=dataclasses.replace(
            config.pretrain.images,
            augment_pad=1 if dataset.image_shape[0] <= 16 else config.pretrain.images.augment_pad,
        ),
    )
    settings = {"data": dataset.content_hash, "training": dataclasses.replace(training, show_progress=True).to_json()}
    backbone = files.join(
        config.work_dir, "backbones", f"{_safe(training.images.model)}-{_keyed_name(config, settings)}"
    )
    info_path = files.join(backbone, _PRETRAIN_FILE)
    if pretrained.is_complete(backbone):
        try:
            with files.open(info_path, "r") as f:
                return backbone, json.load(f) | {"reused": True}
        except (OSError, ValueError):  # not written (or cut short): pre-train again
            pass
    run_dir = files.join(runs, "pretrain")
    train.run(train.TrainConfig(data=public, run_dir=run_dir, training=training))
    split = "test" if "test" in dataset.splits else "validation"
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir, split=split))
    export_backbone.run(export_backbone.ExportBackboneConfig(run_dir, backbone, force=True))
    info = {"run_dir": files.absolute(run_dir), "public_test_accuracy": scores.ema_top1}
    with files.open(info_path, "w") as f:
        json.dump(info, f)
    return backbone, info | {"reused": False}


def _run_dir(config: QuickstartConfig) -> str:
    base = files.join(config.work_dir, "runs", time.strftime("%Y%m%d-%H%M%S"))
    suffix = 0
    while files.exists(base + (f"-{suffix}" if suffix else "")):
        suffix += 1
    path = base + (f"-{suffix}" if suffix else "")
    if files.is_url(path):  # an object store has no empty directories: the run's files will make it
        return path
    os.makedirs(path)
    return path


@dataclasses.dataclass(frozen=True)
class QuickstartResult:
    data: str
    model: str
    public_classes: list[str]
    private_classes: list[str]
    public_removed_by_dedup: int | None  # None: dedup skipped, or not asked for (a private diagnostic)
    public_test_accuracy: float
    pretrain_run_dir: str
    pretrain_reused: bool
    backbone: str
    features: str
    epsilon: float
    delta: float
    noise_multiplier: float
    batch_size: int
    steps: int
    test_split: str
    test_accuracy: float  # EMA parameters
    test_accuracy_last: float
    test_examples: int
    run_dir: str
    stage_seconds: dict[str, float]
    seconds: float
    warnings: tuple[str, ...] = ()


def run(config: QuickstartConfig) -> QuickstartResult:
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(stage: str, since: float) -> float:
        now = time.perf_counter()
        seconds[stage] = round(now - since, 1)
        log.info("quickstart: %s done in %.1f s", stage, now - since)
        return now

    plan = plan_source(parse_source(config.data))
    public_classes, private_classes = _split_classes(config, plan.class_names)
    held_out = "test" if "test" in plan.split_sizes else "validation"
    validation = 0.0 if held_out in plan.split_sizes else _VALIDATION_FRACTION
    log.info("quickstart: classes %s public, %s private", ",".join(public_classes), ",".join(private_classes))
    public = _ingested(config, "public", public_classes, validation)
    private = _ingested(config, "private", private_classes, validation)
    now = lap("ingest", started)
    removed = 0
    if config.dedup:
        public, removed = _deduplicated(config, public, private)
        now = lap("dedup", now)
    runs = _run_dir(config)
    backbone, pretrain = _pretrained_backbone(config, public, runs)
    now = lap("pretrain", now)
    features = featurize.run(
        featurize.FeaturizeConfig(
            data=private, backbone=backbone, cache_dir=files.join(config.work_dir, "cache"), verbose=config.verbose
        )
    )
    now = lap("featurize", now)
    run_dir = files.join(runs, "private")
    private = config.private
    if private.microbatch_size is None and private.batch_size is not None:  # one micro-batch per step, as a rule
        private = dataclasses.replace(private, microbatch_size=64 * math.ceil(1.25 * private.batch_size / 64))
    trained = train.run(
        train.TrainConfig(
            data=features.path,
            run_dir=run_dir,
            training=dataclasses.replace(private, checkpoint_every=private.checkpoint_every or private.steps),
        )
    )
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir, split=held_out))
    lap("private training", now)
    return QuickstartResult(
        data=config.data,
        model=config.pretrain.images.model,
        public_classes=list(public_classes),
        private_classes=list(private_classes),
        public_removed_by_dedup=removed if config.dedup and config.private_diagnostics else None,
        public_test_accuracy=pretrain["public_test_accuracy"],
        pretrain_run_dir=pretrain["run_dir"],
        pretrain_reused=pretrain["reused"],
        backbone=files.absolute(backbone),
        features=files.absolute(features.path),
        epsilon=trained.epsilon,
        delta=trained.delta,
        noise_multiplier=trained.noise_multiplier,
        batch_size=trained.batch_size,
        steps=trained.steps,
        test_split=held_out,
        test_accuracy=scores.ema_top1,
        test_accuracy_last=scores.top1,
        test_examples=scores.num_examples,
        run_dir=files.absolute(run_dir),
        stage_seconds=seconds,
        seconds=round(time.perf_counter() - started, 1),
        warnings=trained.warnings
        + ((release.warning("public_removed_by_dedup"),) if config.dedup and config.private_diagnostics else ())
        + ((TUNED_WARNING,) if _tuned_on_this_data(config) else ()),
    )


def _tuned_on_this_data(config: QuickstartConfig) -> bool:
    """Whether the run uses the learning rates that were chosen on held-out rows of its own private data."""
    return (
        config.data == TUNED_ON
        and not config.public_classes
        and config.pretrain.learning_rate == PRETRAIN.learning_rate
        and config.private.learning_rate == PRIVATE.learning_rate
    )
