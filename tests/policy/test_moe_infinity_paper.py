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
