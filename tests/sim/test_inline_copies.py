"""The engine's inline forms of per-layer calls replay exactly as the calls they stand in for.

A prefetch's copy is made by ``new_transfer`` (not ``Transfer(...)``) and its slot checked inline
(``Transfers._prefetch``, not ``CacheState.start_load``); one copy engine begins a queued copy inline where no CPU work can stretch it
(``CopyEngines.advance``, not ``_begin``); a decode layer's GPU track skips the arrival checks where nothing
is on its way to the layer; a one-token CPU track reads the memoised DRAM rate rather than calling
``_contends``; a one-row decode view is made from the step's split rows (``Simulator._view``). Forcing each
call back must change no figure, no step's times, no copy-engine state and not even the order of the cache's
sets.
"""

from __future__ import annotations

import dataclasses
import heapq

import pytest

from moesim.policy.base import LayerPlan, LayerView
from moesim.sim.copies import CopyEngines, Transfer, new_transfer
from moesim.sim.engine import Simulator
from moesim.sim.run import prepare
from moesim.trace.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("inline") / "decode.parquet"
    config = SynthConfig.from_settings(model="deepseek-v2-lite", requests=2, prompt_len=6, decode_len=30,
                                       batch=1, seed=11, settings={}, scores=True)
    synthesize(config, path)
    return str(path)


def called_advance(self: CopyEngines, t: float) -> None:
    """``CopyEngines.advance`` as it was: each copy begun by ``_begin``."""
    queue, free = self.queue, self.free
    while queue:
        i = self._engine()
        start = free[i] if free[i] > queue[0].issued else queue[0].issued
        if start > t:
            return
        self._head += 1
        self._begin(i, queue.popleft(), start)
        if start > self.latest_prefetch_start:
            self.latest_prefetch_start = start


def called_prefetch(self: Simulator, plan: LayerPlan, s: int, layer: int, at: float) -> None:
    """``Transfers._prefetch`` as it was: the class called for each copy, ``start_load`` for each slot."""
    batch = []
    for lay, e in plan.prefetches:
        self._seq += 1
        self.cache.start_load(lay, e)
        self.pending[lay][e] = transfer = Transfer(lay, e, self.costs.expert_bytes, 1, "prefetch", self._seq, at, s)
        batch.append(transfer)
        self.prefetched[lay].add(e)
        if self.decisions is not None:
            self.decisions.append((s, layer, e, "prefetch", lay))
    if self.pcie.queue:
        self.pcie.advance(at)
    self.pcie.submit_prefetches(batch, at)


#: an expert id no layer has: an entry for it in every layer's copies in flight makes none look empty, so the
#: GPU track checks every expert's arrival (nothing asks for it, and nothing goes through the entries)
NO_EXPERT = -1


class NothingMemoised(dict):
    """DRAM rates that never say they are known: the CPU track calls ``_contends``."""

    def __contains__(self, key: object) -> bool:
        return False


def replay(trace: str, system: str, settings: dict[str, str], called: bool, monkeypatch) -> tuple:
    """A replay's figures, step times, copy-engine state and cache sets (as lists: their order too).
    ``settings`` ``loads=placed``: demand loads placed as transfers, never laid out at once, so that GPU
    experts of decode layers wait for copies in flight."""
    settings = dict(settings)
    placed = settings.pop("loads", "") == "placed"
    with monkeypatch.context() as patch:
        if placed:
            patch.setattr(CopyEngines, "idle_at", lambda self, at: False)
        if called:
            patch.setattr(CopyEngines, "advance", called_advance)
            patch.setattr(Simulator, "_prefetch", called_prefetch)
        sim = prepare(trace, "rtx4090", system, {"cache.slots_per_layer": "10", **settings})
        if called:
            sim.pending = [{NO_EXPERT: None} for _ in sim.pending]
            sim._cpu_rate = NothingMemoised()
            view = sim._view

            def viewed(step, layer, rows, phase, now):  # the inline view against one from layer_view's fields
                made = view(step, layer, rows, phase, now)
                for f in dataclasses.fields(LayerView):
                    getattr(made, f.name)  # every field set
                return made

            sim._view = viewed
        result = sim.run()
    pcie = sim.pcie
    engines = (pcie.free, pcie.busy_s, pcie.bytes, pcie._head, pcie._tail, pcie.latest_prefetch_start,
               [(x.layer, x.expert, x.start, x.end) for x in pcie.queue],
               sorted((end, seq) for end, seq, _ in pcie.unretired))
    return (dict(vars(result.counters)), [(r.step, r.start, r.end) for r in result.steps], result.pcie_busy_s,
            result.pcie_bytes, result.makespan_s, [list(s) for s in sim.cache.resident],
            [list(s) for s in sim.cache.in_flight], sim._seq, engines)


