"""Plan bookkeeping shared by both executors: counters, the decision log and gate-weight mass.

The simulator and the real backend execute the same plans; counting them and
logging their decisions in one place keeps their metrics and decision logs
comparable row for row.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.policy.base import LayerPlan, LayerView, PolicyError, Substitutions
from moesim.policy.checked import plan_fault

#: breakdown categories (000 Sec. VI-E) plus the rest of the forward pass: attention (MoE and dense
#: layers), dense layers' FFNs, embedding, LM head, sampling, the runtime's kernel/graph launches and
#: host work (moesim.hw.cost, docs/engine.md)
BREAKDOWN = ("attention", "predict", "cache_management", "gpu_compute", "wait_cache",
             "shared_expert", "cpu_other", "sync", "dense_ffn", "embedding", "lm_head", "sampling", "launch",
             "host")


@dataclass
class Counters:
    #: (token, expert) pairs routed
    activations: int = 0
    #: (step, layer, expert) triples: what the hit rate counts
    distinct_activations: int = 0
    gpu_activations: int = 0
    cpu_activations: int = 0
    hits: int = 0
    late_prefetches: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    demand_loads: int = 0
    streamed: int = 0
    evictions: int = 0
    substituted: int = 0
    deferred: int = 0
    cancelled_prefetches: int = 0
    #: of those, prefetches whose expert was routed (counted in prefetch_used) while the copy waited
    cancelled_used: int = 0
    substituted_weight_mass: float = 0.0
    deferred_weight_mass: float = 0.0
    gpu_busy_s: float = 0.0
    cpu_busy_s: float = 0.0
    #: seconds CPU experts lost to sharing host DRAM with copies
    dram_shared_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in BREAKDOWN})


def account_plan(c: Counters, view: LayerView, plan: LayerPlan, count: dict[int, int] | None,
                 resident: set[int], prefetched: set[int]) -> None:
    """Count one plan; hits are experts resident when the plan was made.

    ``count`` maps experts to their tokens; None when every expert has one token. ``prefetched``: this
    layer's experts prefetched and not used since.
    """
    account_placement(c, view, plan, count, resident, prefetched)
    account_moves(c, plan)


def account_placement(c: Counters, view: LayerView, plan: LayerPlan, count: dict[int, int] | None,
                      resident: set[int], prefetched: set[int]) -> None:
    """:func:`account_plan`'s count of the activations and where they ran: all a plan of CPU and GPU experts
    alone needs counted (the simulator's short path)."""
    c.activations += view.experts.size
    c.distinct_activations += len(view.active)
    if resident:
        c.hits += len(resident.intersection(view.active))
    if prefetched:  # a prefetched expert's first use counts once, and it leaves the set
        used = prefetched.intersection(view.active)
        if used:
            c.prefetch_used += len(used)
            prefetched.difference_update(used)
    if plan.gpu:
        c.gpu_activations += len(plan.gpu) if count is None else sum(map(count.__getitem__, plan.gpu))
    if plan.cpu:
        c.cpu_activations += len(plan.cpu) if count is None else sum(map(count.__getitem__, plan.cpu))


def account_moves(c: Counters, plan: LayerPlan) -> None:
    """:func:`account_plan`'s count of the copies, evictions, rewrites and deferred experts a plan makes."""
    if plan.loads or plan.streamed or plan.prefetches or plan.evictions:
        c.demand_loads += len(plan.loads)
        c.streamed += len(plan.streamed)
        c.prefetches += len(plan.prefetches)
        c.evictions += len(plan.evictions)
    if plan.substitutions or plan.deferred:
        c.substituted += len(plan.substitutions)
        c.deferred += len(plan.deferred)


def placement_decisions(view: LayerView, plan: LayerPlan, resident: set[int]) -> list[tuple]:
    """Decision-log rows for where each expert ran, logged after the plan's evictions."""
    s, layer = view.step, view.layer
    loads, streamed = set(plan.loads), set(plan.streamed)
    rows = []
    for e in plan.gpu:
        action = "gpu_load" if e in loads else "gpu_stream" if e in streamed else \
            "gpu_hit" if e in resident else "gpu_inflight"
        rows.append((s, layer, e, action, layer))
    rows += [(s, layer, e, "cpu", layer) for e in plan.cpu]
    rows += [(s, layer, e, "deferred", layer) for e in plan.deferred]
    return rows


def weight_mass(view: LayerView, experts: list[int]) -> float:
    """Gate weight routed to ``experts`` in this layer (NaN when the trace has no weights: unknown, not none)."""
    if not experts:
        return 0.0
    if view.weights is None:
        return math.nan
    if view.experts.size * len(experts) > 4096:
        return float(view.weights[np.isin(view.experts, experts)].sum())
    # a decode layer: the entries np.isin's mask selects, in the same (row-major) order, without its set-up
    chosen = set(experts)
    picked = [i for i, e in enumerate(view.experts.ravel().tolist()) if e in chosen]
    return float(view.weights.ravel()[picked].sum())


def substitution_mass(view: LayerView, plan: LayerPlan) -> float:
    """Gate weight of the (row, slot) entries a plan rewrites (NaN when the trace has no weights)."""
    if not plan.substitutions:
        return 0.0
    if view.weights is None:
        return math.nan
    weights = view.weights
    if isinstance(plan.substitutions, Substitutions):  # the same running sum, as the ufunc's accumulation
        return float(np.add.accumulate(weights[plan.substitutions.rows, plan.substitutions.slots])[-1])
    # a running sum in the weights' own dtype (numpy scalars add in it), entry by entry: a plan rewrites a
    # few entries, where building index arrays would cost more than the sum
    total = None
    for row, slot, _ in plan.substitutions:
        value = weights[row, slot]
        total = value if total is None else total + value
    return float(total)


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


def check_plan(view: LayerView, plan: LayerPlan) -> None:
    """What every plan must hold (``engine.check``): each routed expert computed once, on one side; no
    eviction of an expert the layer uses or of one in flight; write-backs only of evicted experts; and the
    rest of what :func:`moesim.policy.checked.plan_fault` checks of a plan of one's own (GPU experts there or
    on their way, loads and prefetches within the slots). A plan that breaks one raises a one-line
    :class:`PolicyError` naming the step, the layer and the fault."""
    problem = _in_flight_eviction(view, plan) or plan_fault(view, plan)
    if problem:
        raise PolicyError(f"at step {view.step}, layer {view.layer}, {problem}", source="plan (engine.check)",
                          fix="the system's policies made it: see LayerPlan (moesim.policy.base) for what every "
                              "plan keeps")


def _in_flight_eviction(view: LayerView, plan: LayerPlan) -> str:
    """An eviction of an expert still on its way ("" when none; plan_fault calls it one not resident)."""
    try:
        for lay, e in plan.evictions:
            if e in view.cache.in_flight[lay]:
                return f"evicts expert {e} of layer {lay}, which is on its way (in flight)"
    except (TypeError, ValueError, IndexError):
        pass  # no list of (layer, expert) pairs: plan_fault says so
    return ""
