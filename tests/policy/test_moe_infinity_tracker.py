"""ActivationTracker adds a one-request layer's routing when its matrices are next read: whatever the reads
in between, the EAMs, the run's counts, the batch EAM and the collection are those of adding every layer at
once (a plain per-request sum)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policy.base import LayerView, active_experts
from moesim.policy.catalog.moe_infinity.eam import ActivationTracker, unit_rows

LAYERS, EXPERTS = 3, 5


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pending_routing_reads_as_routing_added_at_once(data):
    last_step = {r: data.draw(st.integers(0, 5)) for r in range(3)}
    tracker = ActivationTracker(LAYERS, EXPERTS, eamc_size=4, last_step=last_step)
    tracker.total = np.zeros((LAYERS, EXPERTS))
    live: dict[int, np.ndarray] = {}
    total = np.zeros((LAYERS, EXPERTS))
    finished: list[np.ndarray] = []
    for step in range(data.draw(st.integers(1, 6))):
        serving = [r for r in range(3) if last_step[r] >= step]  # a finished request routes no more
        if not serving:
            break
        for r in [r for r in live if last_step[r] < step]:  # what observe retires at a new step
            finished.append(live.pop(r))
        for layer in range(LAYERS):
            rows = data.draw(st.integers(1, 3))
            routed = np.array(data.draw(st.lists(st.lists(st.integers(0, EXPERTS - 1), min_size=2, max_size=2,
                                                          unique=True), min_size=rows, max_size=rows)))
            # mostly one request per layer (the pending path), sometimes two (added at once)
            requests = np.array(data.draw(st.lists(st.sampled_from(serving), min_size=rows, max_size=rows)))
            view = LayerView(step, layer, "decode", routed, *active_experts(routed, EXPERTS), None, None,
                             requests=requests)
            tracker.observe(view)
            for r in sorted(set(requests.tolist())):  # a request's EAM starts at its first layer
                live.setdefault(r, np.zeros((LAYERS, EXPERTS)))
            for row, r in zip(routed, requests.tolist()):
                live[r][layer, row] += 1
                total[layer, row] += 1
            read = data.draw(st.sampled_from(["none", "none", "batch", "total", "live"]))
            if read == "batch":
                expected = sum((live[r] for r in sorted(set(requests.tolist()))), np.zeros((LAYERS, EXPERTS)))
                assert np.array_equal(tracker.batch_eam(view), expected)
            elif read == "total":
                assert np.array_equal(tracker.total, total)
            elif read == "live":
                assert sorted(tracker.live) == sorted(live)
    assert np.array_equal(tracker.total, total)
    assert sorted(tracker.live) == sorted(live)
    for r, eam in live.items():
        assert np.array_equal(tracker.live[r], eam)
    kept = [unit_rows(eam).ravel() for eam in finished if eam.any()][-4:]
    assert len(tracker.collection) == len(kept)
    for entry, expected in zip(tracker.collection, kept):
        assert np.array_equal(entry, expected)
