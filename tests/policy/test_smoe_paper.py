"""SMoE against 000_dba2fecbbc66318b.txt, rule by rule: cases worked by hand for what test_smoe.py leaves
open (Alg. 1's strict inequality, LFU's tie-break, Adaptive eviction with nothing to load, the empty cache
of the prefill, Fig. 14's prediction-only point, the cost of the cache updates in a replay, Alg. 1's CPU thread beside
the GPU pipeline with Fig. 11a's prefill breakdown, the pipeline on and off of Fig. 10, the fill of
prompts prefilled back to back, and Fig. 8's decode layer)."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.hw.cost import CostModel
from moesim.policy.base import RunContext
from moesim.policy.catalog.smoe import SMoEAssign, SMoELFUCache, TokenWisePrefetch
from moesim.policy.systems import build_system
from moesim.sim.bookkeeping import BREAKDOWN
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import tiny_model, tiny_profile
from tests.policy.test_smoe import FAST_PCIE, decode_trace, view_for

#: the token-wise predictor on the tiny model: a 64 x 8 bf16 GEMV (1,024 bytes at 1000 GB/s x the
#: profile's efficiency) plus two 5 us launches
def gemv_s() -> float:
    return 2 * 5e-6 + 1024 / (1000e9 * tiny_profile().gpu.effective_bandwidth_efficiency)


# ----------------------------------------------------------------------------- Alg. 1, line 3
def test_alg1_needs_the_cpu_strictly_slower_a_tie_stays_on_the_cpu():
    """Line 3 sends e to G only when T_CPU(e) > T_GPU(e) + T_PCIe. With GPU and CPU curves equal
    (100 sqrt(n) us both), no launch time and e resident (T_PCIe = 0), both sides are equal at every
    token count: the expert stays in C. One microsecond more on the CPU tips it to the GPU."""
    model = tiny_model(layers=1, experts=4, top_k=2)
    even = tiny_profile(cpu_us=(100.0, 1000.0), pcie_gbps=FAST_PCIE)
    view = view_for(model, even, [[0, 1], [0, 1], [0, 2]], resident=[0, 1, 2])
    view.expert_launch_s = 0.0
    assert view.costs.cpu_expert(3) == view.costs.gpu_expert(3)  # e0: 3 tokens, 173.2 us either side
    assert SMoEAssign().split(view) == ([], [0, 1, 2])
    slower = view_for(model, tiny_profile(cpu_us=(101.0, 1010.0), pcie_gbps=FAST_PCIE), [[0, 1], [0, 1], [0, 2]],
                      resident=[0, 1, 2])
    slower.expert_launch_s = 0.0
    assert SMoEAssign().split(slower) == ([0, 1, 2], [])


# ----------------------------------------------------------------------------- Sec. IV-E, LFU
def test_lfu_ties_go_to_the_least_recently_activated_then_the_lower_id():
    """Sec. IV-E evicts the least frequently activated; 000 gives no tie-break, moesim takes the
    expert routed longest ago, then the lower id. Observations: {0, 1}, then {2, 3}: all counted once,
    0 and 1 earlier, so 0 then 1 go first. Then {0, 3}: counts 0:2 1:1 2:1 3:2; 1 (seen at the first
    observation) before 2 (second), then 0 before 3 (same count, same observation, lower id)."""
    model = tiny_model(layers=1, experts=4, top_k=2)
    profile = tiny_profile()
    cache = SMoELFUCache()
    cache.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4]))
    full = view_for(model, profile, [[0, 1]], phase="decode", resident=[0, 1, 2, 3])
    for rows in ([[0, 1]], [[2, 3]]):
        cache.observe(view_for(model, profile, rows, phase="decode"))
    assert cache.victims(full, 0, 2, set()) == [0, 1]
    cache.observe(view_for(model, profile, [[0, 3]], phase="decode"))
    assert [cache.frequency(0, e) for e in range(4)] == [2, 1, 1, 2]
    assert cache.victims(full, 0, 4, set()) == [1, 2, 0, 3]
    assert cache.victims(full, 0, 3, {1}) == [2, 0, 3]


def test_the_cache_is_empty_until_the_prefill_ends(tmp_path):
    """Sec. IV-E: the decode cache's slots are allocated and filled once the prefill ends, so SMoE starts
    a replay with nothing resident (other systems start from their preloaded first experts)."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    trace = decode_trace(tmp_path / "t.parquet", model, [[[0, 1]] * 2], [[[0, 1], [0, 2]]] * 2)
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "3"})
    assert result.initial_resident == [[], []]


