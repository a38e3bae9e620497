"""KTransformers (001_66a328d79a3cae8d.txt): Expert Deferral rules, AMX/AVX-512 switch, CUDA-Graph launches,
static GPU experts, and replays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.hw.profile import load_profile
from moesim.model.presets import load_preset
from moesim.policy.base import LayerPlan, LayerView, RunContext, active_experts
from moesim.policy.catalog.ktransformers import ExpertDeferral
from moesim.policy.state import CacheState
from moesim.policy.systems import build_system
from moesim.sim.run import simulate
from moesim.trace import TraceMeta, write_trace
from tests.factories import tiny_model, tiny_profile

ROOT = Path(__file__).resolve().parents[2]


def view_for(rows, phase="decode", layer=0, layers=4, experts=8):
    model = tiny_model(layers=layers, experts=experts, top_k=len(rows[0]))
    routed = np.array(rows, dtype=np.int16)
    active, counts = active_experts(routed, experts)
    return LayerView(0, layer, phase, routed, active, counts, CacheState(capacity=[0] * layers),
                     CostModel(tiny_profile(), model))


# ----------------------------------------------------------------------------- 001 Sec. 4.1
def test_deferral_takes_exactly_the_d_lowest_score_experts():
    view = view_for([[5, 3, 7, 1]])  # slots are ordered by gate score, best first
    plan = LayerPlan(cpu=[5, 3, 7, 1])
    assert ExpertDeferral(deferred=2).choose(view, plan) == [7, 1]
    assert ExpertDeferral(deferred=3).choose(view, plan) == [3, 7, 1]
    assert ExpertDeferral(deferred=0).choose(view, plan) == []


def test_deferral_is_decode_only_and_never_at_the_last_layer():
    plan = LayerPlan(cpu=[5, 3, 7, 1])
    assert ExpertDeferral(deferred=2).choose(view_for([[5, 3, 7, 1]], phase="prefill"), plan) == []
    assert ExpertDeferral(deferred=2).choose(view_for([[5, 3, 7, 1]], layer=3, layers=4), plan) == []
    assert ExpertDeferral(deferred=2).choose(view_for([[5, 3, 7, 1]], layer=2, layers=4), plan) == [7, 1]


def test_deferral_defers_only_cpu_experts_late_for_every_token():
    plan = LayerPlan(cpu=[5, 3, 7, 1, 2])
    # token 0 defers 7, 1; token 1 defers 2, 3; 7 and 3 are immediate for the other token
    view = view_for([[5, 3, 7, 1], [7, 5, 2, 3]])
    assert ExpertDeferral(deferred=2).choose(view, plan) == [1, 2]
    # an expert on the GPU is computed immediately
    assert ExpertDeferral(deferred=2).choose(view_for([[5, 3, 7, 1]]), LayerPlan(cpu=[5, 3, 7])) == [7]


def test_system_moves_deferred_experts_out_of_the_cpu_list():
    model = tiny_model(layers=4, experts=8, top_k=4)
    system = build_system("ktransformers-ed", {"defer.deferred": "2"})
    system.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[0] * 4))
    plan = system.plan(view_for([[5, 3, 7, 1]]))
    assert plan.cpu == [5, 3] and plan.deferred == [7, 1] and plan.gpu == []


def test_too_many_deferred_experts_is_one_clear_error(tmp_path):
    model = tiny_model(layers=2, experts=8, top_k=4)
    with pytest.raises(ConfigError, match="defer.deferred"):
        ExpertDeferral(deferred=4).configure(RunContext(model=model, costs=CostModel(tiny_profile(), model),
                                                        capacity=[0, 0]))


# ----------------------------------------------------------------------------- 001 Sec. 3.2, 3.3
def test_amx_from_five_tokens_per_expert_on_the_ktransformers_testbed():
    costs = CostModel(load_profile(str(ROOT / "hwprofiles" / "rtx4080.yaml")), load_preset("deepseek-v3"), "int4")
    assert [costs.cpu_kernel(t) for t in (1, 4, 5, 64)] == ["avx512", "avx512", "amx", "amx"]
    # 4 tokens on AVX-512 are compute bound (3.6 TFLOPS); 5 on AMX are memory bound (440 GB/s)
    assert costs.cpu_expert(4) == pytest.approx(2 * 4 * 3 * 7168 * 2048 / 3.6e12, rel=2e-3)
    assert costs.cpu_expert(5) == pytest.approx(3 * 7168 * 2048 * 0.515625 / 440e9, rel=2e-3)


def decode_trace(path: Path, model, tokens: int, seed: int = 0) -> Path:
    """One request, 2 prefill tokens then ``tokens`` decode tokens; gate weights 0.4, 0.3, 0.2, 0.1."""
    rng = np.random.default_rng(seed)
    rows = []
    for position in range(2 + tokens):
        step = 0 if position < 2 else position - 1
        for layer in range(model.num_layers):
            rows.append((step, layer, 0, position, "prefill" if position < 2 else "decode",
                         rng.choice(model.num_experts, model.top_k, replace=False).tolist()))
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    data = {name: np.array([r[i] for r in rows]) for i, name in enumerate(("step", "layer", "request", "position"))}
    data["phase"] = [r[4] for r in rows]
    data["experts"] = np.array([r[5] for r in rows], dtype=np.int16)
    data["weights"] = np.tile(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)[:model.top_k], (len(rows), 1))
    return write_trace(path, data, TraceMeta(model=model, source={"kind": "test"}))


def test_cuda_graph_setting_is_honoured(tmp_path):
    model = tiny_model(layers=2, experts=8, top_k=4, shared=True)
    trace = decode_trace(tmp_path / "t.parquet", model, 5)
    # fast CPU (4 experts at 10 us, a 20 us sync) against the shared expert on the GPU (100 us, the routed
    # curve): the GPU track is the critical path of every layer
    profile = tiny_profile(cpu_us=(10.0, 100.0))
    graph = metrics(simulate(str(trace), profile, "ktransformers", {"hw.gpu.cuda_graph": True}))
    plain = metrics(simulate(str(trace), profile, "ktransformers", {"hw.gpu.cuda_graph": False}))
    # 3 shared-expert kernels per layer at 5 us (launch) vs 1 us (graph), 2 layers
    assert plain["tpot_ms_mean"] - graph["tpot_ms_mean"] == pytest.approx(2 * 3 * (5 - 1) / 1e3)


def test_static_gpu_experts_per_layer(tmp_path):
    model = tiny_model(layers=2, experts=8, top_k=4)
    trace = decode_trace(tmp_path / "t.parquet", model, 5)
    result = simulate(str(trace), tiny_profile(), "ktransformers",
                      {"cache.per_layer": "2", "cache.slots_per_layer": "3", "engine.check": "true"})
    assert [len(r) for r in result.initial_resident] == [2, 2]
    assert metrics(result)["demand_loads"] == 0 and metrics(result)["gpu_hit_rate"] > 0
    # the memory plan holds the static experts only: the third slot per layer stays free memory
    assert result.memory.capacity == [2, 2] and metrics(result)["expert_slots"] == 4
    assert simulate(str(trace), tiny_profile(), "ktransformers").memory.capacity == [0, 0]
    with pytest.raises(ConfigError, match="cache.per_layer"):
        simulate(str(trace), tiny_profile(), "ktransformers", {"cache.per_layer": "4", "cache.slots_per_layer": "3"})


def test_a_calibration_trace_without_static_experts_is_noted_as_unused(tmp_path):
    model = tiny_model(layers=2, experts=8, top_k=4)
    trace = decode_trace(tmp_path / "t.parquet", model, 2)
    unused = simulate(str(trace), tiny_profile(), "ktransformers", {"cache.calibration": str(trace)})
    assert unused.memory.capacity == [0, 0]
    assert any("cache.calibration" in n and "unused" in n for n in unused.notes)
    used = simulate(str(trace), tiny_profile(), "ktransformers",
                    {"cache.calibration": str(trace), "cache.per_layer": "1", "cache.slots_per_layer": "1"})
    assert not any("unused" in n for n in used.notes)


# ----------------------------------------------------------------------------- replays
def test_deferral_lowers_tpot_when_the_cpu_is_the_bottleneck(tmp_path):
    model = tiny_model(layers=4, experts=8, top_k=4, shared=True)
    trace = decode_trace(tmp_path / "t.parquet", model, 8)
    profile = tiny_profile(attention_us=300.0)  # CPU: 1 ms per expert
    common = {"engine.check": "true"}
    base = metrics(simulate(str(trace), profile, "ktransformers", common))
    deferred = metrics(simulate(str(trace), profile, "ktransformers-ed", {**common, "defer.deferred": "2"}))
    assert base["deferred_experts"] == 0
    # 8 decode steps x 3 layers (never the last) x 2 experts; none in the prefill
    assert deferred["deferred_experts"] == 8 * 3 * 2
    assert deferred["tpot_ms_mean"] < base["tpot_ms_mean"]
    assert deferred["ttft_ms"] == pytest.approx(base["ttft_ms"])
    # weights 0.1 + 0.2 deferred per layer-step over 4 * 4 routed activations per decode step (plus the prefill)
    routed = (2 + 8) * 4 * 4
    assert deferred["deferred_weight_mass"] == pytest.approx(8 * 3 * 0.3 / routed)


@pytest.mark.parametrize("top_k, expected", [(2, 0), (4, 2), (8, 3)])
def test_default_defers_three_but_keeps_two_immediate(top_k, expected):
    """001 Sec. 4.2: defer few experts, 3 for DeepSeek-V3, keeping at least 2 immediate per token."""
    model = tiny_model(layers=2, experts=8, top_k=top_k)
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[0, 0])
    deferral = ExpertDeferral()
    deferral.configure(ctx)
    assert deferral.count == expected
    assert any("at least 2 of top-" in n for n in ctx.notes)  # a model 001 Sec. 6.3 has no count for


# ----------------------------------------------------------------------------- 001 Sec. 6.3 defaults
@pytest.mark.parametrize("preset, dtype, expected", [
    ("deepseek-v3", "bf16", 3), ("deepseek-v3", "int4", 6), ("deepseek-v2.5", "bf16", 4),
    ("deepseek-v2.5", "int8", 4), ("qwen2-57b-a14b", "bf16", 2), ("qwen2-57b-a14b", "int8", 4),
    ("qwen2-57b-a14b", "fp16", 2),
])
def test_default_deferral_count_is_the_papers_per_model_and_precision(preset, dtype, expected):
    """001 Sec. 6.1: the quantized runs are DS-3 in Int4, DS-2 and QW-2 in Int8; full precision is BF16/FP16."""
    model = load_preset(preset)
    ctx = RunContext(model=model, costs=CostModel(load_profile("a100-40g"), model, dtype),
                     capacity=[0] * model.num_layers)
    deferral = ExpertDeferral()
    deferral.configure(ctx)
    assert deferral.count == expected and not ctx.notes


@pytest.mark.parametrize("preset, dtype, expected, borrowed", [
    ("deepseek-v3", "fp8", 6, "int4"), ("deepseek-v3", "int8", 6, "int4"), ("qwen2-57b-a14b", "int4", 4, "int8"),
])
def test_a_dtype_001_did_not_run_borrows_a_count_with_a_note(preset, dtype, expected, borrowed):
    """DeepSeek-V3's released fp8 experts were never run in 001 (BF16 on the A100, Int4 on the RTX 4080): the
    quantized run's 6 is borrowed, and the note says so rather than passing it off as 001's count."""
    model = load_preset(preset)
    ctx = RunContext(model=model, costs=CostModel(load_profile("a100-40g"), model, dtype),
                     capacity=[0] * model.num_layers)
    deferral = ExpertDeferral()
    deferral.configure(ctx)
    assert deferral.count == expected
    assert any(f"no {dtype} experts" in n and f"its {borrowed} run" in n for n in ctx.notes)


def test_default_deferral_elsewhere_follows_the_rule_of_thumb_with_a_note():
    model = load_preset("qwen3-30b-a3b")  # top-8, not in 001's evaluation
    ctx = RunContext(model=model, costs=CostModel(load_profile("a100-40g"), model), capacity=[0] * model.num_layers)
    deferral = ExpertDeferral()
    deferral.configure(ctx)
    assert deferral.count == 3 and any("no deferral count for qwen3-30b-a3b" in n for n in ctx.notes)


def test_a_layer_whose_cpu_experts_are_all_deferred_still_pays_its_sync(tmp_path, monkeypatch):
    """Handing work to the CPU costs the sync whether the work is immediate or deferred, but a sync runs beside
    CPU work still under way (001 Sec. 4.1). With every CPU expert of layers 0 and 1 deferred (2 x 1 ms of CPU
    each) and a 500 us sync: the prefill's 3 layers pay it in full; a decode step pays it at layer 0, whose CPU
    is idle, while layers 1 and 2 start their syncs 50 us (attention) after the layer before, with its 2 ms of
    CPU work still running: hidden. Of layer 0's sync, the breakdown (critical-path time) charges what runs
    past layer 1's 50 us of attention, which the GPU does meanwhile: 3 x 500 + 4 x 450 us."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = decode_trace(tmp_path / "t.parquet", model, 4)  # one prefill step, four decode steps
    monkeypatch.setattr(ExpertDeferral, "choose", lambda self, view, plan: list(plan.cpu)
                        if view.phase == "decode" and view.layer < view.num_layers - 1 else [])
    result = simulate(str(trace), tiny_profile(sync_us=500.0), "ktransformers-ed",
                      {"defer.deferred": "1", "engine.check": "true"})
    assert result.counters.deferred == 4 * 2 * 2  # 4 decode steps x 2 layers x both experts
    assert result.counters.breakdown["sync"] == pytest.approx(3 * 500e-6 + 4 * 450e-6)
    assert sum(result.counters.breakdown.values()) == pytest.approx(result.makespan_s)
