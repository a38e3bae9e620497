"""HybriMoE (baseline of 000_dba2fecbbc66318b.txt): score update, head/tail scheduling, layer-wise prefetch, replays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from moesim.analysis.metrics import metrics
from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, RunContext, active_experts, highest
from moesim.policy.catalog.hybrimoe import LayerWisePrefetch, ScoreAwareCache, hybrid_schedule
from moesim.policy.state import CacheState
from moesim.sim.run import simulate
from moesim.trace import TraceMeta, write_trace
from tests.factories import tiny_model, tiny_profile

LAUNCH = 3 * 5e-6
FAST = 0.49152  # one tiny expert copied in 100 us + 10 us latency


def view_for(model, profile, rows, *, resident=(), in_flight=(), scores=None, phase="decode", layer=0,
             next_layer=None):
    routed = np.array(rows, dtype=np.int16)
    active, counts = active_experts(routed, model.num_experts)
    cache = CacheState(capacity=[4] * model.num_layers)
    cache.resident[layer] = set(resident)
    cache.in_flight[layer] = set(in_flight)
    predictors = {"pred_next_layer": [np.array(p, dtype=np.int16) for p in next_layer]} if next_layer else {}
    return LayerView(0, layer, phase, routed, active, counts, cache, CostModel(profile, model),
                     scores=None if scores is None else np.array(scores, dtype=np.float16),
                     predictors=predictors, expert_launch_s=LAUNCH)


def test_score_update_follows_the_formula():
    model, profile = tiny_model(layers=1, experts=4, top_k=2), tiny_profile()
    cache = ScoreAwareCache(alpha=0.5, top_p=2)
    cache.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4], columns=("scores",)))
    cache.observe(view_for(model, profile, [[1, 2]], scores=[[0.125, 0.5, 0.25, 0.125]]))
    # TopP keeps experts 1 and 2: S = 0.5 * s there, 0 elsewhere
    assert cache.priority(0).tolist() == pytest.approx([0.0, 0.25, 0.125, 0.0])
    cache.observe(view_for(model, profile, [[0, 2]], scores=[[0.5, 0.125, 0.25, 0.125]]))
    # TopP keeps 0 and 2; 1 and 3 decay by (1 - alpha)
    assert cache.priority(0).tolist() == pytest.approx([0.25, 0.125, 0.1875, 0.0])
    view = view_for(model, profile, [[0, 2]], resident=[0, 1, 2, 3])
    assert cache.victims(view, 0, 2, protected={0}) == [3, 1]


def test_top_p_defaults_to_twice_top_k_as_the_public_code_builds_the_cache():
    """modeling_deepseek.py builds ``KScoreAwareCache(..., 0.5, 2 * top_k)``: on a top-2 model of 8 experts
    TopP keeps 4 experts, so the 5th to 8th best scores are not added (their S stays 0). A fixed 12 would keep
    all 8. ``cache.top_p`` set explicitly still wins."""
    model, profile = tiny_model(layers=1, experts=8, top_k=2), tiny_profile()
    scores = [[0.25, 0.1875, 0.125, 0.125, 0.0625, 0.0625, 0.03125, 0.03125]]
    expected = {None: [0.125, 0.09375, 0.0625, 0.0625, 0, 0, 0, 0], 8: [s / 2 for s in scores[0]]}
    for top_p, priority in expected.items():
        cache = ScoreAwareCache() if top_p is None else ScoreAwareCache(top_p=top_p)
        cache.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4], columns=("scores",)))
        cache.observe(view_for(model, profile, [[0, 1]], scores=scores))
        assert cache.priority(0).tolist() == pytest.approx(priority)


def test_scores_fall_back_to_routed_weights_with_a_note():
    model, profile = tiny_model(layers=1, experts=4, top_k=2), tiny_profile()
    cache = ScoreAwareCache(alpha=1.0, top_p=4)
    ctx = RunContext(model=model, costs=CostModel(profile, model), capacity=[4])
    cache.configure(ctx)
    cache.observe(view_for(model, profile, [[1, 2], [1, 3]]))
    assert cache.priority(0).tolist() == pytest.approx([0.0, 0.5, 0.25, 0.25])
    assert "no scores column" in ctx.notes[0]


def test_head_tail_scheduling_on_hand_example():
    # cpu(n) = 100 sqrt(n) us, gpu(n) = 100 sqrt(n) us + 15 us launch, sync 20 us, copy 110 us
    model = tiny_model(layers=1, experts=8, top_k=2)
    profile = tiny_profile(cpu_us=(100.0, 1000.0), pcie_gbps=0.49152)
    # counts: e0 4 (cached), e1 1 (cached), e2 3 (not cached), e3 1 (not cached)
    rows = [[0, 2], [0, 2], [0, 2], [0, 1], [3, 5]]
    view = view_for(model, profile, rows, resident=[0, 1, 5])
    # order: cached by load [0, 1, 5], then uncached [2, 3]
    # 1: head 0 -> GPU 215 | tail 3 -> CPU 20 + 100 = 120: CPU takes 3
    # 2: head 0 -> 215 | tail 2 -> 120 + 173.2 = 293.2: GPU takes 0 (215)
    # 3: head 1 -> 215 + 115 = 330 | tail 2 -> 293.2: CPU takes 2 (293.2)
    # 4: head 1 -> 330 | tail 5 -> 393.2: GPU takes 1 (330)
    # 5: head 5 -> 445 | tail 5 -> 393.2: CPU takes 5
    assert hybrid_schedule(view) == ([0, 1], [3, 2, 5])


def test_uncached_head_waits_for_its_copy():
    model = tiny_model(layers=1, experts=8, top_k=1)
    profile = tiny_profile(cpu_us=(100.0, 1000.0), pcie_gbps=0.49152)
    # e1 cached with 1 token, e2 not cached with 9 tokens
    view = view_for(model, profile, [[1]] + [[2]] * 9, resident=[1])
    # head 1 -> GPU 115 | tail 2 -> CPU 20 + 300 = 320: GPU takes 1
    # head 2 -> max(115, 110) + 300 + 15 = 430 | tail 2 -> 320: CPU takes 2
    assert hybrid_schedule(view) == ([1], [2])
    # with its copy in flight e2 counts as cached (the layer waits for prefetches) and leads the order:
    # head 2 -> 300 + 15 = 315 | tail 1 -> 20 + 100 = 120: CPU takes 1; then 315 < 420: GPU takes 2
    inflight = view_for(model, profile, [[1]] + [[2]] * 9, resident=[1], in_flight=[2])
    assert hybrid_schedule(inflight) == ([2], [1])


def test_prefill_schedules_over_cached_experts_only():
    """000 Sec. VI-B: HybriMoE's prefill runs the cached subset on the GPU and relieves the CPU; it loads
    nothing on demand. Same layer as test_head_tail_scheduling_on_hand_example, with e2 (3 tokens,
    uncached) made heavy: 9 tokens."""
    model = tiny_model(layers=1, experts=8, top_k=2)
    profile = tiny_profile(cpu_us=(100.0, 1000.0), pcie_gbps=0.49152)
    rows = [[0, 2]] * 9 + [[0, 1], [3, 5]]  # e0 10 (cached), e2 9, e1 1 (cached), e3 1, e5 1 (cached)
    decode = view_for(model, profile, rows, resident=[0, 1, 5])
    prefill = view_for(model, profile, rows, resident=[0, 1, 5], phase="prefill")
    # decoding: order [0, 1, 5, 2, 3]; GPU 331.2, CPU 120 -> 3; 331.2 vs 420 -> GPU 0; 446.2 vs 420 -> CPU 2;
    # 446.2 vs 520 -> GPU 1; 561.2 vs 520 -> CPU 5
    assert hybrid_schedule(decode) == ([0, 1], [3, 2, 5])
    # with uncached heavy e2 at the head of the uncached group the GPU would take it if loads were allowed:
    rows2 = [[2, 4]] * 9 + [[0, 1]]  # e2 9, e4 9 uncached; e0 1, e1 1 cached
    allowed = view_for(model, profile, rows2, resident=[0, 1])
    assert 2 in hybrid_schedule(allowed)[0]
    barred = view_for(model, profile, rows2, resident=[0, 1], phase="prefill")
    gpu, cpu = hybrid_schedule(barred, loads=False)
    assert set(gpu) <= {0, 1} and {2, 4} <= set(cpu)
    from moesim.policy.catalog.hybrimoe import HybridScheduling
    assert HybridScheduling().split(barred) == (gpu, cpu)
    gpu, cpu = HybridScheduling().split(prefill)  # the first layout's prefill: heavy uncached e2 on the CPU
    assert set(gpu) <= {0, 1, 5} and 2 in cpu
    assert HybridScheduling(prefill_loads=True).split(barred) == hybrid_schedule(allowed)
    # decode_loads=false: a decode layer keeps its uncached experts on the CPU, as the prefill does
    gpu, cpu = HybridScheduling(decode_loads=False).split(allowed)
    assert (gpu, cpu) == hybrid_schedule(allowed, loads=False) and set(gpu) <= {0, 1} and {2, 4} <= set(cpu)


def test_layer_wise_prefetch_targets_the_next_layer():
    model, profile = tiny_model(layers=3, experts=8, top_k=2), tiny_profile()
    prefetch = LayerWisePrefetch(n=2)
    prefetch.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[4] * 3,
                                  columns=("pred_next_layer",)))
    view = view_for(model, profile, [[0, 1]], next_layer=[[6, 4, 3]])
    view.cache.resident[1] = {6}
    # the 2 best-ranked predictions not cached are 4 and 3 (not just 4 of the top-2 6, 4); the cached 6
    # ranks above them and is listed too, so that the system never evicts it for them
    assert prefetch.candidates(view) == [(1, 6), (1, 4), (1, 3)]
    view.cache.in_flight[1] = {4}  # arriving counts as cached
    assert prefetch.candidates(view) == [(1, 6), (1, 4), (1, 3)]
    prefetch.n = 1
    assert prefetch.candidates(view) == [(1, 6), (1, 4), (1, 3)]  # 3 is the first not cached
    view.cache.in_flight[1] = set()
    assert prefetch.candidates(view) == [(1, 6), (1, 4)]
    assert prefetch.candidates(view_for(model, profile, [[0, 1]], next_layer=[[6]], layer=2)) == []
    assert prefetch.candidates(view_for(model, profile, [[0, 1]], next_layer=[[6]], phase="prefill")) == []


def test_prefetch_never_evicts_a_better_ranked_cached_expert():
    """One slot holding the top-ranked expert: the next-best is not fetched over it."""
    from moesim.policy.systems import build_system
    model, profile = tiny_model(layers=2, experts=8, top_k=2), tiny_profile()
    system = build_system("hybrimoe")
    system.configure(RunContext(model=model, costs=CostModel(profile, model), capacity=[1, 1],
                                columns=("pred_next_layer",)))
    view = view_for(model, profile, [[0, 1]], resident=[0], next_layer=[[6, 4]])
    view.cache.capacity = [1, 1]
    view.cache.resident[1] = {6}
    assert system.plan(view).prefetches == []
    view.cache.resident[1] = {5}  # the resident one is not predicted: 6 replaces it
    plan = system.plan(view)
    assert plan.prefetches == [(1, 6)] and (1, 5) in plan.evictions


def test_prefetch_falls_back_to_priorities():
    model, profile = tiny_model(layers=2, experts=4, top_k=1), tiny_profile()
    ctx = RunContext(model=model, costs=CostModel(profile, model), capacity=[2, 2], columns=("scores",))
    cache, prefetch = ScoreAwareCache(alpha=1.0, top_p=4), LayerWisePrefetch(n=1)
    cache.configure(ctx)
    prefetch.configure(ctx)
    prefetch.use_priorities(cache)
    cache.observe(view_for(model, profile, [[2]], scores=[[0.1, 0.2, 0.6, 0.1]], layer=1))
    assert prefetch.candidates(view_for(model, profile, [[0]])) == [(1, 2)]
    assert any("no pred_next_layer" in note for note in ctx.notes)


# ----------------------------------------------------------------------------- replays
def trace_with_predictor(path: Path, model, prompt: int, decode: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tokens = [[rng.choice(model.num_experts, model.top_k, replace=False).tolist()
               for _ in range(model.num_layers)] for _ in range(prompt + decode)]
    rows = []
    for t, by_layer in enumerate(tokens):
        for layer, experts in enumerate(by_layer):
            nxt = by_layer[layer + 1] if layer + 1 < model.num_layers else []
            rows.append((0 if t < prompt else t - prompt + 1, layer, 0, t, "prefill" if t < prompt else "decode",
                         experts, nxt))
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    data = {name: np.array([r[i] for r in rows]) for i, name in enumerate(("step", "layer", "request", "position"))}
    data["phase"] = [r[4] for r in rows]
    data["experts"] = np.array([r[5] for r in rows], dtype=np.int16)
    data["pred_next_layer"] = [r[6] for r in rows]
    return write_trace(path, data, TraceMeta(model=model, source={"kind": "test"}))


def test_replay_passes_invariants_and_beats_cpu_only_in_prefill(tmp_path):
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = trace_with_predictor(tmp_path / "t.parquet", model, prompt=40, decode=10)
    profile = tiny_profile(pcie_gbps=0.49152)
    hybri = metrics(simulate(str(trace), profile, "hybrimoe", {"engine.check": "true", "cache.slots_per_layer": "3"}))
    ktrans = metrics(simulate(str(trace), profile, "ktransformers", {"engine.check": "true"}))
    # 000 Sec. VI-B: caching and hybrid scheduling relieve the CPU, so HybriMoE's TTFT is below KTransformers'
    assert hybri["ttft_ms"] < ktrans["ttft_ms"]
    assert hybri["prefetches"] > 0 and hybri["gpu_share_of_activations"] > 0


def test_prefill_loads_nothing_and_starts_from_the_preloaded_cache(tmp_path):
    """000 Sec. VI-B's prefill: only the cached subset (preloaded before the first step, as for every
    system) runs on the GPU; no transfer at all in a prefill-only replay."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = trace_with_predictor(tmp_path / "t.parquet", model, prompt=40, decode=0)
    settings = {"engine.check": "true", "cache.slots_per_layer": "3"}
    result = simulate(str(trace), tiny_profile(pcie_gbps=FAST), "hybrimoe", settings)
    lru = simulate(str(trace), tiny_profile(pcie_gbps=FAST), "gpu-only-lru", settings)
    assert result.initial_resident == lru.initial_resident == [[0, 1, 2]] * 3
    m = metrics(result)
    assert m["pcie_h2d_bytes"] == 0 and m["demand_loads"] == 0 and m["gpu_share_of_activations"] > 0
    loading = metrics(simulate(str(trace), tiny_profile(pcie_gbps=FAST), "hybrimoe",
                               {**settings, "assign.prefill_loads": "true"}))
    # loading the heavy uncached experts (streamed: every slot holds an expert this layer runs) is what
    # SMoE adds to the prefill; HybriMoE's prefill without it leaves them to the CPU and takes longer
    assert loading["pcie_h2d_bytes"] > 0 and loading["ttft_ms"] < m["ttft_ms"]


