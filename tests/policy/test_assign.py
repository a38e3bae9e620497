"""The oracle's split search (BestSplit): its incremental estimates are the plain estimates, number for number,
and its shortcut for experts alike chooses as the full search."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policy.assign import BestSplit, SplitCosts
from moesim.policy.base import LayerView
from moesim.policy.state import CacheState

times = st.floats(0.0, 5.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 12), engines=st.integers(1, 3), data=st.data())
def test_prefix_estimates_equal_the_estimates(n, engines, data):
    experts = list(range(n))
    now = data.draw(times)
    ready = {e: data.draw(st.one_of(st.none(), st.just(now), times)) for e in experts}
    table = SplitCosts(now=now, gpu={e: data.draw(times) for e in experts}, cpu={e: data.draw(times) for e in experts},
                       ready=ready, load=data.draw(times), shared=data.draw(times), sync=data.draw(times),
                       link_free=sorted(data.draw(times) for _ in range(engines)))
    order = data.draw(st.permutations(experts))
    lengths = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=n + 1))))
    got = table.prefix_estimates(order, lengths)
    assert got == [table.estimate(order[:i], order[i:]) for i in lengths]


def test_prefix_estimates_by_hand():
    """Now 0, shared 1; expert 0 resident (gpu 2, cpu 5), expert 1 loaded in 3 (gpu 1, cpu 1), sync 0.5.
    All on the CPU: 0.5 + 6; expert 0 on the GPU: max(1 + 2, 0.5 + 1) = 3; both: max(3, 3) + 1 = 4."""
    table = SplitCosts(now=0.0, gpu={0: 2.0, 1: 1.0}, cpu={0: 5.0, 1: 1.0}, ready={0: 0.0, 1: None}, load=3.0,
                       shared=1.0, sync=0.5, link_free=[0.0])
    assert table.prefix_estimates([0, 1], [0, 1, 2]) == [6.5, 3.0, 4.0]


class _Costs:
    """The cost-model calls the split search makes, with drawn numbers."""

    def __init__(self, gpu: float, cpu: float, load: float, shared: float, sync: float) -> None:
        self.model = SimpleNamespace(shared_intermediate_size=1 if shared else 0)
        self._gpu, self._cpu, self.expert_load, self._shared, self.sync_s = gpu, cpu, load, shared, sync

    def gpu_expert(self, tokens: int) -> float:
        return self._gpu * tokens

    def cpu_expert(self, tokens: int) -> float:
        return self._cpu * tokens

    def gpu_shared(self, tokens: int) -> float:
        return self._shared


#: few distinct values, so that ties between estimates and between sort keys happen
coarse = st.sampled_from([0.0, 1e-9, 0.25, 0.5, 1.0, 2.0, 3.0])


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 16), tokens=st.integers(1, 3), engines=st.integers(1, 3), data=st.data())
def test_the_search_for_experts_alike_chooses_as_the_full_search(n, tokens, engines, data):
    """A decode layer's shortcut (every expert the same tokens) returns the full search's split, list for
    list: resident, arriving and missing experts, ties between candidates, one to three copy engines."""
    experts = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n, unique=True))
    resident = set(data.draw(st.lists(st.sampled_from(experts), unique=True)))
    now = data.draw(st.sampled_from([0.0, 1.0, 1e6]))
    arriving = [e for e in experts if e not in resident and data.draw(st.booleans())]
    arrivals = {e: now + data.draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 4.0])) for e in arriving}
    costs = _Costs(*(data.draw(coarse) for _ in range(5)))
    cache = CacheState(capacity=[64], pool=None)
    cache.resident[0] |= resident
    cache.in_flight[0] |= set(arrivals)
    view = LayerView(0, 0, "decode", np.array([experts] * tokens), list(experts), [tokens] * n, cache, costs,
                     now=now, arrivals=arrivals, expert_launch_s=data.draw(coarse),
                     shared_launch_s=data.draw(coarse))
    search = BestSplit()
    search.configure(SimpleNamespace(costs=SimpleNamespace(profile=SimpleNamespace(
        pcie=SimpleNamespace(copy_engines=engines)))))
    assert search.split(view) == search._split_any(view)


def test_the_search_for_experts_alike_by_hand():
    """Now 0, no shared experts, gpu 1 and cpu 2 per expert, load 3, sync 0; experts 5 and 7 resident, 6 not.
    Prefixes of (5, 7, 6): 0 -> 6 (all CPU), 1 -> max(1, 4) = 4, 2 -> max(2, 2) = 2, 3 -> 3 + 1 = 4; the
    resident candidate (5, 7 on the GPU) also takes 2 and comes first, so it wins, in routing order."""
    cache = CacheState(capacity=[8], pool=None)
    cache.resident[0] |= {5, 7}
    view = LayerView(0, 0, "decode", np.array([[7, 6, 5]]), [7, 6, 5], [1, 1, 1], cache,
                     _Costs(1.0, 2.0, 3.0, 0.0, 0.0))
    search = BestSplit()
    assert search.split(view) == ([7, 5], [6]) == search._split_any(view)
