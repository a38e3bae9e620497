"""A sweep as one self-contained HTML page: the standard figures and the tables.

Every image is a PNG embedded as a base64 ``data:`` URI and the styles are
inline, so the page opens anywhere (mail it, attach it to an issue) without
the files it came from. Sections: what ran, the best system per setting
(TPOT table with the winner in bold), the figures of
:mod:`moesim.analysis.figures`, the failed points with their errors, and
every row in a collapsed table.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from moesim.analysis import figures as F
from moesim.util import atomic_write_text

#: rows of the setting-by-system table before it is cut short (a note says how many were left out)
MAX_TABLE_ROWS = 60
#: metric columns of the full table, in this order (the others stay in the Parquet file)
TABLE_METRICS = ("tpot_ms_mean", "tpot_ms_p99", "ttft_ms", "decode_tokens_per_s", "gpu_hit_rate",
                 "prefetches", "demand_loads", "substituted_experts", "pcie_h2d_bytes", "cpu_util", "gpu_util",
                 "pcie_util", "slots_per_layer", "runtime")

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.5rem; margin-bottom: .2rem; } h2 { font-size: 1.15rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
.meta { color: #555; font-size: .9rem; }
figure { margin: 1rem 0 2rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: .9rem; margin-top: .3rem; }
table { border-collapse: collapse; font-size: .82rem; margin: .5rem 0; }
th, td { border: 1px solid #ddd; padding: .2rem .45rem; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
td.best { font-weight: bold; background: #e8f3ec; }
.error { color: #a00; text-align: left; } .note { color: #555; font-size: .85rem; }
details summary { cursor: pointer; margin: .5rem 0; }
"""


