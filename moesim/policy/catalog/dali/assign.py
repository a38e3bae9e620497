"""DALI's CPU/GPU assignment (003_46c415738ddfa491.txt, Sec. 4.1): the cost vectors of Eq. 4-6,
the greedy rule of Alg. 1, the exact solve of Eq. 3-9 and the decision time charged for them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.policy.assign import Assignment
from moesim.policy.base import LayerView, PerTokens, RunContext
from moesim.policy.base import expert_times as kernel_and_cpu_times
from moesim.policy.systems import register_component


# ----------------------------------------------------------------------------- cost vectors (Eq. 4-6)
def expert_times(view: LayerView) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(experts, t_gpu, t_cpu) for the layer's activated experts (Eq. 5-6 with the cache, Sec. 4.3)."""
    experts, t_gpu, t_cpu = expert_time_lists(view)
    return experts, np.array(t_gpu, dtype=np.float64), np.array(t_cpu, dtype=np.float64)


def expert_time_lists(view: LayerView, times: PerTokens | None = None) -> tuple[list[int], list[float], list[float]]:
    """:func:`expert_times` as lists (a decode layer's few experts: no arrays to build); ``times``: the cost
    model's (GPU kernel, CPU) expert times by token count, kept between calls."""
    times = PerTokens.of(times, view.costs, kernel_and_cpu_times)
    resident, arrivals, now, launch = view.cache.resident[view.layer], view.arrivals, view.now, view.expert_launch_s
    expert_load = view.costs.expert_load
    experts, counts = list(view.active), view.counts
    if experts and counts[0] == counts[-1]:  # one token count (every decode layer): one kernel and CPU time
        gpu, cpu = times[counts[0]]
        gpu += launch
        t_gpu = []
        for e in experts:
            if e in resident:
                transfer = 0.0
            elif e in arrivals:
                transfer = max(arrivals[e] - now, 0.0)
            else:
                transfer = expert_load
            t_gpu.append(transfer if transfer > gpu else gpu)
        return experts, t_gpu, [cpu] * len(experts)
    t_gpu, t_cpu = [], []
    for e, n in zip(experts, counts):
        if e in resident:
            transfer = 0.0
        elif e in arrivals:
            transfer = max(arrivals[e] - now, 0.0)
        else:
            transfer = expert_load
        gpu, cpu = times[n]
        gpu += launch
        t_gpu.append(transfer if transfer > gpu else gpu)
        t_cpu.append(cpu)
    return experts, t_gpu, t_cpu


def makespan(t_gpu: np.ndarray, t_cpu: np.ndarray, on_gpu: np.ndarray) -> float:
    """Eq. 3: max(T_gpu, T_cpu) of an assignment (``on_gpu`` boolean per expert)."""
    return max(float(t_gpu[on_gpu].sum()), float(t_cpu[~on_gpu].sum()))


def greedy_assignment(t_gpu: np.ndarray, t_cpu: np.ndarray) -> np.ndarray:
    """Alg. 1 of 003: boolean GPU mask."""
    return np.array(greedy_mask(t_gpu.tolist(), t_cpu.tolist()), dtype=bool)


def greedy_mask(gpu: list[float], cpu: list[float]) -> list[bool]:
    """:func:`greedy_assignment` on lists of the same doubles."""
    order = sorted(range(len(gpu)), key=lambda i: -abs(gpu[i] - cpu[i]))  # stable: ties keep their order
    on_gpu = [False] * len(gpu)
    total_gpu = total_cpu = 0.0
    for i in order:
        g, c = gpu[i], cpu[i]
        if g == 0 and c == 0:
            continue
        if total_gpu + g <= total_cpu + c:
            on_gpu[i] = True
            total_gpu += g
        else:
            total_cpu += c
    return on_gpu


