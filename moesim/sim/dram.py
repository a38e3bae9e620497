"""Host DRAM shared by CPU expert kernels and host-to-device copies (fluid sharing).

A CPU expert streams its weights from DRAM at ``bytes / time`` when it runs
alone; a copy engine reads pinned host memory at ``bytes / time`` of its PCIe
transfer. While both run, they draw on the same memory system, whose
achievable combined bandwidth is ``HardwareProfile.dram_combined_gbps``. When
the two rates add up to more, both slow by the same factor
``C / (r_cpu + r_copy)`` (each keeps its share of the demand), and run at full
speed again once the other ends: piecewise-constant rates over the overlap.

The engine lays the work out in closed form, so sharing is applied where the
work is placed:

* :func:`share` lays out a layer's CPU experts together with the copies
  already on the copy engines (placed or queued) from the moment the CPU
  starts, slowing both over each overlap.
* :func:`stretch` places a copy issued later against the CPU work already laid
  out (a :class:`Ledger` of CPU intervals), slowing the copy over the overlap;
  the CPU work, already laid out, is not revised.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def slowdown(cpu_rate: float, copy_rate: float, combined: float) -> float:
    """Speed factor (<= 1) of both streams while they overlap."""
    demand = cpu_rate + copy_rate
    return 1.0 if demand <= combined else combined / demand


@dataclass
class Ledger:
    """CPU DRAM intervals (start, end, bytes/s) laid out so far, in time order."""

    intervals: list[tuple[float, float, float]] = field(default_factory=list)

    def add(self, start: float, end: float, rate: float) -> None:
        if end > start and rate > 0:
            self.intervals.append((start, end, rate))

    def prune(self, before: float) -> None:
        """Forget intervals that end before ``before`` (no copy can start earlier)."""
        intervals = self.intervals
        if intervals and intervals[0][1] < before:
            self.intervals = [x for x in intervals if x[1] >= before]


def stretch(start: float, work: float, rate: float, ledger: Ledger, combined: float) -> float:
    """End of a copy that needs ``work`` seconds alone, started at ``start``, against the ledger's CPU work."""
    t, left = start, work
    for a, b, cpu_rate in ledger.intervals:
        if b <= t:
            continue
        if a >= t + left:
            break
        if a > t:  # alone until the CPU interval begins
            left -= a - t
            t = a
        f = slowdown(cpu_rate, rate, combined)
        span = b - t
        if left <= span * f:
            return t + left / f
        left -= span * f
        t = b
    return t + left


@dataclass
class Lane:
    """One copy engine's work from the moment the CPU starts: [earliest start, seconds alone, bytes/s, tag]."""

    jobs: list[list] = field(default_factory=list)
    free: float = 0.0


def share(cpu_start: float, cpu_jobs: list[tuple[float, float]], lanes: list[Lane],
          combined: float) -> tuple[list[float], list[list[tuple[object, float, float]]]]:
    """Lay out CPU jobs (seconds alone, bytes/s) one after another from ``cpu_start`` beside the copy lanes.

    Returns the CPU jobs' end times and, per lane, (tag, start, end) of its jobs.
    A lane's jobs run one after another, each from its earliest start; copies
    still running when the CPU work ends continue alone.
    """
    ends: list[float] = []
    placed: list[list[tuple[object, float, float]]] = [[] for _ in lanes]
    # per lane: index of its current job, its remaining work, when it started
    idx = [0] * len(lanes)
    left = [lane.jobs[0][1] if lane.jobs else 0.0 for lane in lanes]
    began: list[float | None] = [None] * len(lanes)
    lane_free = [lane.free for lane in lanes]
    t = cpu_start
    for work, cpu_rate in cpu_jobs:
        remaining = work
        while remaining > 1e-15:
            active = []
            next_start = float("inf")
            for i, lane in enumerate(lanes):
                if idx[i] >= len(lane.jobs):
                    continue
                at = max(lane.jobs[idx[i]][0], lane_free[i])
                if at <= t + 1e-15:
                    if began[i] is None:
                        began[i] = at
                    active.append(i)
                else:
                    next_start = min(next_start, at)
            copy_rate = sum(lanes[i].jobs[idx[i]][2] for i in active)
            f = slowdown(cpu_rate, copy_rate, combined) if active else 1.0
            dt = min([remaining / f, next_start - t] + [left[i] / f for i in active])
            remaining -= dt * f
            for i in active:
                left[i] -= dt * f
            t += dt
            for i in active:
                if left[i] <= 1e-15:
                    job = lanes[i].jobs[idx[i]]
                    placed[i].append((job[3], began[i], t))
                    lane_free[i] = t
                    idx[i] += 1
                    began[i] = None
                    left[i] = lanes[i].jobs[idx[i]][1] if idx[i] < len(lanes[i].jobs) else 0.0
        ends.append(t)
    for i, lane in enumerate(lanes):  # the rest runs alone
        while idx[i] < len(lane.jobs):
            job = lane.jobs[idx[i]]
            start = began[i] if began[i] is not None else max(job[0], lane_free[i])
            end = (max(start, t) if began[i] is not None else start) + left[i]
            placed[i].append((job[3], start, end))
            lane_free[i] = end
            idx[i] += 1
            began[i] = None
            left[i] = lane.jobs[idx[i]][1] if idx[i] < len(lane.jobs) else 0.0
    return ends, placed
