"""Where a sweep is: run k of n, its grid point and the sweep's time left, on every progress line of a run.

A sweep trains its runs one after the other. Each run's own bar (``dpscale train``'s) is labelled
``sweep run k of n (NAME)``, NAME being the run's directory under ``runs/`` (its grid point), and,
once a run has been trained in this invocation, ``sweep ~H:MM:SS left``: the mean wall time of the
runs trained so far (scoring included) times the runs still to train. A finished run found in
OUT_DIR is reused: it costs nothing and counts for nothing. The estimate lives on stderr only;
nothing here is written to a file (per-run times of private runs are a private diagnostic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

from dpscale.progress import clock, within


@dataclasses.dataclass
class SweepProgress:
    """Counts and times of one sweep invocation's runs (mutable: it follows the sweep)."""

    total: int  # runs of the grid, baselines included
    to_train: int  # of those, not finished when the sweep began
    trained: int = 0
    reused: int = 0
    training_seconds: float = 0.0
    began: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float | None:
        """Seconds left at the mean time of the runs trained so far; None before the first."""
        if not self.trained:
            return None
        return self.training_seconds / self.trained * max(self.to_train - self.trained, 0)

    def label(self, index: int, name: str) -> str:
        left = self.left()
        return f"sweep run {index} of {self.total} ({name}" + (f"; sweep ~{clock(left)} left)" if left else ")")

    @contextlib.contextmanager
    def run(self, index: int, name: str, *, finished: bool) -> Iterator[None]:
        """Around the ``index``-th run (1-based): labels its bars; counts it as reused when ``finished``."""
        started = time.monotonic()
        with within(self.label(index, name)):
            yield
        if finished:
            self.reused += 1
        else:
            self.trained += 1
            self.training_seconds += time.monotonic() - started

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.began
