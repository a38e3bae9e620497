"""Importance-driven scheduling (004_91681cee0e4a4add.txt) against the paper, mechanism by mechanism: each
test works a tiny case by hand in its comments and asserts the plan or number 004's rule gives."""

from __future__ import annotations

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
