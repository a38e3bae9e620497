"""A portfolio member's floors (moesim.sim.floors): by hand, exact where the placement is fixed, and never above
what a replay takes, step by step and over every suffix of steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.sim.floor_parts import MemberCosts, Traits
from moesim.sim.floors import _layers_floor, placed_floors
from moesim.sim.window_floors import window_need
from moesim.sim.shape import TraceShape
from moesim.sim.portfolio import racing_members
from moesim.sim.run import members, prepare
from moesim.trace.io import read_meta
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile

ROOT = Path(__file__).parents[2]


def test_layers_floor_by_hand():
    """Two layers, each 1 ms of launches and attention, GPU sides 2 and 1 ms, CPU sides 3 and 4 ms.
    Side by side: (1 + 3) + (1 + 4) = 9. Deferred: the GPU sides alone take 1 + 2 + 1 + 1 = 5; the CPU may
    start after the first attention (1 + 3 + 4 = 8) or must wait for the second layer's (1 + 2 + 1 + 4 = 8)."""
    assert _layers_floor([1.0, 1.0], [2.0, 1.0], [3.0, 4.0], defers=False) == 9.0
    assert _layers_floor([1.0, 1.0], [2.0, 1.0], [3.0, 4.0], defers=True) == 8.0
    # a long second GPU side: the GPU alone bounds it (1 + 2 + 1 + 9 = 13)
    assert _layers_floor([1.0, 1.0], [2.0, 9.0], [3.0, 4.0], defers=True) == 13.0


def _traits(placement: str = "", no_prefetch: bool = True, defers: bool = False) -> Traits:
    return Traits(keeps_routing=True, defers=defers, plain=True, no_prefetch=no_prefetch, placement=placement)


def test_window_need_by_hand():
    """Fixed work 2 s, 3 misses, a copy 2 s (tau), a CPU expert 1 s (c).

    Every expert on the GPU without prefetch: 2 + 3 x 2 = 8. No prefetch, any split: each miss costs at least
    c tau / (c + tau) = 2/3 per layer: 2 + 2 = 4. Prefetch: the longer of 2 + n and 2 k, n + k = 3, at least
    at 2 + 3 - k = 2 k, k = 5/3: 10/3. Prefetch with deferral: the longer of 2, n and 2 k: k = 1, 2. No prefetch
    with deferral: the longer of 2 + 2 k and 3 - k: k = 1/3, 8/3."""
    need = lambda traits: float(window_need(traits, np.array([2.0]), np.array([3]), 2.0, 1.0)[0])  # noqa: E731
    assert need(_traits("gpu")) == 8.0
    assert need(_traits()) == pytest.approx(4.0)
    assert need(_traits(no_prefetch=False)) == pytest.approx(10 / 3)
    assert need(_traits(no_prefetch=False, defers=True)) == pytest.approx(2.0)
    assert need(_traits(defers=True)) == pytest.approx(8 / 3)
    assert need(_traits("gpu", no_prefetch=False)) == 6.0  # copies overlap: the longer of 2 and 3 x 2


def _members(path: str, profile, slots: dict[str, str], names: tuple[str, ...] | None = None):
    shape = TraceShape.of(path, read_meta(path).model.num_experts)
    sims = {}
    for name in names or members("oracle"):
        sims[name] = prepare(path, profile, name, slots)
    return shape, racing_members(sims, shape, (), {})


def _run(member):
    member.advance(len(member.shape.rows) + 1, lambda: False)
    return np.array([s.end - s.start for s in member.sim.steps])


@pytest.mark.parametrize("batch", [1, 2])
def test_placed_floors_are_the_steps_themselves(tmp_path, batch):
    """cpu-only and static-hot never copy an expert: their floors are their steps (side by side; no DRAM
    sharing without copies), prefill and decode alike; one-token decode steps (``batch`` 1, taken at once)
    as well as batched ones (step by step)."""
    model = tiny_model(layers=2, experts=6, top_k=2, shared=True)
    path = tmp_path / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=2, prompt_len=3, decode_len=5, batch=batch,
                                         seed=1), path)
    shape, racing = _members(str(path), tiny_profile(), {"cache.slots_per_layer": "2"},
                             ("cpu-only", "static-hot", "ktransformers-ed"))
    for member in racing:
        floors = member.floors.steps
        durations = _run(member)
        if member.name == "ktransformers-ed":
            assert (durations >= floors * (1 - 1e-12)).all()
        else:
            np.testing.assert_allclose(floors, durations, rtol=1e-12)


