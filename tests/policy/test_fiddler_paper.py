"""Fiddler's placement as its public code does it (efeslab/fiddler ``src/fiddler/mixtral.py``,
``set_expert_loc``): one popularity ranking over every (layer, expert) pair of the model, not a quota per
layer."""

from __future__ import annotations

import pytest

from moesim.analysis.metrics import metrics
from moesim.sim.run import simulate
from tests.factories import tiny_model, tiny_profile, write_tiny_trace

# top-1 routing of one 8-token prompt, then 4 decode tokens that repeat the prompt's hottest experts.
# counts: layer 0: e0 x6, e1 x6; layer 1: e0 x4, e1 x4, e2 x3, e3 x1 (12 tokens each)
LAYER0 = [0] * 4 + [1] * 4
LAYER1 = [0, 0, 0, 1, 1, 1, 2, 2]
DECODE = [(0, 0), (0, 1), (1, 2), (1, 3)]


def lopsided(tmp_path):
    model = tiny_model(layers=2, experts=4, top_k=1)
    steps = [{"phase": "prefill", "tokens": {0: (0, [[[e] for e in LAYER0], [[e] for e in LAYER1]])}}]
    steps += [{"phase": "decode", "tokens": {0: (8 + i, [[[a]], [[b]]])}} for i, (a, b) in enumerate(DECODE)]
    return write_tiny_trace(tmp_path / "t.parquet", model, steps)


def test_popular_pairs_are_ranked_over_the_whole_model(tmp_path):
    """3 slots: the pairs (0,0) 6, (0,1) 6, (1,0) 4 (its tie with (1,1) goes to the lower id), so layer 0
    gets two slots and layer 1 one; static-hot's even spread gives layer 0 one and layer 1 two."""
    path, profile = lopsided(tmp_path), tiny_profile()
    settings = {"engine.check": "true", "cache.slots": "3"}
    fiddler = simulate(str(path), profile, "fiddler", settings)
    assert [sorted(r) for r in fiddler.initial_resident] == [[0, 1], [0]]
    assert fiddler.memory.pool == 3
    even = simulate(str(path), profile, "static-hot", settings)
    assert [sorted(r) for r in even.initial_resident] == [[0], [0, 1]]
    # 13 (step, layer, expert) activations: prefill 2 + 3, decode 4 + 4. Hits: 2 + 1 + 4 + 1 pinned
    # globally, against the even spread's 1 + 2 + 2 + 2
    assert metrics(fiddler)["gpu_hit_rate"] == pytest.approx(8 / 13)
    assert metrics(even)["gpu_hit_rate"] == pytest.approx(7 / 13)


def test_explicit_per_layer_quotas_pin_each_layers_hottest(tmp_path):
    path = lopsided(tmp_path)
    run = simulate(str(path), tiny_profile(), "fiddler", {"engine.check": "true", "cache.slots_per_layer": "[2,1]"})
    assert [sorted(r) for r in run.initial_resident] == [[0, 1], [0]]
    assert run.memory.pool is None
