"""Terminal tables of replay metrics."""

from __future__ import annotations

import math
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moesim.policy.systems import own_weights


def number_text(value: Any, digits: int = 2) -> str:
    """A figure as the tables print it: thousands separated, "-" where undefined (NaN), and a small non-zero
    figure with two significant digits rather than as 0.00 (a tiny model's TPOT is microseconds)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if 0 < abs(value) < 1:
            digits = min(max(digits, 1 - math.floor(math.log10(abs(value)))), 9)
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def bytes_text(nbytes: float) -> str:
    """Bytes in GiB, or in MiB or KiB where GiB would read 0.00 (a tiny model's copies are not nothing)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= 0.005 * scale or nbytes == 0:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes / 2**10:,.2f} KiB"


def render_metrics(m: dict[str, Any], console: Console, title: str = "") -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("TTFT", f"{number_text(m['ttft_ms'])} ms"),
        ("TPOT mean / p50 / p99", f"{number_text(m['tpot_ms_mean'])} / {number_text(m['tpot_ms_p50'])} / "
                                  f"{number_text(m['tpot_ms_p99'])} ms"),
        ("decode throughput", f"{number_text(m['decode_tokens_per_s'])} tok/s"),
        ("prefill throughput", f"{number_text(m['prefill_tokens_per_s'])} tok/s"),
        ("GPU hit rate", f"{m['gpu_hit_rate']:.1%}"),
        ("experts on GPU (token share)", f"{m['gpu_share_of_activations']:.1%}"),
        ("demand loads / streamed / prefetches", f"{m['demand_loads']:,} / {m['streamed_experts']:,} / "
                                                 f"{m['prefetches']:,}"),
        ("late prefetches", number_text(m["late_prefetches"])),
        ("PCIe H2D", bytes_text(m["pcie_h2d_bytes"])),
        ("utilisation CPU / GPU / PCIe", f"{m['cpu_util']:.0%} / {m['gpu_util']:.0%} / {m['pcie_util']:.0%}"),
        ("expert slots", str(m.get("slot_spread", m["expert_slots"]))),
        ("runtime", str(m.get("runtime", "-"))),
        ("simulated in", f"{m['sim_wall_s']:.2f} s"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    breakdown = Table(title="time breakdown (ms, all layers)", title_justify="left")
    for key in m["breakdown_ms"]:
        breakdown.add_column(key, justify="right")
    breakdown.add_row(*(number_text(v, 1) for v in m["breakdown_ms"].values()))
    console.print(breakdown)
    _print_notes(m, console)


def _print_notes(m: dict[str, Any], console: Console) -> None:
    for note in m.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(note)}", markup=True)
    if m.get("cost_fallbacks"):
        console.print(f"[yellow]note:[/] roofline estimate used (no profile curve) for: "
                      f"{escape('; '.join(m['cost_fallbacks']))}", markup=True)


def render_comparison_table(by_system: dict[str, dict[str, Any]], console: Console, title: str = "") -> None:
    """One row per system; the last column is the TPOT over the oracle's (over all-in-gpu's when the oracle
    did not run: a reference, not a bound)."""
    bound = _bound(by_system)
    table = Table(title=title, title_justify="left")
    floor = by_system.get(_first_cached(by_system), {}).get("lower_bound")
    columns = [("system", "left"), ("TTFT ms", "right"), ("TPOT ms", "right"), ("p99 ms", "right"),
               ("decode tok/s", "right"), ("hit rate", "right"), ("PCIe GiB", "right"),
               ("CPU/GPU/PCIe util", "right"), (f"TPOT vs {bound[0]}" if bound else "vs bound", "right")]
    if floor:
        columns.append(("time vs lower bound", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    other_weights = {name: weights for name, m in by_system.items()
                     if (weights := own_weights(name, (m.get("inputs") or {}).get("settings")))}
    for name, m in by_system.items():
        gap = "-"
        if name in other_weights:
            gap = "other weights"  # the oracle schedules the replay's weights, not this system's
        elif bound and not math.isnan(m["tpot_ms_mean"]) and bound[1] > 0:
            gap = f"{m['tpot_ms_mean'] / bound[1]:.2f}x"
        row = [name, number_text(m["ttft_ms"]), number_text(m["tpot_ms_mean"]), number_text(m["tpot_ms_p99"]),
               number_text(m["decode_tokens_per_s"]), f"{m['gpu_hit_rate']:.1%}", f"{m['pcie_h2d_bytes'] / 2**30:,.2f}",
               f"{m['cpu_util']:.0%}/{m['gpu_util']:.0%}/{m['pcie_util']:.0%}", gap]
        if floor:
            row.append(f"{m['gap_to_lower_bound']:.2f}x")
        table.add_row(*row)
    console.print(table)
    _print_spreads(by_system, console)
    if bound and bound[0] == "oracle":
        console.print("TPOT vs oracle: relative to that bound's TPOT (1.00x is the bound itself; the oracle "
                      "is, per metric, the best of its clairvoyant schedules and of every listed system under the "
                      "same GPU memory budget)")
    elif bound:
        console.print(f"TPOT vs {bound[0]}: relative to its TPOT, as the oracle did not run (below 1.00x is "
                      "possible: see the next line)")
    for name, weights in other_weights.items():
        console.print(f"{name}: runs its own weights by default ({weights}), so the oracle, which schedules the "
                      "replay's weights, is no bound for it; compare with "
                      + " ".join(f"--set {setting}" for setting in weights.split(", ")) + " --system oracle")
    if "all-in-gpu" in by_system:
        ideal = by_system["all-in-gpu"].get("runtime") == "ideal"
        console.print("all-in-gpu: a reference, not a bound: it holds every expert whatever the GPU memory"
                      + (" and runs on the ideal runtime (no kernel launches, no host work; a system with "
                         "every expert resident still pays its own runtime's)" if ideal else "")
                      + ", so schedules within the budget may beat it")
    if floor:
        slots = {m["lower_bound"].get("slots") for m in by_system.values()
                 if isinstance(m.get("lower_bound", {}).get("slots"), int)}
        slots_text = ", ".join(str(s) for s in sorted(slots))
        console.print(f"time vs lower bound: whole-run time over the system's physical lower bound (the "
                      f"unavoidable GPU, CPU and PCIe work of its own workload, substitutions included, with at "
                      f"most its memory plan's experts resident ({slots_text or '-'} slots); no launches or syncs;"
                      f" docs/memory-and-bounds.md). For {_first_cached(by_system)}: "
                      f"{number_text(floor['makespan_s'], 3)} s, TTFT {number_text(floor['ttft_ms'])} ms, "
                      f"TPOT {number_text(floor['tpot_ms_mean'])} ms")
    for note in shared_notes(by_system.items()):
        console.print(f"[yellow]note:[/] {escape(note)}", markup=True)


def shared_notes(runs: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
    """The notes of several systems' runs, each once and sorted, with the systems that gave it in brackets
    unless every system did; then the cost-model fallbacks of them all. A note speaks of the component it
    comes from (``static-hot: ...`` may come from fiddler's cache), so the bracket says whose run it was."""
    by_note: dict[str, list[str]] = {}
    systems: list[str] = []
    fallbacks: set[str] = set()
    for name, m in runs:
        if name not in systems:
            systems.append(name)
        for note in m.get("notes", []):
            givers = by_note.setdefault(note, [])
            if name not in givers:
                givers.append(name)
        fallbacks.update(m.get("cost_fallbacks", []))
    notes = [note if len(givers) == len(systems) else f"{note} [{', '.join(givers)}]"
             for note, givers in sorted(by_note.items())]
    if fallbacks:
        notes.append(f"roofline estimate used (no profile curve) for: {'; '.join(sorted(fallbacks))}")
    return notes


def _print_spreads(by_system: dict[str, dict[str, Any]], console: Console) -> None:
    """How each system's expert slots spread over the layers, systems with the same spread on one line;
    then the runtime each ran on (its launch costs and CPU kernel efficiency), on one line."""
    for text, names in _grouped(by_system, "slot_spread"):
        console.print(f"expert slots of {', '.join(names)}: {text}", highlight=False)
    runtimes = _grouped(by_system, "runtime")
    if runtimes:
        console.print("runtimes (launch costs, CPU kernel efficiency; --set runtime=NAME): "
                      + "; ".join(f"{text} ({', '.join(names)})" for text, names in runtimes), highlight=False)


def _grouped(by_system: dict[str, dict[str, Any]], key: str) -> list[tuple[str, list[str]]]:
    """The values of ``key`` with the systems that have each, the most shared first."""
    groups: dict[str, list[str]] = {}
    for name, m in by_system.items():
        if key in m:
            groups.setdefault(str(m[key]), []).append(name)
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))


def _first_cached(by_system: dict[str, dict[str, Any]]) -> str:
    """A system whose bound shows the capacity term: the first with a plain memory plan and no substitutions."""
    for name, m in by_system.items():
        bound = m.get("lower_bound", {})
        if isinstance(bound.get("slots"), int) and bound["slots"] > 0 and not m.get("substituted_experts") \
                and not m.get("portfolio_best"):
            return name
    return next(iter(by_system), "")


def _bound(by_system: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    for name in ("oracle", "all-in-gpu"):
        if name in by_system and not math.isnan(by_system[name]["tpot_ms_mean"]):
            return name, by_system[name]["tpot_ms_mean"]
    return None
