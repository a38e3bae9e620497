"""How the figures of a sweep look: colours, markers and hatches per series, legends, tidy and log axes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from moesim.analysis.sweep_results import bound_kind, is_bound

#: colours of the systems (and of any other hue): Okabe-Ito's six (as in moesim.analysis.plots, without the
#: yellow, which vanishes on white), then colours of Paul Tol's schemes, Kelly's and tab20, each the one
#: farthest (CIEDE2000) from those before it and from the bounds' black and greys, dark enough for white: 20
#: colours, no two closer than 13.7 (Okabe-Ito's sky blue and tab20's cyan). 15 colours gave a sweep of every
#: catalogue system (16 and two bounds) repeats: gpu-only-lru and all-in-gpu both orange, static-hot and the
#: oracle both green. Past 20 a colour comes back with another marker and dotted lines (bars: hatched).
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#882255", "#8DB600", "#654522",
           "#604E97", "#F99379", "#997700", "#BE0032", "#117733", "#8C564B", "#AA4499", "#EE6677", "#004488",
           "#2CA02C", "#17BECF")
#: colours and markers of bounds (black, dark grey) and references (greys), drawn dashed, apart from every
#: system's colour
BOUND_PALETTE = {"bound": ("#000000", "#444444"), "reference": ("#777777", "#AAAAAA")}
BOUND_MARKERS = ("X", "*", "P", "D")
#: 15 markers: with 20 colours, no two of the first 60 hues look alike
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "H", "8")
#: bars have no marker: each round of the palette after the first hatches them apart
HATCHES = ("", "///", "xxx", "...")
#: lines of each round of the palette: solid, then dotted, then dash-dotted (bounds alone are dashed)
LINESTYLES = ("-", (0, (1, 1.5)), (0, (5, 1.5, 1, 1.5)))
#: the dashes of bounds and references
BOUND_LINESTYLE = (0, (4, 2))
#: the y axis turns logarithmic when the largest value exceeds the smallest by this factor
LOG_RATIO = 10.0
#: what a log axis's label ends with
LOG_NOTE = ", log scale"


def series_style(i: int, system: str | None) -> dict[str, Any]:
    """The ``i``-th hue's colour, marker, hatch and line style (dashed for a bound or reference, ``system``)."""
    dashed = system is not None and is_bound(str(system))
    rounds = i // len(PALETTE)
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)],
            "hatch": HATCHES[rounds % len(HATCHES)],
            "linestyle": BOUND_LINESTYLE if dashed else LINESTYLES[rounds % len(LINESTYLES)]}


def system_styles(systems: Sequence[Any]) -> dict[Any, dict[str, Any]]:
    """A style per system, each unlike every other: systems take the palette in order (bounds and references
    left out of the count); bounds black or dark grey, references lighter greys, both dashed, with markers of
    their own."""
    out: dict[Any, dict[str, Any]] = {}
    deployable = [s for s in systems if not is_bound(str(s))]
    for i, system in enumerate(deployable):
        out[system] = series_style(i, None)
    seen = {"bound": 0, "reference": 0}
    for k, system in enumerate(s for s in systems if is_bound(str(s))):
        kind = bound_kind(str(system))
        colours, j = BOUND_PALETTE[kind], seen[kind]
        seen[kind] += 1
        out[system] = {"color": colours[j % len(colours)], "marker": BOUND_MARKERS[k % len(BOUND_MARKERS)],
                       "hatch": HATCHES[j // len(colours) % len(HATCHES)], "linestyle": BOUND_LINESTYLE}
    return out


def hue_styles(hues: Sequence[Any], systems: bool, every: Sequence[Any] | None = None) -> dict[Any, dict[str, Any]]:
    """Styles of a figure's hues: by :func:`system_styles` when they are systems (over ``every`` system of the
    results, so a system keeps its look in every figure of them), else the palette in order."""
    if systems:
        styles = system_styles(list(every) if every is not None else list(hues))
        missing = [h for h in hues if h not in styles]
        if missing:  # a hue outside ``every``: styles of the hues alone
            styles = system_styles(list(hues))
        return {h: styles[h] for h in hues}
    return {h: series_style(i, None) for i, h in enumerate(hues)}


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
    from matplotlib.ticker import FuncFormatter, ScalarFormatter
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for axis in (ax.xaxis, ax.yaxis):  # plain tick labels: a narrow range near 24 GiB read "0.0015 ... +2.399e1"
        if isinstance(axis.get_major_formatter(), ScalarFormatter):
            # with thousands separators, as on a log axis: PCIe bytes read "2500000000000"
            axis.set_major_formatter(FuncFormatter(_plain))
    ax.grid(axis="y", color="#dddddd", linewidth=0.6, which="major")
    ax.set_axisbelow(True)


def _plain(value: float, _: Any = None) -> str:
    """A tick label: the number in full with thousands separators, float noise (0.30000000000000004) dropped
    (and no 2e+12: a whole number is written out)."""
    text = f"{value:,.10g}"
    return f"{round(value):,}" if "e" in text and float(text.replace(",", "")) == round(value) else text


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
    axis.set_major_formatter(FuncFormatter(_plain))
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


#: characters of a setting a figure shows whole (a tick label, a legend entry, a panel or figure title); a
#: longer one, such as a per-layer ``cache.slots_per_layer`` list of 32 or 61 numbers, is abbreviated
SHORT_SETTING = 24


def short_setting(text: str, limit: int = SHORT_SETTING) -> str:
    """``text`` as a figure shows it: whole up to ``limit`` characters; a longer comma-separated list as its
    first and last values and its length ('1,2,1,2,...,2,1 (32 values)'); other long text cut in the middle.

    Whole, a per-layer list of cache slots made tick labels that ran into each other and a title wider than the
    figure, whose layout then squeezed the bars and their names together."""
    text = str(text)
    if len(text) <= limit:
        return text
    parts = text.split(",")
    if len(parts) > 2:
        head, tail = [], []
        room = limit - 3  # the ellipsis and its commas
        for i in range(len(parts) // 2):
            if len(",".join(head + [parts[i]])) + len(",".join([parts[-1 - i]] + tail)) > room:
                break
            head.append(parts[i])
            tail.insert(0, parts[-1 - i])
        if head:
            return f"{','.join(head)},\u2026,{','.join(tail)} ({len(parts)} values)"
    keep = max(limit - 1, 2)
    return f"{text[:keep - keep // 2]}\u2026{text[len(text) - keep // 2:]}"


def short_settings(texts: Sequence[Any], limit: int = SHORT_SETTING) -> list[str]:
    """:func:`short_setting` of each of ``texts``, told apart: where two shorten alike (per-layer lists that
    differ only in the middle), more of each is kept until they differ, or they are shown whole."""
    texts = [str(t) for t in texts]
    longest = max((len(t) for t in texts), default=0)
    while True:
        out = [short_setting(t, limit) for t in texts]
        if len(set(out)) == len(set(texts)) or limit >= longest:
            return out
        limit += 8
