"""The files of one training run directory: the only code that names them (the lock and the orbax
checkpoints are written by ``training.run_lock`` and ``training.checkpoints``, where it says).

    run_dir/config.json     what the run is: its data, its ``TrainingConfig``, its ``PrivacyPlan`` and what
                            its inputs are made of (feature mode: the backbone and preprocessing)
    run_dir/key.id          names the run's secrets in the user's key store (``data.key_store``, mode 0600):
                            the seed and a keyed identity of the data, so a killed run can resume
                            exactly; deleted when the run completes. Never in the run directory: a
                            copy of it carries no seed (which would reveal the noise)
    run_dir/ledger.json     the privacy ledger (``privacy.plan.Ledger``): sigma, q, T, epsilon spent
    run_dir/metrics.jsonl   per optimiser step, what epsilon covers (``training.release``)
    run_dir/diagnostics.NOT-PRIVATE.jsonl   per step, private diagnostics (only if asked for; 0600)
    run_dir/checkpoints/    orbax checkpoints of the whole ``TrainState`` (newest two)
    run_dir/params/         orbax checkpoint: params, EMA params, frozen model state (a finished run)
    run_dir/params.sha256.json   the sha256 of every file of params/ at save time: damage is one line
    run_dir/metrics.json    the last evaluation's scores on a split outside the private training data
    run_dir/metrics.<split>.NOT-PRIVATE.json   scores on the private training rows (0600)
    run_dir/metrics.other-data.<name>.json   scores on other data made like the run's (evaluate --force-other-data)
    run_dir/run.lock        flock'ed by the process training in the directory (released when it dies); on
                            gs:// an object created only if absent, naming the host and pid that hold it
    run_dir/simulation.NOT-PRIVATE.json   only in a TAN simulation (``sweep --simulate-batch``), from
                            before its first step: then every JSON file and line above says
                            ``"simulated": true`` (``training.release``), so none reads as a private result

A run directory is self-contained and relocatable: every file is found relative to the
directory the command names, never through a path stored inside it; the data (and a
pretrained backbone) are stored as absolute paths, so they resolve from any working
directory, and the keyed data identity says whether they are still the same data. A run is
written only after everything about it was validated, so a start that fails leaves no run
behind and the directory can be used again.

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

A run directory may be a URL (``gs://...``, through ``dpscale.files``; orbax writes its
checkpoints there itself). There, ``metrics.jsonl`` is rewritten whenever the ledger is (each
checkpoint), not at every step: an object cannot be appended to, and the lines of steps after
the last checkpoint are dropped on resume anyway.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from dpscale import files
from dpscale.data import key_store
from dpscale.errors import DataError, DpscaleError
from dpscale.files import open_for_writing, write_atomic, write_json_atomic
from dpscale.privacy.plan import Ledger, PrivacyPlan
from dpscale.training.checkpoints import Checkpoints, check_digests, restore_on_first_device, save_with_digests
from dpscale.training.config import TrainingConfig
from dpscale.training.release import DIAGNOSTICS_FILE, SIMULATED, SIMULATION_FILE, SIMULATION_NOTE, diagnostic_name
from dpscale.training.run_lock import RunLock

CONFIG = "config.json"
SEED_FILE = "seed.json"  # in the key store: <key id>.seed.json
LEDGER = "ledger.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
PARAMS = "params"
PARAMS_DIGESTS = "params.sha256.json"
SCORES = "metrics.json"
LOCK = "run.lock"
# How each layer is clipped and why (timings on random inputs of the device: nothing of the data).
CLIP_PATHS = "clip_paths.json"
T = TypeVar("T")
#: What every JSON file of a simulated run carries (its lines: ``SIMULATED`` only).
_STAMP = {SIMULATED: True, "simulation": f"{SIMULATION_NOTE}: a TAN simulation, see {SIMULATION_FILE}"}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What ``config.json`` holds: everything needed to rebuild the run (but the seed).

    ``inputs`` says what the run's inputs are made of besides the data itself (feature mode:
    the cache key's backbone and preprocessing parts), so evaluation on other data can refuse
    features that the classifier was not trained on.
    """

    data: str
    training: TrainingConfig
    plan: PrivacyPlan
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def new(cls, data: str, training: TrainingConfig, plan: PrivacyPlan, inputs: dict[str, Any]) -> RunSpec:
        """The spec of a new run, with its data (and a backbone directory) as absolute paths."""
        backbone = training.images.backbone
        if backbone and os.path.exists(backbone):
            training = dataclasses.replace(
                training, images=dataclasses.replace(training.images, backbone=files.absolute(backbone))
            )
        return cls(data=files.absolute(data), training=training, plan=plan, inputs=dict(inputs))

    def to_json(self) -> dict[str, Any]:
        return {
            "data": self.data,
            "training": self.training.to_json(),
            "plan": self.plan.to_json(),
            "inputs": self.inputs,
        }

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> RunSpec:
        unknown = sorted(set(payload) - {"data", "training", "plan", "inputs", *_STAMP})
        if unknown:
            raise DataError(f"unknown keys {unknown}")
        return cls(
            data=str(payload["data"]),
            training=TrainingConfig.from_json(payload["training"]),
            plan=PrivacyPlan(**payload["plan"]),
            inputs=dict(payload.get("inputs") or {}),
        )

    def data_path(self, override: str | None = None) -> str:
        """The data to read: ``override`` if given, else the run's own, which must still be there."""
        if override is not None:
            return override
        if "://" in self.data or os.path.exists(self.data):
            return self.data
        if not os.path.isabs(self.data):
            raise DataError(
                f"the run's data {self.data!r} is a relative path (stored by an older dpscale) and "
                f"does not exist from {os.getcwd()!r}: run the command from the directory the run "
                "was started in"
            )
        raise DataError(f"the run's data {self.data!r} does not exist (moved or deleted?)")


