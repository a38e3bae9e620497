"""KTransformers (001_66a328d79a3cae8d.txt) against the paper, mechanism by mechanism: each test works a tiny
case by hand in its comments and asserts the number or plan 001's rule gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from moesim.hw.cost import CostModel
from moesim.hw.profile import load_profile, parse_profile
from moesim.model.presets import load_preset
from moesim.policy.base import RunContext
from moesim.policy.catalog.ktransformers import ExpertDeferral
from moesim.sim.result import result_to_frames
from moesim.sim.run import prepare
from tests.factories import HIDDEN, INTERMEDIATE, profile_dict, tiny_model, tiny_profile, write_tiny_trace

US = 1e-6


def timeline(path: Path, system: str, settings: dict, **profile) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(kind, layer, expert) -> (start, end) in microseconds of one replay's timeline."""
    sim = prepare(str(path), tiny_profile(**profile), system, {"engine.check": "true", **settings}, timeline=True)
    frame = result_to_frames(sim.run())["timeline"]
    return {(r.kind, int(r.layer), int(r.expert)): (r.start_s / US, r.end_s / US) for r in frame.itertuples()}


# ----------------------------------------------------------------------------- 001 Sec. 3.3
def test_shared_experts_on_the_gpu_overlap_the_routed_experts_on_the_cpu(tmp_path):
    """Sec. 3.3: the shared expert runs on the GPU while the CPU computes the routed ones; the layer ends when
    both are done. One decode token, one layer, top-2: attention 0-50 us; the CPU starts after the 20 us
    sync and takes 1000 us per expert, ending at 2070 us. The shared expert (the tiny model's shared expert
    has the routed shape, so it reads gpu_us: 1900 us at one token, plus 3 launches of 5 us) runs from
    50 to 1965 us: hidden, the step's output starts at 2070 us. At 3000 us it ends at 3065 us and binds."""
    model = tiny_model(layers=1, experts=8, top_k=2, shared=True)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0, 1]]])}}])
    hidden = timeline(path, "ktransformers", {}, gpu_us=(1900.0, 19000.0))
    assert hidden[("shared", 0, -1)] == pytest.approx((50, 1965), abs=1e-3)
    assert hidden[("expert", 0, 1)][1] == pytest.approx(2070, abs=1e-3)
    assert hidden[("lm_head", -1, -1)][0] == pytest.approx(2070, abs=1e-3)
    binding = timeline(path, "ktransformers", {}, gpu_us=(3000.0, 30000.0))
    assert binding[("lm_head", -1, -1)][0] == pytest.approx(3065, abs=1e-3)


def test_amx_or_avx512_by_each_experts_tokens_in_a_prefill(tmp_path):
    """Sec. 3.2 (Fig. 7): AVX-512 up to 4 tokens per expert, AMX from 5 (cpu.amx_switch_tokens). A prefill of
    5 tokens, token i routed to experts 0 and i + 1: expert 0 has 5 tokens, experts 1-5 one each. AVX-512
    curve 1000 us at 1 token, 10,000 at 100; AMX curve 300 us at 5 tokens. Expert 0 runs AMX: 300 us; the
    others AVX-512: 1000 us each. With the switch at 6 tokens, expert 0 reads the AVX-512 curve at 5 tokens,
    log-log: 1000 x 5^(log 10 / log 100) = 2236.068 us. (KTransformers decides once per call, on the mean
    tokens per expert, here 10 / 6 <= 4: AVX-512 for all; the per-expert rule is the departure the module
    docstring states.)"""
    model = tiny_model(layers=1, experts=8, top_k=2)
    path = write_tiny_trace(tmp_path / "t.parquet", model,
                            [{"phase": "prefill", "tokens": {0: (0, [[[0, i + 1] for i in range(5)]])}}])
    data = profile_dict()
    data["cpu"].update(peak_tflops={"avx512": 1, "amx": 4}, amx_switch_tokens=5)
    data["cpu"]["expert_ffn"].append({"hidden": HIDDEN, "intermediate": INTERMEDIATE, "dtype": "bf16",
                                      "kernel": "amx", "tokens": [5, 100], "time_us": [300.0, 6000.0],
                                      "source": "test"})
    profile = parse_profile(data, origin="test-profile")

    def spans(settings):
        sim = prepare(str(path), profile, "ktransformers", {"engine.check": "true", **settings}, timeline=True)
        frame = result_to_frames(sim.run())["timeline"]
        return {int(r.expert): (r.end_s - r.start_s) / US for r in frame.itertuples() if r.kind == "expert"}

    amx = spans({})
    assert amx[0] == pytest.approx(300, abs=1e-3)
    assert [amx[e] for e in range(1, 6)] == pytest.approx([1000] * 5, abs=1e-3)
    later = spans({"hw.cpu.amx_switch_tokens": "6"})
    assert later[0] == pytest.approx(1000 * 5 ** 0.5, abs=1e-3)
    assert [later[e] for e in range(1, 6)] == pytest.approx([1000] * 5, abs=1e-3)


