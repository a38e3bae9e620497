"""Figures of a replay: a Gantt chart of the timeline and a time-breakdown comparison.

Both draw on a bare :class:`matplotlib.figure.Figure` with the Agg canvas, so
they work without a display and leave pyplot's global state alone. The
figures are :class:`DisplayFigure`: a plain Jupyter kernel shows them as a
PNG without ``%matplotlib inline``.
"""

from __future__ import annotations

import io
import numbers
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import StrMethodFormatter

from moesim.analysis.sweep_results import hw_named
from moesim.analysis.timeline import RESOURCES, check_timeline, in_steps
from moesim.errors import ConfigError
from moesim.sim.bookkeeping import BREAKDOWN
from moesim.util import FIGURE, OUTPUT_FORMATS, check_suffix, tmp_path_for

#: bars above which a Gantt chart stops being readable
MAX_BARS = 2000
#: forward passes shown by default when they fit in MAX_BARS
DEFAULT_STEPS = 2
#: about the width of the Gantt plot area in pixels at the saved size and dpi
BAR_PIXELS = 1800
FORMATS = {suffix: suffix[1:] for suffix in OUTPUT_FORMATS[FIGURE]}

LANE_LABELS = {"pcie": "PCIe H2D", "gpu": "GPU", "cpu": "CPU"}
# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies
KIND_STYLE = {
    "attention": ("#999999", "attention + gate"),
    "predict": ("#56B4E9", "prediction / scheduling"),  # the breakdown's colours for these two
    "cache_management": ("#F0E442", "cache management"),
    "shared": ("#CC79A7", "shared experts"),
    "expert": ("#0072B2", "routed expert"),
    "load": ("#D55E00", "demand load"),
    "prefetch": ("#009E73", "prefetch"),
    "stage": ("#E69F00", "streamed (staging)"),
    "chunk": ("#009E73", "prefetch"),  # the part of a prefetch done before a demand load cut in
    "writeback": ("#F0E442", "write-back (D2H)"),
    "deferred": ("#56B4E9", "deferred CPU expert"),
    # the rest of the forward pass, around the MoE layers: one entry, they sit at each step's ends
    **{kind: ("#555555", "embedding, dense layers, LM head, sampling")
       for kind in ("embedding", "dense_ffn", "lm_head", "sampling")},
}
BREAKDOWN_STYLE = {
    "attention": ("#999999", "attention + gate"),
    "predict": ("#56B4E9", "predict"),
    "cache_management": ("#F0E442", "cache management"),
    "gpu_compute": ("#0072B2", "GPU compute"),
    "wait_cache": ("#D55E00", "wait for cache"),
    "shared_expert": ("#CC79A7", "shared experts"),
    "cpu_other": ("#009E73", "CPU not overlapped"),
    "sync": ("#E69F00", "CPU-GPU sync"),
    # the rest of the forward pass in greys (the eight colours above are all there are)
    "dense_ffn": ("#666666", "dense-layer FFN"),
    "embedding": ("#CCCCCC", "embedding"),
    "lm_head": ("#444444", "LM head"),
    "sampling": ("#E6E6E6", "sampling"),
    "launch": ("#000000", "kernel launches"),
    "host": ("#B3B3B3", "host work"),
}