def planned(settings: dict[str, str], preds: list[int]):
    """One decode layer, 4 slots holding 0-3 with counts 0:5 1:1 2:3 3:2 (then 0 and 2 routed now)."""
    model, profile = tiny_model(layers=1, experts=8, top_k=2), tiny_profile(pcie_gbps=FAST_PCIE)
    system = build_system("smoe", settings)
    system.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4],
                                columns=("pred_next_token",)))
    for expert, times in {0: 5, 1: 1, 2: 3, 3: 2}.items():
        for _ in range(times):
            system.cache.observe(view_for(model, profile, [[expert, 7]], phase="decode"))
    system.cache._order[0][7] = (0, 0, 7)  # the filler expert 7 only made the rows two wide
    view = view_for(model, profile, [[0, 2]], phase="decode", resident=[0, 1, 2, 3], preds=[preds])
    return system.plan(view)


def test_adaptive_eviction_loads_nothing_when_the_top_n_are_cached():
    """Sec. IV-E, Adaptive: only the top-N predictions missing from the cache are loaded, 0 to N of them.
    Predictions 3, 1, 5 with N = 2: the top two (3 and 1) are both cached, so nothing moves, nothing is
    evicted, and no cache update is charged; Fixed-N loads 5 over the least frequent of the others
    (1:1, 3:2 once 0 and 2 are routed; 1 goes even though it is predicted: 000 names the N least
    frequently activated as the ones replaced, not the least frequent of those not predicted)."""
    adaptive = planned({"prefetch.eviction": "adaptive", "prefetch.n": "2"}, [3, 1, 5])
    assert adaptive.prefetches == [] and adaptive.evictions == []
    assert adaptive.overhead_s == {"predict": pytest.approx(gemv_s())}
    fixed = planned({"prefetch.eviction": "fixed", "prefetch.n": "2"}, [3, 1, 5])
    # Fixed-N wants two new experts, but the prediction names only one uncached: one transfer
    assert fixed.prefetches == [(0, 5)] and fixed.evictions == [(0, 1)]
    assert fixed.overhead_s == {"predict": pytest.approx(gemv_s()), "cache_management": pytest.approx(10e-6)}


# ----------------------------------------------------------------------------- Fig. 14
def test_prefetch_n_zero_is_prediction_without_prefetch():
    """Fig. 14's x-axis: -1 is the initial cache alone (moesim: prefetch=none), 0 is the predictor run
    with nothing prefetched. With prefetch.n=0 the predictor's GEMV is charged on the layer; nothing is
    loaded or evicted, and no cache update is charged."""
    plan = planned({"prefetch.n": "0"}, [5, 6])
    assert plan.prefetches == [] and plan.evictions == []
    assert plan.overhead_s == {"predict": pytest.approx(gemv_s())}
    none = planned({"prefetch": "none"}, [5, 6])
    assert none.prefetches == [] and none.overhead_s == {}