def test_numa_aware_tensor_parallelism_streams_at_both_sockets_local_bandwidth():
    """Sec. 3.3 and 6.1: each socket reads its own slice of every expert at 220 GB/s, so a one-token decode
    of a DeepSeek-V3 bf16 expert (3 x 7168 x 2048 weights, 2 bytes) streams 88.08 MB at 2 x 220 GB/s:
    200.2 us (AVX-512 compute, 2 x 3 x 7168 x 2048 flops at 3.6 TFLOPS = 24.5 us, does not bind). A
    NUMA-oblivious runtime (llama.cpp) is up to 1.63x slower in decode (Sec. 6.4): 200.2 / 0.613 = 326.6 us."""
    model = load_preset("deepseek-v3")
    profile = load_profile("a100-40g")
    kt = CostModel(profile, model, runtime_name="ktransformers")
    assert kt.cpu_kernel(1) == "avx512"
    assert kt.cpu_expert(1) == pytest.approx(3 * 7168 * 2048 * 2 / 440e9, rel=1e-3)
    oblivious = CostModel(profile, model, runtime_name="llamacpp")
    assert oblivious.cpu_expert(1) == pytest.approx(kt.cpu_expert(1) / 0.613, rel=1e-9)


# ----------------------------------------------------------------------------- 001 Sec. 4.1
def test_expert_deferral_follows_the_layer_equation(tmp_path):
    """Sec. 4.1's O_k: layer k's deferred experts run while layer k + 1's attention does, and join layer
    k + 1's output; the last layer defers nothing. One decode token, 3 layers, top-2, one deferred:
    layer 0 routes 0, 1; layer 1 routes 2, 3; layer 2 routes 4, 5. Attention 50 us, sync 20 us, 1000 us
    per CPU expert.

    Without deferral every layer takes 50 + 20 + 2 x 1000 = 2070 us: the step's output at 6210 us.
    With it: immediate expert 0 runs 70-1070 us; layer 1's attention starts at once (1070-1120 us) while
    deferred expert 1 runs 1070-2070 us. Layer 1's sync (1120-1140 us) overlaps it too, and its immediate
    expert 2 starts when the CPU is free (2070 us); its deferred
    expert 3 follows it, overlapping layer 2's attention (which starts when 2 ends). Layer 2 computes
    4 and 5 (R_L^all) and its output waits for 3 too. Two attentions (2 x 50 us) leave the critical path."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    path = write_tiny_trace(tmp_path / "t.parquet", model,
                            [{"phase": "decode", "tokens": {0: (0, [[[0, 1]], [[2, 3]], [[4, 5]]])}}])
    base = timeline(path, "ktransformers", {})
    assert base[("lm_head", -1, -1)][0] == pytest.approx(6210, abs=1e-3)
    ed = timeline(path, "ktransformers-ed", {"defer.deferred": "1"})
    assert ed[("expert", 0, 0)] == pytest.approx((70, 1070), abs=1e-3)
    assert ed[("deferred", 0, 1)] == pytest.approx((1070, 2070), abs=1e-3)
    assert ed[("attention", 1, -1)] == pytest.approx((1070, 1120), abs=1e-3)
    # layer 1's sync (1120-1140 us) runs while deferred expert 1 still computes: expert 2 starts as 1 ends
    assert ed[("expert", 1, 2)][0] == pytest.approx(ed[("deferred", 0, 1)][1], abs=1e-3)
    assert ed[("deferred", 1, 3)][0] == pytest.approx(ed[("expert", 1, 2)][1], abs=1e-3)
    assert ed[("attention", 2, -1)][0] == pytest.approx(ed[("expert", 1, 2)][1], abs=1e-3)
    assert ("deferred", 2, 4) not in ed and ("deferred", 2, 5) not in ed  # never at the last layer
    assert ed[("lm_head", -1, -1)][0] == pytest.approx(max(ed[("expert", 2, 5)][1], ed[("deferred", 1, 3)][1]))
    assert base[("lm_head", -1, -1)][0] - ed[("lm_head", -1, -1)][0] >= 2 * 50 - 1e-3


def test_deferred_experts_join_the_next_layers_output_even_when_it_has_no_cpu_work(tmp_path):
    """Sec. 4.1's O_{k+1} adds R_k^def: layer k + 1 ends only when layer k's deferred experts have, even when
    layer k + 1 itself runs on the GPU, and only CPU experts are deferred. 3 layers, top-2, one deferred;
    cache.per_layer=2 pins the calibration trace's experts: 6, 7 in layers 0 and 2 (not routed), 2, 3 in
    layer 1. One decode token routes 0, 1 / 2, 3 / 4, 5. Attention 50 us, sync 20 us, CPU expert 1000 us,
    GPU expert 100 us + 3 launches of 5 us.

    Without deferral: layer 0 ends at 50 + 20 + 2000 = 2070 us; layer 1: attention to 2120, experts 2 and 3
    on the GPU to 2350; layer 2: attention to 2400, sync to 2420, two CPU experts to 4420 (the LM head).
    With it: layer 0's immediate expert 0 runs 70-1070, deferred expert 1 1070-2070. Layer 1's attention
    starts at 1070, its GPU experts (nothing deferred: not CPU work) run 1120-1350, but its output waits
    for expert 1: layer 2's attention starts at 2070 (not 1350), then sync to 2140, experts 4 and 5 (the
    last layer defers nothing) to 4140 us."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    calibration = write_tiny_trace(tmp_path / "c.parquet", model,
                                   [{"phase": "decode", "tokens": {0: (0, [[[6, 7]], [[2, 3]], [[6, 7]]])}}])
    path = write_tiny_trace(tmp_path / "t.parquet", model,
                            [{"phase": "decode", "tokens": {0: (0, [[[0, 1]], [[2, 3]], [[4, 5]]])}}])
    static = {"cache.per_layer": "2", "cache.slots_per_layer": "2", "cache.calibration": str(calibration)}
    base = timeline(path, "ktransformers", static)
    assert base[("expert", 1, 3)] == pytest.approx((2235, 2350), abs=1e-3)
    assert base[("lm_head", -1, -1)][0] == pytest.approx(4420, abs=1e-3)
    ed = timeline(path, "ktransformers-ed", {**static, "defer.deferred": "1"})
    assert ed[("deferred", 0, 1)] == pytest.approx((1070, 2070), abs=1e-3)
    assert ed[("expert", 1, 2)] == pytest.approx((1120, 1235), abs=1e-3)
    assert ed[("expert", 1, 3)] == pytest.approx((1235, 1350), abs=1e-3)
    assert ("deferred", 1, 3) not in ed
    assert ed[("attention", 2, -1)] == pytest.approx((2070, 2120), abs=1e-3)
    assert ed[("expert", 2, 5)] == pytest.approx((3140, 4140), abs=1e-3)
    assert ed[("lm_head", -1, -1)][0] == pytest.approx(4140, abs=1e-3)


