"""The whole forward pass: MLA attention, non-expert dtype, dense layers, embedding, LM head, sampling."""

from __future__ import annotations

import dataclasses

import pytest

from moesim.analysis.metrics import metrics
from moesim.hw.cost import CostModel
from moesim.model.presets import load_preset
from moesim.sim.run import simulate
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


def test_deepseek_v3_mla_attention_params():
    m = load_preset("deepseek-v3")
    # q_a 7168x1536, q_b 1536x128x192, kv_a 7168x576, kv_b 512x128x256, o 128x128x7168
    expected = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert m.attention_params_per_layer() == expected == 187_105_280


def test_attention_roofline_reads_weights_in_the_non_expert_dtype():
    m = load_preset("deepseek-v3")
    from moesim.hw.profile import load_profile
    profile = load_profile("rtx4090")
    bf16 = CostModel(profile, m, "int4", non_expert_dtype="bf16")
    int8 = CostModel(profile, m, "int4", non_expert_dtype="int8")
    params = 187_105_280 + 7168 * 256
    kv = (512 + 64) * 2 * 1  # one context token of latent cache, bf16
    bandwidth = 1008e9 * 0.914
    assert bf16.attention_roofline(1, 1) == pytest.approx((params * 2 + kv) / bandwidth, rel=1e-9)
    assert int8.attention_roofline(1, 1) == pytest.approx((params * (1 + 2 / 128) + kv) / bandwidth, rel=1e-9)
    # the shipped curve is bf16: int8 scales it by the same ratio
    assert int8.attention(1, 128) / bf16.attention(1, 128) == pytest.approx(
        int8.attention_roofline(1, 128) / bf16.attention_roofline(1, 128), rel=1e-9)


def test_step_fixed_work_by_hand():
    model = dataclasses.replace(tiny_model(), num_dense_layers=2, dense_intermediate_size=256)
    costs = CostModel(tiny_profile(), model)
    bandwidth, flops = 1000e9 * 0.6, 100e12 * 0.6
    work = costs.step_fixed(tokens=4, context=10, sequences=2)
    dense_ffn = max(2 * 4 * 3 * 64 * 256 / flops, 3 * 64 * 256 * 2 / bandwidth)
    assert work["dense_ffn"] == pytest.approx(2 * dense_ffn, rel=1e-9)
    assert work["attention"] == pytest.approx(2 * 4 * 50e-6, rel=1e-9)  # the toy curve: 50 us per token
    assert work["embedding"] == pytest.approx(4 * 64 * 2 / bandwidth, rel=1e-9)
    assert work["lm_head"] == pytest.approx(max(2 * 2 * 100 * 64 / flops, 100 * 64 * 2 / bandwidth), rel=1e-9)
    assert work["sampling"] == pytest.approx(3 * 4 * 2 * 100 / bandwidth, rel=1e-9)


def test_dense_layers_are_charged_and_reported(tmp_path):
    plain = tiny_model(layers=1, experts=4, top_k=1)
    dense = dataclasses.replace(plain, num_dense_layers=1, dense_intermediate_size=256)
    routing = [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}]
    a = simulate(str(write_tiny_trace(tmp_path / "a.parquet", plain, routing)), tiny_profile(), "cpu-only")
    b = simulate(str(write_tiny_trace(tmp_path / "b.parquet", dense, routing)), tiny_profile(), "cpu-only")
    costs = CostModel(tiny_profile(), dense)
    extra = costs.attention(1, 1) + costs.dense_ffn(1)
    assert b.makespan_s - a.makespan_s == pytest.approx(extra, rel=1e-9)
    assert b.counters.breakdown["dense_ffn"] == pytest.approx(costs.dense_ffn(1), rel=1e-9)
    assert a.counters.breakdown["dense_ffn"] == 0.0
    for category in ("embedding", "lm_head", "sampling"):
        assert b.counters.breakdown[category] > 0
    assert metrics(b)["breakdown_ms"]["dense_ffn"] > 0