@pytest.mark.parametrize("system, settings", [
    ("smoe", {}), ("smoe-flex", {}), ("hybrimoe", {}), ("moe-infinity", {}), ("gpu-only-lru", {}),
    ("mixtral-offloading", {}), ("cpu-only", {}), ("dali", {}), ("gpu-only-lru", {"loads": "placed"}),
    ("hybrimoe", {"hw.cpu.dram_combined_gbps": "60"}),  # CPU experts stretch copies: _begin's own case
    ("smoe", {"engine.copy_chunk_bytes": "1000000"})])
def test_inline_calls_replay_as_the_calls(trace, system, settings, monkeypatch):
    inline = replay(trace, system, settings, called=False, monkeypatch=monkeypatch)
    called = replay(trace, system, settings, called=True, monkeypatch=monkeypatch)
    assert inline == called
    if system in ("smoe", "hybrimoe", "moe-infinity"):
        assert inline[0]["prefetches"] > 50, "the case should prefetch"
    if settings.get("loads") == "placed":
        assert inline[0]["breakdown"]["wait_cache"] > 0, "GPU experts should wait for their copies"


def test_contended_case_stretches_copies(trace, monkeypatch):
    """The DRAM case above lays CPU work beside copies, so advance meets a ledger reaching past a copy."""
    stretched = []
    begin = CopyEngines._begin

    def watched(self, i, transfer, start):
        if self.ledger is not None and self.ledger.intervals and self.ledger.intervals[-1][1] > start:
            stretched.append(transfer.kind)
        return begin(self, i, transfer, start)

    monkeypatch.setattr(CopyEngines, "_begin", watched)
    prepare(trace, "rtx4090", "hybrimoe", {"cache.slots_per_layer": "10", "hw.cpu.dram_combined_gbps": "60"}).run()
    assert "prefetch" in stretched


def test_new_transfer_is_the_constructed_transfer():
    made = new_transfer(3, 7, 1024, 1, "prefetch", 42, 1.5, 9)
    constructed = Transfer(3, 7, 1024, 1, "prefetch", 42, 1.5, 9)
    for f in dataclasses.fields(Transfer):  # every field set, a field added later included
        assert getattr(made, f.name) == getattr(constructed, f.name), f.name


def test_one_engine_begins_queued_copies_in_order():
    copies = CopyEngines(lambda nbytes: nbytes * 1e-3, engines=1)
    batch = [new_transfer(0, e, 1000, 1, "prefetch", e, 0.5, 0) for e in range(3)]
    copies.submit_prefetches(batch, 0.5)
    assert [x.start for x in batch] == [0.5, None, None] and copies.free[0] == 1.5
    copies.advance(2.5)  # the second starts at 1.5, the third at 2.5
    assert [(x.start, x.end) for x in batch] == [(0.5, 1.5), (1.5, 2.5), (2.5, 3.5)]
    assert copies.busy_s == 3.0 and copies.bytes == 3000 and copies.latest_prefetch_start == 2.5
    assert [heapq.heappop(copies.unretired)[2] for _ in range(3)] == batch
