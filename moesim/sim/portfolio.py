"""A portfolio bound's members run by branch and bound: each stops once it provably cannot be best.

Every member of a portfolio (``oracle``) replays the same trace, so every
replay has the same steps: phases, requests, tokens and contexts. A member
that has run ``k`` of ``N`` steps has exact step records for the first ``k``;
each later step lasts at least its *floor*, work the member pays whatever it
plans (:func:`step_floors`). So each metric of ``PORTFOLIO_METRICS`` has a
lower bound at every step (:meth:`Member.lower`):

* makespan: now plus the floors of the steps left (with the window terms of
  the windows left);
* mean TPOT: the decode durations so far and the floors left, each once per
  request in the step (with the window terms), over the trace's decode entries;
* mean TTFT: per request, its span if its prefill is over, else its start to
  now plus the floors up to its last prefill step, else those floors.

A member is stopped (pruned) when on every metric its bound exceeds the best
value of a member already complete (a member with equal value earlier in the
member order would win the tie, so only a strict excess counts; a relative
margin of :data:`MARGIN` covers floating-point sums). Values within :data:`TIE` of
the lowest tie with it, and the member order picks among them. Such a member can be
best on no metric, so the portfolio's best values, the members that give them
and the leading member's record are those of running every member to the end.

Order: members advance a few steps at a time, always the one whose TPOT bound
is lowest (best-first search): the best member tends to finish first, and a
member is never run beyond the point where its bound passes the eventual best.

Floors (moesim.sim.floors): per step, the work a member pays whatever it plans;
exact steps for a member whose placement is fixed; and per window of decode
steps, the copies or CPU work that experts beyond those its memory holds cost.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy

from moesim.errors import ConfigError
from moesim.sim.bookkeeping import latency_metrics
from moesim.sim.engine import Simulator
from moesim.sim.floor_parts import Traits
from moesim.sim.floors import MemberFloors
from moesim.sim.result import SimResult, StepRecord
from moesim.sim.shape import TraceShape, Windows

#: metrics a portfolio takes, each from its best member (lower is better); values in the members' units
METRICS = ("tpot_ms_mean", "ttft_ms", "makespan_s")
#: a bound must exceed the best by this share of it to stop a member (float sums of step durations)
MARGIN = 1e-6
#: steps a member runs before the search looks again (as a share of the trace's steps)
CHUNK_SHARE = 0.01
#: members whose values of a metric differ by less than this share of the lowest tie on it, and the member
#: order breaks the tie: members running the same schedule sum its times in different orders (and a replay
#: with the timeline on in another order than one without), so their values can differ in the last bits
TIE = 1e-9


@dataclass
class Pruned:
    """A member stopped early: after which step, its lower bounds there, and why."""

    step: int
    steps: int
    lower: dict[str, float]
    reason: str
    #: seconds its replay ran before it stopped
    wall_s: float = 0.0


@dataclass
class Member:
    """One member's replay, run a few steps at a time, with its lower bounds as it goes."""

    name: str
    sim: Simulator
    #: its floors (per-step floors alone: no window terms)
    floors: MemberFloors | np.ndarray
    shape: TraceShape
    #: suffix sums of the floors (with the window terms: ``left_span``), and of the floors times each step's
    #: TPOT entries (with the window terms)
    left: np.ndarray = field(init=False)
    left_span: np.ndarray = field(init=False)
    left_tpot: np.ndarray = field(init=False)
    process: simpy.Process | None = None
    decode_sum: float = 0.0
    wall_s: float = 0.0
    _pause: simpy.Event | None = None
    _stop_after: int = 0
    _stop: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.floors, np.ndarray):
            zeros = np.zeros(len(self.floors) + 1)
            self.floors = MemberFloors(self.floors, zeros, zeros)
        steps = self.floors.steps
        self.left = np.concatenate([np.cumsum(steps[::-1])[::-1], [0.0]])
        self.left_span = self.left + self.floors.extra_span
        weight = self.shape.decode_weight
        self.left_tpot = np.concatenate([np.cumsum((steps * weight)[::-1])[::-1], [0.0]]) + self.floors.extra_tpot
        self.sim.watch = self._watch

    @property
    def done(self) -> int:
        return len(self.sim.steps)

    @property
    def finished(self) -> bool:
        return self.process is not None and not self.process.is_alive

    def _watch(self, record: StepRecord) -> bool:
        if record.phase == "decode":
            self.decode_sum += (record.end - record.start) * len(record.requests)
        if self._stop is not None and self._stop():
            return True
        if self.done >= self._stop_after and self._pause is not None and not self._pause.triggered:
            self._pause.succeed()
        return False

    def advance(self, steps: int, stop: Callable[[], bool]) -> None:
        """Run ``steps`` more steps (or to the end, or until ``stop`` says so after a step)."""
        wall = time.perf_counter()
        if self.process is None:
            self.process = self.sim.start()
        env = self.sim.env
        self._pause, self._stop_after, self._stop = env.event(), self.done + steps, stop
        env.run(until=env.any_of([self._pause, self.process]))
        self.wall_s += time.perf_counter() - wall

    def result(self) -> SimResult:
        result = self.sim.finish()
        result.sim_wall_s = self.wall_s
        return result

    def lower(self, metric: str, spans: dict[int, tuple[int, int]], entries: float) -> float:
        """A lower bound on this member's final ``metric`` (in its units) from its steps so far."""
        k, steps = self.done, self.sim.steps
        now = steps[-1].end if steps else 0.0
        if metric == "makespan_s":
            return now + float(self.left_span[k])
        if metric == "tpot_ms_mean":
            return (self.decode_sum + float(self.left_tpot[k])) / entries * 1e3 if entries else math.nan
        if not spans:
            return math.nan
        total = 0.0
        for first, last in spans.values():
            if last < k:
                total += steps[last].end - steps[first].start
            elif first < k:
                total += now - steps[first].start + float(self.left[k] - self.left[last + 1])
            else:
                total += float(self.left[first] - self.left[last + 1])
        return total / len(spans) * 1e3


