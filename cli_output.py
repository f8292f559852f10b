"""What the ``dpscale`` command line writes, and where: a command's result is one line of strict JSON on
stdout; notes, warnings, progress lines and errors go to stderr, each a ``dpscale: ...`` line.

User errors (``DpscaleError``, storage faults and click's own usage errors) become one line and
exit code 2, never a traceback; Ctrl-C becomes one line (with how to continue, where there is
something to continue) and exit code 130 (``end_promptly_on_interrupt``). Of the library it imports
only the errors, so that every command (``cli``, ``cli_prepare``) writes the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from dpscale.errors import DpscaleError, PipelineStalledError, storage_error


class DpscaleGroup(click.Group):
    """A click group whose user errors are one line on stderr with exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        given = args[0] if args else kwargs.get("args")
        _invoked[:] = list(sys.argv[1:] if given is None else given)
        with _warnings_as_lines():
            self._main(*args, **kwargs)

    def _main(self, *args: Any, **kwargs: Any) -> None:
        kwargs["standalone_mode"] = False
        try:
            super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:  # Ctrl-C while click parsed the flags
            click.echo(interrupted_line(), err=True)
            sys.exit(INTERRUPTED)
        except click.ClickException as exc:
            click.echo(f"dpscale: error: {exc.format_message()}", err=True)
            sys.exit(2)
        except OSError as exc:  # a full disk, a read-only file system, missing permissions: one line
            fault = storage_error(exc)
            if fault is None:
                raise
            click.echo(f"dpscale: error: {fault}", err=True)
            sys.exit(2)
        except DpscaleError as exc:
            message = " ".join(str(exc).split())
            click.echo(f"dpscale: error: {message}", err=True)
            if isinstance(exc, PipelineStalledError):  # Beam's stuck threads would block exit
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(2)
            sys.exit(2)
        sys.exit(0)

    def invoke(self, ctx: click.Context) -> Any:
        """A command; Ctrl-C (``KeyboardInterrupt`` where ``end_promptly_on_interrupt`` is not in force: the
        command line called in-process) is its one line and exit code 130, as in the command line's own process."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            click.echo(exc.line if isinstance(exc, _Interrupted) else interrupted_line(), err=True)
            sys.exit(INTERRUPTED)


@contextlib.contextmanager
def _warnings_as_lines() -> Any:
    """While a command runs, dpscale's logged warnings (e.g. a fixed seed) read ``dpscale: warning: ...``
    like every other warning, instead of in the root logger's format (stage progress lines have
    their own handler, ``show_stage_progress``, with the same format for warnings). dpscale's Python
    warnings are logged as well, so they are not shown twice. Undone afterwards: the CLI may run in-process."""
    import warnings

    log = logging.getLogger("dpscale")
    handler = _StderrHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_StageFormatter())
    propagate = log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"dpscale\.")
            yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


class _StageFormatter(logging.Formatter):
    """Progress lines with the time of day; warnings and errors as ``dpscale: warning: ...``, like every other."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            return f"dpscale: {record.levelname.lower()}: {record.getMessage()}"
        return super().format(record)


def _drop_beam_bigquery_warning(record: logging.LogRecord) -> bool:
    """Beam warns on import that the optional BigQuery client is missing; we never use it."""
    return not str(record.msg).startswith("apitools not found")


def _drop_beam_filesystem_warnings(record: logging.LogRecord) -> bool:
    """Beam warns on import that the file systems of extras not installed cannot be loaded (``Failed to import
    GCSFileSystem; ...`` on a plain install before Beam 2.78, which loads that one without the GCS client).
    dpscale reads and writes ``gs://`` itself (``files``), and a ``gs://`` path without the gcp extra is already
    one line naming what to install."""
    return not str(record.msg).startswith("Failed to import ")


def quiet_library_logs() -> None:
    """Keep absl/dp-accounting chatter (bisection convergence warnings) off the CLI."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # absl comes with dp-accounting; tolerate its absence
        pass
    logging.getLogger("absl").setLevel(logging.ERROR)
    root = logging.getLogger()
    if _drop_beam_bigquery_warning not in root.filters:
        root.addFilter(_drop_beam_bigquery_warning)
    beam_filesystems = logging.getLogger("apache_beam.io.filesystems")  # a logger's filter sees only its own records
    if _drop_beam_filesystem_warnings not in beam_filesystems.filters:
        beam_filesystems.addFilter(_drop_beam_filesystem_warnings)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (the CLI's stderr, also when the CLI is called in-process)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def show_stage_progress(log: logging.Logger) -> None:
    """Print a Beam stage's progress lines (one per stage and split) once, with a timestamp."""
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_StageFormatter())
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # Beam configures the root logger too: print once
    logging.getLogger("apache_beam").setLevel(logging.WARNING)


def print_json_line(payload: dict) -> None:
    """One line of strict JSON (non-finite numbers such as a non-private epsilon become "inf")."""
    import json
    import math

    def strict(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(v) for v in value]
        return value

    click.echo(json.dumps(strict(payload), sort_keys=True, default=str, allow_nan=False))


