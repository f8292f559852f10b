"""Writing local files whose mode must hold: secrets and private diagnostics are owner-only.

Setting the mode of a file that already exists is not enough: ``os.open(path, O_CREAT,
0o600)`` keeps an existing file's mode, ``chmod`` does not take back a descriptor someone
opened while the file was world-readable, and a symlink planted at the path (or at a fixed
``.tmp`` name) would redirect the secret elsewhere. So private data only ever goes into a
file this process has just created (``O_EXCL``: never an existing file, never through a
symlink), mode 0600 from birth; an existing private file is replaced, not reused, unless it
is already a regular, owner-only file of ours. Files that are not private keep the umask.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable
from typing import IO, Any

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
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
            and not st.st_mode & 0o077)


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
        with open(path, "rb") as old:
            kept = old.read()
        os.unlink(path)
        fd = _create_new(path, private=True)
        os.write(fd, kept)
        return fd
    if os.path.lexists(path):
        os.unlink(path)  # whoever holds the old file keeps only what it held
    return _create_new(path, private=True)


def open_for_writing(path: str, *, private: bool, append: bool = False, binary: bool = False,
                     newline: str | None = None) -> IO[Any]:
    """``path`` opened for writing (truncated, or appended to); see the module docstring."""
    if private:
        fd = _private_fd(path, append=append)
    else:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | _CLOEXEC
        fd = os.open(path, flags, _PUBLIC_MODE)
    return os.fdopen(fd, ("a" if append else "w") + ("b" if binary else ""), newline=newline)


def write_atomic(path: str, write: Callable[[IO[Any]], None], *, private: bool = False,
                 binary: bool = False) -> None:
    """Call ``write`` on a new temporary file beside ``path``, then rename it over ``path``.

    Readers never see half a file, and after a crash ``path`` holds the old or the new
    contents (the data is flushed to disk before the rename); the temporary file has a
    random name and is removed if ``write`` fails.
    """
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    fd = _create_new(tmp, private=private)
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


def owner_only(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with every file and directory it creates owner-only (umask 077), for stages that write private data.

    Ingested shards, feature caches and dedup's output *are* the private data (or derived from it
    without noise); the umask covers every writer underneath (Beam's, zarr's, orbax's) without
    each setting modes, and is restored afterwards. Workers on other machines (a remote Beam
    runner) use their own umask.
    """
    import functools

    @functools.wraps(run)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        previous = os.umask(0o077)
        try:
            return run(*args, **kwargs)
        finally:
            os.umask(previous)

    return wrapped
