"""Figures of a sweep: any metric against any parameter, and the standard set.

The input is the tidy frame of :mod:`moesim.sweep` (one row per point; the
parameters ``trace``, ``hw``, ``system``, ``seed`` and dotted ``--set`` keys;
the metrics of :func:`moesim.analysis.metrics.metrics`). Only points with
``status == "ok"`` are drawn. Standard figures:

* TPOT against GPU cache slots per layer, one line per system;
* GPU hit rate against the prefetch count (a varied ``prefetch.*`` parameter,
  else the prefetches each run issued);
* where the time went, stacked per system (the categories of
  000_dba2fecbbc66318b.txt Sec. VI-E, Fig. 13, via
  :func:`moesim.analysis.plots.plot_breakdown`);
* a CPU/GPU/PCIe Gantt chart of two decode steps of one point, replayed again
  with its timeline (:func:`moesim.analysis.plots.plot_gantt`).

Like :mod:`moesim.analysis.plots`, figures are bare matplotlib Figures on the
Agg canvas: no display, no pyplot state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from moesim.analysis.plots import DisplayFigure, fit_width, plot_breakdown, plot_gantt, save_figure
from moesim.errors import ConfigError, did_you_mean
from moesim.sim.bookkeeping import BREAKDOWN

#: Okabe-Ito colours (as in moesim.analysis.plots) without the yellow, which vanishes on white, then
#: Paul Tol's muted scheme: 15 colours that stay apart; markers tell repeats apart beyond that
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#332288", "#117733", "#882255", "#999933", "#AA4499", "#44AA99", "#661100", "#888888")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
#: bars have no marker: each round of the palette after the first hatches them apart
HATCHES = ("", "///", "xxx", "...")
BASE_PARAMETERS = ("trace", "hw", "system", "seed", "model")
#: the y axis turns logarithmic when the largest value exceeds the smallest by this factor
LOG_RATIO = 10.0

LABELS = {
    "tpot_ms_mean": "TPOT, mean (ms)", "tpot_ms_p50": "TPOT, p50 (ms)", "tpot_ms_p99": "TPOT, p99 (ms)",
    "ttft_ms": "TTFT (ms)", "decode_tokens_per_s": "decode throughput (tokens/s)",
    "prefill_tokens_per_s": "prefill throughput (tokens/s)", "gpu_hit_rate": "GPU hit rate",
    "cache.slots_per_layer": "GPU cache slots per layer", "slots_per_layer": "GPU cache slots per layer",
    "pcie_h2d_bytes": "PCIe host-to-device bytes", "prefetches": "prefetches issued",
    "makespan_s": "makespan (s)", "hw.pcie.bandwidth_scale": "PCIe bandwidth scale",
    "gpu_memory_gib": "GPU memory planned (GiB)", "expert_cache_gib": "GPU expert cache (GiB)",
}
#: metrics where more is better (the Pareto front maximises them); every other metric is minimised
HIGHER_IS_BETTER = {"decode_tokens_per_s", "prefill_tokens_per_s", "gpu_hit_rate", "prefetch_precision",
                    "gpu_share_of_activations"}


# ----------------------------------------------------------------------------- loading and columns
def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """A sweep's results file as a DataFrame, or one line saying why not."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("results file not found", source=str(path), fix="give the --out file of `moesim sweep`")
    try:
        frame = pd.read_parquet(path)
    except Exception:  # noqa: BLE001 - any unreadable file gets the same answer, by what the bytes show
        raise ConfigError(unreadable_parquet(path), source=str(path), fix="give the --out file of `moesim sweep` "
                          "(a damaged one: run the sweep again into a new file)") from None
    if "point_id" not in frame.columns or "status" not in frame.columns:
        raise ConfigError("not a sweep result (no 'point_id'/'status' columns)", source=str(path),
                          fix="give the --out file of `moesim sweep`")
    if frame.empty:  # not "every point failed": there are none
        raise ConfigError("the results file holds no points", source=str(path),
                          fix="run `moesim sweep SPEC.yaml --out` into it first")
    return frame


#: the four bytes a Parquet file starts and ends with
PARQUET_MAGIC = b"PAR1"