class DisplayFigure(Figure):
    """A matplotlib Figure that IPython and Jupyter display as a PNG with no backend set up.

    Without ``%matplotlib inline`` IPython has no formatter for Figures and
    prints ``<Figure size ...>``; ``_repr_png_`` is the hook its display
    machinery asks for instead.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        FigureCanvasAgg(self)
        self.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()


# ----------------------------------------------------------------------------- saving
def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Save ``fig`` as PNG, SVG or PDF by suffix; the file appears whole at ``path`` or not at all."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a file name, got {path!r}", field="path", fix="e.g. path='figure.png'")
    path = Path(path)
    check_suffix(path, "path", FIGURE)
    fmt = FORMATS[path.suffix.lower()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        FigureCanvasAgg(fig)  # a canvas that needs no display
        fig.savefig(tmp, format=fmt, dpi=150, metadata={"Software": "moesim"} if fmt == "png" else None)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ----------------------------------------------------------------------------- Gantt
def default_window(frame: pd.DataFrame, steps: int = DEFAULT_STEPS, max_bars: int = MAX_BARS) -> tuple[float, float]:
    """The first ``steps`` forward passes, cut short so that at most ``max_bars`` spans start in it.

    Returns ``(start_s, end_s)``. A single prefill step of a large model can
    hold more spans than a readable figure: then the window ends where the
    ``max_bars``-th span starts.
    """
    if frame.empty:
        return 0.0, 0.0
    spans = frame.sort_values("start_s", kind="stable")
    start = float(spans["start_s"].iloc[0])
    chosen = sorted(spans["step"].unique())[:steps]
    end = step_window(frame, int(chosen[0]), int(chosen[-1]))[1]
    if (spans["start_s"] < end).sum() > max_bars:
        end = float(spans["start_s"].iloc[max_bars])
    return start, end


def step_window(frame: pd.DataFrame, first: int, last: int) -> tuple[float, float]:
    """``(start_s, end_s)`` spanning every interval of steps ``first`` to ``last`` (inclusive)."""
    chosen = in_steps(frame, (first, last))
    if chosen.empty:
        steps = frame["step"]
        have = f"steps {int(steps.min())} to {int(steps.max())}" if len(steps) else "no steps"
        raise ConfigError(f"no step in {first}:{last}", field="steps", fix=f"the timeline has {have}")
    start, end = float(chosen["start_s"].min()), float(chosen["end_s"].max())
    # a copy issued in the last step can run on into later ones: the window ends where the next step starts
    # (steps=(10, 12) showed steps 13 and 14 too)
    later = frame.loc[frame["step"] > last, "start_s"]
    if len(later) and start < float(later.min()) < end:
        end = float(later.min())
    return start, end


def window_label(frame: pd.DataFrame, window: tuple[float, float]) -> str:
    """What a window shows, for the title: the steps that start in it, of how many, and the time span."""
    if frame.empty:
        return "empty timeline"
    starts = frame.groupby("step")["start_s"].min()
    ends = frame.groupby("step")["end_s"].max()
    lo, hi = window
    # the steps that start in it, and the one it starts in when that is none of them: an earlier step whose
    # copies still run there is no step shown
    inside = sorted(int(s) for s in starts.index if lo - 1e-12 <= starts[s] < hi)
    before = starts[(starts < lo - 1e-12) & (ends > lo)]
    if len(before) and not (inside and starts[inside[0]] <= lo + 1e-12):
        inside.insert(0, int(before.idxmax()))
    whole = [s for s in inside if starts[s] >= lo - 1e-12 and ends[s] <= hi + 1e-12]
    if not inside:
        shown = "no step"
    elif len(inside) == 1:
        shown = f"step {inside[0]}"
    else:
        shown = f"steps {inside[0]}-{inside[-1]}"
    part = "" if len(whole) == len(inside) else f" (part of {'it' if len(inside) == 1 else 'them'})"
    return f"{shown}{part} of {len(starts)}, {lo * 1e3:,.1f}-{hi * 1e3:,.1f} ms"


def _clip(frame: pd.DataFrame, window: tuple[float, float]) -> pd.DataFrame:
    lo, hi = window
    if not hi > lo:
        raise ConfigError(f"empty time window ({lo}, {hi})", field="window",
                          fix="give (start_s, end_s) in seconds with start_s < end_s")
    inside = frame[(frame["end_s"] > lo) & (frame["start_s"] < hi)].copy()
    inside["start_s"] = inside["start_s"].clip(lower=lo)
    inside["end_s"] = inside["end_s"].clip(upper=hi)
    return inside


def _lane_rows(frame: pd.DataFrame) -> dict[tuple[str, int], tuple[float, float]]:
    """(resource, lane) -> (bottom, height) in axis units: one band per resource, split by lanes.

    Band 0 is the bottom one; PCIe is drawn on top, CPU at the bottom (the
    layout of Fig. 1 in 001_66a328d79a3cae8d.txt).
    """
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    for band, resource in enumerate(reversed(RESOURCES)):
        lanes = sorted(int(x) for x in frame.loc[frame["resource"] == resource, "lane"].unique()) or [0]
        height = 0.8 / len(lanes)
        for i, lane in enumerate(lanes):
            rows[(resource, lane)] = (band - 0.4 + (len(lanes) - 1 - i) * height, height * 0.92)
    return rows


def _mark_boundaries(ax: Any, frame: pd.DataFrame, window: tuple[float, float]) -> None:
    """Faint lines where layers start, darker dashed ones and labels where steps start."""
    gpu = frame[frame["resource"] == "gpu"]
    starts = (gpu if not gpu.empty else frame).groupby(["step", "layer"])["start_s"].min()
    lo, hi = window
    layer_x = [t * 1e3 for t in starts.to_numpy() if lo <= t <= hi]
    ax.vlines(layer_x, -0.5, len(RESOURCES) - 0.5, colors="#000000", alpha=0.12, linewidth=0.5, zorder=1)
    step_starts = frame.groupby("step")["start_s"].min()
    for step, t in step_starts.items():
        if lo <= t <= hi:
            ax.axvline(t * 1e3, color="#333333", linestyle="--", linewidth=0.9, alpha=0.7, zorder=1)
        if lo <= t < lo + 0.96 * (hi - lo):  # no label squeezed against the right edge
            ax.annotate(f"step {int(step)}", xy=(t * 1e3, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -3), textcoords="offset points", ha="left", va="top", fontsize=8,
                        color="#333333")


def fit_width(fig: Figure, text: Any) -> None:
    """Break the lines of a left-aligned title (``text``, a suptitle or an axes title) at spaces so that none
    runs past the figure's right edge: a layout engine makes room for a title's height, never its width, so a
    long title (a sweep point's settings, the note under a plot's heading) was cut off at the edge."""
    import warnings

    def start() -> float:
        with warnings.catch_warnings():  # the title too wide yet may leave the axes no room: what this fixes
            warnings.filterwarnings("ignore", message="constrained_layout not applied")
            fig.draw_without_rendering()  # lay the figure out first: where the title starts
        return text.get_window_extent(fig.canvas.get_renderer()).x0

    whole = text.get_text()
    x0 = start()
    # a title too wide for the layout engine left the axes where they were before it ran: broken, the title lets
    # it run and the axes (and an axes title with them) move, so the lines are broken again from where it starts
    # now (an axes title at a breakdown's axes ran past the edge by the width of the y axis's labels)
    for _ in range(3):
        text.set_text(_broken(whole, fig.bbox.x1 - x0 - 6 * fig.dpi / 72, text))  # a little short of the edge
        moved = start()
        if abs(moved - x0) < 1:
            return
        x0 = moved


def _broken(title: str, room: float, text: Any) -> str:
    """``title`` with its lines broken at spaces to fit ``room`` (display units) in ``text``'s font."""
    renderer = text.figure.canvas.get_renderer()
    font = text.get_fontproperties()

    def width(line: str) -> float:
        return renderer.get_text_width_height_descent(line, font, ismath=False)[0]

    lines: list[str] = []
    for line in title.split("\n"):
        current = ""
        for word in unbroken_words(line):
            candidate = f"{current} {word}" if current else word
            if current and width(candidate) > room:
                lines.append(current)
                current = word
            else:
                current = candidate
        lines.append(current)
    return "\n".join(lines)


