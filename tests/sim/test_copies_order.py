"""CopyEngines placed lazily give the schedule of engines run in simulated-time order, under the engine's
contract: submissions at non-decreasing times, and after :meth:`CopyEngines.finish` of a transfer nothing is
issued before that transfer's end (the GPU stream waits for it; tests/sim/test_engine_copy_order.py has the
case where the forward pass used to break this). :meth:`CopyEngines.lanes_from` (the CPU track placing the
copies beside it from its start) may start the queue past the time of copies issued afterwards: a demand among
them takes back the prefetches started after it."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from moesim.sim.copies import CopyEngines, Transfer

#: (what, gap since the previous operation in microseconds, bytes): a demand copy, a prefetch, the GPU
#: waiting for the oldest prefetch not yet finished, or the CPU track looking at the engines gap + bytes
#: microseconds ahead of the issue times (its start, while the copies issued after it are earlier)
OPS = st.lists(st.tuples(st.sampled_from(["demand", "prefetch", "finish", "ahead"]),
                         st.sampled_from([0, 0, 10, 50, 150]), st.sampled_from([100, 100, 40])),
               min_size=1, max_size=20)


def _replay(ops: list, engines: int) -> list[Transfer]:
    copies = CopyEngines(lambda n: n * 1e-6, engines)  # 1 us per byte
    placed: list[Transfer] = []
    waiting: list[Transfer] = []
    now = 0.0
    for seq, (what, gap, nbytes) in enumerate(ops):
        if what == "ahead":  # the issue time stays: the copies issued next come before the time it looks at
            copies.lanes_from(now + (gap + nbytes) * 1e-6)
            continue
        now += gap * 1e-6
        if what == "finish":
            if waiting:
                now = max(now, copies.finish(waiting.pop(0)))  # the GPU waits for it: later issues follow it
            continue
        transfer = Transfer(0, seq, nbytes, int(what == "prefetch"), "load" if what == "demand" else what, seq, now)
        copies.submit(transfer)
        placed.append(transfer)
        if what == "prefetch":
            waiting.append(transfer)
    copies.advance(float("inf"))
    return placed


@settings(max_examples=300, deadline=None)
@given(OPS, st.sampled_from([1, 2]))
# two prefetches, the GPU waits for both (the second starts at 100 us), then a demand: issued at 210 us, it
# follows them; issued at 10 us, as if the GPU had not waited, it would follow a prefetch started after it
@example([("prefetch", 0, 100), ("prefetch", 0, 100), ("finish", 0, 100), ("finish", 0, 100),
          ("demand", 10, 100)], 1)
# the CPU track looks at 150 us, which starts the second prefetch at 100 us; a demand issued at 50 us goes
# ahead of it (100-200 us, the prefetch 200-300 us), not behind it
@example([("prefetch", 0, 100), ("prefetch", 0, 100), ("ahead", 50, 100), ("demand", 50, 100)], 1)
def test_copies_run_as_time_ordered_engines_would(ops, engines):
    placed = _replay(ops, engines)
    for x in placed:  # no copy starts before it is issued
        assert x.start is not None and x.end is not None and x.start >= x.issued
    for engine in range(engines):  # an engine runs one copy at a time
        mine = sorted((x for x in placed if x.engine == engine), key=lambda x: x.start)
        for before, after in zip(mine, mine[1:]):
            assert after.start >= before.end - 1e-15
    demands = [x for x in placed if x.priority == 0]
    prefetches = [x for x in placed if x.priority == 1]
    for d in demands:  # a demand copy goes ahead of every prefetch no engine had started when it was issued
        for p in prefetches:
            if p.start > d.issued:
                assert d.start <= p.start + 1e-15
    for a, b in zip(prefetches, prefetches[1:]):  # prefetches start in submission order
        assert a.start <= b.start + 1e-15