def unreadable_parquet(path: Path) -> str:
    """Why Parquet could not read ``path``: empty, cut short (its footer, written last, missing) or no Parquet."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty"
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if head != PARQUET_MAGIC:
        return "not a Parquet file"
    if tail != PARQUET_MAGIC:
        return "a Parquet file cut short (its footer is missing)"
    return "a damaged Parquet file"


def parameter_columns(frame: pd.DataFrame) -> list[str]:
    """The parameter columns: trace, hw, system, seed, model and every dotted ``--set`` key."""
    return [c for c in BASE_PARAMETERS if c in frame.columns] + [c for c in frame.columns if "." in c]


def varying(frame: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    return [c for c in columns if c in frame.columns and frame[c].nunique(dropna=False) > 1]


#: other words for a base parameter, suggested when a column of that name is asked for (too far apart to spell alike)
COLUMN_WORDS = {"hardware": "hw", "profile": "hw", "gpu": "hw", "policy": "system", "systems": "system",
                "traces": "trace", "seeds": "seed"}


def column(frame: pd.DataFrame, name: str, role: str, source: str | None = None) -> str:
    """``name`` (or its ``__`` spelling) if ``frame`` has it, else one line listing what it has."""
    if not isinstance(name, str):  # a list of metrics failed as "'list' object has no attribute 'replace'"
        raise ConfigError(f"{role} must be one column's name, got {name!r}", source=source, field=role,
                          fix="one figure per column: call the function once for each (e.g. y='tpot_ms_mean')")
    for candidate in (name, name.replace("__", ".")):
        if candidate in frame.columns:
            return candidate
    params = parameter_columns(frame)
    metrics = [c for c in frame.columns if c not in params and frame[c].dtype.kind in "biuf"]
    word = COLUMN_WORDS.get(name.lower())
    hint = f"did you mean '{word}'? " if word in params else did_you_mean(name, params + metrics)
    raise ConfigError(f"no column '{name}'", source=source, field=role,
                      fix=f"{hint}parameters: {', '.join(params)}; metrics: {', '.join(metrics)}")


class UnevenMeans(UserWarning):
    """Points of a figure average fewer runs than others (runs that failed or were not run, or an x value
    that several settings share): their means are over other values of the averaged parameters, so they do
    not compare with the rest."""


def fewer_runs(runs: pd.Series | None) -> str:
    """What to say of ``runs`` (runs averaged per point) when some points have fewer than the most; ''."""
    if runs is None or runs.empty or runs.nunique() <= 1:
        return ""
    most = int(runs.max())
    short = runs[runs < most]
    few = f"{int(short.min())}" if short.min() == short.max() else f"{int(short.min())} to {int(short.max())}"
    runs_word = "run" if few == "1" else "runs"
    return (f"{len(short)} of {len(runs)} points average {few} {runs_word} instead of {most} (runs failed or not "
            "run, or an x value that several settings share)")


def ok_rows(frame: pd.DataFrame, source: str | None = None) -> pd.DataFrame:
    ok = frame[frame["status"] == "ok"] if "status" in frame.columns else frame
    if ok.empty:
        raise ConfigError("no finished points to draw (every point failed)", source=source, field="status",
                          fix="see the 'error' column of the results")
    return ok


def label(name: str) -> str:
    return LABELS.get(name, name)


def is_bound(system: str) -> bool:
    """Bounds and references (oracle, all-in-GPU) are drawn dashed: they are not deployable systems.

    A system is one when it is a portfolio of schedules or its description says
    "bound" or "reference" (as ``moesim systems`` lists them).
    """
    import re

    from moesim.policy.systems import SYSTEMS
    spec = SYSTEMS.get(system)
    return bool(spec and (spec.portfolio or re.search(r"\b(bound|reference)\b", spec.description.lower())))


def ordered_systems(values: Sequence[Any]) -> list[Any]:
    """Systems in registry order (as `moesim systems` lists them), bounds last, unknown names at the end."""
    from moesim.policy.systems import SYSTEMS
    rank = {name: i for i, name in enumerate(SYSTEMS)}
    return sorted(values, key=lambda s: (is_bound(str(s)), rank.get(str(s), len(rank)), str(s)))


# ----------------------------------------------------------------------------- the general plot
def plot_results(frame: pd.DataFrame, *, x: str, y: str, hue: str | None = None, facet: str | None = None,
                 path: str | os.PathLike | None = None, source: str | None = None, title: str = "",
                 logy: bool | None = None) -> Figure:
    """``y`` against ``x``, one line per ``hue`` value, one panel per ``facet`` value.

    Numeric ``x``: lines with markers; other ``x``: grouped bars. Points that
    differ in parameters not on the figure are averaged, and the band (or
    error bar) spans their minimum to maximum; the figure says which
    parameters those were. ``logy`` (default: when the values span more than
    :data:`LOG_RATIO`) draws the y axis on a log scale.
    """
    x = column(frame, x, "x", source)
    y = column(frame, y, "y", source)
    hue = column(frame, hue, "hue", source) if hue else None
    facet = column(frame, facet, "facet", source) if facet else None
    data = ok_rows(frame, source)
    if data[y].dtype.kind not in "biuf":
        raise ConfigError(f"column '{y}' is not numeric", source=source, field="y",
                          fix="plot a metric such as tpot_ms_mean or gpu_hit_rate")
    data = data[np.isfinite(data[y].astype(float))]
    if data.empty:
        raise ConfigError(f"column '{y}' has no finite values", source=source, field="y",
                          fix="choose a metric the runs defined (e.g. no TTFT without prefill)")
    check_drawable(data, ((x, "x"), (y, "y")), source)
    data = as_groups(data, (hue, facet))
    shown = {x, hue, facet} - {None}
    averaged = [c for c in varying(data, parameter_columns(data)) if c not in shown]
    runs = data.groupby([c for c in (facet, hue, x) if c], dropna=False)[y].size() if averaged else None
    full = int(runs.max()) if runs is not None else 1  # runs a mean over every averaged value takes
    panels = sorted_values(data[facet]) if facet else [None]
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig = DisplayFigure(figsize=(4.6 * cols + 2.4, 3.6 * rows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    numeric_x = data[x].dtype.kind in "biuf"
    hues = (ordered_systems(data[hue].dropna().unique()) if hue == "system" else sorted_values(data[hue])) \
        if hue else [None]
    styles = {h: _style(i, h if hue == "system" else None) for i, h in enumerate(hues)}
    for ax, panel in zip(axes.flat, panels):
        sub = data[data[facet] == panel] if facet else data
        if numeric_x:
            _lines(ax, sub, x, y, hue, hues, styles, full)
        else:
            _bars(ax, sub, x, y, hue, hues, styles)
        ax.set_xlabel(label(x))
        if facet:
            ax.set_title(f"{label(facet)} = {panel}", fontsize=10)
        _tidy(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(label(y))
    if logy if logy is not None else _wide(data[y]):
        for ax in axes.flat:
            log_axis(ax)
    spread = "band" if numeric_x else "error bars"
    note = f"mean over {', '.join(averaged)} ({spread}: min to max)" if averaged else ""
    short = fewer_runs(runs)
    if short:
        note += f"; {short}" + (" (hollow markers)" if numeric_x else "")
        # at the caller's line, through fig_tpot_vs_slots and the like too (stacklevel=2 named this file there)
        from moesim.util import warn_at_caller
        warn_at_caller(f"{title or source or 'results'}: {short}", UnevenMeans)
    heading = title or f"{label(y)} vs {label(x)}"
    fit_width(fig, fig.suptitle(heading + (f"\n{note}" if note else ""), x=0.01, ha="left", fontsize=11))
    if hue:
        side_legend(fig, [_handle(styles[h], "line" if numeric_x else "bar") for h in hues], [str(h) for h in hues],
                    label(hue))
    if path is not None:
        save_figure(fig, path)
    return fig


# ----------------------------------------------------------------------------- metric against metric
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


def pareto_front(x: np.ndarray, y: np.ndarray, *, maximize_x: bool = False, maximize_y: bool = False) -> np.ndarray:
    """Indices of the points no other point beats on both axes (ties kept once), sorted by x.

    A point is dominated when another is at least as good on both axes and
    better on one; "good" is lower unless ``maximize_*``.
    """
    sx = -np.asarray(x, dtype=float) if maximize_x else np.asarray(x, dtype=float)
    sy = -np.asarray(y, dtype=float) if maximize_y else np.asarray(y, dtype=float)
    order = np.lexsort((sy, sx))  # best x first, best y among equal x
    front: list[int] = []
    best_y = np.inf
    for i in order:
        if sy[i] < best_y:
            front.append(int(i))
            best_y = sy[i]
    return np.array(sorted(front, key=lambda i: x[i]), dtype=int)


def plot_scatter(frame: pd.DataFrame, *, x: str, y: str, hue: str | None = "system", facet: str | None = None,
                 pareto: bool = True, path: str | os.PathLike | None = None, source: str | None = None,
                 title: str = "") -> Figure:
    """``y`` against ``x`` with one marker per run (nothing averaged, no lines between runs).

    With ``pareto`` the front of the runs that are no bound (oracle and
    all-in-GPU are drawn hollow and left out) is drawn as a staircase: the
    runs no other run beats on both metrics. Lower is better except for
    :data:`HIGHER_IS_BETTER`. The legend sits right of the panels, clear of
    the title.
    """
    x = column(frame, x, "x", source)
    y = column(frame, y, "y", source)
    hue = column(frame, hue, "hue", source) if hue else None
    facet = column(frame, facet, "facet", source) if facet else None
    data = ok_rows(frame, source)
    for name, role in ((x, "x"), (y, "y")):
        if data[name].dtype.kind not in "biuf":
            raise ConfigError(f"column '{name}' is not numeric", source=source, field=role,
                              fix="scatter two metrics, e.g. gpu_memory_gib and tpot_ms_mean")
    data = data[np.isfinite(data[x].astype(float)) & np.isfinite(data[y].astype(float))]
    if data.empty:
        raise ConfigError(f"no run has finite '{x}' and '{y}'", source=source, field="y",
                          fix="choose metrics the runs defined (e.g. no TTFT without prefill)")
    check_drawable(data, ((x, "x"), (y, "y")), source)
    data = as_groups(data, (hue, facet))
    panels = sorted_values(data[facet]) if facet else [None]
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig = DisplayFigure(figsize=(4.8 * cols + 2.6, 3.8 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    hues = (ordered_systems(data[hue].dropna().unique()) if hue == "system" else sorted_values(data[hue])) \
        if hue else [None]
    styles = {h: _style(i, h if hue == "system" else None) for i, h in enumerate(hues)}
    drew_front = False
    for ax, panel in zip(axes.flat, panels):
        sub = data[data[facet] == panel] if facet else data
        for h in hues:
            mine = sub[sub[hue] == h] if hue else sub
            if mine.empty:
                continue
            style = styles[h]
            bound = hue == "system" and is_bound(str(h))
            ax.scatter(mine[x], mine[y], marker=style["marker"], s=34, zorder=3, linewidths=1.2,
                       facecolors="none" if bound else style["color"], edgecolors=style["color"], alpha=0.9)
        if pareto:
            deployable = sub[[not is_bound(str(s)) for s in sub["system"]]] if "system" in sub.columns else sub
            if len(deployable):
                drew_front |= _draw_front(ax, deployable, x, y)
        ax.set_xlabel(label(x))
        ax.set_ylabel(label(y))
        if facet:
            ax.set_title(f"{label(facet)} = {panel}", fontsize=10)
        _tidy(ax)
        ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax, name in ((a, n) for a in axes.flat for n in ("x", "y")):
        if _wide(data[x if name == "x" else y]):
            log_axis(ax, name)
    handles = [_handle(styles[h], "marker", hollow=hue == "system" and is_bound(str(h))) for h in hues] \
        if hue else []
    names = [str(h) + (" (bound)" if hue == "system" and is_bound(str(h)) else "") for h in hues] if hue else []
    if drew_front:
        handles.append(Line2D([], [], color="#222222", linewidth=1.4, linestyle="-"))
        names.append("Pareto front")
    better = f"{'higher' if x in HIGHER_IS_BETTER else 'lower'} x, {'higher' if y in HIGHER_IS_BETTER else 'lower'} y"
    note = f"one marker per run; Pareto front: runs no other beats on both ({better} is better)" if drew_front \
        else "one marker per run"
    fit_width(fig, fig.suptitle((title or f"{label(y)} vs {label(x)}") + f"\n{note}", x=0.01, ha="left",
                                fontsize=11))
    if handles:  # centred on the right, clear of the title lines
        side_legend(fig, handles, names, label(hue) if hue else None)
    if path is not None:
        save_figure(fig, path)
    return fig


def _draw_front(ax: Any, data: pd.DataFrame, x: str, y: str) -> bool:
    """The Pareto front of ``data`` as a staircase (the region it dominates lies behind the steps)."""
    xs = data[x].to_numpy(dtype=float)
    ys = data[y].to_numpy(dtype=float)
    max_x, max_y = x in HIGHER_IS_BETTER, y in HIGHER_IS_BETTER
    front = pareto_front(xs, ys, maximize_x=max_x, maximize_y=max_y)
    fx, fy = xs[front], ys[front]
    # the corner between two front points is the one both dominate: (next x, this y) when lower x is
    # better, (this x, next y) when higher x is better
    where = "pre" if max_x else "post"
    ax.step(fx, fy, where=where, color="#222222", linewidth=1.4, zorder=4)
    ax.scatter(fx, fy, s=70, facecolors="none", edgecolors="#222222", linewidths=1.2, zorder=5)
    return True


def sorted_values(series: pd.Series) -> list[Any]:
    values = list(series.dropna().unique())
    try:
        return sorted(values)
    except TypeError:  # numbers, then words (a parameter's values and its NOT_SET)
        return sorted(values, key=lambda v: (isinstance(v, str), v if isinstance(v, str) else float(v)))


#: the hue or panel of runs that did not set a parameter (their sweep left it at the system's default)
NOT_SET = "default"


def as_groups(data: pd.DataFrame, columns: Sequence[str | None]) -> pd.DataFrame:
    """``data`` with each of ``columns`` (hue, facet) fit to name lines and panels: whole numbers stored as
    floats (a parameter some rows lack reads back as float) shown as whole numbers, and a missing value as
    :data:`NOT_SET` (rows of a sweep that left the parameter at its default were dropped unseen)."""
    out = data
    for name in filter(None, columns):
        values = data[name]
        whole = values.dtype.kind == "f" and bool(np.all(np.mod(values.dropna(), 1) == 0))
        if not whole and not values.isna().any():
            continue
        if out is data:
            out = data.copy()
        out[name] = pd.Series([NOT_SET if pd.isna(v) else int(v) if whole else v for v in values],
                              index=values.index, dtype=object)
    return out


def _style(i: int, system: str | None) -> dict[str, Any]:
    dashed = system is not None and is_bound(str(system))
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)],
            "hatch": HATCHES[i // len(PALETTE) % len(HATCHES)], "linestyle": (0, (4, 2)) if dashed else "-"}


def _handle(style: dict[str, Any], kind: str, hollow: bool = False) -> Any:
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


def _lines(ax: Any, data: pd.DataFrame, x: str, y: str, hue: str | None, hues: list[Any],
           styles: dict[Any, dict[str, Any]], full: int = 1) -> None:
    """One line per hue; a point that averages fewer than ``full`` runs is drawn hollow."""
    for h in hues:
        sub = data[data[hue] == h] if hue else data
        if sub.empty:
            continue
        stats = sub.groupby(x)[y].agg(["mean", "min", "max", "size"]).sort_index()
        style = styles[h]
        ax.plot(stats.index, stats["mean"], color=style["color"], marker=style["marker"],
                linestyle=style["linestyle"], linewidth=1.6, markersize=5, zorder=3)
        short = stats[stats["size"] < full]
        if not short.empty:
            ax.plot(short.index, short["mean"], color=style["color"], marker=style["marker"], linestyle="none",
                    markersize=5, markerfacecolor="white", zorder=4)
        if (stats["max"] > stats["min"]).any():
            ax.fill_between(stats.index, stats["min"], stats["max"], color=style["color"], alpha=0.15,
                            linewidth=0, zorder=2)
    if data[x].dtype.kind in "iu" or np.allclose(data[x], np.round(data[x])):
        ax.set_xticks(sorted(data[x].unique()))


def _bars(ax: Any, data: pd.DataFrame, x: str, y: str, hue: str | None, hues: list[Any],
          styles: dict[Any, dict[str, Any]]) -> None:
    groups = sorted_values(data[x])
    width = 0.8 / len(hues)
    for j, h in enumerate(hues):
        sub = data[data[hue] == h] if hue else data
        stats = sub.groupby(x)[y].agg(["mean", "min", "max"]).reindex(groups)
        pos = np.arange(len(groups)) - 0.4 + (j + 0.5) * width
        err = np.vstack([stats["mean"] - stats["min"], stats["max"] - stats["mean"]])
        ax.bar(pos, stats["mean"], width * 0.92, color=styles[h]["color"], hatch=styles[h]["hatch"],
               edgecolor="white", linewidth=0, zorder=3, yerr=err if np.nan_to_num(err).any() else None,
               ecolor="#444444", capsize=2)
    ax.set_xticks(np.arange(len(groups)), [str(g) for g in groups], rotation=30 if len(groups) > 4 else 0,
                  ha="right" if len(groups) > 4 else "center")


def _tidy(ax: Any) -> None:
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
    """Log axis (``which``: "x" or "y") labelled with plain numbers at 1, 2, 5 times powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.10g}"))
    axis.set_minor_formatter(NullFormatter())


