"""Importance-driven scheduling (004_91681cee0e4a4add.txt): router (Alg. 1), top-score prefetch,
score-history eviction (Sec. 5.3), two-pointer balancer (Alg. 2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.analysis.metrics import metrics
from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.model.presets import load_preset
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.importance import (ImportanceRouter, ScoreHistoryCache, TopScorePrefetch,
                                              layer_thresholds, token_thresholds, two_pointer)
from moesim.policy.prefetch import ranked_predictions
from moesim.policy.state import CacheState
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile, write_tiny_trace

SCORES = [0.40, 0.20, 0.15, 0.10, 0.08, 0.07]


def test_thresholds_are_one_plus_and_one_minus_alpha_times_beta():
    high, low, floor = token_thresholds(np.array(SCORES), k=2, alpha=0.5)
    assert low == pytest.approx(0.15)  # beta: the (k+1)-th score
    assert high == pytest.approx(1.5 * 0.15) and floor == pytest.approx(0.5 * 0.15)


def _view(experts, scores, resident, num_experts=6, in_flight=(), phase="decode"):
    model = tiny_model(layers=2, experts=num_experts, top_k=2)
    state = CacheState(capacity=[num_experts, num_experts])
    state.preload(0, sorted(resident))
    state.in_flight[0] = set(in_flight)
    arr = np.array(experts)
    active, counts = active_experts(arr, num_experts)
    return LayerView(0, 0, phase, arr, active, counts, state, CostModel(tiny_profile(), model),
                     scores=np.array(scores, dtype=np.float16))


def test_router_replaces_a_low_score_expert_with_a_resident_alternative():
    router = ImportanceRouter(alpha=0.5)
    # T = 0.225, L = 0.15, R = 0.075: expert 0 (0.40) is top-score, expert 1 (0.20) low-score
    # alternatives: inactive, 0.075 <= score <= 0.15, resident or top-score: only 3 (0.10) is resident
    assert router.rewrite(_view([[0, 1]], [SCORES], {3})) == [(0, 1, 3)]
    # several alternatives: the highest score wins (2, 0.15); 5 (0.07) is below R
    assert router.rewrite(_view([[0, 1]], [SCORES], {2, 3, 5})) == [(0, 1, 2)]
    # a low-score expert already resident stays; so does one when no alternative qualifies
    assert router.rewrite(_view([[0, 1]], [SCORES], {1, 3})) == []
    assert router.rewrite(_view([[0, 1]], [SCORES], {5})) == []
    # alpha = 0.2: T = 0.18, so expert 1 (0.20) is top-score and never replaced
    assert ImportanceRouter(alpha=0.2).rewrite(_view([[0, 1]], [SCORES], {3})) == []


def _reference_router(experts, scores, resident, alpha):
    """Alg. 1 as Sec. 5.1 words it, token by token over full score rows."""
    k = experts.shape[1]
    wide = scores.astype(np.float64)  # a float16 score against a float bound compares in float16 (NEP 50)
    bounds = [token_thresholds(row, k, alpha) for row in wide]
    top = {int(e) for t, row in enumerate(experts) for e in row if wide[t, e] > bounds[t][0]}
    available = set(resident) | top
    out = []
    for t, row in enumerate(experts.tolist()):
        high, low, floor = bounds[t]
        s = scores[t].astype(np.float64)
        needy = sorted((slot for slot, e in enumerate(row) if s[e] <= high and e not in available),
                       key=lambda slot: (s[row[slot]], slot))
        alternatives = sorted((e for e in available if e not in row and floor <= s[e] <= low), key=lambda e: (-s[e], e))
        out += [(t, slot, e) for slot, e in zip(needy, alternatives)]
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_router_for_a_layer_picks_what_token_by_token_alg1_does(data):
    """Thresholds for all tokens from one partition, scores read per token only when it has a replacement to
    make: the same picks as Alg. 1 token by token (ties of scores included: scores drawn from a few values)."""
    n, k = data.draw(st.integers(2, 10)), data.draw(st.integers(1, 4))
    k = min(k, n)
    tokens = data.draw(st.integers(1, 8))
    values = st.sampled_from([0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4]) | st.floats(0.0, 1.0, width=16)
    scores = np.array(data.draw(st.lists(values, min_size=tokens * n, max_size=tokens * n)),
                      dtype=np.float16).reshape(tokens, n)
    experts = np.array([data.draw(st.permutations(range(n)))[:k] for _ in range(tokens)])
    resident = data.draw(st.sets(st.integers(0, n - 1)))
    alpha = data.draw(st.sampled_from([0.0, 0.25, 0.3, 0.5, 1.0]))
    assert layer_thresholds(scores.astype(np.float64), k, alpha) == \
        [token_thresholds(row, k, alpha) for row in scores.astype(np.float64)]
    model = tiny_model(layers=1, experts=n, top_k=k)
    state = CacheState(capacity=[n])
    state.preload(0, sorted(resident))
    active, counts = active_experts(experts, n)
    view = LayerView(0, 0, "decode", experts, active, counts, state, CostModel(tiny_profile(), model), scores=scores)
    assert ImportanceRouter(alpha=alpha).rewrite(view) == _reference_router(experts, scores, resident, alpha)


def test_router_counts_only_resident_experts_as_in_gpu():
    """004 Sec. 5.1: low-score experts "not resident in GPU memory" are replaced by experts "already in GPU
    memory": a prefetch still in flight is neither kept as resident nor offered as an alternative."""
    router = ImportanceRouter(alpha=0.5)
    # expert 1 (low-score) arriving: not in GPU memory yet, so it is replaced by the resident 3
    assert router.rewrite(_view([[0, 1]], [SCORES], {3}, in_flight=[1])) == [(0, 1, 3)]
    # alternatives 2 (0.15, arriving) and 3 (0.10, resident): only 3 qualifies
    assert router.rewrite(_view([[0, 1]], [SCORES], {3}, in_flight=[2])) == [(0, 1, 3)]
    assert router.rewrite(_view([[0, 1]], [SCORES], set(), in_flight=[2, 3])) == []


