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


def test_a_bar_with_a_unit_shows_the_throughput_in_that_unit(capsys):
    lines = progress._Lines("train", 10, 0, 3600.0, ("examples", 256))
    lines.start -= 4.0  # as if started 4 s ago
    lines.update(None, advance=2)  # 2 steps of 256 examples
    lines.line()
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"\d\d:\d\d:\d\d train: 2/10, 128 examples/s, 0:04 elapsed, ~0:1\d left", line), line
    assert progress.rate(1234.5, "images") == "1,234 images/s" and progress.rate(3.14159, "images") == "3.14 images/s"


def test_a_bar_without_a_unit_shows_no_throughput(capsys):
    lines = progress._Lines("copy model", 4, 0, 3600.0)
    lines.start -= 4.0
    lines.update(None, advance=2)
    lines.line()
    assert "/s" not in capsys.readouterr().err
