"""Cost model: interpolation, kernel choice, roofline fallback, PCIe."""

from __future__ import annotations

import pytest

from moesim.hw.cost import CostModel, interp_loglog
from moesim.hw.parts import Curve
from moesim.hw.profile import load_profile, parse_profile
from moesim.model.presets import load_preset
from moesim.model.spec import ModelSpec
from tests.hw.test_profile import minimal

TOY = ModelSpec(name="toy", num_layers=2, num_experts=4, top_k=2, hidden_size=64, moe_intermediate_size=32)


def toy_costs(**changes) -> CostModel:
    data = minimal()
    for key, value in changes.items():
        section, field = key.split("__")
        data[section][field] = value
    return CostModel(parse_profile(data, origin="toy.yaml"), TOY)


# -- interpolation ------------------------------------------------------------------
def test_loglog_exact_at_points_and_between():
    curve = Curve((1.0, 100.0), (10.0, 1000.0), "hand-made")
    assert interp_loglog(curve, 1) == pytest.approx(10)
    assert interp_loglog(curve, 100) == pytest.approx(1000)
    assert interp_loglog(curve, 10) == pytest.approx(100)
    assert interp_loglog(curve, 50) == pytest.approx(500)


def test_loglog_clamps_below_and_grows_linearly_above():
    curve = Curve((4.0, 100.0), (40.0, 1000.0), "hand-made")
    assert interp_loglog(curve, 1) == 40.0
    assert interp_loglog(curve, 300) == pytest.approx(3000)
    assert interp_loglog(curve, 300, extrapolate_linear=False) == 1000.0


def test_gpu_expert_reads_the_curve():
    costs = toy_costs()
    assert costs.gpu_expert(10) == pytest.approx(100e-6)
    assert costs.gpu_expert(1) == pytest.approx(10e-6)
    assert costs.gpu_expert(200) == pytest.approx(2000e-6)
    assert costs.gpu_expert(0) == 0.0
    assert not costs.fallbacks


# -- CPU kernels ----------------------------------------------------------------------
def test_amx_switch_by_tokens():
    costs = toy_costs(cpu__dram_bandwidth_gbps=10_000)  # compute bound, so the kernel's peak shows
    assert [costs.cpu_kernel(t) for t in (1, 4, 5, 64)] == ["avx512", "avx512", "amx", "amx"]
    # roofline: 2*T*3*64*32 flops at 1 TFLOPS*0.5 (avx512) vs 4 TFLOPS*0.5 (amx)
    assert costs.cpu_expert(4) == pytest.approx(2 * 4 * 6144 / 0.5e12)
    assert costs.cpu_expert(5) == pytest.approx(2 * 5 * 6144 / 2e12)
    assert costs.cpu_expert(5) < costs.cpu_expert(4)
    assert costs.fallbacks == {"cpu expert FFN 64x32 bf16 avx512", "cpu expert FFN 64x32 bf16 amx"}


def test_cpu_without_amx_uses_its_vector_family():
    costs = toy_costs(cpu__amx_switch_tokens=None, cpu__peak_tflops={"avx2": 0.5})
    assert costs.cpu_kernel(1000) == "avx2"
    rtx4090 = load_profile("rtx4090")
    qwen = load_preset("qwen3-30b-a3b")
    shipped = CostModel(rtx4090, qwen)
    assert shipped.cpu_kernel(1) == shipped.cpu_kernel(4096) == "avx2"
    assert shipped.cpu_expert(8) > 0 and not shipped.fallbacks


def test_shipped_amx_profile_switches_curves():
    costs = CostModel(load_profile("a100-40g"), load_preset("deepseek-v3"))
    assert costs.cpu_kernel(4) == "avx512" and costs.cpu_kernel(5) == "amx"
    # 8 tokens: AVX-512 is compute bound (2*8*44e6 flops at 3.6 TFLOPS) > memory time, AMX is memory bound
    assert costs.cpu_expert(8) == pytest.approx(88_080_384 / 440e9, rel=1e-3)
    assert not costs.fallbacks


def test_fewer_cores_than_measured_is_slower_in_proportion():
    profile = load_profile("a100-40g")
    model = load_preset("deepseek-v3")
    full = CostModel(profile, model).cpu_expert(64)
    half = CostModel(profile.with_overrides({"cpu.cores": 36}), model).cpu_expert(64)
    assert half == pytest.approx(2 * full)


