"""Rendering of :mod:`moesim.trace.stats` results: the tables and per-layer sparklines of ``moesim trace
inspect`` and ``moesim trace compare``."""

from __future__ import annotations

from typing import Any

from moesim.util import listed


def _layer_list(layers: list[int]) -> str:
    """"layer 3", "layers 0, 8, 12" or "no layer": a list of layer indices never read as a count."""
    if not layers:
        return "no layer"
    return f"layer{'s' if len(layers) > 1 else ''} {listed(layers)}"


_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None]) -> str:
    """One character per layer, height scaled between the smallest and largest value."""
    present = [v for v in values if v is not None]
    if not present:
        return ""
    low, high = min(present), max(present)
    span = (high - low) or 1.0
    return "".join(" " if v is None else _BARS[1 + int(round((v - low) / span * (len(_BARS) - 2)))]
                   for v in values)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _summary_rows(stats: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [
        ("model", stats["model"]), ("source", stats["source"]), ("rows", stats["rows"]),
        ("requests", stats["requests"]), ("tokens", stats["tokens"]),
        ("tokens prefill", stats["tokens_by_phase"]["prefill"]),
        ("tokens decode", stats["tokens_by_phase"]["decode"]),
        ("steps prefill", stats["steps"]["prefill"]), ("steps decode", stats["steps"]["decode"]),
        ("layers (present)", f"{stats['layers']} ({stats['layers_present']})"),
        ("experts / top-k", f"{stats['num_experts']} / {stats['top_k']}"),
        ("shared experts / dense layers", f"{stats['num_shared_experts']} / {stats['num_dense_layers']}"),
        ("top-10% share (mean)", stats["top10_share"]),
        ("prev-token reuse (mean)", stats["reuse_prev_token"]),
        ("co-activation top-4 share", stats["coactivation_top4_share"]),
        ("distinct experts/layer/step prefill", stats["unique_experts_per_layer_step"]["prefill"]),
        ("distinct experts/layer/step decode", stats["unique_experts_per_layer_step"]["decode"]),
        ("prefill coverage (of a uniform router's)", stats["prefill_coverage"]),
        ("top-1 weight share", stats["weight_top1_share"]),
    ]
    rows += [(f"recall {name}", value) for name, value in stats["predictor_recall"].items()]
    return rows


def render_stats(stats: dict[str, Any], console: Any, title: str = "trace") -> None:
    """Print a summary table, a per-layer table and a sparkline of per-layer skew."""
    from rich.table import Table

    summary = Table(title=f"{title}", show_header=False)
    summary.add_column("statistic")
    summary.add_column("value", justify="right")
    for name, value in _summary_rows(stats):
        summary.add_row(name, _fmt(value))
    console.print(summary)

    per_layer = Table(title="per layer")
    for name in ("layer", "top-10% share", "prev-token reuse", "co-act top-4"):
        per_layer.add_column(name, justify="right")
    for layer in range(stats["layers"]):
        per_layer.add_row(str(layer), _fmt(stats["top10_share_by_layer"][layer]),
                          _fmt(stats["reuse_prev_token_by_layer"][layer]),
                          _fmt(stats["coactivation_top4_share_by_layer"][layer]))
    console.print(per_layer)
    console.print(f"top-10% share by layer  {sparkline(stats['top10_share_by_layer'])}", markup=False)
    console.print(f"prev-token reuse        {sparkline(stats['reuse_prev_token_by_layer'])}", markup=False)


def _relative(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(a, bool) or not a:
        return ""
    return f"{(b - a) / abs(a):+.1%}"


def render_comparison(a: dict[str, Any], b: dict[str, Any], console: Any,
                      names: tuple[str, str] = ("A", "B"), distances: dict[str, Any] | None = None) -> None:
    """Print two traces' statistics side by side with the relative difference (B - A) / A, then the
    distances of B from A when given."""
    from rich.table import Table

    table = Table(title="trace comparison")
    table.add_column("statistic")
    table.add_column(names[0], justify="right")
    table.add_column(names[1], justify="right")
    table.add_column("B vs A", justify="right")
    rows_b = dict(_summary_rows(b))
    for name, value in _summary_rows(a):
        other = rows_b.get(name)
        table.add_row(name, _fmt(value), _fmt(other), _relative(value, other))
    console.print(table)
    for key, label in (("top10_share_by_layer", "top-10% share by layer"),
                       ("reuse_prev_token_by_layer", "prev-token reuse by layer")):
        console.print(f"{label}:", markup=False)
        console.print(f"  A {sparkline(a[key])}", markup=False)
        console.print(f"  B {sparkline(b[key])}", markup=False)
    if distances is not None:
        render_distances(distances, console)


def render_distances(d: dict[str, Any], console: Any) -> None:
    """The distances of :func:`trace_distances` as a table (mean and worst layer) with per-layer sparklines."""
    from rich.table import Table

    for note in d.get("notes", []):  # before the distances: what they do and do not cover
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if not d.get("comparable"):
        console.print(f"distances: not computed ({d.get('reason')})", markup=False)
        return
    both = d.get("layers_in_both", [])
    logged = f"; logged in both: {_layer_list(both)}" if len(both) < d["layers_compared"] else ""
    table = Table(title=f"distance of B from A ({d['layers_compared']} layers{logged})", title_justify="left")
    for col in ("measure", "mean", "worst layer", "per layer"):
        table.add_column(col, justify="left" if col in ("measure", "per layer") else "right")
    rows = (("popularity JS divergence (0-1)", "popularity_js", False),
            ("reuse difference B - A", "reuse_diff", True),
            ("co-activation TV distance (0-1)", "coactivation_tv", False),
            ("co-activation top-4 share B - A", "coactivation_top4_diff", True))
    for label, key, signed in rows:
        values = d[key]["by_layer"]
        present = [(i, v) for i, v in enumerate(values) if v is not None]
        worst = max(present, key=lambda iv: abs(iv[1])) if present else None
        mean = d[key]["mean"]
        fmt = "{:+.3f}" if signed else "{:.3f}"
        table.add_row(label, "-" if mean is None else fmt.format(mean),
                      "-" if worst is None else f"{fmt.format(worst[1])} (layer {worst[0]})",
                      sparkline([None if v is None else abs(v) for v in values]))
    console.print(table)