def test_router_and_balancer_work_in_decoding_only():
    """004 Sec. 4 (Online inference): the prefill is traditional offloading, every routed expert loaded to
    and computed on the GPU; the importance-driven scheduler acts in decoding."""
    from moesim.policy.catalog.importance import TwoPointerBalancer
    router = ImportanceRouter(alpha=0.5)
    assert router.rewrite(_view([[0, 1]], [SCORES], {3}, phase="prefill")) == []
    # resident {3}; a load takes 491.5 ms (100 kB/s), the CPU 1 ms per lone token: Alg. 2 loads the heaviest
    # (0, 3 tokens), then the CPU takes 4, 2 (1 token each) and 1 (2 tokens) while C_load stays ahead
    rows = [[0, 1], [0, 1], [0, 2], [3, 4]]
    decode = _view(rows, [SCORES] * 4, {3})
    prefill = _view(rows, [SCORES] * 4, {3}, phase="prefill")
    balancer = TwoPointerBalancer()
    assert balancer.split(decode) == ([3, 0], [4, 2, 1])
    assert balancer.split(prefill) == (prefill.active, [])


def test_router_alternative_may_be_another_tokens_top_score_expert():
    other = [0.05, 0.05, 0.05, 0.70, 0.10, 0.05]  # token 1's top-score expert is 3
    # nothing resident: token 0's expert 1 is replaced by 3, computed anyway for token 1
    assert ImportanceRouter(alpha=0.5).rewrite(_view([[0, 1], [3, 4]], [SCORES, other], set())) == [(0, 1, 3)]


def test_router_refuses_a_trace_without_scores(tmp_path):
    model = tiny_model()
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             [{"phase": "decode", "tokens": {0: (0, [[[0, 1]], [[2, 3]]])}}])
    with pytest.raises(ConfigError, match="'scores'.*fix:"):
        simulate(str(trace), tiny_profile(), "importance", {})
    router = ImportanceRouter()
    with pytest.raises(ConfigError, match="scores"):  # checked before configure, which then need not
        router.check_columns(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[4, 4],
                                    trace_path="t.parquet", columns=("weights",)))


