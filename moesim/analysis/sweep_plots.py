"""Any metric of a sweep against any parameter (lines or bars) or against another metric (scatter with the
Pareto front). Like :mod:`moesim.analysis.plots`, figures are bare matplotlib Figures on the Agg canvas: no
display, no pyplot state."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from moesim.analysis.figure_style import (hue_styles, legend_handle, log_axis, short_settings, side_legend, spans_decade,
                                          tidy_axes)
from moesim.analysis.plots import DisplayFigure, fit_width, save_figure
from moesim.analysis.sweep_results import (HIGHER_IS_BETTER, X_SETTINGS, UnevenMeans, as_groups, check_drawable,
                                           column, failed_note, fewer_runs, hue_names, is_bound, label, ok_rows,
                                           on_hardware, ordered_systems, parameter_columns, sorted_values, system_label,
                                           varying)
from moesim.api_args import checked_keywords
from moesim.errors import ConfigError
from moesim.notebook import callers_lines

# ----------------------------------------------------------------------------- the general plot
@callers_lines
@checked_keywords
def plot_results(frame: pd.DataFrame, *, x: str, y: str, hue: str | None = None,
                 facet: str | Sequence[str] | None = None, path: str | os.PathLike | None = None,
                 source: str | None = None, title: str = "", logy: bool | None = None) -> Figure:
    """``y`` against ``x``, one line per ``hue`` value, one panel per ``facet`` value.

    ``facet`` may name several columns: one panel per combination of their
    values, the last one's values across (columns), the others' down (rows).
    Numeric ``x``: lines with markers; other ``x``: grouped bars. Points that
    differ in parameters not on the figure are averaged, and the band (or
    error bar) spans their minimum to maximum; the figure says which
    parameters those were. A parameter that sets an ``x`` metric
    (``cache.slots`` for ``slots_per_layer``) is on the x axis, not averaged.
    ``logy`` (default: lines whose values span more than :data:`LOG_RATIO`;
    bars stay linear from zero) draws the y axis on a log scale, which its
    label says. The title's second line names the profiles the drawn points
    ran on, with their GPU and host CPU (:func:`with_hardware`).
    """
    x = column(frame, x, "x", source)
    y = column(frame, y, "y", source)
    hue = column(frame, hue, "hue", source) if hue else None
    facets = [column(frame, f, "facet", source) for f in ([facet] if isinstance(facet, str) or not facet
                                                            or not isinstance(facet, (list, tuple)) else facet)
              if f]
    data = ok_rows(frame, source)
    if data[y].dtype.kind not in "biuf":
        raise ConfigError(f"column '{y}' is not numeric", source=source, field="y",
                          fix="plot a metric such as tpot_ms_mean or gpu_hit_rate")
    data = data[np.isfinite(data[y].astype(float))]
    if data.empty:
        raise ConfigError(f"column '{y}' has no finite values", source=source, field="y",
                          fix="choose a metric the runs defined (e.g. no TTFT without prefill)")
    data, without_x = rows_with_x(data, x, source)
    check_drawable(data, ((x, "x"), (y, "y")), source)
    data = as_groups(data, (hue, *facets))
    panel_values = [_panel_values(data, f) for f in facets]
    if len(facets) > 1:  # one column naming each panel by its facets' values
        data = data.assign(_panel=list(zip(*(data[f] for f in facets))))
        facet = "_panel"
        panels = list(itertools.product(*panel_values))
        cols = len(panel_values[-1])
    else:
        facet = facets[0] if facets else None
        panels = panel_values[0] if facets else [None]
        cols = min(len(panels), 3)
    shown = {x, hue, *facets} - {None}
    averaged = [c for c in varying(data, parameter_columns(data)) if c not in shown]
    tied = [c for c in averaged if c in X_SETTINGS.get(x, ())]  # what the x metric stands for
    averaged = [c for c in averaged if c not in tied]
    keys = [c for c in (facet, hue, x) if c]
    runs = full = None
    if averaged:  # runs per point, counted apart per value of a tied parameter
        counted = keys + tied
        runs = data.groupby(counted, dropna=False)[y].size()
        full = full_runs(data, counted, averaged)
        if tied:
            runs = runs.groupby(level=list(range(len(keys))), dropna=False).sum()
            full = full.groupby(level=list(range(len(keys))), dropna=False).sum()
    hollow = set(runs[runs < full].index) if averaged else set()
    rows = -(-len(panels) // cols)
    # many panels across: narrower ones, so the figure stays within a page's width
    width, height = (4.6, 3.6) if cols <= 3 else (3.8, 3.2)
    fig = DisplayFigure(figsize=(width * cols + 2.4, height * rows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    numeric_x = data[x].dtype.kind in "biuf"
    hues = (ordered_systems(data[hue].dropna().unique()) if hue == "system" else sorted_values(data[hue])) \
        if hue else [None]
    _check_hues(hues, hue, source)
    styles = hue_styles(hues, hue == "system", ordered_systems(frame["system"].dropna().unique())
                        if hue == "system" else None)
    for ax, panel in zip(axes.flat, panels):
        sub = data[data[facet].map(lambda v, p=panel: v == p)] if facet else data
        if numeric_x:
            _lines(ax, sub, x, y, hue, hues, styles, _hollow_xs(hollow, keys, facet, panel, hue))
        else:
            _bars(ax, sub, x, y, hue, hues, styles)
        ax.set_xlabel(label(x))
        if facets:
            values = panel if len(facets) > 1 else (panel,)
            ax.set_title("\n".join(f"{label(f)} = {_shown(f, v, among)}"
                                   for f, v, among in zip(facets, values, panel_values)),
                         fontsize=10 if len(facets) == 1 else 9)
            if sub.empty:
                ax.text(0.5, 0.5, "no finished point", transform=ax.transAxes, ha="center", va="center",
                        color="#777777", fontsize=9)
        tidy_axes(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(label(y))
    # bars stand on zero: a log axis makes their lengths meaningless, so only lines turn it on by themselves
    if logy if logy is not None else numeric_x and spans_decade(data[y]):
        for ax in axes.flat:
            log_axis(ax)
    spread = "band" if numeric_x else "error bars"
    note = f"mean over {', '.join(averaged)} ({spread}: min to max)" if averaged else ""
    short = fewer_runs(runs, full)
    if short:
        note += f"; {short}" + (" (hollow markers)" if numeric_x else "")
        # at the caller's line, through fig_tpot_vs_slots and the like too (stacklevel=2 named this file there)
        from moesim.util import warn_at_caller
        warn_at_caller(f"{title or source or 'results'}: {short}", UnevenMeans)
    # a facet's missing points said why
    note = "; ".join(part for part in (note, without_x, failed_note(frame)) if part)
    heading = with_hardware(title or f"{label(y)} vs {label(x)}", data)
    fit_width(fig, fig.suptitle(heading + (f"\n{note}" if note else ""), x=0.01, ha="left", fontsize=11))
    if hue:
        names = _hue_names(data, hue, hues)
        side_legend(fig, [legend_handle(styles[h], "line" if numeric_x else "bar") for h in hues], names, label(hue))
    if path is not None:
        save_figure(fig, path)
    return fig


#: lines (or marker colours) a legend tells apart: four columns of ten beside the panels; 60 ran over the title
MAX_HUES = 40


def _check_hues(hues: list[Any], hue: str | None, source: str | None) -> None:
    """``--hue point_id`` (68 values) drew a legend over the title and panels squeezed to nothing, with a
    matplotlib warning: one line instead."""
    if hue and len(hues) > MAX_HUES:
        raise ConfigError(f"column '{hue}' has {len(hues)} values, more than a legend tells apart ({MAX_HUES})",
                          source=source, field="hue",
                          fix="pick a column with fewer values, or make it the facet (one panel per value)")


def with_hardware(heading: str, data: pd.DataFrame) -> str:
    """``heading`` and, on a line of its own, the profiles ``data`` ran on with their GPU and host CPU
    (:func:`moesim.analysis.sweep_results.on_hardware`)."""
    on = on_hardware(data)
    return f"{heading}\n{on}" if on else heading


def _shown(column: str, value: Any, among: Sequence[Any] = ()) -> str:
    """A facet's value in a panel title: a trace by its file name, a system as the legends name it ("oracle
    (bound)": a panel of a bound read as a deployable system's), a long setting (a per-layer list) shortened
    apart from the other values ``among`` (:func:`short_settings`)."""
    if column == "system":
        return system_label(str(value))
    if column == "trace":
        return os.path.basename(str(value))
    values = [str(v) for v in among] if str(value) in map(str, among) else [str(value)]
    return short_settings(values)[values.index(str(value))]


def _hue_names(data: pd.DataFrame, hue: str, hues: list[Any]) -> list[str]:
    """Legend entries: :func:`hue_names`, a long setting (a per-layer list) shortened (:func:`short_settings`)."""
    names = hue_names(data, hue, hues)
    return names if hue == "system" else short_settings(names)


def _panel_values(data: pd.DataFrame, facet: str) -> list[Any]:
    """A facet's values in panel order: systems as every legend orders them (bounds last), others sorted."""
    return ordered_systems(data[facet].dropna().unique()) if facet == "system" else sorted_values(data[facet])


