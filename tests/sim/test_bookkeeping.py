"""Plan bookkeeping: the gate-weight mass a plan's substitutions and deferrals touch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policy.base import LayerPlan, LayerView, Substitutions
from moesim.sim.bookkeeping import substitution_mass, weight_mass


def _view(weights: np.ndarray) -> LayerView:
    experts = np.zeros(weights.shape, dtype=np.int16)
    return LayerView(0, 0, "decode", experts, [0], [weights.size], None, None, weights=weights)


def test_substitution_mass_adds_the_rewritten_entries():
    weights = np.array([[0.5, 0.25], [0.125, 0.0625]], dtype=np.float32)
    plan = LayerPlan(substitutions=[(0, 1, 3), (1, 0, 2), (1, 1, 4)])
    assert substitution_mass(_view(weights), plan) == 0.25 + 0.125 + 0.0625
    assert substitution_mass(_view(weights), LayerPlan()) == 0.0
    # no weights in the trace: the mass is unknown (NaN), not 0
    assert np.isnan(substitution_mass(LayerView(0, 0, "decode", np.zeros((1, 2)), [], [], None, None), plan))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([np.float16, np.float32, np.float64]), st.integers(1, 40), st.data())
def test_substitution_mass_is_the_entry_by_entry_sum_in_the_weights_dtype(dtype, tokens, data):
    """The mass is a running sum in the weights' dtype, entry by entry in plan order (a prefill rewrites
    thousands of entries at once): the very number a Python sum over the entries gives."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    weights = rng.random((tokens, 4)).astype(dtype)
    entries = data.draw(st.lists(st.tuples(st.integers(0, tokens - 1), st.integers(0, 3)), min_size=1,
                                 max_size=200))
    plan = LayerPlan(substitutions=[(row, slot, 0) for row, slot in entries])
    expected = float(sum(weights[row, slot] for row, slot in entries))
    assert substitution_mass(_view(weights), plan) == expected


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([np.float16, np.float32, np.float64]), st.integers(1, 300), st.data())
def test_substitution_mass_of_rewrites_held_as_arrays_is_the_same_running_sum(dtype, tokens, data):
    """A prefill's thousands of rewrites come as :class:`Substitutions` (arrays): their mass, summed by the
    ufunc's accumulation, is the entry-by-entry number of the same rewrites as a list."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    weights = rng.random((tokens, 4)).astype(dtype)
    chosen = np.flatnonzero(rng.random(tokens * 4) < data.draw(st.floats(0.01, 1.0)))
    if not chosen.size:
        chosen = np.array([0])
    rows, slots = np.divmod(chosen, 4)
    as_arrays = LayerPlan(substitutions=Substitutions(rows, slots, np.zeros_like(rows)))
    as_list = LayerPlan(substitutions=list(as_arrays.substitutions))
    assert substitution_mass(_view(weights), as_arrays) == substitution_mass(_view(weights), as_list)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([np.float16, np.float32]), st.integers(1, 12), st.integers(1, 3), st.data())
def test_weight_mass_is_the_sum_of_the_masked_entries_whatever_the_path(dtype, top_k, tokens, data):
    """One token (read from its row) and a few tokens (a broadcast mask) give the very number np.isin's
    mask selects and sums: the same entries, in row order, summed by numpy in the weights' dtype."""
    experts = np.array([data.draw(st.permutations(range(16)))[:top_k] for _ in range(tokens)], dtype=np.int16)
    weights = np.array(data.draw(st.lists(st.floats(0, 1, width=16), min_size=experts.size, max_size=experts.size)),
                       dtype=dtype).reshape(experts.shape)
    chosen = data.draw(st.lists(st.integers(0, 15), unique=True, max_size=16))
    view = LayerView(0, 0, "decode", experts, [], [], None, None, weights=weights)
    expected = float(weights[np.isin(experts, chosen)].sum()) if chosen else 0.0
    assert weight_mass(view, chosen) == expected


