"""A plan's own time (``LayerPlan.overhead_s``) on the timeline: the Gantt chart shows what the breakdown counts."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


@pytest.mark.parametrize("system", ["smoe", "hybrimoe", "dali"])
def test_the_plans_own_time_is_drawn_where_the_layer_waits_for_it(tmp_path, system):
    """SMoE's predictor and cache management, HybriMoE's and DALI's scheduling: spans on the GPU lane that add up
    to their breakdown categories, each ending where the layer's experts may start; the breakdown's
    ``wait_cache`` overhead (waiting for copies) is idle time and has none. They had no span at all."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, random_routing(np.random.default_rng(3), model, 1, 4, 6))
    result = simulate(str(trace), tiny_profile(pcie_gbps=1.0), system, {"cache.slots_per_layer": "2"}, timeline=True)
    timeline = result_to_frames(result)["timeline"]
    gpu = timeline[timeline.resource == "gpu"]
    breakdown = result.counters.breakdown
    assert breakdown.get("predict", 0.0) > 0
    for category in ("predict", "cache_management"):
        spans = gpu[gpu.kind == category]
        assert (spans.end_s - spans.start_s).sum() == pytest.approx(breakdown.get(category, 0.0), rel=1e-9)
    assert not len(gpu[gpu.kind == "wait_cache"])
    # nothing else runs on the GPU lane meanwhile: the lane's spans never overlap
    ordered = gpu.sort_values(["start_s", "end_s"])
    assert (ordered.start_s.values[1:] >= ordered.end_s.values[:-1]).all()