def test_top_score_prefetch_ranks_by_votes_then_position():
    model = tiny_model(layers=2, experts=6, top_k=2)
    prefetch = TopScorePrefetch(per_token=2, size=2)
    prefetch.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[6, 6],
                                  columns=("pred_next_layer",)))
    view = _view([[0, 1]] * 3, [SCORES] * 3, set())
    view.predictors = {"pred_next_layer": [np.array([4, 2]), np.array([5, 4]), np.array([2, 1])]}
    assert prefetch.candidates(view) == [(1, 2), (1, 4)]  # 2 and 4 have two votes, 2 came first once
    # top-score only: each token's first prediction (4, 5, 2), one vote each, by position then id
    prefetch.per_token, prefetch.size = 1, 0
    assert prefetch.candidates(view) == [(1, 2), (1, 4), (1, 5)]


def test_score_history_evicts_lowest_average_over_n_iterations_with_protection():
    model = tiny_model(layers=1, experts=4, top_k=2)
    cache = ScoreHistoryCache(n=2)
    cache.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[4],
                               columns=("scores",)))
    history = [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.5, 0.05, 0.25, 0.2]]
    for step, scores in enumerate(history):
        view = _view([[0, 1]], [scores], {0, 1, 2, 3}, num_experts=4)
        view.step = step
        cache.observe(view)
    # only the last two iterations count: averages 0.45, 0.175, 0.225, 0.15 (inactive experts included)
    assert np.allclose(cache.average(0), [0.45, 0.175, 0.225, 0.15], atol=1e-3)
    assert cache.victims(view, 0, 2, set()) == [3, 1]
    assert cache.victims(view, 0, 2, {3}) == [1, 2]  # an expert in use is shielded


def test_two_pointer_balancer_alg2():
    counts = {10: 5, 11: 3, 12: 2, 13: 1}
    # l: load 10 (C_load 1); C_load 1 > C_cpu 0 -> CPU 13 (0.4); 1 > 0.4 -> CPU 12 (1.2); 1 <= 1.2 -> load 11
    load, cpu = two_pointer(counts, 1.0, lambda n: 0.4 * n)
    assert load == [10, 11] and cpu == [13, 12]
    assert two_pointer(counts, 1.0, lambda n: 0.4 * n, load_head_start=5.0) == ([], [13, 12, 11, 10])


@pytest.fixture(scope="module")
def ds_like(tmp_path_factory):
    out = tmp_path_factory.mktemp("importance")
    return str(synthesize(SynthConfig.from_settings(model=load_preset("deepseek-v2-lite"), requests=3, prompt_len=8,
                                                    decode_len=16, batch=3, seed=4), out / "t.parquet"))


SETTINGS = {"engine.check": "true", "cache.slots_per_layer": "16"}


def test_importance_replays_with_engine_checks(ds_like):
    m = metrics(simulate(ds_like, "hwprofiles/rtx3090.yaml", "importance", SETTINGS))
    assert m["substituted_experts"] > 0 and m["prefetches"] > 0 and m["cpu_util"] > 0


def test_substituted_weight_mass_is_the_gate_weight_the_router_rewrote(ds_like):
    """The router reads scores only, but the trace's gate weights of the entries it rewrote are what
    ``substituted_weight_mass`` counts: summed here from the rewrites and the trace (0.0 before, weights unread)."""
    import pyarrow.parquet as pq
    result = simulate(ds_like, "hwprofiles/rtx3090.yaml", "importance", SETTINGS)
    table = pq.read_table(ds_like, columns=["step", "layer", "weights"]).to_pandas()
    rows = {key: np.stack(group["weights"].to_numpy()) for key, group in table.groupby(["step", "layer"], sort=False)}
    rewritten = sum(float(rows[key][row, slot]) for key, entries in result.rewrites.items()
                    for row, slot, _ in entries)
    m = metrics(result)
    assert m["substituted_experts"] > 0 and rewritten > 0
    assert m["substituted_weight_mass"] == pytest.approx(rewritten / (len(table) * rows[(0, 0)].shape[1]), rel=1e-5)


