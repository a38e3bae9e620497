"""DALI: workload-aware offloading (003_46c415738ddfa491.txt, Sec. 4).

Components:

* ``dali-greedy`` (assign, Sec. 4.1, Alg. 1): each activated expert costs
  ``t_cpu(w)`` on the CPU and ``t_gpu(w) = max(transfer, compute)`` on the GPU
  (Eq. 5-6; transfer 0 when the expert is cached, its remaining time when it
  is arriving); experts in descending ``|t_gpu - t_cpu|`` order go to the GPU
  when ``T_gpu + t_gpu <= T_cpu + t_cpu``, else to the CPU.
* ``dali-optimal`` (assign, Eq. 3-9): the exact minimum of
  ``max(T_gpu, T_cpu)`` over all assignments, by branch and bound over groups
  of identical experts (exact; no solver dependency). Eq. 9 (GPU memory) never
  binds here: GPU experts that are not cached go through the staging buffers.

Decision time: both are charged on the critical path of every layer (category
``predict``: the breakdown's decision-time slot, 000 Sec. VI-E) as 003 reports
it, a share of end-to-end time: 4.50% for greedy (Table 6, App. A.4), 55% for
the exact solve (Sec. 6.3); see :class:`SolveClock`. ``assign.solve_share``
changes the share, ``assign.solve_us`` charges a fixed time per layer instead
(0: free).
* ``dali-residual`` (prefetch, Sec. 4.2): the experts of the next layer with
  the largest predicted workload (tokens predicting them in ``pred_residual``,
  the residual-corrected gate of Eq. 10), ``size`` of them.
* ``dali-workload`` (cache, Sec. 4.3, Alg. 2): per layer, workload scores
  (tokens per expert) summed over a window of ``w_size`` iterations; at the end
  of each window the ``u_size`` highest-scoring experts not cached replace the
  ``u_size`` lowest-scoring cached ones, and the scores restart at zero. The
  initial cached set is ``cache_size`` experts drawn at random per layer
  (Sec. 4, "we randomly select"), seeded by the run's seed.

Per-model settings (``cache.u_size`` and ``prefetch.size`` at -1, the default): 003 Fig. 12 and
Sec. 6.4 run Mixtral with ``u_size`` 1 and a prefetch size of 1, DeepSeek and Qwen with 8 and 4
(``w_size`` 4 for all); a model of another family takes the setting of the paper's models nearest in
experts per layer (Mixtral's 8, or DeepSeek-V2-Lite's 64 and Qwen1.5-MoE's 60), and the report says so.

The ``dali`` system (:class:`DaliSystem`) keeps DALI's structure: the cache
changes only through Alg. 2; a GPU expert that is not cached is transferred
for this use only (streamed through the staging buffers, Fig. 9's E3/E7);
prefetched experts land in a model-wide prefetch buffer of ``cache.prefetch_slots``
slots (default: twice the prefetch size, so the next layer's prefetch never
overwrites the experts the current layer is using), apart from the cache: the
buffer is its own part of the one GPU memory budget (``moesim.sim.memory``), not
carved out of the cache, so a cache of 1 slot per layer holds 1 expert per layer.
When the buffer is full, the entry whose layer comes round last in the forward
pass makes room. Used as a plain cache in another system (``--set
cache=dali-workload``) the component evicts the lowest window score and
admits the highest, and sees the layers whose plan ran experts on the GPU.

Interpretation of Alg. 2: the printed loop tests ``i mod w_size == 0`` from
``i = 0``, which would replace after the first token; the text says "after
processing a window of w_size tokens", which is what is done. A swap happens
only where the incoming expert's window score exceeds the outgoing one's
(``strict=True``, default): Alg. 2 swaps unconditionally, which loads experts
with score 0 whenever fewer than ``u_size`` uncached experts were used; set
``cache.strict=false`` for the literal rule. "Token" is one forward pass.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.policy.assign import Assignment
from moesim.policy.base import LayerPlan, LayerView, PerTokens, RunContext
from moesim.policy.base import expert_times as kernel_and_cpu_times
from moesim.policy.cache import CachePolicy, SlotSpread
from moesim.policy.catalog.importance import ObservingSystem
from moesim.policy.prefetch import LastTokenPredictor, NoPrefetch, Prefetch
from moesim.policy.systems import SystemSpec, register_component, register_system


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
    experts = list(view.active)
    t_gpu, t_cpu = [], []
    for e, n in zip(experts, view.counts):
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
        if gpu[i] == 0 and cpu[i] == 0:
            continue
        if total_gpu + gpu[i] <= total_cpu + cpu[i]:
            on_gpu[i] = True
            total_gpu += gpu[i]
        else:
            total_cpu += cpu[i]
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


# ----------------------------------------------------------------------------- per-model settings (Sec. 6.4)
#: (u_size, prefetch size) by model family, 003 Fig. 12 caption and Sec. 6.4 (w_size is 4 for all)
PAPER_SETTINGS = {"mixtral": (1, 1), "deepseek": (8, 4), "qwen": (8, 4)}
#: experts per layer between Mixtral's 8 and DeepSeek-V2-Lite's 64 on a log scale: a model of another
#: family with fewer takes Mixtral's setting, one with more DeepSeek's and Qwen's
NEAREST_SPLIT = math.sqrt(8 * 64)


def paper_setting(model: ModelSpec) -> tuple[tuple[int, int], str | None]:
    """003's (u_size, prefetch size) for ``model``, and a note when the paper did not run its family."""
    name = model.name.lower()
    for family, setting in PAPER_SETTINGS.items():
        if name.startswith(family):
            return setting, None
    mixtral_like = model.num_experts < NEAREST_SPLIT
    setting = PAPER_SETTINGS["mixtral" if mixtral_like else "deepseek"]
    return setting, (f"dali: 003 gives no u_size or prefetch size for {model.name}; using those of its "
                     f"{'Mixtral' if mixtral_like else 'DeepSeek and Qwen'} runs ({setting[0]} and {setting[1]}), "
                     f"the nearest in experts per layer ({model.num_experts})")


