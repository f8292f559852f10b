"""The one progress bar of dpscale, drawn on stderr so that stdout carries only a command's result.

Training steps, audited models and Beam pipelines all report through ``progress_bar``::

    with progress_bar("train", total=steps, fields=("epsilon",)) as bar:
        for step in range(steps):
            ...
            bar.advance(epsilon=f"eps {eps:.3f}")

A disabled bar (``enabled=False``) accepts the same calls and draws nothing, so callers never
branch on it. rich draws the bar live on a terminal; elsewhere (a log file, a batch job) one
plain line is printed every ``LINE_EVERY_SECONDS`` and one at the end, so an hours-long run
shows it is alive. With a ``unit`` (``("examples", batch_size)``: what one count is worth) the bar
also shows the throughput, e.g. ``412 examples/s``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

LINE_EVERY_SECONDS = 60.0


class Bar:
    """A handle on one bar; every method is a no-op when the bar is disabled."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def advance(self, count: int = 1, **fields: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=count, **fields)

    def update(self, *, completed: int | None = None, **fields: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, **fields)


class _Lines:
    """rich's ``Progress.update`` for a stream that is not a terminal: a dated line at most every
    ``every`` seconds (rich would print nothing until the end)."""

    def __init__(self, label: str, total: int, completed: int, every: float,
                 unit: tuple[str, float] | None = None) -> None:
        self.label, self.total, self.completed, self.every, self.unit = label, total, completed, every, unit
        self.fields: dict[str, str] = {}
        self.start = self.last = time.monotonic()
        self.first = completed

    def update(self, task: Any, *, advance: int | None = None, completed: int | None = None,
               **fields: str) -> None:
        self.completed = completed if completed is not None else self.completed + (advance or 0)
        self.fields.update(fields)
        if time.monotonic() - self.last >= self.every:
            self.line()

    def line(self) -> None:
        self.last = now = time.monotonic()
        elapsed, done = now - self.start, self.completed - self.first
        left = (self.total - self.completed) * elapsed / done if done > 0 else None
        parts = [f"{self.label}: {self.completed}/{self.total}",
                 *(v for v in self.fields.values() if v),
                 *([rate(done * self.unit[1] / elapsed, self.unit[0])] if self.unit and done > 0 and elapsed > 0 else []),
                 f"{_clock(elapsed)} elapsed",
                 *([f"~{_clock(left)} left"] if left is not None and self.completed < self.total else [])]
        print(time.strftime("%H:%M:%S"), ", ".join(parts), file=sys.stderr, flush=True)


def rate(per_second: float, unit: str) -> str:
    """A throughput for people: ``412 examples/s``, ``3.1 images/s``."""
    return f"{per_second:,.0f} {unit}/s" if per_second >= 100 else f"{per_second:.3g} {unit}/s"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


@contextlib.contextmanager
def progress_bar(label: str, *, total: int, completed: int = 0, enabled: bool = True,
                 fields: Sequence[str] = (), transient: bool = False,
                 unit: tuple[str, float] | None = None) -> Iterator[Bar]:
    """A bar over ``total`` units labelled ``label``, with free-text ``fields`` shown after the count.
    ``transient``: on a terminal the bar is erased when done (away from one, the last line stays).
    ``unit``: (name, how many of them one count is), to show the throughput."""
    if not enabled:
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """rich's recent speed (counts/s) times what a count is worth."""

        def render(self, task: Any) -> Text:
            return Text(rate(task.speed * unit[1], unit[0]) if task.speed else "")

    console = Console(stderr=True)
    if not (console.is_terminal or console.is_jupyter):  # a notebook gets rich's live widget
        lines = _Lines(label, total, completed, LINE_EVERY_SECONDS, unit)
        yield Bar(lines, None)
        lines.line()  # a log keeps the final state, transient or not
        return
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(),
               *(TextColumn(f"{{task.fields[{name}]}}") for name in fields), *([RateColumn()] if unit else []),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=transient) as progress:
        task = progress.add_task(label, total=total, completed=completed, **{name: "" for name in fields})
        yield Bar(progress, task)
