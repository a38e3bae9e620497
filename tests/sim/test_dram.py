"""Host DRAM shared by CPU experts and copies: hand-worked overlaps (moesim.sim.dram, docs/engine.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.sim.dram import Lane, Ledger, share, slowdown, stretch
from moesim.sim.copies import Transfer
from moesim.sim.run import prepare
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


def test_slowdown_only_past_the_combined_bandwidth():
    assert slowdown(4.0, 2.0, 6.0) == 1.0
    assert slowdown(8.0, 4.0, 6.0) == 0.5


def test_full_overlap_slows_both():
    # CPU 10 s alone at 8 B/s, copy 10 s alone at 4 B/s, 6 B/s combined: both at half speed
    ends, placed = share(0.0, [(10.0, 8.0)], [Lane(jobs=[[0.0, 10.0, 4.0, "copy"]])], 6.0)
    assert ends == [pytest.approx(20.0)]
    assert placed == [[("copy", 0.0, pytest.approx(20.0))]]


def test_partial_overlap():
    # the copy starts at 5: CPU alone for 5 s (5 left), then both at half speed: CPU ends at 15 having
    # given the copy 5 s of its work; the copy's other 5 s run alone: ends at 20
    ends, placed = share(0.0, [(10.0, 8.0)], [Lane(jobs=[[5.0, 10.0, 4.0, "copy"]])], 6.0)
    assert ends == [pytest.approx(15.0)]
    assert placed[0][0][1:] == (5.0, pytest.approx(20.0))


def test_no_overlap_no_cost():
    ends, placed = share(0.0, [(10.0, 8.0)], [Lane(jobs=[[10.0, 10.0, 4.0, "copy"]])], 6.0)
    assert ends == [pytest.approx(10.0)]
    assert placed[0][0][1:] == (10.0, pytest.approx(20.0))
    # overlapping but within the combined bandwidth: no cost either
    ends, placed = share(0.0, [(10.0, 2.0)], [Lane(jobs=[[0.0, 10.0, 4.0, "copy"]])], 6.0)
    assert ends == [pytest.approx(10.0)] and placed[0][0][2] == pytest.approx(10.0)


def test_copy_placed_later_is_slowed_by_cpu_work_laid_out():
    ledger = Ledger()
    ledger.add(2.0, 12.0, 8.0)
    # 4 s alone from 0: 2 s alone, then half speed: 2 s of work take 4 s -> 6
    assert stretch(0.0, 4.0, 4.0, ledger, 6.0) == pytest.approx(6.0)
    # 20 s alone: 2 alone, 10 s at half (5 of work), 13 alone -> 25
    assert stretch(0.0, 20.0, 4.0, ledger, 6.0) == pytest.approx(25.0)
    assert stretch(12.0, 4.0, 4.0, ledger, 6.0) == pytest.approx(16.0)


@settings(max_examples=60, deadline=None)
@given(cpu=st.lists(st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)), min_size=1, max_size=4),
       copies=st.lists(st.tuples(st.floats(0, 20), st.floats(0.1, 10), st.floats(0.1, 10)), max_size=4),
       combined=st.floats(0.5, 30))
def test_sharing_never_speeds_up_and_conserves_work(cpu, copies, combined):
    """Nobody finishes earlier than alone; nobody later than if everything ran at the slowest factor."""
    jobs = sorted(copies)
    ends, placed = share(0.0, cpu, [Lane(jobs=[[a, w, r, i] for i, (a, w, r) in enumerate(jobs)])], combined)
    alone = sum(w for w, _ in cpu)
    worst = min([1.0] + [slowdown(r, max(p for _, _, p in jobs), combined) for _, r in cpu]) if jobs else 1.0
    assert ends[-1] >= alone - 1e-9
    assert ends[-1] <= alone / worst + 1e-9
    lane = placed[0]
    assert [tag for tag, _, _ in lane] == list(range(len(jobs)))
    for (tag, start, end), (a, w, _) in zip(lane, jobs):
        assert start >= a - 1e-9 and end - start >= w - 1e-9


def _simulator(tmp_path, combined_gbps: float):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = write_tiny_trace(tmp_path / "d.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}])
    return prepare(str(path), tiny_profile(), "cpu-only", {"hw.cpu.dram_combined_gbps": str(combined_gbps)})


def test_engine_cpu_expert_and_running_copy_share_dram(tmp_path):
    """The worked example of docs/engine.md, Sec. 'Host DRAM'.

    Toy profile: a CPU expert takes 1000 us for its 49,152 bytes (49.152 MB/s); a copy of the same
    bytes takes 10 us + 49,152 B / 100 kB/s = 491,530 us (99,998 B/s). With the combined bandwidth set
    to half their sum, both run at half speed while they overlap. The copy starts at 0; the CPU starts
    after the 20 us sync: 20 us of copy alone, then 2,000 us together (the CPU's 1,000 us of work), the
    copy having done 20 + 1,000 us of its work; its other 490,510 us run alone.
    """
    cpu_rate, copy_time = 49_152 / 1000e-6, 10e-6 + 49_152 / 1e5
    copy_rate = 49_152 / copy_time
    sim = _simulator(tmp_path, (cpu_rate + copy_rate) / 2 / 1e9)
    copy = Transfer(0, 3, 49_152, 0, "load", 1, 0.0)
    sim.pcie.submit_demands([copy], 0.0)
    cpu_end = sim._cpu_track([0], None, 0, 0, 0.0)
    assert cpu_end == pytest.approx(20e-6 + 2000e-6, rel=1e-9)
    assert copy.end == pytest.approx(cpu_end + copy_time - 20e-6 - 1000e-6, rel=1e-9)
    assert sim.counters.dram_shared_s == pytest.approx(1000e-6, rel=1e-9)


def test_engine_copy_issued_during_cpu_work_is_slowed(tmp_path):
    cpu_rate, copy_time = 49_152 / 1000e-6, 10e-6 + 49_152 / 1e5
    sim = _simulator(tmp_path, (cpu_rate + 49_152 / copy_time) / 2 / 1e9)
    cpu_end = sim._cpu_track([0], None, 0, 0, 0.0)
    assert cpu_end == pytest.approx(1020e-6)  # nothing to share with while it was laid out
    copy = Transfer(0, 3, 49_152, 0, "load", 1, 520e-6)
    sim.pcie.submit_demands([copy], 520e-6)
    # 500 us of CPU work left at half speed: 250 us of the copy's work, then alone
    assert copy.end == pytest.approx(1020e-6 + copy_time - 250e-6, rel=1e-9)


def test_engine_copy_queued_behind_a_slowed_copy_starts_when_it_ends(tmp_path):
    """Two copies back to back, the first slowed by a CPU expert (as above, +1,000 us): the second starts
    when the first ends, not where it was first laid, and the engine's busy time counts no overlap."""
    cpu_rate, copy_time = 49_152 / 1000e-6, 10e-6 + 49_152 / 1e5
    sim = _simulator(tmp_path, (cpu_rate + 49_152 / copy_time) / 2 / 1e9)
    first, second = Transfer(0, 3, 49_152, 0, "load", 1, 0.0), Transfer(0, 2, 49_152, 0, "load", 2, 0.0)
    sim.pcie.submit_demands([first, second], 0.0)
    assert second.start == pytest.approx(copy_time, rel=1e-12)
    sim._cpu_track([0], None, 0, 0, 0.0)
    assert first.end == pytest.approx(copy_time + 1000e-6, rel=1e-9)
    assert second.start == pytest.approx(first.end, rel=1e-12)
    assert second.end == pytest.approx(2 * copy_time + 1000e-6, rel=1e-9)
    assert sim.pcie.busy_s == pytest.approx(2 * copy_time + 1000e-6, rel=1e-9)


def test_engine_write_back_tail_follows_its_slowed_load(tmp_path):
    """A load with a write-back tail (rate 0: it reads no host DRAM), slowed as above: the expert is
    ready when the load ends; the engine stays busy for the write-back after it."""
    cpu_rate, copy_time = 49_152 / 1000e-6, 10e-6 + 49_152 / 1e5
    sim = _simulator(tmp_path, (cpu_rate + 49_152 / copy_time) / 2 / 1e9)
    load = Transfer(0, 3, 49_152, 0, "load", 1, 0.0, tail=300e-6, evicted=(0, 2))
    sim.pcie.submit_demands([load], 0.0)
    assert sim.pcie.free[0] == pytest.approx(copy_time + 300e-6, rel=1e-12)
    sim._cpu_track([0], None, 0, 0, 0.0)
    assert load.end == pytest.approx(copy_time + 1000e-6, rel=1e-9)
    assert load.tail == pytest.approx(300e-6, rel=1e-9)
    assert sim.pcie.free[0] == pytest.approx(load.end + 300e-6, rel=1e-12)
    assert sim.pcie.busy_s == pytest.approx(copy_time + 1000e-6 + 300e-6, rel=1e-9)
    # the write-back still runs at the end: only its part before the horizon counts
    horizon = load.end + 100e-6
    sim.pending[0][3] = load  # as the engine's own loads are
    sim._retire(horizon)
    assert sim.pcie.busy_until(horizon)[0] == pytest.approx(copy_time + 1000e-6 + 100e-6, rel=1e-9)


def test_engine_ledger_stays_short_when_no_copy_runs(tmp_path):
    """CPU work that no copy can meet any more is forgotten as the replay goes on (a long CPU-only replay
    used to keep an interval per layer)."""
    model = tiny_model(layers=2, experts=4, top_k=1)
    steps = [{"phase": "decode", "tokens": {0: (i, [[[i % 4]], [[(i + 1) % 4]]])}} for i in range(300)]
    path = write_tiny_trace(tmp_path / "long.parquet", model, steps)
    sim = prepare(str(path), tiny_profile(), "cpu-only", {"hw.cpu.dram_combined_gbps": "0.00001"})
    lengths, add = [], sim.dram.add

    def counted_add(start: float, end: float, rate: float) -> None:
        add(start, end, rate)
        lengths.append(len(sim.dram.intervals))

    sim.dram.add = counted_add
    sim.run()
    assert len(lengths) == 600 and max(lengths) == 65  # one interval per layer, 64 kept at most between prunes


def test_engine_gpu_expert_waits_for_a_copy_slowed_by_deferred_cpu_work(tmp_path):
    """Expert Deferral beside a streamed GPU expert (static-hot with no slots, the best CPU/GPU split, the
    ktrans-deferral of ktransformers-ed): layer 0 copies expert 0 to the GPU while its deferred expert 1 runs
    on the CPU, the two sharing host DRAM past its combined bandwidth. The copy is slowed; the GPU must start
    expert 0 when it lands. The deferred work was laid out after the GPU track, so the GPU started expert 0
    at the copy's unslowed end, 51 us before its weights were there."""
    from moesim.sim.result import result_to_frames
    from moesim.sim.run import simulate
    model = tiny_model(layers=2, experts=4, top_k=2)
    path = write_tiny_trace(tmp_path / "t.parquet", model,
                            [{"phase": "decode", "tokens": {0: (5, [[[0, 1]], [[2, 3]]])}}])
    settings_ = {"cache.slots_per_layer": "0", "assign": "best", "defer": "ktrans-deferral", "defer.deferred": "1",
                 "hw.cpu.dram_combined_gbps": "0.5", "engine.check": "true"}
    profile = tiny_profile(pcie_gbps=1.0, cpu_us=(150.0, 10000.0))
    result = simulate(str(path), profile, "static-hot", settings_, timeline=True, decisions=True)
    frames = result_to_frames(result)
    decisions = frames["decisions"]
    assert set(decisions[decisions.layer == 0].itertuples(index=False, name=None)) == {
        (0, 0, 0, "gpu_stream", 0), (0, 0, 1, "deferred", 0)}
    spans = frames["timeline"]
    stage = spans[(spans.kind == "stage") & (spans.layer == 0)].iloc[0]
    deferred = spans[spans.kind == "deferred"].iloc[0]
    expert = spans[(spans.resource == "gpu") & (spans.kind == "expert") & (spans.layer == 0)].iloc[0]
    unslowed = stage.start_s + profile.pcie.latency_us * 1e-6 + 49_152 / 1e9
    assert deferred.start_s < stage.end_s and stage.end_s > unslowed + 50e-6  # slowed by the deferred work
    assert expert.start_s == pytest.approx(stage.end_s, rel=1e-12)
    # the replay without the timeline lays the layer out alike
    assert simulate(str(path), profile, "static-hot", settings_).makespan_s == pytest.approx(result.makespan_s,
                                                                                                rel=1e-12)
