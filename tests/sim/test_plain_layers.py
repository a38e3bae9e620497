"""The engine's short path for a plan of CPU and GPU experts alone (``Simulator._layer`` without
``_execute``), and the per-layer objects made without calling their classes (``layer_view``,
``split_plan``) or the call skipped (``ComposedSystem.planner``), replay exactly as the general path does.

Forcing every plan through ``_execute`` must change no figure, no step's times and no timeline span.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moesim.policy.base import LayerPlan, LayerView, layer_view, split_plan
from moesim.policy.systems import ComposedSystem, build_system
from moesim.sim.engine import Simulator
from moesim.sim.run import prepare
from moesim.trace.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plain") / "decode.parquet"
    config = SynthConfig.from_settings(model="deepseek-v2-lite", requests=2, prompt_len=6, decode_len=30,
                                       batch=1, seed=5, settings={}, scores=True)
    synthesize(config, path)
    return str(path)


def replay(trace: str, system: str, general: bool, settings: dict[str, str] | None = None) -> tuple[tuple, int]:
    """A replay's figures, step times, timeline and cache sets, and how many layers went through _execute."""
    sim = prepare(trace, "rtx4090", system, {"cache.slots_per_layer": "10", **(settings or {})})
    sim._execute_all = general
    executed = [0]
    execute = sim._execute

    def counted(*args):
        executed[0] += 1
        return execute(*args)

    sim._execute = counted
    result = sim.run()
    figures = (dict(vars(result.counters)), [(r.step, r.phase, r.start, r.end) for r in result.steps],
               result.pcie_busy_s, result.pcie_bytes, result.makespan_s, result.timeline,
               [list(s) for s in sim.cache.resident], sim.cpu_free, sim.deferred_until)
    return figures, executed[0]


@pytest.mark.parametrize("system", ["cpu-only", "ktransformers", "static-hot", "all-in-gpu", "gpu-only-lru",
                                    "fiddler", "llamacpp", "ktransformers-ed"])
def test_plain_plans_replay_as_through_execute(trace, system):
    short, executed = replay(trace, system, general=False)
    layers = len(short[1]) * 26  # DeepSeek-V2-Lite: 26 MoE layers a step
    if system in ("cpu-only", "ktransformers", "static-hot", "all-in-gpu", "llamacpp"):
        assert executed < layers / 2, "most of these plans compute their experts where they are"
    general, executed = replay(trace, system, general=True)
    assert executed == layers
    assert short == general


@pytest.mark.parametrize("system", ["cpu-only", "static-hot"])
def test_plain_plans_draw_the_same_timeline(trace, system):
    short, _ = replay(trace, system, general=False, settings={"engine.timeline": "true"})
    general, _ = replay(trace, system, general=True, settings={"engine.timeline": "true"})
    assert short[5] and short == general


def test_layer_view_is_the_constructed_view():
    experts = np.array([[3, 1]], dtype=np.int16)
    args = (4, 2, "decode", experts, [3, 1], [1, 1], object(), object(), np.ones((1, 2)), None, {}, 1.5,
            {3: 2.0}, 1e-6, 2e-6, np.array([0]), 17)
    made, constructed = layer_view(*args), LayerView(*args)
    for f in dataclasses.fields(LayerView):  # every field set, a field added later included
        assert getattr(made, f.name) is getattr(constructed, f.name), f.name


def test_split_plan_is_the_constructed_plan():
    gpu, cpu = [1, 2], [3]
    made, constructed = split_plan(gpu, cpu), LayerPlan(gpu, cpu)
    for f in dataclasses.fields(LayerPlan):
        assert getattr(made, f.name) == getattr(constructed, f.name), f.name
    assert made.gpu is gpu and made.cpu is cpu
    other = split_plan([], [])
    for name in ("loads", "streamed", "prefetches", "evictions", "writebacks", "substitutions", "deferred",
                 "overhead_s"):
        assert getattr(made, name) is not getattr(other, name), f"{name}: a fresh container for every plan"


def test_planner_skips_plan_only_where_plan_would_place():
    plain = build_system("cpu-only")
    assert plain.planner() == plain._place
    for substituting in ("buddymoe", "ktransformers-ed"):  # a substitution, a deferral: plan() itself
        system = build_system(substituting)
        assert system.planner() == system.plan
    replaced = build_system("cpu-only")
    replaced.plan = lambda view: LayerPlan()  # patched on the instance (tests script plans so)
    assert replaced.planner() is replaced.plan

    class Own(ComposedSystem):
        def plan(self, view):
            return super().plan(view)

    own = Own(name="own", cache=plain.cache, assign=plain.assign, prefetch=plain.prefetch)
    assert own.planner() == own.plan


def test_planner_calls_a_plan_replaced_on_the_class(monkeypatch):
    """A spy set on ComposedSystem.plan (a notebook's, or tests/backends' request check) is called for
    every layer: planner() compared plan with ComposedSystem.plan, which was then the spy itself."""
    original = ComposedSystem.plan
    monkeypatch.setattr(ComposedSystem, "plan", lambda self, view: original(self, view))
    system = build_system("cpu-only")
    assert system.planner() == system.plan


def test_decision_log_takes_the_general_path(trace):
    sim = prepare(trace, "rtx4090", "cpu-only", {"engine.decisions": "true"})
    assert isinstance(sim, Simulator) and sim._execute_all
    assert any(row[3] == "cpu" for row in sim.run().decisions)


def test_one_row_views_count_one_token_per_expert(trace):
    """A decode step's views share one list of token counts: one per expert, as a view built from its row."""
    sim = prepare(trace, "rtx4090", "cpu-only")
    views = []
    place = sim.system._place

    def watched(view):
        views.append((view, view.experts.copy()))
        return place(view)

    sim.system.plan = watched
    sim.run()
    decode = [(v, e) for v, e in views if v.phase == "decode"]
    assert decode
    for view, experts in decode:
        assert view.counts == [1] * experts.shape[1] == [1] * len(view.active)
        assert view.active == experts[0].tolist()
