"""The progress bar away from a terminal: dated lines while the work runs, so a long job's log shows it is alive."""

import re

from dpscale import progress


def test_without_a_terminal_a_line_is_printed_per_interval_and_at_the_end(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 0.0)  # every update prints
    with progress.progress_bar("copy model", total=4, completed=1, fields=("loss",)) as bar:
        bar.update(completed=2, loss="loss 0.700")
        bar.advance(loss="loss 0.600")
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == ""
    assert len(lines) == 3
    assert re.fullmatch(r"\d\d:\d\d:\d\d copy model: 2/4, loss 0\.700, 0:\d\d elapsed, ~0:\d\d left", lines[0])
    assert "3/4, loss 0.600" in lines[1] and "left" in lines[1]
    assert lines[2].split(" ", 1)[1].startswith("copy model: 3/4, loss 0.600, ")  # the final state


def test_without_a_terminal_nothing_is_printed_between_intervals(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 3600.0)
    with progress.progress_bar("train", total=100) as bar:
        for _ in range(100):
            bar.advance()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "train: 100/100" in lines[0] and "left" not in lines[0]


def test_a_disabled_bar_prints_nothing(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 0.0)
    with progress.progress_bar("train", total=3, enabled=False) as bar:
        bar.advance()
    assert capsys.readouterr().err == ""