def _note_once(ctx: RunContext, note: str | None) -> None:
    if note and note not in ctx.notes:
        ctx.notes.append(note)


# ----------------------------------------------------------------------------- prefetch (Sec. 4.2)
@register_component
@dataclass
class ResidualPrefetch(Prefetch):
    """Residual-Based Prefetching (003 Sec. 4.2): the next layer's top experts by predicted workload."""

    name = "dali-residual"
    columns = ("pred_residual",)
    #: experts prefetched per layer ("prefetch size"; -1: 003's for the model, 1 for Mixtral, 4 for DeepSeek
    #: and Qwen, Fig. 12)
    size: int = -1
    _layers: int = 0
    _note: str | None = field(default=None, repr=False)

    _fallback: LastTokenPredictor | None = field(default=None, repr=False)

    def for_model(self, model: ModelSpec) -> None:
        if self.size == -1:
            (_, self.size), self._note = paper_setting(model)
        if self.size < 0:  # before the memory plan sizes the buffer from it
            raise ConfigError(f"prefetch.size={self.size} is negative", field="prefetch.size",
                              fix="use 0 or more (-1: 003's size for the model)")

    def configure(self, ctx: RunContext) -> None:
        self.for_model(ctx.model)
        _note_once(ctx, self._note)
        self._layers = ctx.model.num_layers
        self._fallback = None
        if "pred_residual" not in ctx.columns:
            self._fallback = LastTokenPredictor()
            ctx.notes.append("dali-residual: the trace has no pred_residual column; each token is predicted to "
                             "use, at the next layer, what its request's previous token used there")

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        predicted = self._fallback.predict(view) if self._fallback else view.predictors.get("pred_residual")
        if view.layer + 1 >= self._layers or not predicted:
            return []
        if len(predicted) == 1:
            row = np.asarray(predicted[0]).tolist()
            if len(set(row)) == len(row):  # one token, no repeats: one each, ids ascending among equals
                return [(view.layer + 1, e) for e in sorted(row)[:self.size]]
        flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in predicted]) if predicted else np.array([])
        if flat.size == 0:
            return []
        workload = np.bincount(flat)
        ids = np.flatnonzero(workload)
        order = ids[np.argsort(-workload[ids], kind="stable")]
        return [(view.layer + 1, int(e)) for e in order[:self.size]]


