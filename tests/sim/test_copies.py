"""PCIe copy engines (moesim.sim.copies): arrival estimates of loads in flight."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moesim.sim.copies import CopyEngines, Transfer

#: (expert, bytes, prefetch?, gap since the previous submission in microseconds)
SUBMISSIONS = st.lists(st.tuples(st.integers(0, 15), st.sampled_from([100, 100, 100, 40]), st.booleans(),
                                 st.integers(0, 150)), min_size=1, max_size=12, unique_by=lambda s: s[0])


def _replay(submissions: list, engines: int, chunk: int) -> tuple[CopyEngines, dict]:
    """Engines advanced to the last submission, and the transfers (all of layer 0) by expert."""
    copies = CopyEngines(lambda n: n * 1e-6, engines, chunk_bytes=chunk)  # 1 us per byte
    pending, at = {}, 0.0
    for seq, (expert, nbytes, prefetch, gap) in enumerate(submissions):
        at += gap * 1e-6
        transfer = pending[expert] = Transfer(0, expert, nbytes, int(prefetch), "load", seq, at)
        copies.submit(transfer)
    copies.advance(at)
    return copies, pending


@settings(max_examples=150, deadline=None)
@given(SUBMISSIONS, st.sampled_from([1, 2]), st.sampled_from([0, 30]))
# a prefetch cut at 100 us, its original end: its done chunk and its stale entry once shared (time, seq)
@example([(1, 100, True, 0), (0, 40, False, 17), (2, 100, False, 54)], 1, 30)
def test_estimate_ends_is_estimate_end_of_each(submissions, engines, chunk):
    bulk, pending = _replay(submissions, engines, chunk)
    one_by_one, pending_again = _replay(submissions, engines, chunk)
    experts = set(pending)
    expected = {e: one_by_one.estimate_end(pending_again[e]) for e in experts}
    assert bulk.estimate_ends(experts, pending) == expected


def test_queued_prefetches_arrive_one_copy_apart():
    """One engine, equal copies: the k-th queued prefetch ends k copies after the engine frees."""
    copies = CopyEngines(lambda n: n * 1e-6, 1)
    pending = {e: Transfer(0, e, 100, 1, "prefetch", e, 0.0) for e in range(3)}
    copies.submit_prefetches(list(pending.values()), 0.0)
    demand = pending[9] = Transfer(0, 9, 100, 0, "load", 9, 10e-6)
    copies.submit_demands([demand], 10e-6)
    ends = copies.estimate_ends({0, 1, 2, 9}, pending)
    # prefetch 0 runs 0-100 us, the demand 100-200 us (it overtakes the queued ones), then 1 and 2
    assert ends == {0: pytest.approx(100e-6), 9: pytest.approx(200e-6), 1: pytest.approx(300e-6),
                    2: pytest.approx(400e-6)}
