"""The sweep's plot, rendered: every text inside the figure, no label over another, the baseline drawn when given.

The held-out sweep's plot had its title cut off, the epsilon-8 label past the right edge, the
epsilon-1 label over the legend and no baseline; each kind is drawn here and its text boxes measured.
"""

import itertools

import matplotlib.text
import pytest

from dpscale.training import sweep_plot, sweep_report

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
LONG_TITLE = (
    "best learning rate, augmult, batch-size per epsilon, chosen on held-out training rows; test scores "
    "of the chosen runs"
)


def _chosen():
    """Accuracy low at the smallest epsilon (where the legend used to be) and long setting labels."""
    return [
        {
            "epsilon": e,
            "learning_rate": lr,
            "augmult": 16,
            "batch_size": 4096,
            "test_median_top1": m,
            "test_min_top1": m - 0.02,
            "test_max_top1": m + 0.01,
        }
        for e, lr, m in zip(EPSILONS, (1.0, 2.0, 4.0, 2.0, 4.0, 8.0), (0.12, 0.55, 0.7, 0.78, 0.82, 0.84))
    ]


def _summary(split):
    rows = []
    for (lr, augmult), e in itertools.product(itertools.product((1.0, 2.0, 4.0), (1, 16)), EPSILONS):
        m = 0.3 + 0.1 * lr + 0.02 * augmult + 0.05 * EPSILONS.index(e)
        rows.append(
            {
                "epsilon": e,
                "learning_rate": lr,
                "augmult": augmult,
                "batch_size": 4096,
                "split": split,
                "private": True,
                "repeats": 3,
                "median_top1": m,
                "min_top1": m - 0.03,
                "max_top1": m + 0.02,
            }
        )
    return rows


def _baseline():
    return [
        {
            "epsilon": float("inf"),
            "learning_rate": 0.5,
            "augmult": a,
            "batch_size": 4096,
            "split": "test",
            "private": False,
            "repeats": 3,
            "median_top1": m,
            "min_top1": m - 0.01,
            "max_top1": m + 0.01,
        }
        for a, m in ((1, 0.91), (16, 0.93))
    ]


KINDS = {
    "held-out": dict(summary=[], chosen=_chosen(), title=LONG_TITLE),
    "simulated": dict(
        summary=_summary("holdout"),
        chosen=[],
        epsilon_label="target epsilon",
        title="TAN simulation at batch 256, NOT private at these epsilons: every setting (holdout scores)",
    ),
    "plain": dict(
        summary=_summary("test"), chosen=[], title="every grid point; none chosen (no --holdout): test scores"
    ),
}


def _texts(fig):
    """Every text drawn: tick labels only of the ticks in view (matplotlib keeps the others, undrawn)."""
    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                labels = (tick.label1, tick.label2)
                ticks.update(map(id, labels))
                if low <= tick.get_loc() <= high:
                    drawn += [label for label in labels if label.get_visible()]
    others = [t for t in fig.findobj(matplotlib.text.Text) if id(t) not in ticks and t.get_visible()]
    return [t for t in [*drawn, *others] if t.get_text().strip()]


@pytest.mark.parametrize("baseline", [False, True], ids=["no-baseline", "baseline"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_text_is_inside_the_figure_and_no_label_covers_another(kind, baseline):
    fig = sweep_plot.figure(
        options=("learning_rate", "augmult", "batch_size"), baseline=_baseline() if baseline else (), **KINDS[kind]
    )
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    texts = _texts(fig)
    for text in texts:
        box = text.get_window_extent(renderer)
        assert (
            box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1
        ), f"{text.get_text()!r} at {box} leaves the figure {frame}"
    ax = fig.axes[0]
    labels = [t for t in texts if isinstance(t, matplotlib.text.Annotation)]
    assert len(labels) == (len(EPSILONS) if kind == "held-out" else 0)
    axes_box = ax.get_window_extent(renderer)
    for label in labels:  # labels of points stay inside the axes, clear of the legend
        box = label.get_window_extent(renderer)
        assert axes_box.contains(box.x0, box.y0) and axes_box.contains(box.x1, box.y1), label.get_text()
        assert not box.overlaps(fig.legends[0].get_window_extent(renderer)), label.get_text()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in [*labels, ax.title, *fig.legends[0].get_texts()]]
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
    drawn = [a for a in ax.get_children() if a.get_gid() == sweep_plot.BASELINE_GID]
    assert bool(drawn) == baseline
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert sum("non-private baseline, NOT private" in t for t in legend) == (2 if baseline else 0)


def test_the_baseline_is_drawn_only_into_a_plot_that_is_a_private_diagnostic(tmp_path):
    with pytest.raises(ValueError, match="baseline"):
        sweep_report.plot(
            str(tmp_path),
            options=("learning_rate",),
            diagnostic=False,
            baseline=_baseline(),
            summary=_summary("test"),
            chosen=[],
            title="t",
        )
    path = sweep_report.plot(
        str(tmp_path),
        options=("learning_rate",),
        diagnostic=True,
        baseline=_baseline(),
        summary=_summary("test"),
        chosen=[],
        title="t",
    )
    assert path.endswith("accuracy_vs_epsilon.NOT-PRIVATE.png") and (tmp_path / path.rsplit("/", 1)[-1]).exists()