def optimal_assignment(t_gpu: np.ndarray, t_cpu: np.ndarray) -> np.ndarray:
    """The exact minimum of Eq. 3 under Eq. 4-8, by branch and bound.

    Experts with equal (t_gpu, t_cpu) are interchangeable, so the search picks
    how many of each group go to the GPU; the bound is
    ``max(T_gpu, T_cpu, (T_gpu + T_cpu + sum of the rest's cheaper side) / 2)``.
    Greedy's assignment is the first incumbent, so ties keep greedy's choice.
    """
    keys = list(zip(t_gpu.tolist(), t_cpu.tolist()))
    groups: dict[tuple[float, float], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    items = sorted(groups.items(), key=lambda kv: -abs(kv[0][0] - kv[0][1]) * len(kv[1]))
    g = [k[0] for k, _ in items]
    c = [k[1] for k, _ in items]
    m = [len(v) for _, v in items]
    rest_min = np.concatenate([np.cumsum([min(g[i], c[i]) * m[i] for i in range(len(items))][::-1])[::-1], [0.0]])
    greedy = greedy_assignment(t_gpu, t_cpu)
    best = [makespan(t_gpu, t_cpu, greedy)]
    best_counts: list[list[int] | None] = [None]
    counts = [0] * len(items)

    def search(i: int, total_gpu: float, total_cpu: float) -> None:
        bound = max(total_gpu, total_cpu, (total_gpu + total_cpu + rest_min[i]) / 2)
        if bound >= best[0] - 1e-15:
            return
        if i == len(items):
            best[0], best_counts[0] = max(total_gpu, total_cpu), list(counts)
            return
        # try the balanced split of this group first: good incumbents early
        gi, ci, mi = g[i], c[i], m[i]
        target = (total_cpu + ci * mi - total_gpu) / (gi + ci) if gi + ci > 0 else mi
        first = min(max(int(round(target)), 0), mi)
        for on in sorted(range(mi + 1), key=lambda x: (abs(x - first), x)):
            counts[i] = on
            search(i + 1, total_gpu + on * gi, total_cpu + (mi - on) * ci)
        counts[i] = 0

    search(0, 0.0, 0.0)
    if best_counts[0] is None:
        return greedy
    on_gpu = np.zeros(len(t_gpu), dtype=bool)
    for (_, members), on in zip(items, best_counts[0]):
        on_gpu[members[:on]] = True
    return on_gpu


#: 003 Table 6 / Sec. 6.3: Greedy Assignment's scheduling overhead, 4.50% of end-to-end inference time on
#: average (DeepSeek, batch 8, sequence lengths 32-2048, "essentially constant")
GREEDY_SHARE = 0.045
#: 003 Sec. 6.3: solving the 0-1 problem exactly ("Opt_plan") costs 55% of the total inference time
OPTIMAL_SHARE = 0.55


@dataclass
class SolveClock:
    """Decision time charged per layer plan (003 Table 6, Sec. 6.3, App. A.4).

    003 reports the solver's cost as a share of end-to-end time, constant because every token makes one
    decision per MoE layer. With ``solve_us < 0`` a plan is charged ``share`` times the time since the
    previous plan of the same pass (one layer period: attention, MoE, syncs and this very overhead), so
    the overhead settles at ``share`` of the run. A pass's first layer takes the mean period of the
    previous pass; the very first plan of a run has no period to go by and is charged nothing.
    ``solve_us >= 0`` charges that fixed time per plan instead (0: free).
    """

    share: float
    solve_us: float = -1.0
    _step: int = -1
    _start: float = 0.0
    _last: float = 0.0
    _plans: int = 0
    _period: float = 0.0

    @classmethod
    def checked(cls, share: float, solve_us: float, typical: float) -> "SolveClock":
        """A clock for the ``assign.solve_share`` / ``assign.solve_us`` settings, the share checked first
        (``typical``: the paper's share, named in the fix)."""
        if not 0.0 <= share < 1.0:
            raise ConfigError(f"assign.solve_share={share} outside [0, 1)", field="assign.solve_share",
                              fix=f"use a share of the run such as {typical} (0: free)")
        return cls(share, solve_us)

    def charge(self, view: LayerView) -> float:
        """Seconds of decision time for this plan."""
        if self.solve_us >= 0:
            return self.solve_us * 1e-6
        now = view.now
        if view.step != self._step:  # a new forward pass
            if self._plans > 1:
                self._period = (self._last - self._start) / (self._plans - 1)
            self._step, self._start, self._plans = view.step, now, 0
            seconds = self.share * self._period
        else:
            seconds = self.share * max(now - self._last, 0.0)
        self._last = now
        self._plans += 1
        return seconds


@register_component
@dataclass
class DaliGreedy(Assignment):
    """Greedy Assignment (003 Sec. 4.1, Alg. 1), its decision time charged as 003 Table 6 reports it."""

    name = "dali-greedy"
    any_negative = ("solve_us",)
    #: decision time per layer, microseconds, on the critical path (negative: ``solve_share`` of the run)
    solve_us: float = -1.0
    #: decision time as a share of end-to-end time (003 Table 6: 4.50% for greedy), used when solve_us < 0
    solve_share: float = GREEDY_SHARE
    _last_solve_s: float = field(default=0.0, repr=False)
    _clock: SolveClock | None = field(default=None, repr=False)
    _times: PerTokens | None = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        self._clock = SolveClock.checked(self.solve_share, self.solve_us, GREEDY_SHARE)

    def _charge(self, view: LayerView) -> float:
        if self._clock is None:
            self._clock = SolveClock(self.solve_share, self.solve_us)
        return self._clock.charge(view)

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        self._times = PerTokens.of(self._times, view.costs, kernel_and_cpu_times)
        experts, t_gpu, t_cpu = expert_time_lists(view, self._times)
        on_gpu = greedy_mask(t_gpu, t_cpu)
        self._last_solve_s = self._charge(view)
        return [e for e, g in zip(experts, on_gpu) if g], [e for e, g in zip(experts, on_gpu) if not g]


@register_component
@dataclass
class DaliOptimal(DaliGreedy):
    """The exact 0-1 optimum of Eq. 3-9 (003 Sec. 4.1, "Opt_plan").

    By default its decision time is 55% of the run (003 Sec. 6.3, "4.5% (v.s. 55%)"); ``solve_us``
    charges a fixed time per layer; ``measured=true`` charges this solver's own wall-clock time instead
    (then runs are no longer byte-identical, which is why it is off by default).
    """

    name = "dali-optimal"
    solve_share: float = OPTIMAL_SHARE
    measured: bool = False

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        start = time.perf_counter()
        experts, t_gpu, t_cpu = expert_times(view)
        on_gpu = optimal_assignment(t_gpu, t_cpu)
        self._last_solve_s = time.perf_counter() - start if self.measured else self._charge(view)
        return ([e for e, g in zip(experts, on_gpu) if g], [e for e, g in zip(experts, on_gpu) if not g])
