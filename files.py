"""Writing local files whose mode must hold: secrets and private diagnostics are owner-only.

``os.open(path, O_CREAT, 0o600)`` applies the mode only when it creates the file. A file
that already exists (an earlier run's output, a ``.tmp`` left behind by a crash, a file the
user made) keeps the mode it had, so a seed or a private diagnostic written into it could
stay readable by everyone. ``open_for_writing`` therefore sets the mode on the open
descriptor before a byte is written. Files that are not private keep the process's umask.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import IO, Any

PRIVATE_MODE = 0o600
_PUBLIC_MODE = 0o644  # before the umask


def open_for_writing(path: str, *, private: bool, append: bool = False, binary: bool = False,
                     newline: str | None = None) -> IO[Any]:
    """``path`` opened for writing (truncated, or appended to); mode 0600 if ``private``."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_MODE if private else _PUBLIC_MODE)
    try:
        if private:
            os.fchmod(fd, PRIVATE_MODE)
        return os.fdopen(fd, ("a" if append else "w") + ("b" if binary else ""), newline=newline)
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: str, write: Callable[[IO[Any]], None], *, private: bool = False,
                 binary: bool = False) -> None:
    """Call ``write`` on ``path + '.tmp'``, then rename it over ``path``: never half a file."""
    tmp = f"{path}.tmp"
    with open_for_writing(tmp, private=private, binary=binary) as f:
        write(f)
    os.replace(tmp, path)


def write_json_atomic(path: str, payload: Any, *, private: bool = False) -> None:
    """``payload`` as indented, key-sorted JSON, written atomically."""

    def write(f: IO[Any]) -> None:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.write("\n")

    write_atomic(path, write, private=private)
