"""Runtimes (001_66a328d79a3cae8d.txt Sec. 2.3, 3.3, 6.4): launches, CUDA Graph, CPU kernel efficiency."""

from __future__ import annotations

import pytest

from moesim.analysis.metrics import metrics
from moesim.errors import ProfileError
from moesim.hw.cost import CostModel
from moesim.hw.profile import load_profile
from moesim.model.presets import load_preset
from moesim.policy.systems import SYSTEMS
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds3.parquet"
    synthesize(SynthConfig.from_settings(model=load_preset("deepseek-v3"), requests=1, prompt_len=8,
                                         decode_len=4, batch=1, seed=0), path)
    return str(path)


def test_systems_name_their_papers_runtimes():
    assert SYSTEMS["ktransformers"].runtime == "ktransformers"
    assert SYSTEMS["fiddler"].runtime == "pytorch-eager"
    assert SYSTEMS["llamacpp"].runtime == "llamacpp"
    assert SYSTEMS["smoe"].runtime == "ktransformers-eager"  # 000 Sec. VI-A: KTransformers, no CUDA Graph
    assert SYSTEMS["cpu-only"].runtime == "generic"
    assert SYSTEMS["oracle"].runtime == "ideal"


def test_launch_costs_by_graph_mode():
    profile = load_profile("a100-40g")
    model = load_preset("deepseek-v3")
    kt = CostModel(profile, model, runtime_name="ktransformers")
    assert kt.launch_per_kernel("decode") == 0.0 and kt.step_launch("decode") == 0.0  # graph_launch_us 0
    assert kt.layer_launches("prefill") == pytest.approx(24 * 16e-6)
    llama = CostModel(profile, model, runtime_name="llamacpp")
    assert llama.layer_launches("decode") == pytest.approx(49 * 5e-6)
    with pytest.raises(ProfileError, match="no runtime"):
        CostModel(profile, model, runtime_name="vllm")


def test_cpu_efficiency_applies_to_the_binding_regime():
    profile = load_profile("a100-40g")
    model = load_preset("deepseek-v3")
    kt = CostModel(profile, model, runtime_name="ktransformers")
    pt = CostModel(profile, model, runtime_name="pytorch-eager")
    # one token: bandwidth-bound AVX-512; many tokens: compute-bound AMX (001 Sec. 3.2, 6.4)
    assert pt.cpu_expert(1) == pytest.approx(kt.cpu_expert(1) / 0.276, rel=1e-9)
    assert pt.cpu_expert(512) == pytest.approx(kt.cpu_expert(512) / 0.251, rel=1e-9)


def test_ktransformers_graph_makes_decode_faster_than_cpu_only(deepseek):
    """Before runtimes, ktransformers and cpu-only were byte-identical on every profile."""
    kt = metrics(simulate(deepseek, "a100-40g", "ktransformers"))
    cpu = metrics(simulate(deepseek, "a100-40g", "cpu-only"))
    # the same eager prefill; decode without 24 launches of 16 us per layer (58 MoE + 3 dense layers)
    assert kt["ttft_ms"] == pytest.approx(cpu["ttft_ms"], rel=1e-9)
    assert cpu["tpot_ms_mean"] - kt["tpot_ms_mean"] == pytest.approx(61 * 24 * 16e-3, rel=1e-6)
    assert 1.0 < cpu["tpot_ms_mean"] / kt["tpot_ms_mean"] <= 1.23  # 001 Sec. 6.4: CUDA Graph up to 1.23x


def test_ktransformers_beats_fiddler_and_llamacpp_in_decode(deepseek):
    """001 Sec. 6.2: 2.42-4.09x over Fiddler and 1.25-1.76x over llama.cpp in decode (full precision)."""
    kt = metrics(simulate(deepseek, "a100-40g", "ktransformers"))["tpot_ms_mean"]
    fiddler = metrics(simulate(deepseek, "a100-40g", "fiddler"))["tpot_ms_mean"]
    llama = metrics(simulate(deepseek, "a100-40g", "llamacpp"))["tpot_ms_mean"]
    assert 2.42 <= fiddler / kt <= 4.09
    assert 1.25 <= llama / kt <= 1.76


def test_runtime_setting_swaps_it(deepseek):
    kt = metrics(simulate(deepseek, "a100-40g", "ktransformers"))
    eager = metrics(simulate(deepseek, "a100-40g", "ktransformers", {"runtime": "pytorch-eager"}))
    assert eager["tpot_ms_mean"] > 2 * kt["tpot_ms_mean"]


def test_profile_without_runtimes_falls_back_to_generic_and_says_so(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}])
    result = simulate(str(path), tiny_profile(), "ktransformers")
    assert any("runtime ktransformers" in f for f in result.cost_fallbacks)


