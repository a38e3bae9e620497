"""The physical lower bound: a floor on each step's duration from work no schedule can avoid.

Two other yardsticks are systems elsewhere: ``oracle`` (policy/systems.py, a
per-metric portfolio of clairvoyant schedules and every listed system under the
same memory budget: the best schedule known, an upper bound on the optimum) and
``all-in-gpu`` (a reference that ignores GPU memory, not a bound). This module
gives the floor below every schedule the engine can produce
(docs/memory-and-bounds.md has the derivation with a worked example).

Derivation. Take one step (one forward pass) as the engine runs it:

1. Nothing of a step runs before it starts or after it ends: the engine ends a
   step when every GPU task, CPU task (deferred ones included) and the
   transfers they wait for are done, and starts the next one after it. GPU
   stream, CPU pool and each copy engine do one thing at a time.
2. GPU: every layer's attention and gate, and its shared experts, run on the
   GPU stream and nowhere else: ``step_fixed_gpu`` (the one place that steps
   this work; kernel launches are left out, they only add).
3. Each routed (layer, expert) of the step, with the ``n`` tokens routed to it
   *after* the system's own substitutions (``rewrites``: the workload the
   system really computed), runs once: on the GPU for at least
   ``gpu_expert(n)`` or on the CPU for at least ``cpu_expert(n)``.
4. A GPU expert needs its weights on the GPU. At the step's start at most
   ``slots`` experts are there or on their way (the memory plan's slots hold
   resident and in-flight experts; staging buffers hold nothing between
   layers: a streamed expert is used in the layer that copies it). Every other
   GPU expert is copied during the step, whole, onto one of ``copy_engines``
   engines, taking ``h2d(expert_bytes)`` each.

With ``x_i`` the share of expert ``i`` on the GPU (0 or 1 in a real schedule),
the step lasts at least the largest of

* ``F + sum_i x_i g_i`` (GPU stream: fixed work ``F`` plus GPU experts),
* ``sum_i (1 - x_i) c_i`` (CPU pool),
* ``tau * (sum_i x_i - slots)`` with ``tau = h2d(expert_bytes) / copy_engines``
  (copy engines: experts beyond those already held are copied in the step).

Each of the two relaxations below drops one of these constraints and lets
``x_i`` be fractional, so each is at most the true minimum over schedules, and
so is their maximum:

* ``balanced_floor``: min over x of max(GPU, CPU), ignoring copies (experts go
  to the GPU by increasing ``g/c`` until both sides balance);
* ``capacity_floor``: min over x of max(CPU, copies), ignoring GPU compute
  (``slots`` experts, the most expensive on the CPU, are free; every further
  unit of GPU share costs ``tau`` on the copy engines and saves its CPU time).

Across steps (``tighten``): over a window of consecutive steps, too, at most
``slots`` experts are held at its start, and every other (layer, expert) that
runs on the GPU even once in the window is copied inside it, while one that
never does runs all its uses on the CPU; the same relaxation over the window's
distinct experts (each costing the CPU time of all its uses) bounds the
window's duration. Partitions of a run of decode steps serving the same
requests into windows of 1, 2, 4, ... steps each bound the run's total; the
largest is spread evenly over the run's steps, exact for makespan and for the
mean TPOT (every step of the run serves the same requests). Runs inside a
request's prefill span are left alone: a TTFT sums the steps of its span.

TTFT, TPOT and makespan then follow the metric definitions on steps laid back
to back at their floors: a request's TTFT spans whole steps, each at least its
floor, so no replay reports less. Left out (so it stays a floor): launches,
CPU-GPU synchronisation, decision overheads, transfer latency beyond one copy
per expert, and any stall.

A system that substitutes experts (002, 004) computes a different workload:
its floor replays its own rewrites (``SimResult.rewrites``). ``substitution=True``
gives a floor below any rewrite (each token keeps ``top_k`` distinct experts, so
at least ``top_k`` experts of at least one token run per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moesim.hw.cost import CostModel
from moesim.model.spec import ModelSpec
from moesim.policy.base import active_experts
from moesim.trace.io import Step, iter_steps
from moesim.trace.schema import PHASES

Rewrites = dict[tuple[int, int], list[tuple[int, int, int]]]


def balanced_floor(gpu_fixed: float, gpu: list[float], cpu: list[float]) -> float:
    """min over fractional splits of max(gpu_fixed + GPU share, CPU share) (the LP relaxation)."""
    return balanced_groups(gpu_fixed, [(g, c, 1) for g, c in zip(gpu, cpu)])


def balanced_groups(gpu_fixed: float, groups: list[tuple[float, float, int]]) -> float:
    """:func:`balanced_floor` over experts given as (gpu seconds, cpu seconds, how many alike): fill the
    GPU with the experts it runs cheapest against the CPU first, the last one fractionally."""
    gpu_total, cpu_total = gpu_fixed, float(sum(c * m for _, c, m in groups))
    if gpu_total >= cpu_total:
        return gpu_total
    for g, c, m in sorted(groups, key=lambda x: (x[0] / x[1]) if x[1] > 0 else float("inf")):
        if gpu_total + m * g >= cpu_total - m * c:
            x = (cpu_total - gpu_total) / (g + c) if g + c > 0 else 0.0
            return gpu_total + x * g
        gpu_total += m * g
        cpu_total -= m * c
    return max(gpu_total, cpu_total)


def capacity_floor(cpu: list[float], load_s: float, slots: int | None) -> float:
    """min over fractional x of max(sum (1 - x_i) c_i, load_s * (sum x_i - slots)): CPU against copies.

    With ``U = sum x_i`` GPU units, the CPU keeps least when the units go to
    the most expensive experts; the first ``slots`` are free, each further one
    costs ``load_s`` of copy time. Walk the experts by falling CPU time and
    solve ``CPU left(U) = load_s * (U - slots)`` on the segment where it
    crosses (CPU left falls, copy time grows: one crossing).

    >>> round(capacity_floor([4.0, 4.0, 4.0], 2.0, 1), 6)  # CPU left 12 - 4U = copies 2 (U - 1): U = 7/3
    2.666667
    >>> capacity_floor([4.0, 4.0], 2.0, 2)
    0.0
    """
    if slots is None or load_s <= 0 or len(cpu) <= slots:
        return 0.0
    c = sorted(cpu, reverse=True)
    total = float(sum(c))
    before = float(sum(c[:slots]))  # CPU time taken off by the free units
    for k in range(slots, len(c)):
        after = before + c[k]
        # at U = k + 1: CPU left total - after, copies load_s * (k + 1 - slots)
        if total - after <= load_s * (k + 1 - slots):
            left_at_k = total - before - load_s * (k - slots)  # CPU - copies at U = k (>= 0 here)
            u = k + max(left_at_k, 0.0) / (c[k] + load_s)
            return load_s * (u - slots)
        before = after
    return load_s * (len(c) - slots)


def step_fixed_gpu(step: Step, model: ModelSpec, costs: CostModel) -> float:
    """GPU work of one step that no schedule avoids or moves: every layer's attention and gate at the step's
    context, its shared experts, and the step's dense layers, embedding, LM head and sampling. The one place
    the bound steps this work (whatever the GPU must run
    besides routed experts belongs here)."""
    first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
    context = int(step.position[first].max()) + 1
    sequences = len(np.unique(step.request[first]))
    # dense layers, embedding, LM head and sampling: GPU work every step does besides its MoE layers
    fixed = sum(costs.step_fixed(first.stop - first.start, context, sequences).values())
    for _, rows in step.layers():
        tokens = rows.stop - rows.start
        fixed += costs.attention(tokens, context) + costs.gpu_shared(tokens)
    return fixed


def step_pairs(step: Step, model: ModelSpec, substitution: bool = False,
               rewrites: Rewrites | None = None) -> list[tuple[tuple[int, int], int]]:
    """((layer, expert), tokens) of every routed expert the step computes, after the system's rewrites
    (with ``substitution``, ``top_k`` stand-ins of one token per layer, expert ids -1, -2, ...)."""
    out: list[tuple[tuple[int, int], int]] = []
    for layer, rows in step.layers():
        if substitution:
            out += [((int(layer), -1 - j), 1) for j in range(model.top_k)]
            continue
        experts = step.experts[rows]
        changes = rewrites.get((int(step.step), int(layer))) if rewrites else None
        if changes:
            experts = experts.copy()
            for row, slot, expert in changes:
                experts[row, slot] = expert
        active, counts = active_experts(experts, model.num_experts)
        out += [((int(layer), e), n) for e, n in zip(active, counts)]
    return out


def step_counts(step: Step, model: ModelSpec, substitution: bool = False,
                rewrites: Rewrites | None = None) -> list[int]:
    """Tokens of every routed (layer, expert) the step computes, after the system's rewrites."""
    return [n for _, n in step_pairs(step, model, substitution, rewrites)]


