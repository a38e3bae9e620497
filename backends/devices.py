"""Streams, work handles and the copy engine the real backend runs on: CUDA, or a CPU stand-in.

Two implementations of one small interface:

* CUDA: a compute stream and a dedicated copy stream; every piece of work is
  bracketed by CUDA events, which give its device-side start and end.
* CPU stand-in (``--device cpu``): the "GPU stream" is one thread that runs
  submitted closures in order, and the copy engine copies between two host
  buffers with a plain memcpy, unthrottled. Intervals come from the host
  clock. Nothing is slowed down to look like a PCIe link: the point of this
  mode is to exercise the whole loop (and the policies' decisions) without a
  GPU, not to imitate one.

The CPU expert pool is a :class:`HostStream` in both modes: one worker thread
running experts one after another, each on torch's intra-op thread pool.
All times are seconds since the :class:`Clock` origin.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


#: GIL hand-over interval during real runs and profiling: the streams, the copy engine and the CPU
#: pool are Python threads, and the default 5 ms would put milliseconds into every hand-off
SWITCH_INTERVAL_S = 50e-6


@contextlib.contextmanager
def fast_thread_switching() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def allowed_cpus() -> list[int]:
    """CPUs this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@contextlib.contextmanager
def host_threads(threads: int) -> Iterator[None]:
    """``threads`` torch intra-op threads and fast GIL hand-over, for a real run or a profile.

    Profile and real run execute under the same set-up, so a curve measured
    by the profiler describes the kernels the backend runs. The process is
    not pinned to a subset of its CPUs: the GPU stand-in, the CPU pool and
    the copy engine are threads of their own and must be free to run on
    different cores (pinned together, work the simulator overlaps would take
    turns on one core).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with fast_thread_switching():
            yield
    finally:
        torch.set_num_threads(previous)


class Clock:
    """Host clock with an origin; on CUDA also a device origin event recorded at the same moment."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.origin_event: torch.cuda.Event | None = None
        self.reset()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.origin_event = torch.cuda.Event(enable_timing=True)
            self.origin_event.record()
            self.origin_event.synchronize()
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def device_time(self, event: "torch.cuda.Event") -> float:
        assert self.origin_event is not None
        return self.origin_event.elapsed_time(event) / 1e3


class Work:
    """Something queued on a stream, the CPU pool or the copy engine."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        """Block the calling host thread until the work has finished."""
        raise NotImplementedError

    def gate(self, stream: Any) -> None:
        """Make later work on CUDA ``stream`` wait for this one (host-side wait where needed)."""
        self.wait()

    def interval(self) -> tuple[float, float]:
        """(start, end) in seconds since the clock origin; only once done."""
        raise NotImplementedError


@dataclass(eq=False)
class HostWork(Work):
    start: float = 0.0
    end: float = 0.0
    future: Future | None = None
    event: threading.Event = field(default_factory=threading.Event)

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.future is not None:
            self.future.result()  # re-raises a failure of the closure in the caller

    def interval(self) -> tuple[float, float]:
        return self.start, self.end


class HostStream:
    """A thread that runs closures in submission order: the CPU pool, and the GPU stand-in."""

    def __init__(self, clock: Clock, name: str) -> None:
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def launch(self, fn: Callable[[], None], waits: tuple[Work, ...] = ()) -> HostWork:
        work = HostWork()
        clock = self.clock

        def run() -> None:
            try:
                for w in waits:
                    w.wait()
                work.start = clock.now()
                fn()
                work.end = clock.now()
            finally:
                work.event.set()

        work.future = self._pool.submit(run)
        return work

    def synchronize(self) -> None:
        self.launch(lambda: None).wait()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(eq=False)
class CudaWork(Work):
    clock: Clock
    start_event: Any
    end_event: Any

    def done(self) -> bool:
        return bool(self.end_event.query())

    def wait(self) -> None:
        self.end_event.synchronize()

    def gate(self, stream: Any) -> None:
        stream.wait_event(self.end_event)

    def interval(self) -> tuple[float, float]:
        return self.clock.device_time(self.start_event), self.clock.device_time(self.end_event)


class CudaStream:
    """A CUDA stream whose launches are bracketed by timing events."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.stream = torch.cuda.Stream()

    def launch(self, fn: Callable[[], None], waits: tuple[Work, ...] = ()) -> CudaWork:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            for w in waits:
                w.gate(self.stream)
            start.record(self.stream)
            fn()
            end.record(self.stream)
        return CudaWork(self.clock, start, end)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.synchronize()


