"""Engine invariants over random small traces, profiles and systems (hypothesis)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moesim.analysis.metrics import metrics
from moesim.policy.systems import system_names
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import draw_profile, random_routing, tiny_model, tiny_profile, write_tiny_trace
from tests.sim.invariants import check_all

SYSTEMS = ["cpu-only", "gpu-only-lru", "static-hot", "all-in-gpu", "oracle-prefetch", "oracle-pinned",
           "mixtral-offloading", "hybrimoe"]


@st.composite
def scenarios(draw):
    experts = draw(st.integers(2, 8))
    model = tiny_model(layers=draw(st.integers(1, 3)), experts=experts, top_k=draw(st.integers(1, min(3, experts))),
                       shared=draw(st.booleans()))
    seed = draw(st.integers(0, 2**16))
    routing = random_routing(np.random.default_rng(seed), model, requests=draw(st.integers(1, 2)),
                             prompt=draw(st.integers(1, 5)), decode=draw(st.integers(0, 5)))
    profile = draw_profile(draw)
    # host DRAM shared by CPU experts and copies: from none to both slowed many times over
    profile["dram_combined_gbps"] = draw(st.sampled_from([None, 0.0001, 0.001, 0.01]))
    slots = draw(st.integers(model.top_k, experts))
    return model, routing, profile, slots


def run(model, routing, profile, system, slots, **extra):
    profile = dict(profile)
    combined = profile.pop("dram_combined_gbps", None)
    if combined is not None:
        extra["hw.cpu.dram_combined_gbps"] = str(combined)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_trace(Path(tmp) / "t.parquet", model, routing))
        result = simulate(path, tiny_profile(**profile), system, {"cache.slots_per_layer": str(slots), **extra},
                          timeline=True, decisions=True)
    return result, result_to_frames(result)


FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(scenarios(), st.sampled_from(SYSTEMS))
def test_invariants(scenario, system):
    model, routing, profile, slots = scenario
    result, frames = run(model, routing, profile, system, slots)
    # time never goes backwards, no lane runs two things at once, every routed expert computed exactly once, no
    # expert on the GPU before its weights arrive, slots never exceeded (followed from the decision log), the
    # timeline's copies add up to pcie_util's busy time (tests/sim/invariants.py)
    check_all(model, routing, result, frames, profile["copy_engines"])

    # none of these systems substitutes or defers: the routed experts are the trace's own
    m = metrics(result)
    assert m["substituted_experts"] == 0 and m["deferred_experts"] == 0


@FAST
@given(scenarios())
def test_unlimited_memory_equals_all_in_gpu(scenario):
    model, routing, profile, _ = scenario
    bound = metrics(run(model, routing, profile, "all-in-gpu", model.num_experts)[0])
    for system in ("gpu-only-lru", "static-hot"):  # on the bound's runtime (no launches) to compare schedules
        m = metrics(run(model, routing, profile, system, model.num_experts, runtime="ideal")[0])
        assert m["makespan_s"] == bound["makespan_s"], system
        assert m["gpu_hit_rate"] == 1.0


@FAST
@given(scenarios())
def test_lru_hit_rate_never_falls_with_more_slots(scenario):
    model, routing, profile, _ = scenario
    rates = [metrics(run(model, routing, profile, "gpu-only-lru", slots)[0])["gpu_hit_rate"]
             for slots in range(model.top_k, model.num_experts + 1)]
    assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:])), rates


@settings(max_examples=10, deadline=None)
@given(scenarios(), st.sampled_from(SYSTEMS))
def test_same_inputs_same_outputs(scenario, system):
    model, routing, profile, slots = scenario
    outputs = []
    for _ in range(2):
        result, frames = run(model, routing, profile, system, slots)
        m = metrics(result)
        m.pop("sim_wall_s")
        outputs.append((json.dumps(m, sort_keys=True, default=str),
                        frames["timeline"].to_csv(), frames["decisions"].to_csv()))
    assert outputs[0] == outputs[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([name for name in system_names() if name not in ("oracle", "importance")]))
def test_the_time_breakdown_adds_up_to_the_run(scenario, system):
    """``breakdown_ms`` is critical-path time per category: the categories of any system add up to the run
    (a sync the CPU ran past the GPU track was once counted under both ``sync`` and ``cpu_other``)."""
    model, routing, profile, slots = scenario
    result, _ = run(model, routing, profile, system, slots)
    assert sum(result.counters.breakdown.values()) == pytest.approx(result.makespan_s, rel=1e-9, abs=1e-15)