def test_prefetch_n_zero_in_a_replay_charges_the_predictor_on_every_decode_layer(tmp_path):
    """Two layers, three decode steps, predict_us=7: 6 predictions of 7 us with n=0, none with
    prefetch=none; both move only the post-prefill fill (3 slots x 2 layers)."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    prompt = [[[0, 1], [0, 1], [0, 2]]] * 2
    trace = decode_trace(tmp_path / "t.parquet", model, [[[5, 6]] * 2] * 3, prompt)
    common = {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch.predict_us": "7"}
    zero = metrics(simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe", {**common, "prefetch.n": "0"}))
    assert zero["breakdown_ms"]["predict"] == pytest.approx(6 * 7e-3)
    assert zero["prefetches"] == 6 and zero["breakdown_ms"]["cache_management"] == 0.0
    none = metrics(simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                            {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch": "none"}))
    assert none["breakdown_ms"]["predict"] == 0.0 and none["prefetches"] == 6


# ----------------------------------------------------------------------------- Sec. VI-E
def test_breakdown_has_sec_vi_e_categories_and_charges_each_cache_update(tmp_path):
    """Sec. VI-E's six categories are reported. Cache management (about 0.01 ms, Sec. VI-E) is charged
    on each decode layer whose plan prefetches, never in the prefill. The fill after the prefill puts 0, 1,
    2 in both layers' 3 slots (counts 0:3 1:2 2:1). Decode tokens route [0, 1], [0, 1], then [5, 6]; the
    perfect predictor names the next token's experts (the last token itself). Step 1 (next: 0, 1, cached)
    prefetches nothing. Step 2 (next: 5, 6) wants both, but 0 and 1 are in use, so only 2 can make room:
    5 comes in over 2. Step 3 (next: 5, 6; 5 cached) wants 6, over the less used of 0 (5 uses) and 1 (4):
    1. Four prefetching plans, 4 x 10 us."""
    for category in ("predict", "cache_management", "gpu_compute", "wait_cache", "shared_expert", "cpu_other"):
        assert category in BREAKDOWN
    model = tiny_model(layers=2, experts=8, top_k=2)
    prompt = [[[0, 1], [0, 1], [0, 2]]] * 2
    trace = decode_trace(tmp_path / "t.parquet", model, [[[0, 1]] * 2, [[0, 1]] * 2, [[5, 6]] * 2], prompt)
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch.predict_us": "0"},
                      decisions=True)
    log = result_to_frames(result)["decisions"]
    decode = log[log.step >= 1]
    prefetched = decode[decode.action == "prefetch"]
    assert sorted(zip(prefetched.step, prefetched.layer, prefetched.expert)) == [
        (2, 0, 5), (2, 1, 5), (3, 0, 6), (3, 1, 6)]
    evicted = decode[decode.action == "evict"]
    assert sorted(zip(evicted.step, evicted.layer, evicted.expert)) == [(2, 0, 2), (2, 1, 2), (3, 0, 1), (3, 1, 1)]
    assert metrics(result)["breakdown_ms"]["cache_management"] == pytest.approx(4 * 10e-3)


# ----------------------------------------------------------------------------- Alg. 1, G's order
def test_prefill_streams_the_gpu_experts_heaviest_first():
    """Sec. IV-B picks the top-K experts by load; Alg. 1 copies G[1] first and each next one into the
    buffer freed two experts back. G is in load order, not id order: tokens route e3 x4, e1 x3, e0 x1
    (100 us copies, cpu 1000 sqrt(n) against gpu 100 sqrt(n) + 15 + 110: every one goes to the GPU),
    so the pipeline streams 3, 1, 0."""
    model, profile = tiny_model(layers=1, experts=4, top_k=2), tiny_profile(pcie_gbps=FAST_PCIE)
    system = build_system("smoe")
    system.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[2],
                                columns=("pred_next_token",)))
    view = view_for(model, profile, [[3, 1], [3, 1], [3, 1], [3, 0]], capacity=2)
    assert view.active == [3, 1, 0]
    plan = system.plan(view)
    assert plan.gpu == plan.streamed == [3, 1, 0] and plan.cpu == [] and plan.loads == []


# ----------------------------------------------------------------------------- SMoE-Flex
def test_flex_switches_off_the_floor_of_half_the_layers_lower_layer_first_on_ties():
    """Sec. VI-D: half of the layers, those of lower accuracy. Five layers: floor(2.5) = 2 off; equal
    accuracies go lower layer first (000 gives no tie-break)."""
    from moesim.policy.catalog.smoe.prefetch import least_accurate
    assert least_accurate(np.array([0.5, 0.2, 0.5, 0.2, 0.9]), 0.5) == [1, 3]
    assert least_accurate(np.array([0.5, 0.5, 0.5, 0.5, 0.5]), 0.5) == [0, 1]
    assert least_accurate(np.array([0.9, 0.1, 0.5, 0.5, 0.3]), 0.5) == [1, 4]


# ----------------------------------------------------------------------------- Alg. 1 lines 8-23, Sec. VI-C
SLOW_PCIE = 0.049152  # one tiny expert's copy: 1000 us + 10 us latency


def prefill_run(tmp_path, settings: dict[str, str], prompt=None):
    """One layer, one request; by default 6 prompt tokens: e0 x4, e1 x2, e2-e7 x1 each."""
    model = tiny_model(layers=1, experts=8, top_k=2)
    prompt = prompt or [[[0, 1], [0, 1], [0, 2], [0, 3], [4, 5], [6, 7]]]
    trace = decode_trace(tmp_path / "t.parquet", model, [], prompt)
    return simulate(str(trace), tiny_profile(pcie_gbps=SLOW_PCIE), "smoe",
                    {"engine.check": "true", **settings}, decisions=True)


def test_prefill_runs_the_cpu_thread_beside_the_gpu_pipeline_and_breaks_down_as_fig_11a(tmp_path):
    """Alg. 1 splits the experts (lines 1-6) and runs C on the CPU while G streams through the GPU
    (parbegin/parend, lines 8-23). Copies take 1010 us, cpu(n) = 1000 sqrt(n) us, gpu(n) = 100 sqrt(n)
    + 15 us: the GPU wins from 2 tokens on (900 sqrt(2) > 1025), so G = [e0, e1] and the six
    one-token experts go to C. From t1 (embedding and attention):
      GPU: e0's copy 0-1010, e0 1010-1225 (200 + 15); e1's copy 1010-2020, e1 2020-2176.42 (141.42 + 15)
      CPU: sync 20 us, then six experts of 1000 us: 20-6020
    Fig. 11a's prefill breakdown: GPU = 215 + 156.42 us, PCIe (copy time not hidden) = 1010 + 795 us,
    Wait CPU = 6020 - 2176.42 us (the sync is hidden behind the GPU's work)."""
    result = prefill_run(tmp_path, {})
    log = result_to_frames(result)["decisions"]
    step0 = log[(log.step == 0) & (log.target_layer == 0)]
    assert sorted(step0[step0.action == "cpu"].expert) == [2, 3, 4, 5, 6, 7]
    assert step0[step0.action == "gpu_stream"].expert.tolist() == [0, 1]
    g4, g2 = 100 * 2 + 15, 100 * 2 ** 0.5 + 15
    gpu_end = 2020 + g2
    breakdown = metrics(result)["breakdown_ms"]
    assert breakdown["gpu_compute"] == pytest.approx((g4 + g2) * 1e-3)
    assert breakdown["wait_cache"] == pytest.approx((1010 + (2020 - (1010 + g4))) * 1e-3)
    assert breakdown["cpu_other"] == pytest.approx((20 + 6000 - gpu_end) * 1e-3)
    assert breakdown["sync"] == 0.0
    t1 = 6 * 64 * 2 / 600e9 * 1e6 + 6 * 50
    lm_head_and_sampling = (100 * 64 * 2 + 3 * 4 * 100) / 600e9 * 1e6
    assert metrics(result)["ttft_ms"] == pytest.approx((t1 + 6020 + lm_head_and_sampling) / 1e3)


def test_prefill_pipeline_overlaps_the_next_copy_with_the_current_expert(tmp_path):
    """Fig. 10/11a compare SMoE with and without its pipeline. Without it (one staging buffer,
    engine.staging_slots=1), e1's copy waits for e0 to finish with the buffer: the GPU ends at
    1010 + 215 + 1010 + 156.42 us past t1 instead of 2020 + 156.42, e0's 215 us no longer hidden;
    the PCIe share grows by the same 215 us. The CPU (6020 us) still decides the layer, so the TTFT
    is the same: the pipeline pays only where the GPU side is the longer one. With two tokens
    routing [e0, e1] each, both go to the GPU and nothing to the CPU: the GPU ends at 2020 + 156.42
    us pipelined and at 1010 + 156.42 + 1010 + 156.42 without, the TTFT 156.42 us apart."""
    piped = metrics(prefill_run(tmp_path, {}))
    serial = metrics(prefill_run(tmp_path, {"engine.staging_slots": "1"}))
    g4, g2 = 100 * 2 + 15, 100 * 2 ** 0.5 + 15
    assert serial["breakdown_ms"]["wait_cache"] == pytest.approx(2 * 1010e-3)
    assert serial["breakdown_ms"]["wait_cache"] - piped["breakdown_ms"]["wait_cache"] == pytest.approx(g4 * 1e-3)
    assert serial["breakdown_ms"]["cpu_other"] == pytest.approx((6020 - (2020 + g4 + g2)) * 1e-3)
    assert serial["ttft_ms"] == pytest.approx(piped["ttft_ms"])
    both = [[[0, 1], [0, 1]]]
    piped = metrics(prefill_run(tmp_path, {}, both))
    serial = metrics(prefill_run(tmp_path, {"engine.staging_slots": "1"}, both))
    assert piped["breakdown_ms"]["cpu_other"] == serial["breakdown_ms"]["cpu_other"] == 0.0
    assert piped["breakdown_ms"]["gpu_compute"] == pytest.approx(2 * g2 * 1e-3)
    assert serial["ttft_ms"] - piped["ttft_ms"] == pytest.approx(g2 * 1e-3)


# ----------------------------------------------------------------------------- Sec. IV-E, the initial cache
def test_prompts_prefilled_back_to_back_fill_the_cache_from_all_their_counts(tmp_path):
    """Sec. IV-E fills the decode cache with the experts the prefill activated most. Two prompts
    prefilled in steps 0 and 1 and then decoded together have one prefill: the cache it leaves holds
    the most used experts of both, counted together. One layer, 2 slots, no token-wise prefetch.
      step 0, request 0: [0, 1] x2, [0, 2]: counts 0:3 1:2 2:1, fill {0, 1}
      step 1, request 1: [3, 2] x2, [4, 5], [6, 7], [4, 6], [5, 7]: every expert twice; with request 0
        0:3 2:3 1:2 3:2 ...: the top two are 0 and 2 (ties by id), so 2 comes in over 1
        (request 1's counts alone would give 2 and 3, over both 0 and 1)
      step 2: both decode [0, 2]
      step 3, request 2: [5, 6], [5, 7]: a new prefill after decoding starts a new count: 5:2 6:1 7:1,
        fill {5, 6} over 0 and 2 (counting on from steps 0-1 would give 5:4 0:3 2:3 6:3, {5, 0})."""
    from tests.factories import write_tiny_trace
    model = tiny_model(layers=1, experts=8, top_k=2)
    steps = [
        {"phase": "prefill", "tokens": {0: (0, [[[0, 1], [0, 1], [0, 2]]])}},
        {"phase": "prefill", "tokens": {1: (0, [[[3, 2], [3, 2], [4, 5], [6, 7], [4, 6], [5, 7]]])}},
        {"phase": "decode", "tokens": {0: (3, [[[0, 2]]]), 1: (6, [[[0, 2]]])}},
        {"phase": "prefill", "tokens": {2: (0, [[[5, 6], [5, 7]]])}},
    ]
    trace = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "2", "prefetch": "none"}, decisions=True)
    log = result_to_frames(result)["decisions"]
    moved = lambda step, action: sorted(log[(log.step == step) & (log.action == action)].expert)  # noqa: E731
    assert moved(0, "prefetch") == [0, 1] and moved(0, "evict") == []
    assert moved(1, "prefetch") == [2] and moved(1, "evict") == [1]
    assert moved(3, "prefetch") == [5, 6] and moved(3, "evict") == [0, 2]


