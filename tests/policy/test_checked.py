"""moesim.policy.checked: what a policy of one's own is held to as it runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerPlan, LayerView, PolicyError
from moesim.policy.checked import plan_fault
from moesim.policy.state import CacheState
from moesim.policy.systems import SYSTEMS, ComposedSystem, SystemSpec, register_system
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


@pytest.fixture
def registered():
    systems = dict(SYSTEMS)
    yield
    SYSTEMS.clear()
    SYSTEMS.update(systems)


def test_a_users_plan_that_cancels_and_overfills_is_one_line_naming_it(tmp_path, registered):
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