def test_waiting_for_prefetches_shows_as_wait_cache(tmp_path):
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = trace_with_predictor(tmp_path / "t.parquet", model, prompt=2, decode=10)
    profile = tiny_profile(pcie_gbps=0.049152)  # 1 ms copies against 50 us attention: prefetches arrive late
    common = {"engine.check": "true", "cache.slots_per_layer": "3"}
    waiting = metrics(simulate(str(trace), profile, "hybrimoe", common))
    free = metrics(simulate(str(trace), profile, "hybrimoe", {**common, "prefetch.wait": "false"}))
    # waiting for every prefetch, used or not, holds the whole layer back
    assert waiting["tpot_ms_mean"] > free["tpot_ms_mean"]
    assert waiting["breakdown_ms"]["wait_cache"] > 0


def test_scheduling_time_is_charged_as_003_table_6_reports_it(tmp_path):
    """003 Table 6: HybriMoE's scheduling costs 3.01% of end-to-end time. A fixed ``assign.solve_us`` is
    charged once per layer plan on the critical path (category predict): 3 layers x 12 steps x 100 us, and
    the run is longer by exactly that; the default share settles near 3.01% of the run."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    trace = trace_with_predictor(tmp_path / "t.parquet", model, prompt=2, decode=10)
    profile = tiny_profile(pcie_gbps=FAST)
    common = {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch.wait": "false"}
    free = metrics(simulate(str(trace), profile, "hybrimoe", {**common, "assign.solve_us": "0"}))
    fixed = metrics(simulate(str(trace), profile, "hybrimoe", {**common, "assign.solve_us": "100"}))
    plans = 3 * 11  # one prefill step and ten decode steps, three MoE layers each
    assert free["breakdown_ms"]["predict"] == 0.0
    assert fixed["breakdown_ms"]["predict"] == pytest.approx(plans * 0.1)
    assert (fixed["makespan_s"] - free["makespan_s"]) * 1e3 == pytest.approx(plans * 0.1, rel=1e-9)
    share = metrics(simulate(str(trace), profile, "hybrimoe", common))
    assert share["breakdown_ms"]["predict"] / (share["makespan_s"] * 1e3) == pytest.approx(0.0301, rel=0.15)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]), min_size=1, max_size=30), st.integers(0, 35))
def test_top_p_is_a_stable_sorts_first_p(scores, p):
    """TopP: the p highest scores, highest first, ids ascending among ties (ties are common here)."""
    scores = np.array(scores)
    assert highest(scores, p).tolist() == np.argsort(-scores, kind="stable")[:p].tolist()


def test_decode_loads_is_inert_where_the_cpu_finishes_a_steps_experts_before_one_copy():
    """`hybrimoe --set assign.decode_loads=false` gave the bundled Mixtral trace's TPOT unchanged: its decode
    steps are one token routed to 2 experts, and on rtx4090 the CPU runs both (2 x 4.805 ms) before one copy
    lands (13.46 ms), so the rule never loads. The doc says so; with 4 cores the CPU loses and loads happen."""
    import dataclasses

    from moesim.analysis.params import parameter_docs
    from moesim.hw.profile import load_profile
    from moesim.model.presets import load_preset
    from moesim.policy.catalog.hybrimoe import HybridScheduling
    model, profile = load_preset("mixtral-8x7b"), load_profile("rtx4090")
    costs = CostModel(profile, model)
    assert costs.expert_load == pytest.approx(13.46e-3, abs=1e-5)
    assert costs.cpu_expert(1) == pytest.approx(4.805e-3, abs=1e-6) and costs.gpu_expert(1) < 0.4e-3
    # expert 5 (the tail) to the CPU: 4.817 ms < 13.84 ms; then 3: CPU 9.622 ms < GPU 13.84 ms, loads or not
    view = view_for(model, profile, [[3, 5]], resident=(0, 1))
    assert hybrid_schedule(view, loads=True) == hybrid_schedule(view, loads=False) == ([], [5, 3])
    # 4 cores: a CPU expert takes 12.01 ms; 5 still goes to the CPU (12.02 < 13.84 ms), but 3 would end
    # there at 24.0 ms: its copy and kernel end first (13.84 ms), and the GPU loads it
    slow = dataclasses.replace(profile, cpu=dataclasses.replace(profile.cpu, cores=4))
    assert CostModel(slow, model).cpu_expert(1) == pytest.approx(12.01e-3, abs=1e-5)
    assert hybrid_schedule(view_for(model, slow, [[3, 5]], resident=(0, 1)), loads=True) == ([3], [5])
    assert hybrid_schedule(view_for(model, slow, [[3, 5]], resident=(0, 1)), loads=False) == ([], [5, 3])
    trace = str(Path(__file__).parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")
    runs = {(cores, loads): metrics(simulate(trace, "rtx4090", "hybrimoe",
                                             {"assign.decode_loads": loads, "hw.cpu.cores": cores}))
            for cores in ("10", "4") for loads in ("true", "false")}
    assert runs["10", "true"]["demand_loads"] == runs["10", "false"]["demand_loads"] == 0
    assert runs["10", "true"]["tpot_ms_mean"] == runs["10", "false"]["tpot_ms_mean"]
    assert runs["4", "true"]["demand_loads"] > 0 == runs["4", "false"]["demand_loads"]
    assert runs["4", "true"]["tpot_ms_mean"] < runs["4", "false"]["tpot_ms_mean"]
    meaning = next(d.meaning for d in parameter_docs(HybridScheduling) if d.name == "decode_loads")
    assert "bundled Mixtral trace" in meaning and "2 x 4.8 ms" in meaning and "13.5 ms copy" in meaning
    assert "hw.cpu.cores=4" in meaning