# ----------------------------------------------------------------------------- Sec. IV-C, Fig. 8
def test_decode_runs_a_hit_on_the_gpu_beside_a_miss_on_the_cpu_and_shared_experts_on_the_gpu(tmp_path):
    """Sec. IV-C / Fig. 8: in decoding the routed experts split between the devices and run at once; a
    miss is never loaded (it runs on the CPU), the shared expert always runs on the GPU. One layer with
    a shared expert, 3 slots filled with 0, 1, 2 after the prompt ([0, 1] x2, [0, 2]). The predictor
    names only cached experts (nothing is prefetched). Decode token 2 routes [0, 5]:
      the predictor (GEMV) first, on the GPU after the attention: the plan waits for it (Sec. VI-E
      counts predict_time in the layer's time), then
      GPU: shared expert 115 us, e0 (hit) 115 us
      CPU: sync 20 us, e5 (miss) 1000 us: the layer ends 1020 us after the predictor, CPU-bound
    The step: embedding + attention 50 us + GEMV + 1020 us + LM head and sampling."""
    model = tiny_model(layers=1, experts=8, top_k=2, shared=True)
    trace = decode_trace(tmp_path / "t.parquet", model, [[[0, 1]], [[0, 5]]], [[[0, 1], [0, 1], [0, 2]]],
                         predictor="wrong")
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST_PCIE), "smoe",
                      {"engine.check": "true", "cache.slots_per_layer": "3"}, decisions=True)
    log = result_to_frames(result)["decisions"]
    last = log[log.step == 2]
    assert sorted(zip(last.action, last.expert)) == [("cpu", 5), ("gpu_hit", 0)]
    assert metrics(result)["prefetches"] == 3  # the fill alone
    step = result.steps[-1]
    embedding, output = 64 * 2 / 600e9, (100 * 64 * 2 + 3 * 4 * 100) / 600e9
    assert step.end - step.start == pytest.approx(embedding + 50e-6 + gemv_s() + 1020e-6 + output)
    # the shared expert on the GPU at every step: 3 prompt tokens, then one token twice
    shared = (100 * 3 ** 0.5 + 15) + 2 * 115
    assert metrics(result)["breakdown_ms"]["shared_expert"] == pytest.approx(shared * 1e-3)


# ----------------------------------------------------------------------------- Table I, per model
def test_table_i_count_is_resolved_for_each_model_a_system_is_configured_for():
    """prefetch.n=-1 means Table I's count for the run's model: 3 on Qwen3, 2 on DeepSeek-V3. A system
    configured for Qwen3 and then again for DeepSeek-V3 prefetches 2 there: of the predictions 10, 11,
    12, 13 (none cached) Fixed-N loads 10 and 11. (It kept Qwen3's 3: the first run's resolution
    overwrote the parameter.)"""
    from moesim.model.presets import load_preset
    qwen, deepseek = load_preset("qwen3-30b-a3b"), load_preset("deepseek-v3")
    prefetch = TokenWisePrefetch()
    for model in (qwen, deepseek):
        prefetch.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model),
                                      capacity=[8] * model.num_layers, columns=("pred_next_token",)))
    view = view_for(deepseek, tiny_profile(), [list(range(8))], phase="decode", capacity=8, preds=[[10, 11, 12, 13]])
    assert prefetch.candidates(view) == [(0, 10), (0, 11)]
    assert prefetch.n == -1
