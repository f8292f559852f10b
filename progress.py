"""The one progress bar of dpscale, drawn on stderr so that stdout carries only a command's result.

Training steps, audited models and Beam pipelines all report through ``progress_bar``::

    with progress_bar("train", total=steps, fields=("epsilon",)) as bar:
        for step in range(steps):
            ...
            bar.advance(epsilon=f"eps {eps:.3f}")

A disabled bar (``enabled=False``) accepts the same calls and draws nothing, so callers never
branch on it. rich draws the bar live on a terminal; elsewhere it prints the final state once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


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


@contextlib.contextmanager
def progress_bar(label: str, *, total: int, completed: int = 0, enabled: bool = True,
                 fields: Sequence[str] = (), transient: bool = False) -> Iterator[Bar]:
    """A bar over ``total`` units labelled ``label``, with free-text ``fields`` shown after the count."""
    if not enabled:
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(),
               *(TextColumn(f"{{task.fields[{name}]}}") for name in fields), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=transient) as progress:
        task = progress.add_task(label, total=total, completed=completed, **{name: "" for name in fields})
        yield Bar(progress, task)