# ----------------------------------------------------------------------------- 001 Sec. 4.2, 6.3
def test_an_explicit_count_leaving_fewer_than_two_immediate_experts_is_noted():
    """Sec. 4.2 and 6.3 keep at least 2 immediate experts per layer. Top-4 with 3 deferred leaves one: it
    runs (an ablation beyond the paper) with a note saying so; 2 deferred leaves 2 and needs no note."""
    model = tiny_model(layers=2, experts=8, top_k=4)
    noted = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[0, 0])
    ExpertDeferral(deferred=3).configure(noted)
    assert any("1 immediate" in n and "001 Sec. 4.2" in n for n in noted.notes)
    quiet = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[0, 0])
    ExpertDeferral(deferred=2).configure(quiet)
    assert not quiet.notes


def test_the_sec_6_3_count_is_resolved_for_each_model_the_component_is_configured_for():
    """defer.deferred=-1 means 001 Sec. 6.3's count for the run's model and dtype: 6 for DeepSeek-V3 int4, 4
    for Qwen2-57B-A14B int8. Configured for DeepSeek-V3 and then again for Qwen2, it defers 4 there (it
    kept DeepSeek-V3's 6: the first run's resolution overwrote the parameter)."""
    deferral = ExpertDeferral()
    for name in ("deepseek-v3", "qwen2-57b-a14b"):
        model = load_preset(name)
        costs = CostModel(tiny_profile(), model, expert_dtype="int4" if name == "deepseek-v3" else "int8")
        deferral.configure(RunContext(model=model, costs=costs, capacity=[8] * model.num_layers))
    assert (deferral.count, deferral.deferred) == (4, -1)