def test_weight_mass_without_the_traces_weights_is_unknown_not_zero(tmp_path):
    """A trace without a ``weights`` column cannot say how much gate weight a deferral or rewrite touched: NaN
    (null in --json), where 0.0 claimed that nothing was touched; with nothing deferred it is still 0."""
    import math

    from moesim.analysis.metrics import metrics
    from moesim.sim.run import simulate
    from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace
    view = LayerView(0, 0, "decode", np.array([[1, 2]], dtype=np.int16), [], [], None, None)
    assert math.isnan(weight_mass(view, [1])) and weight_mass(view, []) == 0.0
    model = tiny_model(layers=2, experts=8, top_k=4)
    routing = random_routing(np.random.default_rng(0), model, 1, 4, 6)
    without = write_tiny_trace(tmp_path / "n.parquet", model, routing)
    table = pq.read_table(without)
    weights = pa.FixedSizeListArray.from_arrays(pa.array(np.full(table.num_rows * 4, 0.25, np.float32)), 4)
    with_weights = tmp_path / "w.parquet"
    pq.write_table(table.append_column("weights", weights), with_weights)
    settings = {"defer.deferred": "2"}
    known = metrics(simulate(str(with_weights), tiny_profile(), "ktransformers-ed", settings))
    unknown = metrics(simulate(str(without), tiny_profile(), "ktransformers-ed", settings))
    assert known["deferred_experts"] == unknown["deferred_experts"] > 0
    assert known["deferred_weight_mass"] == pytest.approx(known["deferred_experts"] * 0.25 / (table.num_rows * 4))
    assert math.isnan(unknown["deferred_weight_mass"]) and unknown["substituted_weight_mass"] == 0.0


# ----------------------------------------------------------------------------- check_plan (engine.check)
def _checked_view(active=(0, 1), resident=(2,), in_flight=(3,), layer=0) -> LayerView:
    from moesim.policy.state import CacheState
    cache = CacheState(capacity=[4, 4], resident=[set(resident), set()], in_flight=[set(in_flight), set()])
    experts = np.array([list(active)], dtype=np.int16)
    costs = SimpleNamespace(model=SimpleNamespace(num_experts=4))  # all the check reads of the costs
    return LayerView(7, layer, "decode", experts, list(active), [1] * len(active), cache, costs)


@pytest.mark.parametrize("plan, words", [
    (LayerPlan(gpu=[0, 0], cpu=[1]), "plans expert 0 twice on the GPU"),
    (LayerPlan(gpu=[0], cpu=[1, 1]), "plans expert 1 twice on the CPU"),
    (LayerPlan(gpu=[0, 1], cpu=[1]), "plans expert 1 twice (on the GPU and on the CPU)"),
    (LayerPlan(gpu=[], cpu=[0]), "leaves out routed expert 1"),
    (LayerPlan(gpu=[], cpu=[0, 1, 4]), "plans expert 4 not routed at this layer"),
    (LayerPlan(gpu=[], cpu=[0, 1], evictions=[(0, 2)], writebacks=[(1, 2)]),
     "writes back an expert it does not evict"),
    # one copy for the kernel and a second into the cache: the same bytes over PCIe twice
    (LayerPlan(gpu=[0], cpu=[1], streamed=[0], prefetches=[(0, 0)]),
     "streams expert 0 and prefetches it at the same layer, both before its GPU work"),
    (LayerPlan(gpu=[], cpu=[0, 1], evictions=[(0, 3)]), "evicts expert 3 of layer 0, which is on its way"),
    # a negative overhead or prediction would move the layer's clock back
    (LayerPlan(gpu=[], cpu=[0, 1], overhead_s={"predict": -1e-3}),
     "plan.overhead_s['predict'] is -0.001, not finite seconds >= 0"),
    (LayerPlan(gpu=[], cpu=[0, 1], overhead_s={"predict": float("nan")}), "not finite seconds >= 0"),
    (LayerPlan(gpu=[], cpu=[0, 1], overhead_s=[("predict", 1e-3)]), "not a dict of breakdown category"),
    (LayerPlan(gpu=[], cpu=[0, 1], prefetch_after_predict=-2e-6),
     "plan.prefetch_after_predict is -2e-06, not None or finite seconds >= 0"),
    (LayerPlan(gpu=[], cpu=[0, 1], prefetch_after_predict=float("inf")), "not None or finite seconds >= 0"),
])
def test_a_failed_engine_check_is_one_line_naming_the_fault(plan, words):
    """engine.check failed with a bare AssertionError (a traceback, 'expert planned twice' at best)."""
    from moesim.policy.base import PolicyError
    from moesim.sim.bookkeeping import check_plan
    with pytest.raises(PolicyError) as caught:
        check_plan(_checked_view(), plan)
    message = str(caught.value)
    assert "\n" not in message and words in message and "at step 7, layer 0" in message, message


