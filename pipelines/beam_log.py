"""Beam's log: where Beam's own logging and its worker processes' stderr go during a run, and what
it says when a worker failed.

A run's stderr goes to a log file unless ``verbose`` (``beam_log_to_file``), so the terminal
shows dpscale's lines only. When a worker fails, the user gets the worker's own line: its
dpscale error as it is (``worker_error`` from the exception Beam raised, ``logged_failure``
from the log when Beam stops without raising), else the last line of the exception
(``one_line``), never Beam's wrapping of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator

from dpscale import errors

# What to try when several local worker processes failed: one process cannot fail the way several can.
TRY_IN_MEMORY = "re-run with `-- --direct_running_mode=in_memory` (one process)"


@contextlib.contextmanager
def beam_log_to_file(verbose: bool) -> Iterator[str | None]:
    """Send file descriptor 2 (Beam, gRPC, worker processes) to a log file unless ``verbose``.

    dpscale's own messages keep the terminal: ``sys.stderr`` and every logging handler that
    wrote to it are pointed at a duplicate of the original stderr for the duration. What threads
    older than the run log (Beam's workers left over from an earlier pipeline in this process,
    failing late) stays out of the file: ``logged_failure`` reads it as this run's failure.
    """
    if verbose:
        yield None
        return
    older = {thread.ident for thread in threading.enumerate()} - {threading.get_ident()}
    fd, path = tempfile.mkstemp(prefix="dpscale-beam-", suffix=".log")
    sys.stderr.flush()
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1)
    old_stderr = sys.stderr
    handlers = [
        h
        for name in (None, *logging.root.manager.loggerDict)
        for h in getattr(logging.getLogger(name), "handlers", [])
        if isinstance(h, logging.StreamHandler) and h.stream is old_stderr
    ]
    beam_logger = logging.getLogger("apache_beam")
    old_level, old_propagate = beam_logger.level, beam_logger.propagate
    beam_logger.setLevel(logging.ERROR)
    to_file = logging.StreamHandler(os.fdopen(os.dup(fd), "w", buffering=1))  # a worker's error and its trace
    to_file.addFilter(lambda record: record.thread not in older)
    beam_logger.addHandler(to_file)
    beam_logger.propagate = False
    old_hook = threading.excepthook

    def thread_error_to_file(args: threading.ExceptHookArgs) -> None:  # e.g. a worker process that died
        if args.thread is not None and args.thread.ident in older:
            old_hook(args)
            return
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=to_file.stream)

    threading.excepthook = thread_error_to_file
    os.dup2(fd, 2)
    sys.stderr = terminal
    for h in handlers:
        h.setStream(terminal)
    try:
        yield path
    finally:
        terminal.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
        sys.stderr = old_stderr
        for h in handlers:
            h.setStream(old_stderr)
        terminal.close()
        threading.excepthook = old_hook
        beam_logger.removeHandler(to_file)
        to_file.stream.close()
        beam_logger.setLevel(old_level)
        beam_logger.propagate = old_propagate


_USER_ERROR = re.compile(r"dpscale\.errors\.(\w+): (.+)")
_BEAM_CONTEXT = re.compile(r" \[while running '[^']*'\]")
# A worker's traceback as the log holds it: its last line starts with the exception's name (the
# escaped copies inside Beam's one-line status messages do not start a line).
_LOGGED_USER_ERROR = re.compile(r"^dpscale\.errors\.(\w+): (.+)$", re.MULTILINE)
_LOGGED_EXCEPTION = re.compile(r"^((?:[\w.]+\.)?\w*(?:Error|Exception): .+)$", re.MULTILINE)


def worker_error(
    exc: BaseException, *, writes_to: str | None = None, rerun: str = "run the command again"
) -> errors.DpscaleError | None:
    """The dpscale error a worker raised (a damaged shard, a full disk), if that is why the pipeline failed.

    In one process Beam re-raises the worker's exception (with the step's name added to its
    message); from worker processes only its traceback's text arrives. Either way the user
    gets the worker's own one line, not Beam's wrapping or a hint about running modes.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, errors.DpscaleError):
            return type(error)(_BEAM_CONTEXT.sub("", " ".join(str(error).split())))
        error = error.__cause__ or error.__context__
    found = _USER_ERROR.findall(str(exc))
    if found:
        name, text = found[-1]
        kind = getattr(errors, name, None)
        if isinstance(kind, type) and issubclass(kind, errors.DpscaleError):
            return kind(_BEAM_CONTEXT.sub("", text.strip()))
    return errors.storage_error(exc, path=writes_to, then=rerun)


def logged_failure(log_path: str | None) -> errors.DpscaleError | None:
    """Why a worker process failed, if Beam's log says so: its dpscale error (a damaged shard...)
    as it is, any other exception as a ``PipelineError``; None if the log holds no traceback.

    Beam's multi-process runner sometimes stops without ending the run after a worker's bundle
    failed; the worker's traceback is then only in the log.
    """
    if not log_path:
        return None
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    for name, message in reversed(_LOGGED_USER_ERROR.findall(text)):
        kind = getattr(errors, name, None)
        if isinstance(kind, type) and issubclass(kind, errors.DpscaleError):
            return kind(_BEAM_CONTEXT.sub("", message.strip()))
    failures = _LOGGED_EXCEPTION.findall(text)
    if not failures:
        return None
    line = _BEAM_CONTEXT.sub("", failures[-1].strip())
    return errors.PipelineError(f"the Beam pipeline failed: {line[:300]} (Beam's log: {log_path}); {TRY_IN_MEMORY}")


def one_line(exc: BaseException) -> str:
    """The last meaningful line of an error Beam wrapped around a worker's traceback."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    failures = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and ":" in ln]
    text = (failures or lines or [type(exc).__name__])[-1]
    return text if len(text) < 300 else text[:297] + "..."