def test_expert_cache_router_cuts_loads_and_tpot(ds_like):
    """004 Sec. 6.3 (+ER over +CE): replacing low-score experts with resident ones lowers TPOT."""
    ce = {**SETTINGS, "assign": "gpu", "prefetch": "none", "substitute": "none"}
    er = {**SETTINGS, "assign": "gpu", "prefetch": "none"}
    with_ce = metrics(simulate(ds_like, "hwprofiles/rtx3090.yaml", "importance", ce))
    with_er = metrics(simulate(ds_like, "hwprofiles/rtx3090.yaml", "importance", er))
    assert with_er["demand_loads"] + with_er["streamed_experts"] < with_ce["demand_loads"] + with_ce["streamed_experts"]
    assert with_er["tpot_ms_mean"] < with_ce["tpot_ms_mean"]


# ----------------------------------------------------------------------------- queue clearing (Sec. 5.2)
def clearing_trace(path, layer1_experts):
    """One decode token over 2 layers; layer 0 predicts experts 4, 5, 6 for layer 1."""
    from moesim.trace import TraceMeta, write_trace
    model = tiny_model(layers=2, experts=8, top_k=2)
    data = {"step": np.array([0, 0]), "layer": np.array([0, 1]), "request": np.array([0, 0]),
            "position": np.array([0, 0]), "phase": ["decode", "decode"],
            "experts": np.array([[0, 1], layer1_experts], dtype=np.int16),
            "pred_next_layer": [[4, 5, 6], [0, 1]]}
    return str(write_trace(path, data, TraceMeta(model=model, source={"kind": "test"})))


# LRU instead of score history and no router: the trace needs no scores; the system class still clears.
# Copies take 1000 us + 10 us; LRU preloads experts 0-3 in 4 slots, so the 3 prefetches evict 0, 1, 2 of layer 1.
CLEARING = {"engine.check": "true", "cache": "lru", "substitute": "none", "prefetch.per_token": "3",
            "cache.slots_per_layer": "4"}


def run_clearing(path, **settings):
    from moesim.sim.run import prepare
    sim = prepare(path, tiny_profile(pcie_gbps=0.049152), "importance", {**CLEARING, **settings}, timeline=True)
    return sim, sim.run()


def test_queued_prefetches_are_cancelled_when_the_gate_has_run(tmp_path):
    path = clearing_trace(tmp_path / "t.parquet", [3, 7])
    # layer 0 planned at 50 us runs its resident experts 0 and 1 (115 us each) to 280 us, then the prediction
    # (layer 1's attention and gate, 50 us, 004 Sec. 4.2): the copy of 4 starts at 330 us (ends 1340 us), 5 and
    # 6 wait behind it; layer 1's gate (at 380 us) routes 3 and 7, so 5 and 6 are dropped and their slots free up
    sim, result = run_clearing(path)
    m = metrics(result)
    assert m["prefetches"] == 3 and m["cancelled_prefetches"] == 2
    assert sim.cache.resident[1] == {3, 4} and not sim.cache.in_flight[1] and sim.cache.free(1) == 2
    kept, kept_result = run_clearing(path, **{"prefetch.clear_queue": "false"})
    # nothing dropped while running: 5 starts after layer 1's demand load of 7; 6, still queued when the run
    # ends, copied nothing and counts as cancelled there
    assert metrics(kept_result)["cancelled_prefetches"] == 1
    assert kept.cache.in_flight[1] == {5, 6} and kept.cache.free(1) == 0  # still on their way after the run
    assert [x.expert for x in kept.pcie.queue] == [6]


def test_the_decision_log_names_the_prefetches_a_plan_cancels(tmp_path):
    """The case above: layer 1's plan drops the queued prefetches of 5 and 6. The decision log named their
    prefetch and the evictions that made room, but not their cancellation, so the slots they freed could not be
    followed from it; each is now a ``cancel`` row of the plan that dropped it, one per cancelled prefetch."""
    from moesim.sim.result import result_to_frames as frames_of
    from moesim.sim.run import prepare
    path = clearing_trace(tmp_path / "t.parquet", [3, 7])
    result = prepare(path, tiny_profile(pcie_gbps=0.049152), "importance", CLEARING, decisions=True).run()
    log = frames_of(result)["decisions"]
    cancelled = log[log.action == "cancel"][["step", "layer", "expert", "target_layer"]].values.tolist()
    assert cancelled == [[0, 1, 5, 1], [0, 1, 6, 1]]
    assert len(cancelled) == metrics(result)["cancelled_prefetches"]
    prefetched = log[log.action == "prefetch"][["expert", "target_layer"]].values.tolist()
    assert prefetched == [[4, 1], [5, 1], [6, 1]]


