"""Sweep summaries, the choice on held-out rows, and the plot's labels."""

import os

import matplotlib.pyplot as plt
import pytest

from dpscale.training import sweep_report


def _rows(split):
    return [
        {"epsilon": eps, "learning_rate": lr, "ema_top1": acc, "private": True, "split": split}
        for eps, lr, acc in [
            (1.0, 1.0, 0.5),
            (1.0, 1.0, 0.7),
            (1.0, 2.0, 0.6),
            (1.0, 2.0, 0.62),
            (2.0, 1.0, 0.8),
            (2.0, 2.0, 0.8),
            (4.0, 1.0, 0.9),
            (8.0, 1.0, 0.95),
        ]
    ]


def test_summaries_are_per_setting_and_the_choice_is_the_best_median_first_on_ties():
    summary = sweep_report.summarize(_rows("holdout"), ["learning_rate"])
    first = summary[0]
    assert (first["epsilon"], first["learning_rate"], first["repeats"]) == (1.0, 1.0, 2)
    assert (first["median_top1"], first["min_top1"], first["max_top1"]) == (pytest.approx(0.6), 0.5, 0.7)
    chosen = sweep_report.choose(summary, ["learning_rate"])
    assert [(c["epsilon"], c["learning_rate"]) for c in chosen] == [(1.0, 2.0), (2.0, 1.0), (4.0, 1.0), (8.0, 1.0)]


def test_a_choice_on_the_test_split_is_impossible():
    with pytest.raises(ValueError, match="test split"):
        sweep_report.choose(sweep_report.summarize(_rows("test"), ["learning_rate"]), ["learning_rate"])


@pytest.fixture
def figure(monkeypatch):
    """The figure ``plot`` draws (captured when it is closed)."""
    kept = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig) or close(fig))
    return kept


def test_the_plot_says_how_points_were_chosen_and_labels_epsilon_plainly(tmp_path, figure):
    summary = sweep_report.summarize(_rows("holdout"), ["learning_rate"])
    chosen = [
        c | {"test_median_top1": 0.5, "test_min_top1": 0.4, "test_max_top1": 0.6}
        for c in sweep_report.choose(summary, ["learning_rate"])
    ]
    sweep_report.plot(
        str(tmp_path),
        summary=summary,
        chosen=chosen,
        options=["learning_rate"],
        title="best learning rate per epsilon, chosen on held-out training rows",
        diagnostic=True,
    )
    (fig,) = figure
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    assert "chosen on held-out" in ax.get_title() and "chosen on held-out" in fig.legends[0].get_texts()[0].get_text()
    assert {t.get_text() for t in ax.texts} == {"lr 2", "lr 1"}  # each point names its chosen setting
    assert os.stat(tmp_path / "accuracy_vs_epsilon.NOT-PRIVATE.png").st_mode & 0o777 == 0o600


def test_without_a_choice_every_setting_is_a_line(tmp_path, figure):
    summary = sweep_report.summarize(_rows("test"), ["learning_rate"])
    sweep_report.plot(
        str(tmp_path), summary=summary, chosen=[], options=["learning_rate"], title="none chosen", diagnostic=False
    )
    (fig,) = figure
    assert [line.get_text() for line in fig.legends[0].get_texts()] == ["lr 1", "lr 2"]
    assert os.path.exists(tmp_path / "accuracy_vs_epsilon.png")