def figure_data_uri(fig: Figure) -> str:
    """A figure as a ``data:image/png;base64,...`` URI."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=110)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def write_report(frame: pd.DataFrame, path: str | os.PathLike, *, title: str = "moesim sweep",
                 gantt: bool = True, source: str | None = None, missing: list[str] | None = None) -> Path:
    """Write the report of a results frame to ``path`` (atomically) and return the path; ``missing``
    collects why a figure could not be drawn (the page says so too)."""
    page = render_report(frame, title=title, gantt=gantt, source=source, missing=missing)
    return atomic_write_text(Path(path), page)


def render_report(frame: pd.DataFrame, *, title: str = "moesim sweep", gantt: bool = True,
                  source: str | None = None, missing: list[str] | None = None) -> str:
    ok = frame[frame["status"] == "ok"]
    parts = [f"<h1>{_e(title)}</h1>", _summary(frame, source)]
    if not ok.empty and "ttft_ms_p90" in ok.columns:  # a sweep of serving runs (workload.*)
        from moesim.analysis.serving import serving_figures
        parts.append("<h2>Figures</h2>")
        parts += [_figure(name, fig, caption) for name, (fig, caption) in serving_figures(ok).items()]
    elif not ok.empty:
        parts += [_best_table(ok), "<h2>Figures</h2>"]
        for name, (fig, caption) in F.standard_figures(ok, gantt=gantt, source=source).items():
            parts.append(_figure(name, fig, caption))
            if fig is None and missing is not None:
                missing.append(caption)
    else:
        parts.append('<p class="error">No point finished: nothing to plot.</p>')
    parts += [_failures(frame), _all_rows(frame)]
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_e(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _setting(value: Any) -> str:
    """A setting in a table cell, escaped; a list ('1,2,1,2,...', a per-layer cache.slots_per_layer) may break
    after its commas: a browser finds no place to break '1,2,1,2', and a list of 32 or 61 numbers made its table
    wider than the page."""
    return _e(value).replace(",", ",<wbr>") if "," in str(value) else _e(value)


def _count(n: int, noun: str) -> str:
    """'1 point', '12 points'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _summary(frame: pd.DataFrame, source: str | None) -> str:
    failed = int((frame["status"] != "ok").sum())
    params = F.parameter_columns(frame)
    varied = F.varying(frame, params)
    items = [f"{_count(len(frame), 'point')}, {len(frame) - failed} finished, {failed} failed"]
    for col in ("trace", "hw", "system"):
        if col in frame.columns:
            values = [Path(v).name if col == "trace" else v for v in pd.unique(frame[col].dropna())]
            items.append(f"{col}: {', '.join(map(str, values))}")
    for col in varied:
        if col not in ("trace", "hw", "system"):
            values = [str(v) for v in F.sorted_values(frame[col])]
            # per-layer lists ('1,2,1,2'): their own commas made ', ' between them unreadable
            items.append(f"{col}: {('; ' if any(',' in v for v in values) else ', ').join(values)}")
    fixed = [c for c in params if c not in varied and c not in ("trace", "hw", "system", "point_id")]
    for col in fixed:
        items.append(f"{col} = {frame[col].dropna().iloc[0] if frame[col].notna().any() else '-'}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    origin = f"from {_e(source)}, " if source else ""
    lis = "".join(f"<li>{_e(i)}</li>" for i in items)
    return f'<p class="meta">{origin}written {when} by moesim report</p>\n<ul>{lis}</ul>'


def _best_table(ok: pd.DataFrame) -> str:
    """TPOT (TTFT where no run decoded) per setting (rows) and system (columns); the fastest system that is
    neither a bound nor a reference in bold. Nothing where the results lack the metric or the systems."""
    metric = F.headline_metric(ok)
    if "system" not in ok.columns or metric not in ok.columns or ok[metric].dtype.kind not in "biuf":
        return ""
    settings = [c for c in F.varying(ok, F.parameter_columns(ok)) if c != "system"]
    systems = F.ordered_systems(ok["system"].unique())
    if settings:
        table = ok.pivot_table(index=settings, columns="system", values=metric, aggfunc="mean", dropna=False)
    else:
        table = ok.groupby("system")[metric].mean().to_frame().T
        table.index = ["all points"]
    table = table.reindex(columns=[s for s in systems if s in table.columns])
    real = [s for s in table.columns if not F.is_bound(s)]
    # per setting and system: whether its runs substituted routed experts (marked where they rank)
    flagged = ok.assign(_subs=F.substituting(ok))
    subs = flagged.pivot_table(index=settings, columns="system", values="_subs", aggfunc="max") if settings \
        else flagged.groupby("system")["_subs"].max().to_frame().T.set_axis(table.index)
    subs = subs.reindex(index=table.index, columns=table.columns).fillna(False).astype(bool)
    mark = f" {F.SUBSTITUTES_MARK}"
    head = "".join(f'<th class="text">{_e(c)}</th>' for c in settings or ["setting"])
    head += "".join(f"<th>{_e(F.system_label(s))}{mark if subs[s].any() else ''}</th>" for s in table.columns)
    head += '<th class="text">fastest</th>'
    rows = []
    for key, values in table.head(MAX_TABLE_ROWS).iterrows():
        keys = key if isinstance(key, tuple) else (key,)
        finite = values[real].dropna()
        best = finite.idxmin() if not finite.empty else None
        cells = "".join(f'<td class="text">{_setting(Path(k).name if c == "trace" else k)}</td>'
                        for c, k in zip(settings or ["setting"], keys))
        cells += "".join(f'<td class="{"best" if s == best else ""}">{_num(v)}</td>' for s, v in values.items())
        fastest = "-" if best is None else best + (mark if subs.at[key, best] else "")
        cells += f'<td class="text">{_e(fastest)}</td>'
        rows.append(f"<tr>{cells}</tr>")
    more = len(table) - MAX_TABLE_ROWS
    note = f'<p class="note">{more} more rows in the results file.</p>' if more > 0 else ""
    footnote = F.substitution_note(ok)
    note += f'<p class="note">{_e(footnote)}</p>' if footnote else ""
    name, what = ("TPOT", "Mean time per output token") if metric == "tpot_ms_mean" else \
        ("TTFT", "Time to first token (no run decoded a token)")
    return (f"<h2>{name} (ms) by setting and system</h2>\n"
            f'<p class="note">{what}; bold: the fastest system that is neither a bound nor a reference. '
            "Empty cells: the point failed or was not run.</p>\n"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{note}")


def _num(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1 else f"{value:,.1f}"
    return _e(value)


def _figure(name: str, fig: Figure | None, caption: str) -> str:
    if fig is None:
        return f'<p class="note">{_e(name.replace("_", " "))}: {_e(caption)}</p>'
    alt = name.replace("_", " ")
    return (f'<figure id="{_e(name)}"><img src="{figure_data_uri(fig)}" alt="{_e(alt)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _failures(frame: pd.DataFrame) -> str:
    failed = frame[frame["status"] != "ok"]
    if failed.empty:
        return ""
    params = [c for c in F.varying(frame, F.parameter_columns(frame))] or ["system"]
    head = "".join(f'<th class="text">{_e(c)}</th>' for c in params) + '<th class="text">error</th>'
    rows = "".join("<tr>" + "".join(f'<td class="text">{_setting(r.get(c, ""))}</td>' for c in params)
                   + f'<td class="error">{_e(r.get("error", ""))}</td></tr>'
                   for _, r in _in_point_order(failed, params).iterrows())
    return (f"<h2>Failed points ({len(failed)})</h2>\n"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")


def _cell_number(value: float) -> str:
    """Four significant digits, but whole numbers from 1,000 up rather than 7.833e+04."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _in_point_order(frame: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """Rows sorted by their parameters (workers finish points in any order); numbers numerically."""
    def key(column: pd.Series) -> pd.Series:
        return column if pd.api.types.is_numeric_dtype(column) else column.astype(str)
    return frame.sort_values(params, key=key, kind="stable") if params else frame


def _all_rows(frame: pd.DataFrame) -> str:
    params = [c for c in F.parameter_columns(frame) if c != "point_id"]
    cols = params + ["status"] + [c for c in TABLE_METRICS if c in frame.columns]
    shown = _in_point_order(frame[cols], params)
    if "trace" in shown.columns:
        shown["trace"] = shown["trace"].map(lambda v: Path(str(v)).name)
    if "system" in shown.columns:  # a run that substituted routed experts, as the TPOT table marks it
        subs = F.substituting(frame.loc[shown.index])
        shown["system"] = [f"{s} {F.SUBSTITUTES_MARK}" if sub else s for s, sub in zip(shown["system"], subs)]
    for col in shown.columns:  # integers with separators too (pcie_h2d_bytes), not only floats
        if pd.api.types.is_integer_dtype(shown[col]) and col != "seed":
            shown[col] = shown[col].map(lambda v: f"{v:,}")
    table = shown.to_html(index=False, na_rep="", float_format=_cell_number, border=0)
    return (f"<h2>All points</h2>\n<details><summary>{_count(len(frame), 'row')} (the Parquet file has every metric)"
            f"</summary>\n{table}\n</details>")
