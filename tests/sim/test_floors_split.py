"""The floors of a member's experts split between GPU and CPU in whole experts, alone per layer and with a
window's copies (``split_costs`` and ``split_envelope`` in moesim.sim.floor_parts, ``split_window_need`` in
moesim.sim.window_floors): by hand, and never above a replay, step for step and window for window."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moesim.sim.window_floors as window_floors_module
from moesim.sim.floor_parts import MemberCosts, Traits, split_costs, split_envelope
from moesim.sim.floors import MemberFloors
from moesim.sim.window_floors import split_window_need, window_needs
from moesim.sim.portfolio import racing_members
from moesim.sim.run import members, prepare
from moesim.sim.shape import TraceShape, Windows
from moesim.trace.io import read_meta
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile


def test_split_costs_by_hand():
    """Shared experts 1 s, two routed experts of 2 and 3 s on the GPU, 4 and 5 s on the CPU, sync 0.5 s.
    None on the CPU: 1 + 2 + 3 = 6. One: the GPU keeps at least 1 + 2 (the 3 s one gone), the CPU at least
    0.5 + 4: 4.5. Both: the CPU 0.5 + 4 + 5 = 9.5. Every expert on the GPU: 6 only."""
    gpu, cpu = np.array([2.0, 3.0]), np.array([5.0, 4.0])
    assert split_costs(1.0, gpu, cpu, 0.5).tolist() == [6.0, 4.5, 9.5]
    assert split_costs(1.0, gpu, cpu, 0.5, cpu_allowed=False).tolist() == [6.0]


def test_split_envelope_by_hand():
    """At least ``b`` on the CPU: [6, 4.5, 9.5] -> [4.5, 4.5, 9.5], convex already. [5, 9, 10, 30]: 9 lies
    above the chord from 5 to 10, so it falls to 7.5."""
    assert split_envelope(np.array([6.0, 4.5, 9.5])).tolist() == [4.5, 4.5, 9.5]
    assert split_envelope(np.array([5.0, 9.0, 10.0, 30.0])).tolist() == [5.0, 7.5, 10.0, 30.0]
    assert split_envelope(np.array([3.0])).tolist() == [3.0]


def test_split_window_need_by_hand():
    """Two layers of the envelope [4.5, 4.5, 9.5], 2 s outside their experts, a copy 3 s.

    5 misses: with ``b`` CPU experts a layer, the copies take 3 (5 - 2 b), the layers 2 + 2 x 4.5 up to b = 1:
    they meet at b = 2/3, 11 s. 9 misses: at b = 1 copies take 21 and the layers 11, so they meet past it,
    27 - 6 b = 2 + 2 (4.5 + 5 (b - 1)), b = 1.625: 17.25 s. 20 misses: at most 2 a layer on the CPU, 16
    copies: 48 s. No miss: the layers alone, 11 s. Every expert on the GPU (the envelope [6]): 9 misses are
    9 copies, 27 s, longer than 2 + 2 x 6."""
    envelope = np.array([4.5, 4.5, 9.5])
    need = split_window_need(np.full(4, 2.0), np.array([5, 9, 20, 0]), np.full(4, 2.0), envelope, 3.0)
    np.testing.assert_allclose(need, [11.0, 17.25, 48.0, 11.0], rtol=1e-12)
    assert split_window_need(np.array([2.0]), np.array([9]), np.array([2.0]), np.array([6.0]), 3.0)[0] == 27.0


def test_split_window_need_is_the_least_over_splits():
    """The closed form against a fine grid of ``b`` (the least of the longer side over it), on random
    envelopes, windows and copy times."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        envelope = split_envelope(np.sort(rng.uniform(0, 10, rng.integers(1, 6))) + rng.uniform(0, 5))
        fixed, misses, layers = rng.uniform(0, 20, 8), rng.integers(0, 30, 8), rng.integers(1, 6, 8).astype(float)
        tau = float(rng.uniform(0.1, 5))
        need = split_window_need(fixed, misses, layers, envelope, tau)
        experts = len(envelope) - 1
        for f, m, n, got in zip(fixed, misses, layers, need):
            b = np.linspace(0, min(experts, m / n), 20001)
            grid = np.maximum(tau * (m - n * b), f + n * np.interp(b, np.arange(experts + 1), envelope)).min()
            assert got == pytest.approx(grid, rel=1e-3, abs=1e-9)
            assert got <= grid * (1 + 1e-12)


#: seconds a replay's step or window may fall short of its floor by float rounding of absolute times
ULPS_S = 1e-12


def _members(path: str, profile, slots: dict[str, str]):
    shape = TraceShape.of(path, read_meta(path).model.num_experts)
    sims = {name: prepare(path, profile, name, slots) for name in members("oracle")}
    return shape, racing_members(sims, shape, (), {})