def per_second(count: int, seconds: float) -> float:
    """Throughput over a stage's whole wall time (start-up included), as the JSON result reports it."""
    return round(count / seconds, 1) if seconds > 0 else 0.0


def note(line: str) -> None:
    """A line for the reader: on stderr, so stdout holds only the command's JSON result."""
    click.echo(line, err=True)


def echo_warnings(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        click.echo(f"dpscale: warning: {warning}", err=True)


def under_way(label: str) -> None:
    """A dated line on stderr at once, for a command whose libraries and first result take seconds (an
    accountant) before its stage can say anything: the user sees that it started, and what it does."""
    click.echo(f"{time.strftime('%H:%M:%S')} {label} ...", err=True)


_invoked: list[str] = []  # the arguments of the command running now


def invoked_command() -> str:
    """The command running now, as typed (quoted for a shell): what to run again to continue it."""
    return shlex.join(["dpscale", *_invoked])


def rerun_hint(what: str, why: str) -> contextlib.AbstractContextManager:
    """On Ctrl-C, the interrupted line says to continue ``what`` by running the same command again, and ``why``
    that continues it (work done is reused)."""
    line = f"continue {what} with the same command, `{invoked_command()}` ({why})"
    return interrupt_hint(lambda: line)


# ---- Ctrl-C: one line, then the process ends at once ------------------------------------------

INTERRUPTED = 130  # the exit code of a command ended by Ctrl-C (128 + SIGINT, as shells report it)
_hints: list[Callable[[], str | None]] = []


@contextlib.contextmanager
def interrupt_hint(hint: Callable[[], str | None]) -> Iterator[None]:
    """Inside, the line of an interrupt adds what ``hint()`` says, e.g. how to continue the run it stopped.

    ``hint`` may be called from another thread while the main one is anywhere: it must not import.
    """
    _hints.append(hint)
    try:
        yield
    except KeyboardInterrupt as exc:  # the line, said while the hint is known
        raise exc if isinstance(exc, _Interrupted) else _Interrupted(interrupted_line()) from None
    finally:
        _hints.remove(hint)


class _Interrupted(KeyboardInterrupt):
    """A Ctrl-C that knows its line (``interrupt_hint``)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def interrupted_line() -> str:
    """``dpscale: interrupted``, and how to continue where there is something to continue."""
    for hint in reversed(_hints):
        try:
            said = hint()
        except Exception:  # noqa: BLE001 - the line must come, whatever the hint's storage does
            said = None
        if said:
            return f"dpscale: interrupted; {said}"
    return "dpscale: interrupted"


def end_promptly_on_interrupt() -> None:
    """From now on Ctrl-C (SIGINT) prints ``interrupted_line()`` and ends the process within moments.

    Python runs a signal handler only between two bytecodes of the main thread, which may be inside
    an XLA compilation or a C library for minutes; and the usual exit after ``KeyboardInterrupt``
    joins the libraries' threads and runs their exit hooks (JAX, orbax, Beam, gRPC), which crashed
    (segmentation fault) or hung for a minute when a compilation or a pipeline was under way. So the
    signal also wakes a thread of ours (``signal.set_wakeup_fd``), which writes the line, stops the
    worker processes this one started (a local Beam runner's) and ends the process with ``os._exit``.
    That loses nothing a kill would not: every file dpscale writes appears whole or not at all
    (``files.write_atomic``; orbax renames a finished checkpoint into place), so a stopped run
    continues from its last checkpoint. Call it from the main thread of a process that is only the
    command line: a library's caller keeps ``KeyboardInterrupt``.
    """
    with contextlib.suppress(ImportError):  # now: importing it while ending could wait on the main thread's import
        import psutil  # noqa: F401
    receive, send = socket.socketpair()
    send.setblocking(False)
    signal.signal(signal.SIGINT, lambda signum, frame: _end())  # when the main thread gets there first
    signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            if signal.SIGINT in receive.recv(64):
                _end()

    threading.Thread(target=watch, name="dpscale-interrupt", daemon=True).start()
    _keep.extend((receive, send))


_keep: list[socket.socket] = []  # the wake-up pair lives as long as the process
_ending = threading.Lock()


def _end() -> None:
    """Write the interrupted line once, stop this process's children, and exit with ``INTERRUPTED``."""
    if not _ending.acquire(blocking=False):
        return  # another thread is ending the process
    line = interrupted_line()
    out, err = sys.stdout, sys.stderr
    with contextlib.suppress(Exception):
        out.flush()
    # The main thread runs on until os._exit: whatever it would print now (a progress line) goes nowhere,
    # so that the interrupted line stays the last one.
    with contextlib.suppress(Exception):
        sys.stdout = sys.stderr = open(os.devnull, "w")  # open until the process ends
    _stop_children()
    with contextlib.suppress(Exception):
        terminal = err.isatty()
        # on a terminal: past a live progress bar, and the cursor it hid shown again
        err.write(("\n\x1b[?25h" if terminal else "") + line + "\n")
        err.flush()
    os._exit(INTERRUPTED)


def _stop_children() -> None:
    """Kill the processes this one started (a local Beam runner's workers), which would outlive it."""
    try:
        import psutil
    except ImportError:
        return
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
