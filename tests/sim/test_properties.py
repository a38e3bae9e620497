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

SYSTEMS = ["cpu-only", "gpu-only-lru", "static-hot", "all-in-gpu", "oracle-prefetch", "oracle-pinned",
           "mixtral-offloading", "hybrimoe"]
EPS = 1e-12


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


def routed_sets(model, routing):
    out = {}
    for step, entry in enumerate(routing):
        for layer in range(model.num_layers):
            out[(step, layer)] = sorted({e for _, (__, by_layer) in entry["tokens"].items()
                                         for token in by_layer[layer] for e in token})
    return out


FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(scenarios(), st.sampled_from(SYSTEMS))
def test_invariants(scenario, system):
    model, routing, profile, slots = scenario
    result, frames = run(model, routing, profile, system, slots)
    timeline, decisions = frames["timeline"], frames["decisions"]

    # time never goes backwards: spans are ordered, steps follow each other, one lane never overlaps itself,
    # not even by an ulp (a span summed in another order than the step's clock once did)
    assert (timeline.end_s >= timeline.start_s).all()
    for (resource, lane), spans in timeline.groupby(["resource", "lane"]):
        spans = spans.sort_values(["start_s", "end_s"])
        assert (spans.start_s.values[1:] >= spans.end_s.values[:-1]).all(), resource
    pcie = timeline[timeline.resource == "pcie"].sort_values("start_s")
    for t in pcie.start_s:
        running = ((pcie.start_s <= t + EPS) & (pcie.end_s > t + EPS)).sum()
        assert running <= profile["copy_engines"]
    starts = [s.start for s in result.steps]
    ends = [s.end for s in result.steps]
    assert all(b >= a for a, b in zip(ends, starts[1:]))

    # every routed expert computed exactly once
    computed = timeline[timeline.kind == "expert"]
    per_layer = computed.groupby(["step", "layer"]).expert.apply(list).to_dict()
    for key, routed in routed_sets(model, routing).items():
        assert sorted(per_layer.get(key, [])) == routed, key

    # no expert runs on the GPU before its weights arrive
    gpu = computed[computed.resource == "gpu"]
    actions = decisions.set_index(["step", "layer", "expert", "action"]).index
    for row in gpu.itertuples():
        was_resident = (row.step, row.layer, row.expert, "gpu_hit") in actions
        copies = pcie[(pcie.layer == row.layer) & (pcie.expert == row.expert) & (pcie.start_s <= row.start_s + EPS)]
        if not was_resident:
            assert len(copies), f"expert {row.expert} of layer {row.layer} computed without a copy"
            assert copies.end_s.max() <= row.start_s + EPS
        elif len(copies):
            assert copies.end_s.max() <= row.start_s + EPS

    # slots never exceeded and an expert in use never evicted (replayed from the decision log)
    capacity = result.memory.capacity
    held = [set(x) for x in result.initial_resident]
    assert all(len(h) <= c for h, c in zip(held, capacity))
    for (step, layer), plan in decisions.groupby(["step", "layer"], sort=False):
        in_use = set(plan[plan.action.str.startswith("gpu")].expert)
        for row in plan.itertuples():
            if row.action == "evict":
                assert not (row.target_layer == layer and row.expert in in_use)
                held[row.target_layer].discard(row.expert)
            elif row.action in ("gpu_load", "prefetch"):
                held[row.target_layer].add(row.expert)
                assert len(held[row.target_layer]) <= capacity[row.target_layer]

    # the timeline shows the copy engines' busy time that pcie_util counts, copies still running at the end
    # included (cut at it)
    assert (pcie.end_s - pcie.start_s).sum() == pytest.approx(result.pcie_busy_s, rel=1e-9, abs=1e-15)
    assert (pcie.end_s <= result.makespan_s + EPS).all()

    # total time at least the busiest resource's busy time
    m = metrics(result)
    for util in ("cpu_util", "gpu_util", "pcie_util"):
        assert m[util] <= 1 + 1e-9, util
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
