"""How the figures of a sweep look: colours, markers and hatches per series, legends, tidy and log axes."""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from moesim.analysis.sweep_results import is_bound

#: Okabe-Ito colours (as in moesim.analysis.plots) without the yellow, which vanishes on white, then
#: Paul Tol's muted scheme: 15 colours that stay apart; markers tell repeats apart beyond that
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#332288", "#117733", "#882255", "#999933", "#AA4499", "#44AA99", "#661100", "#888888")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
#: bars have no marker: each round of the palette after the first hatches them apart
HATCHES = ("", "///", "xxx", "...")
#: the y axis turns logarithmic when the largest value exceeds the smallest by this factor
LOG_RATIO = 10.0
#: what a log axis's label ends with
LOG_NOTE = ", log scale"


def series_style(i: int, system: str | None) -> dict[str, Any]:
    dashed = system is not None and is_bound(str(system))
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)],
            "hatch": HATCHES[i // len(PALETTE) % len(HATCHES)], "linestyle": (0, (4, 2)) if dashed else "-"}


def legend_handle(style: dict[str, Any], kind: str, hollow: bool = False) -> Any:
    """Legend entry: "line" (line and marker), "marker" (scatter) or "bar" (a square, hatched as its bars)."""
    if kind == "bar":
        from matplotlib.patches import Patch
        return Patch(facecolor=style["color"], hatch=style["hatch"], edgecolor="white", linewidth=0)
    if kind == "line":
        return Line2D([], [], color=style["color"], marker=style["marker"], linestyle=style["linestyle"],
                      markersize=5)
    marker, size = (style["marker"], 6) if kind == "marker" else ("s", 8)
    return Line2D([], [], color=style["color"], marker=marker, linestyle="none", markersize=size,
                  markerfacecolor="none" if hollow else style["color"])


def tidy_axes(ax: Any) -> None:
    from matplotlib.ticker import ScalarFormatter
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for axis in (ax.xaxis, ax.yaxis):  # plain tick labels: a narrow range near 24 GiB read "0.0015 ... +2.399e1"
        formatter = axis.get_major_formatter()
        if isinstance(formatter, ScalarFormatter):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6, which="major")
    ax.set_axisbelow(True)


def log_axis(ax: Any, which: str = "y") -> None:
    """Log axis (``which``: "x" or "y") labelled with plain numbers at 1, 2, 5 times powers of ten; its label
    (set before) says "log scale": with plain tick labels the scale was told only by their spacing."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    text = axis.get_label().get_text()
    if text and LOG_NOTE not in text:
        axis.set_label_text(f"{text}{LOG_NOTE}")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.10g}"))
    axis.set_minor_formatter(NullFormatter())


def spans_decade(values: pd.Series) -> bool:
    positive = values[values > 0]
    # a ratio, not LOG_RATIO * min: that overflowed (a RuntimeWarning) for values near the float maximum
    return len(positive) == len(values) and len(values) > 1 and positive.max() / LOG_RATIO > positive.min()


def side_legend(fig: Figure, handles: list[Any], names: list[str], title: str | None) -> Any:
    """The legend right of the panels, in as many columns as keep it clear of the title and inside the figure:
    in one column, many systems (``systems: all``) made it taller than the panels and it ran over the title."""
    import warnings as _warnings
    for ncols in range(1, 5):
        legend = fig.legend(handles, names, title=title, loc="outside right center", frameon=False, fontsize=9,
                            ncols=ncols)
        if ncols == 4 or fig.get_suptitle() == "":
            return legend
        with _warnings.catch_warnings():
            _warnings.filterwarnings("ignore", message="constrained_layout not applied")
            fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        box = legend.get_window_extent(renderer)
        inside = box.y0 >= fig.bbox.y0 and box.y1 <= fig.bbox.y1
        if inside and not box.overlaps(fig._suptitle.get_window_extent(renderer)):
            return legend
        legend.remove()
    raise AssertionError("unreachable")
