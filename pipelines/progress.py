"""Progress of a local Beam run, which the runner itself does not report while running.

Each worker drops a tiny marker file per finished read task (``mark``); a thread in the
launching process counts the markers and drives dpscale's progress bar (``dpscale.progress``:
a live bar on a terminal, dated lines in a log). Only for local runs: on a remote runner the workers cannot
reach the launcher's disk, and Beam's own monitoring takes over.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from types import TracebackType

from dpscale.progress import progress_bar


def mark(progress_dir: str | None, count: int) -> None:
    """Record that a task finished ``count`` inputs (no-op without a progress dir)."""
    if progress_dir and os.path.isdir(progress_dir):
        path = os.path.join(progress_dir, uuid.uuid4().hex)
        with open(path + ".tmp", "w") as f:
            f.write(str(count))
        os.replace(path + ".tmp", path)


def _done(progress_dir: str) -> int:
    total = 0
    for name in os.listdir(progress_dir):
        if not name.endswith(".tmp"):
            try:
                with open(os.path.join(progress_dir, name)) as f:
                    total += int(f.read() or 0)
            except (OSError, ValueError):
                pass
    return total


class LocalProgress:
    """Context manager: ``.directory`` for the workers, the progress bar for the user.

    ``since``: when the stage began (``time.monotonic()``), so that the bar's throughput is the
    stage's result's (counts over the stage's whole time); default: when the bar opens.
    """

    def __init__(
        self, total: int, *, label: str, interval: float = 0.5, unit: str | None = None, since: float | None = None
    ) -> None:
        self.total, self.label, self.interval, self.unit, self.since = total, label, interval, unit, since
        self.directory = tempfile.mkdtemp(prefix="dpscale-progress-")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> LocalProgress:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _watch(self) -> None:
        # transient: on a terminal the bar gives way to the stage's result; a log keeps a last line
        with progress_bar(
            self.label, total=self.total, transient=True, since=self.since, unit=(self.unit, 1) if self.unit else None
        ) as bar:
            stopped = False
            while not stopped:  # one more count after the stop: the last marks are in the last line
                stopped = self._stop.wait(self.interval)
                bar.update(completed=min(_done(self.directory), self.total))
