"""moesim.policy.checked: what a policy of one's own is held to as it runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerPlan, LayerView, PolicyError
from moesim.policy.checked import plan_fault
from moesim.policy.state import CacheState
from moesim.policy.systems import ComposedSystem, SystemSpec, register_system
from tests.factories import tiny_model, tiny_profile, write_trace_and_profile


def _view(resident: set[int], in_flight: set[int], capacity: int = 3) -> LayerView:
    """One decode token of layer 0 of a one-layer, 8-expert model, routed to experts 4 and 5."""
    model = tiny_model(layers=1, experts=8, top_k=2)
    cache = CacheState([capacity])
    cache.resident[0].update(resident)
    cache.in_flight[0].update(in_flight)
    return LayerView(0, 0, "decode", np.array([[4, 5]]), [4, 5], [1, 1], cache, CostModel(tiny_profile(), model))


def test_a_plan_that_cancels_prefetches_is_still_held_to_the_slots_they_free():
    """A plan with cancel_queued_prefetches skipped the slot check altogether: one of a user's own that loaded
    into a full layer stopped the engine with an AssertionError, an "internal error" naming no policy. The
    prefetches it cancels free at most their own slots."""
    view = _view(resident={0}, in_flight={2})  # 3 slots: 1 resident, 1 prefetch on its way, 1 free
    loads_two = LayerPlan(gpu=[4, 5], loads=[4, 5], cancel_queued_prefetches=True)
    assert plan_fault(view, loads_two) == ""  # the prefetch of 2, if still queued, frees the second slot
    loads_two.cancel_queued_prefetches = False
    assert plan_fault(view, loads_two) == "loads 2 experts into layer 0, which has 1 free slot (evict first: " \
                                          "plan.evictions)"
    full = _view(resident={0, 1, 2}, in_flight=set())
    overfill = LayerPlan(gpu=[4, 5], loads=[4, 5], cancel_queued_prefetches=True)
    assert plan_fault(full, overfill) == "loads 2 experts into layer 0, which has 0 free slots (evict first: " \
                                         "plan.evictions)"
    one_short = _view(resident={0}, in_flight={2, 3}, capacity=3)
    one_short.experts, one_short.active, one_short.counts = np.array([[4, 5], [6, 7]]), [4, 5, 6, 7], [1] * 4
    assert plan_fault(one_short, LayerPlan(gpu=[4, 5, 6, 7], loads=[4, 5, 6, 7], cancel_queued_prefetches=True)) \
        == "loads 4 experts into layer 0, which has at most 2 free slots (evict first: plan.evictions)"


def test_a_prefetch_of_the_layers_own_gpu_expert_frees_no_slot():
    """A queued prefetch of an expert the layer computes on the GPU becomes its load and is kept: its slot is not
    one the cancellation frees."""
    view = _view(resident={0, 1}, in_flight={4})
    plan = LayerPlan(gpu=[4, 5], loads=[5], cancel_queued_prefetches=True)
    assert plan_fault(view, plan) == "loads 1 expert into layer 0, which has 0 free slots (evict first: " \
                                     "plan.evictions)"


def test_a_users_plan_that_cancels_and_overfills_is_one_line_naming_it(tmp_path, own_systems):
    """The same through a replay: a PolicyError naming the class and the fault, not the engine's assertion."""
    import moesim

    @dataclass
    class CancelsAndOverfills(ComposedSystem):
        def plan(self, view):
            plan = super().plan(view)
            plan.loads, plan.streamed, plan.evictions = [*plan.loads, *plan.streamed], [], []
            plan.cancel_queued_prefetches = True
            return plan

    register_system("cancels-and-overfills", SystemSpec("", cache="lru", assign="gpu",
                                                        system_class=CancelsAndOverfills))
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=8)
    with pytest.raises(PolicyError, match=r"^system 'cancels-and-overfills' \(CancelsAndOverfills.plan\): at step "
                                          r"\d+, layer \d+, loads \d+ experts? into layer \d+, which has 0 free slot"):
        moesim.replay(trace, hw=hw, system="cancels-and-overfills", cache__slots_per_layer=1, timeline=False,
                      decisions=False)


