"""SMoE (000_dba2fecbbc66318b.txt): Alg. 1's load rule and ping-pong order, Fixed-N vs Adaptive LFU,
SMoE-Flex layer selection, the history fallback, and replays through the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.smoe import SMoEAssign, TokenWisePrefetch
from moesim.policy.catalog.smoe.prefetch import token_predictor_accuracy
from moesim.policy.state import CacheState
from moesim.policy.systems import build_system
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from moesim.trace import TraceMeta, write_trace
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace

# one tiny bf16 expert is 3*64*128*2 = 49,152 bytes: at 0.49152 GB/s its copy takes 100 us + 10 us latency
FAST_PCIE = 0.49152
LAUNCH = 3 * 5e-6  # engine default: 3 kernels per expert at the profile's 5 us


def view_for(model, profile, rows, phase="prefill", resident=(), capacity=4, layer=0, preds=None, step=0):
    experts = np.array(rows, dtype=np.int16)
    active, counts = active_experts(experts, model.num_experts)
    cache = CacheState(capacity=[capacity] * model.num_layers)
    cache.resident[layer] = set(resident)
    predictors = {"pred_next_token": [np.array(p, dtype=np.int16) for p in preds]} if preds else {}
    return LayerView(step, layer, phase, experts, active, counts, cache, CostModel(profile, model),
                     predictors=predictors, expert_launch_s=LAUNCH)


def write_rows(path: Path, model, rows: list[dict]) -> Path:
    """rows: dicts with step, layer, request, position, phase, experts and optionally pred_next_token."""
    rows = sorted(rows, key=lambda r: (r["step"], r["layer"], r["request"], r["position"]))
    data = {k: np.array([r[k] for r in rows]) for k in ("step", "layer", "request", "position")}
    data["phase"] = [r["phase"] for r in rows]
    data["experts"] = np.array([r["experts"] for r in rows], dtype=np.int16)
    if "pred_next_token" in rows[0]:
        data["pred_next_token"] = [r["pred_next_token"] for r in rows]
    return write_trace(path, data, TraceMeta(model=model, source={"kind": "test"}))


def decode_trace(path: Path, model, routing: list[list[list[int]]], prompt: list[list[list[int]]],
                 predictor: str = "perfect") -> Path:
    """One request: a prefill (prompt[layer] = token rows), then decode tokens routing[t][layer]."""
    rows = []
    tokens = [[prompt[l][i] for l in range(model.num_layers)] for i in range(len(prompt[0]))] + routing
    for t, by_layer in enumerate(tokens):
        step = 0 if t < len(prompt[0]) else t - len(prompt[0]) + 1
        for layer, experts in enumerate(by_layer):
            nxt = tokens[t + 1][layer] if t + 1 < len(tokens) else experts
            pred = nxt if predictor == "perfect" else [e for e in range(model.num_experts) if e not in nxt][:2]
            rows.append({"step": step, "layer": layer, "request": 0, "position": t,
                         "phase": "prefill" if t < len(prompt[0]) else "decode", "experts": experts,
                         "pred_next_token": pred})
    return write_rows(path, model, rows)


# ----------------------------------------------------------------------------- Alg. 1, lines 1-6
def test_load_rule_on_hand_example():
    # cpu(n) = 1000*sqrt(n) us, gpu(n) = 100*sqrt(n) us (log-log between 1 and 100 tokens), launch 15 us,
    # PCIe 1000 us + 10 us latency: GPU iff 1000 sqrt(n) > 100 sqrt(n) + 15 + 1010, i.e. n >= 2
    model, profile = tiny_model(layers=1, experts=4, top_k=2), tiny_profile(pcie_gbps=0.049152)
    view = view_for(model, profile, [[0, 1], [0, 1], [0, 2], [3, 2]], resident=[3])
    assert view.costs.expert_load == pytest.approx(1010e-6)
    # counts: e0 3, e1 2, e2 2, e3 1 (resident: T_PCIe = 0, and 1000 > 100 + 15)
    assert SMoEAssign().split(view) == ([0, 1, 2, 3], [])
    single = view_for(model, profile, [[0, 1], [2, 3]])  # one token each, none resident: 900 < 1025
    assert SMoEAssign().split(single) == ([], [0, 1, 2, 3])
    # decoding never loads on demand: a non-resident expert runs on the CPU whatever its load
    decode = view_for(model, profile, [[0, 1], [0, 1], [0, 1]], phase="decode", resident=[1])
    assert SMoEAssign().split(decode) == ([1], [0])
    assert SMoEAssign(decode_on_demand=True).split(decode) == ([0, 1], [])


def test_ping_pong_order_on_hand_example(tmp_path):
    """Alg. 1 lines 13-21: G[i+1] is copied into the buffer G[i-1] used, once G[i-1] has finished."""
    model = tiny_model(layers=1, experts=4, top_k=2)
    profile = tiny_profile(pcie_gbps=FAST_PCIE)
    # counts e0 5, e1 2, e2 2, e3 1; copies take 110 us, so every expert goes to the GPU (900 sqrt(n) > 125)
    prompt = [[[0, 1], [0, 1], [0, 2], [0, 2], [0, 3]]]
    trace = decode_trace(tmp_path / "t.parquet", model, [], prompt)
    result = simulate(str(trace), profile, "smoe", {"engine.check": "true"}, timeline=True)
    frame = result_to_frames(result)["timeline"]
    stage = frame[frame.kind == "stage"].sort_values("start_s")
    gpu = frame[(frame.resource == "gpu") & (frame.kind == "expert")].sort_values("start_s")
    us = lambda s: [round(v * 1e6, 3) for v in s]  # noqa: E731
    g5, g2, g1 = 100 * 5 ** 0.5 + 15, 100 * 2 ** 0.5 + 15, 100 + 15
    # the embedding of 5 tokens (5 x 64 bf16 at 1000 GB/s x 0.6), then attention of 5 tokens (5 * 50 us);
    # buffers B0, B1 take e0 and e1 at once (one copy engine)
    t1 = 5 * 64 * 2 / 600e9 * 1e6 + 250
    e0_end = t1 + 110 + g5
    e1_end = max(e0_end, t1 + 220) + g2
    e2_load = e0_end  # B0 frees when e0 finishes
    e2_end = max(e1_end, e2_load + 110) + g2
    e3_load = e1_end  # B1 frees when e1 finishes
    e3_end = max(e2_end, e3_load + 110) + g1
    assert stage.expert.tolist() == [0, 1, 2, 3]
    assert us(stage.start_s) == pytest.approx([t1, t1 + 110, e2_load, e3_load])
    assert gpu.expert.tolist() == [0, 1, 2, 3]
    assert us(gpu.end_s) == pytest.approx([e0_end, e1_end, e2_end, e3_end])
    lm_head_and_sampling = (100 * 64 * 2 + 3 * 4 * 100) / 600e9 * 1e6  # toy GPU rooflines, one sequence
    assert metrics(result)["ttft_ms"] == pytest.approx((e3_end + lm_head_and_sampling) / 1e3)


# ----------------------------------------------------------------------------- Sec. IV-E
def planned(eviction: str):
    model, profile = tiny_model(layers=1, experts=8, top_k=2), tiny_profile(pcie_gbps=FAST_PCIE)
    system = build_system("smoe", {"prefetch.eviction": eviction})
    ctx = RunContext(model=model, costs=CostModel(profile, model), capacity=[4], columns=("pred_next_token",))
    system.configure(ctx)
    history = {0: 5, 1: 1, 2: 3, 3: 2}  # activations seen so far
    for expert, times in history.items():
        for _ in range(times):
            system.cache.observe(view_for(model, profile, [[expert, 7]], phase="decode"))
    system.cache._order[0][7] = (0, 0, 7)  # the filler expert 7 only made the rows two wide
    view = view_for(model, profile, [[0, 2]], phase="decode", resident=[0, 1, 2, 3], preds=[[0, 5, 1, 6]])
    return system.plan(view)


def test_fixed_n_loads_n_new_experts_over_the_least_frequent():
    plan = planned("fixed")
    # ranked predictions 0, 5, 1, 6: the first two not cached are 5 and 6; counts now 0:6 1:1 2:4 3:2 and
    # 0, 2 are in use, so the least frequent evictable are 1 then 3
    assert plan.gpu == [0, 2] and plan.cpu == []
    assert plan.prefetches == [(0, 5), (0, 6)]
    assert plan.evictions == [(0, 1), (0, 3)]
    # the predictor (a 64 x 8 bf16 GEMV: 1,024 bytes at 1000 GB/s x efficiency, plus 2 launches of 5 us)
    gpu = tiny_profile().gpu
    predict = 2 * 5e-6 + 1024 / (1000e9 * gpu.effective_bandwidth_efficiency)
    assert plan.overhead_s == {"cache_management": pytest.approx(10e-6), "predict": pytest.approx(predict)}


def test_adaptive_loads_only_uncached_among_top_n():
    plan = planned("adaptive")
    # top-2 predictions are 0 (cached) and 5: one transfer, over the least frequent (1)
    assert plan.prefetches == [(0, 5)]
    assert plan.evictions == [(0, 1)]


# ----------------------------------------------------------------------------- SMoE-Flex
def flex_trace(path: Path) -> Path:
    """4 layers; the predictor is right at layers 0 and 3, half right at 1, wrong at 2."""
    model = tiny_model(layers=4, experts=8, top_k=2)
    truth = [[0, 1], [2, 3], [4, 5], [6, 7]]  # every token routes the same experts at a layer
    guess = {0: [0, 1], 1: [2, 7], 2: [0, 1], 3: [6, 7]}
    rows = []
    for position in range(4):
        for layer in range(4):
            rows.append({"step": position, "layer": layer, "request": 0, "position": position,
                         "phase": "prefill" if position == 0 else "decode", "experts": truth[layer],
                         "pred_next_token": guess[layer]})
    return write_rows(path, model, rows)


def test_flex_turns_off_the_least_accurate_half(tmp_path):
    path = flex_trace(tmp_path / "flex.parquet")
    model = tiny_model(layers=4, experts=8, top_k=2)
    assert token_predictor_accuracy(str(path), 4, 2).tolist() == [1.0, 0.5, 0.0, 1.0]
    prefetch = TokenWisePrefetch(n=3, flex_off_fraction=0.5, calibration="self")
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[4] * 4,
                     trace_path=str(path), columns=("pred_next_token",))
    prefetch.configure(ctx)
    assert [prefetch.enabled(layer) for layer in range(4)] == [True, False, False, True]
    assert "prefetch off on 2 of 4 layers" in ctx.notes[-1] and "[1, 2]" in ctx.notes[-1]
    assert "clairvoyant" in ctx.notes[-1]
    profile = tiny_profile()
    for layer, expected in ((0, [(0, 6), (0, 7)]), (1, [])):
        view = view_for(model, profile, [[0, 1]], phase="decode", layer=layer, preds=[[6, 7]])
        assert prefetch.candidates(view) == expected


def test_flex_ranks_layers_on_a_held_out_calibration_trace(tmp_path):
    """The replayed trace is never read for the ranking unless asked: a held-out trace decides."""
    calibration = flex_trace(tmp_path / "cal.parquet")
    model = tiny_model(layers=4, experts=8, top_k=2)
    prefetch = TokenWisePrefetch(n=3, flex_off_fraction=0.5, calibration=str(calibration))
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[4] * 4,
                     trace_path=str(tmp_path / "absent.parquet"), columns=("pred_next_token",))
    prefetch.configure(ctx)
    assert [prefetch.enabled(layer) for layer in range(4)] == [True, False, False, True]
    assert str(calibration) in ctx.notes[-1] and "clairvoyant" not in ctx.notes[-1]


def test_flex_reads_a_calibration_trace_whose_name_is_not_utf8(tmp_path):
    """pyarrow cannot encode such a name (bytes a shell passes through): the ranking ended in a
    UnicodeEncodeError."""
    import os
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/cal\xff.parquet")
    os.rename(flex_trace(tmp_path / "cal.parquet"), odd)
    assert token_predictor_accuracy(odd, 4, 2).tolist() == [1.0, 0.5, 0.0, 1.0]


def test_flex_by_default_ranks_layers_online_after_a_warm_up(tmp_path):
    """Default SMoE-Flex: every layer predicts and prefetches for ``warmup`` decode steps, each token's
    prediction scored against its next token; then the least accurate half stops. In flex_trace the
    predictor is right at layers 0 and 3, half right at 1, wrong at 2: after 2 decode steps (1 scored
    pair per layer) layers 1 and 2 switch off, at layer 0 of the third decode step."""
    path = flex_trace(tmp_path / "flex.parquet")
    settings = {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch.warmup": "2",
                "prefetch.predict_us": "1"}
    result = simulate(str(path), tiny_profile(pcie_gbps=FAST_PCIE), "smoe-flex", settings, decisions=True)
    assert any("after 2 decode steps prefetch is off on 2 layers: [1, 2]" in note for note in result.notes)
    assert not any("clairvoyant" in note for note in result.notes)
    # predictions (1 us each): 4 layers in each warm-up step, then layers 0 and 3 only
    assert metrics(result)["breakdown_ms"]["predict"] == pytest.approx((4 + 4 + 2) * 1e-3)
    log = result_to_frames(result)["decisions"]
    prefetched = log[(log.action == "prefetch") & (log.step >= 1)]
    # layer 1's predictor names 7 beside the cached 2, 3: fetched into the free slot during the warm-up
    assert prefetched[prefetched.layer == 1].expert.tolist() == [7]
    short = simulate(str(path), tiny_profile(pcie_gbps=FAST_PCIE), "smoe-flex", {**settings, "prefetch.warmup": "16"})
    assert not any("after 16 decode steps" in note for note in short.notes)  # 3 decode steps: still warming up


def test_predictor_time_is_charged_on_every_predicting_decode_layer(tmp_path):
    model = tiny_model(layers=2, experts=8, top_k=2)
    prompt = [[[0, 1], [0, 1], [0, 2]]] * 2
    trace = decode_trace(tmp_path / "t.parquet", model, [[[0, 1]] * 2] * 3, prompt)
    common = {"engine.check": "true", "cache.slots_per_layer": "3"}
    fixed = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe", {**common, "prefetch.predict_us": "7"})
    assert metrics(fixed)["breakdown_ms"]["predict"] == pytest.approx(3 * 2 * 7e-3)  # 3 decode steps x 2 layers
    free = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe", {**common, "prefetch.predict_us": "0"})
    assert metrics(fixed)["ttft_ms"] == pytest.approx(metrics(free)["ttft_ms"])  # no prediction in the prefill
    # the last step (0 and 1 resident, nothing in flight): 7 us more per layer on the critical path
    last = lambda r: r.steps[-1].end - r.steps[-1].start  # noqa: E731
    assert last(fixed) == pytest.approx(last(free) + 2 * 7e-6)
    derived = metrics(simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe", common))
    gemv = 2 * 5e-6 + 1024 / (1000e9 * tiny_profile().gpu.effective_bandwidth_efficiency)
    assert derived["breakdown_ms"]["predict"] == pytest.approx(6 * gemv * 1e3)


def test_prefetch_count_follows_table_i_per_model():
    from moesim.model.presets import load_preset
    for preset, n in (("qwen3-30b-a3b", 3), ("qwen3-235b-a22b", 3), ("deepseek-v3", 2)):
        model = load_preset(preset)
        system = build_system("smoe")
        ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[8] * model.num_layers)
        system.configure(ctx)
        assert system.prefetch.count == n, preset
        assert not any("no prefetch count" in note for note in ctx.notes)
    model = load_preset("mixtral-8x7b")
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[2] * model.num_layers)
    system = build_system("smoe")
    system.configure(ctx)
    assert system.prefetch.count == 2 and any("no prefetch count for mixtral-8x7b" in note for note in ctx.notes)
    flex = build_system("smoe-flex")
    flex.configure(RunContext(model=load_preset("qwen3-30b-a3b"), costs=ctx.costs, capacity=[8] * 48))
    assert flex.prefetch.count == 3


def test_a_prefetch_count_above_a_layers_slots_is_noted(tmp_path):
    """With one slot per layer, prefetch.n of 1, 2 and 3 give the same replay: a layer cannot take more
    experts than it holds. The notes say so where n exceeds some layer's slots, and only there."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    for capacity, n, noted in (([1, 3], 3, "1 of 2 layers hold fewer slots than prefetch.n=3 (fewest 1)"),
                               ([3, 3], 3, None), ([2, 1], 1, None)):
        system = build_system("smoe", {"prefetch.n": str(n)})
        ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=capacity)
        system.configure(ctx)
        found = [note for note in ctx.notes if "fewer slots than prefetch.n" in note]
        assert found == ([] if noted is None else [f"smoe-token: {noted}: each prefetches at most its slots per step"])
    rng = np.random.default_rng(5)
    path = write_tiny_trace(tmp_path / "t.parquet", model, random_routing(rng, model, 1, 4, 12))
    runs = [metrics(simulate(str(path), tiny_profile(), "smoe", {"cache.slots_per_layer": "1", "prefetch.n": n}))
            for n in ("1", "2", "3")]
    assert runs[0]["prefetches"] > 0
    assert runs[0]["tpot_ms_mean"] == runs[1]["tpot_ms_mean"] == runs[2]["tpot_ms_mean"]
    assert runs[0]["prefetches"] == runs[1]["prefetches"] == runs[2]["prefetches"]


