"""The simulator's per-layer CPU and GPU tracks, laid out in closed form: CPU experts one after another after a
sync (sharing host DRAM with copies where both run), GPU experts in plan order, each once its weights are there.

:class:`Tracks` is a part of :class:`~moesim.sim.engine.Simulator`, kept apart for its size: its methods read
the simulator's memoised costs, cache, pending copies and counters.
"""

from __future__ import annotations

from typing import Callable, Sequence

from moesim.hw.cost import CostModel
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerPlan, PolicyError
from moesim.policy.state import CacheState
from moesim.sim.bookkeeping import Counters
from moesim.sim.config import SimConfig
from moesim.sim.copies import CopyEngines, Transfer
from moesim.sim.dram import Ledger, share


class Tracks:
    """Laying out a layer's CPU and GPU work (a base class of the simulator, which sets these)."""

    model: ModelSpec
    config: SimConfig
    costs: CostModel
    cache: CacheState
    counters: Counters
    pcie: CopyEngines
    dram: Ledger
    dram_combined_bps: float
    #: per layer, the copy of each expert on its way to a cache slot
    pending: list[dict[int, Transfer]]
    timeline: list[tuple] | None
    #: when the CPU pool is next free
    cpu_free: float
    shared_launch_s: float
    # memo tables of the simulator's cost lookups (seconds by tokens; a CPU expert's DRAM rate by tokens)
    _cpu: dict[int, float]
    _cpu_rate: dict[int, float]
    _gpu: dict[int, float]
    _shared: dict[int, float]
    _sync_from: float
    _sync_to: float
    _carried_from: float
    _carried_to: float
    _cpu_s: Callable[[int], float]
    _gpu_s: Callable[[int], float]
    _span: Callable[..., None]
    _submit: Callable[..., Transfer]
    _prefetch: Callable[..., None]

    def _cpu_track(self, experts: list[int], count: dict[int, int] | None, s: int, layer: int, t1: float,
                   kind: str = "expert", sync: bool = True) -> float:
        """CPU experts one after another after a sync (``sync``); returns when the last finishes.

        Copies running or queued while they run share host DRAM with them (moesim.sim.dram).
        """
        if not experts:
            return t1
        counters = self.counters
        sync = self.costs.sync_s if sync else 0.0
        cpu_free = self.cpu_free
        if cpu_free <= t1:  # the CPU is idle: the experts follow the sync
            start, before = t1, sync
            t = start + sync
            if kind == "deferred":  # judged by the next layer, which the deferred work runs beside
                self._carried_from, self._carried_to = t1, t
            else:
                self._sync_from, self._sync_to = t1, t
        else:  # the sync (the GPU's signal, the submission) runs beside CPU work still under way, the previous
            # layer's deferred experts (001 Sec. 4.1): only its part past that work costs time
            ready = t1 + sync
            start, before = max(ready, cpu_free), 0.0
            t = start
            past = cpu_free if cpu_free < ready else ready  # the sync's part past that work: from here to ready
            if kind == "deferred":
                self._carried_from, self._carried_to = past, ready
            else:
                self._sync_from, self._sync_to = past, ready
        pcie = self.pcie
        free = pcie.free
        copying = pcie.queue or (free[0] > t if len(free) == 1 else max(free) > t)
        # a decode layer's experts of one token each, once costed: _contends's answer without the call
        if copying and (self._cpu_rate[1] > 0 if count is None and 1 in self._cpu_rate
                        else self._contends(experts, count)):
            t = self._cpu_shared(experts, count, s, layer, t, kind)
        elif count is None:
            # the same sums with and without a timeline, which only draws them: a replay's figures must not
            # depend on whether it keeps one
            d = self._cpu.get(1)
            if d is None:
                d = self._cpu_s(1)
            if self._cpu_rate[1]:  # 0: cannot contend for DRAM, kept off the ledger
                self.dram.add(t, t + len(experts) * d, self._cpu_rate[1])
            if self.timeline is not None:
                for i, e in enumerate(experts):
                    self._span("cpu", 0, t + i * d, t + (i + 1) * d, kind, s, layer, e, 1)
            t += len(experts) * d
        else:
            cpu, rate, add, timeline = self._cpu, self._cpu_rate, self.dram.add, self.timeline
            for e in experts:
                n = count[e]
                d = cpu[n] if n in cpu else self._cpu_s(n)
                if rate[n]:
                    add(t, t + d, rate[n])
                if timeline is not None:
                    self._span("cpu", 0, t, t + d, kind, s, layer, e, n)
                t += d
        counters.cpu_busy_s += t - start - before
        self.cpu_free = t
        return t

    def _contends(self, experts: list[int], count: dict[int, int] | None) -> bool:
        """Whether any of these CPU experts could exceed the combined DRAM bandwidth beside copies."""
        if count is None:
            self._cpu_s(1)
            return self._cpu_rate[1] > 0
        return any(self._cpu_rate[count[e]] > 0 for e in experts if self._cpu_s(count[e]) >= 0)

    def _cpu_shared(self, experts: list[int], count: dict[int, int] | None, s: int, layer: int, t: float,
                    kind: str) -> float:
        """Lay out CPU experts from ``t`` beside the copy engines' work, both slowed where they overlap."""
        pcie = self.pcie
        counts = [1 if count is None else count[e] for e in experts]
        jobs = [(self._cpu_s(n), self._cpu_rate[n]) for n in counts]
        ends, laid = share(t, jobs, pcie.lanes_from(t), self.dram_combined_bps)
        pcie.relay_laid(laid, t)
        begin = t
        for e, n, end in zip(experts, counts, ends):
            self.dram.add(begin, end, self._cpu_rate[n])
            if self.timeline is not None:
                self._span("cpu", 0, begin, end, kind, s, layer, e, n)
            begin = end
        self.counters.dram_shared_s += (ends[-1] - t) - sum(d for d, _ in jobs)
        return ends[-1]

    def _gpu_predicting(self, plan: LayerPlan, predict: float, staged: dict[int, Transfer],
                        count: dict[int, int] | None, s: int, layer: int, tokens: int, t1: float,
                        loaded: dict[int, float] | None) -> float:
        """The GPU track of a plan with ``prefetch_after_predict`` (004 Sec. 4.2, GPU parts (2)-(4)): shared
        experts, the GPU experts resident at plan time (in plan order), the next-layer prediction (``predict``
        seconds on the stream), the plan's prefetches submitted at its end, then the other GPU experts (loads,
        copies in flight, streamed) in plan order, each once its weights are there."""
        resident = self.cache.resident[layer]  # :meth:`_load_at_once`'s loads are in it already: not yet here
        first: list[int] = []
        rest: list[int] = []
        for e in plan.gpu:
            (first if e in resident and (loaded is None or e not in loaded) else rest).append(e)
        gpu_t = self._gpu_track(first, [], {}, count, s, layer, tokens, t1, loaded)
        if predict:
            if self.timeline is not None:  # the next layer's attention and gate, run early to name prefetches
                self._span("gpu", 0, gpu_t, gpu_t + predict, "predict", s, layer, tokens=tokens)
            gpu_t += predict
            counters = self.counters
            counters.gpu_busy_s += predict
            counters.breakdown["predict"] += predict
        if plan.prefetches:
            self._prefetch(plan, s, layer, gpu_t)
        if not rest:
            return gpu_t
        return self._gpu_track(rest, plan.streamed, staged, count, s, layer, tokens, gpu_t, loaded, shared=False)

    def _gpu_track(self, experts: list[int], streamed: Sequence[int], staged: dict[int, Transfer],
                   count: dict[int, int] | None, s: int, layer: int, tokens: int, t1: float,
                   loaded: dict[int, float] | None = None, shared: bool = True) -> float:
        """Shared experts (unless not ``shared``), then GPU experts in plan order, each once its weights are
        there (``loaded``: the arrival of each of :meth:`_load_at_once`'s loads, the only GPU experts not
        resident before the plan)."""
        counters, tl = self.counters, self.timeline
        gpu_t = t1
        if self.model.shared_intermediate_size and shared:
            d = self._shared.get(tokens)
            if d is None:
                d = self._shared[tokens] = self.costs.gpu_shared(tokens) + self.shared_launch_s
            if tl is not None:
                self._span("gpu", 0, gpu_t, gpu_t + d, "shared", s, layer, tokens=tokens)
            gpu_t += d
            counters.gpu_busy_s += d
            counters.breakdown["shared_expert"] += d
        if not experts:
            return gpu_t
        resident = self.cache.resident[layer]
        pending = self.pending[layer]
        gpu_cost = self._gpu
        if not streamed and count is None and tl is None:
            # a decode layer with nothing streamed: the loop below for experts of one token each, the same sums
            # (inline, not a call of its own: every decode layer of a GPU runs it)
            d = gpu_cost.get(1)
            if d is None:
                d = self._gpu_s(1)
            compute = waited = 0.0
            if loaded is not None:  # nothing else is in flight: each expert resident or one of these loads
                for e in experts:
                    end = loaded.get(e)
                    if end is not None and end > gpu_t:
                        waited += end - gpu_t
                        gpu_t = end
                    gpu_t += d
                    compute += d
            elif not pending:  # nothing on its way to this layer: no expert waits
                for _ in experts:
                    gpu_t += d
                    compute += d
            else:
                for e in experts:
                    if e not in resident:
                        transfer = pending.get(e)
                        if transfer is not None:
                            ready = self._ready(transfer, gpu_t)
                            if ready > gpu_t:
                                waited += ready - gpu_t
                                gpu_t = ready
                    gpu_t += d
                    compute += d
            counters.gpu_busy_s += compute
            counters.breakdown["gpu_compute"] += compute
            counters.breakdown["wait_cache"] += waited
            return gpu_t
        stream_at = {e: i for i, e in enumerate(streamed)} if streamed else {}
        compute = waited = 0.0
        for e in experts:
            ready = gpu_t
            transfer = None
            if e in stream_at:
                transfer = staged.get(e)
                if transfer is None:  # its buffer's user, `staging_slots` earlier in plan.streamed, runs later
                    raise PolicyError(
                        f"at step {s}, layer {layer}, plan.streamed {streamed} is not in the order of plan.gpu",
                        source="plan", field="plan.streamed",
                        fix="list the streamed experts in the order plan.gpu computes them (engine.check=true "
                            "checks every plan)")
            elif e not in resident:
                transfer = pending.get(e)
            if transfer is not None:
                ready = self._ready(transfer, gpu_t)
            waited += ready - gpu_t
            n = 1 if count is None else count[e]
            d = gpu_cost[n] if n in gpu_cost else self._gpu_s(n)
            if tl is not None:
                self._span("gpu", 0, ready, ready + d, "expert", s, layer, e, n)
            gpu_t = ready + d
            compute += d
            if e in stream_at:
                self._stage_next(streamed, stream_at[e], staged, s, layer, gpu_t)
        counters.gpu_busy_s += compute
        counters.breakdown["gpu_compute"] += compute
        counters.breakdown["wait_cache"] += waited
        return gpu_t

    def _stage_next(self, streamed: list[int], done: int, staged: dict[int, Transfer], s: int, layer: int,
                    free_at: float) -> None:
        """Copy the streamed expert that waits for the staging buffer the ``done``-th one frees at ``free_at``.

        Issued here, when the buffer frees, not when the GPU stream reaches that expert: a GPU expert in
        between may wait for a queued prefetch, and :meth:`~moesim.sim.copies.CopyEngines.finish` then starts
        the queue up to it; the copy issued at ``free_at`` must go ahead of the prefetches not started by
        then, as demand copies do (docs/engine.md, Copies)."""
        following = done + self.config.staging_slots
        if following < len(streamed) and streamed[following] not in staged:
            staged[streamed[following]] = self._submit(layer, streamed[following], "stage", s, free_at)

    def _ready(self, transfer: Transfer, gpu_t: float) -> float:
        """When the GPU stream, free at ``gpu_t``, may start the expert whose weights ``transfer`` brings
        (a prefetch still on the wire then is counted late)."""
        end = transfer.end
        if end is None:
            end = self.pcie.finish(transfer)
        if end > gpu_t:
            if transfer.kind == "prefetch":
                self.counters.late_prefetches += 1
            return end
        return gpu_t