def _run(member) -> np.ndarray:
    member.advance(len(member.shape.rows) + 1, lambda: False)
    return np.array([s.end - s.start for s in member.sim.steps])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 3), experts=st.integers(3, 8), top_k=st.integers(1, 3), decode=st.integers(4, 20),
       seed=st.integers(0, 99), cpu=st.sampled_from([(100.0, 1000.0), (1000.0, 10000.0)]),
       sync=st.sampled_from([0.0, 20.0, 500.0]),
       slots=st.sampled_from(["cache.slots_per_layer=0", "cache.slots_per_layer=1", "cache.slots_per_layer=2",
                              "cache.slots=3"]),
       pcie=st.sampled_from([0.0001, 0.001, 0.05]), engines=st.integers(1, 2))
def test_split_floors_never_exceed_a_replay(tmp_path_factory, layers, experts, top_k, decode, seed, cpu, sync,
                                            slots, pcie, engines):
    """One request decoded token by token (every decode window's layers alike), CPU experts from as fast as
    a GPU one to ten times slower, syncs from none to longer than an expert, copies slow and fast: for every
    member of the oracle each step lasts at least its floor, and each window of every length at least its
    need (the split of its experts with its copies included)."""
    model = tiny_model(layers=layers, experts=experts, top_k=min(top_k, experts), shared=True)
    path = tmp_path_factory.mktemp("split") / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=1, prompt_len=2, decode_len=decode, batch=1,
                                         seed=seed), path)
    profile = tiny_profile(pcie_gbps=pcie, copy_engines=engines, cpu_us=cpu, sync_us=sync)
    key, value = slots.split("=")
    shape, racing = _members(str(path), profile, {key: value})
    windows = Windows.of(shape)
    for member in racing:
        fixed = MemberCosts.of(member.sim).fixed_all(shape)
        needs = window_needs(member.sim, shape, windows, fixed)
        durations = _run(member)
        # a step's duration is the difference of two absolute times (seconds into the run): a few ulps of
        # those off, beyond a floor's relative rounding (an exact floor, every expert on the GPU, meets it)
        assert (durations >= member.floors.steps * (1 - 1e-12) - ULPS_S).all(), member.name
        at = np.concatenate([[0.0], np.cumsum(durations)])
        for length, need in needs.items():
            starts, ends, _ = windows.by_length[length]
            assert (at[ends] - at[starts] >= need * (1 - 1e-12) - ULPS_S).all(), (member.name, length)


def test_split_window_floor_binds_a_prefetching_member(tmp_path, monkeypatch):
    """hybrimoe (its own planning: taken to prefetch and split as it likes) with one slot a layer, CPU experts
    as fast as GPU ones and syncs long: each layer's least split runs one expert on the CPU beside the GPU's,
    and every miss past that costs a copy or a CPU expert, so the windows' floor lies above both the per-step
    floors and the windows' floor without the split, and still below the replay."""
    model = tiny_model(layers=2, experts=8, top_k=2, shared=True)
    path = tmp_path / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=1, prompt_len=2, decode_len=16, seed=3), path)
    profile = tiny_profile(pcie_gbps=0.05, cpu_us=(100.0, 1000.0), sync_us=200.0)
    shape = TraceShape.of(str(path), model.num_experts)
    sims = {"hybrimoe": prepare(str(path), profile, "hybrimoe", {"cache.slots_per_layer": "1"})}
    member = racing_members(sims, shape, (), {})[0]
    traits = Traits.of(member.sim)
    assert (traits.defers, traits.no_prefetch, traits.windowed) == (False, False, True)
    windows = Windows.of(shape)
    fixed = MemberCosts.of(member.sim).fixed_all(shape)
    needs = window_needs(member.sim, shape, windows, fixed)
    # a one-token decode step: its work outside the experts, then per layer the least split: GPU experts 115 us
    # (launch included), shared 115 us, CPU 100 us after a 200 us sync: none on the CPU 345 us, one 300 us (the
    # CPU side), both 400 us; the fractional balance, with no sync, is 160.5 us
    parts = MemberCosts.of(member.sim)
    split = parts.split_costs(1, (1, 1), "decode", traits)
    np.testing.assert_allclose(split, [345e-6, 300e-6, 400e-6], rtol=1e-9)
    decode = [i for i, phase in enumerate(shape.phases) if phase == "decode"]
    np.testing.assert_allclose(member.floors.steps[decode], fixed[decode] + 2 * split[1], rtol=1e-12)
    # the windows: above the per-step floors, and above what they were without the split
    assert member.floors.extra_span[0] > 0.0
    with monkeypatch.context() as patch:
        patch.setattr(window_floors_module, "split_window_need", lambda fixed, *_: np.zeros(len(fixed)))
        without = window_needs(member.sim, shape, windows, fixed)
        assert MemberFloors.of(member.sim, shape, windows).extra_span[0] < member.floors.extra_span[0]
    assert any((needs[length] > without[length] * (1 + 1e-9)).any() for length in needs)
    durations = _run(member)
    at = np.concatenate([[0.0], np.cumsum(durations)])
    assert at[-1] >= member.left_span[0]
    for length, need in needs.items():
        starts, ends, _ = windows.by_length[length]
        assert (at[ends] - at[starts] >= need * (1 - 1e-12)).all()