def _wide(values: pd.Series) -> bool:
    positive = values[values > 0]
    # a ratio, not LOG_RATIO * min: that overflowed (a RuntimeWarning) for values near the float maximum
    return len(positive) == len(values) and len(values) > 1 and positive.max() / LOG_RATIO > positive.min()


#: no metric of a run comes near this magnitude; beyond it matplotlib's axis margins overflow
DRAWABLE = 1e300


def check_drawable(data: pd.DataFrame, columns: Sequence[tuple[str, str]], source: str | None) -> None:
    """One line for a numeric axis column (name, argument) holding a value too large to draw (an internal
    error in matplotlib's tick placement before)."""
    for name, role in columns:
        if data[name].dtype.kind not in "biuf":
            continue
        values = data[name].to_numpy(dtype=float)
        huge = values[np.abs(values) > DRAWABLE]
        if huge.size:
            raise ConfigError(f"column '{name}' holds {huge[0]:g}, too large to draw", source=source, field=role,
                              fix="check how the results file was written: no run's metric comes near it")


# ----------------------------------------------------------------------------- the standard set
def slots_column(frame: pd.DataFrame) -> str:
    """The swept ``cache.slots_per_layer`` if any, else the slots each run got (a metric)."""
    return "cache.slots_per_layer" if "cache.slots_per_layer" in frame.columns else "slots_per_layer"


