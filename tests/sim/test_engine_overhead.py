"""A plan's own time (``LayerPlan.overhead_s``) against 004's prediction on the GPU stream: the breakdown, the
timeline's GPU lane and ``gpu_util`` tell one story (docs/engine.md, "What the GPU lane and gpu_util count").

A plan's overhead is host time the stream waits for before the layer's experts (a scheduler's solve, a
predictor's launches, cache bookkeeping), as kernel launches are: critical-path time in its breakdown category,
a gap on the GPU lane, not GPU busy time. 004's next-layer prediction (``prefetch_after_predict``) runs on the
stream: a span, and GPU busy time (tests/policy/test_importance_paper.py counts it).
"""

from __future__ import annotations

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.analysis.timeline import busy_time
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace

US = 1e-6


def _run(path, solve_us: str):
    settings = {"cache.slots_per_layer": "4", "assign.solve_us": solve_us, "prefetch.wait": "false",
                "engine.check": "true"}
    return simulate(str(path), tiny_profile(), "hybrimoe", settings, timeline=True)


def test_a_plans_overhead_is_a_gap_on_the_gpu_lane_and_not_gpu_busy(tmp_path):
    """Two MoE layers, one decode token routed to experts 0 and 1, all four experts resident (tiny profile:
    attention 50 us, a GPU expert 100 us + 3 launches of 5 us = 115 us). By hand the step is
    embedding 0.2133 ns + 2 x (50 + 2 x 115) us + LM head 21.333 ns + sampling 2 ns = 560.0235 us, all of it
    GPU work: gpu_util 1. HybriMoE's scheduling at ``assign.solve_us=1000`` adds 1 ms per layer after the
    attention: the step is 2560.0235 us, ``predict`` 2000 us, the GPU still busy 560.0235 us, so gpu_util is
    560.0235 / 2560.0235 = 0.21876; the GPU lane shows the two 1 ms gaps and nothing in them (it drew a
    ``predict`` span there, which the GPU's busy time did not count)."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (5, [[[0, 1]]] * 2)}}])
    free, solving = _run(path, "0"), _run(path, "1000")
    fixed = 0.2133e-9 + 2 * (50 + 2 * 115) * US + 21.333e-9 + 2e-9
    assert free.makespan_s == pytest.approx(fixed, rel=1e-6)
    assert metrics(free)["gpu_util"] == pytest.approx(1.0, rel=1e-12)
    assert solving.makespan_s == pytest.approx(fixed + 2000 * US, rel=1e-6)
    assert solving.makespan_s - free.makespan_s == pytest.approx(2000 * US, rel=1e-12)
    assert solving.counters.breakdown["predict"] == pytest.approx(2000 * US, rel=1e-12)
    assert solving.counters.gpu_busy_s == free.counters.gpu_busy_s
    assert metrics(solving)["gpu_util"] == pytest.approx(560.0235 / 2560.0235, rel=1e-6)

    gpu = result_to_frames(solving)["timeline"].query("resource == 'gpu'")
    assert busy_time(gpu, "gpu") == pytest.approx(solving.counters.gpu_busy_s, rel=1e-12)
    assert set(gpu.kind) == {"embedding", "attention", "expert", "lm_head", "sampling"}
    for layer in (0, 1):  # the layer's first expert starts 1 ms after its attention ends, nothing between
        attention_end = gpu.query(f"kind == 'attention' and layer == {layer}").end_s.item()
        later = gpu[gpu.start_s >= attention_end]
        assert later.start_s.min() - attention_end == pytest.approx(1000 * US, rel=1e-9)


@pytest.mark.parametrize("system", ["smoe", "hybrimoe", "dali"])
def test_the_gpu_lane_is_the_gpu_busy_time_of_systems_with_plan_overheads(tmp_path, system):
    """On a random trace, every system whose plans charge overhead: the GPU lane's busy time is
    ``gpu_busy_s`` (what gpu_util counts), and the plan's categories are charged but drawn nowhere."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, random_routing(np.random.default_rng(3), model, 1, 4, 6))
    result = simulate(str(trace), tiny_profile(pcie_gbps=1.0), system, {"cache.slots_per_layer": "2"}, timeline=True)
    frame = result_to_frames(result)["timeline"]
    assert result.counters.breakdown["predict"] > 0
    assert busy_time(frame, "gpu") == pytest.approx(result.counters.gpu_busy_s, rel=1e-9)
    assert not frame.kind.isin(["predict", "cache_management", "wait_cache"]).any()
