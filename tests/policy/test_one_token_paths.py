"""The one-token (decode) short paths of hybrimoe, importance, dali and buddymoe give what the general paths give."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, active_experts, expert_times, highest_set
from moesim.policy.catalog.buddymoe.runtime import substitute_buddies, substitute_buddies_one
from moesim.policy.catalog.dali.assign import expert_time_lists
from moesim.policy.catalog.hybrimoe import ScoreAwareCache, head_tail, hybrid_schedule
from moesim.policy.catalog.importance import pointer_rounds, two_pointer
from moesim.policy.state import CacheState
from tests.factories import tiny_model, tiny_profile

#: float16 values with ties, both zeros, a negative, infinity and NaN
F16 = st.sampled_from([0.0, -0.0, 0.125, 0.25, 0.5, 1.0, -0.25, math.inf, math.nan]) | st.floats(0.0, 1.0, width=16)


def _view(rows, resident=(), in_flight=(), arrivals=None, experts=12, scores=None, launch=1e-5):
    model = tiny_model(layers=1, experts=experts, top_k=len(rows[0]))
    routed = np.array(rows, dtype=np.int64)
    active, counts = active_experts(routed, experts)
    cache = CacheState(capacity=[experts])
    cache.resident[0] = set(resident)
    cache.in_flight[0] = set(in_flight)
    return LayerView(0, 0, "decode", routed, active, counts, cache, CostModel(tiny_profile(), model),
                     scores=scores, arrivals=dict(arrivals or {}), now=0.0, expert_launch_s=launch)


def _float_top_set(scores: np.ndarray, p: int) -> np.ndarray:
    """ScoreAwareCache._top_set as it was, on the float16 numbers themselves."""
    k = len(scores) - p
    if k > 0:
        part = scores.copy()
        part.partition(k)
        near = (scores >= part[k]).nonzero()[0]
        if near.size == p:
            return near
    return highest_set(scores.astype(np.float64), p)


@settings(max_examples=300, deadline=None)
@given(st.lists(F16, min_size=2, max_size=40), st.integers(1, 39))
def test_top_set_on_the_bits_is_the_top_set_on_the_numbers(values, p):
    scores = np.array(values, dtype=np.float16)
    cache = ScoreAwareCache()
    cache._p = min(p, len(values))
    assert sorted(cache._top_set(scores).tolist()) == sorted(_float_top_set(scores, cache._p).tolist())


def _paired_schedule(view: LayerView, loads: bool) -> tuple[list[int], list[int]]:
    """hybrid_schedule's general path: (-tokens, id) pairs, times looked up per expert."""
    resident, in_flight = view.cache.resident[0], view.cache.in_flight[0]
    cached = sorted((-n, e) for e, n in zip(view.active, view.counts) if e in resident or e in in_flight)
    uncached = sorted((-n, e) for e, n in zip(view.active, view.counts) if e not in resident and e not in in_flight)
    pairs = cached + uncached
    times = [expert_times(view.costs, -m) for m, _ in pairs]
    costs = view.costs
    shared = costs.gpu_shared(view.tokens) + view.shared_launch_s if costs.model.shared_intermediate_size else 0.0
    return head_tail([e for _, e in pairs], len(cached), [g + view.expert_launch_s for g, _ in times],
                     [c for _, c in times], shared, costs.expert_load, costs.sync_s, loads)


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(12)), st.integers(1, 8), st.sets(st.integers(0, 11)), st.sets(st.integers(0, 11)),
       st.booleans())
def test_hybrid_schedule_of_one_token_is_the_paired_schedule(order, k, resident, in_flight, loads):
    view = _view([order[:k]], resident, in_flight - resident)
    assert hybrid_schedule(view, loads=loads) == _paired_schedule(view, loads)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=0, max_size=10, unique=True), st.floats(1e-4, 1e-2),
       st.floats(1e-4, 1e-2), st.floats(0.0, 1e-2))
def test_pointer_rounds_are_two_pointer_of_one_token_count(experts, t_load, t_cpu, head):
    assert pointer_rounds(sorted(experts), t_load, [t_cpu] * len(experts), head) == \
        two_pointer({e: 1 for e in experts}, t_load, lambda n: t_cpu * n, head)


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(12)), st.integers(1, 8), st.sets(st.integers(0, 11)), st.sets(st.integers(0, 11)),
       st.integers(0, 2), st.data())
def test_buddy_picks_of_one_token_are_alg1s(order, k, resident, in_flight, rho, data):
    buddies = [data.draw(st.lists(st.integers(0, 11), max_size=5, unique=True)) for _ in range(12)]
    row = order[:k]
    on_gpu = resident | in_flight
    assert substitute_buddies_one(row, resident, in_flight, buddies, 3, rho) == \
        substitute_buddies(np.array([row]), on_gpu, resident, buddies, 3, None, rho)


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(12)), st.integers(1, 8), st.sets(st.integers(0, 11)),
       st.dictionaries(st.integers(0, 11), st.floats(-1e-3, 1e-2), max_size=6))
def test_dali_cost_vectors_of_one_token_are_per_expert_ones(order, k, resident, arrivals):
    view = _view([order[:k]], resident, arrivals=arrivals)
    experts, t_gpu, t_cpu = expert_time_lists(view)
    costs, launch = view.costs, view.expert_launch_s
    expected_gpu, expected_cpu = [], []
    for e in view.active:
        transfer = 0.0 if e in resident else max(arrivals[e], 0.0) if e in arrivals else costs.expert_load
        gpu, cpu = expert_times(costs, 1)
        gpu += launch
        expected_gpu.append(transfer if transfer > gpu else gpu)
        expected_cpu.append(cpu)
    assert (experts, t_gpu, t_cpu) == (view.active, expected_gpu, expected_cpu)