def test_queue_aware_transfer_time_counts_copies_ahead():
    # cpu(n) = 1000 sqrt(n) us, gpu(n) = 100 sqrt(n) + 15 us, one copy 1010 us
    model, profile = tiny_model(layers=1, experts=4, top_k=1), tiny_profile(pcie_gbps=0.049152)
    view = view_for(model, profile, [[0]] * 9 + [[1]] * 4)  # e0: 9 tokens, e1: 4 tokens, nothing cached
    # Alg. 1 as printed: e0 3000 > 315 + 1010 and e1 2000 > 215 + 1010: both on the GPU
    assert SMoEAssign().split(view) == ([0, 1], [])
    # queue-aware: e1's copy waits behind e0's, 2000 < 215 + 2020: the CPU takes it
    assert SMoEAssign(queue_aware=True).split(view) == ([0], [1])
    # a copy of this layer already in flight, arriving in 2000 us, delays e0's too: 3000 < 315 + 3010
    view.arrivals = {3: 2000e-6}
    assert SMoEAssign(queue_aware=True).split(view) == ([], [0, 1])


def test_bad_eviction_mode_is_one_clear_error(tmp_path):
    path = flex_trace(tmp_path / "flex.parquet")
    from moesim.errors import ConfigError
    with pytest.raises(ConfigError, match="prefetch.eviction"):
        simulate(str(path), tiny_profile(), "smoe", {"prefetch.eviction": "lru"})


