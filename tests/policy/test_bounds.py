"""The physical lower bound (moesim/policy/catalog/bounds.py): hand cases and a floor under every system."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.policy.catalog.bounds import balanced_floor, physical_lower_bound
from moesim.policy.systems import SYSTEMS
from moesim.sim.run import simulate
from tests.factories import tiny_model, tiny_profile, write_tiny_trace
from moesim.trace.synth import SynthConfig, synthesize


def test_balanced_floor_hand_cases():
    assert balanced_floor(10.0, [1.0], [1.0]) == 10.0  # the GPU's own work dominates
    # two experts, GPU 1 each, CPU 4 each, fixed GPU 2: move the first wholly (3 vs 4), then x of the
    # second: 3 + x = 4 - 4x -> x = 0.2 -> 3.2
    assert balanced_floor(2.0, [1.0, 1.0], [4.0, 4.0]) == pytest.approx(3.2)
    assert balanced_floor(0.0, [], []) == 0.0


def test_bound_of_a_one_step_trace_by_hand(tmp_path):
    model = tiny_model(layers=2, experts=4, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             [{"phase": "decode", "tokens": {0: (0, [[[0, 1]], [[2, 3]]])}}])
    costs = CostModel(tiny_profile(), model)
    bound = physical_lower_bound(str(trace), model, costs)
    # attention 50 us per layer plus the step's embedding, LM head and sampling (rooflines on the toy GPU,
    # 1000 GB/s x 0.6: 1 x 64, 100 x 64 bf16 weights and 3 passes over 100 fp32 logits) = fixed GPU work F;
    # 4 experts of one token: GPU 100 us, CPU 1000 us each. Three go wholly to the GPU, then x of the
    # fourth: F + 300 us + 100x = 1000 (1 - x) us
    fixed = 2 * 50e-6 + (64 * 2 + 100 * 64 * 2 + 3 * 4 * 100) / 600e9
    x = (1000e-6 - fixed - 300e-6) / 1100e-6
    floor = fixed + 3 * 100e-6 + 100e-6 * x
    assert bound["makespan_s"] == pytest.approx(floor)
    assert bound["tpot_ms_mean"] == pytest.approx(floor * 1e3)


def _systems():
    return [name for name, spec in SYSTEMS.items()]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), requests=st.integers(1, 2), prompt=st.integers(1, 4),
       decode=st.integers(0, 4), experts=st.sampled_from([4, 6]), shared=st.booleans())
def test_every_system_is_at_or_above_the_floor(tmp_path, seed, requests, prompt, decode, experts, shared):
    model = tiny_model(layers=2, experts=experts, top_k=2, shared=shared)
    path = tmp_path / f"t{seed}-{requests}-{prompt}-{decode}-{experts}-{shared}.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=requests, prompt_len=prompt, decode_len=decode,
                                         batch=requests, seed=seed), path)
    profile = tiny_profile(shared_us=(80.0, 800.0) if shared else None, pcie_gbps=0.01)
    costs = CostModel(profile, model)
    plain = physical_lower_bound(str(path), model, costs)["makespan_s"]
    rewritten = physical_lower_bound(str(path), model, costs, substitution=True)["makespan_s"]
    assert 0 < rewritten <= plain
    for name in _systems():
        try:
            result = simulate(str(path), profile, name, {"cache.slots_per_layer": "2"}
                              if not SYSTEMS[name].ignores_memory else {})
        except ConfigError:
            continue  # a system that refuses this trace or setting
        floor = rewritten if result.counters.substituted else plain
        assert result.makespan_s >= floor * (1 - 1e-9), name
