"""DALI (003_46c415738ddfa491.txt) copies an expert's weights over PCIe at most once per layer plan.

When the window of Alg. 2 (Sec. 4.3) closes in a layer that also computes one of the incoming experts on
the GPU without having it cached (Sec. 4, Fig. 9's E3/E7), the one copy serves both: it lands in the cache
slot the swap frees and the layer computes from there. Streaming it through a staging buffer and then
transferring it again for the cache would move the same bytes twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from moesim.analysis.metrics import metrics
from moesim.policy.catalog.dali import DaliSystem
from moesim.policy.catalog.dali.workload import WorkloadAwareCache
from moesim.sim.result import result_to_frames
from moesim.sim.run import prepare, simulate
from tests.factories import tiny_model, tiny_profile, write_tiny_trace

GOLDEN_TRACE = Path(__file__).parents[1] / "data" / "golden-dsv2lite.parquet"
#: tiny_model's expert: 3 x 64 x 128 bf16 weights
EXPERT_BYTES = 49_152


def _cache_0_and_1(self: WorkloadAwareCache, layer: int, capacity: int) -> list[int]:
    """Sec. 4 draws the initial cache at random; fixed here to experts 0 and 1."""
    self._cached[layer] = {0, 1}
    return [0, 1]


def test_a_swapped_in_gpu_expert_is_copied_once_into_its_cache_slot(tmp_path, monkeypatch):
    """One layer of 4 experts caching 0 and 1 (cache.slots_per_layer 2), w_size 1 and u_size 1 (a window per
    pass), no prefetch; one decode token routed to experts 2 and 3.

    tiny_profile at 0.1 GB/s: a copy takes 49,152 B / 1e8 B/s + 10 us = 501.52 us; a GPU expert 100 us plus
    its launches, a CPU expert 1000 us.
    Alg. 1: t_gpu = max(501.52, 100 + launches) = 501.52 us for both, t_cpu = 1000 us; equal differences keep
    the layer's order: 2 goes to the GPU (501.52 <= 1000), 3 to the CPU (1003.04 > 1000).
    Alg. 2: scores 2:1 3:1, the top uncached is 2 (the lower id of the tie), the lowest cached 0 (score 0;
    1 ties): 0 goes, 2 comes in. So 2 is wanted twice in this layer, for the kernel and for the cache.

    One copy: a demand load of 2 into 0's slot, from the end of attention (50 us) to 551.52 us; the kernel of
    2 runs after it. The cache then holds 1 and 2. (Copying it twice put 98,304 B on the wire: a staged copy
    to 551.52 us and a second one for the cache to 1,053.04 us.)"""
    monkeypatch.setattr(WorkloadAwareCache, "initial", _cache_0_and_1)
    model = tiny_model(layers=1, experts=4, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[2, 3]]])}}])
    sim = prepare(str(trace), tiny_profile(pcie_gbps=0.1), "dali",
                  {"prefetch": "none", "cache.w_size": "1", "cache.u_size": "1", "cache.slots_per_layer": "2",
                   "assign.solve_us": "0", "engine.check": "true"}, timeline=True, decisions=True)
    result = sim.run()
    m = metrics(result)
    assert m["pcie_h2d_bytes"] == EXPERT_BYTES  # one expert's bytes, not two
    assert (m["demand_loads"], m["streamed_experts"], m["prefetches"], m["evictions"]) == (1, 0, 0, 1)

    frames = result_to_frames(result)
    copies = frames["timeline"].query("resource == 'pcie'")
    assert copies[["kind", "expert"]].values.tolist() == [["load", 2]]
    start, end = copies[["start_s", "end_s"]].values[0]
    assert start == pytest.approx(50e-6, rel=1e-5)
    assert end - start == pytest.approx(EXPERT_BYTES / 1e8 + 10e-6, rel=1e-9)  # 501.52 us
    kernel = frames["timeline"].query("resource == 'gpu' and kind == 'expert'")
    assert kernel["expert"].tolist() == [2] and kernel["start_s"].iloc[0] == pytest.approx(end, rel=1e-12)
    decisions = frames["decisions"][["expert", "action"]].values.tolist()
    assert decisions == [[0, "evict"], [2, "gpu_load"], [3, "cpu"]]

    assert sim.system.cache.cached(0) == {1, 2}
    assert sim.cache.resident[0] == {1, 2} and sim.cache.in_flight[0] == set()


def test_no_dali_plan_copies_an_expert_twice_on_the_golden_trace(monkeypatch):
    """The golden trace (DeepSeek-V2-Lite, two requests, rtx4090) under the engine's plan checks: no plan
    both stages or loads an expert and queues another copy of it for the same layer. Some window swaps take
    an expert the layer computes on the GPU (21 plans did so with two copies each before), and their loads
    keep the model-wide pool within its slots (a residual prefetch counts them)."""
    twice, loaded = [], []
    place = DaliSystem._place

    def watched(self, view):
        plan = place(self, view)
        copied = set(plan.streamed) | set(plan.loads)
        twice.extend((view.step, view.layer, e) for lay, e in plan.prefetches if lay == view.layer and e in copied)
        loaded.extend(plan.loads)
        return plan

    monkeypatch.setattr(DaliSystem, "_place", watched)
    m = metrics(simulate(str(GOLDEN_TRACE), "rtx4090", "dali", {"engine.check": "true"}))
    assert twice == []
    assert len(loaded) == m["demand_loads"] > 0


def test_a_prefetcher_naming_the_current_layer_copies_nothing_the_layer_copies_already(monkeypatch):
    """DALI with SMoE's token-wise prefetcher swapped in (``--set prefetch=smoe-token``), which names experts
    of the current layer for the next token: it prefetched experts the layer streamed (two copies) and
    experts a window swap loaded, which stopped the replay ('plan loads expert 4 of layer 0, which is
    already there'). Those candidates are now skipped, and the engine's plan checks pass."""
    twice = []
    place = DaliSystem._place

    def watched(self, view):
        plan = place(self, view)
        copied = set(plan.streamed) | set(plan.loads)
        twice.extend((view.step, view.layer, e) for lay, e in plan.prefetches if lay == view.layer and e in copied)
        return plan

    monkeypatch.setattr(DaliSystem, "_place", watched)
    m = metrics(simulate(str(GOLDEN_TRACE), "rtx4090", "dali",
                         {"prefetch": "smoe-token", "prefetch.n": "2", "engine.check": "true"}))
    assert twice == [] and m["prefetches"] > 0
