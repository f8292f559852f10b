"""Orbax checkpoints of a training run, so that a killed run can continue exactly.

A checkpoint holds the whole ``TrainState`` (parameters, EMA parameters,
optimiser state, frozen model state, step). The run's secret seed is kept in
``run_dir/seed.json`` (mode 0600), written before the first step: the noise key
and the Poisson sample of step t are pure functions of (seed, t), so a resumed
run continues the *same* noise stream at step t rather than restarting it.

Steps done after the last checkpoint but before a crash are recomputed on
resume with the same batch and the same noise key, i.e. bit-for-bit the same
computation: the crashed attempt's outputs were never saved, and the redo
releases nothing new, so the total privacy spent is exactly the planned T steps.
Drawing *fresh* noise for a redone step would instead be a second release of
that step. Orbax writes each checkpoint to a temporary directory and renames it
when complete, so a kill -9 during a save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
from typing import Any

import orbax.checkpoint as ocp

from dpscale.errors import DataError

CHECKPOINTS = "checkpoints"
SEED_FILE = "seed.json"


def write_seed(run_dir: str, seed: int) -> None:
    path = os.path.join(run_dir, SEED_FILE)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"seed": seed}, f)
    os.replace(path + ".tmp", path)


def read_seed(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, SEED_FILE)) as f:
            return int(json.load(f)["seed"])
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{run_dir!r} has no readable {SEED_FILE}; cannot resume this run") from exc


class Checkpoints:
    """Save every ``every`` steps (and at the end); keep the newest two."""

    def __init__(self, run_dir: str, *, every: int) -> None:
        self.every = max(1, every)
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(os.path.join(os.path.abspath(run_dir), CHECKPOINTS), options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int, total: int) -> bool:
        return step == total or step % self.every == 0

    def save(self, step: int, state: Any) -> None:
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> Any:
        """Restore into the structure (and shardings) of ``like``."""
        return self._manager.restore(step, args=ocp.args.StandardRestore(like))

    def close(self) -> None:
        self._manager.close()