def rows_with_x(data: pd.DataFrame, x: str, source: str | None = None) -> tuple[pd.DataFrame, str]:
    """The rows that have an ``x`` value, and a note naming the runs left out ('' when none is).

    A parameter that only some of a sweep's systems take (``per_system``) is empty in the others' rows: they
    have no place on its axis, and kept, they were counted as one more point whose many runs made every drawn
    point look short of runs (hollow, "instead of") and added an empty 'default' line to the legend."""
    missing = data[x].isna()
    if not missing.any():
        return data, ""
    if missing.all():
        raise ConfigError(f"no finished point has a value of '{x}'", source=source, field="x",
                          fix="choose a parameter the sweep set (a column with values), e.g. cache.slots_per_layer")
    left = data[missing]
    who = f" ({', '.join(ordered_systems(left['system'].unique()))})" if "system" in left.columns else ""
    return data[~missing], f"{len(left)} run{'s' if len(left) > 1 else ''} without {x}{who} not drawn"


def _lines(ax: Any, data: pd.DataFrame, x: str, y: str, hue: str | None, hues: list[Any],
           styles: dict[Any, dict[str, Any]], hollow: dict[Any, set[Any]] | None = None) -> None:
    """One line per hue; the points at ``hollow[hue]`` (x values that average fewer runs than they would over
    every averaged value) are drawn hollow."""
    for h in hues:
        sub = data[data[hue] == h] if hue else data
        if sub.empty:
            continue
        stats = sub.groupby(x)[y].agg(["mean", "min", "max", "size"]).sort_index()
        style = styles[h]
        ax.plot(stats.index, stats["mean"], color=style["color"], marker=style["marker"],
                linestyle=style["linestyle"], linewidth=1.6, markersize=5, zorder=3)
        short = stats[stats.index.isin((hollow or {}).get(h, set()))]
        if not short.empty:
            ax.plot(short.index, short["mean"], color=style["color"], marker=style["marker"], linestyle="none",
                    markersize=5, markerfacecolor="white", zorder=4)
        if (stats["max"] > stats["min"]).any():
            ax.fill_between(stats.index, stats["min"], stats["max"], color=style["color"], alpha=0.15,
                            linewidth=0, zorder=2)
    if data[x].dtype.kind in "iu" or np.allclose(data[x], np.round(data[x])):
        ax.set_xticks(sorted(data[x].unique()))


