"""HybriMoE as 000_dba2fecbbc66318b.txt describes the baseline it reproduced: its settings (Sec. VI-A,
VI-D, VI-F) and its wait for cache updates (Sec. VI-E), worked by hand."""

from __future__ import annotations

import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import RunContext
from moesim.policy.systems import SYSTEMS, build_system
from tests.factories import tiny_model, tiny_profile
from tests.policy.test_hybrimoe import view_for


def test_settings_are_those_000_ran():
    """Sec. VI-D / VI-F: one expert prefetched into the next layer (HybriMoE's best count on both models);
    Sec. VI-A: built on KTransformers without CUDA Graphs; Sec. VI-A: score-aware cache and layer-wise
    prefetch are the techniques reproduced."""
    spec = SYSTEMS["hybrimoe"]
    assert spec.runtime == "ktransformers-eager"
    system = build_system("hybrimoe")
    assert system.prefetch.name == "hybrimoe-layer" and system.prefetch.n == 1
    assert system.cache.name == "score-aware"
    assert system.prefetch.wait is True


def test_the_layer_waits_for_its_outstanding_prefetches_as_wait_cache():
    """Sec. VI-E: HybriMoE's GPU waits for its cache updates (about 1 ms per token and layer there).
    Layer 1 plans at t = 2 ms with prefetches into it arriving at 2.3 ms and 2.75 ms: the layer starts
    when the last one lands, 0.75 ms charged as wait_cache. Scheduling time is set to 0 so that only the
    wait is charged; with prefetch.wait=false nothing is."""
    model, profile = tiny_model(layers=3, experts=8, top_k=2), tiny_profile()
    settings = {"assign.solve_us": "0"}
    for wait, expected in (("true", {"wait_cache": pytest.approx(0.75e-3)}), ("false", {})):
        system = build_system("hybrimoe", {**settings, "prefetch.wait": wait})
        system.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4] * 3))
        view = view_for(model, profile, [[0, 1]], resident=[0, 1], in_flight=[4, 5], layer=1)
        view.now, view.arrivals = 2e-3, {4: 2.3e-3, 5: 2.75e-3}
        assert system.plan(view).overhead_s == expected
    # nothing in flight: no wait
    system = build_system("hybrimoe", settings)
    system.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4] * 3))
    assert system.plan(view_for(model, profile, [[0, 1]], resident=[0, 1], layer=1)).overhead_s == {}