def facet_for(frame: pd.DataFrame, exclude: Sequence[str]) -> str | None:
    """The hardware profile (or trace) as panels when the sweep has several."""
    for name in ("hw", "trace"):
        if name not in exclude and name in frame.columns and frame[name].nunique() > 1:
            return name
    return None


def fig_tpot_vs_slots(frame: pd.DataFrame, path: str | os.PathLike | None = None) -> Figure:
    """TPOT against GPU cache slots per layer, one line per system (bounds dashed), one panel per profile."""
    x = slots_column(frame)
    return plot_results(frame, x=x, y="tpot_ms_mean", hue="system", facet=facet_for(frame, (x,)), path=path,
                        title="TPOT vs GPU cache slots per layer")


def prefetch_parameter(frame: pd.DataFrame) -> str | None:
    """A numeric ``prefetch.*`` parameter the sweep varies, if any."""
    for c in frame.columns:
        if c.startswith("prefetch.") and frame[c].dtype.kind in "biuf" and frame[c].nunique() > 1:
            return c
    return None


def prefetched(data: pd.DataFrame) -> bool:
    """Whether any run issued a prefetch."""
    return "prefetches" in data.columns and bool(data["prefetches"].fillna(0).gt(0).any())


def fig_hit_rate_vs_prefetch(frame: pd.DataFrame, path: str | os.PathLike | None = None) -> Figure:
    """GPU hit rate against the prefetch count: a varied ``prefetch.*`` parameter, else prefetches issued."""
    param = prefetch_parameter(frame)
    if param:
        return plot_results(frame, x=param, y="gpu_hit_rate", hue="system", facet=facet_for(frame, (param,)),
                            path=path, title=f"GPU hit rate vs {param}")
    data = ok_rows(frame)
    if not prefetched(data):  # every marker would sit at x = 0: the hit rate by cache size (or system) instead
        slots = slots_column(data)
        x = slots if slots in data.columns and data[slots].nunique() > 1 else "system"
        return plot_results(data, x=x, y="gpu_hit_rate", hue="system" if x != "system" else None,
                            facet=facet_for(data, (x,)), path=path,
                            title=f"GPU hit rate vs {label(x)} (no run prefetched)")
    fig = DisplayFigure(figsize=(8.4, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    systems = ordered_systems(data["system"].unique())
    styles = {s: _style(i, s) for i, s in enumerate(systems)}
    per_run = data.get("decode_tokens", pd.Series(1, index=data.index)).fillna(0) \
        + data.get("prefill_tokens", pd.Series(0, index=data.index)).fillna(0)
    x_values = data["prefetches"] / per_run.clip(lower=1)
    for s in systems:
        mine = data["system"] == s
        ax.scatter(x_values[mine], data.loc[mine, "gpu_hit_rate"], color=styles[s]["color"],
                   marker=styles[s]["marker"], s=28, alpha=0.85, zorder=3, edgecolors="none")
    ax.set_xlabel("prefetches issued per token")
    ax.set_ylabel(label("gpu_hit_rate"))
    ax.set_ylim(-0.02, 1.02)
    _tidy(ax)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    fig.legend([_handle(styles[s], "marker") for s in systems], systems, title="system", loc="outside right center",
               frameon=False, fontsize=9)
    fig.suptitle("GPU hit rate vs prefetches (one marker per point)", x=0.01, ha="left", fontsize=11)
    if path is not None:
        save_figure(fig, path)
    return fig


def representative(frame: pd.DataFrame, keep: Sequence[str] = ("system",)) -> dict[str, Any]:
    """One value per varying parameter (other than ``keep``): the middle one of its sorted values.

    The breakdown and Gantt figures show one point per system; this picks it
    the same way every time. Each parameter's values are those of the rows that
    match the ones chosen before it, so the point exists even when the sweep is
    no full grid (``zip:`` groups, failed points).
    """
    chosen: dict[str, Any] = {}
    rows = frame
    for c in varying(frame, parameter_columns(frame)):
        if c in keep:
            continue
        values = sorted_values(rows[c])
        if not values:  # only missing values left (a parameter some rows lack)
            continue
        chosen[c] = values[(len(values) - 1) // 2]
        rows = rows[(rows[c] == chosen[c]).to_numpy()]
    return chosen


def select(frame: pd.DataFrame, where: dict[str, Any]) -> pd.DataFrame:
    """The rows of ``frame`` with every ``where`` column at its value (a key spelled with ``__`` too); one line
    for a ``where`` that is no dict or names no column (a KeyError or AttributeError before)."""
    if not isinstance(where, Mapping):
        raise ConfigError(f"where must be a dict of parameter values, got {where!r}", field="where",
                          fix="e.g. where={'system': 'smoe', 'cache.slots_per_layer': 2}")
    mask = np.ones(len(frame), dtype=bool)
    for c, v in where.items():
        mask &= (frame[column(frame, c, "where")] == v).to_numpy()
    return frame[mask]


def no_point(where: dict[str, Any]) -> ConfigError:
    return ConfigError(f"no finished point with {describe(where)}", field="where",
                       fix="pick parameter values the sweep ran")


def describe(where: dict[str, Any]) -> str:
    return ", ".join(f"{k}={Path(v).name if k == 'trace' else v}" for k, v in where.items())


def fig_breakdown(frame: pd.DataFrame, where: dict[str, Any] | None = None,
                  path: str | os.PathLike | None = None) -> Figure:
    """Where the time went, stacked per system, at one point of the other parameters (default: the middle one)."""
    data = ok_rows(frame)
    where = representative(data) if where is None else where
    rows = select(data, where).drop_duplicates("system")
    # as every other figure orders them (registry order, bounds last), not as the workers happened to finish
    rows = rows.set_index("system", drop=False).loc[ordered_systems(rows["system"].unique())]
    if rows.empty:
        raise no_point(where)
    runs = [{"system": r["system"],
             "breakdown_ms": {c: float(r.get(f"breakdown_{c}_ms", 0.0) or 0.0) for c in _categories(data)}}
            for _, r in rows.iterrows()]
    fig = plot_breakdown(runs)
    fit_width(fig, fig.axes[0].set_title(f"time breakdown per system ({describe(where)})" if where else
                                         "time breakdown per system", loc="left", fontsize=11))
    if path is not None:
        save_figure(fig, path)
    return fig


def _categories(frame: pd.DataFrame) -> list[str]:
    found = [c[len("breakdown_"):-len("_ms")] for c in frame.columns
             if c.startswith("breakdown_") and c.endswith("_ms")]
    return [c for c in BREAKDOWN if c in found] + [c for c in found if c not in BREAKDOWN]


def gantt_point(frame: pd.DataFrame, where: dict[str, Any] | None = None) -> pd.Series:
    """The point a Gantt chart shows: at the representative parameters, the fastest system that is no bound."""
    data = ok_rows(frame)
    where = representative(data) if where is None else where
    rows = select(data, where)
    if rows.empty:  # an IndexError ("single positional indexer is out-of-bounds") before
        raise no_point(where)
    real = rows[[not is_bound(s) for s in rows["system"]]]
    rows = real if not real.empty else rows
    fastest = [c for c in (headline_metric(rows), "system") if c in rows.columns]
    return rows.sort_values(fastest, na_position="last").iloc[0]


def fig_gantt(point: pd.Series | dict[str, Any], path: str | os.PathLike | None = None,
              steps: int = 2) -> Figure:
    """Replay one results row again with its timeline and draw ``steps`` decode steps of it."""
    from moesim.sim.result import result_to_frames
    from moesim.sim.run import simulate
    point = dict(point)
    for name in ("trace", "hw", "system"):
        if not _present(point.get(name)):
            raise ConfigError(f"the point has no '{name}'", field=name,
                              fix="give a row of the --out file of `moesim sweep`, or pass --no-gantt")
    trace = str(point.get("trace_path") or point["trace"])
    hw = str(point.get("hw_path") or point["hw"])
    if not Path(trace).is_file():
        raise ConfigError(f"trace '{trace}' of this point is not here", source=trace, field="trace_path",
                          fix="run the report where the sweep ran, or pass --no-gantt")
    settings = {k: _setting(v) for k, v in point.items() if "." in k and _present(v)}
    model = point.get("model") if _present(point.get("model")) else None
    result = simulate(trace, hw, str(point["system"]), settings, model_preset=model,
                      seed=int(point.get("seed", 0) or 0), timeline=True, decisions=False)
    frame = result_to_frames(result)["timeline"]
    window = decode_window(result.steps, steps)
    title = f"{point['system']} on {Path(str(point['trace'])).name}, {point['hw']}"
    if settings:
        title += " (" + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")"
    return plot_gantt(frame, path, window=window, title=title)


def decode_window(steps: Sequence[Any], count: int = 2) -> tuple[float, float] | None:
    """(start, end) of ``count`` decode steps a little into the run, or None (the default window)."""
    decode = [s for s in steps if s.phase == "decode"]
    if not decode:
        return None
    first = min(len(decode) - 1, 2)  # skip the first steps: caches are still cold there
    chosen = decode[first:first + count]
    return chosen[0].start, chosen[-1].end


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and np.isnan(value))


def _setting(value: Any) -> str:
    from moesim.sweep import setting_str
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # a column with gaps turned its ints into floats
    return setting_str(value)


def headline_metric(frame: pd.DataFrame) -> str:
    """The latency the standard figures and the report's table compare: mean TPOT, or TTFT where no run
    decoded a token (a prefill-only trace leaves TPOT undefined in every row)."""
    for name in ("tpot_ms_mean", "ttft_ms"):
        if name in frame.columns and frame[name].dtype.kind in "biuf" and \
                np.isfinite(frame[name].astype(float)).any():
            return name
    return "tpot_ms_mean"


def standard_figures(frame: pd.DataFrame, *, gantt: bool = True,
                     source: str | None = None) -> dict[str, tuple[Figure | None, str]]:
    """The standard set: name -> (figure or None, caption or the reason it is missing). A figure whose
    columns the results lack (an older sweep's file) or never defined is missing with the reason; the rest
    are drawn."""
    data = ok_rows(frame, source)
    if "system" not in data.columns:  # every figure and table compares systems
        raise ConfigError("not a sweep result (no 'system' column)", source=source, field="system",
                          fix="give the --out file of `moesim sweep`")
    out: dict[str, tuple[Figure | None, str]] = {}
    slots = slots_column(data)
    if slots in data.columns and data[slots].nunique() > 1:
        y = headline_metric(data)
        short, what = ("TPOT", "TPOT (mean time per output token)") if y == "tpot_ms_mean" else \
            ("TTFT", "TTFT (no run decoded a token)")
        out["tpot_vs_slots"] = _drawn(
            "latency", lambda: plot_results(data, x=slots, y=y, hue="system", facet=facet_for(data, (slots,)),
                                            title=f"{short} vs GPU cache slots per layer"),
            f"{what} against GPU cache slots per layer; dashed lines are bounds, bands span points averaged "
            "together.")
    else:
        out["tpot_vs_slots"] = (None, "the sweep varies no cache size")
    against = "prefetching" if prefetched(data) or prefetch_parameter(data) else \
        "the cache size (or per system): no run prefetched"
    out["hit_rate_vs_prefetch"] = _drawn(
        "hit-rate", lambda: fig_hit_rate_vs_prefetch(data),
        f"GPU hit rate (activated experts resident when their layer is planned) against {against}.")
    where = representative(data)
    out["breakdown"] = _drawn(
        "breakdown", lambda: fig_breakdown(data, where),
        f"Time per category summed over all layers and steps (000 Sec. VI-E, Fig. 13), at "
        f"{describe(where) or 'the only point'}.")
    if gantt:
        try:
            point = gantt_point(data, where)
            out["gantt"] = (fig_gantt(point), f"CPU, GPU and PCIe activity over two decode steps of "
                            f"{point['system']}, the fastest system at this point that is not a bound.")
        except ConfigError as err:
            out["gantt"] = (None, f"no Gantt chart: {err}")
    return out


def _drawn(name: str, draw: Callable[[], Figure], caption: str) -> tuple[Figure | None, str]:
    """A standard figure and its caption, or None and why these results cannot give it."""
    try:
        return draw(), caption
    except ConfigError as err:  # its fix names the options of `moesim plot`, which the report has not
        return None, f"no {name} figure: {err.detail}"