# ----------------------------------------------------------------------------- copy engine
@dataclass(eq=False)
class Transfer(Work):
    """One copy: host expert weights into a GPU slot or staging buffer (or the stand-ins of both)."""

    dst: torch.Tensor
    src: torch.Tensor
    priority: int  # 0 demand load or staging, 1 prefetch
    kind: str  # "load", "prefetch", "stage"
    layer: int
    expert: int
    step: int
    seq: int
    #: work that must finish before the destination may be overwritten (its previous user)
    after: Work | None = None
    #: work that must finish before the copy may start at all (a plan's "prefetch after the GPU experts")
    not_before: Work | None = None
    issued: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    start_s: float = 0.0
    end_s: float = 0.0
    start_event: Any = None
    end_event: Any = None
    clock: Clock | None = None
    error: BaseException | None = None
    #: elements copied so far by a chunked copy (``CopyEngine.chunk_bytes``) that a demand copy preempted
    offset: int = 0
    #: (start, end) of each part a demand copy cut off, then requeued (timeline kind "chunk"); the copy's own
    #: interval is its last part's
    parts: list = field(default_factory=list)
    #: elements copied within each of ``parts``
    part_elements: list = field(default_factory=list)
    #: work launched on the compute stream waits for this copy: it has landed by the time any work launched
    #: there later ends (the next layer's attention, which the simulator plans after)
    awaited: bool = False
    #: copies issued right behind this one, before any other queued copy (write-backs riding on a load)
    tails: list = field(default_factory=list)
    #: set by the engine once it no longer looks at ``tails``
    tails_closed: bool = False

    def __lt__(self, other: "Transfer") -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)

    def ready(self) -> bool:
        return (self.after is None or self.after.done()) and (self.not_before is None or self.not_before.done())

    def done(self) -> bool:
        if self.end_event is not None:
            return self.issued.is_set() and bool(self.end_event.query())
        return self.finished.is_set()

    def wait(self) -> None:
        self.finished.wait()
        if self.error is not None:
            raise self.error

    def gate(self, stream: Any) -> None:
        if stream is None:  # a host-stream closure
            self.wait()
            return
        self.issued.wait()  # an unrecorded event would not be waited for at all
        if self.error is not None:
            raise self.error
        stream.wait_event(self.end_event)

    def interval(self) -> tuple[float, float]:
        if self.end_event is not None and self.clock is not None:
            return self.clock.device_time(self.start_event), self.clock.device_time(self.end_event)
        return self.start_s, self.end_s


