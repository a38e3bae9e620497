"""A small stand-in for ``torch.cuda`` streams and events, so that the real backend's CUDA branches run on a
machine without a GPU (tests/backends/test_cuda_paths.py).

Work runs eagerly on the host, as it is issued; what the fake keeps is CUDA's rules around it:

* an event is *complete* only once the host has learnt so: ``synchronize()`` or ``query()`` on it, a
  synchronize of its stream or of the device, or a later event of its stream (or of a stream that waited
  for it) completing; ``elapsed_time`` on an event that is not complete (or never recorded) raises, as
  ``cudaEventElapsedTime`` does;
* ``Stream.wait_event`` on an event never recorded raises (CUDA would wait for nothing);
* each event remembers the stream it was recorded on, and streams are per thread (``torch.cuda.stream``).

Tensors stay on the CPU: the executor under test keeps its CPU device with ``cuda`` set, and pinned memory
is the tensor itself.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

_lock = threading.RLock()
_local = threading.local()


class FakeStream:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self.last: FakeEvent | None = None  # the last event recorded here
        self.waited: list[FakeEvent] = []  # waited for since the last record
        self.events: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        if event.time is None:
            raise RuntimeError("wait_event on an event that was never recorded: the stream would not wait")
        with _lock:
            self.waited.append(event)

    def wait_stream(self, other: FakeStream) -> None:
        if other.last is not None:
            self.wait_event(other.last)

    def synchronize(self) -> None:
        with _lock:
            for event in list(self.events):
                event._complete()

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


DEFAULT = FakeStream("default")


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.time: float | None = None
        self.stream: FakeStream | None = None
        self.before: list[FakeEvent] = []
        self.complete = False

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or current_stream()
        with _lock:
            assert self.time is None, "an event recorded twice"
            self.time, self.stream = time.perf_counter(), stream
            self.before = stream.waited + ([stream.last] if stream.last is not None else [])
            stream.waited, stream.last = [], self
            stream.events.append(self)

    def _complete(self) -> None:
        todo = [self]
        while todo:
            event = todo.pop()
            if not event.complete:
                event.complete = True
                todo += event.before

    def query(self) -> bool:
        with _lock:
            if self.time is not None:
                self._complete()
        return True

    def synchronize(self) -> None:
        self.query()

    def elapsed_time(self, end: FakeEvent) -> float:
        for event in (self, end):
            if not event.enable_timing:
                raise RuntimeError("elapsed_time on an event without timing")
            if event.time is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time.")
            if not event.complete:
                raise RuntimeError("CUDA error: device not ready (elapsed_time before the event completed)")
        return (end.time - self.time) * 1e3


def current_stream(device=None) -> FakeStream:
    return getattr(_local, "stream", DEFAULT)


@contextmanager
def stream(s: FakeStream):
    previous = current_stream()
    _local.stream = s
    try:
        yield
    finally:
        _local.stream = previous


def synchronize(device=None) -> None:
    with _lock:
        for s in list(_STREAMS) + [DEFAULT]:
            s.synchronize()


_STREAMS: list[FakeStream] = []


def _new_stream(*args, **kwargs) -> FakeStream:
    s = FakeStream(f"stream{len(_STREAMS)}")
    _STREAMS.append(s)
    return s


def install(monkeypatch) -> None:
    """Replace torch.cuda's streams, events and syncs with the fakes, and pinning with a no-op, for one test."""
    _STREAMS.clear()
    for name, value in (("Event", FakeEvent), ("Stream", _new_stream), ("stream", stream),
                        ("current_stream", current_stream), ("synchronize", synchronize)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    for name in ("zeros", "empty"):
        original = getattr(torch, name)

        def unpinned(*args, _original=original, pin_memory=False, **kwargs):
            return _original(*args, **kwargs)
        monkeypatch.setattr(torch, name, unpinned)