# ----------------------------------------------------------------------------- cache (Sec. 4.3)
@register_component
@dataclass
class WorkloadAwareCache(CachePolicy):
    """Workload-Aware Cache Replacement (003 Sec. 4.3, Alg. 2)."""

    name = "dali-workload"
    #: iterations per window (Fig. 12: 4)
    w_size: int = 4
    #: experts swapped per window (-1: 003's for the model, 1 for Mixtral, 8 for DeepSeek and Qwen, Sec. 6.4)
    u_size: int = -1
    #: model-wide slots for prefetched experts, besides the cache (-1: twice the prefetch size)
    prefetch_slots: int = -1
    #: swap only where the incoming score exceeds the outgoing one (false: Alg. 2 literally)
    strict: bool = True
    _scores: list[np.ndarray] = field(default_factory=list, repr=False)
    _last: list[np.ndarray] = field(default_factory=list, repr=False)
    _windows: list[int] = field(default_factory=list, repr=False)
    _cached: list[set[int]] = field(default_factory=list, repr=False)
    _seen: tuple[int, int] = (-1, -1)
    _seed: int = 0
    _experts: int = 0
    _note: str | None = field(default=None, repr=False)

    def for_model(self, model: ModelSpec) -> None:
        if self.u_size == -1:
            (self.u_size, _), self._note = paper_setting(model)

    def configure(self, ctx: RunContext) -> None:
        self.for_model(ctx.model)
        _note_once(ctx, self._note)
        if self.w_size < 1 or self.u_size < 0:
            raise ConfigError(f"w_size >= 1, u_size >= 0 required (got {self.w_size}, "
                              f"{self.u_size}, {self.prefetch_slots})", field="cache.w_size",
                              fix="--set cache.w_size=4 --set cache.u_size=8 (-1: 003's for the model)")
        experts = ctx.model.num_experts
        self._experts = experts
        self._scores = [np.zeros(experts) for _ in ctx.capacity]
        self._last = [np.zeros(experts) for _ in ctx.capacity]
        self._windows = [0 for _ in ctx.capacity]
        self._cached = [set() for _ in ctx.capacity]
        self._seen = (-1, -1)
        self._seed = ctx.seed

    def initial(self, layer: int, capacity: int) -> list[int]:
        rng = np.random.default_rng([self._seed, layer])
        chosen = sorted(int(e) for e in rng.permutation(self._experts)[:capacity])
        self._cached[layer] = set(chosen)
        return chosen

    def cached(self, layer: int) -> set[int]:
        return self._cached[layer]

    def cached_sets(self) -> list[set[int]]:
        """Every layer's cached experts, by layer."""
        return self._cached

    def observe(self, view: LayerView) -> bool:
        """Add this iteration's workload (Alg. 2 lines 5-6); True when the layer's window just closed."""
        if (view.step, view.layer) == self._seen:
            return False
        self._seen = (view.step, view.layer)
        layer = view.layer
        scores = self._scores[layer]
        for e, n in zip(view.active, view.counts):  # a decode layer's few experts: no index arrays to build
            scores[e] += n
        self._windows[layer] += 1
        return self._windows[layer] % self.w_size == 0

    def replacement(self, layer: int, on_gpu: set[int], protected: set[int]) -> tuple[list[int], list[int]]:
        """Alg. 2 lines 10-15: (experts to bring in, cached experts to drop); restarts the window's scores."""
        s = self._scores[layer]
        cached = self._cached[layer]
        mask = np.ones(self._experts, dtype=bool)
        mask[list(cached)] = False
        uncached = np.flatnonzero(mask)
        # by score descending, ids ascending among ties (a stable sort of ascending ids); only u_size are used
        incoming = uncached[np.argsort(-s[uncached], kind="stable")][:self.u_size].tolist()
        score = s.tolist()
        outgoing = sorted((e for e in cached if e not in protected), key=lambda e: (score[e], e))
        swaps_in, swaps_out = [], []
        for new, old in zip(incoming[:self.u_size], outgoing[:self.u_size]):
            if self.strict and s[new] <= s[old]:
                break
            swaps_in.append(new)
            swaps_out.append(old)
        cached.difference_update(swaps_out)
        cached.update(swaps_in)
        self._last[layer] = s.copy()
        s[:] = 0.0
        return swaps_in, swaps_out

    # -- plain-cache interface, for systems that swap this component in -----------------------
    def touch(self, view: LayerView, used: list[int]) -> None:
        if self.observe(view):
            self._last[view.layer] = self._scores[view.layer].copy()
            self._scores[view.layer][:] = 0.0

    def _rank(self, layer: int) -> np.ndarray:
        return self._scores[layer] + 1e-9 * self._last[layer]

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        rank = self._rank(layer)
        candidates = [e for e in view.cache.resident[layer] if e not in protected]
        return sorted(candidates, key=lambda e: (rank[e], e))[:n]

    def admission_order(self, view: LayerView, layer: int, missing: list[int]) -> list[int]:
        rank = self._rank(layer)
        return sorted(missing, key=lambda e: (-rank[e], e))


