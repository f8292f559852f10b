"""The trend table of finished sweeps: grouping by the option, seed spread, the simulation beside."""

import csv

import pytest

from benchmarks import sweep_trend

FIELDS = ["epsilon", "augmult", "repeat", "private", "achieved_epsilon", "split", "top1", "ema_top1"]


def _sweep(path, rows, name="runs.NOT-PRIVATE.csv"):
    path.mkdir()
    with open(path / name, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(dict(zip(FIELDS, row)))
    return str(path)


def test_trend_groups_real_runs_and_puts_the_simulation_beside(tmp_path):
    real = _sweep(
        tmp_path / "real",
        [
            (3, 1, 0, True, 2.99, "holdout", 0.80, 0.82),
            (3, 1, 1, True, 2.99, "holdout", 0.81, 0.84),
            (3, 1, 2, True, 2.99, "holdout", 0.79, 0.83),
            (3, 4, 0, True, 2.98, "holdout", 0.85, 0.86),
        ],
    )
    sim = _sweep(tmp_path / "sim", [(3, 4, 0, True, 12.0, "holdout", 0.86, 0.87)], name="runs.csv")
    points = sweep_trend.trend(sweep_trend.read_runs(real), sweep_trend.read_runs(sim), "augmult")
    assert [p["value"] for p in points] == [1, 4] and [p["seeds"] for p in points] == [3, 1]
    assert points[0]["ema_median"] == 0.83 and (points[0]["ema_min"], points[0]["ema_max"]) == (0.82, 0.84)
    assert points[0]["last_median"] == 0.80 and points[0]["sim_median"] is None
    assert points[1]["sim_median"] == 0.87
    text = sweep_trend.table(points, "augmult")
    assert "83.00% (82.00-84.00)" in text and "+1.00" in text and "| 1 | 3 |" in text


def test_main_writes_the_plot_and_refuses_an_unfinished_sweep(tmp_path, capsys):
    real = _sweep(tmp_path / "real", [(3, 2, 0, True, 3.0, "test", 0.8, 0.81)])
    sweep_trend.main(["--option", "augmult", "--real", real, "--out", str(tmp_path / "t.png")])
    assert (tmp_path / "t.png").stat().st_size > 0 and "81.00%" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no runs.csv"):
        sweep_trend.main(["--option", "augmult", "--real", str(tmp_path)])
