"""The files of one training run directory: the only code that reads or writes them.

    run_dir/config.json     what the run is: its data, its ``TrainingConfig`` and its ``PrivacyPlan``
    run_dir/seed.json       secrets (mode 0600): the seed, and a keyed identity of the data, so a
                            killed run can resume exactly; deleted when the run completes
    run_dir/ledger.json     the privacy ledger (``privacy.plan.Ledger``): sigma, q, T, epsilon spent
    run_dir/metrics.jsonl   per optimiser step, what epsilon covers (``training.release``)
    run_dir/diagnostics.NOT-PRIVATE.jsonl   per step, private diagnostics (only if asked for; 0600)
    run_dir/checkpoints/    orbax checkpoints of the whole ``TrainState`` (newest two)
    run_dir/params/         orbax checkpoint: params, EMA params, frozen model state (a finished run)
    run_dir/metrics.json    the last evaluation's scores on a split outside the private training data
    run_dir/metrics.<split>.NOT-PRIVATE.json   scores on the private training rows (0600)

JSON files are written to a temporary name and renamed, so a crash never leaves a
half-written ledger. A directory that already holds a run is never overwritten.

Why checkpoints hold everything and the seed is kept: the noise key and the Poisson sample
of step t are pure functions of (seed, t), so a resumed run continues the *same* noise
stream at step t rather than restarting it. Steps done after the last checkpoint but before
a crash are recomputed on resume with the same batch and the same noise key, i.e. bit for
bit the same computation: the crashed attempt's outputs were never saved, and the redo
releases nothing new, so the total privacy spent is exactly the planned T steps. Drawing
*fresh* noise for a redone step would instead be a second release of that step. Orbax
writes each checkpoint to a temporary directory and renames it when complete, so a kill -9
during a save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from dpscale.errors import DataError, DpscaleError
from dpscale.privacy.plan import Ledger, PrivacyPlan
from dpscale.training.config import TrainingConfig
from dpscale.training.release import DIAGNOSTICS_FILE, diagnostic_name

CONFIG = "config.json"
SEED_FILE = "seed.json"
LEDGER = "ledger.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
PARAMS = "params"
SCORES = "metrics.json"
T = TypeVar("T")


def write_json_atomic(path: str, payload: Any, *, mode: int = 0o644) -> None:
    """Write JSON to ``path`` through a temporary file and a rename (never half a file)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What ``config.json`` holds: everything needed to rebuild the run (but the seed)."""

    data: str
    training: TrainingConfig
    plan: PrivacyPlan

    def to_json(self) -> dict[str, Any]:
        return {"data": self.data, "training": self.training.to_json(), "plan": dataclasses.asdict(self.plan)}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> RunSpec:
        return cls(data=str(payload["data"]), training=TrainingConfig.from_json(payload["training"]),
                   plan=PrivacyPlan(**payload["plan"]))


@dataclasses.dataclass(frozen=True)
class RunSecrets:
    """What only the machine that trains may know (``seed.json``, mode 0600).

    ``data_identity`` is a keyed hash of the data (keyed with the seed itself), so a resume can
    refuse data that changed since the start, even with the same number of rows, without any
    released file carrying a hash of the private data.
    """

    seed: int
    data_identity: str


class Checkpoints:
    """Save every ``every`` steps (and at the end); keep the newest two."""

    def __init__(self, directory: str, *, every: int) -> None:
        self.every = max(1, every)
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(directory, options=options)

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


@dataclasses.dataclass(frozen=True)
class RunDirectory:
    path: str

    @classmethod
    def create(cls, path: str) -> RunDirectory:
        """A new run directory; refuses one that already holds a run."""
        path = os.path.abspath(path)
        if os.path.exists(os.path.join(path, CONFIG)):
            raise DataError(f"{path!r} already holds a run; choose a new run directory")
        os.makedirs(path, exist_ok=True)
        return cls(path)

    @classmethod
    def existing(cls, path: str) -> RunDirectory:
        path = os.path.abspath(path)
        if not os.path.isfile(os.path.join(path, CONFIG)):
            raise DataError(f"{path!r} is not a run directory (no {CONFIG})")
        return cls(path)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    # -- what the run is ------------------------------------------------------------------

    def write_spec(self, spec: RunSpec) -> None:
        write_json_atomic(self.file(CONFIG), spec.to_json())

    def _read(self, name: str, parse: Callable[[Any], T], *, hint: str = "") -> T:
        """``parse`` of the JSON file ``name``; one ``DataError`` line if it is missing or malformed."""
        try:
            with open(self.file(name)) as f:
                return parse(json.load(f))
        except (OSError, ValueError, KeyError, TypeError, DpscaleError) as exc:
            raise DataError(f"{self.path!r}: unreadable {name} ({exc}){hint}") from None

    def read_spec(self) -> RunSpec:
        return self._read(CONFIG, RunSpec.from_json)

    def write_secrets(self, secrets: RunSecrets) -> None:
        write_json_atomic(self.file(SEED_FILE), dataclasses.asdict(secrets), mode=0o600)

    def read_secrets(self) -> RunSecrets:
        if not os.path.exists(self.file(SEED_FILE)) and self.has_params:
            raise DataError(f"{self.path!r} is a finished run: there is nothing to resume")
        return self._read(SEED_FILE, lambda payload: RunSecrets(**payload), hint="; cannot resume this run")

    def delete_secrets(self) -> None:
        """A finished run needs no resume: its seed would only let a copy of the run replay the noise."""
        if os.path.exists(self.file(SEED_FILE)):
            os.remove(self.file(SEED_FILE))

    # -- what it has spent and done --------------------------------------------------------

    def write_ledger(self, ledger: Ledger) -> None:
        write_json_atomic(self.file(LEDGER), ledger.to_json())

    def read_ledger(self) -> Ledger:
        return self._read(LEDGER, Ledger.from_json)

    def append_metrics(self, metrics: dict[str, Any], *, diagnostic: bool = False) -> None:
        """One step's covered metrics (``metrics.jsonl``), or its private diagnostics (0600)."""
        name = DIAGNOSTICS_FILE if diagnostic else METRICS
        fd = os.open(self.file(name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600 if diagnostic else 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(metrics, sort_keys=True) + "\n")

    def read_metrics(self, *, diagnostic: bool = False) -> list[dict[str, Any]]:
        """Every logged step's metrics, in order (a line cut short by a crash is skipped)."""
        name = DIAGNOSTICS_FILE if diagnostic else METRICS
        if not os.path.exists(self.file(name)):
            return []
        records = []
        with open(self.file(name)) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
        return records

    def truncate_metrics(self, *, after_step: int) -> None:
        """Drop metric and diagnostic lines past ``after_step`` (and a line cut short by a crash)."""
        for diagnostic, name in ((False, METRICS), (True, DIAGNOSTICS_FILE)):
            if not os.path.exists(self.file(name)):
                continue
            kept = [json.dumps(r, sort_keys=True) + "\n" for r in self.read_metrics(diagnostic=diagnostic)
                    if r.get("step", 0) <= after_step]
            fd = os.open(self.file(name) + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                         0o600 if diagnostic else 0o644)
            with os.fdopen(fd, "w") as f:
                f.writelines(kept)
            os.replace(self.file(name) + ".tmp", self.file(name))

    def checkpoints(self, *, every: int) -> Checkpoints:
        return Checkpoints(self.file(CHECKPOINTS), every=every)

    # -- what it produced --------------------------------------------------------------------

    @property
    def has_params(self) -> bool:
        return os.path.isdir(self.file(PARAMS))

    def save_params(self, **trees: Any) -> None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(self.file(PARAMS), trees, force=True)

    def load_params(self) -> dict[str, Any]:
        """The saved trees, on this process's first device.

        Orbax would otherwise restore onto the devices the run saved from, which do
        not exist when evaluating a multi-device or multi-host run elsewhere.
        """
        if not self.has_params:
            raise DataError(f"{self.path!r} has no saved parameters ({PARAMS}/)")
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        with ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.metadata(self.file(PARAMS)).item_metadata.tree
            target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
            return checkpointer.restore(self.file(PARAMS), target)

    def scores_file(self, split: str, *, diagnostic: bool) -> str:
        """``metrics.json``, or for scores on private training rows ``metrics.<split>.NOT-PRIVATE.json``."""
        return diagnostic_name(f"metrics.{split}.json") if diagnostic else SCORES

    def write_scores(self, scores: dict[str, Any], *, diagnostic: bool = False) -> str:
        name = self.scores_file(scores["split"], diagnostic=diagnostic)
        write_json_atomic(self.file(name), scores, mode=0o600 if diagnostic else 0o644)
        return self.file(name)

    def read_scores(self, split: str = "test", *, diagnostic: bool = False) -> dict[str, Any] | None:
        """The last evaluation's scores (on ``split`` if ``diagnostic``), or None if not evaluated."""
        try:
            with open(self.file(self.scores_file(split, diagnostic=diagnostic))) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
