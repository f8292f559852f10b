"""Local progress: workers mark finished tasks, the launcher reports quarters."""

import logging
import os
import time

from dpscale.pipelines.progress import LocalProgress, mark


def test_marks_are_counted_and_reported(caplog):
    log = logging.getLogger("test-progress")
    with caplog.at_level(logging.INFO, logger="test-progress"):
        with LocalProgress(8, label="work", log=log, interval=0.01) as progress:
            directory = progress.directory
            for _ in range(4):
                mark(directory, 2)
            deadline = time.time() + 5
            while "work: 100%" not in caplog.text and time.time() < deadline:
                time.sleep(0.02)
    assert "work: 100%" in caplog.text
    assert not os.path.exists(directory)  # cleaned up
    mark(directory, 1)  # a late worker after the run: harmless no-op
    assert not os.path.exists(directory)


def test_mark_without_directory_is_a_no_op():
    mark(None, 5)
