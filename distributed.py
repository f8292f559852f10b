"""Multi-host training through ``jax.distributed``: one process per host, one global mesh.

Every process runs the same program over a ``data`` mesh that spans all devices
of all processes. What must agree across processes, and how it does:

* the secret seed: process 0's (fresh OS entropy, or the fixed one) is broadcast
  to all (``agree_on_seed``), so every process samples the same batch at step t,
  augments it with the same key, and draws the same noise;
* the batch: sampling is a pure function of (seed, step), so every process knows
  the whole padded micro-batch and feeds only the rows its own devices hold
  (``BatchPlacement``); XLA all-reduces the clipped sum over the global mesh, so
  the noise is added once, to the global sum, identically on every device;
* the files: only process 0 writes the secrets, config, ledger, metrics and the
  progress bar; orbax writes checkpoints with all processes together, which needs
  the run directory on a filesystem every host sees.

With one process (no flags) nothing here communicates: it reduces to the
single-host behaviour, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpscale.errors import DpscaleError, InvalidConfigError

T = TypeVar("T")
DATA_AXIS = "data"  # the same axis name as privacy.dpsgd.DATA_AXIS


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Join a multi-process JAX cluster; True if this process is now part of one.

    Give all three of ``coordinator_address`` (``HOST:PORT`` of process 0),
    ``num_processes`` and ``process_id``, or ``auto=True`` alone to let JAX detect
    them (Cloud TPU pods, Slurm, Open MPI), or nothing for a single-process run.
    Must run before any JAX computation.
    """
    explicit = (coordinator_address, num_processes, process_id)
    given = [value is not None for value in explicit]
    if not any(given) and not auto:
        return False
    if auto and any(given):
        raise InvalidConfigError(
            "--distributed (auto-detection) takes none of --coordinator-address, --num-processes, --process-id"
        )
    if not auto:
        if not all(given):
            raise InvalidConfigError(
                "multi-host training needs all of --coordinator-address, --num-processes and --process-id"
            )
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidConfigError(f"--coordinator-address must be HOST:PORT, got {coordinator_address!r}")
        if num_processes < 1:
            raise InvalidConfigError(f"--num-processes must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise InvalidConfigError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    except (RuntimeError, ValueError) as exc:  # e.g. called after JAX computed, or no cluster detected
        raise DpscaleError(f"jax.distributed.initialize failed: {exc}") from exc
    return True


def is_primary() -> bool:
    """Process 0 writes the run's files and shows progress; the others only compute."""
    return jax.process_index() == 0


def run_on_primary(setup: Callable[[], T]) -> T | None:
    """Run ``setup`` on process 0 only; every process learns whether it succeeded.

    If it raises on process 0, the error propagates there and the other processes
    raise a ``DpscaleError`` instead of waiting forever in the next collective.
    Returns ``setup``'s result on process 0 and None elsewhere.
    """
    if jax.process_count() == 1:
        return setup()
    result, failure = None, None
    if is_primary():
        try:
            result = setup()
        except BaseException as exc:  # noqa: BLE001  re-raised below, after the others are told
            failure = exc
    from jax.experimental import multihost_utils

    ok = multihost_utils.broadcast_one_to_all(np.array(failure is None, np.int32))
    if failure is not None:
        raise failure
    if not int(ok):
        raise DpscaleError("process 0 failed to set up the run (see its error); stopping this process too")
    return result


def agree_on_seed(seed: int) -> int:
    """Process 0's ``seed`` on every process (all 64 bits; a no-op with one process).

    With OS-entropy seeds each process draws its own; the batches and the noise
    must nevertheless be the same everywhere, or the processes would sum clipped
    gradients of different batches and the accounting would not describe the run.
    """
    if jax.process_count() == 1:
        return seed
    from jax.experimental import multihost_utils

    words = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)  # JAX's default is 32-bit
    high, low = (int(w) for w in np.asarray(multihost_utils.broadcast_one_to_all(words)))
    return (high << 32) | low


