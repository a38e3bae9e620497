"""Importance-driven scheduling (004_91681cee0e4a4add.txt) against the paper, mechanism by mechanism: each
test works a tiny case by hand in its comments and asserts the plan or number 004's rule gives."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.hw.profile import load_profile
from moesim.model.presets import load_preset
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.importance import (
    ImportanceRouter,
    StaticFirstCache,
    TopScorePrefetch,
    TwoPointerBalancer,
)
from moesim.policy.state import CacheState
from moesim.policy.systems import SYSTEMS
from tests.factories import tiny_model, tiny_profile


def view_of(experts, scores=None, resident=(), num_experts=8, layers=2, layer=0, phase="decode", step=0):
    model = tiny_model(layers=layers, experts=num_experts, top_k=len(experts[0]))
    state = CacheState(capacity=[num_experts] * layers)
    state.preload(layer, sorted(resident))
    arr = np.array(experts)
    active, counts = active_experts(arr, num_experts)
    return LayerView(step, layer, phase, arr, active, counts, state, CostModel(tiny_profile(), model),
                     scores=None if scores is None else np.array(scores, dtype=np.float64))


# ----------------------------------------------------------------------------- 004 Sec. 6.1: the software
def test_importance_runs_on_the_pytorch_runtime():
    """004 Sec. 6.1 builds the system on PyTorch (Python without the GIL) with the transformers library's
    model code; Sec. 7 names KTransformers as another system, left out of the comparison. Its launches are
    PyTorch's eager ones: on the a100-40g profile 115 non-expert kernels per layer at 16 us each."""
    assert SYSTEMS["importance"].runtime == "pytorch-eager"
    model = load_preset("deepseek-v3")
    costs = CostModel(load_profile("a100-40g"), model, runtime_name=SYSTEMS["importance"].runtime)
    assert costs.layer_launches("decode") == pytest.approx(115 * 16e-6)


# ----------------------------------------------------------------------------- 004 Sec. 5.1, Alg. 1
# One token, top-3 of 8 experts, alpha = 0.5. Scores, highest first: 0 (0.30), 1 (0.12), 2 (0.11), 3 (0.10),
# 4 (0.09), 5 (0.08), 6 (0.02), 7 (0.01). beta, the 4th highest, is 0.10: T = 0.15, L = 0.10, R = 0.05.
# Routed 0, 1, 2: 0 is top-score (0.30 > T); 1 and 2 are low-score. Alternatives are inactive experts scoring
# in [R, L] that are resident or top-score for some token: of 3, 4, 5 (6 and 7 lie below R).
ROW = [0.30, 0.12, 0.11, 0.10, 0.09, 0.08, 0.02, 0.01]


def test_router_with_fewer_alternatives_than_needy_experts_keeps_the_best_low_score_ones():
    """Alg. 1 lines 20-22: |A_t| = 1 < |B_t| = 2, so A_t joins E[t] and the top |B_t| - |A_t| = 1 low-score
    expert (1, 0.12) keeps its place: the lowest-scoring one (2, 0.11) is the one replaced, by 4."""
    router = ImportanceRouter(alpha=0.5)
    assert router.rewrite(view_of([[0, 1, 2]], [ROW], resident={4})) == [(0, 2, 4)]
    # |A_t| = 2 >= |B_t| = 2 (lines 18-19): both replaced, the highest alternative (3) taking the lowest slot
    assert router.rewrite(view_of([[0, 1, 2]], [ROW], resident={3, 5})) == [(0, 2, 3), (0, 1, 5)]


def test_router_keeps_a_low_score_expert_that_is_another_tokens_top_score_expert():
    """Sec. 5.1: a low-score expert in the top-score set C stays. Token 1 routes 1, 6, 7 with beta = 0.01 and
    T = 0.015, so all three are top-score and C = {0, 1, 6, 7}. Token 0's expert 1 is in C and stays; only
    expert 2 needs an alternative: 4 (resident, 0.09); 6 and 7 are in C but score below R for token 0."""
    other = [0.01, 0.60, 0.01, 0.01, 0.01, 0.01, 0.15, 0.12]
    router = ImportanceRouter(alpha=0.5)
    assert router.rewrite(view_of([[0, 1, 2], [1, 6, 7]], [ROW, other], resident={4})) == [(0, 2, 4)]