#: a number a title does not end a line with: the unit or noun after it stays on its line ('102.4 GB/s', '10 cores')
NUMBER_WORD = re.compile(r"^\(?[0-9]([0-9.,-]*[0-9])?$")


def unbroken_words(line: str) -> list[str]:
    """The words of ``line`` that :func:`fit_width` may break between: a number together with the word after it
    (a profile's '102.4 GB/s DRAM' was broken after '102.4')."""
    words: list[str] = []
    for word in line.split(" "):
        if words and " " not in words[-1] and NUMBER_WORD.match(words[-1]):
            words[-1] = f"{words[-1]} {word}"
        else:
            words.append(word)
    return words


def plot_gantt(frame: pd.DataFrame, path: str | os.PathLike | None = None, *,
               window: tuple[float, float] | None = None, steps: tuple[int, int] | None = None,
               title: str = "") -> Figure:
    """Gantt chart of a timeline: PCIe, GPU and CPU lanes top to bottom, coloured by kind.

    ``window`` is ``(start_s, end_s)`` in seconds, the unit of the timeline's
    columns (the axis shows milliseconds); by default the first
    :data:`DEFAULT_STEPS` steps, shortened to at most :data:`MAX_BARS` bars.
    ``steps`` = ``(first, last)`` chooses whole steps instead (inclusive).
    Spans crossing the window's edges are clipped to it. Layer starts are
    marked by faint vertical lines, step starts by dashed ones. The title
    ends with what is shown: the steps, of how many, and the time span.
    """
    check_timeline(frame)
    if steps is not None and window is not None:
        raise ConfigError("give a time window or steps, not both", field="window", fix="drop one of them")
    if steps is not None:
        first, last = checked_pair(steps, "steps", "(first, last) step numbers, e.g. steps=(10, 12)", whole=True)
        window = step_window(frame, int(first), int(last))
    elif window is not None:
        window = checked_pair(window, "window", "(start_s, end_s) in seconds, e.g. window=(0.5, 0.8)")
        outside_timeline(frame, window)
    window = default_window(frame) if window is None else (float(window[0]), float(window[1]))
    shown = _clip(frame, window) if not frame.empty else frame
    rows = _lane_rows(frame)

    fig = DisplayFigure(figsize=(13, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    kinds = [k for k in KIND_STYLE if (shown["kind"] == k).any()]
    kinds += sorted(set(shown["kind"].astype(str)) - set(kinds))
    pixel_ms = (window[1] - window[0]) * 1e3 / BAR_PIXELS
    for (resource, lane), (bottom, height) in rows.items():
        lane_spans = shown[(shown["resource"] == resource) & (shown["lane"] == lane)]
        for kind in kinds:
            spans = lane_spans[lane_spans["kind"] == kind]
            if spans.empty:
                continue
            start = spans["start_s"].to_numpy() * 1e3
            width = _drawn_widths(spans["end_s"].to_numpy() * 1e3 - start, pixel_ms)
            ax.broken_barh(np.column_stack([start, width]), (bottom, height), facecolors=_colour(kind),
                           linewidth=0, zorder=2, label=kind, snap=False)
    _mark_boundaries(ax, frame, window)

    labels = dict(LANE_LABELS)
    if "writeback" in kinds:  # device-to-host copies of evicted experts share the copy engine's lane
        labels["pcie"] = "PCIe (H2D + D2H)"
    ax.set_yticks(range(len(RESOURCES)), [labels[r] for r in reversed(RESOURCES)])
    ax.set_ylim(-0.55, len(RESOURCES) - 0.45)
    ax.set_xlim(window[0] * 1e3, window[1] * 1e3 if window[1] > window[0] else window[0] * 1e3 + 1)
    ax.set_xlabel("time (ms)")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    labels = {KIND_STYLE.get(k, (None, k))[1]: _colour(k) for k in kinds}  # kinds that share a label: one entry
    handles = [Patch(facecolor=colour, label=label) for label, colour in labels.items()]
    if handles:
        # below the axes: the title above says what is shown and may be long
        # at most five a row: eight or more kinds in one row ran past the figure's edges
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), frameon=False, fontsize=9,
                   title=thin_note(shown, pixel_ms), title_fontproperties={"size": 8})
    shown_label = window_label(frame, window)
    fit_width(fig, fig.suptitle(f"{title}: {shown_label}" if title else shown_label, x=0.01, ha="left",
                                fontsize=11))
    if path is not None:
        save_figure(fig, path)
    return fig


