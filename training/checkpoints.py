"""Orbax checkpoints of a run: the whole training state every few steps (the newest two), and the
finished run's parameters with the sha256 of every file they are made of.

The parameters are a released output: their digests, checked before orbax reads them, make a
damaged or missing file one line naming it, not a traceback from orbax's threads.
``RunDirectory`` says where each lives.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from dpscale import files
from dpscale.errors import DataError
from dpscale.files import write_json_atomic


class Checkpoints:
    """Save every ``every`` steps (and at the end); keep the newest two.

    A save cut short (Ctrl-C, a kill) leaves orbax's temporary directory, never a checkpoint; the next
    process to open the run (the run lock makes it the only one) removes it.
    """

    def __init__(self, directory: str, *, every: int) -> None:
        self.every = max(1, every)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True
        )
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


def save_with_digests(directory: str, *, digests_file: str, annotations: Mapping[str, Any] = {}, **trees: Any) -> None:
    """Save the trees (every process: orbax coordinates them), then the sha256 of each file
    (and ``annotations``, e.g. a simulated run's stamp, beside them in the digests file)."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, trees, force=True)
    if jax.process_index() == 0:
        write_json_atomic(digests_file, {**file_digests(directory), **annotations})


def file_digests(directory: str) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path (the parameters are a released output)."""
    digests = {}
    for name in files.find(directory):
        digest = hashlib.sha256()
        with files.open(files.join(directory, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digests[name] = digest.hexdigest()
    return dict(sorted(digests.items()))


def check_digests(directory: str, recorded: Mapping[str, str], *, run: str) -> None:
    """Refuse damaged parameters before orbax reads them (its failures are tracebacks from threads)."""
    found = file_digests(directory)
    for name, digest in recorded.items():
        if found.get(name) != digest:
            problem = "missing" if name not in found else "corrupt (its sha256 differs from the one saved)"
            raise DataError(
                f"{run!r}: its saved parameters are damaged: {os.path.basename(directory)}/{name} is {problem}"
            )


def restore_on_first_device(directory: str, *, run: str) -> dict[str, Any]:
    """The trees saved in ``directory``, on this process's first device.

    Orbax would otherwise restore onto the devices the run saved from, which do
    not exist when evaluating a multi-device or multi-host run elsewhere.
    """
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(directory)
            if metadata is None:
                raise ValueError("no readable checkpoint metadata")
            saved = metadata.item_metadata.tree
            target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
            return checkpointer.restore(directory, target)
    except Exception as exc:  # noqa: BLE001 - orbax/tensorstore raise many types for damaged files
        reason = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise DataError(
            f"{run!r}: its saved parameters ({os.path.basename(directory)}/) are damaged ({reason})"
        ) from None