def test_router_bounds_at_exactly_t_l_and_r():
    """The readings at the bounds. Top-2, alpha = 0.5, scores 0 (0.5), 1 (0.375), 2 (0.25), 3 (0.125):
    beta = 0.25, T = 0.375, L = 0.25, R = 0.125, all exact in binary. Expert 1 scores exactly T: Alg. 1
    line 6 (> T) and line 13 (< T) would leave it in neither group, dropping it from E[t]; Sec. 5.1's text
    ("above" T is top-score) makes it low-score, so it can be replaced. The alternatives' range is closed at
    both ends: expert 2 at exactly L (the (k+1)-th expert) and expert 3 at exactly R qualify."""
    row = [0.5, 0.375, 0.25, 0.125, 0.0, 0.0, 0.0, 0.0]
    router = ImportanceRouter(alpha=0.5)
    assert router.rewrite(view_of([[0, 1]], [row], resident={2})) == [(0, 1, 2)]
    assert router.rewrite(view_of([[0, 1]], [row], resident={3})) == [(0, 1, 3)]
    assert router.rewrite(view_of([[0, 1]], [row], resident={4})) == []  # 4 scores 0 < R


# ----------------------------------------------------------------------------- 004 Sec. 5.2
def _prefetch(**params):
    model = tiny_model(layers=2, experts=8, top_k=3)
    prefetch = TopScorePrefetch(**params)
    prefetch.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[8, 8],
                                  columns=("pred_next_layer",)))
    return prefetch


def test_top_score_prefetch_per_token_zero_queues_each_tokens_whole_prediction():
    """Sec. 5.2 read literally: each token's top-k predicted experts go to the load queue, highest first.
    Token 0 predicts 4, 2, 7; token 1 predicts 2, 5, 4. Votes: 2 and 4 two each (2 ranks first for token 1,
    4 for token 0: a tie on position, the lower id first), then 5 and 7 one each (5 at position 1, 7 at 2).
    per_token=1 takes the first of each: 4 and 2, one vote each at position 0, the lower id first."""
    view = view_of([[0, 1, 3], [0, 1, 3]])
    view.predictors = {"pred_next_layer": [np.array([4, 2, 7]), np.array([2, 5, 4])]}
    assert _prefetch(per_token=0).candidates(view) == [(1, 2), (1, 4), (1, 5), (1, 7)]
    assert _prefetch(per_token=1).candidates(view) == [(1, 2), (1, 4)]


def test_top_score_prefetch_refuses_a_negative_count():
    with pytest.raises(ConfigError, match="prefetch.per_token"):
        _prefetch(per_token=-1)


# ----------------------------------------------------------------------------- 004 Sec. 4.2 GPU (2)-(4), Sec. 6.3
# When the prefetch goes out. One decode token, 2 layers, 8 experts, top-2, LRU over 4 slots a layer (experts
# 0-3 preloaded), no router (no scores needed). Layer 0 routes 0 (resident) and 6 (a demand load) and
# predicts 7 for layer 1, which routes 7 and 3. Tiny profile: attention and gate 50 us, a GPU expert
# 100 us + 3 launches x 5 us = 115 us, no per-layer launches; embedding 0.2133 ns before layer 0.
SEC42 = {"engine.check": "true", "cache": "lru", "substitute": "none", "cache.slots_per_layer": "4"}


def _sec42_run(tmp_path, pcie_gbps, timeline=True, **settings):
    from moesim.sim.run import prepare
    from moesim.trace import TraceMeta, write_trace
    model = tiny_model(layers=2, experts=8, top_k=2)
    data = {"step": np.array([0, 0]), "layer": np.array([0, 1]), "request": np.array([0, 0]),
            "position": np.array([0, 0]), "phase": ["decode", "decode"],
            "experts": np.array([[0, 6], [7, 3]], dtype=np.int16), "pred_next_layer": [[7], [0, 1]]}
    path = tmp_path / "sec42.parquet"
    if not path.exists():
        write_trace(path, data, TraceMeta(model=model, source={"kind": "test"}))
    sim = prepare(str(path), tiny_profile(pcie_gbps=pcie_gbps), "importance", {**SEC42, **settings},
                  timeline=timeline)
    return sim.run()


