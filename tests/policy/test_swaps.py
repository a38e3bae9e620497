"""Component swaps (``--set ROLE=NAME``) into catalogue systems that once failed: each case replays the smallest
trace that showed the fault and checks the exact behaviour the fix gives."""

from __future__ import annotations

import numpy as np

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
