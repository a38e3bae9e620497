"""Metrics of a run, defined once for the simulator and the real backend (DESIGN.md, metrics)."""

from __future__ import annotations

from typing import Any

from moesim.sim.bookkeeping import latency_metrics  # noqa: F401  (defined with the engine's records)
from moesim.sim.result import SimResult


def _memory_gib(plan: Any) -> dict[str, float]:
    """GPU memory the run planned to use: every fixed part (weights, KV cache, workspace, staging,
    reserved) plus the expert cache it was given, and the expert cache alone, in GiB."""
    cache = plan.slots * plan.expert_bytes
    fixed = sum(int(getattr(plan, name, 0) or 0) for name in
                ("reserved_bytes", "non_expert_bytes", "kv_bytes", "workspace_bytes", "staging_bytes"))
    return {"gpu_memory_gib": (fixed + cache) / 2**30, "expert_cache_gib": cache / 2**30}


def metrics(result: SimResult) -> dict[str, Any]:
    """The stable metric keys of ``moesim replay --json``."""
    c = result.counters
    total = result.makespan_s
    out: dict[str, Any] = {"system": result.system, **latency_metrics(result.steps)}
    gpu_experts = max(c.activations, 1)
    for key, (_, value) in getattr(result, "best", {}).items():
        if key != "makespan_s":
            out[key] = value
    out.update({
        "makespan_s": getattr(result, "best", {}).get("makespan_s", (None, total))[1],
        "gpu_hit_rate": c.hits / max(c.distinct_activations, 1),
        "late_prefetches": c.late_prefetches,
        "prefetches": c.prefetches,
        "cancelled_prefetches": c.cancelled_prefetches,
        "prefetch_precision": c.prefetch_used / c.prefetches if c.prefetches else float("nan"),
        "demand_loads": c.demand_loads,
        "streamed_experts": c.streamed,
        "evictions": c.evictions,
        "pcie_h2d_bytes": result.pcie_bytes,
        "cpu_util": c.cpu_busy_s / total if total else 0.0,
        "gpu_util": c.gpu_busy_s / total if total else 0.0,
        "pcie_util": result.pcie_busy_s / (total * result.pcie_engines) if total else 0.0,
        "gpu_share_of_activations": c.gpu_activations / gpu_experts,
        "breakdown_ms": {k: v * 1e3 for k, v in c.breakdown.items()},
        "substituted_experts": c.substituted,
        "deferred_experts": c.deferred,
        # quality proxies: gate weight touched, per routed (token, expert) activation
        "substituted_weight_mass": c.substituted_weight_mass / max(c.activations, 1),
        "deferred_weight_mass": c.deferred_weight_mass / max(c.activations, 1),
        # the memory plan: every expert slot the cache holds, their mean per layer, and how they spread
        "expert_slots": result.memory.slots,
        "slots_per_layer": result.memory.slots / len(result.memory.capacity) if result.memory.capacity else 0,
        "slot_spread": result.memory.describe(),
        "runtime": result.runtime,
        **_memory_gib(result.memory),
        "sim_wall_s": result.sim_wall_s,
        # a portfolio bound: each metric the best of its schedules, and which schedule gave it
        "portfolio_best": "; ".join(f"{k}={name}" for k, (name, _) in getattr(result, "best", {}).items()),
        "notes": result.notes,
        "cost_fallbacks": result.cost_fallbacks,
    })
    return out

