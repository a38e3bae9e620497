"""SMoE's own decode plan (SMoESystem._decode_hits) against the composed plan it stands in for
(ComposedSystem._place and _plan_prefetch): the same plans on random caches, layer after layer."""

from __future__ import annotations

import random

import numpy as np
import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, RunContext
from moesim.policy.state import CacheState
from moesim.policy.systems import build_system
from tests.factories import tiny_model, tiny_profile

LAUNCH = 15e-6


def random_view(rng: random.Random, model, costs: CostModel, step: int, layer: int) -> LayerView:
    """A one-token decode layer over a random cache: some experts resident, some arriving, a prediction."""
    experts = model.num_experts
    capacity = [rng.randint(1, 6) for _ in range(model.num_layers)]
    cache = CacheState(capacity=capacity)
    for l, slots in enumerate(capacity):
        held = rng.sample(range(experts), rng.randint(0, slots))
        arriving = rng.randint(0, len(held))
        cache.in_flight[l] = set(held[:arriving])
        cache.resident[l] = set(held[arriving:])
    routed = rng.sample(range(experts), model.top_k)
    predicted = rng.sample(range(experts), rng.randint(0, experts))
    now = rng.uniform(0.0, 1e-3)
    arrivals = {e: now + rng.uniform(-1e-4, 3e-4) for e in cache.in_flight[layer] if rng.random() < 0.8}
    return LayerView(step, layer, "decode", np.array([routed], dtype=np.int16), routed, [1] * len(routed), cache,
                     costs, predictors={"pred_next_token": [np.array(predicted, dtype=np.int16)]}, now=now,
                     arrivals=arrivals, expert_launch_s=LAUNCH, requests=np.zeros(1, dtype=np.int64))


def plan_fields(plan) -> tuple:
    return (plan.gpu, plan.cpu, plan.loads, plan.streamed, plan.prefetches, plan.evictions,
            sorted(plan.overhead_s.items()), plan.prefetch_after_gpu)


@pytest.mark.parametrize("system, settings", [
    ("smoe", {}), ("smoe-flex", {}), ("smoe", {"prefetch.eviction": "adaptive"}), ("smoe", {"prefetch.n": "4"}),
    ("smoe", {"prefetch.n": "0"})])
def test_own_decode_plan_is_the_composed_plan(system, settings):
    # a fast PCIe link makes arriving experts worth the GPU, a slow CPU makes resident ones
    model, profile = tiny_model(layers=3, experts=12, top_k=4), tiny_profile(pcie_gbps=0.49152)
    costs = CostModel(profile, model)
    own, composed = build_system(system, dict(settings)), build_system(system, dict(settings))
    for built in (own, composed):
        built.configure(RunContext(model=model, costs=costs, capacity=[6] * model.num_layers,
                                   columns=("pred_next_token",)))
    assert own._own_decode
    composed._own_decode = False
    rng = random.Random(7)
    kinds = set()
    for step in range(60):
        for layer in range(model.num_layers):
            view = random_view(rng, model, costs, step, layer)
            mine, theirs = own.plan(view), composed.plan(view)
            assert plan_fields(mine) == plan_fields(theirs), (step, layer)
            kinds.add((bool(mine.evictions), bool(mine.prefetches)))
    if own.prefetch.count:  # prefetches with and without evictions, and layers without, all met
        assert kinds == {(True, True), (False, True), (False, False)}


def test_components_of_ones_own_take_the_composed_plan():
    model = tiny_model(layers=2, experts=8, top_k=2)
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[4, 4])
    for settings in ({"cache": "lru"}, {"assign.decode_on_demand": "true"}, {"prefetch": "none"}):
        system = build_system("smoe", dict(settings))
        system.configure(ctx)
        assert not system._own_decode, settings


@pytest.mark.parametrize("launch", [0.0, LAUNCH, 1.0])
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_split_is_alg_1_rule(launch, tokens):
    # GPU iff T_CPU > T_GPU + launches + T_PCIe, T_PCIe 0 resident, the rest of the copy arriving, infinite missing;
    # launch 1 s makes the CPU the faster device for every expert
    model, profile = tiny_model(layers=3, experts=12, top_k=4), tiny_profile(pcie_gbps=0.49152)
    costs = CostModel(profile, model)
    split = build_system("smoe").assign
    rng = random.Random(tokens)
    sides = set()
    for step in range(40):
        view = random_view(rng, model, costs, step, rng.randrange(model.num_layers))
        view.expert_launch_s = launch
        if tokens > 1:  # several tokens of one request, routed alike
            view.experts = np.repeat(view.experts, tokens, axis=0)
            view.counts = [tokens] * len(view.active)
        resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
        expected: tuple[list[int], list[int]] = ([], [])
        for expert in view.active:
            if expert in resident:
                transfer = 0.0
            elif expert in in_flight:
                transfer = max(view.arrivals.get(expert, view.now) - view.now, 0.0)
            else:
                transfer = float("inf")
            on_gpu = costs.cpu_expert(tokens) > costs.gpu_expert(tokens) + launch + transfer
            expected[0 if on_gpu else 1].append(expert)
            sides.add((expert in resident, on_gpu))
        assert split.split(view) == expected
    assert (True, launch < 1.0) in sides
