"""The oracle's split search (BestSplit): its incremental estimates are the plain estimates, number for number."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policy.assign import SplitCosts

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
