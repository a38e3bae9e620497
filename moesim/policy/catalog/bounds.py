"""Bounds every report can measure a system against.

Three bounds are systems elsewhere: Belady per layer (``belady``, policy/cache.py),
perfect prefetch and the best split (``oracle``, a portfolio in policy/systems.py),
and every expert resident (``all-in-gpu``). This module adds the physical lower
bound: a floor on each step's duration from the work no schedule can avoid.

What is unavoidable in one step (one forward pass), as the engine runs it:

* GPU: every layer's attention and gate (``attention(tokens, context)``) and
  its shared experts (``gpu_shared(tokens)``); nothing else can run them.
* each (layer, routed expert) with n tokens runs once, on the GPU for
  ``gpu_expert(n)`` (weights assumed already there: loads are avoidable) or
  on the CPU for ``cpu_expert(n)``.
* nothing of a step runs before the step starts or after it ends (the engine
  finishes every GPU and CPU task of a step, deferred ones included, before
  the next), and the GPU and the CPU each do one thing at a time.

So a step lasts at least ``min over splits of max(GPU work, CPU work)``; the
bound is that minimum's fractional relaxation, exact to compute: experts go to
the GPU in order of increasing ``gpu/cpu`` time ratio until the two sides
balance (the last one split). Left out, so the bound stays below any
schedule: kernel launches, CPU-GPU synchronisation, decision overheads and
every PCIe transfer.

Substitution (002, 004) changes which experts run. With ``substitution=True``
the routed part of each layer is only what any rewrite must keep: top-k
distinct experts per token, so at least ``top_k`` experts of at least one
token each (costs grow with tokens).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.hw.cost import CostModel
from moesim.model.spec import ModelSpec
from moesim.policy.base import active_experts
from moesim.trace.io import iter_steps
from moesim.trace.schema import PHASES


def balanced_floor(gpu_fixed: float, gpu: list[float], cpu: list[float]) -> float:
    """min over fractional splits of max(gpu_fixed + GPU share, CPU share) (the LP relaxation)."""
    gpu_total, cpu_total = gpu_fixed, float(sum(cpu))
    if gpu_total >= cpu_total:
        return gpu_total
    order = sorted(range(len(gpu)), key=lambda i: (gpu[i] / cpu[i]) if cpu[i] > 0 else float("inf"))
    for i in order:
        g, c = gpu[i], cpu[i]
        if gpu_total + g >= cpu_total - c:
            x = (cpu_total - gpu_total) / (g + c) if g + c > 0 else 0.0
            return gpu_total + x * g
        gpu_total += g
        cpu_total -= c
    return max(gpu_total, cpu_total)


def step_floor(step, model: ModelSpec, costs: CostModel, substitution: bool = False) -> float:
    """The physical floor of one trace step, seconds."""
    first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
    context = int(step.position[first].max()) + 1
    sequences = len(np.unique(step.request[first]))
    # dense layers, embedding, LM head and sampling: GPU work every step does besides its MoE layers
    fixed = sum(costs.step_fixed(first.stop - first.start, context, sequences).values())
    gpu: list[float] = []
    cpu: list[float] = []
    for _, rows in step.layers():
        tokens = rows.stop - rows.start
        fixed += costs.attention(tokens, context) + costs.gpu_shared(tokens)
        if substitution:
            counts = [1] * model.top_k
        else:
            counts = active_experts(step.experts[rows], model.num_experts)[1]
        gpu += [costs.gpu_expert(n) for n in counts]
        cpu += [costs.cpu_expert(n) for n in counts]
    return balanced_floor(fixed, gpu, cpu)


def physical_lower_bound(trace_path: str, model: ModelSpec, costs: CostModel,
                         substitution: bool = False) -> dict[str, Any]:
    """Floors of a replay of ``trace_path``: makespan, mean TTFT and TPOT, per-step durations.

    TTFT and TPOT follow the metric definitions (moesim.analysis.metrics) on
    steps laid back to back at their floors, so no replay can report less.
    """
    floors: list[float] = []
    phases: list[str] = []
    requests: list[np.ndarray] = []
    for step in iter_steps(trace_path, columns=()):
        floors.append(step_floor(step, model, costs, substitution))
        first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
        phases.append(PHASES[int(step.phase.min())])
        requests.append(np.unique(step.request[first]))
    ends = np.cumsum(floors)
    starts = ends - np.asarray(floors)
    spans: dict[int, list[float]] = {}
    tpot: list[float] = []
    for start, end, phase, reqs, floor in zip(starts, ends, phases, requests, floors):
        if phase == "prefill":
            for r in reqs.tolist():
                spans.setdefault(r, [start, end])[1] = end
        else:
            tpot += [floor] * len(reqs)
    ttft = [b - a for a, b in spans.values()]
    return {
        "makespan_s": float(ends[-1]) if len(ends) else 0.0,
        "ttft_ms": float(np.mean(ttft)) * 1e3 if ttft else float("nan"),
        "tpot_ms_mean": float(np.mean(tpot)) * 1e3 if tpot else float("nan"),
        "step_floor_s": [float(f) for f in floors],
        "substitution": substitution,
    }
