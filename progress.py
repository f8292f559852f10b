"""The one progress bar of dpscale, drawn on stderr so that stdout carries only a command's result.

Training steps, audited models and Beam pipelines all report through ``progress_bar``::

    with progress_bar("train", total=steps, fields=("epsilon",), starting="compiling the DP step") as bar:
        for step in range(steps):
            ...
            bar.advance(epsilon=f"eps {eps:.3f}")

A disabled bar (``enabled=False``) accepts the same calls and draws nothing, so callers never
branch on it. rich draws the bar live on a terminal; elsewhere (a log file, a batch job) one
plain line is printed when the bar opens, one every ``LINE_EVERY_SECONDS`` and one at the end
(unless the last one already showed the end), so an hours-long run shows it is alive.

What the figures mean, the same on a terminal and in a log:

* the throughput (with a ``unit``, ``("examples", batch_size)``: what one count is worth), e.g.
  ``412 examples/s``: the counts done since the bar opened, times the unit, over the wall time since
  it opened, start-up and compilation included. It is the definition of the ``*_per_second``
  fields of the JSON results too, whose time is measured over the same span;
* the time left: from the pace *after the first count* only, so that a first step that compiles
  (minutes) does not turn into an ETA of hours; none is shown before a second count;
* ``starting`` says what happens before the first count (``compiling the DP step``), at once.

``within`` names the larger task a bar belongs to (``run 3 of 12: eps 2, lr 2, r0``): every bar
opened inside it is labelled with it. ``status`` is for work without counts (a calibration): a
line only if it lasts more than a few seconds. None of this writes anything but stderr.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

LINE_EVERY_SECONDS = 60.0
STATUS_AFTER_SECONDS = 3.0  # ``status`` says something only when the work lasts longer than this

_WITHIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("dpscale_progress_within", default=())


class Bar:
    """A handle on one bar; every method is a no-op when the bar is disabled."""

    def __init__(self, progress: Any = None, task: Any = None, pace: _Pace | None = None) -> None:
        self._progress, self._task, self._pace = progress, task, pace  # pace: kept here for rich's bar

    def advance(self, count: int = 1, **fields: str) -> None:
        if self._pace is not None:
            self._pace.count(self._pace.completed + count)
        if self._progress is not None:
            self._progress.update(self._task, advance=count, **fields)

    def update(self, *, completed: int | None = None, **fields: str) -> None:
        if self._pace is not None and completed is not None:
            self._pace.count(completed)
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, **fields)


class _Pace:
    """When a bar opened and when its first count came: the throughput over the whole span, the time
    left from the counts after the first (the first may include start-up or compilation)."""

    def __init__(self, total: int, completed: int, since: float | None = None) -> None:
        self.total, self.initial, self.completed = total, completed, completed
        self.opened = time.monotonic() if since is None else since
        self.first: tuple[float, int] | None = None  # (when, completed) at the first count

    def count(self, completed: int) -> None:
        self.completed = completed
        if self.first is None and completed > self.initial:
            self.first = (time.monotonic(), completed)

    def per_second(self, now: float) -> float | None:
        """Counts per second since the bar opened (the JSON results' definition)."""
        done, elapsed = self.completed - self.initial, now - self.opened
        return done / elapsed if done > 0 and elapsed > 0 else None

    def left(self, now: float) -> float | None:
        """Seconds left at the pace since the first count; None before a second count."""
        if self.first is None or self.completed <= self.first[1] or self.completed >= self.total:
            return None
        return (self.total - self.completed) * (now - self.first[0]) / (self.completed - self.first[1])


class _Lines:
    """rich's ``Progress.update`` for a stream that is not a terminal: a dated line at most every
    ``every`` seconds (rich would print nothing until the end)."""

    def __init__(
        self,
        label: str,
        total: int,
        completed: int,
        every: float,
        unit: tuple[str, float] | None = None,
        starting: str = "",
        since: float | None = None,
    ) -> None:
        self.label, self.total, self.every, self.unit, self.starting = label, total, every, unit, starting
        self.pace = _Pace(total, completed, since)
        self.fields: dict[str, str] = {}
        self.last = self.pace.opened
        self.shown: tuple[int, tuple[str, ...]] | None = None  # the state the last line showed

    @property
    def start(self) -> float:  # when the bar opened (tests move it back in time)
        return self.pace.opened

    @start.setter
    def start(self, value: float) -> None:
        self.pace.opened = value

    @property
    def completed(self) -> int:
        return self.pace.completed

    def update(self, task: Any, *, advance: int | None = None, completed: int | None = None, **fields: str) -> None:
        if completed is None and advance:
            self.pace.count(self.pace.completed + advance)
        elif completed is not None and completed != self.pace.completed:
            self.pace.count(completed)
        self.fields.update(fields)
        if time.monotonic() - self.last >= self.every:
            self.line()

    def opening(self) -> None:
        """The line that says at once that work has begun (and what comes before the first count)."""
        if self.starting:
            print(
                time.strftime("%H:%M:%S"),
                f"{self.label}: {self.completed}/{self.total}, {self.starting} ...",
                file=sys.stderr,
                flush=True,
            )

    def closing(self) -> None:
        """The final state, unless the last line already showed it."""
        if self.shown != self._state():
            self.line()

    def _state(self) -> tuple[int, tuple[str, ...]]:
        return self.completed, tuple(v for v in self.fields.values() if v)

    def line(self) -> None:
        self.last = now = time.monotonic()
        pace, elapsed = self.pace, now - self.pace.opened
        speed, left = pace.per_second(now), pace.left(now)
        parts = [
            f"{self.label}: {self.completed}/{self.total}",
            *(v for v in self.fields.values() if v),
            *([rate(speed * self.unit[1], self.unit[0])] if self.unit and speed else []),
            f"{clock(elapsed)} elapsed",
            *([f"~{clock(left)} left"] if left is not None else []),
        ]
        self.shown = self._state()
        print(time.strftime("%H:%M:%S"), ", ".join(parts), file=sys.stderr, flush=True)


def rate(per_second: float, unit: str) -> str:
    """A throughput for people: ``412 examples/s``, ``3.1 images/s``."""
    return f"{per_second:,.0f} {unit}/s" if per_second >= 100 else f"{per_second:.3g} {unit}/s"


def clock(seconds: float) -> str:
    """A duration for people: ``4:05``, ``1:02:03``."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


@contextlib.contextmanager
def within(text: str) -> Iterator[None]:
    """Label every bar opened inside with ``text`` (the larger task it is part of)."""
    token = _WITHIN.set((*_WITHIN.get(), text))
    try:
        yield
    finally:
        _WITHIN.reset(token)


def _labelled(label: str) -> str:
    return " | ".join((*_WITHIN.get(), label))


@contextlib.contextmanager
def progress_bar(
    label: str,
    *,
    total: int,
    completed: int = 0,
    enabled: bool = True,
    fields: Sequence[str] = (),
    transient: bool = False,
    unit: tuple[str, float] | None = None,
    starting: str = "",
    since: float | None = None,
) -> Iterator[Bar]:
    """A bar over ``total`` units labelled ``label``, with free-text ``fields`` shown after the count.
    ``transient``: on a terminal the bar is erased when done (away from one, the last line stays).
    ``unit``: (name, how many of them one count is), to show the throughput. ``starting``: what
    happens before the first count, shown at once. ``since``: when the work began
    (``time.monotonic()``; default: now), the start of the throughput's time, as the result's."""
    if not enabled:
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    label = _labelled(label)
    pace = _Pace(total, completed, since)

    class RateColumn(ProgressColumn):
        """The throughput as the JSON results define it: counts since the bar opened over its time."""

        def render(self, task: Any) -> Text:
            speed = pace.per_second(time.monotonic())
            return Text(rate(speed * unit[1], unit[0]) if speed else "")

    class LeftColumn(ProgressColumn):
        """The time left at the pace after the first count; before it, what is happening."""

        def render(self, task: Any) -> Text:
            if pace.first is None:
                return Text(f"{starting} ..." if starting else "")
            left = pace.left(time.monotonic())
            return Text(f"~{clock(left)} left" if left is not None else "")

    console = Console(stderr=True)
    if not (console.is_terminal or console.is_jupyter):  # a notebook gets rich's live widget
        lines = _Lines(label, total, completed, LINE_EVERY_SECONDS, unit, starting, since)
        lines.opening()
        yield Bar(lines, None)  # the lines keep their own pace
        lines.closing()  # a log keeps the final state, transient or not
        return
    columns = (
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        *(TextColumn(f"{{task.fields[{name}]}}") for name in fields),
        *([RateColumn()] if unit else []),
        LeftColumn(),
    )
    with Progress(*columns, console=console, transient=transient) as progress:
        task = progress.add_task(label, total=total, completed=completed, **{name: "" for name in fields})
        yield Bar(progress, task, pace)


@contextlib.contextmanager
def status(text: str, *, enabled: bool = True, after: float | None = None) -> Iterator[None]:
    """Work without counts (a calibration): if it lasts more than ``after`` seconds (default
    ``STATUS_AFTER_SECONDS``), a dated line says what it is, then one every ``LINE_EVERY_SECONDS``."""
    if not enabled:
        yield
        return
    label, began, done = _labelled(text), time.monotonic(), threading.Event()

    def report() -> None:
        wait = STATUS_AFTER_SECONDS if after is None else after
        while not done.wait(wait):
            print(
                time.strftime("%H:%M:%S"),
                f"{label} ..., {clock(time.monotonic() - began)} elapsed",
                file=sys.stderr,
                flush=True,
            )
            wait = LINE_EVERY_SECONDS

    thread = threading.Thread(target=report, name="dpscale-status", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
