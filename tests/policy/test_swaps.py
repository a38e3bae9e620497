"""Component swaps (``--set ROLE=NAME``) into catalogue systems that once failed: each case replays the smallest
trace that showed the fault and checks the exact behaviour the fix gives."""

from __future__ import annotations

import numpy as np
import pytest

import moesim.policy.catalog.moe_infinity as moe_infinity
from moesim.analysis.metrics import metrics
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_scored_trace


def _scored(path, layers: int, experts: int, seed: int) -> str:
    model = tiny_model(layers=layers, experts=experts, top_k=2)
    rng = np.random.default_rng(seed)
    return write_scored_trace(path, model, random_routing(rng, model, requests=2, prompt=2, decode=3), rng)


def _same(a: dict, b: dict) -> bool:
    a, b = dict(a), dict(b)
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    return a == b


def test_request_lfu_beside_another_prefetch_never_takes_a_finished_runs_tracker(tmp_path, monkeypatch):
    """eam-match swapped into another system left its activation tracker in a module-wide table keyed by
    ``id(ctx)``; CPython hands a later run's context the address of a finished one, and moe-infinity with
    its prefetch swapped out (nothing to replace the entry) then ranked its cache by the other run's
    counts: on a trace of another expert count it stopped with numpy's "operands could not be broadcast".
    Every context here gets the same id, as address reuse would give: the replay equals a fresh one."""
    other = _scored(tmp_path / "a.parquet", layers=2, experts=4, seed=0)
    trace = _scored(tmp_path / "b.parquet", layers=2, experts=6, seed=1)
    hw = tiny_profile(pcie_gbps=1.0)
    swap = {"prefetch": "next-layer", "cache.slots_per_layer": "3", "engine.check": "true"}
    alone = metrics(simulate(trace, hw, "moe-infinity", swap))
    monkeypatch.setattr(moe_infinity, "id", lambda obj: 1, raising=False)
    simulate(other, hw, "gpu-only-lru", {"prefetch": "eam-match", "cache.slots_per_layer": "2"})
    after = metrics(simulate(trace, hw, "moe-infinity", swap))
    assert _same(after, alone)
    assert after["prefetches"] > 0


def test_dali_with_next_layer_prefetch_sizes_its_buffer_from_the_models_top_k(tmp_path):
    """dali's prefetch buffer is twice the prefetcher's size; next-layer's default size is -1 (the model's
    top-k, resolved when the run starts), which made a buffer of -2 slots: the cache's quotas shrank by two
    and the run was refused with "initial resident set of layer 0 has 2 experts but only 0 slots are left".
    On a top-2 model the default now buffers 2 x 2 slots beside the 2 cached per layer, and replays exactly
    as prefetch.size=2 does."""
    trace = _scored(tmp_path / "t.parquet", layers=2, experts=6, seed=3)
    hw = tiny_profile(pcie_gbps=1.0)
    swap = {"prefetch": "next-layer", "cache.slots_per_layer": "2", "engine.check": "true"}
    result = simulate(trace, hw, "dali", swap)
    assert result.memory.reserved_slots == 4
    assert result.memory.cached == [2, 2] and result.memory.capacity == [6, 6]
    assert [len(held) for held in result.initial_resident] == [2, 2]
    assert _same(metrics(result), metrics(simulate(trace, hw, "dali", {**swap, "prefetch.size": "2"})))



