"""The note a replay gets when its prefetches fell behind the forward pass (moesim.sim.engine)."""

from __future__ import annotations

import re
from pathlib import Path

from moesim.sim.engine import BACKLOG_STEPS
from moesim.sim.run import simulate

MIXTRAL = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")


def _backlog(notes: list[str]) -> list[str]:
    return [n for n in notes if "were still queued, never started" in n]


def test_prefetches_left_queued_steps_before_the_end_are_noted_with_how_many_and_since_when():
    """SMoE at a fifth of rtx4090's PCIe bandwidth: its token-wise prefetches queue faster than the link copies
    them, so copies issued steps earlier never started (a bigger cache then runs slower: a longer backlog, each
    queued copy holding the slot it evicted empty). The note says how many and the oldest one's step; at the
    profile's bandwidth the copies keep up and there is none."""
    slow = simulate(MIXTRAL, "rtx4090", "smoe", {"hw.pcie.bandwidth_scale": "0.2"})
    [note] = _backlog(slow.notes)
    count, oldest, last = map(int, re.search(r"(\d+) prefetches issued .* from step (\d+) of (\d+)", note).groups())
    assert last == slow.steps[-1].step and oldest < last - BACKLOG_STEPS
    # the noted copies are among those the run counts as never started
    assert 0 < count <= slow.counters.cancelled_prefetches
    assert note.startswith("smoe: ") and "fewer prefetches per layer" in note
    assert _backlog(simulate(MIXTRAL, "rtx4090", "smoe").notes) == []


def test_a_system_that_never_prefetches_gets_no_backlog_note():
    assert _backlog(simulate(MIXTRAL, "rtx4090", "gpu-only-lru", {"hw.pcie.bandwidth_scale": "0.05"}).notes) == []
