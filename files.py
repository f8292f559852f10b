"""Writing local files whose mode must hold: secrets and private diagnostics are owner-only.

Setting the mode of a file that already exists is not enough: ``os.open(path, O_CREAT,
0o600)`` keeps an existing file's mode, ``chmod`` does not take back a descriptor someone
opened while the file was world-readable, and a symlink planted at the path (or at a fixed
``.tmp`` name) would redirect the secret elsewhere. So private data only ever goes into a
file this process has just created (``O_EXCL``: never an existing file, never through a
symlink), mode 0600 from birth; an existing private file is replaced, not reused, unless it
is already a regular, owner-only file of ours. Files that are not private keep the umask;
``owner_only_files`` sets it to 077 while the library writes private data (caches, shards).

The same functions, and the small filesystem layer below them (``open``, ``exists``,
``listdir``, ``replace``, ...), also take URLs (``gs://bucket/key``): every file dpscale
reads or writes goes through this module, so a data set, a cache or a run directory may live
on Cloud Storage. A URL has no mode: who may read it is the bucket's access control.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import io
import json
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

from dpscale.errors import DpscaleError, InvalidConfigError

PRIVATE_MODE = 0o600
_PUBLIC_MODE = 0o644  # before the umask
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _create_new(path: str, *, private: bool) -> int:
    """A descriptor on a file created now (``FileExistsError`` if anything is at ``path``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    return os.open(path, flags, PRIVATE_MODE if private else _PUBLIC_MODE)


def _owner_only(st: os.stat_result) -> bool:
    """A regular file of this user, with one name, that nobody else may read."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1 and not st.st_mode & 0o077


def _private_fd(path: str, *, append: bool) -> int:
    if append:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
        except FileNotFoundError:
            return _create_new(path, private=True)
        if _owner_only(os.fstat(fd)):
            os.set_blocking(fd, True)
            return fd
        os.close(fd)  # e.g. written by an older version at 0644: carry its lines into a new file
        with builtins.open(path, "rb") as old:
            kept = old.read()
        os.unlink(path)
        fd = _create_new(path, private=True)
        os.write(fd, kept)
        return fd
    if os.path.lexists(path):
        os.unlink(path)  # whoever holds the old file keeps only what it held
    return _create_new(path, private=True)


def open_for_writing(
    path: str, *, private: bool, append: bool = False, binary: bool = False, newline: str | None = None
) -> IO[Any]:
    """``path`` opened for writing (truncated, or appended to); see the module docstring."""
    if is_url(path):
        return _RemoteWriter(path, append=append, binary=binary)  # type: ignore[return-value]
    if private:
        fd = _private_fd(path, append=append)
    else:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | _CLOEXEC
        fd = os.open(path, flags, _PUBLIC_MODE)
    return os.fdopen(fd, ("a" if append else "w") + ("b" if binary else ""), newline=newline)


def write_atomic(path: str, write: Callable[[IO[Any]], None], *, private: bool = False, binary: bool = False) -> None:
    """Call ``write`` on a new temporary file beside ``path``, then rename it over ``path``.

    Readers never see half a file, and after a crash ``path`` holds the old or the new
    contents (the data is flushed to disk before the rename); the temporary file has a
    random name and is removed if ``write`` fails.
    """
    if is_url(path):
        with _RemoteWriter(path, append=False, binary=binary) as f:
            write(f)
        return
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    try:
        fd = _create_new(tmp, private=private)
    except OSError as exc:  # name the file being written, not its temporary name
        raise type(exc)(exc.errno, exc.strerror, path) from None
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str, payload: Any, *, private: bool = False) -> None:
    """``payload`` as indented, key-sorted JSON, written atomically."""

    def write(f: IO[Any]) -> None:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.write("\n")

    write_atomic(path, write, private=private)


_umask_lock = threading.Lock()
_umask_holders = 0
_umask_before = 0


@contextlib.contextmanager
def owner_only_files() -> Iterator[None]:
    """Every file and directory this process creates meanwhile is owner-only (umask 077).

    For the library's own writers of private data (ingested shards, feature caches, dedup's
    output): the umask covers every writer underneath (Beam's, zarr's, ArrayRecord's) without
    each setting modes, whatever the caller's umask, so a user of the Python API gets the same
    modes as the command line. The umask belongs to the process, not the thread: nested and
    concurrent holders (Beam's worker threads) share one count, and the caller's umask comes
    back when the last one leaves; a file another thread creates meanwhile is owner-only too
    (never less private). Workers on other machines (a remote Beam runner) use their own
    umask, and a URL has no mode at all (``gs://``: the bucket's access control decides).
    """
    global _umask_holders, _umask_before
    with _umask_lock:
        if _umask_holders == 0:
            _umask_before = os.umask(0o077)
        _umask_holders += 1
    try:
        yield
    finally:
        with _umask_lock:
            _umask_holders -= 1
            if _umask_holders == 0:
                os.umask(_umask_before)


def owner_only(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` under ``owner_only_files``: for stages and functions that write private data."""

    @functools.wraps(run)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with owner_only_files():
            return run(*args, **kwargs)

    return wrapped


# ---- Local paths and URLs (gs://...): the one filesystem layer ------------------------------------
#
# Every path dpscale reads or writes may be a local path or a URL. Local paths keep the exact
# behaviour above (atomic replace, owner-only modes); a URL goes through fsspec (gs:// through
# gcsfs, the `gcp` extra). Object stores have no directories, no modes and no rename, but a
# written object appears whole when its upload completes, which is what the atomic local writes
# give. Who may read an object is the bucket's access control, not a file mode.

CLOUD_EXTRA = 'pip install "dpscale[gcp]"'


class MissingExtraError(DpscaleError):
    """A URL whose file system is not installed (neither an ``OSError`` nor a ``ValueError``: callers
    that turn those into "not a dataset" must not hide what to install)."""


_registered: set[str] = set()


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a remote object (``gs://bucket/key``) rather than a local file."""
    return "://" in os.fspath(path)


def filesystem(url: str) -> Any:
    """The fsspec file system behind ``url``; one line naming the extra to install if it is missing.

    ``gs://`` is served by ``gcs.GcsFileSystem``, gcsfs's JSON-API client (``gcsfs.core``) with
    bounded waits, registered for the whole process so that zarr and orbax's paths use it too:
    gcsfs's default class first asks the storage-control gRPC service for each bucket's layout
    (zonal buckets), which a GCS API server without that service answers only after a 30-60 s
    timeout, and dpscale needs none of it. The first use of a bucket reaches it
    (``GcsFileSystem.check_bucket``): an unreachable, missing or refused bucket is one line
    (``CloudStorageError``) at once. Listings are never cached: Beam workers and other hosts write
    the objects that the launching process lists (feature-chunk markers), and a cached listing
    would hide them.
    """
    protocol = url.split("://", 1)[0]
    try:
        import fsspec

        if protocol in ("gs", "gcs"):
            import gcsfs  # noqa: F401 - the extra: dpscale.gcs, once imported, would hide its absence

            from dpscale.gcs import GcsFileSystem
        if protocol in ("gs", "gcs") and protocol not in _registered:
            for name in ("gs", "gcs"):
                fsspec.register_implementation(name, GcsFileSystem, clobber=True)
                fsspec.config.conf.setdefault(name, {}).setdefault("use_listings_cache", False)
                _registered.add(name)
        fs = fsspec.filesystem(protocol)
    except ImportError:
        if protocol in ("gs", "gcs"):
            raise MissingExtraError(
                f"{url!r} is on Cloud Storage, which needs dpscale's gcp extra: {CLOUD_EXTRA}"
            ) from None
        raise MissingExtraError(
            f"{url!r}: no file system for {protocol}:// is installed "
            f"(dpscale reads URLs through fsspec; for gs:// {CLOUD_EXTRA})"
        ) from None
    except ValueError as exc:  # fsspec: "Protocol not known"
        raise InvalidConfigError(f"{url!r}: {exc}") from None
    if protocol in ("gs", "gcs"):
        fs.check_bucket(url)
    return fs


def require_local(path: str, what: str) -> str:
    """``path`` if it is local; one line if it is a URL (for the few outputs that stay on this machine)."""
    if is_url(path):
        raise InvalidConfigError(f"{what} must be a local path, got {path!r}")
    return path


def join(base: str, *names: str) -> str:
    """``base`` / ``names``: ``os.path.join`` locally, ``/``-joined for a URL."""
    if not is_url(base):
        return os.path.join(base, *names)
    return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])


def absolute(path: str) -> str:
    """A local path made absolute (a stored reference then resolves from anywhere); a URL as given."""
    return path if is_url(path) else os.path.abspath(path)


def open(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:  # noqa: A001 - the builtin, for URLs too
    """``path`` opened like the builtin ``open`` (reading, or a plain write of a new object)."""
    if is_url(path):
        return filesystem(path).open(path, mode, **kwargs)
    return builtins.open(path, mode, **kwargs)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def exists(path: str) -> bool:
    return filesystem(path).exists(path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    """A local directory, or a URL prefix that holds at least one object."""
    return filesystem(path).isdir(path) if is_url(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    try:  # not fsspec's isfile, which says False for any failure (an unreachable server too)
        return filesystem(path).info(path)["type"] == "file"
    except FileNotFoundError:
        return False


def size(path: str) -> int | None:
    """The size of the regular file at ``path``; None if there is none (absent, or a directory in its place)."""
    if not is_url(path):
        try:
            found = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return found.st_size if stat.S_ISREG(found.st_mode) else None
    try:
        info = filesystem(path).info(path)
    except FileNotFoundError:
        return None
    return int(info["size"]) if info.get("type") == "file" else None


def makedirs(path: str, *, mode: int = 0o777) -> None:
    """``os.makedirs(path, exist_ok=True)`` locally; nothing for a URL (prefixes need no creation)."""
    if not is_url(path):
        os.makedirs(path, mode=mode, exist_ok=True)


def makedirs_owner_only(path: str) -> None:
    """``path`` made (or, if there, set) mode 0700 locally: nobody else may list or enter it; a URL: nothing."""
    if not is_url(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        if stat.S_IMODE(os.stat(path).st_mode) != 0o700:
            os.chmod(path, 0o700)


def listdir(path: str) -> list[str]:
    """The names directly inside ``path`` (``FileNotFoundError`` if there is nothing there)."""
    if not is_url(path):
        return os.listdir(path)
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in filesystem(path).ls(path, detail=False)]


def glob(pattern: str) -> list[str]:
    """Paths matching ``pattern`` (``*`` within one name), sorted; URLs keep their scheme."""
    if not is_url(pattern):
        import glob as globbing

        return sorted(globbing.glob(pattern))
    fs = filesystem(pattern)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(pattern))


def find(root: str) -> list[str]:
    """Every file under ``root``, as paths relative to it with ``/`` separators, sorted."""
    if not is_url(root):
        return sorted(
            os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
            for folder, _, names in os.walk(root)
            for name in names
        )
    prefix = root.split("://", 1)[1].rstrip("/") + "/"  # fsspec lists "bucket/key", without the scheme
    return sorted(p[len(prefix) :] for p in filesystem(root).find(root) if p.startswith(prefix))


def remove(path: str) -> None:
    """Delete one file (``FileNotFoundError`` if it is not there)."""
    if is_url(path):
        filesystem(path).rm_file(path)
    else:
        os.remove(path)


def rmtree(path: str) -> None:
    """Delete ``path`` and everything under it, if anything is there."""
    if not is_url(path):
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    elif exists(path):
        filesystem(path).rm(path, recursive=True)


def replace(src: str, dst: str) -> None:
    """Move ``src`` over ``dst``: ``os.replace`` locally; on an object store a copy, then a delete."""
    if is_url(dst):  # copy + delete: GCS's moveTo is not served by every GCS API server
        filesystem(dst).copy(src, dst)
        filesystem(src).rm_file(src)
    else:
        os.replace(src, dst)


def upload(local_path: str, url: str) -> None:
    """Copy a local file to ``url`` (for writers that need a local file, e.g. ArrayRecord's)."""
    filesystem(url).put_file(local_path, url)


def create_exclusive(url: str, data: bytes) -> bool:
    """Write ``data`` to ``url`` only if no object is there (GCS: ``ifGenerationMatch=0``); False if one is.

    The object store decides, so of two processes on different hosts exactly one succeeds.
    """
    try:
        filesystem(url).pipe_file(url, data, mode="create")
    except FileExistsError:
        return False
    return True


class _RemoteWriter:
    """A text or binary buffer whose contents become the object at ``url`` when it closes without error.

    An object is written in one upload, so a failure while writing leaves the old object (or none),
    never half of the new one; appending rewrites the object with its old contents first.
    """

    def __init__(self, url: str, *, append: bool, binary: bool) -> None:
        self.url, self.binary = url, binary
        self._head = read_bytes(url) if append and exists(url) else b""
        self._buffer: Any = io.BytesIO() if binary else io.StringIO()

    def write(self, data: Any) -> int:
        return self._buffer.write(data)

    def writelines(self, lines: Any) -> None:
        self._buffer.writelines(lines)

    def flush(self) -> None:
        pass

    def __enter__(self) -> _RemoteWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()

    def close(self) -> None:
        body = self._buffer.getvalue()
        filesystem(self.url).pipe_file(self.url, self._head + (body if self.binary else body.encode("utf-8")))
