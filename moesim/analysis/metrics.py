"""Metrics of a run, defined once for the simulator and the real backend (DESIGN.md, metrics).

:data:`METRIC_DOCS` documents every key of ``moesim replay --json`` (``moesim replay --help-metrics`` prints
it); a test keeps it complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moesim.sim.bookkeeping import latency_metrics  # noqa: F401  (defined with the engine's records)
from moesim.sim.result import SimResult


@dataclass(frozen=True)
class MetricDoc:
    """One key of the metrics: its unit ("" for a count, a name or text) and its meaning."""

    unit: str
    meaning: str


#: every key of ``moesim replay --json``, in the order listed by ``--help-metrics``
METRIC_DOCS: dict[str, MetricDoc] = {
    "system": MetricDoc("", "the system replayed"),
    "ttft_ms": MetricDoc("ms", "time to first token: from a request's first prefill step's start to its last one's "
                               "end, mean over requests (null without prefill)"),
    "tpot_ms_mean": MetricDoc("ms", "time per output token: each decode step's duration, once per request in it; "
                                    "mean (null without decode steps)"),
    "tpot_ms_p50": MetricDoc("ms", "median of the same per-token decode times"),
    "tpot_ms_p99": MetricDoc("ms", "99th percentile of the same per-token decode times"),
    "decode_tokens_per_s": MetricDoc("tokens/s", "decode tokens over the time of the decode steps"),
    "prefill_tokens_per_s": MetricDoc("tokens/s", "prefill tokens over the time of the prefill steps"),
    "decode_tokens": MetricDoc("tokens", "tokens decoded (one per request per decode step)"),
    "prefill_tokens": MetricDoc("tokens", "prompt tokens prefilled"),
    "makespan_s": MetricDoc("s", "simulated time of the whole trace"),
    "gpu_hit_rate": MetricDoc("fraction", "routed (step, layer, expert) uses whose expert was on the GPU when the "
                                          "layer's plan was made"),
    "late_prefetches": MetricDoc("experts", "prefetches a GPU expert waited for: still copying when the GPU "
                                            "stream reached their expert (one computed on the CPU while its "
                                            "prefetch copies is not counted)"),
    "prefetches": MetricDoc("experts", "experts copied ahead of need"),
    "cancelled_prefetches": MetricDoc("experts", "prefetches dropped before their copy ran"),
    "prefetch_precision": MetricDoc("fraction", "prefetched experts routed at their layer before being evicted, "
                                               "wherever they ran and whether or not their copy had landed, over "
                                               "the prefetches not cancelled before they started: how often a "
                                               "prediction that was acted on was right (null without such "
                                               "prefetches)"),
    "demand_loads": MetricDoc("experts", "experts copied into a cache slot when a layer needed them"),
    "streamed_experts": MetricDoc("experts", "experts copied through a staging buffer and not kept"),
    "evictions": MetricDoc("experts", "experts removed from the GPU cache"),
    "pcie_h2d_bytes": MetricDoc("bytes", "bytes copied host to device (write-backs to the host not counted)"),
    "cpu_util": MetricDoc("fraction", "time the CPU expert pool was busy over the makespan"),
    "gpu_util": MetricDoc("fraction", "time the GPU stream ran work over the makespan: the spans of the "
                                      "timeline's GPU lane (experts with their own launches, attention, 004's "
                                      "prediction, ...); not the host time it waits for (launch, host, a plan's "
                                      "predict and cache_management overheads) nor waits for copies "
                                      "(docs/engine.md)"),
    "pcie_util": MetricDoc("fraction", "copy-engine busy time over the makespan times the copy engines"),
    "gpu_share_of_activations": MetricDoc("fraction", "routed (token, expert) activations computed on the GPU"),
    "breakdown_ms": MetricDoc("ms", "critical-path time per category (attention, gpu_compute, wait_cache, "
                                    "cpu_other, sync, launch, ...), all layers; in Python flattened to "
                                    "breakdown_<category>_ms"),
    "substituted_experts": MetricDoc("experts", "routed experts replaced by another (buddymoe, importance)"),
    "deferred_experts": MetricDoc("experts", "routed experts deferred to the next layer (ktransformers-ed)"),
    "substituted_weight_mass": MetricDoc("fraction", "gate weight of substituted experts per routed activation"),
    "deferred_weight_mass": MetricDoc("fraction", "gate weight of deferred experts per routed activation"),
    "expert_slots": MetricDoc("experts", "GPU expert slots of the memory plan, all layers"),
    "slots_per_layer": MetricDoc("experts", "expert_slots over the MoE layers (a mean: quotas may differ by layer)"),
    "slot_spread": MetricDoc("", "how the slots spread over the layers, in words"),
    "runtime": MetricDoc("", "the runtime launches and CPU kernel efficiency were charged by"),
    "gpu_memory_gib": MetricDoc("GiB", "GPU memory planned: weights, KV cache, workspace, staging, reserved and the "
                                       "expert cache"),
    "expert_cache_gib": MetricDoc("GiB", "GPU memory of the expert slots"),
    "sim_wall_s": MetricDoc("s", "wall-clock time the replay took (not simulated time)"),
    "portfolio_best": MetricDoc("", "a portfolio bound (oracle): which schedule gave each metric, "
                                    "'metric=schedule; ...'; empty otherwise"),
    "notes": MetricDoc("", "what the system's components assumed or estimated on this trace"),
    "cost_fallbacks": MetricDoc("", "shapes the profile has no curve for, costed by a roofline estimate"),
    # added by `moesim replay` (not by metrics(): they need more replays or the command line)
    "lower_bound": MetricDoc("", "the system's physical lower bound (docs/memory-and-bounds.md): makespan_s, "
                                 "ttft_ms, tpot_ms_mean and the slots it assumed"),
    "gap_to_lower_bound": MetricDoc("ratio", "makespan_s over lower_bound.makespan_s (>= 1)"),
    "inputs": MetricDoc("", "what the run came from: trace, hw, settings (--set), seed, model, and in the CLI's "
                            "JSON hw_parts (the profile's GPU, host CPU, its cores and DRAM bandwidth)"),
    "skipped": MetricDoc("", "--system all only: why this system could not run on the trace (its only other keys: "
                             "system, inputs)"),
}


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
        # of the copies that ran: a prefetch cancelled before it started copied nothing, used or not
        "prefetch_precision": (c.prefetch_used - c.cancelled_used) / (c.prefetches - c.cancelled_prefetches)
        if c.prefetches > c.cancelled_prefetches else float("nan"),
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

