"""Test-wide set-up: four host CPU devices, so multi-device code runs everywhere.

XLA reads the flag when JAX initialises its backend, so it must be set before any
test imports jax. Single-device behaviour is tested on a one-device mesh.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests build a fresh DpsgdStep (fresh jit closures) around the same program;
# JAX's persistent compilation cache, keyed on the compiled program, lets them
# share compilations across tests and across pytest-xdist workers.
import tempfile  # noqa: E402

# Secrets go to the user's key store (data.key_store): tests use a fresh one of their own.
os.environ["DPSCALE_KEY_STORE"] = tempfile.mkdtemp(prefix="dpscale-test-keys-")

import jax  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("DPSCALE_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "dpscale-test-jax-cache")),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import hashlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dpscale.cache.feature_store import EntryLayout, FeatureStore, SplitLayout  # noqa: E402
from dpscale.cache.keys import FeatureKey  # noqa: E402


def write_feature_cache(
    root: str,
    splits: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    chunk_rows: int,
    data_hash_char: str,
    class_names: tuple[str, ...] = ("a", "b", "c"),
    **key_parts,
) -> str:
    """A real, complete cache entry holding ``splits`` (name -> (features [n, d], labels [n])).

    ``key_parts`` override the synthetic key's backbone/preprocessing (e.g. ``resolution=16``).
    """
    dim = next(iter(splits.values()))[0].shape[1]
    parts = dict(weights_sha256="w" * 64, model="synthetic", resolution=8, mean=(0.0,), std=(1.0,)) | key_parts
    key = FeatureKey(data_identity=data_hash_char * 64, **parts)
    layout = EntryLayout(
        key=key,
        feature_dim=dim,
        class_names=class_names,
        splits={s: SplitLayout(num_examples=len(y), chunk_rows=chunk_rows) for s, (_, y) in splits.items()},
    )
    store = FeatureStore.create(root, layout)
    for split, (feats, labels) in splits.items():
        rows = layout.splits[split]
        for chunk in range(rows.num_chunks):
            start, stop = rows.rows(chunk)
            ids = [hashlib.sha256(np.asarray(row, np.float32).tobytes()).digest() for row in feats[start:stop]]
            store.write_chunk(split, chunk, feats[start:stop], labels[start:stop], ids)
    store.finalize()
    return store.path


def write_synthetic_feature_cache(
    root: str, *, seed: int, sizes: dict[str, int], chunk_rows: int, data_hash_char: str, **key_parts
) -> str:
    """A separable 3-class problem in 16 dimensions, stored as a real, complete cache entry."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, 16)) * 3
    splits = {}
    for split, n in sizes.items():
        labels = rng.integers(0, 3, size=n)
        splits[split] = (centers[labels] + rng.normal(size=(n, 16)), labels)
    return write_feature_cache(root, splits, chunk_rows=chunk_rows, data_hash_char=data_hash_char, **key_parts)


_TRIM_GROWTH = 200 << 20  # bytes the worker may grow by since its last trim before the next one
_floor = {"bytes": 0}  # the worker's resident bytes right after its last trim


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _give_freed_memory_back():
    """Memory a test freed goes back to the system, so one heavy test does not weigh on the rest.

    glibc keeps freed memory for the process: the xdist worker that ran WRN-28-10's ghost test
    (a 7-10 GB peak) went on holding 3.5-5.4 GB for its remaining 361 tests, beside the other
    worker's (benchmarks/results/test_suite.md). ``malloc_trim`` gives it back, after a test that
    left the worker 200 MB larger than its last trim did (not after every test: a trim walks the
    whole heap). Linux with glibc only; elsewhere it does nothing.
    """
    try:
        _resident_bytes()
    except OSError:  # no /proc: not Linux
        yield
        return
    yield
    if _resident_bytes() - _floor["bytes"] > _TRIM_GROWTH:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        _floor["bytes"] = _resident_bytes()


@pytest.fixture(scope="session")
def synthetic_feature_cache():
    """``write_synthetic_feature_cache`` for module-scoped fixtures."""
    return write_synthetic_feature_cache


@pytest.fixture()
def umask_022():
    """A Python API user's usual umask (group and others may read what is not made owner-only)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def not_owner_only(root: str) -> list[str]:
    """What under ``root`` (itself included) another user could read: directories not 0700, files not 0600."""
    import stat

    found = []
    for folder, _, names in os.walk(root):
        if stat.S_IMODE(os.stat(folder).st_mode) != 0o700:
            found.append(f"{oct(stat.S_IMODE(os.stat(folder).st_mode))} {folder}/")
        for name in names:
            mode = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
            if mode != 0o600:
                found.append(f"{oct(mode)} {os.path.join(folder, name)}")
    return found


def readable_by_others(root: str) -> list[str]:
    """Files under ``root`` (relative paths) that another user could read: readable, and every folder on the way open."""
    found = []
    for folder, dirs, names in os.walk(root):
        if not os.stat(folder).st_mode & 0o005 == 0o005:  # others can neither list nor enter it: nothing below
            dirs[:] = []
            continue
        found += [
            os.path.relpath(os.path.join(folder, n), root)
            for n in names
            if os.stat(os.path.join(folder, n)).st_mode & 0o004
        ]
    return sorted(found)