# ----------------------------------------------------------------------------- replays
def random_decode(rng, model, tokens):
    return [[sorted(rng.choice(model.num_experts, model.top_k, replace=False).tolist())
             for _ in range(model.num_layers)] for _ in range(tokens)]


def test_prefetch_with_accurate_predictor_raises_hit_rate(tmp_path):
    model = tiny_model(layers=2, experts=8, top_k=2)
    rng = np.random.default_rng(0)
    prompt = [[sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(6)] for _ in range(2)]
    trace = decode_trace(tmp_path / "t.parquet", model, random_decode(rng, model, 30), prompt)
    profile = tiny_profile(pcie_gbps=FAST_PCIE)
    common = {"engine.check": "true", "cache.slots_per_layer": "3"}
    with_prefetch = metrics(simulate(str(trace), profile, "smoe", common))
    without = metrics(simulate(str(trace), profile, "smoe", {**common, "prefetch": "none"}))
    assert without["prefetches"] == 2 * 3  # the post-prefill fill only: 3 slots x 2 layers
    assert with_prefetch["prefetches"] > without["prefetches"]
    assert with_prefetch["gpu_hit_rate"] > without["gpu_hit_rate"] + 0.2
    assert with_prefetch["tpot_ms_mean"] < without["tpot_ms_mean"]
    # only the post-prefill fill can be late (the first decode token needs it at once), never a token-wise one
    assert with_prefetch["late_prefetches"] <= without["late_prefetches"]