def _spans(result):
    """(resource, kind, layer, expert) -> (start, end) in us, less the 0.2133 ns embedding."""
    from moesim.sim.result import result_to_frames
    frame = result_to_frames(result)["timeline"]
    skew = 64 * 2 / 600e9
    out = {}
    for row in frame.itertuples():
        out.setdefault((row.resource, row.kind, row.layer, row.expert), []).append(
            ((row.start_s - skew) * 1e6, (row.end_s - skew) * 1e6))
    return out


US = 1e-6


def test_prefetch_waits_for_resident_experts_and_the_gpu_prediction(tmp_path):
    """004 Sec. 4.2: the GPU computes the resident experts (2), then predicts the next layer's experts by
    running that layer's attention and gate on their results (3), and only then can the prefetch go; then
    it computes the newly loaded experts (4). A copy takes 49,152 B / 491.52 MB/s + 10 us = 110 us.

    Layer 0, by hand: attention 0-50 us; plan at 50: demand load of 6 on the idle link, 50-160 us. GPU:
    expert 0 (resident) 50-165, the prediction (layer 1's attention and gate: 50 us) 165-215, and the
    prefetch of 7 submitted at 215 us: the link has been idle since 160, and still the copy starts at 215,
    ending 325. Expert 6 landed at 160 but the GPU is busy until 215 (the GPU is the bottleneck here): it
    runs 215-330, 50 us later than without the prediction. Layer 1 (the last: no prediction): attention
    330-380; 7 arrived at 325, so 7 and 3 are both resident: 380-495, 495-610. ``predict``: 50 us, once."""
    result = _sec42_run(tmp_path, pcie_gbps=0.49152)
    spans = _spans(result)
    assert spans[("pcie", "load", 0, 6)] == [pytest.approx((50, 160))]
    assert spans[("gpu", "expert", 0, 0)] == [pytest.approx((50, 165))]
    # the prediction's span (it runs layer 1's attention and gate), after layer 0's own attention
    assert spans[("gpu", "attention", 0, -1)] == [pytest.approx((0, 50))]
    assert spans[("gpu", "predict", 0, -1)] == [pytest.approx((165, 215))]
    assert spans[("pcie", "prefetch", 1, 7)] == [pytest.approx((215, 325))]
    assert spans[("gpu", "expert", 0, 6)] == [pytest.approx((215, 330))]
    assert spans[("gpu", "expert", 1, 3)] == [pytest.approx((495, 610))]
    b = result.counters.breakdown
    assert b["predict"] == pytest.approx(50 * US) and b["wait_cache"] == 0.0
    assert b["attention"] == pytest.approx(100 * US)  # the two layers' own; the prediction is not in it
    # the GPU never idles: 2 x 50 attention + 50 prediction + 4 x 115 experts + 23.5 ns embedding and head
    assert result.makespan_s == pytest.approx(610.0235467 * US)
    assert result.counters.gpu_busy_s == pytest.approx(result.makespan_s)
    # the closed-form path (no timeline: the demand load laid out at once) gives the same schedule
    fast = _sec42_run(tmp_path, pcie_gbps=0.49152, timeline=False)
    assert fast.makespan_s == result.makespan_s and fast.counters.breakdown == b


def test_the_prediction_hides_in_the_wait_when_the_link_is_the_bottleneck(tmp_path):
    """The same case on a 49.152 MB/s link: a copy takes 1000 + 10 us. Layer 0: 6 loads 50-1060 us; expert 0
    50-165, the prediction 165-215, then 6 waits for its copy (845 us of ``wait_cache``, 50 less than the 895
    of plan-time prefetching) and runs 1060-1175; the prefetch of 7 queues behind the demand load, 1060-2070.
    Layer 1: attention 1175-1225, 3 (resident) 1225-1340, 7 waits to 2070 and runs to 2185, as without the
    prediction: it costs nothing on the critical path here."""
    new, old = (_sec42_run(tmp_path, pcie_gbps=0.049152, **s) for s in ({}, {"prefetch.after_resident": "false"}))
    assert _spans(new)[("pcie", "prefetch", 1, 7)] == [pytest.approx((1060, 2070))]
    assert new.counters.breakdown["predict"] == pytest.approx(50 * US)
    assert new.counters.breakdown["wait_cache"] == pytest.approx((845 + 730) * US)
    assert old.counters.breakdown["wait_cache"] == pytest.approx((895 + 730) * US)
    assert new.makespan_s == pytest.approx(old.makespan_s) == pytest.approx(2185.0235467 * US)


