"""Mixtral-offloading baseline: the open-source LRU expert cache, with optional speculative loading."""

from __future__ import annotations

import pytest

from moesim.analysis.metrics import metrics
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixoff")
    return str(synthesize(SynthConfig.from_settings(model=tiny_model(layers=3, experts=8, top_k=2), requests=1,
                                                    prompt_len=4, decode_len=12, seed=1), out / "t.parquet"))


def test_same_schedule_as_gpu_only_lru(trace):
    settings = {"engine.check": "true", "cache.slots_per_layer": "3"}
    ours = simulate(trace, tiny_profile(), "mixtral-offloading", settings)
    lru = simulate(trace, tiny_profile(), "gpu-only-lru", settings)
    assert ours.makespan_s == lru.makespan_s and ours.counters.demand_loads == lru.counters.demand_loads
    assert ours.initial_resident[0] == [0, 1, 2]  # a layer's first experts fill its slots


def test_speculative_loading_prefetches_the_guessed_experts(trace):
    settings = {"engine.check": "true", "cache.slots_per_layer": "4", "prefetch": "speculative"}
    spec = metrics(simulate(trace, tiny_profile(), "mixtral-offloading", settings))
    plain = metrics(simulate(trace, tiny_profile(), "mixtral-offloading", {"cache.slots_per_layer": "4"}))
    assert spec["prefetches"] > 0 and spec["prefetch_precision"] > 0.5
    assert spec["demand_loads"] < plain["demand_loads"]
