"""The copy engines serve copies in simulated-time order even though the forward pass places them lazily.

A demand copy issued at ``t`` goes ahead of every prefetch no engine has started by ``t`` (docs/engine.md,
Copies). The GPU track can ask for a queued prefetch's end (:meth:`CopyEngines.finish`), which starts the queue
up to it at times later than the stream's position; a staging copy whose buffer had freed before those starts
must still go first.
"""

from __future__ import annotations

import pytest

from moesim.policy.base import LayerPlan
from moesim.sim.result import result_to_frames
from moesim.sim.run import prepare
from tests.factories import tiny_model, tiny_profile, write_tiny_trace

MS = 1e-3
#: 49,152 bytes of a tiny expert at 4.9152 MB/s and no latency: one copy takes 10 ms
COPY_GBPS = 49_152 / 10e-3 / 1e9


def scripted(plans: dict[int, LayerPlan]):
    """A plan function giving each step's (one layer's) plan as written."""
    return lambda view: plans[view.step]


def test_a_staging_copy_goes_ahead_of_prefetches_started_after_its_buffer_freed(tmp_path):
    """One MoE layer, one staging buffer, 16 experts of which 0-7 are resident (attention 50 us, a GPU
    expert 115 us, a copy 10 ms on one engine). Step 0 computes 0, 1, 2 on the GPU and prefetches 8, 9, 10
    over 5, 6, 7: 8 copies from 0.05 to 10.05 ms, 9 and 10 queue. Step 1 (from 0.395 ms) routes 10, 11, 12 and
    runs them in the order 11, 10, 12, streaming 11 and 12 through the one buffer: 11's copy, a demand,
    goes ahead of the queued 9 and 10 (10.05-20.05 ms), and 11 computes until 20.165 ms, which frees the
    buffer for 12. 9 started at 20.05 ms, before that; 10 had not, so 12's copy goes ahead of it:
    12 copies 30.05-40.05 ms and 10 40.05-50.05 ms; then the GPU runs 10 (50.05-50.165) and 12 (to 50.28).
    The GPU track used to issue 12's copy only on reaching 12, after it had waited for 10, whose copy the
    engines had started at 30.05 ms, after 12's buffer was free: 12 copied 40.05-50.05 ms behind it."""
    model = tiny_model(layers=1, experts=16, top_k=3)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[10, 11, 12]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    sim = prepare(str(path), tiny_profile(pcie_gbps=COPY_GBPS, latency_us=0.0), "gpu-only-lru",
                  {"cache.slots_per_layer": "8", "engine.staging_slots": "1"}, timeline=True)
    sim.system.plan = scripted({
        0: LayerPlan(gpu=[0, 1, 2], prefetches=[(0, 8), (0, 9), (0, 10)], evictions=[(0, 5), (0, 6), (0, 7)]),
        1: LayerPlan(gpu=[11, 10, 12], streamed=[11, 12]),
    })
    result = sim.run()
    assert result.initial_resident == [list(range(8))]
    pcie = result_to_frames(result)["timeline"].query("resource == 'pcie'")
    copies = {(kind, expert): (start / MS, end / MS)
              for kind, expert, start, end in zip(pcie.kind, pcie.expert, pcie.start_s, pcie.end_s)}
    near = {"abs": 1e-5}  # ms: the embedding's 0.21 ns shifts every time
    assert copies == {("prefetch", 8): pytest.approx((0.05, 10.05), **near),
                      ("stage", 11): pytest.approx((10.05, 20.05), **near),
                      ("prefetch", 9): pytest.approx((20.05, 30.05), **near),
                      ("stage", 12): pytest.approx((30.05, 40.05), **near),
                      ("prefetch", 10): pytest.approx((40.05, 50.05), **near)}
    gpu = result_to_frames(result)["timeline"].query("resource == 'gpu' and kind == 'expert' and step == 1")
    assert list(gpu.expert) == [11, 10, 12]
    assert (gpu.start_s / MS).tolist() == pytest.approx([20.05, 50.05, 50.165], **near)
    assert gpu.end_s.max() / MS == pytest.approx(50.28, **near)