def load_time(costs: CostModel) -> float:
    """``tau``: copy-engine time per expert copied, spread over the engines."""
    return costs.h2d(costs.expert_bytes) / max(costs.profile.pcie.copy_engines, 1)


def step_floor(step: Step, model: ModelSpec, costs: CostModel, substitution: bool = False,
               slots: int | None = None, rewrites: Rewrites | None = None) -> float:
    """The physical floor of one trace step, seconds (see the module docstring)."""
    terms = _terms(step, model, costs, substitution, rewrites)
    return _floor(terms.balanced, terms.cpu.tolist(), load_time(costs), slots)


def _floor(balanced: float, cpu: list[float], load_s: float, slots: int | None) -> float:
    """A step's floor from its :class:`StepTerms`: the balanced floor, and with ``slots`` the capacity floor."""
    return balanced if slots is None else max(balanced, capacity_floor(cpu, load_s, slots))


def window_floor(steps_cpu: list[dict[int, float]], load_s: float, slots: int) -> float:
    """Floor of a run of consecutive steps from the experts they share: ``capacity_floor`` over the distinct
    (layer, expert) pairs of the window, each costing the CPU time of all its uses (see ``tighten``)."""
    total: dict[int, float] = {}  # by (layer, expert) coded as in StepTerms
    for cpu in steps_cpu:
        for pair, c in cpu.items():
            total[pair] = total.get(pair, 0.0) + c
    return capacity_floor(list(total.values()), load_s, slots)


