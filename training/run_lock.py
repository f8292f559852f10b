"""The run lock: one process trains in a run directory at a time.

On a local disk it is an exclusive ``flock`` (the kernel drops it when its holder dies); on an
object store (``gs://``), which has no locks, an object created only if absent, naming the host
and pid that hold it. ``RunDirectory.lock`` says where it lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket

from dpscale import files
from dpscale.errors import DataError


class RunLock:
    """An exclusive ``flock`` on ``run.lock``: one process trains in a directory at a time.

    The kernel drops the lock when its file descriptor closes, so it is released even when
    the process is killed (kill -9) and a stale lock file never blocks a resume.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._held_remote = False
        if files.is_url(path):
            self._take_remote()
            return
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._fd, 64).decode(errors="replace").strip() or "?"
            self.release()
            raise DataError(
                f"{os.path.dirname(path)!r} is in use: another process (pid {holder}) is training in "
                "it; wait for it to finish or stop it"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def _take_remote(self) -> None:
        """An object store has no flock: the lock is an object created only if absent (the store decides
        between hosts). A killed holder cannot delete it, so one left by a process of this host that no
        longer runs is taken over; one from another host is refused with what to do."""
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            if files.create_exclusive(self.path, json.dumps(me).encode()):
                self._held_remote = True
                return
            try:
                holder = json.loads(files.read_text(self.path))
            except FileNotFoundError:
                continue  # released meanwhile: try again
            except (OSError, ValueError):
                holder = {}
            if holder.get("host") != me["host"] or _process_alive(int(holder.get("pid", 0))):
                break
            files.remove(self.path)  # its holder was killed; two resumers racing here is not guarded
        else:
            holder = {}
        where = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        raise DataError(
            f"{self.path.rsplit('/', 1)[0]!r} is in use: another process ({where}) is training in it; "
            f"wait for it to finish or stop it (if it was killed on another host, delete {self.path})"
        )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._held_remote:
            self._held_remote = False
            with contextlib.suppress(FileNotFoundError):
                files.remove(self.path)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, killed but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
