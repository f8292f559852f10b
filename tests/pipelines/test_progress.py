"""Local progress: workers mark finished tasks, the launcher drives dpscale's progress bar."""

import os

from dpscale import progress as bar_module
from dpscale.pipelines.progress import LocalProgress, mark


def test_marks_are_counted_and_reported(capsys, monkeypatch):
    monkeypatch.setattr(bar_module, "LINE_EVERY_SECONDS", 3600.0)  # away from a terminal: only the last line
    with LocalProgress(8, label="work", interval=0.01) as progress:
        directory = progress.directory
        for _ in range(3):
            mark(directory, 2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "work: 6/8" in lines[0]  # marks made before the end are all counted
    assert not os.path.exists(directory)  # cleaned up
    mark(directory, 1)  # a late worker after the run: harmless no-op
    assert not os.path.exists(directory)


def test_mark_without_a_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a marker with no directory would land here
    mark(None, 5)
    mark("", 5)
    assert list(tmp_path.iterdir()) == []