# ----------------------------------------------------------------------------- 001 Sec. 6.1, Table 1, Table 2
@pytest.mark.parametrize("preset, layers, experts, top_k, quantized, hw, immediate_deferred", [
    ("deepseek-v3", 58, 256, 8, "int4", "rtx4080", (2, 6)),
    ("deepseek-v2.5", 59, 160, 6, "int8", "rtx4080", (2, 4)),
    ("qwen2-57b-a14b", 28, 64, 8, "int8", "rtx4080", (4, 4)),
])
def test_the_evaluated_models_and_their_table_2_split(preset, layers, experts, top_k, quantized, hw,
                                                      immediate_deferred):
    """Table 1: MoE layers, routed experts per layer and top-k of DS-3, DS-2 and QW-2; Sec. 6.1: the quantized
    builds run on the RTX 4080 host (2 x 36-core Xeon 8452Y, 2 x 220 GB/s, AMX from 5 tokens); Table 2: their
    (immediate + deferred) split, the default defer.deferred there."""
    model = load_preset(preset)
    assert (model.num_layers, model.num_experts, model.top_k) == (layers, experts, top_k)
    profile = load_profile(hw)
    assert (profile.cpu.cores, profile.cpu.dram_bandwidth_gbps, profile.cpu.amx_switch_tokens) == (72, 440, 5)
    deferral = ExpertDeferral()
    deferral.configure(RunContext(model=model, costs=CostModel(profile, model, quantized),
                                  capacity=[0] * model.num_layers))
    assert (model.top_k - deferral.count, deferral.count) == immediate_deferred


def test_a_deferral_count_that_leaves_no_immediate_expert_names_both_ranges():
    """The fix said "use 0..1 (001 Sec. 4.2 keeps at least 2 immediate)" for a top-2 model, where keeping 2
    immediate allows none deferred: it now gives what runs (0..1) and what the paper keeps (0..0) apart."""
    from moesim.errors import ConfigError
    from moesim.sim.run import simulate
    trace = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")
    with pytest.raises(ConfigError, match=r"use 0\.\.1; 001 Sec\. 4\.2 keeps at least 2 immediate: 0\.\.0"):
        simulate(trace, "rtx4090", "ktransformers-ed", {"defer.deferred": "2"})