# -- roofline fallback ----------------------------------------------------------------
def test_gpu_roofline_fallback_is_recorded():
    costs = toy_costs()
    other = ModelSpec(name="other", num_layers=2, num_experts=4, top_k=2, hidden_size=64, moe_intermediate_size=48)
    fallback = CostModel(costs.profile, other)
    params = 3 * 64 * 48
    expected = max(2 * 1000 * params / (100e12 * 0.6), params * 2 / (1000e9 * 0.6))
    assert fallback.gpu_expert(1000) == pytest.approx(expected)
    assert fallback.fallbacks == {"gpu expert FFN 64x48 bf16"}


def test_gpu_roofline_counts_quantisation_scales():
    profile = parse_profile(minimal(), origin="toy.yaml")
    int4 = CostModel(profile, ModelSpec(name="q", num_layers=1, num_experts=1, top_k=1, hidden_size=64,
                                         moe_intermediate_size=48, expert_dtype="int4"))
    params = 3 * 64 * 48
    assert int4.gpu_expert(1) == pytest.approx(params * (0.5 + 2 / 128) / (1000e9 * 0.6))
    assert int4.expert_bytes == round(params * (0.5 + 2 / 128))


def test_separate_bandwidth_efficiency():
    data = minimal()
    data["gpu"]["expert_ffn"] = []
    data["gpu"]["bandwidth_efficiency"] = 0.9
    costs = CostModel(parse_profile(data, origin="toy.yaml"), TOY)
    assert costs.gpu_expert(1) == pytest.approx(3 * 64 * 32 * 2 / (1000e9 * 0.9))


def test_attention_without_curve_falls_back_and_says_so():
    costs = CostModel(load_profile("rtx4090"), load_preset("mixtral-8x7b"))
    assert costs.attention(1, 1024) > 0
    assert costs.fallbacks == {"gpu attention mixtral-8x7b"}


def test_attention_interpolates_across_token_counts():
    costs = CostModel(load_profile("rtx3090"), load_preset("qwen3-30b-a3b"))
    t16, t128 = costs.attention(16, 2048), costs.attention(128, 2048)
    between = costs.attention(45, 2048)
    assert t16 < between < t128
    assert costs.attention(2048, 2048) == pytest.approx(2 * costs.attention(1024, 2048))
    assert not costs.fallbacks


# -- PCIe and overheads -------------------------------------------------------------------
def test_h2d_is_latency_plus_bytes_over_bandwidth():
    costs = toy_costs()
    assert costs.h2d(20_000_000) == pytest.approx(5e-6 + 20_000_000 / 20e9)
    assert costs.d2h(1000) == pytest.approx(5e-6 + 1000 / 20e9)
    assert costs.expert_load == pytest.approx(5e-6 + 12288 / 20e9)


def test_bandwidth_scale_override_halves_bandwidth():
    profile = parse_profile(minimal(), origin="toy.yaml")
    slow = CostModel(profile.with_overrides({"pcie.bandwidth_scale": 0.5}), TOY)
    assert slow.h2d(20_000_000) == pytest.approx(5e-6 + 20_000_000 / 10e9)


def test_shipped_expert_load_time():
    costs = CostModel(load_profile("rtx4090"), load_preset("mixtral-8x7b"))
    # 3 x 4096 x 14336 bf16 = 352,321,536 B at 26.19 GB/s + 6 us
    assert costs.expert_load == pytest.approx(6e-6 + 352_321_536 / 26.19e9)


def test_launch_and_sync_overheads():
    costs = toy_costs()
    assert costs.launch_s == pytest.approx(10e-6) and costs.launches(3) == pytest.approx(30e-6)
    assert costs.sync_s == pytest.approx(12e-6)
    graph = toy_costs(gpu__cuda_graph=True)
    assert graph.launch_s == pytest.approx(1e-6)


def test_attention_curve_without_model_applies_to_any_model():
    data = minimal()
    data["gpu"]["attention"] = [{"tokens": 1, "context": [1, 1000], "time_us": [50, 50], "source": "x"},
                                {"model": "other", "tokens": 1, "context": [1], "time_us": [7], "source": "x"}]
    costs = CostModel(parse_profile(data, origin="toy.yaml"), TOY)
    assert costs.attention(1, 500) == pytest.approx(50e-6)
    assert costs.attention(4, 500) == pytest.approx(200e-6)  # above the last token count: proportional
    assert not costs.fallbacks
