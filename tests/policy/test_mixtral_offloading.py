"""Mixtral-offloading baseline: the open-source LRU expert cache (last experts resident first, int4
experts), with optional speculative loading."""

from __future__ import annotations

import pytest

from moesim.analysis.metrics import metrics
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixoff")
    return str(synthesize(SynthConfig.from_settings(model=tiny_model(layers=3, experts=8, top_k=2), requests=1,
                                                    prompt_len=4, decode_len=12, seed=1), out / "t.parquet"))


def test_the_last_experts_start_on_the_gpu(trace):
    """build_model.py offloads expert i when i < offload_per_layer: the GPU keeps the last ids."""
    settings = {"engine.check": "true", "cache.slots_per_layer": "3"}
    ours = simulate(trace, tiny_profile(), "mixtral-offloading", settings)
    assert ours.initial_resident == [[5, 6, 7]] * 3
    lru = simulate(trace, tiny_profile(), "gpu-only-lru", settings)
    assert lru.initial_resident[0] == [0, 1, 2]
    # with the first ids and bf16 weights the composition is gpu-only-lru's, to the last number
    same = simulate(trace, tiny_profile(), "mixtral-offloading",
                    {**settings, "cache": "lru", "memory.expert_dtype": "bf16", "memory.non_expert_dtype": "bf16"})
    assert same.makespan_s == lru.makespan_s and same.counters.demand_loads == lru.counters.demand_loads


def test_never_used_residents_are_evicted_lowest_id_first(tmp_path):
    """The cache's insertion order: of the never-used last experts, the lowest id is least recently used."""
    model = tiny_model(layers=1, experts=8, top_k=1)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}])
    result = simulate(str(path), tiny_profile(), "mixtral-offloading",
                      {"engine.check": "true", "cache.slots_per_layer": "3"}, decisions=True)
    from moesim.sim.result import result_to_frames
    log = result_to_frames(result)["decisions"]
    assert log[log.action == "evict"].expert.tolist() == [5]


def test_experts_are_int4_by_default(trace):
    settings = {"cache.slots_per_layer": "3"}
    int4 = simulate(trace, tiny_profile(), "mixtral-offloading", settings)
    bf16 = simulate(trace, tiny_profile(), "mixtral-offloading", {**settings, "memory.expert_dtype": "bf16"})
    model = tiny_model(layers=3, experts=8, top_k=2)
    assert int4.counters.demand_loads == bf16.counters.demand_loads > 0
    # every load moves one expert: 4-bit weights with one fp16 scale per 128 (49,152 -> 12,672 bytes)
    assert int4.pcie_bytes / bf16.pcie_bytes == pytest.approx(model.expert_bytes("int4") / model.expert_bytes("bf16"))
    assert model.expert_bytes("int4") == 3 * 64 * 128 // 2 + 3 * 64 * 128 // 128 * 2


def test_attention_is_int4_by_default(trace):
    """The demo quantizes attention to 4 bits (HQQ): the non-expert weights take a quarter of bf16's memory,
    which leaves room for more expert slots."""
    from moesim.sim.run import prepare
    profile = tiny_profile()
    int4 = prepare(trace, profile, "mixtral-offloading").memory
    bf16 = prepare(trace, profile, "mixtral-offloading", {"memory.non_expert_dtype": "bf16"}).memory
    model = tiny_model(layers=3, experts=8, top_k=2)
    assert (int4.non_expert_bytes, bf16.non_expert_bytes) == (model.non_expert_bytes("int4"),
                                                              model.non_expert_bytes("bf16"))
    assert int4.non_expert_bytes * 4 == bf16.non_expert_bytes
    assert int4.total_slots > bf16.total_slots


def test_speculative_loading_prefetches_the_guessed_experts(trace):
    settings = {"engine.check": "true", "cache.slots_per_layer": "4", "prefetch": "speculative"}
    spec = metrics(simulate(trace, tiny_profile(), "mixtral-offloading", settings))
    plain = metrics(simulate(trace, tiny_profile(), "mixtral-offloading", {"cache.slots_per_layer": "4"}))
    assert spec["prefetches"] > 0 and spec["prefetch_precision"] > 0.5
    assert spec["demand_loads"] < plain["demand_loads"]


def test_speculative_loading_falls_back_to_the_previous_token_without_the_column(tmp_path):
    import numpy as np
    model = tiny_model(layers=2, experts=8, top_k=2)
    path = write_tiny_trace(tmp_path / "plain.parquet", model, random_routing(np.random.default_rng(3), model, 1, 4, 8))
    result = simulate(str(path), tiny_profile(), "mixtral-offloading",
                      {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch": "speculative"})
    assert any("speculative: the trace has no pred_next_layer" in note for note in result.notes)
    assert metrics(result)["prefetches"] > 0


def test_each_swap_writes_the_evicted_expert_back_before_the_next_load(tmp_path):
    """ExpertCache._swap copies the evicted expert device-to-host after the load, on the same stream.

    One slot holding expert 7; decode steps routed to 0 then 1 (bf16, 49,152 bytes, 100 kB/s both ways:
    c = 10 us + 491.52 ms per copy). On the link: load 0 [a, a+c], write-back 7 [a+c, a+2c], load 1 (issued
    earlier, it waits) [a+2c, a+3c], write-back 0 [a+3c, a+4c]; expert 1 runs once load 1 is in, at a+3c.
    Without write-backs load 1 starts when step 1 issues it, before a+c+c.
    """
    from moesim.sim.result import result_to_frames
    model = tiny_model(layers=1, experts=8, top_k=1)
    routing = [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}, {"phase": "decode", "tokens": {0: (1, [[[1]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, routing)
    settings = {"engine.check": "true", "cache.slots_per_layer": "1", "memory.expert_dtype": "bf16"}
    swap = simulate(str(path), tiny_profile(), "mixtral-offloading", settings, timeline=True)
    plain = simulate(str(path), tiny_profile(), "mixtral-offloading", {**settings, "cache.writeback": "false"},
                     timeline=True)
    c = 10e-6 + 49_152 / 1e5
    frame = result_to_frames(swap)["timeline"]
    link = frame[frame.resource == "pcie"].sort_values("start_s")
    # the last write-back is still on the link when the last token is out: its span is cut at the run's end
    assert list(zip(link.kind, link.expert)) == [("load", 0), ("writeback", 7), ("load", 1), ("writeback", 0)]
    a = link.start_s.iloc[0]
    assert link.start_s.tolist() == pytest.approx([a, a + c, a + 2 * c, a + 3 * c], rel=1e-9)
    assert link.end_s.tolist() == pytest.approx([a + c, a + 2 * c, a + 3 * c, swap.makespan_s], rel=1e-9)
    assert a + 3 * c < swap.makespan_s < a + 4 * c
    gpu = frame[(frame.resource == "gpu") & (frame.kind == "expert")].set_index("expert")
    assert gpu.loc[1, "start_s"] == pytest.approx(a + 3 * c, rel=1e-9)
    plain_link = result_to_frames(plain)["timeline"]
    plain_link = plain_link[plain_link.resource == "pcie"].sort_values("start_s")
    assert plain_link.kind.tolist() == ["load", "load"] and plain_link.start_s.iloc[1] < a + 2 * c
    assert swap.makespan_s > plain.makespan_s
    # three whole copies and the start of the fourth on the link during the run, against two; write-backs
    # move no host-to-device bytes
    assert 3 * c < swap.pcie_busy_s < 3.01 * c and plain.pcie_busy_s == pytest.approx(2 * c)
    assert swap.pcie_bytes == plain.pcie_bytes == 2 * 49_152
