"""The progress bar away from a terminal: dated lines while the work runs, so a long job's log shows it is alive."""

import re
import time

from dpscale import progress


def test_without_a_terminal_a_line_is_printed_per_interval_and_at_the_end(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 0.0)  # every update prints
    with progress.progress_bar("copy model", total=4, completed=1, fields=("loss",)) as bar:
        bar.update(completed=2, loss="loss 0.700")
        bar.advance(loss="loss 0.600")
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == ""
    assert len(lines) == 2, lines  # the last line already shows the final state: not printed twice
    # no time left after the first count (it may include compilation), one after the second
    assert re.fullmatch(r"\d\d:\d\d:\d\d copy model: 2/4, loss 0\.700, 0:\d\d elapsed", lines[0])
    assert "3/4, loss 0.600" in lines[1] and "left" in lines[1]


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
    assert re.fullmatch(r"\d\d:\d\d:\d\d train: 2/10, 128 examples/s, 0:04 elapsed", line), line
    assert progress.rate(1234.5, "images") == "1,234 images/s" and progress.rate(3.14159, "images") == "3.14 images/s"


def test_a_bar_without_a_unit_shows_no_throughput(capsys):
    lines = progress._Lines("copy model", 4, 0, 3600.0)
    lines.start -= 4.0
    lines.update(None, advance=2)
    lines.line()
    assert "/s" not in capsys.readouterr().err


class _Clock:
    """A stand-in for ``time.monotonic``: the tests move time on by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_time_left_counts_only_the_steps_after_the_first(capsys, monkeypatch):
    """A first step that compiles for 6 minutes must not become an ETA of hours (issue: 1/30 ... ~1:13:59 left)."""
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    lines = progress._Lines("train", 30, 0, 3600.0, ("examples", 10))
    clock.now += 360.0  # compilation and the first step
    lines.update(None, advance=1)
    lines.line()
    for _ in range(4):  # then 2 s a step
        clock.now += 2.0
        lines.update(None, advance=1)
    lines.line()
    first, later = capsys.readouterr().err.strip().splitlines()
    assert "left" not in first  # one count says nothing about the pace
    assert later.endswith("~0:50 left"), later  # 25 steps x 2 s, not 25 x 73 s
    # the throughput is the JSON's: every count since the bar opened over all of its time
    assert "0.136 examples/s" in later and "6:08 elapsed" in later


def test_what_comes_before_the_first_count_is_said_at_once(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 3600.0)
    with progress.progress_bar("train", total=3, starting="compiling the DP step") as bar:
        assert re.fullmatch(r"\d\d:\d\d:\d\d train: 0/3, compiling the DP step \.\.\.\n", capsys.readouterr().err)
        for _ in range(3):
            bar.advance()
    assert "train: 3/3" in capsys.readouterr().err


def test_a_line_that_shows_the_end_is_not_printed_again(capsys, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 60.0)
    with progress.progress_bar("train", total=2, fields=("eps",)) as bar:
        bar.advance(eps="eps 1.0")
        clock.now += 61.0
        bar.advance(eps="eps 2.0")  # prints: 60 s since the bar opened
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "train: 2/2, eps 2.0" in lines[0], lines


def test_bars_inside_a_larger_task_are_labelled_with_it(capsys):
    with progress.within("run 2 of 6: eps 8, lr 2, r0"), progress.progress_bar("train", total=1) as bar:
        bar.advance()
    assert "run 2 of 6: eps 8, lr 2, r0 | train: 1/1" in capsys.readouterr().err
    with progress.progress_bar("train", total=1) as bar:  # outside: the plain label again
        bar.advance()
    assert " train: 1/1" in capsys.readouterr().err


def test_a_status_speaks_only_when_the_work_takes_a_while(capsys):
    with progress.status("calibrating", after=60.0):
        pass
    assert capsys.readouterr().err == ""
    with progress.status("calibrating the batch size", after=0.01):
        time.sleep(0.2)
    assert re.fullmatch(r"\d\d:\d\d:\d\d calibrating the batch size \.\.\., 0:00 elapsed\n", capsys.readouterr().err)