# ----------------------------------------------------------------------------- the system
class DaliSystem(ObservingSystem):
    """DALI's planning steps (003 Sec. 4, Fig. 9); see the module docstring."""

    #: (layer, expert) pairs that may be buffer entries: prefetched, and not yet found cached or gone
    _buffer_pairs: set[tuple[int, int]]
    #: whether every layer was looked at once for uncached experts (the run may start with some)
    _scanned: bool = False

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        self._buffer_pairs, self._scanned = set(), False

    def _buffer(self) -> int:
        """Slots of the prefetch buffer (0 when another cache or no prefetch is swapped in)."""
        cache = self.cache
        if not isinstance(cache, WorkloadAwareCache) or isinstance(self.prefetch, NoPrefetch):
            return 0
        if cache.prefetch_slots >= 0:
            return cache.prefetch_slots
        return 2 * getattr(self.prefetch, "size", 1)

    def reserved_slots(self, layers: int) -> int:
        return self._buffer()

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """The cache's quotas, each layer allowed the buffer on top, the whole held to cache + buffer."""
        buffer = self._buffer()
        cache = self.cache.spread(total, layers, experts, requested)
        if not buffer:
            return cache
        return SlotSpread([min(q + buffer, experts) for q in cache.capacity], sum(cache.capacity) + buffer)

    def initial(self, layer: int, capacity: int) -> list[int]:
        return self.cache.initial(layer, max(capacity - self._buffer(), 0))

    def _place(self, view: LayerView) -> LayerPlan:
        cache = self.cache
        if not isinstance(cache, WorkloadAwareCache):
            return super()._place(view)  # another cache swapped in: the generic steps
        window_closed = cache.observe(view)
        gpu, cpu = self.assign.split(view)
        plan = LayerPlan(cpu=cpu)
        solve_s = getattr(self.assign, "_last_solve_s", 0.0)
        if solve_s:
            plan.overhead_s["predict"] = solve_s
        layer, state = view.layer, view.cache
        present = [e for e in gpu if state.has(layer, e)]
        ready = [e for e in present if e in state.resident[layer]]
        arriving = sorted((e for e in present if e not in state.resident[layer]),
                          key=lambda e: view.arrivals.get(e, 0.0))
        plan.streamed = [e for e in gpu if not state.has(layer, e)]
        plan.gpu = ready + arriving + plan.streamed
        if window_closed:
            self._swap(view, plan, set(gpu))
        self._prefetch(view, plan)
        return plan

    def _swap(self, view: LayerView, plan: LayerPlan, in_use: set[int]) -> None:
        """The window's replacement: evict the dropped experts, load the new ones (or promote them
        from the prefetch buffer, where they already are)."""
        cache, layer, state = self.cache, view.layer, view.cache
        assert isinstance(cache, WorkloadAwareCache)
        protected = in_use | state.in_flight[layer]
        swaps_in, swaps_out = cache.replacement(layer, state.resident[layer], protected)
        for e in swaps_out:
            plan.evictions.append((layer, e))
        for e in swaps_in:
            if not state.has(layer, e):
                plan.prefetches.append((layer, e))

    def _prefetch(self, view: LayerView, plan: LayerPlan) -> None:
        """Prefetched experts go to buffer slots; stale buffer entries make room, never cached experts."""
        if not self._prefetching:
            return
        state = view.cache
        wanted = self.prefetch.candidates(view)
        evicted = set(plan.evictions)
        # free slots after the plan so far: of each target's quota (found at its first need), of the whole
        room: dict[int, int] = {}
        pool_left = None if state.pool is None else state.pool - state.held() + len(evicted) - len(plan.prefetches)
        # the buffer's entries, found at the first need: one layer's (a full quota) or every layer's (a full pool)
        entries: dict[int | None, list[tuple[int, int]]] = {}
        swaps = len(plan.prefetches)  # the window's swap-ins, cached experts
        for target, e in wanted:
            if (state.has(target, e) and (target, e) not in evicted) or (target, e) in plan.prefetches:
                continue
            if target not in room:
                room[target] = self._quota_left(view, plan, target, evicted)
            full = room[target] <= 0
            if full or (pool_left is not None and pool_left <= 0):
                where = target if full else None
                if where not in entries:
                    entries[where] = self._buffer_entries(view, where)
                stale = self._stale_entry(view, plan, where, wanted, evicted, entries[where])
                if stale is None:
                    entries[where] = []  # none now, and the plan only takes more away: none later either
                    continue
                plan.evictions.append(stale)
                evicted.add(stale)
                if stale[0] in room:
                    room[stale[0]] += 1
                if pool_left is not None:
                    pool_left += 1
            plan.prefetches.append((target, e))
            room[target] -= 1
            if pool_left is not None:
                pool_left -= 1
        self._buffer_pairs.update(plan.prefetches[swaps:])  # after the loop: not in flight before the plan runs

    def _quota_left(self, view: LayerView, plan: LayerPlan, target: int, evicted: set[tuple[int, int]]) -> int:
        """Free slots of ``target``'s quota after this plan so far."""
        state = view.cache
        dropped = sum(1 for (l, _) in evicted if l == target)
        queued = sum(1 for (l, _) in plan.prefetches if l == target)
        return state.capacity[target] - state.used(target) + dropped - queued

    def _buffer_entries(self, view: LayerView, layer: int | None = None) -> list[tuple[int, int]]:
        """Every (layer, expert) resident and not cached: what the prefetch buffer holds (in ``layer`` alone
        when given)."""
        cache, resident = self.cache, view.cache.resident
        assert isinstance(cache, WorkloadAwareCache)
        if layer is not None:
            return [(layer, x) for x in resident[layer] - cache.cached(layer)]
        kept, in_flight = cache.cached_sets(), view.cache.in_flight
        if not self._scanned:  # the first time, every layer
            self._buffer_pairs.update((l, x) for l, (held, cached) in enumerate(zip(resident, kept))
                                      if not held <= cached for x in held - cached)
            self._scanned = True
        # only a prefetch puts an uncached expert in a layer, so the entries are among the prefetched pairs;
        # a pair leaves them once its expert is cached, or neither resident nor arriving
        entries = []
        for pair in list(self._buffer_pairs):
            l, x = pair
            if x in resident[l]:
                if x in kept[l]:
                    self._buffer_pairs.discard(pair)
                else:
                    entries.append(pair)
            elif x not in in_flight[l]:
                self._buffer_pairs.discard(pair)
        return entries

    def _stale_entry(self, view: LayerView, plan: LayerPlan, layer: int | None, wanted: list[tuple[int, int]],
                     evicted: set[tuple[int, int]], entries: list[tuple[int, int]]) -> tuple[int, int] | None:
        """A buffer entry (of ``entries``) nobody needs now: in ``layer`` when given, else the one whose
        layer comes round last in the forward pass."""
        if not entries:
            return None
        busy = set(wanted) | evicted | {(view.layer, x) for x in plan.gpu}
        stale = [(l, x) for l, x in entries if (layer is None or l == layer) and (l, x) not in busy]
        if not stale:
            return None
        turns = view.cache.num_layers
        return max(stale, key=lambda p: ((p[0] - view.layer - 1) % turns, -p[1]))


register_system("dali", SystemSpec(
    "DALI (003): greedy CPU/GPU assignment, residual-based prefetch into a buffer, workload-aware cache "
    "replacement over token windows; uncached GPU experts are transferred for one use",
    cache="dali-workload", assign="dali-greedy", prefetch="dali-residual", system_class=DaliSystem,
    runtime="ktransformers-eager"))