def test_cpu_efficiency_for_a_kernel_the_cpu_lacks_is_refused():
    data = load_profile("rtx4090").raw
    import copy
    data = copy.deepcopy(data)
    data["runtimes"]["llamacpp"]["cpu_compute_efficiency"] = {"amx": 0.5}
    from moesim.hw.profile import parse_profile
    with pytest.raises(ProfileError, match="no 'amx' kernel"):
        parse_profile(data, origin="x.yaml")


def _kt_profile(**runtime):
    """tests/factories' profile with a ``runtimes.ktransformers`` section: 5 us launches, 4 kernels per layer,
    a whole-decode-step graph (gpu.graph_launch_us 1 us), CPU curves as they are, no host work."""
    from moesim.hw.profile import parse_profile
    from tests.factories import profile_dict
    data = profile_dict()
    data["runtimes"] = {"ktransformers": {"launch_us": 5, "graph": "decode_step", "kernels_per_layer": 4,
                                          "cpu_compute_efficiency": {}, "cpu_bandwidth_efficiency": 1.0,
                                          "host_us_per_step": 0, **runtime}}
    data["sources"]["runtimes"] = "test"
    return parse_profile(data, origin="test-profile")


@pytest.mark.parametrize("runtime, settings, ttft_us, tpot_us", [
    ({}, {}, 4180, 4141),
    ({"launch_us": 10}, {}, 4220, 4141),
    ({"kernels_per_layer": 8}, {}, 4220, 4141),
    ({"graph": "none"}, {}, 4180, 4180),
    ({"graph": "kernel"}, {}, 4148, 4148),
    ({}, {"hw.gpu.graph_launch_us": "3"}, 4180, 4143),
    ({"cpu_bandwidth_efficiency": 0.5}, {}, 8180, 8141),
    ({"cpu_compute_efficiency": {"avx512": 0.5}}, {}, 4180, 4141),
    ({"host_us_per_step": 7}, {}, 4187, 4148),
])
def test_each_ktransformers_runtime_field_by_hand(tmp_path, runtime, settings, ttft_us, tpot_us):
    """001 Sec. 3.3, 6.4: every field of ``runtimes.ktransformers`` on a two-layer top-2 model with a shared
    expert, one prefill token then one decode token, each layer routed to two CPU experts (1000 us each at one
    token, DRAM-bound: 49,152 B at 100 GB/s against 49,152 flops at 1 TFLOPS), attention 50 us, sync 20 us; the
    shared expert's 100 us (+ its launches) on the GPU hide behind the CPU.

    Prefill (launched eagerly): per layer 4 launches x 5 us + 50 + 20 + 2 x 1000 = 2090 us, 4180 us in all.
    Decode (one CUDA Graph): 1 us graph launch + 2 x (50 + 20 + 2000) = 4141 us, no per-kernel launches.
    launch_us 10 or kernels_per_layer 8: prefill +2 x 20 us, decode unchanged (inside the graph). graph none:
    decode pays prefill's launches and no graph launch (4180). graph kernel: every kernel from a graph at 1 us,
    4 per layer, both phases: 2 x (4 + 2070) = 4148. gpu.graph_launch_us 3: decode 4143. cpu_bandwidth_efficiency
    0.5: each expert 2000 us (DRAM binds), 2 x (20 + 50 + 20 + 4000) = 8180 and 1 + 2 x 4070 = 8141.
    cpu_compute_efficiency avx512 0.5: compute does not bind at one token, nothing moves (it does at 100 tokens:
    test_ktransformers_compute_efficiency_applies_where_compute_binds). host_us_per_step 7: +7 us each step.
    (Embedding, LM head and sampling add 0.0235 us.)"""
    model = tiny_model(layers=2, experts=8, top_k=2, shared=True)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [
        {"phase": "prefill", "tokens": {0: (0, [[[0, 1]], [[2, 3]]])}},
        {"phase": "decode", "tokens": {0: (1, [[[0, 1]], [[2, 3]]])}}])
    m = metrics(simulate(str(path), _kt_profile(**runtime), "ktransformers", settings))
    assert m["ttft_ms"] * 1e3 == pytest.approx(ttft_us + 0.0235, abs=1e-3)
    assert m["tpot_ms_mean"] * 1e3 == pytest.approx(tpot_us + 0.0235, abs=1e-3)


def test_ktransformers_compute_efficiency_applies_where_compute_binds():
    """100 tokens on one tiny expert: 2 x 100 x 3 x 64 x 128 flops at 1 TFLOPS = 4.9 us against 0.49 us of DRAM,
    so compute binds and cpu_compute_efficiency avx512 0.5 doubles the curve's 10,000 us; one token (DRAM-bound)
    keeps its 1000 us."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    half = CostModel(_kt_profile(cpu_compute_efficiency={"avx512": 0.5}), model, runtime_name="ktransformers")
    assert half.cpu_expert(100) == pytest.approx(20_000e-6)
    assert half.cpu_expert(1) == pytest.approx(1000e-6)
