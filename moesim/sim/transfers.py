"""The engine's copies over PCIe: demand loads, prefetches, staging copies and write-backs submitted to the
copy engines (:class:`~moesim.sim.copies.CopyEngines`), and finished ones made resident.

:class:`Transfers` is a part of :class:`~moesim.sim.engine.Simulator`, kept apart for its size: its methods
read and change the simulator's cache, pending copies and counters.
"""

from __future__ import annotations

import heapq
from typing import Callable

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerPlan
from moesim.policy.state import CacheState
from moesim.sim.bookkeeping import Counters
from moesim.sim.copies import CopyEngines, Transfer, new_transfer
from moesim.sim.dram import Ledger

#: the transfers that make an expert resident when they end (not stage, chunk or write-back)
CACHED_KINDS = frozenset({"load", "prefetch"})


class Transfers:
    """Submitting and retiring the simulator's copies (a base class of the simulator, which sets these)."""

    pcie: CopyEngines
    cache: CacheState
    costs: CostModel
    counters: Counters
    dram: Ledger
    #: per layer, the copy of each expert on its way to a cache slot
    pending: list[dict[int, Transfer]]
    #: per layer, the experts prefetched and not yet used
    prefetched: list[set[int]]
    timeline: list[tuple] | None
    decisions: list[tuple] | None
    _seq: int
    _writeback_s: float | None
    #: a timeline span, recorded when the timeline is on (the simulator's)
    _span: Callable[..., None]

    def _retire(self, t: float) -> None:
        """Make transfers finished by ``t`` resident."""
        pending, in_flight, resident = self.pending, self.cache.in_flight, self.cache.resident
        pcie = self.pcie
        if pcie.queue:
            pcie.advance(t)
        done, pop, timeline = pcie.unretired, heapq.heappop, self.timeline
        while done and done[0][0] <= t:
            end, _, transfer = pop(done)
            if transfer.end != end or transfer.retired:
                continue  # stale: the transfer was re-laid later
            transfer.retired = True
            if transfer.kind in CACHED_KINDS:
                layer, expert = transfer.layer, transfer.expert
                del pending[layer][expert]
                in_flight[layer].discard(expert)  # CacheState.finish_load, inlined: this runs per transfer
                resident[layer].add(expert)
                if transfer.tail:
                    if timeline is not None:
                        self._writeback_span(pcie.tails[transfer.engine], t)  # ended before this one began
                    pcie.tails[transfer.engine] = transfer
            if timeline is not None:
                self._span("pcie", transfer.engine, transfer.start or 0.0, transfer.end or 0.0, transfer.kind,
                           transfer.step, transfer.layer, transfer.expert)
        if self.dram.intervals:
            self.dram.prune(t)

    def _writeback_span(self, load: Transfer | None, t: float) -> None:
        """The timeline span of ``load``'s write-back tail if it ended by ``t`` (as a retired transfer's)."""
        if load is not None and load.evicted is not None and load.end + load.tail <= t:  # type: ignore[operator]
            self._span("pcie", load.engine, load.end, load.end + load.tail, "writeback", load.step,  # type: ignore
                       *load.evicted)

    def _submit_loads(self, layer: int, experts: list[int], step: int, at: float,
                      writebacks: list[tuple[int, int]] | None = None) -> None:
        """Demand loads of one plan, submitted together (the common case of every cache miss); each
        write-back (a device-to-host copy of an evicted expert) right after the load that takes its slot,
        as that load's tail (:class:`~moesim.sim.copies.Transfer`), the others after the loads."""
        self.cache.start_loads(layer, experts)
        pending = self.pending[layer]
        nbytes = self.costs.expert_bytes
        batch = []
        back = writebacks or ()
        tail = self._writeback_seconds() if back else 0.0
        seq = self._seq
        for e in experts:
            seq += 1
            pending[e] = transfer = new_transfer(layer, e, nbytes, 0, "load", seq, at, step)
            batch.append(transfer)
        for transfer, evicted in zip(batch, back):  # the i-th write-back rides on the i-th load
            transfer.tail = tail
            transfer.evicted = evicted
        for evicted in back[len(experts):]:
            seq += 1
            batch.append(self._writeback(evicted, step, at, seq))
        self._seq = seq
        self.pcie.submit_demands(batch, at)

    def _load_at_once(self, layer: int, experts: list[int], writebacks: list[tuple[int, int]], step: int,
                      at: float) -> dict[int, float]:
        """:meth:`_submit_loads` of a decode layer's loads that the idle copy engine takes at once
        (:meth:`~moesim.sim.copies.CopyEngines.idle_at`), in a layer whose CPU work cannot contend with them
        for DRAM: when each arrives, by expert, with no transfer placed.

        Each expert is resident from here on, in plan order as its retirement would make it: this layer's
        GPU track waits for its arrival (``loaded``), the layer ends after it, and everything else that
        looks at the cache before the next layer (a prefetch's slot checks) counts it as in flight would. The
        schedule, busy time and bytes are those of :meth:`_submit_loads`; a load carrying a write-back
        (``writebacks``, at most one each) keeps the engine busy for its tail, and the last one is kept as
        the engine's retired tail.
        """
        self.cache.check_loads(layer, experts)
        tail = self._writeback_seconds() if writebacks else 0.0
        nbytes = self.costs.expert_bytes
        first_start, ends = self.pcie.lay_demands(len(experts), nbytes, at, len(writebacks), tail)
        first_seq = self._seq + 1
        self._seq += len(experts)
        if writebacks:
            i = len(writebacks) - 1
            start = ends[i - 1] + tail if i else first_start  # the copy before it and its tail end there
            self.pcie.tails[0] = Transfer(layer, experts[i], nbytes, 0, "load", first_seq + i, at, step, start,
                                          ends[i], -1, 0, True, 0.0, tail, writebacks[i])
        resident = self.cache.resident[layer]
        if type(resident) is set:  # one call, the same set as adding them one by one in this order
            resident.update(experts)
        else:  # a pooled cache's CountedSlots: each add keeps the pool's tally and journal
            for e in experts:
                resident.add(e)
        return dict(zip(experts, ends))

    def _writeback_seconds(self) -> float:
        if self._writeback_s is None:
            self._writeback_s = self.costs.d2h(self.costs.expert_bytes)
        return self._writeback_s

    def _writeback(self, evicted: tuple[int, int], step: int, at: float, seq: int) -> Transfer:
        return Transfer(evicted[0], evicted[1], 0, 0, "writeback", seq, at, step, None, None, -1, 0, False,
                        self._writeback_seconds())

    def _stage(self, layer: int, experts: list[int], step: int, at: float) -> dict[int, Transfer]:
        """Copies of streamed experts into the free staging buffers, submitted together at ``at`` (as
        :meth:`_submit` would one by one), by expert."""
        nbytes, seq = self.costs.expert_bytes, self._seq
        staged = {}
        for e in experts:
            seq += 1
            staged[e] = new_transfer(layer, e, nbytes, 0, "stage", seq, at, step)
        self._seq = seq
        self.pcie.submit_demands(list(staged.values()), at)
        return staged

    def _submit(self, layer: int, expert: int, kind: str, step: int, at: float) -> Transfer:
        self._seq += 1
        transfer = new_transfer(layer, expert, self.costs.expert_bytes, 1 if kind == "prefetch" else 0, kind,
                            self._seq, at, step)
        if kind != "stage":
            self.cache.start_load(layer, expert)
            self.pending[layer][expert] = transfer
        self.pcie.submit(transfer)
        return transfer

    def _prefetch(self, plan: LayerPlan, s: int, layer: int, at: float) -> None:
        """The plan's prefetches, queued in plan order at ``at`` (as :meth:`_submit` would, one call)."""
        cache, pending, prefetched, decisions = self.cache, self.pending, self.prefetched, self.decisions
        resident, in_flight, capacity = cache.resident, cache.in_flight, cache.capacity
        pooled = cache.pool is not None
        nbytes, seq = self.costs.expert_bytes, self._seq
        batch = []
        for lay, e in plan.prefetches:
            seq += 1
            held, flying = resident[lay], in_flight[lay]
            if pooled or e in held or e in flying or len(held) + len(flying) >= capacity[lay]:
                cache.start_load(lay, e)  # the pool's checks, or the refusal that names the fault
            else:  # CacheState.start_load, inline: its checks pass
                flying.add(e)
            pending[lay][e] = transfer = new_transfer(lay, e, nbytes, 1, "prefetch", seq, at, s)
            batch.append(transfer)
            prefetched[lay].add(e)
            if decisions is not None:
                decisions.append((s, layer, e, "prefetch", lay))
        self._seq = seq
        self.pcie.submit_prefetches(batch, at)

    def _count_cancelled(self, transfer: Transfer) -> None:
        """Count a prefetch dropped before its copy started; one whose expert was routed while it waited (it
        left the prefetched set when used) is counted apart, for the precision of the copies that ran."""
        self.counters.cancelled_prefetches += 1
        if transfer.expert not in self.prefetched[transfer.layer]:
            self.counters.cancelled_used += 1

    def _cancel_prefetches(self, t: float, keep: frozenset, step: int, layer: int) -> None:
        """Drop prefetches not yet started by ``t`` (but those in ``keep``); their slots free up again, and the
        decision log says so (``cancel``) at ``step`` and ``layer``, the plan that dropped them."""
        for transfer in self.pcie.cancel_queued(t, kind="prefetch", keep=keep):
            if self.decisions is not None:
                self.decisions.append((step, layer, transfer.expert, "cancel", transfer.layer))
            self.pending[transfer.layer].pop(transfer.expert, None)
            self.cache.in_flight[transfer.layer].discard(transfer.expert)
            self._count_cancelled(transfer)
            self.prefetched[transfer.layer].discard(transfer.expert)