def test_a_queued_prefetch_the_layer_uses_is_kept_as_its_load(tmp_path):
    path = clearing_trace(tmp_path / "t.parquet", [3, 5])
    sim, result = run_clearing(path)
    assert metrics(result)["cancelled_prefetches"] == 1  # only 6
    frame = result_to_frames(result)["timeline"]
    copies = frame[frame.resource == "pcie"].set_index("expert")
    gpu = frame[(frame.resource == "gpu") & (frame.kind == "expert") & (frame.layer == 1)].set_index("expert")
    # 4's copy runs 330-1340 us (after layer 0's resident experts and the prediction), then 5's
    assert copies.loc[5, "start_s"] * 1e6 == pytest.approx(1340) and copies.loc[5, "end_s"] * 1e6 == pytest.approx(2350)
    # expert 5 runs once its weights are there (3 is resident and goes first)
    assert gpu.loc[5, "start_s"] * 1e6 == pytest.approx(2350)
    assert gpu.loc[3, "end_s"] * 1e6 < 2350 and 6 not in copies.index


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=6), min_size=0, max_size=40))
def test_ranked_predictions_order_by_votes_then_position_then_id(rows):
    """Most tokens first, then the best place in a token's list, then the lower id: one token or thousands."""
    votes: dict[int, list[int]] = {}
    for row in rows:
        for position, e in enumerate(row):
            entry = votes.setdefault(e, [0, position])
            entry[0] += 1
            entry[1] = min(entry[1], position)
    expected = sorted(votes, key=lambda e: (-votes[e][0], votes[e][1], e))
    assert ranked_predictions([np.array(row, dtype=np.int16) for row in rows]) == expected


@pytest.mark.parametrize("preset,alpha,noted", [("qwen2-57b-a14b", 0.25, False), ("deepseek-v3", 0.3, True)])
def test_router_alpha_follows_004_per_model(preset, alpha, noted):
    """004 Sec. 6.2: 0.35 in S1, 0.3 in S2, 0.25 in S3 (Qwen2-57B-A14B); S2's 0.3, noted, for other models;
    an explicit alpha is kept."""
    from moesim.model.presets import load_preset
    model = load_preset(preset)
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[4] * model.num_layers,
                     columns=("scores",))
    router = ImportanceRouter()
    router.configure(ctx)
    assert router.threshold == alpha
    assert any("004 sets alpha for its three models only" in note for note in ctx.notes) == noted
    explicit = ImportanceRouter(alpha=0.4)
    explicit.configure(ctx)
    assert explicit.alpha == 0.4


def test_another_prefetch_swapped_into_importance_keeps_plan_time_prefetches(tmp_path):
    """004's prediction timing belongs to the top-score prefetch: with DALI's residual prefetch swapped in
    (which has a prediction cost of its own, charged by the dali system), importance issues the prefetches at
    plan time and runs no prediction on the GPU."""
    from tests.factories import random_routing, write_scored_trace
    model = tiny_model(layers=3, experts=6, top_k=2)
    rng = np.random.default_rng(1)
    trace = write_scored_trace(tmp_path / "t.parquet", model, random_routing(rng, model, 1, 3, 5), rng)
    settings = {"prefetch": "dali-residual", "prefetch.size": "1", "cache.slots_per_layer": "2"}
    result = simulate(trace, tiny_profile(), "importance", settings, timeline=True)
    frame = result_to_frames(result)["timeline"]
    assert result.counters.prefetches > 0
    assert result.counters.breakdown["predict"] == 0.0 and not (frame.kind == "predict").any()
