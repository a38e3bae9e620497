"""A portfolio bound's members run by branch and bound: each stops once it provably cannot be best.

Every member of a portfolio (``oracle``) replays the same trace, so every
replay has the same steps: phases, requests, tokens and contexts. A member
that has run ``k`` of ``N`` steps has exact step records for the first ``k``;
each later step lasts at least its *floor*, work the member pays whatever it
plans (:func:`step_floors`). So each metric of ``PORTFOLIO_METRICS`` has a
lower bound at every step (:meth:`Member.lower`):

* makespan: now plus the floors of the steps left;
* mean TPOT: the decode durations so far and the floors left, each once per
  request in the step, over the trace's decode entries;
* mean TTFT: per request, its span if its prefill is over, else its start to
  now plus the floors up to its last prefill step, else those floors.

A member is stopped (pruned) when on every metric its bound exceeds the best
value of a member already complete (a member with equal value earlier in the
member order would win the tie, so only a strict excess counts; a relative
margin of :data:`MARGIN` covers floating-point sums). Such a member can be
best on no metric, so the portfolio's best values, the members that give them
and the leading member's record are those of running every member to the end.

Order: members advance a few steps at a time, always the one whose TPOT bound
is lowest (best-first search): the best member tends to finish first, and a
member is never run beyond the point where its bound passes the eventual best.

Floor of one step (seconds), from the engine's own costs (moesim.sim.engine):
the runtime's host work and launches, embedding, dense layers, LM head and
sampling (``_step_work``); per MoE layer its launches, attention and shared
experts, which the GPU stream runs before its routed experts; and the routed
experts: each runs on the GPU for at least ``gpu_expert(n)`` plus its launch
or on the CPU for at least ``cpu_expert(n)``, so a layer lasts at least the
fractional balance of GPU stream and CPU (``balanced_groups``). A member that
defers CPU experts past their layer (001 Sec. 4) balances them over the whole
step instead (its CPU work still ends inside the step). A member that rewrites
routing (002, 004) counts the routed experts of single-token layers only (a
token keeps ``top_k`` distinct experts, one token each); its other layers
count attention and shared experts only. Copies and waits are left out.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy

from moesim.errors import ConfigError
from moesim.policy.base import active_experts
from moesim.policy.catalog.bounds import balanced_groups
from moesim.policy.systems import NoDeferral, NoSubstitution
from moesim.sim.bookkeeping import latency_metrics
from moesim.sim.engine import SimResult, Simulator, StepRecord
from moesim.trace.io import iter_steps
from moesim.trace.schema import PHASES

#: metrics a portfolio takes, each from its best member (lower is better); values in the members' units
METRICS = ("tpot_ms_mean", "ttft_ms", "makespan_s")
#: a bound must exceed the best by this share of it to stop a member (float sums of step durations)
MARGIN = 1e-6
#: steps a member runs before the search looks again (as a share of the trace's steps)
CHUNK_SHARE = 0.01


@dataclass
class TraceShape:
    """The steps every member replays: what their records and floors depend on."""

    phases: list[str]
    #: per step: requests in it (its first layer's)
    requests: list[list[int]]
    #: per step: trace rows (what a progress bar counts)
    rows: list[int]
    #: per step: (tokens, context, sequences, phase) as the engine's ``run_step`` derives them
    work: list[tuple[int, int, int, str]]
    #: per step: ((layer tokens, token counts of its routed experts), how many MoE layers have them)
    layers: list[tuple[tuple[tuple[int, tuple[int, ...]], int], ...]]

    @classmethod
    def of(cls, trace: str, num_experts: int) -> TraceShape:
        out = cls([], [], [], [], [])
        for step in iter_steps(trace, columns=()):
            first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
            tokens = first.stop - first.start
            phase = PHASES[int(step.phase.min())]
            requests = np.unique(step.request[first])
            out.phases.append(phase)
            out.requests.append(requests.tolist())
            out.rows.append(step.rows)
            out.work.append((tokens, int(step.position[first].max()) + 1, len(requests) if tokens > 1 else 1,
                             phase))
            kinds: Counter = Counter()
            for _, rows in step.layers():
                experts = step.experts[rows]
                if rows.stop - rows.start == 1:  # the validated trace row has distinct experts
                    kinds[(1, (1,) * experts.shape[1])] += 1
                else:
                    kinds[(rows.stop - rows.start, tuple(sorted(active_experts(experts, num_experts)[1])))] += 1
            out.layers.append(tuple(sorted(kinds.items())))
        return out

    @property
    def decode_weight(self) -> np.ndarray:
        """Per step: its entries in the mean TPOT (requests of a decode step, else 0)."""
        return np.array([len(r) if p == "decode" else 0 for p, r in zip(self.phases, self.requests)], dtype=float)

    def spans(self) -> dict[int, tuple[int, int]]:
        """Request -> (first, last) step of its prefill, in the order TTFT averages them."""
        out: dict[int, list[int]] = {}
        for i, (phase, reqs) in enumerate(zip(self.phases, self.requests)):
            if phase == "prefill":
                for r in reqs:
                    out.setdefault(r, [i, i])[1] = i
        return {r: (a, b) for r, (a, b) in out.items()}


def step_floors(sim: Simulator, shape: TraceShape) -> np.ndarray:
    """Seconds each step of ``shape`` lasts at least when ``sim`` replays it (the module docstring)."""
    costs = sim.costs
    shared_on = bool(sim.model.shared_intermediate_size)
    substitutes = not isinstance(sim.system.substitute, NoSubstitution)
    defers = not isinstance(sim.system.defer, NoDeferral)
    head_memo: dict[tuple[int, int, int, str], float] = {}
    layer_memo: dict[tuple, tuple[float, list[tuple[float, float, int]]]] = {}

    def head_tail(key: tuple[int, int, int, str]) -> float:
        value = head_memo.get(key)
        if value is None:
            tokens, context, sequences, phase = key
            value = head_memo[key] = (sum(costs.step_fixed(tokens, context, sequences).values())
                                      + costs.step_launch(phase)
                                      + sim.model.num_dense_layers * costs.layer_launches(phase)
                                      + costs.host_per_step)
        return value

    def layer(tokens: int, counts: tuple[int, ...], phase: str) -> tuple[float, list[tuple[float, float, int]]]:
        """(GPU-stream seconds before routed experts plus, unless deferred, the layer's expert balance;
        the experts as (gpu, cpu, how many) when they are balanced over the step instead)."""
        key = (tokens, counts, phase)
        value = layer_memo.get(key)
        if value is None:
            expert_launch, shared_launch = sim._launch[phase]
            shared = costs.gpu_shared(tokens) + shared_launch if shared_on else 0.0
            groups: list[tuple[float, float, int]] = []
            if not substitutes or tokens == 1:
                groups = [(costs.gpu_expert(n) + expert_launch, costs.cpu_expert(n), m)
                          for n, m in sorted(Counter(counts).items())]
            value = layer_memo[key] = ((shared, groups) if defers else (balanced_groups(shared, groups), []))
        return value

    floors = np.empty(len(shape.work))
    for i, (work, kinds) in enumerate(zip(shape.work, shape.layers)):
        tokens, context, _, phase = work
        total = head_tail(work)
        step_groups: list[tuple[float, float, int]] = []
        launch = sim._layer_launches[phase]
        for (layer_tokens, counts), m in kinds:
            fixed, groups = layer(layer_tokens, counts, phase)
            total += m * (launch + sim._attention_s(layer_tokens, context) + fixed)
            step_groups += [(g, c, n * m) for g, c, n in groups]
        floors[i] = balanced_groups(total, step_groups) if step_groups else total
    return floors


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
    floors: np.ndarray
    shape: TraceShape
    #: suffix sums of the floors, and of the floors times each step's TPOT entries
    left: np.ndarray = field(init=False)
    left_tpot: np.ndarray = field(init=False)
    process: simpy.Process | None = None
    decode_sum: float = 0.0
    wall_s: float = 0.0
    _pause: simpy.Event | None = None
    _stop_after: int = 0
    _stop: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        self.left = np.concatenate([np.cumsum(self.floors[::-1])[::-1], [0.0]])
        weight = self.shape.decode_weight
        self.left_tpot = np.concatenate([np.cumsum((self.floors * weight)[::-1])[::-1], [0.0]])
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
            return now + float(self.left[k])
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
            value = values[metric]
            if not math.isnan(value) and (metric not in best or (value, rank[name]) < best[metric]):
                best[metric] = (value, rank[name])

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
