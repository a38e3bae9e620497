"""PCIe host-to-device copy engines, advanced lazily by the forward pass (moesim.sim.engine).

Demand loads overtake queued prefetches but never a transfer already running
(unless copies are issued in chunks); copies read host DRAM and are slowed where
CPU experts share it (moesim.sim.dram).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from moesim.sim.dram import Lane, Ledger, stretch


@dataclass(eq=False, slots=True)
class Transfer:
    layer: int
    expert: int
    nbytes: int
    priority: int  # 0 demand, 1 prefetch
    kind: str  # "load", "prefetch", "stage", "chunk" (a preempted prefetch's done part), "writeback"
    seq: int
    issued: float
    step: int = -1
    start: float | None = None
    end: float | None = None
    #: place in the prefetch queue (counts from the queue's first ever entry)
    queued_at: int = -1
    engine: int = 0
    retired: bool = False
    #: copy time when it is not ``duration(nbytes)``: a device-to-host write-back (``nbytes`` 0: no H2D bytes)
    seconds: float = 0.0
    #: seconds the engine stays busy after ``end`` with the write-back of ``evicted`` (the expert whose slot
    #: this load takes): the pair is one engine job, while the loaded expert is ready at ``end``
    tail: float = 0.0
    evicted: tuple[int, int] | None = None
    #: a preempted prefetch's rest: an engine has copied its first chunks (kind ``chunk``), so it has started
    cut: bool = False


def new_transfer(layer: int, expert: int, nbytes: int, priority: int, kind: str, seq: int, issued: float,
                 step: int) -> Transfer:
    """``Transfer(layer, expert, nbytes, priority, kind, seq, issued, step)``, its fields set without calling
    the class: every copy makes one, and calling a dataclass costs several times as much as setting its slots."""
    transfer = _new_transfer(Transfer)
    transfer.layer = layer
    transfer.expert = expert
    transfer.nbytes = nbytes
    transfer.priority = priority
    transfer.kind = kind
    transfer.seq = seq
    transfer.issued = issued
    transfer.step = step
    transfer.start = None
    transfer.end = None
    transfer.queued_at = -1
    transfer.engine = 0
    transfer.retired = False
    transfer.seconds = 0.0
    transfer.tail = 0.0
    transfer.evicted = None
    transfer.cut = False
    return transfer


_new_transfer = object.__new__


class CopyEngines:
    """Host-to-device copy engines: demand transfers first, then prefetches in order; advanced lazily.

    Transfers are submitted at non-decreasing times. Demand transfers are placed
    on an engine at once: no later submission can overtake them, and they go
    ahead of every queued prefetch. Prefetches wait in a FIFO queue (all have
    the same priority, so submission order is service order), and
    :meth:`advance` starts every queued prefetch that an engine falling idle at
    or before ``t`` picks. A transfer already running is not preempted, except
    with ``chunk_bytes`` > 0: a copy is then issued in chunks of that size, and
    a demand transfer overtakes a running prefetch at its next chunk boundary
    (the prefetch's rest goes back to the head of the queue).

    A transfer reads pinned host memory; against CPU work already laid out in
    ``ledger`` it is slowed by DRAM sharing (moesim.sim.dram). Entries of
    ``unretired`` whose end no longer matches their transfer's are stale (the
    transfer was re-laid) and skipped. A load's ``tail`` (its write-back) keeps
    the engine busy after the load is retired; ``tails`` holds, per engine, the
    last retired transfer with one, the only one whose tail may still run.

    :meth:`lanes_from` starts the queue up to the CPU's start, which can lie past
    the time of a demand copy issued afterwards (a staging copy whose buffer
    frees while CPU work runs on); such a demand takes back the prefetches placed
    to start after its issue (:meth:`_take_back`), as engines run in time order
    would not have started them yet.
    """

    def __init__(self, duration: Callable[[int], float], engines: int, ledger: Ledger | None = None,
                 combined_bps: float = float("inf"), chunk_bytes: int = 0) -> None:
        self._duration = duration
        self._durations: dict[int, float] = {}
        self.free = [0.0] * engines
        self.last: list[Transfer | None] = [None] * engines
        self.queue: deque[Transfer] = deque()
        self._head = 0  # queued_at of the queue's first entry
        self._tail = 0  # queued_at the next entry gets
        self.unretired: list[tuple[float, int, Transfer]] = []
        self.busy_s = 0.0
        self.bytes = 0
        self.ledger = ledger
        self.combined_bps = combined_bps
        self.chunk_bytes = chunk_bytes
        self.preemptions = 0
        self.tails: list[Transfer | None] = [None] * engines
        #: no placed prefetch starts later than this (an upper bound: one placed and since retired may set it)
        self.latest_prefetch_start = -math.inf

    def duration(self, nbytes: int) -> float:
        value = self._durations.get(nbytes)
        if value is None:
            value = self._durations[nbytes] = self._duration(nbytes)
        return value

    def _engine(self) -> int:
        free = self.free
        return 0 if len(free) == 1 else min(range(len(free)), key=free.__getitem__)

    def submit(self, transfer: Transfer) -> None:
        if transfer.priority == 0:
            self.submit_demands([transfer], transfer.issued)
        else:
            self.submit_prefetches([transfer], transfer.issued)

    def submit_prefetches(self, transfers: list[Transfer], at: float) -> None:
        """Several prefetches issued at ``at``, queued in order behind the queued ones (one advance starts the
        queued ones and then these, in order, as advancing before queueing them would)."""
        tail = self._tail
        for transfer in transfers:
            transfer.queued_at = tail
            tail += 1
        self._tail = tail
        self.queue.extend(transfers)
        self.advance(at)

    def submit_demands(self, transfers: list[Transfer], at: float) -> None:
        """Several demand transfers issued at ``at``, in order (see :meth:`submit`)."""
        if self.queue:
            self.advance(at)
        if self.latest_prefetch_start > at:
            self._take_back(at)
        free = self.free
        ledger = self.ledger
        if len(free) == 1 and not self.chunk_bytes and not (ledger is not None and ledger.intervals
                                                            and ledger.intervals[-1][1] > at):
            self._begin_in_turn(transfers, at)
            return
        for transfer in transfers:
            i = 0 if len(free) == 1 else min(range(len(free)), key=free.__getitem__)
            if self.chunk_bytes and free[i] > at:
                self._preempt(i, at)
            self._begin(i, transfer, free[i] if free[i] > at else at)

    def _preempt(self, i: int, at: float) -> None:
        """Cut engine ``i``'s running prefetch at its first chunk boundary after ``at``; requeue its rest."""
        running = self.last[i]
        if running is None or running.priority != 1 or running.start is None or running.end is None \
                or not running.start < at < running.end:
            return
        chunk = self.duration(min(self.chunk_bytes, running.nbytes))
        done_chunks = math.ceil((at - running.start) / chunk - 1e-9)
        boundary = running.start + done_chunks * chunk
        rest = running.nbytes - done_chunks * self.chunk_bytes
        if rest <= 0 or boundary >= running.end:
            return
        self.preemptions += 1
        self.busy_s -= running.end - boundary
        self.bytes -= rest
        part = Transfer(running.layer, running.expert, running.nbytes - rest, 1, "chunk", running.seq,
                        running.issued, running.step, running.start, boundary, engine=i)
        # keyed apart from its parent's entries: a stale one of the parent can end at this very boundary, and
        # the same (time, seq) would make the heap compare two transfers
        heapq.heappush(self.unretired, (boundary, -1 - part.seq, part))
        running.nbytes, running.start, running.end, running.issued = rest, None, None, boundary
        running.cut = True
        self._head -= 1
        running.queued_at = self._head
        self.queue.appendleft(running)
        self.free[i] = boundary
        self.last[i] = None

    def _take_back(self, at: float) -> None:
        """Return to the head of the queue, in queue order, the prefetches placed to start after ``at``: a
        look-ahead (:meth:`lanes_from`) started them, and a demand issued at ``at`` goes ahead of them (a
        cancellation at ``at`` drops them: :meth:`cancel_queued`).

        Each engine is free again from the end of the work it keeps (``at`` at the earliest); the DRAM
        sharing :func:`~moesim.sim.dram.share` applied to the prefetches taken back is dropped with them
        (the CPU work laid out beside them is not revised, as for any copy issued after it). A prefetch's
        done part cut off at a chunk boundary (kind ``chunk``) stays: it is copied, not queued work."""
        live = {id(x): x for end, _, x in self.unretired if x.end == end and not x.retired}
        back, kept = [], []
        for x in live.values():
            later = x.priority == 1 and x.kind != "chunk" and x.start > at  # type: ignore[operator]
            (back if later else kept).append(x)
        self.latest_prefetch_start = max((x.start for x in kept if x.priority == 1),  # type: ignore[type-var]
                                         default=-math.inf)
        if not back:
            return
        gone = {id(x) for x in back}
        self.unretired = [entry for entry in self.unretired if id(entry[2]) not in gone]
        heapq.heapify(self.unretired)
        for i in {x.engine for x in back}:
            mine = [x for x in kept if x.engine == i]
            ends = [x.end + x.tail for x in mine]  # type: ignore[operator]
            retired = self.tails[i]
            if retired is not None:  # a retired load's write-back may still run
                ends.append(retired.end + retired.tail)  # type: ignore[operator]
            self.free[i] = max([at, *ends])
            self.last[i] = max(mine, key=lambda x: x.start) if mine else None  # type: ignore[arg-type,return-value]
        back.sort(key=lambda x: x.queued_at)
        for x in back:
            self.busy_s -= x.end - x.start  # type: ignore[operator]
            self.bytes -= x.nbytes
            x.start = x.end = None
        self.queue.extendleft(reversed(back))
        self._head -= len(back)
        for place, x in enumerate(self.queue):  # the places estimate_end counts from
            x.queued_at = self._head + place

    def _begin(self, i: int, transfer: Transfer, start: float) -> None:
        transfer.start = start
        transfer.engine = i
        duration = transfer.seconds or self.duration(transfer.nbytes)
        ledger = self.ledger
        if transfer.nbytes and ledger is not None and ledger.intervals and ledger.intervals[-1][1] > start:
            duration = stretch(start, duration, transfer.nbytes / duration, ledger, self.combined_bps) - start
        transfer.end = end = start + duration
        self.free[i] = end + transfer.tail
        self.last[i] = transfer
        self.busy_s += duration
        if transfer.tail:  # added apart: the same sum as when the write-back was a transfer of its own
            self.busy_s += transfer.tail
        self.bytes += transfer.nbytes
        heapq.heappush(self.unretired, (transfer.end, transfer.seq, transfer))

    def _begin_in_turn(self, transfers: list[Transfer], at: float) -> None:
        """:meth:`_begin` of each transfer in turn on the one engine, from ``at``, when no CPU work in the
        DRAM ledger reaches past ``at`` (nothing to stretch them): the common case of every cache miss."""
        t = self.free[0]
        if t < at:
            t = at
        busy, nbytes = self.busy_s, self.bytes
        durations, unretired, push = self._durations, self.unretired, heapq.heappush
        for transfer in transfers:
            transfer.start = t
            duration = transfer.seconds or durations.get(transfer.nbytes) or self.duration(transfer.nbytes)
            transfer.end = t = t + duration
            busy += duration
            nbytes += transfer.nbytes
            push(unretired, (t, transfer.seq, transfer))
            if transfer.tail:
                t += transfer.tail
                busy += transfer.tail
        self.free[0] = t
        self.last[0] = transfers[-1] if transfers else self.last[0]
        self.busy_s, self.bytes = busy, nbytes

    def idle_at(self, at: float) -> bool:
        """Whether demand copies issued at ``at`` have the one engine to themselves, whole, with nothing
        queued, running or unretired, and no CPU work in the DRAM ledger reaching past ``at`` (nothing to
        stretch them): :meth:`lay_demands` may lay them out."""
        ledger = self.ledger
        return len(self.free) == 1 and not self.chunk_bytes and not self.queue and not self.unretired \
            and not (ledger is not None and ledger.intervals and ledger.intervals[-1][1] > at)

    def lay_demands(self, count: int, nbytes: int, at: float, tails: int, tail: float) -> tuple[float, list[float]]:
        """(first start, ends) of ``count`` demand copies of ``nbytes`` issued at ``at`` when :meth:`idle_at`,
        the first ``tails`` each followed by a write-back of ``tail`` seconds (a later copy starts where the
        one before it and its tail end): :meth:`_begin_in_turn`'s schedule, busy time and bytes, with no
        :class:`Transfer` placed (the caller retires them itself)."""
        start = t = self.free[0] if self.free[0] > at else at
        duration = self._durations.get(nbytes) or self.duration(nbytes)
        busy = self.busy_s
        ends = []
        for i in range(count):
            t = t + duration
            ends.append(t)
            busy += duration
            if i < tails:
                t += tail
                busy += tail
        self.free[0] = t
        self.last[0] = None  # read when a running copy is cut into chunks, which this engine set never does
        self.busy_s = busy
        self.bytes += nbytes * count
        return start, ends

    def relay(self, transfer: Transfer, start: float, end: float) -> None:
        """Move a placed transfer to [start, end) (DRAM sharing slowed it); its old heap entry goes stale."""
        self.busy_s += (end - start) - (transfer.end - transfer.start)  # type: ignore[operator]
        transfer.start, transfer.end = start, end
        if transfer.priority == 1 and start > self.latest_prefetch_start:
            self.latest_prefetch_start = start
        heapq.heappush(self.unretired, (end, transfer.seq, transfer))

    def relay_tail(self, transfer: Transfer, end: float) -> None:
        """Move the end of ``transfer``'s write-back tail to ``end`` (DRAM sharing slowed it)."""
        tail = end - transfer.end  # type: ignore[operator]
        self.busy_s += tail - transfer.tail
        transfer.tail = tail

    def lanes_from(self, t: float) -> list[Lane]:
        """Each engine's work from ``t`` as a :class:`~moesim.sim.dram.Lane` for :func:`~moesim.sim.dram.share`:
        transfers running or placed, write-back tails, and the queued ones where they would go (simulated for
        their draw on DRAM only; the engine places them itself later)."""
        self.advance(t)
        lanes = [Lane(free=t) for _ in self.free]
        for done in self.tails:  # a retired load's write-back still running
            if done is not None and done.end + done.tail > t:  # type: ignore[operator]
                lanes[done.engine].jobs.append([t, done.end + done.tail - t, 0.0, ("tail", done)])
        placed = sorted((x for end, _, x in self.unretired if end > t and x.end == end), key=lambda x: x.start)
        for x in placed:
            running = x.start < t  # type: ignore[operator]
            work = x.end - t if running else x.seconds or self.duration(x.nbytes)  # type: ignore[operator]
            rate = x.nbytes / self.duration(x.nbytes) if x.nbytes else 0.0  # a write-back reads no host DRAM
            lanes[x.engine].jobs.append([t if running else x.start, work, rate, x])
            if x.tail:
                lanes[x.engine].jobs.append([x.end, x.tail, 0.0, ("tail", x)])
        free = [max(t, lane.jobs[-1][0] + lane.jobs[-1][1]) if lane.jobs else t for lane in lanes]
        for x in self.queue:
            i = min(range(len(free)), key=free.__getitem__)
            d = self.duration(x.nbytes)
            lanes[i].jobs.append([max(free[i], x.issued), d, x.nbytes / d, None])
            free[i] = max(free[i], x.issued) + d
        return lanes

    def relay_laid(self, laid: list[list[tuple]], t: float) -> None:
        """Move the transfers and tails of :meth:`lanes_from` to where :func:`~moesim.sim.dram.share` laid them."""
        for i, lane in enumerate(laid):
            for transfer, a, b in lane:
                if isinstance(transfer, tuple):  # a write-back tail: it follows its load, wherever that ended
                    load = transfer[1]
                    if abs(b - (load.end + load.tail)) > 1e-12:
                        self.relay_tail(load, b)
                    self.free[i] = max(self.free[i], b)
                elif transfer is not None and abs(b - transfer.end) > 1e-12:
                    # one running at t keeps its start; a later one starts when the lane reaches it
                    self.relay(transfer, transfer.start if transfer.start < t else a, b)
                    self.free[i] = max(self.free[i], b)

    def advance(self, t: float) -> None:
        queue, free = self.queue, self.free
        if len(free) == 1:  # one engine: no choosing (the common case, as every profile has it)
            ledger, durations = self.ledger, self._durations
            while queue:
                transfer = queue[0]
                issued = transfer.issued
                start = free[0] if free[0] > issued else issued
                if start > t:
                    return
                self._head += 1
                queue.popleft()
                if start > self.latest_prefetch_start:
                    self.latest_prefetch_start = start
                if ledger is not None and ledger.intervals and ledger.intervals[-1][1] > start:
                    self._begin(0, transfer, start)  # CPU work may stretch it
                    continue
                # _begin with nothing to stretch it, inline: this runs for every prefetch
                transfer.start = start
                transfer.engine = 0
                duration = transfer.seconds or durations.get(transfer.nbytes) or self.duration(transfer.nbytes)
                transfer.end = end = start + duration
                free[0] = end + transfer.tail
                self.last[0] = transfer
                self.busy_s += duration
                if transfer.tail:  # added apart, as _begin adds it
                    self.busy_s += transfer.tail
                self.bytes += transfer.nbytes
                heapq.heappush(self.unretired, (end, transfer.seq, transfer))
            return
        while queue:
            i = self._engine()
            start = free[i] if free[i] > queue[0].issued else queue[0].issued
            if start > t:
                return
            self._head += 1
            self._begin(i, queue.popleft(), start)
            if start > self.latest_prefetch_start:
                self.latest_prefetch_start = start

    def cancel_queued(self, t: float, kind: str, keep: frozenset = frozenset()) -> list[Transfer]:
        """Remove the transfers of ``kind`` that no engine has started by ``t``, except (layer, expert) in ``keep``
        (a preempted prefetch's rest has started: its first chunks are copied)."""
        self.advance(t)
        if self.latest_prefetch_start > t:  # a look-ahead started some after ``t``: not started by then
            self._take_back(t)
        dropped = [x for x in self.queue if x.kind == kind and not x.cut and (x.layer, x.expert) not in keep]
        if dropped:
            gone = set(map(id, dropped))
            self.queue = deque(x for x in self.queue if id(x) not in gone)
            for place, x in enumerate(self.queue):
                x.queued_at = place
            self._head, self._tail = 0, len(self.queue)
        return dropped

    def finish(self, transfer: Transfer) -> float:
        """End time of ``transfer``, starting queued work as the engines free up."""
        while transfer.end is None:
            self.advance(min(self.free))
        return transfer.end

    def busy_until(self, horizon: float) -> tuple[float, int]:
        """Busy seconds and bytes of transfers started before ``horizon``, cut at it.

        Prefetches still queued or running when the last token is out are work the
        run did not need; only their part inside the run counts. Call after every
        transfer ending by ``horizon`` was retired.
        """
        self.advance(horizon)
        busy, nbytes = self.busy_s, self.bytes
        tails, running = self.past(horizon)
        for retired in tails:
            busy -= retired.end + retired.tail - max(retired.end, horizon)  # type: ignore[operator]
        for transfer in running:
            start = transfer.start if transfer.start is not None else horizon
            busy -= transfer.end + transfer.tail - max(start, horizon)  # type: ignore[operator]
            if start >= horizon:
                nbytes -= transfer.nbytes
        return busy, nbytes

    def past(self, horizon: float) -> tuple[list[Transfer], list[Transfer]]:
        """What runs past ``horizon``: retired loads whose write-back does, and the unretired transfers ending
        after it (each once; a heap entry of a transfer re-laid since is stale)."""
        tails = [t for t in self.tails if t is not None and t.end + t.tail > horizon]  # type: ignore[operator]
        seen: set[int] = set()
        running = []
        for end, _, transfer in self.unretired:
            if end > horizon and transfer.end == end and id(transfer) not in seen:
                seen.add(id(transfer))
                running.append(transfer)
        return tails, running

    def estimate_end(self, transfer: Transfer) -> float:
        """End of a started transfer, or when it would end if nothing else were submitted.

        Call after :meth:`advance` up to now, so that every queued transfer starts
        later than now. With one engine and transfers of equal size (expert
        loads) this is a closed form; otherwise the queue ahead is replayed.
        """
        if transfer.end is not None:
            return transfer.end
        ahead = transfer.queued_at - self._head
        if len(self.free) == 1 and len(self._durations) == 1:
            return self.free[0] + (ahead + 1) * self.duration(transfer.nbytes)
        free = list(self.free)
        for queued in list(self.queue)[:ahead + 1]:
            i = min(range(len(free)), key=free.__getitem__)
            free[i] = max(free[i], queued.issued) + self.duration(queued.nbytes)
        return free[i]

    def estimate_ends(self, experts: set[int], pending: dict[int, Transfer]) -> dict[int, float]:
        """:meth:`estimate_end` of the transfer ``pending[e]`` of each of ``experts`` (a layer's loads in flight,
        ``pending`` that layer's transfers by expert), by expert; the closed form of one engine and one copy
        size is taken inline."""
        durations, head, out = self._durations, self._head, {}
        one_engine = len(self.free) == 1
        for expert in experts:
            transfer = pending[expert]
            end = transfer.end
            if end is None:
                # checked per transfer: estimate_end of a new copy size below adds it to ``durations``
                duration = durations.get(transfer.nbytes) if one_engine and len(durations) == 1 else None
                end = self.free[0] + (transfer.queued_at - head + 1) * duration if duration is not None \
                    else self.estimate_end(transfer)
            out[expert] = end
        return out
