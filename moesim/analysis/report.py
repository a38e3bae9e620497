"""Terminal tables of replay metrics."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def render_metrics(m: dict[str, Any], console: Console, title: str = "") -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("TTFT", f"{_fmt(m['ttft_ms'])} ms"),
        ("TPOT mean / p50 / p99", f"{_fmt(m['tpot_ms_mean'])} / {_fmt(m['tpot_ms_p50'])} / "
                                  f"{_fmt(m['tpot_ms_p99'])} ms"),
        ("decode throughput", f"{_fmt(m['decode_tokens_per_s'])} tok/s"),
        ("prefill throughput", f"{_fmt(m['prefill_tokens_per_s'])} tok/s"),
        ("GPU hit rate", f"{m['gpu_hit_rate']:.1%}"),
        ("experts on GPU (token share)", f"{m['gpu_share_of_activations']:.1%}"),
        ("demand loads / streamed / prefetches", f"{m['demand_loads']:,} / {m['streamed_experts']:,} / "
                                                 f"{m['prefetches']:,}"),
        ("late prefetches", _fmt(m["late_prefetches"])),
        ("PCIe H2D", f"{m['pcie_h2d_bytes'] / 2**30:,.2f} GiB"),
        ("utilisation CPU / GPU / PCIe", f"{m['cpu_util']:.0%} / {m['gpu_util']:.0%} / {m['pcie_util']:.0%}"),
        ("slots per layer", _fmt(m["slots_per_layer"])),
        ("simulated in", f"{m['sim_wall_s']:.2f} s"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    breakdown = Table(title="time breakdown (ms, all layers)", title_justify="left")
    for key in m["breakdown_ms"]:
        breakdown.add_column(key, justify="right")
    breakdown.add_row(*(_fmt(v, 1) for v in m["breakdown_ms"].values()))
    console.print(breakdown)
    _print_notes(m, console)


def _print_notes(m: dict[str, Any], console: Console) -> None:
    for note in m.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    if m.get("cost_fallbacks"):
        console.print(f"[yellow]note:[/] roofline estimate used (no profile curve) for: "
                      f"{'; '.join(m['cost_fallbacks'])}")


def render_comparison_table(by_system: dict[str, dict[str, Any]], console: Console, title: str = "") -> None:
    """One row per system; the last column is the gap to the best bound that ran."""
    bound = _bound(by_system)
    table = Table(title=title, title_justify="left")
    floor = next((m["lower_bound"] for m in by_system.values() if "lower_bound" in m), None)
    columns = [("system", "left"), ("TTFT ms", "right"), ("TPOT ms", "right"), ("p99 ms", "right"),
               ("decode tok/s", "right"), ("hit rate", "right"), ("PCIe GiB", "right"),
               ("CPU/GPU/PCIe util", "right"), (f"TPOT vs {bound[0]}" if bound else "vs bound", "right")]
    if floor:
        columns.append(("time vs lower bound", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, m in by_system.items():
        gap = "-"
        if bound and not math.isnan(m["tpot_ms_mean"]) and bound[1] > 0:
            gap = f"{m['tpot_ms_mean'] / bound[1]:.2f}x"
        row = [name, _fmt(m["ttft_ms"]), _fmt(m["tpot_ms_mean"]), _fmt(m["tpot_ms_p99"]),
               _fmt(m["decode_tokens_per_s"]), f"{m['gpu_hit_rate']:.1%}", f"{m['pcie_h2d_bytes'] / 2**30:,.2f}",
               f"{m['cpu_util']:.0%}/{m['gpu_util']:.0%}/{m['pcie_util']:.0%}", gap]
        if floor:
            row.append(f"{m['gap_to_lower_bound']:.2f}x")
        table.add_row(*row)
    console.print(table)
    if bound:
        console.print(f"TPOT vs {bound[0]}: relative to that bound's TPOT (1.00x is the bound itself)")
    if floor:
        console.print(f"time vs lower bound: whole-run time over the physical lower bound "
                      f"({floor['makespan_s']:.3f} s; TTFT {_fmt(floor['ttft_ms'])} ms, TPOT "
                      f"{_fmt(floor['tpot_ms_mean'])} ms: the busiest of GPU and CPU doing only unavoidable "
                      f"work, no transfers, launches or syncs)")
        for name, m in by_system.items():
            own = m.get("lower_bound")
            if own and own != floor:  # a system whose defaults change the work itself (e.g. its expert dtype)
                console.print(f"  {name}: against its own lower bound under its defaults ({own['makespan_s']:.3f} s)")
    notes = sorted({n for m in by_system.values() for n in m.get("notes", [])})
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    fallbacks = sorted({f for m in by_system.values() for f in m.get("cost_fallbacks", [])})
    if fallbacks:
        console.print(f"[yellow]note:[/] roofline estimate used (no profile curve) for: {'; '.join(fallbacks)}")


def _bound(by_system: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    for name in ("oracle", "all-in-gpu"):
        if name in by_system and not math.isnan(by_system[name]["tpot_ms_mean"]):
            return name, by_system[name]["tpot_ms_mean"]
    return None