def test_prefetch_timing_ablations_restore_the_plan_time_prefetch_or_a_free_prediction(tmp_path):
    """``prefetch.after_resident=false``: the old timing, the prefetch queued at plan time (50 us) behind the
    demand load of 6, so its copy runs 160-270 us; 6 runs as soon as it lands and the GPU is free, 165-280;
    no ``predict``; layer 1 330-560 (attention 280-330). ``prefetch.predict_cost=false``: the prefetch still
    waits for the resident expert 0 (to 165 us) but the prediction takes no time: copy 165-275, 6 at
    165-280, the same makespan as the plan-time prefetch."""
    plan_time = _sec42_run(tmp_path, pcie_gbps=0.49152, **{"prefetch.after_resident": "false"})
    spans = _spans(plan_time)
    assert spans[("pcie", "prefetch", 1, 7)] == [pytest.approx((160, 270))]
    assert spans[("gpu", "expert", 0, 6)] == [pytest.approx((165, 280))]
    assert plan_time.counters.breakdown["predict"] == 0.0
    assert plan_time.makespan_s == pytest.approx(560.0235467 * US)
    free = _sec42_run(tmp_path, pcie_gbps=0.49152, **{"prefetch.predict_cost": "false"})
    spans = _spans(free)
    assert spans[("pcie", "prefetch", 1, 7)] == [pytest.approx((165, 275))]
    assert spans[("gpu", "expert", 0, 6)] == [pytest.approx((165, 280))]
    assert free.counters.breakdown["predict"] == 0.0 and free.makespan_s == plan_time.makespan_s


def test_prediction_cost_is_the_next_layers_attention_and_gate():
    """Sec. 5.2: the prediction runs the next layer's attention (over its KV cache) and gate: the cost
    model's attention (gate included) for the step's tokens and context, no launches (kernels_per_layer
    counts a whole layer's); none in the prefill, at the last layer, or with after_resident=false; 0 with
    predict_cost=false."""
    model = load_preset("deepseek-v3")
    costs = CostModel(load_profile("a100-40g"), model, runtime_name="pytorch-eager")
    prefetch = TopScorePrefetch()
    prefetch.configure(RunContext(model=model, costs=costs, capacity=[8] * model.num_layers,
                                  columns=("pred_next_layer",)))
    state = CacheState(capacity=[8] * model.num_layers)
    arr = np.array([list(range(model.top_k))])
    view = LayerView(0, 0, "decode", arr, arr[0].tolist(), [1] * model.top_k, state, costs, context=300)
    assert prefetch.prediction_s(view) == costs.attention(1, 300) > 0
    view.context = 900  # a later step reads more context
    assert prefetch.prediction_s(view) == costs.attention(1, 900) > costs.attention(1, 300)
    view.layer = model.num_layers - 1
    assert prefetch.prediction_s(view) is None
    view.layer, view.phase = 0, "prefill"
    assert prefetch.prediction_s(view) is None
    view.phase = "decode"
    assert TopScorePrefetch(after_resident=False).prediction_s(view) is None
    free = TopScorePrefetch(predict_cost=False)
    free.configure(RunContext(model=model, costs=costs, capacity=[8] * model.num_layers,
                              columns=("pred_next_layer",)))
    assert free.prediction_s(view) == 0.0


# ----------------------------------------------------------------------------- 004 Sec. 5.3
def test_score_history_window_includes_the_iteration_being_planned():
    """Sec. 5.3 through the importance system: 2 slots, experts 0 and 1 resident, layer 0 of step 1 routes
    expert 2, which must be loaded over one of them. Step 0's scores: 0 -> 0.1, 1 -> 0.9; step 1's:
    0 -> 0.3, 1 -> 0.1, 2 -> 0.6. With n = 2 the averages are 0 -> 0.2, 1 -> 0.5: expert 0 goes. With
    n = 1 only step 1 counts (its gate has run when the eviction is decided): expert 1 goes."""
    from moesim.policy.systems import build_system
    model = tiny_model(layers=2, experts=4, top_k=1)
    for n, victim in ((2, 0), (1, 1)):
        system = build_system("importance", {"cache.n": str(n), "assign": "gpu", "prefetch": "none",
                                             "substitute": "none"})
        system.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[2, 2],
                                    columns=("scores",)))
        state = CacheState(capacity=[2, 2])
        state.preload(0, [0, 1])
        for step, (experts, scores) in enumerate((([[1]], [0.1, 0.9, 0.0, 0.0]), ([[2]], [0.3, 0.1, 0.6, 0.0]))):
            arr = np.array(experts)
            active, counts = active_experts(arr, 4)
            view = LayerView(step, 0, "decode", arr, active, counts, state, CostModel(tiny_profile(), model),
                             scores=np.array([scores]))
            plan = system.plan(view)
        assert plan.evictions == [(0, victim)] and plan.loads == [2]


