"""Demand loads laid out at once on an idle copy engine (``Simulator._load_at_once``) replay exactly as
transfers placed one by one and retired later do.

The closed form skips a :class:`~moesim.sim.copies.Transfer` per cache miss in decode layers computed
wholly on the GPU; forcing every load through the general path must change no figure, no step's times
and not even the order the cache's sets were filled in.
"""

from __future__ import annotations

import pytest

from moesim.sim.copies import CopyEngines, Transfer
from moesim.sim.run import prepare
from moesim.trace.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("loads") / "decode.parquet"
    config = SynthConfig.from_settings(model="deepseek-v2-lite", requests=1, prompt_len=6, decode_len=40,
                                       batch=1, seed=3, settings={}, scores=True)
    synthesize(config, path)
    return str(path)


def replay(trace: str, system: str) -> tuple[tuple, dict[str, int]]:
    """A replay's figures, step times, copy-engine state and cache sets (as lists: their order too), and
    how many layers took the closed form (with prefetches, with CPU experts beside their loads)."""
    # 10 slots a layer for top-6 of 64 experts: most decode layers miss and evict, none streams
    sim = prepare(trace, "rtx4090", system, {"cache.slots_per_layer": "10"})
    laid = {"layers": 0, "with_prefetches": 0, "with_cpu": 0, "with_writebacks": 0}
    plan_of, load_at_once, plans = sim.system.plan, sim._load_at_once, []

    def plan(view):
        plans.append(plan_of(view))
        return plans[-1]

    def counted(*args):
        laid["layers"] += 1
        for key, part in (("with_prefetches", "prefetches"), ("with_cpu", "cpu"), ("with_writebacks", "writebacks")):
            laid[key] += bool(getattr(plans[-1], part))
        return load_at_once(*args)

    sim.system.plan, sim._load_at_once = plan, counted
    result = sim.run()
    steps = [(r.step, r.start, r.end) for r in result.steps]
    tails = [(t.layer, t.expert, t.end, t.tail, t.evicted) if t is not None else None for t in sim.pcie.tails]
    figures = (dict(vars(result.counters)), steps, result.pcie_busy_s, result.pcie_bytes, result.makespan_s, tails,
               [list(s) for s in sim.cache.resident], sim._seq)
    return figures, laid


@pytest.mark.parametrize("system", ["gpu-only-lru", "mixtral-offloading", "moe-infinity", "hybrimoe", "importance"])
def test_loads_at_once_replay_as_placed_transfers(trace, system, monkeypatch):
    fast, laid = replay(trace, system)
    laid_layers = laid["layers"]
    assert laid["layers"] > 200, "the decode layers' misses should take the closed form"
    if system == "mixtral-offloading":  # every swap writes the evicted expert back
        assert laid["with_writebacks"] > 200
        assert fast[5][0] is not None, "the last load with a write-back is the engine's retired tail"
    if system in ("hybrimoe", "importance"):  # prefetches queue behind the loads; CPU experts run beside them
        assert laid["with_prefetches"] > 100 and laid["with_cpu"] > 100
    monkeypatch.setattr(CopyEngines, "idle_at", lambda self, at: False)
    slow, laid = replay(trace, system)
    assert laid["layers"] == 0
    assert fast[0]["demand_loads"] >= laid_layers
    assert fast == slow


def test_lay_demands_by_hand():
    copies = CopyEngines(lambda nbytes: nbytes * 1e-3, engines=1)
    copies.free[0] = 1.0
    copies.busy_s, copies.bytes = 0.5, 7
    assert copies.idle_at(2.0)
    first, ends = copies.lay_demands(3, 1000, 2.0, 2, 0.25)  # 1 s a copy, the first two with a 0.25 s tail
    starts = [first, ends[0] + 0.25, ends[1] + 0.25]
    assert starts == [2.0, 3.25, 4.5]
    assert ends == [3.0, 4.25, 5.5]
    assert copies.free[0] == 5.5
    assert copies.busy_s == pytest.approx(0.5 + 3 + 0.5)
    assert copies.bytes == 7 + 3000
    # the same copies placed as transfers one by one end at the same times
    placed = CopyEngines(lambda nbytes: nbytes * 1e-3, engines=1)
    placed.free[0] = 1.0
    loads = [Transfer(0, e, 1000, 0, "load", e + 1, 2.0) for e in range(3)]
    loads[0].tail = loads[1].tail = 0.25
    placed.submit_demands(loads, 2.0)
    assert [x.start for x in loads] == starts and [x.end for x in loads] == ends
    assert placed.free[0] == copies.free[0]


def test_not_idle_with_work_in_the_way():
    copies = CopyEngines(lambda nbytes: 1.0, engines=1)
    assert copies.idle_at(0.0)
    copies.submit_prefetches([Transfer(0, 1, 10, 1, "prefetch", 1, 0.0)], 0.0)
    assert not copies.idle_at(0.5), "a copy running or unretired must be retired first"
    assert not CopyEngines(lambda nbytes: 1.0, engines=2).idle_at(0.0), "two engines choose: no closed form"
    assert not CopyEngines(lambda nbytes: 1.0, engines=1, chunk_bytes=4).idle_at(0.0)
