"""The quickstart stage: ingest -> calibrate -> train -> evaluate, offline, in minutes.

The default data is scikit-learn's bundled 8x8 ``digits`` set, so it runs on a
fresh machine with no download. ``data`` takes any ingest source
(``folder:PATH``, ``idx:DIR``, ``tfds:NAME``). Ingested data is reused when the
work directory already holds the same source; every run gets its own run
directory, so nothing earlier is overwritten.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from dpscale.errors import DpscaleError
from dpscale.stages import evaluate, ingest, train
from dpscale.stages.dataset import IngestedDataset


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    data: str = "digits"
    work_dir: str = "dpscale-quickstart"
    model: str = "cnn-small"
    epsilon: float = 8.0
    delta: float = 1e-5
    batch_size: int = 256
    steps: int = 100
    learning_rate: float = 2.0
    augmult: int = 1
    augment_flip: bool = False  # digits and other glyphs are not mirror-symmetric
    microbatch_size: int = 128
    seed: int | None = None
    show_progress: bool = True


def _ingested(config: QuickstartConfig) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in config.data).strip("_")
    data_dir = os.path.join(config.work_dir, "data", safe)
    if os.path.exists(os.path.join(data_dir, "manifest.json")):
        try:
            if IngestedDataset(data_dir).manifest.get("source") == config.data:
                return data_dir
        except DpscaleError:  # an unreadable earlier attempt: ingest again below
            pass
    ingest.run(ingest.IngestConfig(source=config.data, output_dir=data_dir, overwrite=True))
    return data_dir


def run(config: QuickstartConfig) -> dict[str, Any]:
    started = time.perf_counter()
    data_dir = _ingested(config)
    run_dir = os.path.join(config.work_dir, "runs", time.strftime("%Y%m%d-%H%M%S"))
    suffix = 0
    while os.path.exists(run_dir + (f"-{suffix}" if suffix else "")):
        suffix += 1
    run_dir += f"-{suffix}" if suffix else ""
    trained = train.run(
        train.TrainConfig(
            data=data_dir,
            run_dir=run_dir,
            model=config.model,
            epsilon=config.epsilon,
            delta=config.delta,
            batch_size=config.batch_size,
            steps=config.steps,
            learning_rate=config.learning_rate,
            augmult=config.augmult,
            augment_pad=1 if IngestedDataset(data_dir).image_shape[0] <= 16 else 4,
            augment_flip=config.augment_flip,
            microbatch_size=config.microbatch_size,
            seed=config.seed,
            show_progress=config.show_progress,
        )
    )
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir))
    return {
        "data": config.data,
        "model": config.model,
        "epsilon": trained.epsilon,
        "delta": trained.delta,
        "noise_multiplier": trained.noise_multiplier,
        "batch_size": trained.batch_size,
        "steps": trained.steps,
        "test_accuracy": scores.ema_top1,
        "test_accuracy_last": scores.top1,
        "test_examples": scores.num_examples,
        "run_dir": os.path.abspath(run_dir),
        "seconds": round(time.perf_counter() - started, 1),
    }
