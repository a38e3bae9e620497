"""ComposedSystem._place and _plan_prefetch with plain loops (one pass over a layer's GPU experts, the
cache's sets looked up once, a layer's victims popped off the end of its ranking) plan exactly as the
comprehension-based versions they replaced, kept here as the reference: the same plans on random caches,
layer after layer, for the catalogue systems that plan through them, with per-layer quotas and a pool."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerPlan, LayerView, RunContext, split_plan
from moesim.policy.cache import LRUCache, make_room
from moesim.policy.state import CacheState
from moesim.policy.systems import ComposedSystem, build_system
from tests.factories import tiny_model, tiny_profile


# --- the reference: the code before the plain loops, as it was ------------------------------------------------

def reference_place(self, view: LayerView) -> LayerPlan:
    gpu, cpu = self.assign.split(view)
    plan = split_plan([], cpu)
    if not gpu:
        if self._prefetching:
            self._plan_prefetch(view, plan)
        return plan
    layer = view.layer
    state = view.cache
    resident, in_flight = state.resident[layer], state.in_flight[layer]
    if in_flight:
        present = [e for e in gpu if e in resident or e in in_flight]
        missing = [e for e in gpu if e not in resident and e not in in_flight]
    else:
        present = [e for e in gpu if e in resident]
        missing = [e for e in gpu if e not in resident] if len(present) < len(gpu) else []
    if missing:
        missing = self.cache.admission_order(view, layer, missing)
        fits, evict = make_room(self.cache, view, layer, missing, set(present))
        plan.evictions = evict
        plan.loads = missing[:fits]
        plan.streamed = missing[fits:]
    if in_flight:
        ready = [e for e in present if e in resident]
        arriving = sorted((e for e in present if e not in resident), key=lambda e: view.arrivals.get(e, 0.0))
        present = ready + arriving
    plan.gpu = present + plan.loads + plan.streamed
    self.cache.touch(view, plan.gpu)
    if self._prefetching:
        self._plan_prefetch(view, plan)
    return plan


def reference_plan_prefetch(self, view: LayerView, plan: LayerPlan) -> None:
    wanted = self.prefetch.candidates(view)
    if not wanted:
        return
    state = view.cache
    evicted = set(plan.evictions)
    quota_left: dict[int, int] = {}
    pool_left = None if state.pool is None else state.pool - state.held() + len(evicted) - len(plan.loads)
    victims = None
    for layer, expert in wanted:
        if (state.has(layer, expert) and (layer, expert) not in evicted) \
                or (layer == view.layer and expert in plan.gpu):
            continue
        if layer not in quota_left:
            dropped = sum(1 for (l, _) in evicted if l == layer) if evicted else 0
            loading = len(plan.loads) if layer == view.layer else 0
            quota_left[layer] = state.capacity[layer] - state.used(layer) + dropped - loading
        full = quota_left[layer] <= 0
        if full or (pool_left is not None and pool_left <= 0):
            if victims is None:
                victims = ReferenceVictims(self.cache, view, plan, wanted, evicted)
            victim = victims.next(layer, full)
            if victim is None:
                continue
            plan.evictions.append(victim)
            evicted.add(victim)
            if victim[0] in quota_left:
                quota_left[victim[0]] += 1
            if pool_left is not None:
                pool_left += 1
        plan.prefetches.append((layer, expert))
        quota_left[layer] -= 1
        if pool_left is not None:
            pool_left -= 1


class ReferenceVictims:
    def __init__(self, cache, view, plan, wanted, evicted) -> None:
        self.cache, self.view, self.plan, self.wanted, self.evicted = cache, view, plan, wanted, evicted
        self._ranked: dict[int, list[int]] = {}
        self._exhausted: set[int] = set()
        self._pairs: set[tuple[int, int]] | None = None

    def next(self, layer, own_layer):
        victim = self._from_layer(layer) if own_layer else self._from_pool(layer)
        if victim is not None and self._pairs is not None:
            self._pairs.add(victim)
        return victim

    def _from_layer(self, layer):
        ranked, evicted = self._ranked.get(layer), self.evicted
        while ranked and (layer, ranked[0]) in evicted:
            ranked.pop(0)
        if not ranked:
            if layer in self._exhausted:
                return None
            view = self.view
            wanted_here = [e for l, e in self.wanted if l == layer]
            keep = set(wanted_here)
            keep |= view.cache.in_flight[layer]
            if evicted:
                keep.update(e for l, e in evicted if l == layer)
            if layer == view.layer:
                keep.update(self.plan.gpu)
            ranked = self._ranked[layer] = list(self.cache.victims(view, layer, len(wanted_here), keep))
            if len(ranked) < len(wanted_here):
                self._exhausted.add(layer)
            if not ranked:
                return None
        return layer, ranked.pop(0)

    def _from_pool(self, layer):
        if self._pairs is None:
            view = self.view
            pairs = set(self.wanted) | {(l, e) for l, f in enumerate(view.cache.in_flight) for e in f}
            self._pairs = pairs | {(view.layer, e) for e in self.plan.gpu} | self.evicted
        pairs = self.cache.pool_victims(self.view, 1, self._pairs, layer)
        return pairs[0] if pairs else None


@contextmanager
def reference_code():
    """ComposedSystem planning with the reference steps (subclasses' super() calls reach them too)."""
    place, prefetch = ComposedSystem._place, ComposedSystem._plan_prefetch
    ComposedSystem._place, ComposedSystem._plan_prefetch = reference_place, reference_plan_prefetch
    try:
        yield
    finally:
        ComposedSystem._place, ComposedSystem._plan_prefetch = place, prefetch


class PoolLRU(LRUCache):
    layout: ClassVar[str] = "pool"


# --- random layers -------------------------------------------------------------------------------------------

def random_view(seed: int, model, costs: CostModel, step: int, layer: int, pool: int | None) -> LayerView:
    """A decode layer over a random cache: some experts resident, some arriving, routing, scores, predictions.
    The same seed gives the same view (each side of a comparison plans its own copy)."""
    rng = random.Random(seed)
    experts, layers = model.num_experts, model.num_layers
    capacity = [rng.randint(1, 6) for _ in range(layers)]
    resident: list[set[int]] = []
    in_flight: list[set[int]] = []
    for slots in capacity:
        held = rng.sample(range(experts), rng.randint(0, slots))
        arriving = rng.randint(0, len(held))
        in_flight.append(set(held[:arriving]))
        resident.append(set(held[arriving:]))
    if pool is not None:
        pool = max(pool, sum(map(len, resident)) + sum(map(len, in_flight)))
    cache = CacheState(capacity=capacity, resident=resident, in_flight=in_flight, pool=pool)
    tokens = rng.choice((1, 1, 1, 3))
    rows = np.array([rng.sample(range(experts), model.top_k) for _ in range(tokens)], dtype=np.int16)
    active, counts = [], []
    for e in rows.ravel().tolist():
        if e in active:
            counts[active.index(e)] += 1
        else:
            active.append(e)
            counts.append(1)
    weights = np.array([[rng.random() for _ in range(model.top_k)] for _ in range(tokens)], dtype=np.float32)
    scores = np.array([[rng.random() for _ in range(experts)] for _ in range(tokens)], dtype=np.float32)
    predicted = [np.array(rng.sample(range(experts), rng.randint(0, experts)), dtype=np.int16) for _ in range(tokens)]
    now = rng.uniform(0.0, 1e-3)
    arrivals = {e: now + rng.uniform(-1e-4, 3e-4) for e in cache.in_flight[layer] if rng.random() < 0.8}
    return LayerView(step, layer, "decode", rows, active, counts, cache, costs, weights=weights, scores=scores,
                     predictors={"pred_next_layer": predicted, "pred_next_token": predicted}, now=now,
                     arrivals=arrivals, expert_launch_s=15e-6, requests=np.zeros(tokens, dtype=np.int64))


def plan_fields(plan: LayerPlan) -> tuple:
    return (plan.gpu, plan.cpu, plan.loads, plan.streamed, plan.prefetches, plan.evictions, plan.writebacks,
            plan.substitutions, plan.deferred, sorted(plan.overhead_s.items()), plan.prefetch_after_gpu,
            plan.cancel_queued_prefetches)


@pytest.mark.parametrize("system, settings, pool", [
    ("gpu-only-lru", {}, None), ("mixtral-offloading", {}, None), ("buddymoe", {"substitute": "none"}, None), ("hybrimoe", {}, None),
    ("importance", {}, None), ("gpu-only-lru", {}, 14), ("buddymoe", {"substitute": "none"}, 14),
    ("hybrimoe", {}, 14)])
def test_plain_loops_plan_as_the_comprehensions(system, settings, pool):
    model, profile = tiny_model(layers=3, experts=12, top_k=4), tiny_profile(pcie_gbps=0.49152)
    costs = CostModel(profile, model)
    new, old = build_system(system, dict(settings)), build_system(system, dict(settings))
    if pool is not None and type(new.cache) is LRUCache:  # an LRU over a model-wide pool: pool victims too
        new.cache, old.cache = PoolLRU(), PoolLRU()
    columns = tuple(c for c in new.needed_columns())
    for built in (new, old):
        built.configure(RunContext(model=model, costs=costs, capacity=[6] * model.num_layers, columns=columns))
    seed = 0
    kinds = set()
    for step in range(80):
        for layer in range(model.num_layers):
            seed += 1
            mine = new.plan(random_view(seed, model, costs, step, layer, pool))
            with reference_code():
                theirs = old.plan(random_view(seed, model, costs, step, layer, pool))
            assert plan_fields(mine) == plan_fields(theirs), (step, layer)
            kinds.add((bool(mine.loads), bool(mine.evictions), bool(mine.prefetches)))
    assert (True, True, False) in kinds or (True, True, True) in kinds  # demand evictions met
    if new._prefetching:
        assert any(k[2] for k in kinds)
