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


def test_a_staging_copy_goes_ahead_of_prefetches_the_cpu_tracks_started_after_its_buffer_freed(tmp_path):
    """The CPU tracks place the copies beside them from the CPU's start (host DRAM sharing), which starts the
    prefetch queue up to then; the deferred experts start when the layer's other CPU experts end, long after
    the layer began. One MoE layer, 10 of 19 experts resident, one staging buffer, one engine (a copy 10 ms),
    a CPU expert 10 ms and as DRAM-hungry as a copy, with the two together getting half their speed each
    (``hw.cpu.dram_combined_gbps`` = one copy's rate). Times in ms, ns dropped.

    Step 0 computes 0-5 on the GPU (0.05-0.74) and prefetches 10, 11, 12 over 7, 8, 9. Step 1 (attention to
    0.79) runs 15, 16, 17 on the CPU after the sync (from 0.81, 10 ms each alone) and defers 18, streaming 13
    and 14 through the buffer. The engine is never idle, so each CPU expert and copy runs at half speed:
    10 copies 0.05-19.29 (0.76 ms alone, 9.24 beside 15), 13, a demand issued at 0.79, 19.29-39.29 ahead of
    the queued 11 and 12, 11 39.29-59.29; the CPU experts end at 20.81, 40.81, 60.81. 13 computes 39.29-39.405
    and frees the buffer: 14's copy, issued then, goes ahead of 12, not started: 59.29-79.29. 18 runs from
    60.81 beside it to 79.29 (9.24 of its 10 ms), then alone to 80.05, where the step ends (the last layer
    waits for its deferred experts); 14 computes 79.29-79.405. 12 starts at 79.29, 0.38 ms of work beside 18
    and 9.62 alone: it ends at 89.67, past the run's end (its span is cut there).
    The deferred experts' placement beside the copies from 60.81 used to start 11 and 12 (at 39.29, 59.29)
    for good: 14 then copied 79.29-89.67 behind 12, and the step ended at 89.785."""
    model = tiny_model(layers=1, experts=19, top_k=6)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2, 3, 4, 5]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[13, 14, 15, 16, 17, 18]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    profile = tiny_profile(pcie_gbps=COPY_GBPS, latency_us=0.0, cpu_us=(10_000.0, 100_000.0))
    sim = prepare(str(path), profile, "gpu-only-lru",
                  {"cache.slots_per_layer": "10", "engine.staging_slots": "1",
                   "hw.cpu.dram_combined_gbps": str(COPY_GBPS)}, timeline=True)
    sim.system.plan = scripted({
        0: LayerPlan(gpu=[0, 1, 2, 3, 4, 5], prefetches=[(0, 10), (0, 11), (0, 12)],
                     evictions=[(0, 7), (0, 8), (0, 9)]),
        1: LayerPlan(gpu=[13, 14], streamed=[13, 14], cpu=[15, 16, 17], deferred=[18]),
    })
    result = sim.run()
    assert result.initial_resident == [list(range(10))]
    timeline = result_to_frames(result)["timeline"]
    spans = {(resource, kind, expert): (start / MS, end / MS) for resource, kind, expert, start, end
             in zip(timeline.resource, timeline.kind, timeline.expert, timeline.start_s, timeline.end_s)
             if kind in ("prefetch", "stage", "expert", "deferred") and (resource != "gpu" or expert >= 13)}
    near = {"abs": 1e-3}  # ms: to the microsecond
    assert spans == {("pcie", "prefetch", 10): pytest.approx((0.05, 19.29), **near),
                     ("pcie", "stage", 13): pytest.approx((19.29, 39.29), **near),
                     ("pcie", "prefetch", 11): pytest.approx((39.29, 59.29), **near),
                     ("pcie", "stage", 14): pytest.approx((59.29, 79.29), **near),
                     ("pcie", "prefetch", 12): pytest.approx((79.29, 80.05), **near),
                     ("cpu", "expert", 15): pytest.approx((0.81, 20.81), **near),
                     ("cpu", "expert", 16): pytest.approx((20.81, 40.81), **near),
                     ("cpu", "expert", 17): pytest.approx((40.81, 60.81), **near),
                     ("cpu", "deferred", 18): pytest.approx((60.81, 80.05), **near),
                     ("gpu", "expert", 13): pytest.approx((39.29, 39.405), **near),
                     ("gpu", "expert", 14): pytest.approx((79.29, 79.405), **near)}
    assert result.makespan_s / MS == pytest.approx(80.05, **near)
    prefetch_12 = sim.pending[0][12]
    assert (prefetch_12.start / MS, prefetch_12.end / MS) == pytest.approx((79.29, 89.67), **near)


