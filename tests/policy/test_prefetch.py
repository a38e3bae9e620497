"""Prefetch components and the trace-only next-layer predictor."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.hw.cost import CostModel
from moesim.policy.assign import AllGPU
from moesim.policy.base import LayerPlan, LayerView
from moesim.policy.cache import LRUCache
from moesim.policy.prefetch import LastTokenPredictor, Prefetch
from moesim.policy.state import CacheState
from moesim.policy.systems import ComposedSystem
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


def view(layer: int, experts: list[list[int]], requests: list[int]) -> LayerView:
    model = tiny_model(layers=3, experts=8, top_k=2)
    rows = np.array(experts)
    return LayerView(step=0, layer=layer, phase="decode", experts=rows, active=sorted(set(rows.ravel().tolist())),
                     counts=[], cache=CacheState(capacity=[2, 2, 2]), costs=CostModel(tiny_profile(), model),
                     requests=np.array(requests))


def test_last_token_predictor_repeats_the_requests_previous_token_at_the_next_layer():
    predictor = LastTokenPredictor()
    # token 1 of requests 0 and 1: nothing is known yet
    assert [p.tolist() for p in predictor.predict(view(0, [[0, 1], [2, 3]], [0, 1]))] == [[], []]
    predictor.predict(view(1, [[4, 5], [6, 7]], [0, 1]))
    predictor.predict(view(2, [[0, 7], [1, 6]], [0, 1]))
    # token 2: layer 0 predicts layer 1 as each request's token 1 routed there
    assert [p.tolist() for p in predictor.predict(view(0, [[0, 2], [3, 4]], [0, 1]))] == [[4, 5], [6, 7]]
    # the last layer has nothing after it to predict for: layer 3 was never seen
    assert [p.tolist() for p in predictor.predict(view(2, [[1, 2], [3, 5]], [0, 1]))] == [[], []]


def test_predictor_systems_run_without_the_columns_and_say_so(tmp_path):
    model = tiny_model(layers=2, experts=6, top_k=2)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                random_routing(np.random.default_rng(1), model, requests=1, prompt=3, decode=8)))
    for system, note in (("buddymoe", "no pred_next_layer column"), ("dali", "no pred_residual column")):
        result = simulate(path, tiny_profile(pcie_gbps=1.0), system,
                          {"cache.slots_per_layer": "3", "engine.check": "true"})
        assert any(note in n for n in result.notes), (system, result.notes)
        assert result.counters.activations == 2 * (3 + 8) * 2
    # buddymoe's LRU cache already holds the previous token's experts, so that stand-in rarely loads
    # anything; DALI's workload-ranked cache does not, and prefetches from it
    dali = simulate(path, tiny_profile(pcie_gbps=1.0), "dali", {"cache.slots_per_layer": "3"})
    assert dali.counters.prefetches > 0


class _Fixed(Prefetch):
    """Wants a given list of (layer, expert) pairs."""

    name = "fixed"

    def __init__(self, wanted: list[tuple[int, int]]) -> None:
        self.wanted = wanted

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        return list(self.wanted)


def _one_victim_at_a_time(cache: LRUCache, view: LayerView, plan: LayerPlan,
                          wanted: list[tuple[int, int]]) -> tuple[list, list]:
    """Prefetch planning as its definition reads: every quantity recounted, one victims() call per eviction."""
    state = view.cache
    evictions, prefetches = list(plan.evictions), []

    def room(layer: int) -> int:
        return state.capacity[layer] - state.used(layer) + sum(l == layer for l, _ in evictions) \
            - (len(plan.loads) if layer == view.layer else 0) - sum(l == layer for l, _ in prefetches)

    def pool_room() -> int:
        return 1 if state.pool is None else \
            state.pool - state.held() + len(evictions) - len(plan.loads) - len(prefetches)

    for layer, expert in wanted:
        if (state.has(layer, expert) and (layer, expert) not in evictions) \
                or (layer == view.layer and expert in plan.gpu):
            continue
        if room(layer) <= 0 or pool_room() <= 0:
            if room(layer) <= 0:
                keep = {e for l, e in wanted + evictions if l == layer} | state.in_flight[layer]
                keep |= set(plan.gpu) if layer == view.layer else set()
                found = [(layer, e) for e in cache.victims(view, layer, 1, keep)]
            else:
                pairs = set(wanted + evictions) | {(l, e) for l, f in enumerate(state.in_flight) for e in f}
                found = cache.pool_victims(view, 1, pairs | {(view.layer, e) for e in plan.gpu}, layer)
            if not found:
                continue
            evictions.append(found[0])
        prefetches.append((layer, expert))
    return evictions, prefetches


@st.composite
def _prefetch_cases(draw):
    layers, experts = draw(st.integers(2, 3)), 6
    capacity = [draw(st.integers(1, 4)) for _ in range(layers)]
    resident, in_flight = [], []
    for cap in capacity:
        held = draw(st.lists(st.integers(0, experts - 1), unique=True, max_size=cap))
        split = draw(st.integers(0, len(held)))
        resident.append(set(held[:split]))
        in_flight.append(set(held[split:]))
    pool = draw(st.none() | st.integers(1, sum(capacity)))
    if pool is not None and sum(map(len, resident + in_flight)) > pool:
        pool = None
    layer = draw(st.integers(0, layers - 1))
    gpu = draw(st.lists(st.integers(0, experts - 1), unique=True, max_size=3))
    evictable = sorted(resident[layer] - set(gpu))
    evictions = [(layer, e) for e in draw(st.lists(st.sampled_from(evictable), unique=True))] if evictable else []
    loads = [e for e in gpu if e not in resident[layer] and e not in in_flight[layer]][:len(evictions)]
    wanted = draw(st.lists(st.tuples(st.integers(0, layers - 1), st.integers(0, experts - 1)), unique=True,
                           max_size=8))
    stamps = draw(st.permutations(range(layers * experts)))
    return capacity, resident, in_flight, pool, layer, gpu, evictions, loads, wanted, stamps


@settings(max_examples=300, deadline=None)
@given(_prefetch_cases())
def test_prefetch_victims_are_those_one_victims_call_per_eviction_picks(case):
    """Planning ranks a full layer's victims once and takes them in turn; that must pick exactly what
    asking the cache policy for one victim at a time (each earlier one protected) picks."""
    capacity, resident, in_flight, pool, layer, gpu, evictions, loads, wanted, stamps = case
    experts = 6
    state = CacheState(capacity=list(capacity), resident=[set(s) for s in resident],
                       in_flight=[set(s) for s in in_flight], pool=pool)
    cache = LRUCache()
    cache._stamp = [{e: stamps[l * experts + e] for e in range(experts)} for l in range(len(capacity))]
    model = tiny_model(layers=len(capacity), experts=experts, top_k=2)
    view = LayerView(step=0, layer=layer, phase="decode", experts=np.array([gpu or [0]]), active=list(gpu),
                     counts=[1] * len(gpu), cache=state, costs=CostModel(tiny_profile(), model))
    system = ComposedSystem("t", cache, AllGPU(), _Fixed(wanted))
    plan = LayerPlan(gpu=list(gpu), loads=list(loads), evictions=list(evictions))
    expected = _one_victim_at_a_time(cache, view, plan, wanted)
    system._plan_prefetch(view, plan)
    assert (plan.evictions, plan.prefetches) == expected
