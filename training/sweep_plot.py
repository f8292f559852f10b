"""A sweep's plot: accuracy against epsilon, laid out so that no text is cut off or covers another.

One line per setting when nothing was chosen, or the setting chosen per epsilon (each point
labelled with it) after a choice on held-out rows; a non-private baseline, where one is given, is a
dashed horizontal line per setting with its min-max band (it has no epsilon). The baseline is a
private diagnostic: the caller draws it only into a plot that is one too (``*.NOT-PRIVATE.*``).

Layout: matplotlib's constrained layout, the legend outside the axes (below them, where no data
is), the title wrapped to the figure's width, the epsilon axis padded so the extreme points'
labels fit, and each point's label put at the first of a few places around the point where it lies
inside the axes and clear of the labels already placed (clipped to the axes if none is free).
``tests/training/test_sweep_plot.py`` renders every kind and checks each text's box.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

from dpscale.training.grid import flag, value_text

BASELINE_GID = "baseline"  # the gid of the baseline's artists (what the tests look for)
# (dx, dy) in points, alignment: above-left first (clear of a line that rises with epsilon), then around
_OFFSETS = (
    (-5, 5, "right", "bottom"),
    (0, 7, "center", "bottom"),
    (5, 5, "left", "bottom"),
    (5, -6, "left", "top"),
    (0, -9, "center", "top"),
    (-5, -6, "right", "top"),
    (0, 20, "center", "bottom"),
    (0, -22, "center", "top"),
)


def setting_label(setting: Sequence[tuple[str, Any]]) -> str:
    """``lr 2, augmult 4``: a setting as a reader sees it."""
    short = {"learning_rate": "lr"}
    return ", ".join(f"{short.get(k, flag(k))} {value_text(v)}" for k, v in setting) or "-"


def figure(
    *,
    summary: Sequence[dict[str, Any]],
    chosen: Sequence[dict[str, Any]],
    options: Sequence[str],
    title: str,
    epsilon_label: str = "epsilon",
    baseline: Sequence[dict[str, Any]] = (),
) -> Any:
    """The plot as a matplotlib figure (``save`` writes it); ``baseline``: the baseline's summary rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    others = [o for o in options if o != "epsilon"]
    fig = plt.figure(figsize=(7.0, 4.4), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    labels = []
    if chosen:
        eps = [c["epsilon"] for c in chosen]
        med = [100 * c["test_median_top1"] for c in chosen]
        err = [
            [m - 100 * c["test_min_top1"] for m, c in zip(med, chosen)],
            [100 * c["test_max_top1"] - m for m, c in zip(med, chosen)],
        ]
        ax.errorbar(eps, med, yerr=err, marker="o", capsize=3, label="chosen on held-out rows (median, min-max)")
        labels = [(e, m, setting_label([(o, c[o]) for o in others])) for e, m, c in zip(eps, med, chosen)]
        ylabel = "test top-1 (%, EMA)"
    else:
        lines: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for s in summary:
            lines.setdefault(tuple(s[o] for o in others), []).append(s)
        for key, points in lines.items():
            points = sorted(points, key=lambda s: s["epsilon"])
            med = [100 * s["median_top1"] for s in points]
            err = [
                [m - 100 * s["min_top1"] for m, s in zip(med, points)],
                [100 * s["max_top1"] - m for m, s in zip(med, points)],
            ]
            ax.errorbar(
                [s["epsilon"] for s in points],
                med,
                yerr=err,
                marker="o",
                capsize=3,
                label=setting_label(list(zip(others, key))),
            )
        eps = sorted({s["epsilon"] for s in summary})
        ylabel = f"{summary[0]['split'] if summary else 'test'} top-1 (%, EMA, median and min-max)"
    _draw_baseline(ax, baseline, others)
    ax.set_xscale("log", base=2)
    if eps:
        ax.set_xticks(eps, [f"{e:g}" for e in eps])
        ax.set_xlim(min(eps) / 2**0.6, max(eps) * 2**0.6)  # room for the extreme points' labels
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(epsilon_label)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, width=int(fig.get_figwidth() * 120 / 5.2)), fontsize=8)  # ~5.2 px a char
    ax.grid(alpha=0.3)
    if labels:
        low, high = ax.get_ylim()
        ax.set_ylim(low - 0.08 * (high - low), high + 0.12 * (high - low))  # room above and below the points
    _legend(fig)
    _place(fig, ax, labels)
    return fig


def _legend(fig: Any) -> None:
    """Below the axes, in as many columns (3 at most) as fit the figure's width; the figure grows by its rows."""
    handles, _ = fig.axes[0].get_legend_handles_labels()
    renderer = fig.canvas.get_renderer()
    base = fig.get_figheight()
    for columns in (3, 2, 1):
        rows = math.ceil(len(handles) / columns)
        fig.set_figheight(base + 0.17 * max(rows - 1, 0))
        legend = fig.legend(loc="outside lower center", ncols=columns, fontsize=7, frameon=False)
        if columns == 1 or legend.get_window_extent(renderer).width <= fig.bbox.width * 0.98:
            return
        legend.remove()


def _draw_baseline(ax: Any, baseline: Sequence[dict[str, Any]], others: Sequence[str]) -> None:
    """One dashed line (median) and band (min-max) per baseline setting, across the whole epsilon axis."""
    styles = ("--", "-.", ":")
    for i, row in enumerate(baseline):
        setting = setting_label([(o, row[o]) for o in others if o in row])
        line = ax.axhline(
            100 * row["median_top1"],
            color="0.25",
            linestyle=styles[i % len(styles)],
            linewidth=1.2,
            label=f"non-private baseline, NOT private ({setting}; {row['split']} top-1)",
        )
        band = ax.axhspan(100 * row["min_top1"], 100 * row["max_top1"], color="0.5", alpha=0.12, linewidth=0)
        line.set_gid(BASELINE_GID)
        band.set_gid(BASELINE_GID)


def _place(fig: Any, ax: Any, labels: Sequence[tuple[float, float, str]]) -> None:
    """Each point's label at the first offset where it is inside the axes and clear of the others."""
    fig.canvas.draw()  # the constrained layout settles the axes' position first
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed: list[Any] = []
    for x, y, text in labels:
        annotation = None
        for dx, dy, ha, va in _OFFSETS:
            if annotation is not None:
                annotation.remove()
            annotation = ax.annotate(
                text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va, fontsize=7
            )
            annotation.set_in_layout(False)  # placed inside the axes: the layout need not make room
            box = annotation.get_window_extent(renderer)
            inside = box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(other) for other in placed):
                break
        else:  # nowhere free: above the point, cut to the axes
            annotation.remove()
            dx, dy, ha, va = _OFFSETS[1]
            annotation = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                ha=ha,
                va=va,
                fontsize=7,
                annotation_clip=True,
            )
            annotation.set_in_layout(False)
            annotation.set_clip_on(True)
        placed.append(annotation.get_window_extent(renderer))


def save(fig: Any, file: Any) -> None:
    """Write ``fig`` as PNG to the open binary ``file`` and free it."""
    import matplotlib.pyplot as plt

    fig.savefig(file, format="png")
    plt.close(fig)
