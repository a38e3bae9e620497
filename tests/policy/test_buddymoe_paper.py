"""BuddyMoE (002_95ae8307b42d2a8d.txt) worked by hand: from co-activation counts to the buddy a token gets
(Eq. 3-6 with Alg. 1), an arriving expert in Alg. 1 and Eq. 2, and settings that have nothing to act on."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.buddymoe import BuddySubstitution, buddy_lists, coactivation, substitute_buddies
from moesim.policy.state import CacheState
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile


def test_the_buddy_a_token_gets_is_the_highest_q_resident_peer_within_the_cft_prefix():
    """Calibration on 5 experts, top-2: expert 0 runs with 1 three times, with 2 twice, with 3 once.

    Eq. 4 (no smoothing): q_{.|0} = (0, 3/6, 2/6, 1/6, 0). Eq. 5: alpha 0.8 is first reached by the
    prefix (1, 2) (0.5, then 0.833), alpha 0.9 needs (1, 2, 3) (1.0). Eq. 3 with eta = kappa = 0 (002's
    default) ranks by q alone, so Alg. 1 takes the first resident peer in that order.
    """
    calibration = np.array([[0, 1]] * 3 + [[0, 2]] * 2 + [[0, 3]])
    m = coactivation(calibration, 5)
    assert m[0].tolist() == [0, 3, 2, 1, 0]
    tight, broad = buddy_lists(m, 0.8, 16, 0.0), buddy_lists(m, 0.9, 16, 0.0)
    assert tight[0] == [1, 2] and broad[0] == [1, 2, 3]
    assert buddy_lists(m, 0.9, 1, 0.0)[0] == [1]  # K_max caps the list
    token = np.array([[0, 4]])  # expert 0 is missing, 4 resident
    assert substitute_buddies(token, {1, 2, 3, 4}, {1, 2, 3, 4}, tight, 16) == [(0, 0, 1)]  # q 1/2
    assert substitute_buddies(token, {2, 3, 4}, {2, 3, 4}, tight, 16) == [(0, 0, 2)]  # 1 absent: q 1/3
    # only 3 resident: outside alpha 0.8's prefix, so 0 is fetched as routed; alpha 0.9 reaches it
    assert substitute_buddies(token, {3, 4}, {3, 4}, tight, 16) == []
    assert substitute_buddies(token, {3, 4}, {3, 4}, broad, 16) == [(0, 0, 3)]


def _view(rows, resident, arriving, weights):
    model = tiny_model(layers=1, experts=5, top_k=2)
    state = CacheState(capacity=[5])
    state.preload(0, sorted(resident))
    state.in_flight[0].update(arriving)
    experts = np.array(rows)
    active, counts = active_experts(experts, 5)
    return LayerView(0, 0, "decode", experts, active, counts, state, CostModel(tiny_profile(), model),
                     weights=np.array(weights, dtype=np.float32))


def _calibration(tmp_path, drop=()):
    path = synthesize(SynthConfig.from_settings(model=tiny_model(layers=1, experts=5, top_k=2), requests=1,
                                                prompt_len=64, decode_len=0, seed=3), tmp_path / "cal.parquet")
    if drop:
        table = pq.read_table(path)
        pq.write_table(table.drop_columns([c for c in drop if c in table.column_names]), path)
    return str(path)


def _configured(calibration, columns=(), **params):
    model = tiny_model(layers=1, experts=5, top_k=2)
    sub = BuddySubstitution(calibration=calibration, **params)
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[5], columns=columns)
    sub.configure(ctx)
    return sub, ctx.notes


def test_an_arriving_expert_is_on_the_gpu_for_alg1_and_for_eq2(tmp_path):
    """Resident {0, 1, 2}, expert 3 arriving (prefetched), expert 4 in CPU memory; buddies 3 -> 0, 4 -> 0.

    Layer requests {3, 4}. Counting 3 as on the GPU, delta = 1/2 < beta = 0.75: the gate is open, 3 is
    left to arrive and 4 becomes 0. Counting it on the CPU would give delta = 2/2 >= 0.75 (no replacement).
    """
    sub, _ = _configured(_calibration(tmp_path), beta=0.75, tau=0.0)
    sub._buddies = [[[1], [0], [0], [0], [0]]]
    assert sub.rewrite(_view([[3, 4]], {0, 1, 2}, {3}, [[0.5, 0.5]])) == [(0, 1, 0)]
    # nothing arriving: both are missing, delta = 1 >= 0.75, the gate closes
    assert sub.rewrite(_view([[3, 4]], {0, 1, 2}, set(), [[0.5, 0.5]])) == []


def test_weighted_coactivation_without_probabilities_says_it_counted_binary(tmp_path):
    """002 Sec. 3.3 (i) weights co-activations by min(p_i, p_j): a calibration trace with neither weights
    nor scores has no p, so ``weighted=true`` gives the binary lists; the report must say so."""
    bare = _calibration(tmp_path, drop=("weights", "scores"))
    binary, _ = _configured(bare, tau=0.5)
    weighted, notes = _configured(bare, tau=0.5, weighted=True)
    assert weighted._buddies == binary._buddies
    assert any("weighted" in n and "binary" in n for n in notes), notes


def test_a_replayed_trace_without_probabilities_says_the_tae_gate_is_off(tmp_path):
    """Eq. 1 needs each token's top-k probabilities: a replayed trace with neither weights nor scores lets
    every token through whatever tau is; the report must say so (once)."""
    calibration = _calibration(tmp_path)
    (tmp_path / "bare").mkdir()
    bare_calibration = _calibration(tmp_path / "bare", drop=("weights", "scores"))
    bare = ("request", "step", "phase", "position", "layer", "experts")
    for cal in (calibration, bare_calibration):
        for tau in (0.5, -1.0):
            _, notes = _configured(cal, columns=bare, tau=tau)
            assert sum("TAE gate" in n for n in notes) == 1, notes
    _, notes = _configured(calibration, columns=bare + ("weights",), tau=0.5)
    assert not any("TAE gate" in n for n in notes)


def test_two_layers_with_their_own_alpha_get_lists_of_their_own_length_from_the_same_counts(tmp_path):
    """002 Sec. 3.3's per-layer alpha_l: both MoE layers of a 5-expert, top-2 model see the same six tokens,
    expert 0 with 1 three times, with 2 twice, with 3 once; no smoothing (epsilon 0).

    Eq. 4 in both layers: q_{.|0} = (0, 3/6, 2/6, 1/6, 0); q_{0|1} = q_{0|2} = q_{0|3} = 1 (each ran only
    with 0); expert 4 never ran. Eq. 5 at expert 0: alpha 0.9 is first reached by the prefix (1, 2, 3)
    (0.5, 0.833, 1.0), alpha 0.8 by (1, 2) (0.833). So layer 0 (alpha 0.9) lists 0 -> [1, 2, 3], layer 1
    (alpha 0.8) 0 -> [1, 2]; 1, 2, 3 -> [0] and 4 -> [] in both. One alpha for both gives equal lists.
    """
    from moesim.policy.catalog.buddymoe import alpha_schedule
    from tests.factories import write_tiny_trace
    model = tiny_model(layers=2, experts=5, top_k=2)
    tokens = [[0, 1]] * 3 + [[0, 2]] * 2 + [[0, 3]]
    path = write_tiny_trace(tmp_path / "two.parquet", model,
                            [{"phase": "prefill", "tokens": {0: (0, [tokens, tokens])}}])
    assert alpha_schedule("0.9:0.8", 2) == [0.9, 0.8]  # a two-layer schedule is its two ends

    def lists(alpha):
        sub = BuddySubstitution(calibration=str(path), epsilon=0.0)
        sub.set_param("alpha", alpha)
        ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[5, 5])
        sub.configure(ctx)
        return sub._buddies, ctx.notes

    for per_layer in ("[0.9,0.8]", "0.9:0.8"):
        buddies, notes = lists(per_layer)
        assert buddies[0] == [[1, 2, 3], [0], [0], [0], []]
        assert buddies[1] == [[1, 2], [0], [0], [0], []]
        # the report: each layer's alpha and the mean length of its non-empty lists, (3+1+1+1)/4 and (2+1+1+1)/4
        assert f"buddy: per-layer alpha {per_layer} over 2 MoE layers (002 Sec. 3.3); layer 0: alpha 0.9, mean " \
               "|B| 1.50; layer 1: alpha 0.8, mean |B| 1.25" in notes
    buddies, notes = lists("0.8")
    assert buddies[0] == buddies[1] == [[1, 2], [0], [0], [0], []]
    assert not any("per-layer alpha" in n for n in notes)  # one number: the report as before


# ----------------------------------------------------------------------------- TAE temperature T and margin gamma
# 002 Sec. 3.1 (ii): p~(x; T) = softmax(z/T) restricted to S(x); with z = log p + c that is p_i^(1/T) renormalized.
# Sec. 3.1's margin: replacement is forbidden when (TAE <= tau) or (p~max - p~2nd >= gamma).
def test_temperature_smooths_the_tae_of_a_hand_worked_token(tmp_path):
    """Top-2 probabilities (0.6, 0.2) renormalize to (0.75, 0.25).

    T = 1: H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.215762 + 0.346574 = 0.562335 nats; TAE = H / ln 2 = 0.811278.
    T = 2: (sqrt 0.6, sqrt 0.2) = (0.774597, 0.447214), sum 1.221811 -> (0.633975, 0.366025) (sqrt 3 : 1);
    H = 0.633975 * 0.455725 + 0.366025 * 1.005052 = 0.656803; TAE = 0.947571: smoother, higher.
    T = 0.5: (0.36, 0.04) -> (0.9, 0.1); H = 0.9 * 0.105361 + 0.1 * 2.302585 = 0.325082; TAE = 0.468996: lower.
    Margins p~max - p~2nd: 0.5, 0.267949 and 0.8. With tau = 0.9 the token is barred at T = 1 (0.811 <= 0.9)
    and let through at T = 2 (0.948 > 0.9): its missing expert 3 takes buddy 0.
    """
    from moesim.policy.catalog.buddymoe import margin, tae, tempered, token_tae
    token = np.array([[0.6, 0.2]])
    assert tempered(token, 2.0)[0] == pytest.approx([0.633975, 0.366025], abs=1e-6)
    for t, expected, m in ((1.0, 0.811278, 0.5), (2.0, 0.947571, 0.267949), (0.5, 0.468996, 0.8)):
        assert tae(token, t)[0] == pytest.approx(expected, abs=1e-6)
        assert token_tae([0.6, 0.2], t) == pytest.approx(expected, abs=1e-6)
        assert margin(token, t)[0] == pytest.approx(m, abs=1e-6)
    cal = _calibration(tmp_path)
    rows, resident = [[1, 3]], {0, 1, 2}  # expert 3 missing: delta = 1/2 < beta = 1
    for t, expected in ((1.0, []), (2.0, [(0, 1, 0)])):
        sub, _ = _configured(cal, tau=0.9, tae_temperature=t)
        sub._buddies = [[[1], [0], [0], [0, 2], [1, 0]]]
        assert sub.rewrite(_view(rows, resident, set(), [[0.6, 0.2]])) == expected
        # the many-tokens path (over 16 tokens) decides the same for each copy of the token
        many = sub.rewrite(_view(rows * 20, resident, set(), [[0.6, 0.2]] * 20))
        assert many == [(row, 1, 0) for row in range(20) if expected]


def test_a_margin_at_or_above_gamma_bars_a_token_the_tae_lets_through(tmp_path):
    """Weights (0.75, 0.25): TAE 0.811278 > tau = 0.5, so the TAE alone lets the token through; its margin
    is 0.75 - 0.25 = 0.5. gamma = 0.5: m >= gamma, barred (the equality bars); gamma = 0.6: allowed; the
    default (off) and gamma above 1 (m never exceeds 1) change nothing. At T = 2 the margin is 0.267949
    (sqrt 3 : 1 -> 0.633975 - 0.366025), below gamma = 0.5: allowed again."""
    cal = _calibration(tmp_path)
    rows, resident, weights = [[1, 3]], {0, 1, 2}, [[0.75, 0.25]]
    outcomes = {}
    for settings in ({}, {"margin": 0.5}, {"margin": 0.6}, {"margin": 1.5},
                     {"margin": 0.5, "tae_temperature": 2.0}):
        sub, _ = _configured(cal, tau=0.5, **settings)
        sub._buddies = [[[1], [0], [0], [0, 2], [1, 0]]]
        outcomes[tuple(settings.items())] = (sub.rewrite(_view(rows, resident, set(), weights)),
                                             len(sub.rewrite(_view(rows * 20, resident, set(), weights * 20))))
    assert outcomes[()] == ([(0, 1, 0)], 20)
    assert outcomes[(("margin", 0.5),)] == ([], 0)
    assert outcomes[(("margin", 0.6),)] == outcomes[(("margin", 1.5),)] == outcomes[()]
    assert outcomes[(("margin", 0.5), ("tae_temperature", 2.0))] == outcomes[()]


def _weighted_trace(path, tokens):
    """One MoE layer of 5 experts, top-2: one prefill token per pair of weights, routed to experts (0, 1)."""
    from moesim.trace import TraceMeta, write_trace
    n = len(tokens)
    data = {"step": np.zeros(n, dtype=np.int64), "layer": np.zeros(n, dtype=np.int64),
            "request": np.zeros(n, dtype=np.int64), "position": np.arange(n), "phase": ["prefill"] * n,
            "experts": np.array([[0, 1]] * n, dtype=np.int16),
            "weights": np.array(tokens, dtype=np.float32)}
    return str(write_trace(path, data, TraceMeta(model=tiny_model(layers=1, experts=5, top_k=2),
                                                 source={"kind": "test"})))


def test_the_calibrated_tau_is_the_percentile_of_the_tae_at_the_gates_temperature(tmp_path):
    """Five calibration tokens; the 25th percentile of five values is the second smallest (index 0.25 * 4 = 1,
    no interpolation).

    T = 1, the TAEs: (1, 0) -> 0; (0.9, 0.1) -> 0.468996; (0.75, 0.25) -> 0.811278; (0.6, 0.4) -> 0.970951;
    (0.5, 0.5) -> 1. tau = 0.468996.
    T = 2: (1, 0) -> 0; (0.9, 0.1) -> (sqrt 0.9, sqrt 0.1) = (0.948683, 0.316228), 3 : 1 -> (0.75, 0.25):
    0.811278, the second smallest again (top-2: T keeps the order). tau = 0.811278, the TAE of the quantity
    the gate compares at T = 2; the T = 1 percentile would bar at 0.468996 what T = 2 puts at 0.811278.
    """
    cal = _weighted_trace(tmp_path / "w.parquet", [[1.0, 0.0], [0.9, 0.1], [0.75, 0.25], [0.6, 0.4], [0.5, 0.5]])
    taus = {t: _configured(cal, tau=-1.0, tau_percentile=25.0, tae_temperature=t)[0]._tau for t in (1.0, 2.0)}
    assert taus[1.0] == [pytest.approx(0.468996, abs=1e-6)]
    assert taus[2.0] == [pytest.approx(0.811278, abs=1e-6)]


def test_top_k_prefetch_count_is_resolved_for_each_model_a_system_is_configured_for():
    """Fig. 3's next-layer prefetch loads one gate's worth (``size=-1``: the model's top_k) per layer.

    One prefetcher configured for a top-2 model and then for a top-4 one: a decode layer whose three tokens
    predict (5, 6), (6, 7), (6, 4) at the next layer ranks 6 (three votes), then 5, 4, 7 (one each; 5 first
    at position 0, then 4 and 7 at position 1 by id), so top-2 loads 6, 5 and top-4 all four. The parameter
    stays -1: the count is the run's, not a setting written over at the first configure.
    """
    from moesim.policy.catalog.buddymoe import NextLayerPrefetch
    prefetch = NextLayerPrefetch()
    rows = np.array([[0, 1], [0, 1], [0, 1]])
    predicted = {"pred_next_layer": [np.array([5, 6]), np.array([6, 7]), np.array([6, 4])]}
    picks = {}
    for top_k in (2, 4):
        model = tiny_model(layers=2, experts=8, top_k=top_k)
        costs = CostModel(tiny_profile(), model)
        prefetch.configure(RunContext(model=model, costs=costs, capacity=[8, 8], columns=("pred_next_layer",)))
        active, counts = active_experts(rows, 8)
        view = LayerView(0, 0, "decode", rows, active, counts, CacheState(capacity=[8, 8]), costs,
                         predictors=predicted)
        picks[top_k] = prefetch.candidates(view)
    assert picks[2] == [(1, 6), (1, 5)]
    assert picks[4] == [(1, 6), (1, 5), (1, 4), (1, 7)]
    assert prefetch.size == -1


def _routed_trace(path, experts, weights):
    """One MoE layer of 5 experts, top-2: one prefill token per row of ``experts`` with its ``weights``."""
    from moesim.trace import TraceMeta, write_trace
    n = len(experts)
    data = {"step": np.zeros(n, dtype=np.int64), "layer": np.zeros(n, dtype=np.int64),
            "request": np.zeros(n, dtype=np.int64), "position": np.arange(n), "phase": ["prefill"] * n,
            "experts": np.array(experts, dtype=np.int16), "weights": np.array(weights, dtype=np.float32)}
    return str(write_trace(path, data, TraceMeta(model=tiny_model(layers=1, experts=5, top_k=2),
                                                 source={"kind": "test"})))


def test_probability_weighted_coactivation_can_pick_another_buddy(tmp_path):
    """002 Sec. 3.3 (i): co-activations weighted by min(p~_i, p~_j) instead of counted.

    Calibration: expert 0 runs with 1 twice at weights (0.9, 0.1), with 2 once at (0.5, 0.5); no smoothing.
    Binary: M(0, .) = (0, 2, 1, 0, 0), q_{1|0} = 2/3, q_{2|0} = 1/3; alpha 0.5 is reached by (1).
    Weighted: M(0, 1) = 0.1 + 0.1 = 0.2, M(0, 2) = 0.5; q_{1|0} = 2/7, q_{2|0} = 5/7; alpha 0.5 by (2).
    A token routing (0, 4) with 0 off the GPU and 1, 2, 4 resident takes buddy 1, weighted buddy 2.
    """
    cal = _routed_trace(tmp_path / "w.parquet", [[0, 1], [0, 1], [0, 2]], [[0.9, 0.1], [0.9, 0.1], [0.5, 0.5]])
    picks = {}
    for weighted in (False, True):
        sub, _ = _configured(cal, tau=0.0, epsilon=0.0, alpha=0.5, weighted=weighted)
        m = coactivation(np.array([[0, 1], [0, 1], [0, 2]]), 5,
                         np.array([[0.9, 0.1], [0.9, 0.1], [0.5, 0.5]]) if weighted else None)
        assert m[0, 1:3] == pytest.approx([0.2, 0.5] if weighted else [2, 1])
        assert sub._buddies[0][0] == ([2] if weighted else [1])
        picks[weighted] = sub.rewrite(_view([[0, 4]], {1, 2, 4}, set(), [[0.5, 0.5]]))
    assert picks == {False: [(0, 0, 1)], True: [(0, 0, 2)]}


def test_random_baseline_draws_uniformly_among_resident_experts_not_in_the_tokens_set(tmp_path):
    """002 Sec. 5.1's Random: a missing expert becomes a uniformly drawn GPU-resident expert.

    Resident {0, 1, 2}. Token (0, 3): 3 is missing, 0 is the token's own, so 1 and 2 with 1/2 each.
    Token (3, 4): slot 0 draws from {0, 1, 2} (1/3 each), slot 1 from the two left. Token (1, 3) with 3
    arriving (prefetched): nothing missing, nothing drawn. 3,000 draws: each share within 0.04 of its 1/2 or
    1/3 (over 5 standard deviations).
    """
    from moesim.policy.catalog.buddymoe import RandomSubstitution
    model = tiny_model(layers=1, experts=5, top_k=2)
    rand = RandomSubstitution()
    rand.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[5]))
    draws = 3000
    own = [rand.rewrite(_view([[0, 3]], {0, 1, 2}, set(), [[0.5, 0.5]])) for _ in range(draws)]
    assert {tuple(p) for p in own} == {((0, 1, 1),), ((0, 1, 2),)}
    assert sum(p == [(0, 1, 1)] for p in own) / draws == pytest.approx(1 / 2, abs=0.04)
    both = [rand.rewrite(_view([[3, 4]], {0, 1, 2}, set(), [[0.5, 0.5]])) for _ in range(draws)]
    assert all(len(p) == 2 and p[0][2] != p[1][2] and {p[0][2], p[1][2]} <= {0, 1, 2} for p in both)
    for b in (0, 1, 2):
        assert sum(p[0][2] == b for p in both) / draws == pytest.approx(1 / 3, abs=0.04)
    assert rand.rewrite(_view([[1, 3]], {0, 1, 2}, {3}, [[0.5, 0.5]])) == []


def test_the_budget_rho_counts_replacements_made_in_rank_order():
    """002 Sec. 5.1's rho: at most rho replacements per token, Alg. 1's slots visited in rank order.

    Top-3 token (2, 3, 4), highest weight first; resident {0, 1}; buddies 2 -> [] (none), 3 -> [0], 4 -> [1].
    rho = 1: slot 0 finds no buddy (2 is fetched as routed, the budget untouched), slot 1 takes 0, and the
    budget is spent: 4 is fetched. rho = 2 (or 0, no limit): 4 takes 1 as well. A token ranking 4 first
    spends its one replacement on 4 -> 1.
    """
    row, resident, buddies = np.array([[2, 3, 4]]), {0, 1}, [[], [], [], [0], [1]]
    assert substitute_buddies(row, resident, resident, buddies, 16, rho=1) == [(0, 1, 0)]
    assert substitute_buddies(row, resident, resident, buddies, 16, rho=2) == [(0, 1, 0), (0, 2, 1)]
    assert substitute_buddies(row, resident, resident, buddies, 16, rho=0) == [(0, 1, 0), (0, 2, 1)]
    assert substitute_buddies(np.array([[4, 3, 2]]), resident, resident, buddies, 16, rho=1) == [(0, 0, 1)]