def check_same_everywhere(text: str, what: str) -> None:
    """Raise on every process if ``text`` is not the same on all of them.

    A host started with other flags or other data would compute a different
    update (another noise multiplier, other examples) while the others wait for
    it in the same collectives: refuse before the first step instead.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 8]
    differ = [i for i, row in enumerate(gathered) if not np.array_equal(row, gathered[0])]
    if differ:
        raise InvalidConfigError(
            f"{what} differs between process 0 and process(es) {differ}: "
            "every host must run the same command on the same data"
        )


def training_mesh(devices: int | None = None) -> Mesh:
    """A 1-D ``data`` mesh: ``devices`` local ones (all by default), or all global devices.

    With several processes the mesh spans every device of every process, so
    ``devices`` may only be left out or equal the global count.
    """
    if jax.process_count() > 1:
        everything = jax.devices()
        if devices not in (None, len(everything)):
            raise InvalidConfigError(
                f"with {jax.process_count()} processes training uses all "
                f"{len(everything)} global devices; --devices {devices} is not supported"
            )
        return Mesh(everything, (DATA_AXIS,))
    available = jax.local_devices()
    count = len(available) if devices is None else devices
    if not 1 <= count <= len(available):
        platform, have = available[0].platform, len(available)
        more = (
            "; JAX makes N CPU devices of this machine's cores when started with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N in the environment"
            if platform == "cpu" and count > have
            else ""
        )
        raise InvalidConfigError(
            f"--devices {devices}: this machine has {have} {platform} "
            f"device{'s' if have != 1 else ''} (give {f'1 to {have}' if have > 1 else 1}){more}"
        )
    return Mesh(available[:count], (DATA_AXIS,))


def put_replicated(tree: Any, sharding: NamedSharding) -> Any:
    """``jax.device_put(tree, sharding)`` for a replicated ``sharding``, also across processes.

    JAX places process-local values on another process's devices only from host
    data (it then checks that every process passes the same value), so with several
    processes leaves go through NumPy (key arrays through their key data). A single
    process keeps the plain device-to-device copy.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def put(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and leaf.is_fully_replicated and leaf.sharding == sharding:
            return leaf
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(leaf)), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return jax.device_put(np.asarray(leaf), sharding)

    return jax.tree_util.tree_map(put, tree)


def local_rows(sharding: NamedSharding, size: int) -> np.ndarray:
    """The rows of a ``[size, ...]`` array with ``sharding`` held by this process's devices (sorted)."""
    index_map = sharding.addressable_devices_indices_map((size,))
    blocks = sorted({index[0].indices(size)[:2] for index in index_map.values()})
    return np.concatenate([np.arange(start, stop) for start, stop in blocks]).astype(np.int64)


class BatchPlacement:
    """Which rows of a micro-batch this process feeds, and how they become one global array.

    ``mesh=None`` is a plain single-device run: every row is local and ``put`` is
    ``jnp.asarray``. Otherwise rows are split over the mesh's ``data`` axis and
    ``put`` assembles the process-local rows into a global, data-sharded array
    without reading any other process's rows.
    """

    def __init__(self, mesh: Mesh | None) -> None:
        self.mesh = mesh
        self._sharded = None if mesh is None else NamedSharding(mesh, PartitionSpec(DATA_AXIS))
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._rows: dict[int, np.ndarray] = {}

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[DATA_AXIS]

    def rows(self, size: int) -> np.ndarray:
        """Positions (in ``range(size)``) of the rows this process must provide."""
        if size % self.num_devices:
            raise InvalidConfigError(f"micro-batch size {size} is not divisible by the {self.num_devices} devices")
        if size not in self._rows:
            self._rows[size] = np.arange(size) if self._sharded is None else local_rows(self._sharded, size)
        return self._rows[size]

    def put(self, local: Any, size: int) -> Any:
        """Global ``[size, ...]`` arrays from the leaves of ``local`` (each holding ``rows(size)``)."""
        rows = self.rows(size)
        if self._sharded is None:
            return jax.tree_util.tree_map(jax.numpy.asarray, local)

        def place(leaf: Any) -> jax.Array:
            leaf = np.asarray(leaf)
            leaf = leaf.astype(jax.dtypes.canonicalize_dtype(leaf.dtype), copy=False)  # as jnp.asarray would
            if leaf.shape[0] != len(rows):
                raise ValueError(f"expected {len(rows)} local rows, got {leaf.shape[0]}")

            def shard(index: tuple[slice, ...]) -> np.ndarray:
                wanted = np.arange(size)[index[0]]
                return leaf[(np.searchsorted(rows, wanted), *index[1:])]

            return jax.make_array_from_callback((size, *leaf.shape[1:]), self._sharded, shard, dtype=leaf.dtype)

        return jax.tree_util.tree_map(place, local)

    def replicate(self, tree: Any) -> Any:
        """The same value on every device of the mesh (e.g. an augmentation key)."""
        return tree if self._replicated is None else put_replicated(tree, self._replicated)
