"""Prefetch components and the trace-only next-layer predictor."""

from __future__ import annotations

import numpy as np

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView
from moesim.policy.prefetch import LastTokenPredictor
from moesim.policy.state import CacheState
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


def view(layer: int, experts: list[list[int]], requests: list[int]) -> LayerView:
    model = tiny_model(layers=3, experts=8, top_k=2)
    rows = np.array(experts)
    return LayerView(step=0, layer=layer, phase="decode", experts=rows, active=sorted(set(rows.ravel().tolist())),
                     counts=[], cache=CacheState(capacity=[2, 2, 2]), costs=CostModel(tiny_profile(), model),
                     requests=np.array(requests))


def test_last_token_predictor_repeats_the_requests_previous_token_at_the_next_layer():
    predictor = LastTokenPredictor()
    # token 1 of requests 0 and 1: nothing is known yet
    assert [p.tolist() for p in predictor.predict(view(0, [[0, 1], [2, 3]], [0, 1]))] == [[], []]
    predictor.predict(view(1, [[4, 5], [6, 7]], [0, 1]))
    predictor.predict(view(2, [[0, 7], [1, 6]], [0, 1]))
    # token 2: layer 0 predicts layer 1 as each request's token 1 routed there
    assert [p.tolist() for p in predictor.predict(view(0, [[0, 2], [3, 4]], [0, 1]))] == [[4, 5], [6, 7]]
    # the last layer has nothing after it to predict for: layer 3 was never seen
    assert [p.tolist() for p in predictor.predict(view(2, [[1, 2], [3, 5]], [0, 1]))] == [[], []]


def test_predictor_systems_run_without_the_columns_and_say_so(tmp_path):
    model = tiny_model(layers=2, experts=6, top_k=2)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                random_routing(np.random.default_rng(1), model, requests=1, prompt=3, decode=8)))
    for system, note in (("buddymoe", "no pred_next_layer column"), ("dali", "no pred_residual column")):
        result = simulate(path, tiny_profile(pcie_gbps=1.0), system,
                          {"cache.slots_per_layer": "3", "engine.check": "true"})
        assert any(note in n for n in result.notes), (system, result.notes)
        assert result.counters.activations == 2 * (3 + 8) * 2
    # buddymoe's LRU cache already holds the previous token's experts, so that stand-in rarely loads
    # anything; DALI's workload-ranked cache does not, and prefetches from it
    dali = simulate(path, tiny_profile(pcie_gbps=1.0), "dali", {"cache.slots_per_layer": "3"})
    assert dali.counters.prefetches > 0