def test_static_first_baseline_keeps_the_first_experts_and_never_evicts():
    """Sec. 6.3's baseline: some experts stay in GPU memory for good (the first ones here) and no eviction
    ever makes room: a missing expert runs where the assignment puts it (the CPU, with assign=resident)."""
    cache = StaticFirstCache()
    assert cache.initial(0, 3) == [0, 1, 2]
    assert cache.victims(view_of([[5]], resident={0, 1, 2}), 0, 1, set()) == []


# ----------------------------------------------------------------------------- 004 Sec. 5.4, Alg. 2
def test_balancer_splits_only_the_experts_not_on_the_gpu():
    """Alg. 2 on the tiny profile: a load takes 491.52 ms + 10 us, the CPU 1 ms per lone token and 10 ms at
    100 tokens (linear in between: 1 + 9 (B - 1) / 99 ms). Resident: 0. Tokens: 0 x3 (GPU, resident),
    1 x2, 2 x1, 3 x1. Sorted by tokens: 1, 2, 3 (ties by id). C_load 0 <= C_cpu 0: load 1 (C_load 491.5 ms);
    then C_load > C_cpu: the CPU takes 3 (1 ms), then 2 (2 ms in all): still below C_load."""
    view = view_of([[0, 1], [0, 1], [0, 2], [0, 3]], resident={0})
    assert TwoPointerBalancer().split(view) == ([0, 1], [3, 2])


def _drop_trace(tmp_path):
    """One decode token, 2 layers of 12 experts, top-4. Layer 0 routes 0-3 and predicts 8, 9, 10 for layer 1,
    which routes 0, 1, 2, 4."""
    from moesim.trace import TraceMeta, write_trace
    model = tiny_model(layers=2, experts=12, top_k=4)
    data = {"step": np.array([0, 0]), "layer": np.array([0, 1]), "request": np.array([0, 0]),
            "position": np.array([0, 0]), "phase": ["decode", "decode"],
            "experts": np.array([[0, 1, 2, 3], [0, 1, 2, 4]], dtype=np.int16),
            "pred_next_layer": [[8, 9, 10], [0, 1]]}
    return str(write_trace(tmp_path / "drop.parquet", data, TraceMeta(model=model, source={"kind": "test"})))


def test_balancer_counts_only_the_copy_on_the_wire_not_the_queued_prefetches(tmp_path):
    """Alg. 2's load pointer starts where the link can take this layer's first load. Sec. 5.2 clears the
    queued prefetches once the gate has run (and a demand load overtakes them anyway), so only the prefetch
    already on the wire delays it.

    By hand: a copy takes 49,152 B / 49.152 MB/s + 10 us = 1010 us, the CPU 1000 us per lone token (after a
    20 us sync), a GPU expert 115 us, attention 50 us. LRU over 8 slots a layer, experts 0-7 preloaded.
    Layer 0: attention 0-50, its resident 0-3 50-510, the prediction 510-560; the prefetches of 8, 9, 10 evict
    layer 1's 0, 1, 2; 8 goes on the wire 560-1570, 9 and 10 queue. Layer 1: attention 560-610, plan at 610:
    4 resident, 0, 1, 2 one token each. 9 and 10 are dropped; the link is free at 1570, 960 us away. Alg. 2
    from C_load = 960: 960 > C_cpu 0, the CPU takes 2 (1000); 960 <= 1000, load 0 (1970); 1970 > 1000, the
    CPU takes 1 (2000). Load of 0: 1570-2580, run 2580-2695; CPU 2 630-1630, 1 1630-2630: the step ends at
    2695 us. (Counting 9 and 10 as well, C_load started at 3590 - 610 = 2980 and the CPU took all three,
    ending at 3630 us.)"""
    from moesim.analysis.metrics import metrics
    from moesim.sim.run import simulate
    settings = {"engine.check": "true", "cache": "lru", "substitute": "none", "prefetch.per_token": "3",
                "cache.slots_per_layer": "8"}
    result = simulate(_drop_trace(tmp_path), tiny_profile(pcie_gbps=0.049152), "importance", settings,
                      timeline=True)
    spans = _spans(result)
    assert spans[("pcie", "prefetch", 1, 8)] == [pytest.approx((560, 1570))]
    assert spans[("pcie", "load", 1, 0)] == [pytest.approx((1570, 2580))]
    assert spans[("gpu", "expert", 1, 0)] == [pytest.approx((2580, 2695))]
    assert spans[("cpu", "expert", 1, 2)] == [pytest.approx((630, 1630))]
    assert spans[("cpu", "expert", 1, 1)] == [pytest.approx((1630, 2630))]
    assert metrics(result)["cancelled_prefetches"] == 2
    assert result.makespan_s == pytest.approx(2695.0235467 * US)