def test_history_predictor_is_flagged_without_the_column(tmp_path):
    from tests.factories import random_routing, write_tiny_trace
    model = tiny_model(layers=2, experts=8, top_k=2)
    trace = write_tiny_trace(tmp_path / "plain.parquet", model, random_routing(np.random.default_rng(1), model, 1, 4, 6))
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "2"})
    assert any("history predictor" in note for note in result.notes)
    assert metrics(result)["prefetches"] > 0


def test_cache_is_filled_from_prefill_counts_when_the_prefill_ends(tmp_path):
    """Sec. IV-E: the fill is queued by the prefill's last layer, not at the first decode step."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    prompt = [[[0, 1], [0, 1], [0, 2], [3, 4]], [[4, 5], [4, 5], [4, 6], [3, 4]]]
    trace = decode_trace(tmp_path / "t.parquet", model, [[[5, 6], [5, 6]], [[5, 6], [5, 6]]], prompt)
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch": "none"},
                      decisions=True, timeline=True)
    frames = result_to_frames(result)
    log = frames["decisions"]
    fills = log[log.action == "prefetch"]
    assert set(fills.step) == {0} and set(fills.layer) == {1}  # all planned by the prefill's last layer
    # layer 0 counts 0:3 1:2 2:1 3:1 4:1, layer 1 4:4 5:2 3:1 6:1: most used first, ties by id, 3 slots
    assert list(zip(fills.target_layer, fills.expert)) == [(0, 0), (0, 1), (0, 2), (1, 4), (1, 5), (1, 3)]
    timeline = frames["timeline"]
    copies = timeline[(timeline.resource == "pcie") & (timeline.kind == "prefetch")]
    last_prefill_gpu = timeline[(timeline.step == 0) & (timeline.layer == 1) & (timeline.resource == "gpu")]
    assert copies.start_s.min() == pytest.approx(last_prefill_gpu.end_s.max())  # queued after its GPU work


def test_token_wise_prefetch_is_submitted_when_the_layers_gpu_experts_finish(tmp_path):
    """Sec. IV-E: the prefetch task enters the transfer queue once the layer's GPU computation is done."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    prompt = [[[0, 1], [0, 1], [0, 2]]] * 2  # fill: experts 0, 1, 2 of both layers
    trace = decode_trace(tmp_path / "t.parquet", model, [[[0, 1]] * 2, [[0, 1]] * 2, [[5, 6]] * 2], prompt)
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "3"}, timeline=True)
    frame = result_to_frames(result)["timeline"]
    step = frame[frame.step == 2]  # 0, 1, 2 resident (filled after the prefill), next token predicted 5, 6
    for layer in (0, 1):
        here = step[step.layer == layer]
        copies = here[(here.resource == "pcie") & (here.kind == "prefetch")]
        experts = here[(here.resource == "gpu") & (here.kind == "expert")]
        attention_end = here[here.kind == "attention"].end_s.iloc[0]
        # one free slot (LFU evicts 2; 0 and 1 are in use): expert 5 is fetched, after both GPU experts
        assert copies.expert.tolist() == [5]
        assert sorted(experts.expert) == [0, 1]
        assert copies.start_s.iloc[0] == pytest.approx(experts.end_s.max())
        predict = 2 * 5e-6 + 1024 / (1000e9 * tiny_profile().gpu.effective_bandwidth_efficiency)
        assert copies.start_s.iloc[0] * 1e6 == pytest.approx((attention_end + 10e-6 + predict) * 1e6 + 2 * (100 + 15))
