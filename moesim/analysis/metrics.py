"""Metrics of a run, defined once for the simulator and the real backend (DESIGN.md, metrics)."""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.sim.engine import SimResult


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def latency_metrics(steps: list[Any]) -> dict[str, float]:
    """TTFT, TPOT and throughput from per-step records (start, end, phase, tokens, requests).

    TTFT of a request: from the start of its first prefill step to the end of
    its last one (requests are admitted when their prefill starts; the trace has
    no arrival times). TPOT: the duration of every decode step, once per
    request in it.
    """
    prefill_span: dict[int, list[float]] = {}
    tpot: list[float] = []
    prefill_tokens = decode_tokens = 0
    prefill_time = decode_time = 0.0
    for rec in steps:
        duration = rec.end - rec.start
        if rec.phase == "prefill":
            prefill_tokens += rec.tokens
            prefill_time += duration
            for r in rec.requests:
                span = prefill_span.setdefault(r, [rec.start, rec.end])
                span[1] = rec.end
        else:
            decode_tokens += rec.tokens
            decode_time += duration
            tpot += [duration] * len(rec.requests)
    ttft = [end - start for start, end in prefill_span.values()]
    ms = 1e3
    return {
        "ttft_ms": float(np.mean(ttft)) * ms if ttft else float("nan"),
        "tpot_ms_mean": float(np.mean(tpot)) * ms if tpot else float("nan"),
        "tpot_ms_p50": _percentile(tpot, 50) * ms,
        "tpot_ms_p99": _percentile(tpot, 99) * ms,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else float("nan"),
        "prefill_tokens_per_s": prefill_tokens / prefill_time if prefill_time else float("nan"),
        "decode_tokens": decode_tokens,
        "prefill_tokens": prefill_tokens,
    }


def _memory_gib(plan: Any) -> dict[str, float]:
    """GPU memory the run planned to use: every fixed part (weights, KV cache, workspace, staging,
    reserved) plus the expert cache it was given, and the expert cache alone, in GiB."""
    cache = sum(plan.capacity) * plan.expert_bytes
    fixed = sum(int(getattr(plan, name, 0) or 0) for name in
                ("reserved_bytes", "non_expert_bytes", "kv_bytes", "workspace_bytes", "staging_bytes"))
    return {"gpu_memory_gib": (fixed + cache) / 2**30, "expert_cache_gib": cache / 2**30}


def metrics(result: SimResult) -> dict[str, Any]:
    """The stable metric keys of ``moesim replay --json``."""
    c = result.counters
    total = result.makespan_s
    out: dict[str, Any] = {"system": result.system, **latency_metrics(result.steps)}
    gpu_experts = max(c.activations, 1)
    out.update({
        "makespan_s": total,
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
        "slots_per_layer": result.memory.capacity[0] if result.memory.capacity else 0,
        **_memory_gib(result.memory),
        "sim_wall_s": result.sim_wall_s,
        "notes": result.notes,
        "cost_fallbacks": result.cost_fallbacks,
    })
    return out