def test_evicting_an_expert_the_layer_computes_on_the_gpu_is_refused():
    from moesim.policy.base import PolicyError
    from moesim.sim.bookkeeping import check_plan
    view = _checked_view(active=(0, 2), resident=(2,))
    with pytest.raises(PolicyError, match="evicts expert 2, which it computes on the GPU at this layer"):
        check_plan(view, LayerPlan(gpu=[2], cpu=[0], evictions=[(0, 2)]))


def test_a_plan_that_keeps_every_invariant_passes():
    from moesim.sim.bookkeeping import check_plan
    check_plan(_checked_view(active=(0, 2), resident=(2,)),
               LayerPlan(gpu=[2], cpu=[], deferred=[0]))
    check_plan(_checked_view(), LayerPlan(gpu=[], cpu=[1], deferred=[0], evictions=[(0, 2)], writebacks=[(0, 2)]))
    check_plan(_checked_view(), LayerPlan(gpu=[], cpu=[0, 1], overhead_s={"predict": 0.0, "cache_management": 1e-6},
                                          prefetch_after_predict=0.0))
    # a slot filled once the kernel has used its streamed copy (SMoE's cache fill at the prefill's end)
    check_plan(_checked_view(), LayerPlan(gpu=[0], cpu=[1], streamed=[0], prefetches=[(0, 0)], prefetch_after_gpu=True))


def test_a_replay_whose_plan_breaks_the_check_stops_with_one_line(tmp_path):
    """The engine's check on a catalogue system's plan (here made to evict an expert it is about to use)."""
    from moesim.policy.base import PolicyError
    from moesim.sim.run import prepare
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 3, prompt=2, decode=4)
    sim = prepare(trace, hw, "gpu-only-lru", {"engine.check": "true", "cache.slots_per_layer": "6"})
    plan = sim.system.plan

    def evicting(view):
        out = plan(view)
        used = [e for e in out.gpu if e in view.cache.resident[view.layer]]
        if used:
            out.evictions = [*out.evictions, (view.layer, used[0])]
        return out

    sim.system.plan = evicting
    with pytest.raises(PolicyError, match=r"^[^\n]*at step \d+, layer \d, evicts expert \d, which it computes on "
                                          r"the GPU at this layer[^\n]*$"):
        sim.run()


def test_prefetches_no_engine_started_by_the_end_count_as_cancelled(tmp_path):
    """SMoE fills its decode cache when the prefill ends (000 Sec. IV-E); on a prefill-only trace the run ends
    with those prefetches queued behind the first. They copy nothing (no bytes, no busy time), so they are
    cancelled: issued prefetches less cancelled ones are the copies whose bytes the run counts (before, 8
    prefetches were reported with one expert's bytes)."""
    from moesim.analysis.metrics import metrics
    from moesim.sim.run import simulate
    from tests.factories import tiny_model, tiny_profile, write_tiny_trace

    model = tiny_model(layers=2, experts=4, top_k=2)
    prompt = [[0, 1], [1, 2], [2, 3]]  # three prompt tokens, the same experts at both layers
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "prefill", "tokens": {0: (0, [prompt, prompt])}}])
    m = metrics(simulate(str(trace), tiny_profile(), "smoe"))
    expert_bytes = 3 * 64 * 128 * 2
    assert m["prefetches"] == 8 and m["demand_loads"] == m["streamed_experts"] == 0
    assert m["pcie_h2d_bytes"] == expert_bytes  # the first fill copy starts before the prefill's CPU work ends
    assert m["cancelled_prefetches"] == 7
