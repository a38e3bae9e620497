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
    # with the first ids and bf16 experts the composition is gpu-only-lru's, to the last number
    same = simulate(trace, tiny_profile(), "mixtral-offloading",
                    {**settings, "cache": "lru", "memory.expert_dtype": "bf16"})
    assert same.makespan_s == lru.makespan_s and same.counters.demand_loads == lru.counters.demand_loads


def test_never_used_residents_are_evicted_lowest_id_first(tmp_path):
    """The cache's insertion order: of the never-used last experts, the lowest id is least recently used."""
    model = tiny_model(layers=1, experts=8, top_k=1)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}])
    result = simulate(str(path), tiny_profile(), "mixtral-offloading",
                      {"engine.check": "true", "cache.slots_per_layer": "3"}, decisions=True)
    from moesim.sim.engine import result_to_frames
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
