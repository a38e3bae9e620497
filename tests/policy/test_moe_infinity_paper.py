"""MoE-Infinity against its public sources (Xue et al., arXiv 2401.14361; github.com/EfficientMoE/MoE-Infinity):
hand-worked cases of each mechanism."""

from __future__ import annotations

import numpy as np

from moesim.policy.catalog.moe_infinity.eam import ActivationTracker


def test_matching_averages_the_cosine_of_each_layer():
    """``ExpertTracer.find_most_similar`` ranks past EAMs by the mean over layers of each row's cosine.

    Current EAM q = [[4,0,0,0], [1,1,1,1]]; past A = [[4,0,0,0], [0,4,0,0]], past B = [[2,2,0,0], [1,1,1,1]].
    Row by row: A 1 + 1/2 = 1.5, B 1/sqrt(2) + 1 = 1.707, so B. One cosine over the flattened matrices
    would weigh the peaked first row more and pick A: 20 / (sqrt(20) sqrt(32)) = 0.791 against
    12 / (sqrt(20) sqrt(12)) = 0.775.
    """
    q = np.array([[4.0, 0, 0, 0], [1, 1, 1, 1]])
    a = np.array([[4.0, 0, 0, 0], [0, 4, 0, 0]])
    b = np.array([[2.0, 2, 0, 0], [1, 1, 1, 1]])
    assert a.ravel() @ q.ravel() / np.linalg.norm(a) / np.linalg.norm(q) > \
        b.ravel() @ q.ravel() / np.linalg.norm(b) / np.linalg.norm(q)
    tracker = ActivationTracker(2, 4, eamc_size=10, last_step={})
    tracker.add_to_collection(a, request=1)
    tracker.add_to_collection(b, request=2)
    match = tracker.best_match(q)
    assert np.allclose(match, [[np.sqrt(0.5), np.sqrt(0.5), 0, 0], [0.5, 0.5, 0.5, 0.5]])
    # a layer not reached yet (zero row) adds nothing: only the first row decides, and A matches it exactly
    assert np.allclose(tracker.best_match(np.array([[4.0, 0, 0, 0], [0, 0, 0, 0]])), [[1, 0, 0, 0], [0, 1, 0, 0]])


def test_each_prediction_replaces_the_queued_prefetches(tmp_path):
    """``ReplaceCacheCandidates`` empties the prefetch queue before each layer's new list is enqueued.

    Three layers, top-1, one slot per layer, 100 kB/s link (c = 10 us + 491.52 ms a copy). Request 0 routes
    to expert 0 everywhere; its match, request 1, used 2 at layer 1 and 3 at layer 2. At layer 0 the prediction
    sends (1, 2) onto the link and queues (2, 3). At layer 1 the queue is emptied before its demand load of 0,
    so (2, 3) never moves and layer 2's load of 0 follows layer 1's at once: the run is one copy shorter than
    with (2, 3) sent between them (seven copies, not eight).
    """
    from moesim.analysis.metrics import metrics
    from moesim.sim.result import result_to_frames
    from moesim.sim.run import simulate
    from tests.factories import tiny_model, tiny_profile, write_tiny_trace

    model = tiny_model(layers=3, experts=4, top_k=1)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [
        {"phase": "decode", "tokens": {0: (0, [[[0]], [[0]], [[0]]])}},
        {"phase": "decode", "tokens": {1: (0, [[[0]], [[2]], [[3]]])}},
    ])
    result = simulate(str(trace), tiny_profile(), "moe-infinity", {"cache.slots_per_layer": "1", "engine.check": "true"},
                      timeline=True)
    assert metrics(result)["cancelled_prefetches"] == 1
    frame = result_to_frames(result)["timeline"]
    link = frame[frame.resource == "pcie"].sort_values("start_s")
    c = 10e-6 + 49_152 / 1e5
    step0 = list(zip(link.kind, link.layer, link.expert))[:3]
    assert step0 == [("prefetch", 1, 2), ("load", 1, 0), ("load", 2, 0)]
    assert len(link) == 7 and link.end_s.iloc[-1] - link.start_s.iloc[0] < 7 * c + 1e-3
