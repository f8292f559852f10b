"""The export-backbone command: a finished image training run -> a backbone directory.

``run(config)`` writes the run's EMA (or last) parameters with the preprocessing the
run trained with, as a backbone that ``featurize --backbone DIR`` and ``train
--backbone DIR`` accept (``models.pretrained``). This is how the paper's path is
walked without downloaded weights: train on public data, export, featurize the
private data with the export, train the last layer with DP.

A run above a cut (activations mode) trained only the top: its export is the top joined
to the frozen part below the cut (``models.cuts.join``), the backbone's own weights there,
unchanged, with the preprocessing its activations were cached with, so the exported
network computes from images what the run's top computed from the cached activations.

Privacy: the exported weights are a function of the run's output only, so exporting a
DP run is post-processing and costs no privacy; the backbone inherits the run's
(epsilon, delta) for the data it was trained on. A non-private run (``epsilon=inf``)
carries NO guarantee for its training data: export only runs on data that is public
(or that you may disclose); the result says which it was, and the metadata's
``source`` records it. Above a cut, the layers below it were never trained on the run's
data: ``source`` names the backbone they come from and that backbone's own source.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal

import jax
import jax.numpy as jnp

from dpscale import files
from dpscale.data.dataset import IngestedDataset
from dpscale.data.image_data import PIXEL_MEAN, PIXEL_STD
from dpscale.errors import DataError, InvalidConfigError, storage_faults
from dpscale.models import pretrained
from dpscale.training.release import SIMULATION_NOTE
from dpscale.training.run_directory import CHECKPOINTS, RunDirectory, RunSpec


@dataclasses.dataclass(frozen=True)
class ExportBackboneConfig:
    run_dir: str
    output_dir: str
    parameters: Literal["ema", "last"] = "ema"
    force: bool = False  # replace a backbone already in output_dir

    def __post_init__(self) -> None:
        if self.parameters not in ("ema", "last"):
            raise InvalidConfigError(f"parameters must be 'ema' or 'last', got {self.parameters!r}")


@dataclasses.dataclass(frozen=True)
class ExportBackboneResult:
    output_dir: str
    metadata: pretrained.BackboneMetadata
    parameters: str
    private: bool  # False: the weights carry no privacy guarantee for the run's data
    epsilon: float  # the run's epsilon spent (inf if non-private)
    delta: float


def _model_and_preprocessing(spec: RunSpec) -> tuple[str, int, pretrained.Preprocessing]:
    """The model name, its number of classes and the preprocessing the run trained with."""
    dataset = IngestedDataset(spec.data_path())
    num_classes = dataset.num_classes
    settings = spec.training.images
    if settings.backbone:  # a fine-tuned backbone keeps the backbone's own preprocessing
        meta = pretrained.read_metadata(pretrained.resolve_backbone(settings.backbone))
        return meta.model, num_classes, meta.preprocessing
    height, width, channels = dataset.image_shape
    if height != width or channels not in (1, 3):
        raise DataError(
            f"the run trained on {height}x{width}x{channels} images; a backbone "
            "needs square images with 1 or 3 channels"
        )
    # data.image_data.normalize is (x - PIXEL_MEAN) / PIXEL_STD, at the data's own size
    prep = pretrained.Preprocessing(resolution=height, mean=(PIXEL_MEAN,) * channels, std=(PIXEL_STD,) * channels)
    return settings.model, num_classes, prep


def _joined_above_cut(spec: RunSpec, params: Any, state: Any) -> tuple[str, int, pretrained.Preprocessing, Any, str]:
    """A top trained above a cut, joined to the frozen part below it (``models.cuts.join``): the model's
    name, its classes, the preprocessing the cached activations were made with, its variables, and what
    ``source`` says of the layers below the cut."""
    from dpscale.cache.feature_store import open_features
    from dpscale.models import cuts
    from dpscale.training.model import cut_top, feature_inputs

    data = spec.data_path()
    store = open_features(data)
    recorded = spec.inputs.get("feature_key")
    if recorded is not None and recorded != feature_inputs(store)["feature_key"]:
        raise DataError(f"the cache entry {data!r} is not the one the run trained on (another key)")
    key = store.key
    sides = cut_top(store, spec.inputs.get("top"))
    model, variables, meta, top_name = sides.backbone, sides.variables, sides.metadata, sides.name
    name = cuts.joined_model_name(key.model, model, top_name)
    whole = pretrained.build_model(name, num_classes=store.num_classes)
    joined = cuts.join(model, key.cut, sides.top, whole=whole, variables=variables, params=params, state=state)
    prep = pretrained.Preprocessing(resolution=key.resolution, mean=key.mean, std=key.std)
    resize = (
        f"; its activations were resized with {key.resize_method!r}: featurize with --resize-method "
        f"{key.resize_method} to match them"
        if key.resize_method != "bilinear"
        else ""
    )
    below = (
        f"; above the cut {key.cut!r}: the run's top {top_name!r}; below it: the pretrained backbone's own layers, "
        f"unchanged, never trained on the run's data, so what is said above of that data holds for the whole network "
        f"({key.model}, weights sha256 {key.weights_sha256}; its own source: {meta.source or 'not recorded'}){resize}"
    )
    return name, store.num_classes, prep, joined, below


def _check_fits(name: str, num_classes: int, prep: pretrained.Preprocessing, variables: Any) -> None:
    model = pretrained.build_model(name, num_classes=num_classes)
    shape = (1, prep.resolution, prep.resolution, len(prep.mean))
    abstract = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct(shape, jnp.float32))
    expected = jax.tree.map(lambda a: tuple(a.shape), abstract)
    found = jax.tree.map(lambda a: tuple(a.shape), variables)
    if expected != found:
        raise DataError(f"the run's parameters do not fit model {name!r} with {num_classes} classes")


def _progress(run_dir: RunDirectory, planned: int) -> str:
    """How far an unfinished run got: its newest complete checkpoint, where a resume continues (the
    ledger may lag it by one checkpoint in a run that an older dpscale saved)."""
    if not os.path.isdir(run_dir.file(CHECKPOINTS)):
        return f"no checkpoint yet of {planned} steps"
    checkpoints = run_dir.checkpoints(every=1)
    try:
        latest = checkpoints.latest_step()
    finally:
        checkpoints.close()
    return (
        f"its last checkpoint is at step {latest} of {planned}" if latest else f"no checkpoint yet of {planned} steps"
    )


def run(config: ExportBackboneConfig) -> ExportBackboneResult:
    """Export the parameters of the finished image (or above-a-cut) run ``config.run_dir`` as a backbone."""
    if not config.force and files.exists(files.join(config.output_dir, pretrained.METADATA_FILE)):  # before any work
        raise DataError(
            f"{config.output_dir!r} already holds a backbone: add --force to replace it, or export into another "
            "directory"
        )
    run_dir = RunDirectory.existing(config.run_dir)
    if run_dir.simulated:
        raise DataError(
            f"{config.run_dir!r} is a TAN simulation (sweep --simulate-batch; {SIMULATION_NOTE}), not a "
            "private result: train the setting with `dpscale train` and export that run"
        )
    spec = run_dir.read_spec()
    if spec.training.mode == "features":
        raise DataError(
            f"{config.run_dir!r} is a features-mode run: it holds only a classifier "
            "over cached features, not an image backbone"
        )
    ledger = run_dir.read_ledger()
    if not ledger.finished or not run_dir.has_params:
        raise DataError(
            f"{config.run_dir!r} is not finished ({_progress(run_dir, ledger.planned_steps)}); "
            f"finish it with `dpscale train --resume {config.run_dir}` first"
        )
    trained = run_dir.load_params()
    params = trained["ema_params" if config.parameters == "ema" else "params"]
    state = trained.get("model_state") or {}
    if spec.training.mode == "activations":
        name, num_classes, prep, variables, below = _joined_above_cut(spec, params, state)
    else:
        name, num_classes, prep = _model_and_preprocessing(spec)
        variables, below = {"params": params, **state}, ""
    _check_fits(name, num_classes, prep, variables)
    epsilon = ledger.epsilon_spent if ledger.private else math.inf
    guarantee = (
        f"({epsilon:.4g}, {ledger.delta:g})-DP for its training data"
        if ledger.private
        else "NON-PRIVATE: no guarantee for its training data"
    )
    source = f"dpscale run {run_dir.path}: {config.parameters} parameters after {ledger.steps_done} steps; {guarantee}{below}"
    with storage_faults(path=config.output_dir, stopped="the backbone was not exported", then="export it again"):
        metadata = pretrained.save_pretrained(
            config.output_dir,
            variables,
            model=name,
            num_classes=num_classes,
            preprocessing=prep,
            source=source,
            force=config.force,
        )
    return ExportBackboneResult(config.output_dir, metadata, config.parameters, ledger.private, epsilon, ledger.delta)