def outside_timeline(frame: pd.DataFrame, window: tuple[float, float]) -> None:
    """One line for a window that misses the whole timeline: window=(100, 200) read as milliseconds, the axis's
    unit, drew an empty figure without a word where steps past the end were refused."""
    if frame.empty:
        return
    first, last = float(frame["start_s"].min()), float(frame["end_s"].max())
    if window[1] > first and window[0] < last:
        return
    lo, hi = window
    in_ms = hi / 1e3 > first and lo / 1e3 < last  # the window read as milliseconds falls on the timeline
    example = f"window=({lo / 1e3:g}, {hi / 1e3:g}) for {lo:g}-{hi:g} ms" if in_ms else \
        f"window=({first:.4g}, {min(last, first + 0.1):.4g})"
    raise ConfigError(f"window=({lo:g}, {hi:g}) s holds nothing: the timeline runs from {first:.4g} s to {last:.4g} s",
                      field="window", fix=f"window is (start_s, end_s) in seconds (the axis shows milliseconds): "
                                          f"e.g. {example}, or steps=(first, last)")


def checked_pair(value: Any, name: str, what: str, whole: bool = False) -> tuple[Any, Any]:
    """``value`` as two numbers (whole ones for steps), the first not above the second; one line otherwise
    (steps=10 failed with "'int' object is not subscriptable", window=(1,) with an IndexError)."""
    kind = numbers.Integral if whole else numbers.Real
    pair = tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, kind) for v in pair):
        raise ConfigError(f"{name} must be {what.split(', e.g.')[0]}, got {value!r}", field=name,
                          fix=f"give {what}")
    if pair[0] > pair[1]:
        raise ConfigError(f"{name}={value!r} ends before it starts", field=name, fix=f"give {what}")
    return pair