@pytest.mark.parametrize("plan, fault, fix", [
    (LayerPlan(gpu=[4, 5, 4], loads=[4, 5]), "plans expert 4 twice on the GPU",
     "put each expert of view.active in exactly one of plan.gpu, plan.cpu and plan.deferred; see LayerPlan"),
    (LayerPlan(gpu=[4, 5]), "GPU expert 4 is neither resident, on its way, loaded (plan.loads) nor streamed",
     "add it to plan.loads (evicting a resident expert not in use, plan.evictions, when the layer is full) or "
     "plan.streamed, or compute it on the CPU (plan.cpu); see LayerPlan"),
    (LayerPlan(cpu=[4, 5], evictions=[(0, 6)]), "evicts expert 6 of layer 0, which is not resident",
     "evict each expert once, only experts of view.cache.resident[layer] that the layer does not compute on the "
     "GPU; see LayerPlan"),
    (LayerPlan(gpu=[4, 5], loads=[4, 5]), "loads 2 experts into layer 0, which has 0 free slots",
     "load or prefetch each expert once, only one neither resident nor on its way, no more than the layer's free "
     "slots plus what the plan evicts (plan.evictions); stream the rest (plan.streamed); see LayerPlan"),
])
def test_a_users_faulty_plan_is_told_the_fields_to_change(own_systems, plan, fault, fix):
    """Every fault of a system class of one's own had the same fix, "see LayerPlan ... for what each field
    holds", whatever it was: the fix now names the fields that make that fault go away."""
    from moesim.policy.checked import _CheckedPlan

    @dataclass
    class Fixed(ComposedSystem):
        def plan(self, view):
            return plan

    register_system("fixed-plan", SystemSpec("", cache="lru", assign="gpu", system_class=Fixed))
    from moesim.policy.systems import build_system
    checked = build_system("fixed-plan").plan
    assert isinstance(checked, _CheckedPlan)
    with pytest.raises(PolicyError) as caught:
        checked(_view(resident={0, 1, 2}, in_flight=set()))
    assert caught.value.detail.startswith(f"at step 0, layer 0, {fault}"), caught.value.detail
    assert caught.value.fix.startswith(fix), caught.value.fix


def test_a_component_whose_methods_cannot_be_wrapped_has_its_plans_checked(tmp_path, own_systems):
    """A component whose instance refuses new attributes kept its methods unchecked, and nothing checked the plans
    they made (engine.check is off by default): victims of experts not resident stopped the engine with an
    AssertionError, an internal error naming no policy."""
    import moesim
    from moesim.policy.cache import CachePolicy
    from moesim.policy.systems import COMPONENTS, register_component

    @dataclass
    class EvictsAbsent(CachePolicy):
        name = "evicts-absent-unwrapped"

        def __setattr__(self, key, value):
            if key in ("victims", "touch", "initial", "admission_order", "pool_victims", "spread", "configure",
                       "for_model"):
                raise AttributeError(f"{key} is read-only")
            super().__setattr__(key, value)

        def victims(self, view, layer, n, protected, incoming=None):
            return [e for e in range(8) if e not in view.cache.resident[layer] and e not in protected][:n]

    register_component(EvictsAbsent)
    try:
        register_system("evicts-absent-unwrapped", SystemSpec("", cache="evicts-absent-unwrapped", assign="gpu"))
        trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=8)
        with pytest.raises(PolicyError, match=r"^system 'evicts-absent-unwrapped' \(ComposedSystem.plan\): at step "
                                              r"\d+, layer \d+, evicts expert \d+ of layer \d+, which is not resident"):
            moesim.replay(trace, hw=hw, system="evicts-absent-unwrapped", cache__slots_per_layer=1, timeline=False,
                          decisions=False)
    finally:
        COMPONENTS["cache"].pop("evicts-absent-unwrapped", None)