@dataclasses.dataclass(frozen=True)
class RunSecrets:
    """What only the user who trains may know (in the key store, mode 0600).

    ``data_identity`` is a keyed hash of the data (keyed with the seed itself), so a resume can
    refuse data that changed since the start, even with the same number of rows, without any
    released file carrying a hash of the private data.
    """

    seed: int
    data_identity: str
    # The versions that fix the noise of a step (``noise_versions``): a redone step's noise is the
    # crashed attempt's only under the same ones. {}: recorded before they were.
    versions: dict[str, str] = dataclasses.field(default_factory=dict)


def noise_versions() -> dict[str, str]:
    """The library versions a step's noise (and batch) depends on, bit for bit: jax and jaxlib (XLA)."""
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


@dataclasses.dataclass(frozen=True)
class RunDirectory:
    path: str
    # metric lines not yet written, by file name (URLs only: see the module docstring)
    _pending: dict[str, list[str]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # whether it is a simulation, once known (a run becomes one before its first step, never stops being one)
    _simulated: list[bool] = dataclasses.field(default_factory=list, compare=False, repr=False)

    @classmethod
    def new(cls, path: str) -> RunDirectory:
        """Where a new run will go (nothing is written yet); refuses a directory that holds a run."""
        run = cls(files.absolute(path))
        run._check_free()
        return run

    def _check_free(self) -> None:
        if files.exists(self.file(CONFIG)):
            raise DataError(f"{self.path!r} already holds a run; choose a new run directory")

    def begin(self, spec: RunSpec, secrets: RunSecrets) -> RunLock:
        """Create the run, locked (``lock``): its secrets, then ``config.json`` (what makes it a run)."""
        files.makedirs(self.path)
        lock = self.lock()
        try:
            self._check_free()  # again, under the lock: another start may have won the race
            self.write_secrets(secrets)
            write_json_atomic(self.file(CONFIG), self._stamped(spec.to_json()))
        except BaseException:
            lock.release()
            raise
        return lock

    @classmethod
    def existing(cls, path: str) -> RunDirectory:
        path = files.absolute(path)
        if not files.isfile(files.join(path, CONFIG)):
            raise DataError(f"{path!r} is not a run directory (no {CONFIG})")
        return cls(path)

    def lock(self) -> RunLock:
        """Hold the run for this process (``RunLock``); ``DataError`` if another one trains in it."""
        return RunLock(self.file(LOCK))

    def file(self, name: str) -> str:
        return files.join(self.path, name)

    # -- a simulation says so everywhere ---------------------------------------------------

    @property
    def simulated(self) -> bool:
        """Whether this run is a TAN simulation (``sweep --simulate-batch``): DP only at its own epsilon."""
        if not self._simulated:
            self._simulated.append(files.exists(self.file(SIMULATION_FILE)))
        return self._simulated[0]

    def mark_simulated(self, what: dict[str, Any]) -> None:
        """Make this a simulation of ``what`` (before its first step); a ledger already here is stamped again."""
        files.makedirs(self.path)
        if not files.exists(self.file(SIMULATION_FILE)):
            write_json_atomic(self.file(SIMULATION_FILE), what, private=True)
        self._simulated[:] = [True]
        if files.exists(self.file(LEDGER)) and SIMULATED not in json.loads(files.read_text(self.file(LEDGER))):
            self.write_ledger(self.read_ledger())

    def _stamped(self, payload: dict[str, Any], stamp: dict[str, Any] = _STAMP) -> dict[str, Any]:
        return payload | stamp if self.simulated else payload

    # -- what the run is ------------------------------------------------------------------

    def _read(self, name: str, parse: Callable[[Any], T], *, hint: str = "") -> T:
        """``parse`` of the JSON file ``name``; one ``DataError`` line if it is missing or malformed."""
        try:
            with files.open(self.file(name), "r") as f:
                return parse(json.load(f))
        except (OSError, ValueError, KeyError, TypeError, DpscaleError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise DataError(f"{self.path!r}: unreadable {name} ({reason}){hint}") from None

    def read_spec(self) -> RunSpec:
        return self._read(CONFIG, RunSpec.from_json)

    @property
    def secrets_file(self) -> str:
        """Where this run's secrets are: the user's key store, under the run's ``key.id`` (made on first use)."""
        return key_store.secret_path(key_store.key_id(self.path), SEED_FILE)

    @property
    def has_secrets(self) -> bool:
        """Whether this user can resume the run (its secrets are in this key store)."""
        named = files.is_url(self.path) or os.path.exists(self.file(key_store.ID_FILE))  # a URL names its key
        return named and os.path.exists(self.secrets_file)

    def write_secrets(self, secrets: RunSecrets) -> None:
        write_json_atomic(self.secrets_file, dataclasses.asdict(secrets), private=True)

    def read_secrets(self) -> RunSecrets:
        if not self.has_secrets:
            if self.has_params:
                raise DataError(f"{self.path!r} is a finished run: there is nothing to resume")
            raise DataError(
                f"{self.path!r}: its secrets are not in this user's key store "
                f"({key_store.store_dir()}; ${key_store.ENV}); a run resumes only where it started"
            )
        try:
            with open(self.secrets_file) as f:
                return RunSecrets(**json.load(f))
        except (OSError, ValueError, TypeError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise DataError(f"{self.path!r}: unreadable secrets ({reason}); cannot resume this run") from None

    def delete_secrets(self) -> None:
        """A finished run needs no resume: its seed would only let someone replay the noise."""
        if self.has_secrets:
            os.remove(self.secrets_file)

    # -- what it has spent and done --------------------------------------------------------

    def write_ledger(self, ledger: Ledger) -> None:
        self._write_pending_metrics()
        write_json_atomic(self.file(LEDGER), self._stamped(ledger.to_json()))

    def write_clip_paths(self, layers: list[dict[str, Any]]) -> None:
        """Each layer's clipping path, precision and the reason (the device's timings): a speed
        choice made from shapes and random inputs, never from the data."""
        write_json_atomic(self.file(CLIP_PATHS), self._stamped({"backend": jax.default_backend(), "layers": layers}))

    def read_ledger(self) -> Ledger:
        return self._read(LEDGER, Ledger.from_json)

    def append_metrics(self, metrics: dict[str, Any], *, diagnostic: bool = False) -> None:
        """One step's covered metrics (``metrics.jsonl``), or its private diagnostics (0600)."""
        name = DIAGNOSTICS_FILE if diagnostic else METRICS
        line = json.dumps(self._stamped(metrics, {SIMULATED: True}), sort_keys=True) + "\n"
        if files.is_url(self.path):
            self._pending.setdefault(name, []).append(line)
            return
        with open_for_writing(self.file(name), private=diagnostic, append=True) as f:
            f.write(line)

    def _write_pending_metrics(self) -> None:
        for name, lines in list(self._pending.items()):
            with open_for_writing(self.file(name), private=name == DIAGNOSTICS_FILE, append=True) as f:
                f.writelines(lines)
            del self._pending[name]

    def read_metrics(self, *, diagnostic: bool = False) -> list[dict[str, Any]]:
        """Every logged step's metrics, in order (a line cut short by a crash is skipped)."""
        name = DIAGNOSTICS_FILE if diagnostic else METRICS
        if not files.exists(self.file(name)) and not self._pending.get(name):
            return []
        records = []
        with files.open(self.file(name), "r") if files.exists(self.file(name)) else io.StringIO() as f:
            for line in [*f, *self._pending.get(name, [])]:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
        return records

    def truncate_metrics(self, *, after_step: int) -> None:
        """Drop metric and diagnostic lines past ``after_step`` (and a line cut short by a crash)."""
        for diagnostic, name in ((False, METRICS), (True, DIAGNOSTICS_FILE)):
            if not files.exists(self.file(name)):
                continue
            kept = [
                json.dumps(r, sort_keys=True) + "\n"
                for r in self.read_metrics(diagnostic=diagnostic)
                if r.get("step", 0) <= after_step
            ]
            write_atomic(self.file(name), lambda f, lines=kept: f.writelines(lines), private=diagnostic)

    def checkpoints(self, *, every: int) -> Checkpoints:
        return Checkpoints(self.file(CHECKPOINTS), every=every)

    # -- what it produced --------------------------------------------------------------------

    @property
    def has_params(self) -> bool:
        return files.isdir(self.file(PARAMS))

    def save_params(self, **trees: Any) -> None:
        """Save the trees (every process: orbax coordinates them), then the sha256 of each file."""
        save_with_digests(
            self.file(PARAMS), digests_file=self.file(PARAMS_DIGESTS), annotations=self._stamped({}), **trees
        )

    def _check_params(self) -> None:
        """Refuse damaged parameters before orbax reads them (its failures are tracebacks from threads)."""
        if not files.exists(self.file(PARAMS_DIGESTS)):
            return  # saved by an older dpscale: orbax's own errors are all there is
        recorded = self._read(
            PARAMS_DIGESTS, lambda payload: {str(k): str(v) for k, v in payload.items() if k not in _STAMP}
        )
        check_digests(self.file(PARAMS), recorded, run=self.path)

    def load_params(self) -> dict[str, Any]:
        """The saved trees, on this process's first device (``checkpoints.restore_on_first_device``)."""
        if not self.has_params:
            resume = (
                f": its training did not finish; continue it with `dpscale train --resume {self.path}`"
                if self.has_secrets
                else ""
            )
            raise DataError(f"{self.path!r} has no saved parameters ({PARAMS}/){resume}")
        self._check_params()
        return restore_on_first_device(self.file(PARAMS), run=self.path)

    def scores_file(self, split: str, *, diagnostic: bool, other_data: str | None = None) -> str:
        """``metrics.json``, or for scores on private training rows ``metrics.<split>.NOT-PRIVATE.json``;
        scores on data other than the run's go to ``metrics.other-data.<other_data>[...].json`` instead."""
        stem = f"metrics.other-data.{other_data}" if other_data else "metrics"
        return diagnostic_name(f"{stem}.{split}.json") if diagnostic else f"{stem}.json" if other_data else SCORES

    def write_scores(self, scores: dict[str, Any], *, diagnostic: bool = False, other_data: str | None = None) -> str:
        name = self.scores_file(scores["split"], diagnostic=diagnostic, other_data=other_data)
        write_json_atomic(self.file(name), self._stamped(scores), private=diagnostic)
        return self.file(name)

    def read_scores(self, split: str = "test", *, diagnostic: bool = False) -> dict[str, Any] | None:
        """The last evaluation's scores (on ``split`` if ``diagnostic``), or None if not evaluated."""
        try:
            with files.open(self.file(self.scores_file(split, diagnostic=diagnostic)), "r") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