def full_runs(data: pd.DataFrame, keys: list[str], averaged: list[str]) -> pd.Series:
    """Per point of the figure (a group of ``keys``), the runs its mean would take over every averaged value.

    Systems are counted apart by which averaged parameters they leave empty: a parameter only some systems take
    (a sweep's ``per_system``) is empty in every row of the others, whose points are no less complete for it."""
    runs = data.groupby(keys, dropna=False).size()
    empty = data[averaged].isna()
    if "system" in data.columns:
        empty = empty.groupby(data["system"]).transform("all")
    takes = pd.Series([tuple(row) for row in empty.to_numpy()], index=data.index, name="_takes")
    parts = data.groupby([*(data[k] for k in keys), takes], dropna=False).size()
    most = parts.groupby(level="_takes").max()
    missing = pd.Series(parts.index.get_level_values("_takes").map(most), index=parts.index) - parts
    return runs + missing.groupby(level=list(range(len(keys))), dropna=False).sum().reindex(runs.index)


def _hollow_xs(hollow: set[Any], keys: list[str], facet: str | None, panel: Any, hue: str | None) -> dict[Any, set]:
    """The x values to draw hollow in ``panel``, per hue value (None without a hue)."""
    out: dict[Any, set] = {}
    for key in hollow:
        parts = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        if facet and parts[facet] != panel:
            continue
        out.setdefault(parts[hue] if hue else None, set()).add(parts[keys[-1]])
    return out