def _drawn_widths(width_ms: np.ndarray, pixel_ms: float) -> np.ndarray:
    """Bar widths as drawn.

    At least half a pixel, so that short kernels stay visible (anti-aliasing
    draws them lighter, so a dense run of them reads as partly busy rather
    than solid), and a pixel short of touching when several pixels wide, so
    back-to-back spans stay apart.
    """
    gapped = np.where(width_ms > 4 * pixel_ms, width_ms - pixel_ms, width_ms)
    return np.maximum(gapped, 0.5 * pixel_ms)


def thin_note(shown: pd.DataFrame, pixel_ms: float) -> str | None:
    """What the legend says of the kinds whose spans are mostly narrower than a pixel, or None.

    They are drawn half a pixel wide and so fainter: without a word, a lane of short attention kernels looked
    idle and its legend entry named nothing visible."""
    width = (shown["end_s"] - shown["start_s"]) * 1e3
    names = shown["kind"].astype(str).map(lambda k: KIND_STYLE.get(k, (None, k))[1])
    # per lane: GPU experts can be a fraction of a pixel where the CPU's are wide
    share = (width < pixel_ms).groupby([shown["resource"], names], sort=False).mean()
    thin: dict[str, list[str]] = {}
    for (resource, name), part in share.items():
        if part > 0.5:
            thin.setdefault(str(resource), []).append(name)
    if not thin:
        return None
    order = [label for _, label in KIND_STYLE.values()]  # as the legend lists them
    where = "; ".join(" / ".join(sorted(names, key=lambda n: order.index(n) if n in order else len(order)))
                      + f" ({LANE_LABELS.get(r, r)})" for r, names in thin.items())
    return f"narrower than a pixel, so drawn faint: {where}; a shorter window or fewer steps shows them"


def _colour(kind: str) -> str:
    return KIND_STYLE.get(kind, ("#000000", kind))[0]


# ----------------------------------------------------------------------------- breakdown
#: relative difference between a bar's parts and its run's makespan above which the bar says so
RUN_TOLERANCE = 1e-6


