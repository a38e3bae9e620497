"""The SimPy engine: replays a trace under a system on a hardware profile.

Resources (DESIGN.md, engine semantics):

* GPU compute stream: attention and gate, then shared experts and GPU experts
  in plan order; a GPU expert waits for its weights.
* CPU pool: the routed experts assigned to the CPU, one after another, each on
  all configured cores (the curves are measured that way), after a CPU-GPU
  synchronisation; it runs alongside the GPU stream.
* PCIe copy engine(s): SimPy processes serving a priority queue; demand loads
  overtake queued prefetches but never a transfer already running.
* GPU memory: expert slots per layer (:class:`~moesim.policy.state.CacheState`)
  plus staging buffers for experts streamed through without caching.

The forward pass itself is one SimPy process. A layer whose GPU experts are
all resident is advanced with a single timeout computed in closed form; the
process only waits on transfer events when a GPU expert really waits for its
weights. That keeps the engine at one or two SimPy events per layer.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import simpy

from moesim.hw.cost import CostModel
from moesim.hw.profile import HardwareProfile
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.state import CacheState
from moesim.policy.systems import ComposedSystem
from moesim.sim.memory import MemoryPlan, active_counts
from moesim.trace.io import Step, iter_steps
from moesim.trace.schema import PHASES

#: breakdown categories (000 Sec. VI-E) plus the non-MoE part of a layer
BREAKDOWN = ("attention", "predict", "cache_management", "gpu_compute", "wait_cache",
             "shared_expert", "cpu_other", "sync")


@dataclass
class SimConfig:
    """Engine parameters, reachable as ``--set engine.<name>=value``."""

    #: kernel launches per GPU expert (gate/up GEMM, activation, down GEMM)
    kernels_per_expert: int = 3
    #: kernel launches for the shared experts of a layer
    kernels_per_shared: int = 3
    #: staging buffers for streamed experts (ping-pong: 2, 000 Alg. 1)
    staging_slots: int = 2
    timeline: bool = False
    decisions: bool = False
    #: verify plans against the invariants while running (tests)
    check: bool = False


@dataclass(eq=False)
class Transfer:
    layer: int
    expert: int
    nbytes: int
    priority: int  # 0 demand, 1 prefetch
    kind: str  # "load", "prefetch", "stage"
    seq: int
    issued: float
    step: int = -1
    start: float | None = None
    end: float | None = None
    done: simpy.Event | None = None
    used_late: bool = False

    def __lt__(self, other: "Transfer") -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class PCIe:
    """Copy engines serving a priority queue of host-to-device transfers."""

    def __init__(self, env: simpy.Environment, costs: CostModel, engines: int,
                 on_done: Callable[[Transfer], None]) -> None:
        self.env = env
        self.costs = costs
        self.queue: list[Transfer] = []
        self.on_done = on_done
        self.running: list[Transfer] = []
        self.started: list[Transfer] = []
        self._wake: list[simpy.Event] = []
        for _ in range(engines):
            env.process(self._serve())

    def submit(self, transfer: Transfer) -> None:
        heapq.heappush(self.queue, transfer)
        if self._wake:
            self._wake.pop().succeed()

    def _serve(self) -> Iterator[simpy.Event]:
        env = self.env
        while True:
            if not self.queue:
                wake = env.event()
                self._wake.append(wake)
                yield wake
                continue
            transfer = heapq.heappop(self.queue)
            transfer.start = env.now
            duration = self.costs.h2d(transfer.nbytes)
            transfer.end = env.now + duration
            self.running.append(transfer)
            self.started.append(transfer)
            yield env.timeout(duration)
            self.running.remove(transfer)
            self.on_done(transfer)
            if transfer.done is not None:
                transfer.done.succeed()

    def busy_until(self, horizon: float) -> tuple[float, int]:
        """Busy seconds and bytes of transfers started before ``horizon``, cut at it.

        Prefetches still queued or running when the last token is out are work the
        run did not need; only their part inside the run counts.
        """
        busy = sum(min(t.end, horizon) - t.start for t in self.started if t.end is not None and t.start is not None)
        return busy, sum(t.nbytes for t in self.started)

    def estimate_end(self, transfer: Transfer) -> float:
        """Known end of a running transfer, or a queue-order estimate for a waiting one."""
        if transfer.end is not None:
            return transfer.end
        t = min((r.end for r in self.running if r.end is not None), default=self.env.now)
        for queued in sorted(self.queue):
            t += self.costs.h2d(queued.nbytes)
            if queued is transfer:
                return t
        return t


@dataclass
class StepRecord:
    step: int
    phase: str
    start: float
    end: float
    tokens: int
    requests: list[int]


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
    gpu_busy_s: float = 0.0
    cpu_busy_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in BREAKDOWN})


@dataclass
class SimResult:
    system: str
    steps: list[StepRecord]
    counters: Counters
    pcie_busy_s: float
    pcie_bytes: int
    makespan_s: float
    memory: MemoryPlan
    notes: list[str]
    timeline: list[tuple] | None
    decisions: list[tuple] | None
    sim_wall_s: float
    cost_fallbacks: list[str]
    initial_resident: list[list[int]] = field(default_factory=list)
    pcie_engines: int = 1


TIMELINE_COLUMNS = ("resource", "lane", "start_s", "end_s", "kind", "step", "layer", "expert", "tokens")
DECISION_COLUMNS = ("step", "layer", "expert", "action", "target_layer")


class Simulator:
    """One replay of one trace under one system."""

    def __init__(self, trace_path: str, model: ModelSpec, profile: HardwareProfile, system: ComposedSystem,
                 costs: CostModel, memory: MemoryPlan, config: SimConfig | None = None,
                 columns: tuple[str, ...] = (), seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> None:
        self.trace_path = trace_path
        self.model = model
        self.profile = profile
        self.system = system
        self.costs = costs
        self.memory = memory
        self.config = config or SimConfig()
        self.columns = columns
        self.seed = seed
        self.progress = progress
        self.env = simpy.Environment()
        self.cache = CacheState(capacity=list(memory.capacity))
        self.counters = Counters()
        self.timeline: list[tuple] | None = [] if self.config.timeline else None
        self.decisions: list[tuple] | None = [] if self.config.decisions else None
        self.pending: dict[tuple[int, int], Transfer] = {}
        self.prefetched: set[tuple[int, int]] = set()
        self.steps: list[StepRecord] = []
        self.cpu_free = 0.0
        self._seq = 0
        self.pcie = PCIe(self.env, costs, profile.pcie.copy_engines, self._transfer_done)
        self.expert_launch_s = costs.launches(self.config.kernels_per_expert)
        self.shared_launch_s = costs.launches(self.config.kernels_per_shared) if model.shared_intermediate_size else 0.0
        self.ctx = RunContext(model=model, costs=costs, capacity=list(memory.capacity), trace_path=trace_path,
                              seed=seed, columns=columns)

    # ------------------------------------------------------------------ public
    def run(self) -> SimResult:
        wall = time.perf_counter()
        self.system.configure(self.ctx)
        initial = [self.system.initial(layer, cap) for layer, cap in enumerate(self.cache.capacity)]
        for layer, experts in enumerate(initial):
            self.cache.preload(layer, experts)
        forward = self.env.process(self._forward())
        self.env.run(until=forward)
        makespan = self.steps[-1].end if self.steps else 0.0
        pcie_busy, pcie_bytes = self.pcie.busy_until(makespan)
        return SimResult(system=self.system.name, steps=self.steps, counters=self.counters,
                         pcie_busy_s=pcie_busy, pcie_bytes=pcie_bytes, makespan_s=makespan, memory=self.memory,
                         notes=list(self.ctx.notes), timeline=self.timeline, decisions=self.decisions,
                         sim_wall_s=time.perf_counter() - wall, cost_fallbacks=sorted(self.costs.fallbacks),
                         initial_resident=initial, pcie_engines=self.profile.pcie.copy_engines)

    # ------------------------------------------------------------------ recording
    def _span(self, resource: str, lane: int, start: float, end: float, kind: str, step: int, layer: int,
              expert: int = -1, tokens: int = 0) -> None:
        if self.timeline is not None and end > start:
            self.timeline.append((resource, lane, start, end, kind, step, layer, expert, tokens))

    def _decide(self, step: int, layer: int, expert: int, action: str, target: int = -1) -> None:
        if self.decisions is not None:
            self.decisions.append((step, layer, expert, action, target))

    def _transfer_done(self, transfer: Transfer) -> None:
        self.pending.pop((transfer.layer, transfer.expert), None)
        if transfer.kind != "stage":
            self.cache.finish_load(transfer.layer, transfer.expert)
        self._span("pcie", 0, transfer.start or 0.0, transfer.end or 0.0, transfer.kind, transfer.step,
                   transfer.layer, transfer.expert)

    def _submit(self, layer: int, expert: int, kind: str, step: int) -> Transfer:
        self._seq += 1
        transfer = Transfer(layer=layer, expert=expert, nbytes=self.costs.expert_bytes,
                            priority=1 if kind == "prefetch" else 0, kind=kind, seq=self._seq,
                            issued=self.env.now, step=step)
        if kind != "stage":
            self.cache.start_load(layer, expert)
            self.pending[(layer, expert)] = transfer
        self.pcie.submit(transfer)
        return transfer

    # ------------------------------------------------------------------ the forward pass
    def _forward(self) -> Iterator[simpy.Event]:
        for step in iter_steps(self.trace_path, columns=self.system.needed_columns()):
            start = self.env.now
            for layer, rows in step.layers():
                yield from self._layer(step, layer, rows)
            requests = np.unique(step.request[step.layer_bounds[0]:step.layer_bounds[1]]).tolist()
            phase = PHASES[int(step.phase.min())]
            self.steps.append(StepRecord(step.step, phase, start, self.env.now, step.tokens, requests))
            if self.progress is not None:
                self.progress(step.rows)

    def _view(self, step: Step, layer: int, rows: slice) -> LayerView:
        experts = step.experts[rows]
        active, counts = active_counts(experts, self.model.num_experts)
        arrivals = {}
        if self.cache.in_flight[layer]:
            arrivals = {e: self.pcie.estimate_end(self.pending[(layer, e)]) for e in self.cache.in_flight[layer]}
        return LayerView(
            step=step.step, layer=layer, phase="prefill" if step.phase[rows.start] == 0 else "decode",
            experts=experts, active=active, counts=counts, cache=self.cache, costs=self.costs,
            weights=None if step.weights is None else step.weights[rows],
            scores=None if step.scores is None else step.scores[rows],
            predictors={k: v[rows] for k, v in step.predictors.items()} if step.predictors else {},
            now=self.env.now, arrivals=arrivals, expert_launch_s=self.expert_launch_s,
            shared_launch_s=self.shared_launch_s)

    def _layer(self, step: Step, layer: int, rows: slice) -> Iterator[simpy.Event]:
        env, costs, counters = self.env, self.costs, self.counters
        s = step.step
        tokens = rows.stop - rows.start
        context = int(step.position[rows].max()) + 1
        t0 = env.now
        attention = costs.attention(tokens, context)
        counters.gpu_busy_s += attention
        counters.breakdown["attention"] += attention
        self._span("gpu", 0, t0, t0 + attention, "attention", s, layer, tokens=tokens)
        yield env.timeout(attention)

        view = self._view(step, layer, rows)
        plan = self.system.plan(view)
        if self.config.check:
            self._check_plan(view, plan)
        count = dict(zip(view.active, view.counts))
        resident_at_plan = set(self.cache.resident[layer])
        self._account_plan(view, plan, count)
        overhead = sum(plan.overhead_s.values())
        if overhead:
            for category, seconds in plan.overhead_s.items():
                counters.breakdown[category] = counters.breakdown.get(category, 0.0) + seconds
            yield env.timeout(overhead)

        # execute: evict, load, prefetch (demand first: it overtakes queued prefetches)
        for lay, e in plan.evictions:
            self.cache.evict(lay, e)
            self.prefetched.discard((lay, e))
            self._decide(s, layer, e, "evict", lay)
        self._log_plan(view, plan, resident_at_plan)
        for e in plan.loads:
            self._submit(layer, e, "load", s)
        streamed = plan.streamed
        staged: dict[int, Transfer] = {}
        for e in streamed[:self.config.staging_slots]:
            staged[e] = self._submit(layer, e, "stage", s)
        for lay, e in plan.prefetches:
            self._submit(lay, e, "prefetch", s)
            self.prefetched.add((lay, e))
            self._decide(s, layer, e, "prefetch", lay)
        t1 = env.now

        # CPU track, closed form
        cpu_end = t1
        if plan.cpu:
            cpu_start = max(t1, self.cpu_free)
            t = cpu_start + costs.sync_s
            counters.breakdown["sync"] += costs.sync_s
            for e in plan.cpu:
                d = costs.cpu_expert(count[e])
                self._span("cpu", 0, t, t + d, "expert", s, layer, e, count[e])
                t += d
            counters.cpu_busy_s += t - cpu_start - costs.sync_s
            cpu_end = self.cpu_free = t

        # GPU track: shared experts, then GPU experts as their weights arrive
        gpu_t = t1
        if self.model.shared_intermediate_size:
            d = costs.gpu_shared(tokens) + self.shared_launch_s
            self._span("gpu", 0, gpu_t, gpu_t + d, "shared", s, layer, tokens=tokens)
            gpu_t += d
            counters.gpu_busy_s += d
            counters.breakdown["shared_expert"] += d
        gpu_compute = 0.0
        waited = 0.0
        stream_index = {e: i for i, e in enumerate(streamed)}
        finished: dict[int, float] = {}
        for e in plan.gpu:
            ready = gpu_t
            transfer = self.pending.get((layer, e)) if e not in self.cache.resident[layer] else None
            if e in stream_index:
                i = stream_index[e]
                transfer = staged.get(e)
                if transfer is None:  # its buffer frees when the expert two places earlier finishes
                    free_at = finished[streamed[i - self.config.staging_slots]]
                    if free_at > env.now:
                        yield env.timeout(free_at - env.now)
                    transfer = staged[e] = self._submit(layer, e, "stage", s)
            if transfer is not None:
                if transfer.end is None or transfer.end > gpu_t:
                    if gpu_t > env.now:
                        yield env.timeout(gpu_t - env.now)
                    if transfer.end is None or transfer.end > env.now:
                        if transfer.done is None:
                            transfer.done = env.event()
                        yield transfer.done
                    if transfer.kind == "prefetch":
                        counters.late_prefetches += 1
                ready = max(gpu_t, transfer.end or env.now)
            waited += ready - gpu_t
            d = costs.gpu_expert(count[e]) + self.expert_launch_s
            self._span("gpu", 0, ready, ready + d, "expert", s, layer, e, count[e])
            gpu_t = ready + d
            finished[e] = gpu_t
            gpu_compute += d
        counters.gpu_busy_s += gpu_compute
        counters.breakdown["gpu_compute"] += gpu_compute
        counters.breakdown["wait_cache"] += waited
        end = max(gpu_t, cpu_end)
        counters.breakdown["cpu_other"] += max(cpu_end - gpu_t, 0.0)
        if end > env.now:
            yield env.timeout(end - env.now)

    # ------------------------------------------------------------------ bookkeeping
    def _account_plan(self, view: LayerView, plan: LayerPlan, count: dict[int, int]) -> None:
        c = self.counters
        layer, s = view.layer, view.step
        resident = self.cache.resident[layer]
        c.activations += sum(view.counts)
        c.distinct_activations += len(view.active)
        for e in view.active:
            if e in resident:
                c.hits += 1
                if (layer, e) in self.prefetched:
                    c.prefetch_used += 1
                    self.prefetched.discard((layer, e))
            elif (layer, e) in self.prefetched:
                c.prefetch_used += 1
                self.prefetched.discard((layer, e))
        for e in plan.gpu:
            c.gpu_activations += count[e]
        for e in plan.cpu:
            c.cpu_activations += count[e]
        c.demand_loads += len(plan.loads)
        c.streamed += len(plan.streamed)
        c.prefetches += len(plan.prefetches)
        c.evictions += len(plan.evictions)
        c.substituted += len(plan.substitutions)
        c.deferred += len(plan.deferred)

    def _log_plan(self, view: LayerView, plan: LayerPlan, resident: set[int]) -> None:
        """Decision-log rows in execution order: evictions were logged first, then loads and placement."""
        if self.decisions is None:
            return
        s, layer = view.step, view.layer
        loads, streamed = set(plan.loads), set(plan.streamed)
        for e in plan.gpu:
            action = "gpu_load" if e in loads else "gpu_stream" if e in streamed else \
                "gpu_hit" if e in resident else "gpu_inflight"
            self._decide(s, layer, e, action, layer)
        for e in plan.cpu:
            self._decide(s, layer, e, "cpu", layer)

    def _check_plan(self, view: LayerView, plan: LayerPlan) -> None:
        gpu, cpu = plan.gpu, plan.cpu
        assert len(set(gpu)) == len(gpu) and len(set(cpu)) == len(cpu), "expert planned twice"
        assert not set(gpu) & set(cpu), "expert on both CPU and GPU"
        computed = set(gpu) | set(cpu) | set(plan.deferred)
        assert computed == set(view.active), f"plan computes {sorted(computed)}, routed {sorted(view.active)}"
        for lay, e in plan.evictions:
            assert not (lay == view.layer and e in gpu), f"plan evicts expert {e} it is about to use"
            assert e not in self.cache.in_flight[lay], f"plan evicts in-flight expert {e}"


def result_to_frames(result: SimResult) -> dict[str, Any]:
    """Timeline and decision log as pandas DataFrames (None when not recorded)."""
    import pandas as pd
    out: dict[str, Any] = {"timeline": None, "decisions": None}
    if result.timeline is not None:
        frame = pd.DataFrame(result.timeline, columns=list(TIMELINE_COLUMNS))
        out["timeline"] = frame.sort_values(["start_s", "resource", "lane"], kind="stable").reset_index(drop=True)
    if result.decisions is not None:
        out["decisions"] = pd.DataFrame(result.decisions, columns=list(DECISION_COLUMNS))
    return out