def _bars(ax: Any, data: pd.DataFrame, x: str, y: str, hue: str | None, hues: list[Any],
          styles: dict[Any, dict[str, Any]]) -> None:
    groups = ordered_systems(data[x].dropna().unique()) if x == "system" else sorted_values(data[x])
    width = 0.8 / len(hues)
    for j, h in enumerate(hues):
        sub = data[data[hue] == h] if hue else data
        stats = sub.groupby(x)[y].agg(["mean", "min", "max"]).reindex(groups)
        pos = np.arange(len(groups)) - 0.4 + (j + 0.5) * width
        err = np.vstack([stats["mean"] - stats["min"], stats["max"] - stats["mean"]])
        ax.bar(pos, stats["mean"], width * 0.92, color=styles[h]["color"], hatch=styles[h]["hatch"],
               edgecolor="white", linewidth=0, zorder=3, yerr=err if np.nan_to_num(err).any() else None,
               ecolor="#444444", capsize=2)
    # systems named as in the legends: "oracle (bound)", "all-in-gpu (reference)", "buddymoe (substitutes)"; their
    # bars read as deployable systems' otherwise
    names = hue_names(data, "system", groups) if x == "system" else short_settings(groups)
    # many names, or long ones (per-layer lists, even shortened) that would run into each other: slanted
    slant = len(groups) > 4 or sum(len(n) for n in names) > TICK_CHARACTERS
    ax.set_xticks(np.arange(len(groups)), names, rotation=30 if slant else 0, ha="right" if slant else "center")


#: characters of a bar chart's group names in all that fit level under a panel (about 4.6 inches at 10 pt)
TICK_CHARACTERS = 40


# ----------------------------------------------------------------------------- metric against metric
@callers_lines
@checked_keywords
def plot_scatter(frame: pd.DataFrame, *, x: str, y: str, hue: str | None = "system", facet: str | None = None,
                 pareto: bool = True, path: str | os.PathLike | None = None, source: str | None = None,
                 title: str = "") -> Figure:
    """``y`` against ``x`` with one marker per run (nothing averaged, no lines between runs).

    With ``pareto`` the front of the runs that are neither a bound nor a
    reference (oracle and all-in-GPU are drawn hollow and left out) is drawn
    as a staircase: the runs no other run beats on both metrics. Lower is better except for
    :data:`HIGHER_IS_BETTER`. The legend sits right of the panels, clear of
    the title, whose second line names the profiles with their GPU and host CPU.
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
    panels = _panel_values(data, facet) if facet else [None]
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig = DisplayFigure(figsize=(4.8 * cols + 2.6, 3.8 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    hues = (ordered_systems(data[hue].dropna().unique()) if hue == "system" else sorted_values(data[hue])) \
        if hue else [None]
    _check_hues(hues, hue, source)
    styles = hue_styles(hues, hue == "system", ordered_systems(frame["system"].dropna().unique())
                        if hue == "system" else None)
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
            ax.set_title(f"{label(facet)} = {_shown(facet, panel, panels)}", fontsize=10)
        tidy_axes(ax)
        ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax, name in ((a, n) for a in axes.flat for n in ("x", "y")):
        if spans_decade(data[x if name == "x" else y]):
            log_axis(ax, name)
    handles = [legend_handle(styles[h], "marker", hollow=hue == "system" and is_bound(str(h))) for h in hues] \
        if hue else []
    names = _hue_names(data, hue, hues) if hue else []
    if drew_front:
        handles.append(Line2D([], [], color="#222222", linewidth=1.4, linestyle="-"))
        names.append("Pareto front")
    better = f"{'higher' if x in HIGHER_IS_BETTER else 'lower'} x, {'higher' if y in HIGHER_IS_BETTER else 'lower'} y"
    note = f"one marker per run; Pareto front: runs no other beats on both ({better} is better)" if drew_front \
        else "one marker per run"
    note = "; ".join(part for part in (note, failed_note(frame)) if part)
    heading = with_hardware(title or f"{label(y)} vs {label(x)}", data)
    fit_width(fig, fig.suptitle(f"{heading}\n{note}", x=0.01, ha="left", fontsize=11))
    if handles:  # centred on the right, clear of the title lines
        side_legend(fig, handles, names, label(hue) if hue else None)
    if path is not None:
        save_figure(fig, path)
    return fig


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
