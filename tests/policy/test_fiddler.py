"""Fiddler (baseline of 001_66a328d79a3cae8d.txt): pinned hot experts, copy-or-CPU rule, and how it differs
from ``static-hot``."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, active_experts
from moesim.policy.catalog.fiddler import FiddlerAssign
from moesim.policy.state import CacheState
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


def test_copy_or_cpu_rule_on_hand_example():
    # cpu(n) = 1000 sqrt(n), gpu(n) = 100 sqrt(n) + 15 launch, copy 1010 us: copy iff 900 sqrt(n) > 1025
    model, profile = tiny_model(layers=1, experts=8, top_k=2), tiny_profile(pcie_gbps=0.049152)
    routed = np.array([[0, 1], [0, 1], [0, 2], [3, 2]], dtype=np.int16)  # counts 0:3 1:2 2:2 3:1
    active, counts = active_experts(routed, 8)
    cache = CacheState(capacity=[2])
    cache.resident[0] = {3, 7}
    view = LayerView(0, 0, "prefill", routed, active, counts, cache, CostModel(profile, model),
                     expert_launch_s=15e-6)
    assert FiddlerAssign().split(view) == ([0, 1, 2, 3], [])
    one_token = LayerView(0, 0, "decode", routed[:1], [0, 1], [1, 1], cache, CostModel(profile, model),
                          expert_launch_s=15e-6)
    assert FiddlerAssign().split(one_token) == ([], [0, 1])


def prompt_of_64(tmp_path):
    """A 64-token prompt and 8 decode tokens over 2 layers of 8 experts (top-2), 2 pinned per layer."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    routing = random_routing(np.random.default_rng(3), model, requests=1, prompt=64, decode=8)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, routing)
    # cpu(n) = 100 n us: one token costs less on the CPU than a 110 us copy; 16 tokens cost more
    profile = tiny_profile(pcie_gbps=0.49152, cpu_us=(100.0, 10000.0))
    return trace, profile, {"engine.check": "true", "cache.slots_per_layer": "2"}


def test_fiddler_equals_static_hot_in_decode_and_wins_long_prefills(tmp_path):
    trace, profile, common = prompt_of_64(tmp_path)
    fiddler = metrics(simulate(str(trace), profile, "fiddler", common))
    static = metrics(simulate(str(trace), profile, "static-hot", common))
    # same pinned experts; one token per expert in decoding never pays for a copy
    assert fiddler["tpot_ms_mean"] == pytest.approx(static["tpot_ms_mean"])
    # 64 prompt tokens: ~16 per expert, so copying cold experts beats the CPU
    assert fiddler["streamed_experts"] > 0 and static["streamed_experts"] == 0
    assert fiddler["ttft_ms"] < static["ttft_ms"]
    assert fiddler["demand_loads"] == 0 and fiddler["evictions"] == 0


def test_one_placeholder_buffer_by_default_and_the_users_setting_wins(tmp_path):
    """Fiddler copies a cold expert into its single placeholder: the next copy waits for that expert to run."""
    from moesim.sim.result import result_to_frames
    model = tiny_model(layers=1, experts=8, top_k=2)
    # 32 tokens, each routed to one of 4 cold experts (pinned: 6, 7): 8 tokens each, copying beats the CPU
    rows = [[[e, 6 + (i % 2)] for i, e in enumerate([0, 1, 2, 3] * 8)]]
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "prefill", "tokens": {0: (0, rows)}}])
    profile = tiny_profile(pcie_gbps=0.49152, cpu_us=(100.0, 10000.0))
    common = {"engine.check": "true", "cache.slots_per_layer": "2", "cache.calibration": str(trace)}

    def stages(settings):
        result = simulate(str(trace), profile, "fiddler", {**common, **settings}, timeline=True)
        frame = result_to_frames(result)["timeline"]
        copies = frame[frame.kind == "stage"].sort_values("start_s")
        gpu = frame[(frame.resource == "gpu") & (frame.kind == "expert")].set_index("expert")
        return copies, gpu, metrics(result)

    copies, gpu, one = stages({})
    assert copies.expert.tolist() == [0, 1, 2, 3]
    # each copy after the first starts when the expert before it has finished on the GPU
    for before, after in zip([0, 1, 2], [1, 2, 3]):
        assert copies.set_index("expert").loc[after, "start_s"] == pytest.approx(gpu.loc[before, "end_s"])
    copies2, _, two = stages({"engine.staging_slots": "2"})
    # two buffers: the second copy follows the first straight away (110 us each)
    assert copies2.start_s.iloc[1] == pytest.approx(copies2.end_s.iloc[0])
    assert two["ttft_ms"] < one["ttft_ms"]


def test_without_copies_every_cold_expert_runs_on_the_cpu_even_in_a_long_prefill(tmp_path):
    """001 Sec. 6.1's Fiddler: routed experts on the CPU; the 64-token prefill copies nothing and takes as long
    as static-hot's (same pinned experts, every other one on the CPU)."""
    trace, profile, common = prompt_of_64(tmp_path)
    copying = metrics(simulate(str(trace), profile, "fiddler", common))
    on_cpu = metrics(simulate(str(trace), profile, "fiddler", {**common, "assign.copy_cold": "false"}))
    static = metrics(simulate(str(trace), profile, "static-hot", common))
    assert copying["streamed_experts"] > 0 and on_cpu["streamed_experts"] == 0
    assert on_cpu["ttft_ms"] == pytest.approx(static["ttft_ms"])
    assert on_cpu["ttft_ms"] > copying["ttft_ms"]