def test_one_token_steps_at_once_are_the_walk_bit_for_bit(tmp_path):
    """The one-token decode steps' placed floors taken at once (with and without deferral) are the numbers
    the step-by-step walk gives (the walk: the same shape without its decode pairs)."""
    model = tiny_model(layers=3, experts=6, top_k=2, shared=True)
    path = tmp_path / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=1, prompt_len=3, decode_len=9, batch=1, seed=2),
               path)
    shape, racing = _members(str(path), tiny_profile(), {"cache.slots_per_layer": "2"},
                             ("static-hot", "ktransformers-ed"))
    walk = dataclasses.replace(shape, decode_pairs=None)
    assert sum(kinds == (((1, (1, 1)), 3),) for kinds in shape.layers) == 9  # every decode step is one token
    for member in racing:
        sim = member.sim
        on_gpu = [set(r) for r in sim.cache.resident]
        parts = MemberCosts.of(sim)
        at_once, stepwise = placed_floors(sim, shape, parts, on_gpu), placed_floors(sim, walk, parts, on_gpu)
        assert at_once.tolist() == stepwise.tolist(), member.name


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 3), experts=st.integers(3, 8), top_k=st.integers(1, 2), requests=st.integers(1, 3),
       batch=st.integers(1, 3), decode=st.integers(2, 14), seed=st.integers(0, 99),
       slots=st.sampled_from(["cache.slots_per_layer=0", "cache.slots_per_layer=1", "cache.slots_per_layer=2",
                              "cache.slots=3"]),
       pcie=st.sampled_from([0.0001, 0.001, 1.0]), engines=st.integers(1, 2))
def test_floors_never_exceed_a_replay(tmp_path_factory, layers, experts, top_k, requests, batch, decode, seed,
                                      slots, pcie, engines):
    """For every member of the oracle: each step lasts at least its floor, and from every step ``k`` on, the
    steps take at least the makespan floor and their request-weighted durations at least the TPOT floor
    (window terms included): slow and fast copies, one or two copy engines, caches from none to a few."""
    model = tiny_model(layers=layers, experts=experts, top_k=min(top_k, experts), shared=True)
    path = tmp_path_factory.mktemp("floors") / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=requests, prompt_len=2, decode_len=decode,
                                         batch=batch, seed=seed), path)
    profile = tiny_profile(pcie_gbps=pcie, copy_engines=engines)
    key, value = slots.split("=")
    shape, racing = _members(str(path), profile, {key: value})
    weight = shape.decode_weight
    for member in racing:
        durations = _run(member)
        # durations are differences of absolute times: a few ulps of seconds off, which an exact floor (a
        # member with every expert on the GPU, its split known) can meet; 1e-12 s covers them
        assert (durations >= member.floors.steps * (1 - 1e-12) - 1e-12).all(), member.name
        span = np.concatenate([np.cumsum(durations[::-1])[::-1], [0.0]])
        tpot = np.concatenate([np.cumsum((durations * weight)[::-1])[::-1], [0.0]])
        assert (span >= member.left_span * (1 - 1e-12) - 1e-12).all(), member.name
        assert (tpot >= member.left_tpot * (1 - 1e-12) - 1e-12).all(), member.name


def test_window_floors_raise_a_demand_paging_member(tmp_path):
    """gpu-only-lru with one slot per layer on slow copies: every decode step that routes a new expert
    copies it, so the windows' floor lies far above the per-step floors (which let every expert run on the
    GPU with no copy) and still below the replay."""
    model = tiny_model(layers=2, experts=6, top_k=2)
    path = tmp_path / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=1, prompt_len=2, decode_len=12, seed=3), path)
    shape, racing = _members(str(path), tiny_profile(), {"cache.slots_per_layer": "1"}, ("gpu-only-lru",))
    member = racing[0]
    assert member.floors.extra_span[0] > 10 * member.left[0]
    assert sum(_run(member)) >= member.left_span[0]


def test_window_floors_bind_a_system_that_plans_on_its_own(tmp_path):
    """llamacpp plans its layers itself (``LlamaCppSystem``): taken to prefetch and split as it likes, it
    still holds at most its slots, so on slow copies every new expert of a window runs on the CPU or is
    copied; its windows add to its per-step floors, which alone let every expert run on the GPU. Traits say
    what the floors assume of it."""
    model = tiny_model(layers=2, experts=6, top_k=2)
    path = tmp_path / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=1, prompt_len=2, decode_len=12, seed=3), path)
    shape, racing = _members(str(path), tiny_profile(pcie_gbps=0.001), {"cache.slots_per_layer": "1"},
                             ("llamacpp",))
    member = racing[0]
    traits = Traits.of(member.sim)
    assert (traits.plain, traits.no_prefetch, traits.placement, traits.windowed) == (False, False, "", True)
    assert member.floors.extra_span[0] > 2 * member.left[0]
    assert sum(_run(member)) >= member.left_span[0]