class CopyEngine:
    """One copy at a time from a priority queue: demand loads overtake queued prefetches, never a running copy.

    A thread picks the most urgent queued transfer whose destination is free
    (its ``after`` work has finished), issues it and waits for it to complete
    before picking the next, as the simulator's copy engine does.
    """

    #: how often a thread with only blocked transfers looks again, seconds
    POLL_S = 50e-6

    def __init__(self, clock: Clock, cuda: bool, chunk_bytes: int = 0) -> None:
        self.clock = clock
        self.cuda = cuda
        #: > 0: copies go in chunks of this many bytes, and a ready demand copy overtakes a running prefetch
        #: at its next chunk boundary (``engine.copy_chunk_bytes``, as the simulator's copy engine does)
        self.chunk_bytes = max(chunk_bytes, 0)
        self.stream = torch.cuda.Stream() if cuda else None
        self._queue: list[Transfer] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        #: what stopped the engine's thread (a CUDA error surfacing in a readiness check): every copy queued then
        #: or submitted later fails with it, rather than leaving its waiter blocked for good
        self._failed: BaseException | None = None
        self.running: Transfer | None = None
        self._thread = threading.Thread(target=self._serve, name="moesim-copy", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, *, priority: int, kind: str, layer: int, expert: int,
               step: int, after: Work | None = None, not_before: Work | None = None) -> Transfer:
        transfer = Transfer(dst, src, priority, kind, layer, expert, step, next(self._seq), after, not_before,
                            clock=self.clock)
        with self._cond:
            self._enqueue(transfer)
        return transfer

    def _enqueue(self, transfer: Transfer) -> None:
        """Queue ``transfer`` (failed at once if the engine has stopped); holds ``_cond``."""
        heapq.heappush(self._queue, transfer)
        self._cond.notify()
        if self._failed is not None:
            self._fail_queued()

    def submit_tail(self, dst: torch.Tensor, src: torch.Tensor, behind: Transfer, *, kind: str, layer: int,
                    expert: int, step: int) -> Transfer:
        """A copy issued right after ``behind`` ends, ahead of every queued copy (a write-back is its load's
        tail on the engine, as the simulator places it); queued as urgent if ``behind`` has already ended."""
        transfer = Transfer(dst, src, 0, kind, layer, expert, step, next(self._seq), clock=self.clock)
        with self._cond:
            if not behind.tails_closed:
                behind.tails.append(transfer)
            else:
                self._enqueue(transfer)
        return transfer

    def cancel(self, kind: str, keep: frozenset = frozenset()) -> list[Transfer]:
        """Remove the queued (not started) transfers of ``kind``, but those whose (layer, expert) is in ``keep``
        and those compute waits for (``awaited``); they count as finished, never copied."""
        # not cancelled: a preempted copy's rest (its first chunks are on the device already), and a copy that
        # compute launched earlier waits for (in the simulator it has started by the time a later plan runs)
        with self._cond:
            dropped = [t for t in self._queue if t.kind == kind and (t.layer, t.expert) not in keep and not t.offset
                       and not t.awaited]
            gone = set(map(id, dropped))
            self._queue = [t for t in self._queue if id(t) not in gone]
            heapq.heapify(self._queue)
        for t in dropped:
            t.finished.set()
        return dropped

    def queued(self) -> list[Transfer]:
        """Transfers not yet started, most urgent first."""
        with self._cond:
            return sorted(self._queue)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _next(self) -> Transfer | None:
        with self._cond:
            while True:
                if self._closed and not self._queue:
                    return None
                ready = [t for t in self._queue if t.ready()]
                if ready:
                    chosen = min(ready)
                    self._queue.remove(chosen)
                    heapq.heapify(self._queue)
                    self.running = chosen
                    return chosen
                self._cond.wait(self.POLL_S if self._queue else None)

    def _serve(self) -> None:
        try:
            self._serve_queue()
        except BaseException as err:  # the engine itself failed: its waiters get the error, not a wait for good
            with self._cond:
                self._failed = err
                self._fail_queued()
            raise

    def _fail_queued(self) -> None:
        """Fail every queued copy (and the write-backs riding on it) with the engine's error; holds ``_cond``."""
        for t in self._queue:
            failed, t.tails, t.tails_closed = [t, *t.tails], [], True
            for f in failed:
                f.error = self._failed
                f.issued.set()
                f.finished.set()
        self._queue = []

    def _serve_queue(self) -> None:
        while (transfer := self._next()) is not None:
            if self._serve_one(transfer, chunked=bool(self.chunk_bytes)):
                continue  # preempted: back in the queue with its rest
            with self._cond:
                tails, transfer.tails, transfer.tails_closed = transfer.tails, [], True
            for tail in tails:  # write-backs riding on it: whole copies, nothing between them
                self._serve_one(tail)

    def _serve_one(self, transfer: Transfer, chunked: bool = False) -> bool:
        """Copy ``transfer`` (``chunked``: it may stop at a chunk boundary, returning True, and is not finished
        then); a failure goes to whoever waits for it."""
        self.running = transfer
        preempted = False
        try:
            if chunked:
                preempted = self._copy_chunks(transfer)
            else:
                self._copy(transfer)
        except BaseException as err:  # surfaced to whoever waits for the transfer
            transfer.error = err
            transfer.issued.set()
        finally:
            self.running = None
            if not preempted:
                transfer.finished.set()
        return preempted

    def _demand_waiting(self) -> bool:
        with self._cond:
            return any(t.priority == 0 and t.ready() for t in self._queue)

    def _copy_chunks(self, t: Transfer) -> bool:
        """Copy ``t`` from its offset in chunks; a prefetch that a ready demand copy is waiting behind stops at
        the next chunk boundary and goes back to the queue with its rest (returns True). The copy counts as
        issued once its last chunk is: a CUDA stream waiting for it waits for the whole copy. On CUDA the host
        waits at a prefetch's chunk boundaries only (where a demand copy may take over); a demand copy's chunks
        go onto the stream one after another."""
        dst, src = t.dst.view(-1), t.src.view(-1)
        total = src.numel()
        step = max(self.chunk_bytes // src.element_size(), 1)
        start_offset = t.offset
        if self.cuda:
            t.start_event, t.end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t.start_event.record(self.stream)
        else:
            t.start_s = self.clock.now()
        while t.offset < total:
            end = min(t.offset + step, total)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    dst[t.offset:end].copy_(src[t.offset:end], non_blocking=True)
                    if end == total:
                        t.end_event.record(self.stream)
                        t.issued.set()
                    elif t.priority > 0:  # a boundary a demand copy may take: this chunk has landed first
                        self.stream.synchronize()
            else:
                dst[t.offset:end].copy_(src[t.offset:end])
            t.offset = end
            if end < total and t.priority > 0 and self._demand_waiting():
                if self.cuda:
                    t.end_event.record(self.stream)
                    t.end_event.synchronize()
                    t.parts.append((t.clock.device_time(t.start_event), t.clock.device_time(t.end_event)))
                else:
                    t.parts.append((t.start_s, self.clock.now()))
                t.part_elements.append(end - start_offset)
                t.start_event = t.end_event = None
                with self._cond:
                    heapq.heappush(self._queue, t)  # its own seq: ahead of the prefetches queued after it
                return True
        if self.cuda:
            t.end_event.synchronize()
        else:
            t.issued.set()
            t.end_s = self.clock.now()
        return False

    def _copy(self, t: Transfer) -> None:
        if self.cuda:
            t.start_event, t.end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                t.start_event.record(self.stream)
                t.dst.copy_(t.src, non_blocking=True)
                t.end_event.record(self.stream)
            t.issued.set()
            t.end_event.synchronize()
        else:
            t.issued.set()
            t.start_s = self.clock.now()
            t.dst.copy_(t.src)
            t.end_s = self.clock.now()