def plot_breakdown(metrics_list: Sequence[dict[str, Any]], path: str | os.PathLike | None = None,
                   title: str | None = None) -> Figure:
    """Stacked bars of ``breakdown_ms`` per system (the categories of 000_dba2fecbbc66318b.txt Sec. VI-E, Fig. 13).

    ``metrics_list`` holds :func:`moesim.analysis.metrics.metrics` dicts of
    runs over the same trace; each bar is labelled with its total in ms. The
    categories add up to the run's makespan: where a dict has ``makespan_s``
    and its parts do not, the bar's label gives the run's time beside them.
    ``title`` defaults to what the runs share (system of a single run, trace
    and profile from their ``inputs``).
    """
    if not metrics_list:
        raise ConfigError("no runs to compare", field="metrics_list", fix="pass at least one metrics dict")
    for i, m in enumerate(metrics_list):
        if "breakdown_ms" not in m:
            raise ConfigError("metrics lack 'breakdown_ms'", field="breakdown_ms", row=i,
                              fix="pass dicts made by moesim.analysis.metrics.metrics")
    extra = sorted({k for m in metrics_list for k in m["breakdown_ms"]} - set(BREAKDOWN))
    categories = list(BREAKDOWN) + extra
    names = [str(m.get("system", f"run {i}")) for i, m in enumerate(metrics_list)]
    values = np.array([[float(m["breakdown_ms"].get(c, 0.0)) for c in categories] for m in metrics_list])

    fig = DisplayFigure(figsize=(max(5.5, 1.1 * len(names) + 3.5), 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = np.arange(len(names))
    bottom = np.zeros(len(names))
    for j, category in enumerate(categories):
        if not values[:, j].any():
            continue  # a category no run spent time in only clutters the legend
        colour, label = BREAKDOWN_STYLE.get(category, (None, category.replace("_", " ")))
        ax.bar(x, values[:, j], 0.6, bottom=bottom, color=colour, label=label, edgecolor="white", linewidth=0.5)
        bottom += values[:, j]
    run_ms = [_run_ms(m) for m in metrics_list]
    apart = [run is not None and not np.isclose(total, run, rtol=RUN_TOLERANCE, atol=1e-6)
             for total, run in zip(bottom, run_ms)]
    for xi, total, run, off in zip(x, bottom, run_ms, apart):
        # parts that miss the run's time are shown, not hidden: the label gives both
        text = f"{total:,.1f} ms" + (f"\n(run: {run:,.1f} ms)" if off else "")
        ax.annotate(text, xy=(xi, total), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8, color="#D55E00" if off else "black")
    ax.set_xticks(x, names, rotation=20 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    ax.set_ylabel("time over the whole run (ms)")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))  # as the bars' labels: 140,000 not 140000
    ax.set_ylim(0, max(float(bottom.max()), 1e-9) * (1.16 if any(apart) else 1.1))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="outside right center", frameon=False, fontsize=9)
    if title is None:
        title = breakdown_title(metrics_list)
    if all(run is not None for run in run_ms):
        one = len(apart) == 1
        title += "\n" + (("the bar adds up to the run's makespan" if one else
                          "each bar adds up to its run's makespan") if not any(apart) else
                         ("the bar does not add up to the run's makespan" if one else
                          f"{sum(apart)} of {len(apart)} bars do not add up to their run's makespan"))
    fit_width(fig, ax.set_title(title, loc="left", fontsize=11))
    if path is not None:
        save_figure(fig, path)
    return fig


def _run_ms(metrics: dict[str, Any]) -> float | None:
    run = metrics.get("makespan_s")
    return None if run is None or not np.isfinite(float(run)) else float(run) * 1e3


def breakdown_title(metrics_list: Sequence[dict[str, Any]]) -> str:
    """"time breakdown" of the single system, or per system, on the trace and profile the runs share (the
    profile with its GPU and host CPU, :func:`hw_named`)."""
    title = "time breakdown" + (f" of {metrics_list[0]['system']}" if len(metrics_list) == 1 and
                                "system" in metrics_list[0] else " per system")
    inputs = [m.get("inputs") or {} for m in metrics_list]
    shared = [Path(str(first[key])).name if key == "trace" else _inputs_hw(inputs)
              for first in inputs[:1] for key in ("trace", "hw")
              if first.get(key) and all(i.get(key) == first[key] for i in inputs)]
    settings = [i.get("settings") or {} for i in inputs]
    common = {k: v for k, v in settings[0].items() if all(s.get(k) == v for s in settings)} if settings else {}
    # the --set values the runs share: two replays that differ in them drew the same title
    return title + (" on " + ", ".join(shared) if shared else "") + settings_note(common)


def settings_note(settings: dict[str, Any]) -> str:
    """' (key=value, ...)' of ``settings`` (the ``--set`` values of a replay) as a figure's title gives them, a
    long value (a per-layer list) shortened; '' without any."""
    from moesim.analysis.figure_style import short_setting
    return f" ({', '.join(f'{k}={short_setting(v)}' for k, v in settings.items())})" if settings else ""


def _inputs_hw(inputs: Sequence[dict[str, Any]]) -> str:
    """The profile runs of the same ``hw`` share, named with the parts they ran on: those their ``inputs``
    recorded (``hw_parts`` of the CLI), else read with the ``hw.*`` settings they share."""
    first = inputs[0]
    parts = first.get("hw_parts")
    if parts is not None and all(i.get("hw_parts") == parts for i in inputs):
        return hw_named(str(first["hw"]), parts=parts)
    settings = first.get("settings") or {}
    shared = {k: v for k, v in settings.items() if all((i.get("settings") or {}).get(k) == v for i in inputs)}
    return hw_named(str(first["hw"]), shared)