def racing_members(sims: dict[str, Simulator], shape: TraceShape, own: tuple[str, ...],
                   skipped: dict[str, str]) -> list[Member]:
    """The members of a portfolio ready for :func:`branch_and_bound`, each with its floors. A member whose
    floors need the experts it starts with is started (configured) here; one that cannot be is skipped
    (added to ``skipped``), unless it is one of the bound's ``own`` schedules."""
    windows = Windows.of(shape)
    shared: dict = {}
    out = []
    for name, sim in sims.items():
        wall = time.perf_counter()
        try:
            process = sim.start() if Traits.of(sim).placed else None
        except ConfigError as err:
            if name in own:
                raise
            skipped[name] = str(err)
            continue
        started = time.perf_counter() - wall
        member = Member(name, sim, MemberFloors.of(sim, shape, windows, shared), shape, process=process)
        member.wall_s = started
        out.append(member)
    return out


def best_of(values: list[tuple[float, int]]) -> tuple[float, int]:
    """The best of members' (value, rank in member order) on one metric: of the values within :data:`TIE` of
    the lowest, the one of the member earliest in the order."""
    low = min(value for value, _ in values)
    return min((x for x in values if x[0] <= low + abs(low) * TIE), key=lambda x: x[1])


def beats(lower: float, best: float) -> bool:
    """Whether a lower bound provably exceeds ``best`` (then the member cannot have ``best`` or less)."""
    return lower > best + abs(best) * MARGIN


def branch_and_bound(members: list[Member], complete: dict[str, dict[str, float]], order: list[str],
                     shape: TraceShape, own: tuple[str, ...], skipped: dict[str, str],
                     progress: Callable[[int], None] | None = None
                     ) -> tuple[dict[str, SimResult], dict[str, Pruned]]:
    """Run ``members`` best-first until each is complete or provably best on no metric.

    ``complete``: metrics of members already complete (reused replays); results of the members run here
    are added to it. ``order``: every member's name in portfolio order (the tie-break).
    """
    spans = shape.spans()
    entries = float(shape.decode_weight.sum())
    metrics = [m for m in METRICS if not (m == "tpot_ms_mean" and not entries) and not (m == "ttft_ms" and not spans)]
    primary = metrics[0] if metrics else "makespan_s"
    rank = {name: i for i, name in enumerate(order)}
    chunk = max(1, int(len(shape.rows) * CHUNK_SHARE))
    best: dict[str, tuple[float, int]] = {}

    def record(name: str, values: dict[str, float]) -> None:
        complete[name] = values
        for metric in metrics:
            got = [(v[metric], rank[n]) for n, v in complete.items() if not math.isnan(v[metric])]
            if got:
                best[metric] = best_of(got)

    for name, values in list(complete.items()):
        record(name, values)

    def beaten(member: Member) -> dict[str, float] | None:
        """The member's bounds if every one exceeds its metric's best so far, else None."""
        if not metrics or any(metric not in best for metric in metrics):
            return None
        lower = {}
        for metric in metrics:  # TTFT last: it walks the requests
            lower[metric] = member.lower(metric, spans, entries)
            if not beats(lower[metric], best[metric][0]):
                return None
        return lower

    results: dict[str, SimResult] = {}
    pruned: dict[str, Pruned] = {}
    live = list(members)

    def prune(member: Member, lower: dict[str, float]) -> None:
        k = member.done
        said = ", ".join(f"{_label(m)} >= {v:.6g} > {best[m][0]:.6g} ({order[best[m][1]]})"
                         for m, v in lower.items())
        pruned[member.name] = Pruned(k, len(shape.rows), lower, f"after step {k} of {len(shape.rows)}: {said}",
                                     member.wall_s)
        live.remove(member)
        member.sim.stop_reading()
        if progress is not None:
            progress(sum(shape.rows[k:]))

    while live:
        member = min(live, key=lambda m: (m.lower(primary, spans, entries), rank[m.name]))
        stop_at: list[dict[str, float]] = []

        def stop(member: Member = member, stop_at: list = stop_at) -> bool:
            lower = beaten(member)
            if lower is not None:
                stop_at.append(lower)
            return lower is not None

        try:
            member.advance(chunk, stop)
        except ConfigError as err:
            if member.name in own:
                raise  # the bound's own schedules must run
            skipped[member.name] = str(err)
            live.remove(member)
            member.sim.stop_reading()
            continue
        if stop_at and member.done < len(shape.rows):
            prune(member, stop_at[0])
        elif member.finished:
            result = results[member.name] = member.result()
            live.remove(member)
            record(member.name, summary(result))
            for other in list(live):
                lower = beaten(other)
                if lower is not None:
                    prune(other, lower)
    return results, pruned


def summary(result: SimResult) -> dict[str, float]:
    """A member's values of ``METRICS``."""
    lat = latency_metrics(result.steps)
    return {"tpot_ms_mean": lat["tpot_ms_mean"], "ttft_ms": lat["ttft_ms"], "makespan_s": result.makespan_s}


def _label(metric: str) -> str:
    return {"tpot_ms_mean": "TPOT ms", "ttft_ms": "TTFT ms", "makespan_s": "makespan s"}[metric]