def tighten(floors: list[float], steps_cpu: list[dict[int, float]], load_s: float,
            slots: int) -> list[float]:
    """Raise the floors of a run of consecutive steps by what windows of them need together, spread evenly.

    Over a window of consecutive steps, at most ``slots`` experts are held at its start; every other
    (layer, expert) the window runs on the GPU even once is copied, whole, inside the window; one that never
    runs on the GPU runs every use on the CPU. So the window lasts at least ``window_floor`` (the same
    relaxation as ``capacity_floor``, one unit per distinct pair) and at least the sum of its step floors.
    Each partition of the run into windows of ``k`` steps (k = 1, 2, 4, ...) bounds the run's total; the
    largest total is spread evenly over the steps, which is exact for sums of the run's step durations
    (makespan, and TPOT when every step serves the same requests: the caller's condition).
    """
    n = len(floors)
    base = sum(floors)
    best = base
    k = 2
    while k <= n:
        total = 0.0
        for start in range(0, n, k):
            part = slice(start, start + k)
            total += max(sum(floors[part]), window_floor(steps_cpu[part], load_s, slots))
        best = max(best, total)
        k *= 2
    if n > 1:
        best = max(best, window_floor(steps_cpu, load_s, slots))
    extra = (best - base) / n if n else 0.0
    return [f + extra for f in floors]