def test_a_staging_copy_goes_ahead_of_prefetches_started_beside_the_previous_layers_deferred_work(tmp_path):
    """The same with the CPU track starting late because the previous layer's deferred experts run on: two
    MoE layers, 10 of 19 experts resident in each, the profile and settings of the test above; times in ms.

    Step 0 (1.02 in all) prefetches 10, 11, 12 into layer 1: 10 copies from 0.05. Step 1's layer 0 computes
    0 on the GPU (1.07-1.185) and defers 15, 16, 17 (after the sync, from 1.09): laid out beside 10, 11 and
    12 as then queued, at half speed, they end at 60.05. Layer 1 (from 1.235) streams 13 and 14 through the
    one buffer and runs 18 on the CPU, from 60.05 (the CPU is busy until then): 10 ends at 19.01 (1.04 ms
    alone, 8.96 at half speed), 13 copies 19.01-39.01 ahead of 11, 11 39.01-59.01; 13 computes until 39.125,
    when 14's copy is issued, ahead of 12: 59.01-79.01 (0.52 ms of work beside 17, 9.48 beside 18). 18 ends at
    79.53 (beside 14, then 0.52 ms alone); the GPU runs 14 (79.01-79.125) and 1; the step ends with 18.
    Laying 18 out beside the copies from 60.05 used to start 12 at 59.01 for good: 14 copied 79.01-89.27
    behind it (0.26 ms of work beside 18, then alone), and the step ended at 89.50."""
    model = tiny_model(layers=2, experts=19, top_k=4)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2, 3]], [[0, 1, 2, 3]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[0, 15, 16, 17]], [[13, 14, 18, 1]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    profile = tiny_profile(pcie_gbps=COPY_GBPS, latency_us=0.0, cpu_us=(10_000.0, 100_000.0))
    sim = prepare(str(path), profile, "gpu-only-lru",
                  {"cache.slots_per_layer": "10", "engine.staging_slots": "1",
                   "hw.cpu.dram_combined_gbps": str(COPY_GBPS)}, timeline=True)
    plans = {(0, 0): LayerPlan(gpu=[0, 1, 2, 3], prefetches=[(1, 10), (1, 11), (1, 12)],
                               evictions=[(1, 7), (1, 8), (1, 9)]),
             (0, 1): LayerPlan(gpu=[0, 1, 2, 3]),
             (1, 0): LayerPlan(gpu=[0], deferred=[15, 16, 17]),
             (1, 1): LayerPlan(gpu=[13, 14, 1], streamed=[13, 14], cpu=[18])}
    sim.system.plan = lambda view: plans[(view.step, view.layer)]
    result = sim.run()
    timeline = result_to_frames(result)["timeline"].query("step == 1 or resource == 'pcie'")
    spans = {(resource, kind, expert): (start / MS, end / MS) for resource, kind, expert, start, end
             in zip(timeline.resource, timeline.kind, timeline.expert, timeline.start_s, timeline.end_s)
             if kind in ("prefetch", "stage", "expert", "deferred")}
    near = {"abs": 1e-3}  # ms: to the microsecond
    assert spans == {("pcie", "prefetch", 10): pytest.approx((0.05, 19.01), **near),
                     ("pcie", "stage", 13): pytest.approx((19.01, 39.01), **near),
                     ("pcie", "prefetch", 11): pytest.approx((39.01, 59.01), **near),
                     ("pcie", "stage", 14): pytest.approx((59.01, 79.01), **near),
                     ("pcie", "prefetch", 12): pytest.approx((79.01, 79.53), **near),  # cut at the run's end
                     ("cpu", "deferred", 15): pytest.approx((1.09, 21.09), **near),
                     ("cpu", "deferred", 16): pytest.approx((21.09, 41.09), **near),
                     ("cpu", "deferred", 17): pytest.approx((41.09, 60.05), **near),
                     ("cpu", "expert", 18): pytest.approx((60.05, 79.53), **near),
                     ("gpu", "expert", 0): pytest.approx((1.07, 1.185), **near),
                     ("gpu", "expert", 13): pytest.approx((39.01, 39.125), **near),
                     ("gpu", "expert", 14): pytest.approx((79.01, 79.125), **near),
                     ("gpu", "expert", 1): pytest.approx((79.125, 79.24), **near)}
    assert result.makespan_s / MS == pytest.approx(79.53, **near)
    prefetch_12 = sim.pending[1][12]
    assert (prefetch_12.start / MS, prefetch_12.end / MS) == pytest.approx((79.01, 89.27), **near)


def test_a_plan_cancels_the_prefetches_a_look_ahead_started_after_its_time(tmp_path):
    """A plan that drops queued prefetches drops those the copy engines had started only in looking ahead:
    two MoE layers, 10 of 19 experts resident in each, one engine (a copy 10 ms), a CPU expert 10 ms, a 12 ms
    sync. Step 0 (1.02 ms) prefetches 10 and 11 into layer 1: 10 copies 0.05-10.05, 11 queues. Step 1's layer 0
    defers 15, which starts after the sync at 13.07; laying it out beside the copies starts 11 at 10.05. Layer 1
    plans at 1.465 with ``cancel_queued_prefetches``: no engine has started 11 by then, so it is dropped (one
    cancellation, one copy's bytes). It was kept and copied 10.05-27.03 beside 15."""
    model = tiny_model(layers=2, experts=19, top_k=4)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2, 3]], [[0, 1, 2, 3]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[0, 1, 2, 15]], [[0, 1, 2, 3]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    profile = tiny_profile(pcie_gbps=COPY_GBPS, latency_us=0.0, cpu_us=(10_000.0, 100_000.0), sync_us=12_000.0)
    sim = prepare(str(path), profile, "gpu-only-lru",
                  {"cache.slots_per_layer": "10", "hw.cpu.dram_combined_gbps": str(COPY_GBPS)}, timeline=True,
                  decisions=True)
    plans = {(0, 0): LayerPlan(gpu=[0, 1, 2, 3], prefetches=[(1, 10), (1, 11)], evictions=[(1, 8), (1, 9)]),
             (0, 1): LayerPlan(gpu=[0, 1, 2, 3]),
             (1, 0): LayerPlan(gpu=[0, 1, 2], deferred=[15]),
             (1, 1): LayerPlan(gpu=[0, 1, 2, 3], cancel_queued_prefetches=True)}
    sim.system.plan = lambda view: plans[(view.step, view.layer)]
    result = sim.run()
    frames = result_to_frames(result)
    pcie = frames["timeline"].query("resource == 'pcie'")
    assert list(zip(pcie.kind, pcie.expert)) == [("prefetch", 10)]
    assert (pcie.start_s.iloc[0] / MS, pcie.end_s.iloc[0] / MS) == pytest.approx((0.05, 10.05), abs=1e-3)
    assert sim.counters.cancelled_prefetches == 1
    assert sim.pcie.bytes == 49_152
    assert sim.pcie.busy_s / MS == pytest.approx(10.0, abs=1e-9)
    assert not sim.pcie.queue and 11 not in sim.pending[1]
    assert (1, 1, 11, "cancel", 1) in sim.decisions


def test_a_plan_keeps_a_prefetch_whose_first_chunks_are_copied(tmp_path):
    """A plan that drops queued prefetches keeps a preempted prefetch's rest, as the real backend does: an engine
    has started it (docs/engine.md, Copies). Two MoE layers, 10 of 16 experts resident in each, one engine (a copy
    10 ms, a write-back 10 ms), copies in chunks of 12,288 B (2.5 ms). Step 0's layer 0 prefetches 10 into layer
    1 from 0.05 ms; layer 1 (from 0.56) loads 11 with a write-back of 8: the load overtakes 10 at its first chunk
    boundary, 2.55 (10's rest, 36,864 B, back at the head of the queue), and copies 2.55-12.55, the write-back
    12.55-22.55. Step 1's layer 0 (from 12.715) drops the queued prefetches: 10's rest stays, the next copy
    after the write-back (30.05). It was dropped (a 'cancel' row), its first chunk copied for nothing."""
    model = tiny_model(layers=2, experts=16, top_k=4)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2, 3]], [[0, 1, 2, 11]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[0, 1, 2, 3]], [[0, 1, 2, 3]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    sim = prepare(str(path), tiny_profile(pcie_gbps=COPY_GBPS, latency_us=0.0), "gpu-only-lru",
                  {"cache.slots_per_layer": "10", "engine.copy_chunk_bytes": "12288"}, timeline=True,
                  decisions=True)
    plans = {(0, 0): LayerPlan(gpu=[0, 1, 2, 3], prefetches=[(1, 10)], evictions=[(1, 9)]),
             (0, 1): LayerPlan(gpu=[0, 1, 2, 11], loads=[11], evictions=[(1, 8)], writebacks=[(1, 8)]),
             (1, 0): LayerPlan(gpu=[0, 1, 2, 3], cancel_queued_prefetches=True),
             (1, 1): LayerPlan(gpu=[0, 1, 2, 3])}
    sim.system.plan = lambda view: plans[(view.step, view.layer)]
    sim.run()
    assert sim.pcie.preemptions == 1
    assert sim.counters.cancelled_prefetches == 0
    assert [row for row in sim.decisions if row[3] == "cancel"] == []
    rest = sim.pending[1][10]
    assert list(sim.pcie.queue) == [rest] and rest.nbytes == 36_864 and 10 in sim.cache.in_flight[1]
    assert sim.pcie.estimate_end(rest) / MS == pytest.approx(30.05, abs=1e-3)