# (swap, reserved slots, whether the note of the count-free fallback is given) on a 2-layer, 8-expert, top-2
# model: twice what the prefetcher issues per layer, worked from its parameters; twice the top-k (2 x 2) where
# none fixes the number
BUFFERS = [
    ({"prefetch": "smoe-token", "prefetch.n": "3"}, 6, False),  # 2 x n
    ({"prefetch": "smoe-token", "prefetch.n": "1"}, 2, False),
    ({"prefetch": "smoe-token"}, 4, False),  # n=-1: 000 Table I has no tiny model, DeepSeek-V3's 2 -> 2 x 2
    ({"prefetch": "hybrimoe-layer", "prefetch.n": "3"}, 6, False),  # 2 x n
    ({"prefetch": "top-score", "prefetch.size": "3"}, 6, False),  # 2 x the cap
    ({"prefetch": "top-score"}, 4, True),  # size 0, no cap: 2 x top-k
    ({"prefetch": "perfect"}, 4, True),  # the next layer's routed experts, as many as the batch routes
    ({"prefetch": "next-layer", "prefetch.size": "0"}, 4, True),  # every predicted expert
    ({"prefetch": "next-layer", "prefetch.size": "3"}, 6, False),
    ({"prefetch": "next-layer"}, 4, False),  # size -1: the model's top-k, 2 x 2
    ({"prefetch": "speculative"}, 4, False),  # its size 2 -> 2 x 2
    ({"prefetch": "eam-match"}, 4, False),  # lookahead 2 cut to the one later layer x per_layer 0 (top-k 2)
    ({"prefetch": "eam-match", "prefetch.per_layer": "3", "prefetch.lookahead": "5"}, 6, False),  # 1 layer x 3
    ({"prefetch": "dali-residual", "prefetch.size": "3"}, 6, False),
    ({}, 2, False),  # catalogue dali: 003's Mixtral size 1 for an 8-expert model -> 2 x 1
]


@pytest.mark.parametrize("swap, reserved, noted", BUFFERS,
                         ids=[",".join(f"{k}={v}" for k, v in swap.items()) or "dali" for swap, _, __ in BUFFERS])
def test_dali_sizes_its_prefetch_buffer_from_what_any_prefetcher_issues_per_layer(tmp_path, swap, reserved, noted):
    """dali's buffer (``cache.prefetch_slots`` -1) is twice what its prefetcher issues per layer. It read a
    ``size`` field alone: smoe-token, hybrimoe-layer, eam-match and perfect (none) got 2 slots whatever their
    parameters, top-score's size 0 (no cap) gave no buffer, next-layer's size 0 (every predicted expert) none
    either. Each layer's quota is its 2 cached slots plus the buffer (at most its 8 experts)."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    rng = np.random.default_rng(3)
    trace = write_scored_trace(tmp_path / "t.parquet", model,
                               random_routing(rng, model, requests=2, prompt=2, decode=3), rng)
    result = simulate(trace, tiny_profile(pcie_gbps=1.0), "dali",
                      {"cache.slots_per_layer": "2", "engine.check": "true", **swap})
    assert result.memory.reserved_slots == reserved
    assert result.memory.cached == [2, 2] and result.memory.capacity == [2 + reserved] * 2
    assert any(note.startswith("dali: prefetch '") for note in result.notes) == noted


def test_smoe_token_n_in_dali_sizes_the_buffer(tmp_path):
    """``--set prefetch=smoe-token --set prefetch.n=3`` in dali: 3 prefetches per layer get 6 buffer slots
    (2 x 3), n=1 gets 2; both got 2 before. A prefetcher without a count (perfect) gets twice the top-k, and
    the note says so with its figure; ``cache.prefetch_slots`` given is taken as it is, without the note."""
    trace = _scored(tmp_path / "t.parquet", layers=2, experts=8, seed=5)
    hw = tiny_profile(pcie_gbps=1.0)
    base = {"prefetch": "smoe-token", "cache.slots_per_layer": "2", "engine.check": "true"}
    three = simulate(trace, hw, "dali", {**base, "prefetch.n": "3"})
    one = simulate(trace, hw, "dali", {**base, "prefetch.n": "1"})
    assert (three.memory.reserved_slots, one.memory.reserved_slots) == (6, 2)
    assert (three.memory.capacity, one.memory.capacity) == ([8, 8], [4, 4])
    perfect = simulate(trace, hw, "dali", {**base, "prefetch": "perfect"})
    assert "dali: prefetch 'perfect' loads no fixed number of experts per layer; the prefetch buffer holds twice " \
           "the model's top-k, 4 slots (set cache.prefetch_slots)" in perfect.notes
    given = simulate(trace, hw, "dali", {**base, "prefetch": "perfect", "cache.prefetch_slots": "3"})
    assert given.memory.reserved_slots == 3 and not any(n.startswith("dali: prefetch '") for n in given.notes)