def decode_runs(phases: list[str], requests: list[np.ndarray]) -> list[slice]:
    """Runs of consecutive decode steps serving the same requests and inside no request's prefill span
    (a TTFT spans whole steps; spreading a window's need evenly is exact only for whole runs)."""
    inside = [False] * len(phases)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (phase, reqs) in enumerate(zip(phases, requests)):
        if phase == "prefill":
            for r in reqs.tolist():
                first.setdefault(r, i)
                last[r] = i
    for r, start in first.items():
        for i in range(start, last[r] + 1):
            inside[i] = True
    runs: list[slice] = []
    start = None
    for i in range(len(phases) + 1):
        same = (i < len(phases) and phases[i] == "decode" and not inside[i] and start is not None
                and np.array_equal(requests[i], requests[start]))
        if same:
            continue
        if start is not None and i - start > 1:
            runs.append(slice(start, i))
        start = i if i < len(phases) and phases[i] == "decode" and not inside[i] else None
    return runs


@dataclass
class StepTerms:
    """What a step's floor takes from the trace and the costs, whatever the slots: the balanced floor, and
    the CPU seconds of each routed (layer, expert), the pair coded as ``layer * num_experts + expert``
    (arrays: a sweep keeps these for every step of a trace while its points run)."""

    balanced: float
    pairs: np.ndarray
    cpu: np.ndarray
    phase: str
    requests: np.ndarray


def _terms(step: Step, model: ModelSpec, costs: CostModel, substitution: bool = False,
           rewrites: Rewrites | None = None) -> StepTerms:
    """:class:`StepTerms` of one step, after the system's rewrites (with ``substitution``, stand-ins)."""
    fixed = step_fixed_gpu(step, model, costs)
    pairs = step_pairs(step, model, substitution, rewrites)
    cpu = [costs.cpu_expert(n) for _, n in pairs]
    balanced = balanced_floor(fixed, [costs.gpu_expert(n) for _, n in pairs], cpu)
    first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
    codes = np.array([layer * model.num_experts + e for (layer, e), _ in pairs], dtype=np.int64)
    return StepTerms(balanced, codes, np.array(cpu, dtype=np.float64), PHASES[int(step.phase.min())],
                     np.unique(step.request[first]))


def step_terms(trace_path: str, model: ModelSpec, costs: CostModel, substitution: bool = False,
               rewrites: Rewrites | None = None) -> list[StepTerms]:
    """:class:`StepTerms` of every step of ``trace_path``."""
    return [_terms(step, model, costs, substitution, rewrites) for step in iter_steps(trace_path, columns=())]


def physical_lower_bound(trace_path: str, model: ModelSpec, costs: CostModel, substitution: bool = False,
                         slots: int | None = None, rewrites: Rewrites | None = None,
                         terms: list[StepTerms] | None = None) -> dict[str, Any]:
    """Floors of a replay of ``trace_path``: makespan, mean TTFT and TPOT, per-step durations.

    ``slots``: experts the memory plan holds at once (None: no capacity term, as
    for a reference that ignores memory). ``rewrites``: the system's
    substitutions, (step, layer) -> (row, slot, new expert). ``terms``: a list
    that keeps :func:`step_terms` of this trace and these costs between calls
    (filled by the first call that has neither substitution nor rewrites;
    bounds of other slot counts then skip the trace), or None.
    """
    if terms is None or substitution or rewrites:
        terms = step_terms(trace_path, model, costs, substitution, rewrites)
    elif not terms:
        terms += step_terms(trace_path, model, costs)
    load_s = load_time(costs)
    floors: list[float] = []
    cpu: list[dict[int, float]] = []  # per step, CPU seconds of each routed (layer, expert), for the windows
    for t in terms:
        step_cpu = t.cpu.tolist()
        floors.append(_floor(t.balanced, step_cpu, load_s, slots))
        cpu.append(dict(zip(t.pairs.tolist(), step_cpu)) if slots is not None and not substitution else {})
    phases = [t.phase for t in terms]
    requests = [t.requests for t in terms]
    if slots is not None and not substitution:
        for run in decode_runs(phases, requests):
            floors[run] = tighten(floors[run], cpu[run], load_s, slots)
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
        "substitution": substitution or bool(rewrites),
        "slots": slots,
    }
