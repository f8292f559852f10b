"""What the ``dpscale`` command line writes, and where: a command's result is one line of strict JSON on
stdout; notes, warnings, progress lines and errors go to stderr, each a ``dpscale: ...`` line.

User errors (``DpscaleError``, storage faults and click's own usage errors) become one line and
exit code 2, never a traceback. Of the library it imports only the errors, so that every command
(``cli``, ``cli_prepare``) writes the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import click

from dpscale.errors import DpscaleError, PipelineStalledError, storage_error


class DpscaleGroup(click.Group):
    """A click group whose user errors are one line on stderr with exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D401 - click API
        with _warnings_as_lines():
            self._main(*args, **kwargs)

    def _main(self, *args: Any, **kwargs: Any) -> None:
        kwargs["standalone_mode"] = False
        try:
            super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("dpscale: aborted", err=True)
            sys.exit(130)
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
