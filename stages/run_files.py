"""The files of one training run directory, written so that no work is lost.

    run_dir/config.json     resolved configuration (incl. calibrated hyper-parameters)
    run_dir/ledger.json     privacy ledger: accountant, sampling, q, sigma, T, epsilon spent
    run_dir/metrics.jsonl   one JSON object per optimiser step
    run_dir/params/         orbax checkpoint: params, EMA params, frozen model state

JSON files are written to a temporary name and renamed, so a crash never leaves a
half-written ledger. A directory that already holds a run is never overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dpscale.errors import DataError
from dpscale.privacy.accounting import DpsgdPrivacySpec

CONFIG = "config.json"
LEDGER = "ledger.json"
METRICS = "metrics.jsonl"
PARAMS = "params"


def write_json_atomic(path: str, payload: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class RunFiles:
    run_dir: str

    @classmethod
    def create(cls, run_dir: str) -> RunFiles:
        run_dir = os.path.abspath(run_dir)
        if os.path.exists(os.path.join(run_dir, CONFIG)):
            raise DataError(f"{run_dir!r} already holds a run; choose a new run directory")
        os.makedirs(run_dir, exist_ok=True)
        return cls(run_dir)

    @classmethod
    def existing(cls, run_dir: str) -> RunFiles:
        run_dir = os.path.abspath(run_dir)
        if not os.path.isfile(os.path.join(run_dir, CONFIG)):
            raise DataError(f"{run_dir!r} is not a run directory (no {CONFIG})")
        return cls(run_dir)

    def path(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def write_config(self, config: dict[str, Any]) -> None:
        write_json_atomic(self.path(CONFIG), config)

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.path(METRICS), "a") as f:
            f.write(json.dumps(metrics, sort_keys=True) + "\n")

    def truncate_metrics(self, *, after_step: int) -> None:
        """Drop metric lines past ``after_step`` (and a line cut short by a crash)."""
        if not os.path.exists(self.path(METRICS)):
            return
        kept = []
        with open(self.path(METRICS)) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("step", 0) <= after_step:
                    kept.append(json.dumps(record, sort_keys=True) + "\n")
        with open(self.path(METRICS) + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path(METRICS) + ".tmp", self.path(METRICS))

    def write_ledger(
        self,
        *,
        accounting_spec: DpsgdPrivacySpec | None,
        delta: float,
        accountant: str,
        epsilon_spent: float,
        steps_done: int,
        planned_steps: int,
        data_hash: str,
    ) -> None:
        """The privacy ledger; ``accounting_spec`` None means a non-private run."""
        spec = accounting_spec
        write_json_atomic(
            self.path(LEDGER),
            {
                "private": spec is not None,
                "accountant": accountant,
                "neighboring_relation": "add_or_remove_one",
                "sampling": None if spec is None else spec.sampling,
                "exact_accounting": spec is not None and spec.exact,
                "sampling_rate": None if spec is None else spec.sampling_rate,
                "noise_multiplier": 0.0 if spec is None else spec.noise_multiplier,
                # One-off Gaussian releases (sensitivity 1) composed into epsilon_spent, e.g. a DP feature mean.
                "releases": [] if spec is None else list(spec.releases),
                "planned_steps": planned_steps,
                "steps_done": steps_done,
                "delta": delta,
                "epsilon_spent": "inf" if math.isinf(epsilon_spent) else epsilon_spent,
                "data_content_hash": data_hash,
            },
        )

    def save_params(self, **trees: Any) -> None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(self.path(PARAMS), trees, force=True)

    def load_params(self) -> dict[str, Any]:
        """The saved trees, on this process's first device.

        Orbax would otherwise restore onto the devices the run saved from, which do
        not exist when evaluating a multi-device or multi-host run elsewhere.
        """
        if not os.path.isdir(self.path(PARAMS)):
            raise DataError(f"{self.run_dir!r} has no saved parameters ({PARAMS}/)")
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        with ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.metadata(self.path(PARAMS)).item_metadata.tree
            target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
            return checkpointer.restore(self.path(PARAMS), target)


class _Bar:
    def __init__(self, progress: Progress | None, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self, *, epsilon: float | None = None, loss: float | None = None) -> None:
        if self._progress is None:
            return
        fields = {}
        if epsilon is not None:
            fields["epsilon"] = f"eps {epsilon:.3f}"
        if loss is not None:
            fields["loss"] = f"loss {loss:.3f}"
        self._progress.update(self._task, advance=1, **fields)


@contextlib.contextmanager
def progress(*, total: int, enabled: bool, completed: int = 0) -> Iterator[_Bar]:
    """A progress bar over optimiser steps showing epsilon spent and the loss."""
    if not enabled:
        yield _Bar(None, None)
        return
    columns = (
        TextColumn("train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[epsilon]}"),
        TextColumn("{task.fields[loss]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=total, completed=completed, epsilon="", loss="")
        yield _Bar(bar, task)