def test_balancer_load_pointer_starts_at_zero_while_a_copy_engine_is_idle():
    """The same rule with two copy engines: one prefetch (of 7) on the wire for 5 ms leaves the other engine
    idle, so C_load starts at 0 (Alg. 2 line 1). Tokens: 0 x3 resident; 1, 2, 3 one each, not on the GPU;
    a load takes 491.5 ms, the CPU 1 ms an expert. C_load 0 <= 0: load 1; then the CPU takes 3 and 2. With one
    engine the link is busy for 5 ms: C_load 5 ms > C_cpu, and the CPU takes 3, 2 and 1 (3 ms in all)."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    for engines, split in ((2, ([0, 1], [3, 2])), (1, ([0], [3, 2, 1]))):
        costs = CostModel(tiny_profile(copy_engines=engines), model)
        view = view_of([[0, 1], [0, 2], [0, 3]], resident={0})
        view.costs, view.now = costs, 1.0
        view.cache.in_flight[0] = {7}
        view.arrivals = {7: 1.0 + 5e-3}
        balancer = TwoPointerBalancer()
        balancer.configure(RunContext(model=model, costs=costs, capacity=[8, 8]))
        assert balancer.split(view) == split


def test_score_history_never_evicts_an_expert_the_layer_uses():
    """Sec. 5.3's protection shield through the importance system: 2 slots, 0 and 1 resident; step 0 scores
    0 -> 0.1, 1 -> 0.9; step 1 routes 0 and 2 with 0 -> 0.2, 1 -> 0.8, 2 -> 0.5. Averages over n = 2:
    0 -> 0.15, 1 -> 0.85: 0 has the lowest, but the layer computes it, so 1 makes room for 2."""
    from moesim.policy.systems import build_system
    model = tiny_model(layers=2, experts=4, top_k=2)
    system = build_system("importance", {"cache.n": "2", "assign": "gpu", "prefetch": "none", "substitute": "none"})
    system.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[2, 2],
                                columns=("scores",)))
    state = CacheState(capacity=[2, 2])
    state.preload(0, [0, 1])
    for step, (experts, scores) in enumerate((([[0, 1]], [0.1, 0.9, 0.0, 0.0]), ([[0, 2]], [0.2, 0.8, 0.5, 0.0]))):
        arr = np.array(experts)
        active, counts = active_experts(arr, 4)
        plan = system.plan(LayerView(step, 0, "decode", arr, active, counts, state,
                                     CostModel(tiny_profile(), model), scores=np.array([scores])))
    assert plan.evictions == [(0, 1)] and plan.loads == [2]


def test_alpha_is_resolved_for_each_model_the_router_is_configured_for():
    """substitute.alpha=-1 means 004 Sec. 6.2's alpha for the run's model: 0.35 on deepseek-moe-16b, 0.25 on
    Qwen2-57B-A14B. Configured for the first and then again for Qwen2, it uses 0.25 there (it kept 0.35: the
    first run's resolution overwrote the parameter)."""
    router = ImportanceRouter()
    for name in ("deepseek-moe-16b", "qwen2-57b-a14b"):
        model = dataclasses.replace(tiny_model(layers=2, experts=8, top_k=2), name=name)
        router.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[8, 8],
                                    columns=("scores",)))
    assert (router.threshold, router.alpha) == (0.25, -1.0)
