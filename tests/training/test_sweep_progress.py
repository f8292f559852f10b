"""A sweep's place in its grid and its time left, from the runs trained so far (reused runs cost nothing)."""

from dpscale import progress as bars
from dpscale.training import sweep_progress


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_time_left_is_the_mean_trained_run_times_the_runs_left_to_train(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sweep_progress.time, "monotonic", clock)
    sweep = sweep_progress.SweepProgress(total=5, to_train=4)
    assert sweep.label(1, "eps1-lr2-r0") == "sweep run 1 of 5 (eps1-lr2-r0)"  # nothing to go by yet
    with sweep.run(1, "eps1-lr2-r0", finished=True):  # reused: no time, not a trained run
        pass
    for index in (2, 3):
        with sweep.run(index, f"eps{index}-lr2-r0", finished=False):
            clock.now += 60.0
    assert (sweep.trained, sweep.reused) == (2, 1)
    assert sweep.label(4, "eps4-lr2-r0") == "sweep run 4 of 5 (eps4-lr2-r0; sweep ~2:00 left)"  # 2 left x 60 s


def test_a_runs_bars_carry_its_place_in_the_sweep(capsys):
    sweep = sweep_progress.SweepProgress(total=2, to_train=2)
    with sweep.run(2, "eps8-lr2-r0", finished=False), bars.progress_bar("train", total=1) as bar:
        bar.advance()
    assert "sweep run 2 of 2 (eps8-lr2-r0) | train: 1/1" in capsys.readouterr().err
