"""The standard figures of a sweep, which ``moesim report`` embeds:

* TPOT against GPU cache slots per layer, one line per system (TTFT when no
  run decoded a token);
* GPU hit rate against the prefetch count (a varied ``prefetch.*`` parameter,
  else the prefetches each run issued);
* where the time went, stacked per system (the categories of
  000_dba2fecbbc66318b.txt Sec. VI-E, Fig. 13, via
  :func:`moesim.analysis.plots.plot_breakdown`);
* a CPU/GPU/PCIe Gantt chart of two decode steps of one point, replayed again
  with its timeline (:func:`moesim.analysis.plots.plot_gantt`).

Any metric against any parameter or another metric is
:mod:`moesim.analysis.sweep_plots` (``plot_results``, ``plot_scatter``), the
results file and its columns :mod:`moesim.analysis.sweep_results`, colours and
axes :mod:`moesim.analysis.figure_style`; their names are importable from here
too, as before the split. Like :mod:`moesim.analysis.plots`, figures are bare
matplotlib Figures on the Agg canvas: no display, no pyplot state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from moesim.analysis.figure_style import (BOUND_PALETTE, HATCHES, LOG_RATIO, MARKERS, PALETTE,  # noqa: F401
                                          hue_styles, legend_handle, log_axis, series_style, short_setting,
                                          side_legend, system_styles, tidy_axes)
from moesim.analysis.plots import DisplayFigure, fit_width, plot_breakdown, plot_gantt, save_figure, settings_note
from moesim.analysis.sweep_plots import pareto_front, plot_results, plot_scatter, with_hardware  # noqa: F401
from moesim.analysis.sweep_results import (BASE_PARAMETERS, COLUMN_WORDS, HIGHER_IS_BETTER, LABELS,  # noqa: F401
                                           NOT_SET, SUBSTITUTES_MARK, X_SETTINGS, UnevenMeans, as_groups,
                                           bound_kind, column, fewer_runs, headline_metric, hue_names, hw_named,
                                           is_bound, label, load_results, ok_rows, ordered_systems,
                                           parameter_columns, routed_activations, setting_text, sorted_values,
                                           substituting, substitution_note, system_label, varying)
from moesim.api_args import checked_keywords
from moesim.errors import ConfigError, MoesimError
from moesim.notebook import callers_lines
from moesim.sim.bookkeeping import BREAKDOWN

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


#: the most panels a standard figure splits into; parameters past it are averaged (the heading says so)
MAX_PANELS = 12


def facets_for(frame: pd.DataFrame, exclude: Sequence[str]) -> list[str]:
    """The swept parameters a standard figure shows as panels rather than averaging them: the hardware profile,
    the trace, then every other swept parameter in column order (not the system, the seed, ``exclude`` or what
    the x axis stands for), each while the panels stay within :data:`MAX_PANELS`; ordered by how many values
    they have, so the one with most runs across and the others down. Averaged, a sweep over three PCIe
    bandwidths and two traces made one line per system of six settings, said only by a "mean over" note."""
    tied = {t for x in exclude for t in X_SETTINGS.get(x, ())}
    params = [c for c in varying(frame, parameter_columns(frame)) if c not in ("system", "seed", *exclude, *tied)]
    first = ("hw", "trace")
    params = sorted(params, key=lambda c: first.index(c) if c in first else len(first))  # stable: column order
    chosen: list[str] = []
    panels = 1
    for name in params:
        count = frame[name].nunique(dropna=False)
        if panels * count <= MAX_PANELS:
            chosen.append(name)
            panels *= count
    return sorted(chosen, key=lambda c: frame[c].nunique(dropna=False))


@callers_lines
@checked_keywords
def fig_tpot_vs_slots(frame: pd.DataFrame, path: str | os.PathLike | None = None) -> Figure:
    """TPOT against GPU cache slots per layer, one line per system (bounds and references dashed), one panel
    per setting of the other swept parameters (:func:`facets_for`)."""
    x = slots_column(frame)
    return plot_results(frame, x=x, y="tpot_ms_mean", hue="system", facet=facets_for(frame, (x,)), path=path,
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


@callers_lines
@checked_keywords
def fig_hit_rate_vs_prefetch(frame: pd.DataFrame, path: str | os.PathLike | None = None) -> Figure:
    """GPU hit rate against the prefetch count: a varied ``prefetch.*`` parameter, else prefetches issued."""
    param = prefetch_parameter(frame)
    if param:  # panels by what varies among the runs drawn: those that take the parameter
        drawn = frame[frame[param].notna()]
        return plot_results(frame, x=param, y="gpu_hit_rate", hue="system", facet=facets_for(drawn, (param,)),
                            path=path, title=f"GPU hit rate vs {param}")
    data = ok_rows(frame)
    if not prefetched(data):  # every marker would sit at x = 0: the hit rate by cache size (or system) instead
        slots = slots_column(data)
        x = slots if slots in data.columns and data[slots].nunique() > 1 else "system"
        return plot_results(data, x=x, y="gpu_hit_rate", hue="system" if x != "system" else None,
                            facet=facets_for(data, (x,)), path=path,
                            title=f"GPU hit rate vs {label(x)} (no run prefetched)")
    fig = DisplayFigure(figsize=(8.4, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    systems = ordered_systems(data["system"].unique())
    styles = system_styles(systems)
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
    tidy_axes(ax)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    # the title first: the legend takes as many columns as keep it clear of the title's lines
    fit_width(fig, fig.suptitle(with_hardware("GPU hit rate vs prefetches (one marker per point)", data), x=0.01,
                                ha="left", fontsize=11))
    side_legend(fig, [legend_handle(styles[s], "marker") for s in systems], hue_names(data, "system", systems),
                "system")
    if path is not None:
        save_figure(fig, path)
    return fig


@callers_lines
@checked_keywords
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


def describe(where: dict[str, Any], short: bool = False) -> str:
    """``where`` as 'key=value, ...': a trace by its file name, a whole number read back as a float (a column
    some rows leave empty holds 2.0) as 2; with ``short``, as a figure's title shows it (a per-layer list
    shortened by :func:`short_setting`)."""
    def shown(text: str) -> str:
        return short_setting(text) if short else text
    return ", ".join(f"{k}={Path(v).name if k == 'trace' else shown(setting_text(v))}" for k, v in where.items())


@callers_lines
@checked_keywords
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
    # bars named as the legends name systems ("oracle (bound)", "buddymoe (substitutes)"): bare, a bound's bar
    # read as a deployable system's
    names = hue_names(rows, "system", list(rows["system"]))
    runs = [{"system": name,
             "breakdown_ms": {c: float(r.get(f"breakdown_{c}_ms", 0.0) or 0.0) for c in _categories(data)},
             **({"makespan_s": r["makespan_s"]} if _present(r.get("makespan_s")) else {})}
            for name, (_, r) in zip(names, rows.iterrows())]
    title = f"time breakdown per system ({describe(where, short=True)})" if where else "time breakdown per system"
    return plot_breakdown(runs, path, title=with_hardware(title, rows))


def _categories(frame: pd.DataFrame) -> list[str]:
    found = [c[len("breakdown_"):-len("_ms")] for c in frame.columns
             if c.startswith("breakdown_") and c.endswith("_ms")]
    return [c for c in BREAKDOWN if c in found] + [c for c in found if c not in BREAKDOWN]


@callers_lines
@checked_keywords
def gantt_point(frame: pd.DataFrame, where: dict[str, Any] | None = None) -> pd.Series:
    """The point a Gantt chart shows: at the representative parameters, the fastest system that is neither a
    bound nor a reference."""
    data = ok_rows(frame)
    where = representative(data) if where is None else where
    rows = select(data, where)
    if rows.empty:  # an IndexError ("single positional indexer is out-of-bounds") before
        raise no_point(where)
    real = rows[[not is_bound(s) for s in rows["system"]]]
    rows = real if not real.empty else rows
    fastest = [c for c in (headline_metric(rows), "system") if c in rows.columns]
    return rows.sort_values(fastest, na_position="last").iloc[0]


@callers_lines
@checked_keywords
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
    if not Path(hw).is_file():  # a profile file moved since: `moesim report` failed whole (exit 2), not the chart
        from moesim.hw.profile import profile_path
        hw = str(profile_path(str(point["hw"])))  # a profile name still finds its bundled file
        if not Path(hw).is_file():
            given = str(point.get("hw_path") or point["hw"])
            raise ConfigError(f"hardware profile '{given}' of this point is not here", source=given,
                              field="hw_path", fix="run the report where the sweep ran, or pass --no-gantt")
    settings = {k: setting_text(v) for k, v in point.items() if "." in k and _present(v)}
    model = point.get("model") if _present(point.get("model")) else None
    result = simulate(trace, hw, str(point["system"]), settings, model_preset=model,
                      seed=int(point.get("seed", 0) or 0), timeline=True, decisions=False)
    frame = result_to_frames(result)["timeline"]
    window = decode_window(result.steps, steps)
    hw_settings = {k: v for k, v in settings.items() if k.startswith("hw.")}
    title = f"{point['system']} on {Path(str(point['trace'])).name}, {hw_named(str(point['hw']), hw_settings, path=hw)}"
    return plot_gantt(frame, path, window=window, title=title + settings_note(settings))


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


@callers_lines
@checked_keywords
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
            "latency", lambda: plot_results(data, x=slots, y=y, hue="system", facet=facets_for(data, (slots,)),
                                            title=f"{short} vs GPU cache slots per layer"),
            f"{what} against GPU cache slots per layer, a panel per setting of the other swept parameters (up to "
            f"{MAX_PANELS} panels); dashed lines are bounds and references; where parameters are averaged (the "
            "heading names them), bands span their points' minimum to maximum.")
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
            out["gantt"] = (fig_gantt(point), (f"CPU, GPU and PCIe activity over two decode steps of "
                                               f"{point['system']}, the fastest system at this point that is "
                                               "neither a bound nor a reference."))
        except MoesimError as err:  # a trace or profile damaged since the sweep too: the other figures stand
            out["gantt"] = (None, f"no Gantt chart: {err}")
    return out


def _drawn(name: str, draw: Callable[[], Figure], caption: str) -> tuple[Figure | None, str]:
    """A standard figure and its caption, or None and why these results cannot give it."""
    try:
        return draw(), caption
    except ConfigError as err:  # its fix names the options of `moesim plot`, which the report has not
        return None, f"no {name} figure: {err.detail}"
