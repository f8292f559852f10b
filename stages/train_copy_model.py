"""The train-copy-model stage: a copy embedding for ``dedup --copy-model``, from PUBLIC images only.

``run(config)`` reads the chosen splits of an ingested public dataset, trains
``dedup.copy_model`` on them (no labels, no private data: the weights are public data) and
writes the model with what it was trained on (dataset path and content hash, splits,
settings, time, and the id of every training image, by which dedup refuses a model that saw
private images). Train once per public set; every dedup of a private set against it reuses
the model. An interrupted run resumes from its last finished epoch. The training images are
held as 32x32 thumbnails (3 KB each): a few hundred thousand public images fit in memory;
a billion-image public set would be sampled or streamed (not built).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

import numpy as np

from dpscale import files
from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import copy_model
from dpscale.dedup.planning import select_splits
from dpscale.errors import DataError, InvalidConfigError
from dpscale.progress import progress_bar

log = logging.getLogger(__name__)
WORK = "_train_work"  # the last finished epoch of an interrupted run, inside the output directory
READ_CHUNK = 5_000


@dataclasses.dataclass(frozen=True)
class TrainCopyModelConfig:
    public: str
    output_dir: str
    splits: tuple[str, ...] = ()  # empty: every split
    epochs: int = copy_model.TrainSettings.epochs
    batch: int = copy_model.TrainSettings.batch
    seed: int = copy_model.TrainSettings.seed
    overwrite: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        try:
            _ = self.settings  # checks the settings
        except ValueError as exc:
            raise InvalidConfigError(str(exc)) from None

    @property
    def settings(self) -> copy_model.TrainSettings:
        return copy_model.TrainSettings(epochs=self.epochs, batch=self.batch, seed=self.seed)


@dataclasses.dataclass(frozen=True)
class TrainCopyModelResult:
    output_dir: str
    info: dict


def run(config: TrainCopyModelConfig) -> TrainCopyModelResult:
    """Train the copy embedding on ``config.public`` and write it to ``config.output_dir``."""
    files.require_local(config.output_dir, "the copy model's directory")
    if os.path.isfile(os.path.join(config.output_dir, copy_model.WEIGHTS)) and not config.overwrite:
        raise DataError(f"{config.output_dir!r} already holds a copy model; pass --overwrite to replace it")
    if os.path.realpath(config.output_dir) == os.path.realpath(config.public):
        raise DataError("the copy model's output must be a different directory from the public dataset")
    public = IngestedDataset(config.public)
    splits = select_splits(public, config.splits)
    sizes = [public.num_examples(s) for s in splits]
    if sum(sizes) < config.batch:
        raise DataError(
            f"{config.public!r} ({','.join(splits)}) holds {sum(sizes)} images, fewer than "
            f"one training batch of {config.batch}; lower --batch"
        )
    start = time.perf_counter()
    # read and shrink a chunk at a time: only 32x32 thumbnails (3 KB each) are held for training
    images = np.concatenate(
        [
            copy_model.thumbnails(public.get(s, np.arange(lo, min(n, lo + READ_CHUNK)))[0])
            for s, n in zip(splits, sizes)
            for lo in range(0, n, READ_CHUNK)
        ]
    )
    work = os.path.join(config.output_dir, WORK)
    os.makedirs(work, exist_ok=True)
    log.info("train-copy-model: %d public images (%s), %d epochs", len(images), ",".join(splits), config.epochs)
    steps = config.epochs * (len(images) // config.batch)
    with progress_bar("copy model", total=steps, enabled=config.show_progress, fields=("loss",)) as bar:

        def progress(step: int, total: int, loss: float) -> None:
            bar.update(completed=step, loss=f"loss {loss:.3f}")

        try:
            params, info = copy_model.train(images, config.settings, progress=progress, work_dir=work)
        except FloatingPointError as exc:
            raise DataError(
                f"{exc}: try another --seed or a larger --batch; if it repeats, look at the "
                "public images (the ingest report lists what was rejected)"
            ) from None
    # what it saw, by example id: dedup refuses a model that saw private images (whatever their path)
    trained_on = np.concatenate([public.ids(s) for s in splits])
    info = {
        **info,
        "public": {"path": config.public, "content_hash": public.content_hash, "splits": list(splits)},
        "seconds": round(time.perf_counter() - start, 1),
    }
    copy_model.save(config.output_dir, params, info, trained_on)
    shutil.rmtree(work, ignore_errors=True)
    return TrainCopyModelResult(config.output_dir, info)
