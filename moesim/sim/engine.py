"""The SimPy engine: replays a trace under a system on a hardware profile.

Resources (DESIGN.md, engine semantics):

* GPU compute stream: attention and gate, then shared experts and GPU experts
  in plan order; a GPU expert waits for its weights.
* CPU pool: the routed experts assigned to the CPU, one after another, each on
  all configured cores (the curves are measured that way), after a CPU-GPU
  synchronisation; it runs alongside the GPU stream.
* PCIe copy engine(s): demand loads overtake queued prefetches but never a
  transfer already running.
* GPU memory: expert slots per layer (:class:`~moesim.policy.state.CacheState`)
  plus staging buffers for experts streamed through without caching.

The forward pass is one SimPy process and the only source of work: every
transfer is issued by it, at non-decreasing times, and a layer's operations
follow from its plan. So resources need no processes of their own: a layer's
GPU and CPU tracks are computed in closed form, and :class:`~moesim.sim.copies.CopyEngines` starts
queued transfers lazily, in order, whenever the forward pass looks at the
clock, which gives the schedule a process per engine would, without events per
transfer; a decode layer's demand loads on an idle engine are laid out in closed
form, with no transfer at all (:meth:`Simulator._load_at_once`). A step then
costs one SimPy timeout, which is what lets a
2,000-token DeepSeek-V3 decode replay in about a second
(``benchmarks/replay_speed.py``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np
import simpy

from moesim.hw.cost import CostModel
from moesim.hw.profile import HardwareProfile
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerPlan, LayerView, PolicyError, RunContext, active_experts, layer_view
from moesim.policy.checked import room_fault
from moesim.policy.state import CacheState
from moesim.policy.systems import ComposedSystem
from moesim.sim.bookkeeping import (Counters, account_moves, account_placement, check_plan, placement_decisions,
                                   substitution_mass, weight_mass)
from moesim.sim.config import SimConfig
from moesim.sim.copies import CopyEngines, Transfer
from moesim.sim.dram import Ledger
from moesim.sim.memory import MemoryPlan
from moesim.sim.result import SimResult, StepRecord
from moesim.sim.tracks import Tracks
from moesim.sim.transfers import Transfers
from moesim.trace.io import OneRowLayers, Step, iter_steps
from moesim.trace.schema import PHASES


#: steps a prefetch may wait in the copy queue before the run's end without a note that the queue fell behind
BACKLOG_STEPS = 2
#: the streamed experts and staged copies of a plan that streams nothing (read, never changed)
NOTHING: tuple[int, ...] = ()
NONE_STAGED: dict[int, Transfer] = {}
#: breakdown categories of a step's work outside its MoE layers, besides the dense layers' attention
FIXED_CATEGORIES = ("dense_ffn", "embedding", "lm_head", "sampling", "launch", "host")


class Simulator(Transfers, Tracks):
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
        self._check = self.config.check  # read once: the per-layer path asks it for every plan
        self.columns = columns
        self.seed = seed
        self.progress = progress
        self.env = simpy.Environment()
        self.cache = CacheState(capacity=list(memory.capacity), pool=memory.pool)
        self.counters = Counters()
        self.timeline: list[tuple] | None = [] if self.config.timeline else None
        self.decisions: list[tuple] | None = [] if self.config.decisions else None
        # every plan through _execute, the general path, even one of CPU and GPU experts alone: the decision log
        # is kept there (tests set it to compare the two paths)
        self._execute_all = self.decisions is not None
        #: per layer, the transfer making each expert resident (loads and prefetches in flight): indexed by
        #: layer, then expert, so the hot lookups build no (layer, expert) keys
        self.pending: list[dict[int, Transfer]] = [{} for _ in memory.capacity]
        #: per layer, the experts prefetched there and not used since (a prefetch's first use counts)
        self.prefetched: list[set[int]] = [set() for _ in memory.capacity]
        self.steps: list[StepRecord] = []
        self.cpu_free = 0.0
        self.deferred_until = 0.0
        # the MoE layer the current step ends with: its deferred experts have no later layer to overlap with. Not
        # always the model's last: an imported trace may log only some layers (cerebras: layer 0 of 16)
        self._last_layer = -1
        # start and end of the last layer's sync and of the last deferred work's: a sync is critical-path time only
        # where it runs past the GPU track, which the layer that waits for it finds out (an older one ended
        # before that layer began, so it never counts twice)
        self._sync_from = self._sync_to = self._carried_from = self._carried_to = 0.0
        self._seq = 0
        self.dram = Ledger()
        self.dram_combined_bps = profile.dram_combined_gbps * 1e9
        chunk = self.config.copy_chunk_bytes
        self.pcie = CopyEngines((lambda n: costs.h2d_chunked(n, chunk)) if chunk > 0 else costs.h2d,
                                profile.pcie.copy_engines, self.dram, self.dram_combined_bps, max(chunk, 0))
        # the most a copy engine set draws from host DRAM: CPU work whose own rate plus this stays within
        # the combined bandwidth can never contend, and is kept off the DRAM ledger (the common case)
        copy_s = self.pcie.duration(costs.expert_bytes) if costs.expert_bytes else 0.0
        self._copy_rate = costs.expert_bytes / copy_s * profile.pcie.copy_engines if copy_s else 0.0
        # launches depend on the phase (a whole-decode-step CUDA Graph, 001 Sec. 3.3): set per step
        self._launch = {phase: (costs.launches(self.config.kernels_per_expert, phase),
                                costs.launches(self.config.kernels_per_shared, phase)
                                if model.shared_intermediate_size else 0.0) for phase in PHASES}
        self.expert_launch_s, self.shared_launch_s = self._launch["prefill"]
        self._layer_launches = {phase: costs.layer_launches(phase) for phase in PHASES}
        # per-run memo tables: the cost model is pure, and these lookups sit on the hot path
        self._attention: dict[tuple[int, int], float] = {}
        self._cpu: dict[int, float] = {}
        self._cpu_rate: dict[int, float] = {}
        self._gpu_by_phase: dict[str, dict[int, float]] = {phase: {} for phase in PHASES}
        self._shared_by_phase: dict[str, dict[int, float]] = {phase: {} for phase in PHASES}
        self._gpu = self._gpu_by_phase["prefill"]
        self._shared = self._shared_by_phase["prefill"]
        self._fixed: dict[tuple[int, int, str], dict[str, float]] = {}
        self._step_fixed: dict[str, float] = {}
        self._dense_attention = 0.0
        self._writeback_s: float | None = None
        self._step_phase = "prefill"  # the phase of the step ``run_step`` last ran
        self._rows: OneRowLayers | None = None  # the rows of the step ``run_step`` runs, split by layer
        self._context = 0  # the context length of the step ``run_step`` runs (its views carry it)
        self._empty: dict = {}
        self.ctx = RunContext(model=model, costs=costs, capacity=list(memory.capacity), pool=memory.pool,
                              trace_path=trace_path, seed=seed, columns=columns)
        #: called with each step's record once it ends; True ends the replay there (moesim.sim.portfolio)
        self.watch: Callable[[StepRecord], bool] | None = None
        self._steps: Iterator[Step] | None = None  # the trace's steps as the forward pass reads them

    # ------------------------------------------------------------------ public
    def run(self, driver: Callable[[], Iterator[simpy.Event]] | None = None) -> SimResult:
        """Run to the end; ``driver`` is the process issuing steps through :meth:`run_step` (default: the trace's)."""
        forward = self.start(driver)
        self.env.run(until=forward)
        return self.finish()

    def start(self, driver: Callable[[], Iterator[simpy.Event]] | None = None) -> simpy.Process:
        """Configure the system, preload its cache and start the forward pass (``run`` runs it to the end;
        a portfolio bound runs its members a few steps at a time)."""
        self._wall = time.perf_counter()
        self.system.check_columns(self.ctx)
        self.system.configure(self.ctx)
        self._initial = [sorted(self.system.initial(layer, quota))
                         for layer, quota in enumerate(self.memory.cache_quota)]
        for layer, experts in enumerate(self._initial):
            self.cache.preload(layer, experts)
        self._plan = self.system.planner()  # fetched once: plan() runs for every layer
        return self.env.process((driver or self._forward)())

    def stop_reading(self) -> None:
        """Let go of the trace: a replay stopped before its end (a portfolio member found not best) no
        longer holds steps of a decode it shares with others (moesim.trace.io)."""
        if self._steps is not None:
            self._steps.close()  # type: ignore[attr-defined]

    def finish(self) -> SimResult:
        """The result of a forward pass that has ended."""
        wall, initial = self._wall, self._initial
        makespan = self.steps[-1].end if self.steps else 0.0
        self._retire(makespan)
        if self.timeline is not None:
            for transfer in self.pcie.tails:
                self._writeback_span(transfer, makespan)
        pcie_busy, pcie_bytes = self.pcie.busy_until(makespan)
        if self.timeline is not None:
            self._cut_spans(makespan)
        # prefetches no engine had started when the last token was out copied nothing (busy_until leaves their
        # bytes and time out): dropped, as a cancellation drops them, so that prefetches less cancelled ones
        # are the copies the run counts
        for transfer in self.pcie.queue:
            if transfer.kind == "prefetch" and not transfer.cut:  # queued whole (a cut one copied its first chunks)
                self._count_cancelled(transfer)
        return SimResult(system=self.system.name, steps=self.steps, counters=self.counters,
                         pcie_busy_s=pcie_busy, pcie_bytes=pcie_bytes, makespan_s=makespan, memory=self.memory,
                         notes=list(self.ctx.notes) + self._backlog_note(), timeline=self.timeline,
                         decisions=self.decisions,
                         sim_wall_s=time.perf_counter() - wall, cost_fallbacks=sorted(self.costs.fallbacks),
                         initial_resident=initial, pcie_engines=self.profile.pcie.copy_engines,
                         rewrites=self.system.rewrites, runtime=self.costs.runtime_name)

    def _backlog_note(self) -> list[str]:
        """A note when prefetches issued more than :data:`BACKLOG_STEPS` steps before the last one never started:
        the copy queue fell behind the forward pass, so prefetches landed steps late and held the slots they had
        evicted empty until then (a bigger cache can then be slower: a longer backlog). The last steps' own
        prefetches, for steps that never came or a copy engine a step behind, are no backlog."""
        if not self.steps:
            return []
        last = self.steps[-1].step
        # a chunked prefetch's rest, back in the queue, has started (cut)
        late = [x.step for x in self.pcie.queue if x.kind == "prefetch" and not x.cut and x.step < last - BACKLOG_STEPS]
        if not late:
            return []
        return [f"{self.system.name}: {len(late)} prefetches issued more than {BACKLOG_STEPS} steps before the last "
                f"were still queued, never started, when the run ended (the oldest from step {min(late)} of {last}): "
                f"the copies fell behind, so prefetches landed late and the slots they evicted stood empty until "
                f"then; fewer prefetches per layer may run faster"]

    # ------------------------------------------------------------------ recording
    def _cut_spans(self, makespan: float) -> None:
        """Spans of the copies and write-backs still running when the run ends, cut at its end: ``pcie_util``
        counts their part inside the run, so the timeline shows it too."""
        tails, running = self.pcie.past(makespan)
        for load in tails:
            if load.evicted is not None:
                self._span("pcie", load.engine, load.end, makespan, "writeback", load.step, *load.evicted)
        for transfer in running:
            start = transfer.start if transfer.start is not None else makespan
            self._span("pcie", transfer.engine, start, makespan, transfer.kind, transfer.step, transfer.layer,
                       transfer.expert)

    def _span(self, resource: str, lane: int, start: float, end: float, kind: str, step: int, layer: int,
              expert: int = -1, tokens: int = 0) -> None:
        if end > start:
            self.timeline.append((resource, lane, start, end, kind, step, layer, expert, tokens))  # type: ignore

    # ------------------------------------------------------------------ cost lookups (memoised)
    def _attention_s(self, tokens: int, context: int) -> float:
        key = (tokens, context)
        value = self._attention.get(key)
        if value is None:
            value = self._attention[key] = self.costs.attention(tokens, context)
        return value

    def _cpu_s(self, tokens: int) -> float:
        value = self._cpu.get(tokens)
        if value is None:
            value = self._cpu[tokens] = self.costs.cpu_expert(tokens)
            rate = self.costs.expert_bytes / value if value > 0 else 0.0
            # 0: this expert and every copy together stay within the combined bandwidth
            self._cpu_rate[tokens] = rate if rate + self._copy_rate > self.dram_combined_bps else 0.0
        return value

    def _gpu_s(self, tokens: int) -> float:
        value = self._gpu.get(tokens)
        if value is None:
            value = self._gpu[tokens] = self.costs.gpu_expert(tokens) + self.expert_launch_s
        return value

    # ------------------------------------------------------------------ the forward pass
    def _forward(self) -> Iterator[simpy.Event]:
        env = self.env
        self._steps = iter_steps(self.trace_path, columns=self.system.needed_columns())
        end = env.now
        for step in self._steps:
            # a step starts where the last one ended: env.now, as start + (end - start), can fall an ulp short
            start = end
            # layers run back to back and nothing else issues work, so one timeout per step suffices
            end = self.run_step(step, start)
            yield env.timeout(end - start)
            first, second = step.layer_bounds[:2].tolist()
            # one token: its request (np.unique's sort costs more than the rest of a small step's set-up)
            requests = [int(step.request[first])] if second - first == 1 else \
                np.unique(step.request[first:second]).tolist()
            self.steps.append(StepRecord(step.step, self._step_phase, start, end, second - first, requests))
            if self.progress is not None:
                self.progress(step.rows)
            if self.watch is not None and self.watch(self.steps[-1]):
                return

    def run_step(self, step: Step, start: float) -> float:
        """Run one forward pass (every layer of ``step``) from ``start``; return when it ends.

        The one entry point for a step: the trace replay above and the serving
        loop (which assembles its steps from requests) both call it. Order: the
        runtime's host work and graph launch, embedding, dense layers, the MoE
        layers, LM head and sampling.
        """
        first = slice(*step.layer_bounds[:2].tolist())
        tokens = first.stop - first.start
        context = (int(step.position[first.start]) if tokens == 1 else int(step.position[first].max())) + 1
        phase = self._step_phase = PHASES[int(step.phase.min())]
        self._context = context
        sequences = len(np.unique(step.request[first])) if tokens > 1 else 1
        self.expert_launch_s, self.shared_launch_s = self._launch[phase]
        self._gpu, self._shared = self._gpu_by_phase[phase], self._shared_by_phase[phase]
        self._layer_launch = self._layer_launches[phase]
        head, tail = self._step_work(tokens, context, sequences, phase)
        t = start + head
        if self.timeline is not None:
            self._step_spans(step.step, start, t, tokens, before=True)
        self._rows = step.one_row_layers()
        self._empty = {}  # the step's views' arrivals and predictors where they have none
        attention = self._attention_s(tokens, context)
        layers = step.layers()
        self._last_layer = layers[-1][0] if layers else -1
        if self._rows is not None:  # one row a layer: every layer attends over the step's one token
            for layer, rows in layers:
                t = self._layer(step, layer, rows, attention, phase, t)
        else:
            for layer, rows in layers:
                # a layer attends over the step's tokens (an imported trace may log a layer's rows differently)
                own = attention if rows.stop - rows.start == tokens else \
                    self._attention_s(rows.stop - rows.start, context)
                t = self._layer(step, layer, rows, own, phase, t)
        if self.timeline is not None:
            self._step_spans(step.step, t, t + tail, tokens, before=False)
        return t + tail

    def _step_spans(self, s: int, t: float, end: float, tokens: int, before: bool) -> None:
        """Timeline spans of the GPU work before the first MoE layer (from ``t``) or after the last (to ``end``).

        The last span ends at ``end`` exactly: the step's times are summed in another order, and a span an
        ulp past them would overlap the next one on the GPU lane.
        """
        work = {**self._step_fixed, "attention": self._dense_attention}
        if before:
            t += work["host"] + work["launch"]
            kinds = ("embedding", "attention", "dense_ffn")
        else:
            kinds = ("lm_head", "sampling")
        for kind in kinds:
            stop = end if kind == kinds[-1] else t + work[kind]
            self._span("gpu", 0, t, stop, kind, s, -1, tokens=tokens)
            t = stop

    def _step_work(self, tokens: int, context: int, sequences: int, phase: str) -> tuple[float, float]:
        """Seconds before the first MoE layer and after the last one, counted in the breakdown."""
        key = (tokens, sequences, phase)
        work = self._fixed.get(key)
        if work is None:  # all but the dense layers' attention, which grows with the context
            costs = self.costs
            work = dict(costs.step_fixed(tokens, context, sequences))
            del work["attention"]
            work["launch"] = costs.step_launch(phase) + costs.model.num_dense_layers * costs.layer_launches(phase)
            work["host"] = costs.host_per_step
            self._fixed[key] = work
        attention = self._dense_attention = self.model.num_dense_layers * self._attention_s(tokens, context)
        self._step_fixed = work  # the current step's, for its timeline spans
        breakdown, counters = self.counters.breakdown, self.counters
        for category in FIXED_CATEGORIES:
            breakdown[category] += work[category]
        breakdown["attention"] += attention
        counters.gpu_busy_s += attention + work["dense_ffn"] + work["embedding"] + work["lm_head"] + work["sampling"]
        head = work["host"] + work["launch"] + work["embedding"] + attention + work["dense_ffn"]
        return head, work["lm_head"] + work["sampling"]

    def _view(self, step: Step, layer: int, rows: slice, phase: str, now: float) -> LayerView:
        in_flight = self.cache.in_flight[layer]
        # no arrivals, no predictors: the step's one empty dict, which views only read
        arrivals = self.pcie.estimate_ends(in_flight, self.pending[layer]) if in_flight else self._empty
        one_row = self._rows
        if one_row is not None:  # a decode step of one sequence: its layers' rows were split at its start
            i = rows.start  # the validated trace row has distinct experts: one token each
            predictors = one_row.predictors[i] if one_row.predictors else self._empty
            return layer_view(step.step, layer, phase, one_row.experts[i], one_row.active[i], one_row.ones,
                              self.cache, self.costs, one_row.weights[i], one_row.scores[i], predictors, now,
                              arrivals, self.expert_launch_s, self.shared_launch_s, one_row.request[i], self._context)
        predictors = {k: v[rows] for k, v in step.predictors.items()} if step.predictors else self._empty
        experts = step.experts[rows]
        if rows.stop - rows.start == 1:  # one token: the validated trace row has distinct experts
            active = experts[0].tolist()
            counts = [1] * len(active)
        else:
            active, counts = active_experts(experts, self.model.num_experts)
        return layer_view(
            step.step, layer, phase, experts, active, counts, self.cache, self.costs,
            None if step.weights is None else step.weights[rows],
            None if step.scores is None else step.scores[rows],
            predictors, now, arrivals, self.expert_launch_s, self.shared_launch_s, step.request[rows],
            self._context)

    def _layer(self, step: Step, layer: int, rows: slice, attention: float, phase: str, t0: float) -> float:
        """Run one MoE layer starting at ``t0`` (its attention taking ``attention`` seconds); return when it ends."""
        counters, tl = self.counters, self.timeline
        s = step.step
        tokens = rows.stop - rows.start
        counters.gpu_busy_s += attention
        breakdown = counters.breakdown
        breakdown["attention"] += attention
        launch = self._layer_launch
        if launch:
            breakdown["launch"] += launch
            t0 += launch
        t1 = t0 + attention
        if tl is not None:
            self._span("gpu", 0, t0, t1, "attention", s, layer, tokens=tokens)
        pcie = self.pcie
        if pcie.queue or pcie.unretired:
            self._retire(t1)
        elif len(self.dram.intervals) > 64:  # CPU work with no copy to meet: forget it now and then
            self.dram.prune(t1)

        view = self._view(step, layer, rows, phase, t1)
        plan = self._plan(view)
        if plan.substitutions:
            view = self._substitute(view, plan)
        if self._check:
            check_plan(view, plan)
        # one token per expert (every decode layer): no per-expert counts needed
        count = None if len(view.active) == view.experts.size else dict(zip(view.active, view.counts))
        resident = self.cache.resident[layer]
        resident_at_plan = set(resident) if self.decisions is not None else resident
        account_placement(counters, view, plan, count, resident, self.prefetched[layer])
        if not (plan.loads or plan.streamed or plan.prefetches or plan.evictions or plan.writebacks or plan.deferred
                or plan.substitutions or plan.overhead_s or plan.cancel_queued_prefetches
                or plan.prefetch_after_predict is not None or self._execute_all):
            # experts computed where they are and nothing else (every cpu-only layer, a layer of hits): what
            # _execute does for such a plan, without its tests (account_moves would count nothing)
            cpu_end = self._cpu_track(plan.cpu, count, s, layer, t1)
            gpu_end = self._gpu_track(plan.gpu, NOTHING, NONE_STAGED, count, s, layer, tokens, t1)
            deferred_end, carried = 0.0, None
        else:
            cpu_end, gpu_end, deferred_end, carried = self._execute(view, plan, count, resident_at_plan, s, tokens,
                                                                    t1)
        # the previous layer's deferred experts are added into this layer's output
        cpu_side = cpu_end if cpu_end > self.deferred_until else self.deferred_until
        end = gpu_end if gpu_end > cpu_side else cpu_side
        if cpu_side > gpu_end:
            # the syncs' part past the GPU track [sync], the rest [cpu_other]: inline, as every CPU layer runs it
            stop = self._sync_to
            past = stop - (self._sync_from if self._sync_from > gpu_end else gpu_end) if stop > gpu_end else 0.0
            if self._carried_to > gpu_end:
                past += self._past_carried(gpu_end)
            breakdown = counters.breakdown
            breakdown["sync"] += past
            breakdown["cpu_other"] += cpu_side - gpu_end - past
        self.deferred_until = deferred_end
        if carried is not None:
            self._carried_from, self._carried_to = carried
            counters.deferred_weight_mass += weight_mass(view, plan.deferred)
            if layer == self._last_layer and self.deferred_until > end:  # nothing later to overlap with
                past = self._past_carried(end)
                counters.breakdown["sync"] += past
                counters.breakdown["cpu_other"] += self.deferred_until - end - past
                end = self.deferred_until
        return end

    def _execute(self, view: LayerView, plan: LayerPlan, count: dict[int, int] | None, resident_at_plan: set[int],
                 s: int, tokens: int, t1: float) -> tuple[float, float, float, tuple[float, float] | None]:
        """Carry a plan out from ``t1``: its overhead, evictions, copies, CPU and GPU tracks and deferred work.
        Returns when the CPU track, the GPU track and the deferred work end (0.0: none) and, with deferred work,
        its sync (``_carried_from``, ``_carried_to``), which the caller sets once the layer is joined."""
        counters, layer, pcie = self.counters, view.layer, self.pcie
        account_moves(counters, plan)  # the rest of account_plan
        if plan.overhead_s:
            # the plan's own time (a predictor's or scheduler's decision, cache bookkeeping, a wait for copies)
            # is host work the stream waits for before the layer's experts, as kernel launches are: critical-path
            # time in its categories, a gap on the timeline's GPU lane, not GPU busy time (gpu_util); the real
            # backend spins it on the host (backends/torch_backend.py)
            for category, seconds in plan.overhead_s.items():
                counters.breakdown[category] = counters.breakdown.get(category, 0.0) + seconds
            t1 += sum(plan.overhead_s.values())

        # execute: evict, load, prefetch (demand first: it overtakes queued prefetches)
        if plan.evictions:
            cache, prefetched = self.cache, self.prefetched
            if cache.mirror is not None:  # a pool: evict_all keeps its tally and journal in one pass
                cache.evict_all(plan.evictions)
                for lay, e in plan.evictions:
                    prefetched[lay].discard(e)
            else:
                resident = cache.resident
                for lay, e in plan.evictions:  # CacheState.evict_all, inline, each also no longer prefetched
                    if e not in resident[lay]:
                        cache.evict(lay, e)  # refused, naming the one at fault
                    resident[lay].discard(e)
                    prefetched[lay].discard(e)
            if self.decisions is not None:
                self.decisions += [(s, layer, e, "evict", lay) for lay, e in plan.evictions]
        if self.decisions is not None:
            self.decisions += placement_decisions(view, plan, resident_at_plan)
        if plan.cancel_queued_prefetches:
            # a queued prefetch of an expert this layer computes on the GPU is its load now: keep it
            self._cancel_prefetches(t1, frozenset((layer, e) for e in plan.gpu), s, layer)
            if plan.loads or plan.prefetches:
                self._check_room(plan, s, layer, t1)
        loaded = None
        if plan.loads or plan.writebacks:
            if count is None and self.timeline is None and not plan.streamed \
                    and len(plan.writebacks) <= len(plan.loads) \
                    and not ((plan.cpu or plan.deferred) and self._contends(plan.cpu or plan.deferred, None)) \
                    and pcie.idle_at(t1):
                loaded = self._load_at_once(layer, plan.loads, plan.writebacks, s, t1)
            else:
                self._submit_loads(layer, plan.loads, s, t1, plan.writebacks)
        streamed = plan.streamed
        staged = self._stage(layer, streamed[:self.config.staging_slots], s, t1) if streamed else NONE_STAGED
        predict = plan.prefetch_after_predict  # None but for 004's timing
        if plan.prefetches and not plan.prefetch_after_gpu and predict is None:
            self._prefetch(plan, s, layer, t1)

        cpu_end = self._cpu_track(plan.cpu, count, s, layer, t1)
        deferred_end, carried = 0.0, None
        if plan.deferred:
            # deferred work follows the immediate experts' submission; with none, it is the submission. Laid out
            # before the GPU track: where it shares host DRAM with a copy it slows the copy (re-laid), and a GPU
            # expert must wait for that copy's new end. The previous layer's deferred sync stays for the
            # layer's join; this layer's is kept until then
            before = self._carried_from, self._carried_to
            deferred_end = self._cpu_track(plan.deferred, count, s, layer, cpu_end, kind="deferred",
                                           sync=not plan.cpu)
            carried = self._carried_from, self._carried_to
            self._carried_from, self._carried_to = before
        if predict is None:
            gpu_end = self._gpu_track(plan.gpu, streamed, staged, count, s, layer, tokens, t1, loaded)
            if plan.prefetches and plan.prefetch_after_gpu:
                self._prefetch(plan, s, layer, gpu_end)
        else:
            gpu_end = self._gpu_predicting(plan, predict, staged, count, s, layer, tokens, t1, loaded)
        return cpu_end, gpu_end, deferred_end, carried

    def _check_room(self, plan: LayerPlan, s: int, layer: int, t1: float) -> None:
        """Refuse, in one line, a plan whose loads and prefetches count on the slots of prefetches its
        cancellation could not drop: those a copy engine had started by ``t1`` finish and keep their slots
        (plan checks can only bound what a cancellation frees; the cache's own refusal is an AssertionError
        naming no policy)."""
        problem = room_fault(self.cache, layer, plan.loads, plan.prefetches)
        if not problem:
            return
        layers = {lay for lay, _ in plan.prefetches} | ({layer} if plan.loads else set())
        started = [f"expert {x.expert} of layer {x.layer} (from {x.start * 1e3:.3f} ms)" if x.start is not None
                   else f"expert {x.expert} of layer {x.layer} (its first chunks)"
                   for lay, pending in enumerate(self.pending) if self.cache.pool is not None or lay in layers
                   for x in pending.values() if x.priority == 1 and (x.start is not None and x.start <= t1 or x.cut)]
        on_wire = f"; on the wire at the plan's {t1 * 1e3:.3f} ms, so kept: {', '.join(started[:3])}" \
            f"{' and more' if len(started) > 3 else ''}" if started else ""
        raise PolicyError(f"at step {s}, layer {layer}, {problem}{on_wire}",
                          source=f"system '{self.system.name}' (plan.cancel_queued_prefetches)",
                          fix="evict a resident expert (plan.evictions) for each load or prefetch beyond the free "
                              "slots: a cancellation frees only the slots of prefetches no copy engine has started")

    def _past_carried(self, t: float) -> float:
        """The part of the last deferred work's sync that runs past ``t``."""
        start, stop = self._carried_from, self._carried_to
        return stop - (start if start > t else t) if stop > t else 0.0

    def _substitute(self, view: LayerView, plan: LayerPlan) -> LayerView:
        """The view after the plan's rewrites, with the gate-weight mass they touched counted."""
        self.counters.substituted_weight_mass += substitution_mass(view, plan)
        return view.substituted(plan.substitutions)
