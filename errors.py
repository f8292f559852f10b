"""Errors that mean "the user asked for something impossible", as opposed to bugs.

The CLI turns these into one line on stderr and exit code 2; anything else is a bug
and keeps its traceback. Faults of the machine (a full disk, a read-only file system, missing
permissions) are the user's environment, not a bug: ``storage_error`` turns them into one line.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any


class DpscaleError(Exception):
    """Base class for errors caused by the user's input or environment."""


class InvalidConfigError(DpscaleError, ValueError):
    """A configuration value is out of range or inconsistent with another one."""


class InfeasiblePrivacyTargetError(DpscaleError, ValueError):
    """No admissible hyper-parameter reaches the requested (epsilon, delta)."""


class DataError(DpscaleError):
    """Input data is missing, corrupt, or does not match what the run expects."""


class PipelineError(DpscaleError, RuntimeError):
    """A Beam pipeline failed (or lost data); the message says what to try next."""


class PipelineStalledError(PipelineError):
    """A local Beam pipeline made no progress and was stopped instead of hanging."""


class StorageError(DpscaleError):
    """A file could not be written or read: permissions, a read-only file system, a full disk."""


class CloudStorageError(StorageError):
    """Cloud Storage (``gs://``) is out of reach or refuses: no network, no credentials, no permission, no bucket."""


#: The operating-system faults that are the user's environment, not a bug, and what to do about each.
_REMEDIES = {
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space (or raise the quota)",
    errno.EROFS: "use a writable file system",
    errno.EACCES: "fix the permissions (or use another path)",
    errno.EPERM: "fix the permissions (or use another path)",
}
_ERRNO_PATH = re.compile(r"\[Errno (\d+)\] [^:'\"]*: '([^']+)'")


def os_fault(exc: BaseException) -> tuple[int, str | None] | None:
    """``(errno, path or None)`` if ``exc``, or an error it wraps, is one of the faults of ``_REMEDIES``.

    Libraries re-raise these in their own types (orbax and tensorstore as ``ValueError``, Beam
    as the text of a worker's traceback), so the text is read too, for the fault's standard message.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _REMEDIES:
            return error.errno, error.filename
        error = error.__cause__ or error.__context__
    text = str(exc)
    for match in _ERRNO_PATH.finditer(text):
        if int(match.group(1)) in _REMEDIES:
            return int(match.group(1)), match.group(2)
    found = [(text.find(os.strerror(number)), number) for number in _REMEDIES if os.strerror(number) in text]
    return (min(found)[1], None) if found else None


def storage_error(
    exc: BaseException, *, path: str | None = None, stopped: str | None = None, then: str = "run the command again"
) -> StorageError | None:
    """The one line for an operating-system fault (``os_fault``), or None if ``exc`` is something else.

    ``path`` names the file or directory when the error does not; ``stopped`` says where the
    work stands, ``then`` what to run once the fault is fixed (e.g. how to resume a run).
    """
    fault = os_fault(exc)
    if fault is None:
        return None
    number, where = fault
    where = where or path
    what = os.strerror(number)
    what = what[0].lower() + what[1:]
    prefix = f"{where!r}: " if where else ""
    state = f"{stopped}: " if stopped else ""
    return StorageError(f"{prefix}{what}; {state}{_REMEDIES[number]}, then {then}")


@contextlib.contextmanager
def storage_faults(
    *, path: str | None = None, stopped: str | Callable[[], str] | None = None, then: str = "run the command again"
) -> Iterator[None]:
    """Inside: an operating-system fault ends in ``storage_error``'s one line (``stopped`` may be a
    function, asked only then), and the libraries' own reports of it stay off the terminal.

    orbax and tensorstore write a failed write's traceback to the absl log from every writer
    thread, then asyncio logs the tasks whose failure nobody awaited and reports, as unraisable,
    the threads that call back into the closed event loop of the failed save; some come after
    the error reached us, so once a fault happened their filters stay for the rest of the process.
    """
    echoes = _FaultEchoes()
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    for logger in loggers:
        logger.addFilter(echoes)
    faulted = False
    try:
        yield
    except Exception as exc:
        fault = storage_error(exc, path=path, stopped=stopped() if callable(stopped) else stopped, then=then)
        if fault is None:
            raise
        faulted = True
        sys.unraisablehook = _without_closed_loop_reports(sys.unraisablehook)
        raise fault from None
    finally:
        if not faulted:
            for logger in loggers:
                logger.removeFilter(echoes)


def _closed_loop(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


class _FaultEchoes(logging.Filter):
    """Drops a library's log record of an operating-system fault (or of its closed event loop)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and (_closed_loop(exc) or os_fault(exc) is not None):
            return False
        return os_fault(Exception(record.getMessage())) is None


def _without_closed_loop_reports(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """``sys.unraisablehook`` minus "Event loop is closed" (see ``storage_faults``)."""
    if getattr(hook, "__qualname__", "").startswith("_without_closed_loop_reports"):
        return hook

    def report(unraisable: Any) -> None:
        if not _closed_loop(unraisable.exc_value):
            hook(unraisable)

    return report
