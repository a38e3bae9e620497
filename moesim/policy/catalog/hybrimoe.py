"""HybriMoE (arXiv 2504.05897; a baseline of 000_dba2fecbbc66318b.txt Sec. VI-A, VI-D).

Three parts, after the paper and its public implementation (github.com/PKU-SEC-Lab/HybriMoE,
``ktransformers/operators/experts.py``):

* score-aware cache: a priority per (layer, expert), ``S = alpha * TopP(s) + (1 - alpha) * S``
  where ``TopP(s)`` keeps the router scores of the ``top_p`` best experts and is 0
  elsewhere (so unselected experts decay by ``1 - alpha``); the victim is the resident
  expert of lowest priority;
* hybrid scheduling: experts sorted cached-first, then by tokens (most first); the
  GPU takes from the head and the CPU from the tail, whichever would finish sooner,
  counting the transfer of an uncached head expert (the GPU waits for it);
* layer-wise prefetch of the next layer during decoding, ``n`` experts (000 Sec.
  VI-D found 1 best on DeepSeek-V3 and Qwen3; Sec. VI-A counts HybriMoE's
  impact-driven prefetch as layer-wise), and the layer waiting for all its
  outstanding prefetches before computing it (the implementation's
  ``wait_prefetch``; moesim puts the wait before the layer's CPU and GPU
  experts alike; 000 Sec. VI-E measured about 1 ms of such waiting per token
  and layer).

Prefill as 000 Sec. VI-B describes HybriMoE's (reproduced and extended to DeepSeek-V3
and Qwen3 by 000's authors, Sec. VI-A): the experts it keeps cached on the GPU take
work off the CPU, so its TTFT grows with the prompt, but more slowly than
KTransformers'. Hybrid scheduling runs in the prefill too, but
over the cached experts only: nothing is loaded on demand there (the on-demand
loading of heavy experts is SMoE's contribution, Sec. IV-B), so uncached experts
go to the CPU (``assign.prefill_loads=true`` lets the GPU take uncached heads with
their transfer, as in decoding). The initial cache is the layer's first experts,
preloaded before the first step as for every system (moesim charges no system
for its load-time cache; only SMoE fills its cache later, after the prefill, and
pays for it because that is its mechanism).

Scheduling overhead: 003_46c415738ddfa491.txt Table 6 measured HybriMoE's scheduling at 3.01% of
end-to-end inference time on average (DeepSeek, batch 8, sequence lengths 32-2048, essentially
constant because every token makes one decision per MoE layer). Each layer's plan is charged that
share of the layer period on the critical path (category ``predict``, as DALI's 4.50%), with DALI's
``SolveClock``; ``assign.solve_us`` charges a fixed time per layer instead (0: free).

The public code prefetches by priority score; this module uses the trace's
``pred_next_layer`` (the next layer's gate on this layer's input, the paper's
prediction) when present, and the priority scores otherwise (noted in the report).
The ``n`` best-ranked experts not already cached (resident or arriving) are
prefetched; the better-ranked cached ones are kept (never evicted for them). With a batch of several tokens the priority update uses their mean
scores.

Where moesim departs from the public code (``ktransformers/operators/experts.py``, ``KExpertsCache``):

* cost estimates: the code's ``HSS`` uses fixed fitted constants marked "need to be tested" (CPU
  1 ms per token plus 0.79 ms on its first expert, GPU 0.5 ms an expert whatever its tokens with no
  intercept, 0.418 ms a copy); moesim's scheduler reads the cost model the replay executes, so its
  estimates are the run's own times, and it starts the GPU after the shared experts, which the code
  runs on the GPU before its routed experts without counting them;
* batches: the code schedules only one-token steps and updates the priorities from the first token's
  scores (``top_p_scores[0]``); moesim schedules any token count and updates from the tokens' mean;
* prefill: the code's multi-token path skips ``HSS`` and runs every expert on the GPU, streaming the
  uncached ones through a per-layer buffer; moesim follows 000 Sec. VI-B's account (above);
* prefetch: the code's ``prefetch_size`` defaults to 0 (``local_chat.py``; its README runs
  ``--prefetch_size 0``) and moesim uses 000 Sec. VI-D's 1; the code takes the ``n`` best-ranked and
  copies those not loaded (none when they are all cached), and only when the layer gave the GPU an
  expert; moesim spends the ``n`` copies on the best-ranked uncached experts in every decode layer
  (a copy of a cached expert saves nothing);
* eviction: the code evicts the lowest-priority loaded expert of the layer, even one the layer is
  about to run; moesim never evicts one the layer runs on the GPU or one still arriving (the
  composed system's protected set), since the code's choice would copy that expert back at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.policy.assign import Assignment
from moesim.policy.base import (LayerPlan, LayerView, PerTokens, RunContext, expert_times, highest_set,
                                token_mean)
from moesim.policy.cache import CachePolicy
from moesim.policy.catalog.dali.assign import SolveClock
from moesim.policy.prefetch import Prefetch, ranked_predictions
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system


_FLOAT16 = np.dtype(np.float16)
#: float16 numbers read as their bits, and the bits of +inf (above them: NaN; from 0x8000: a sign bit)
_BITS = np.dtype(np.uint16)
_INF_BITS = 0x7C00


@register_component
@dataclass
class ScoreAwareCache(CachePolicy):
    """HybriMoE's score-aware cache: evict the resident expert of lowest priority ``S``."""

    name = "score-aware"
    columns = ("scores", "weights")
    #: weight of the newest scores in ``S = alpha * TopP(s) + (1 - alpha) * S`` (0.5: the public implementation's
    #: default, ``KScoreAwareCache`` in ``ktransformers/operators/experts.py``)
    alpha: float = 0.5
    #: experts whose scores enter TopP each update; 0: twice the model's top_k, as the public code builds the
    #: cache (``KScoreAwareCache(..., 0.5, 2 * self.top_k)`` in ``ktransformers/models/modeling_deepseek.py``;
    #: the class's own default ``p=12`` is that value for DeepSeek-V2-Lite's top-6 and is never used) (experts)
    top_p: int = 0
    _p: int = field(default=12, repr=False)
    _priority: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False)
    _noted: bool = False
    _notes: list[str] = field(default_factory=list, repr=False)

    def configure(self, ctx: RunContext) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"cache.alpha={self.alpha} outside (0, 1]", field="cache.alpha", fix="use e.g. 0.5")
        if self.top_p < 0:
            raise ConfigError(f"cache.top_p={self.top_p} is negative", field="cache.top_p",
                              fix="use 0 (twice the model's top_k) or e.g. 12")
        # resolved per run, so that a system configured again for another model takes that model's top_k
        self._p = self.top_p or 2 * ctx.model.top_k
        self._priority = np.zeros((ctx.model.num_layers, ctx.model.num_experts))
        self._notes = ctx.notes
        self._noted = False
        if "scores" not in ctx.columns:
            self._notes.append("score-aware: the trace has no scores column; priorities use the routed experts' "
                               "gate weights (1/top_k each without weights), so TopP sees only top_k experts")
            self._noted = True

    def layer_scores(self, view: LayerView) -> np.ndarray:
        """Mean router scores of this layer's tokens (from routed weights when the trace lacks scores)."""
        if view.scores is not None:
            return token_mean(view.scores)
        dense = np.zeros(view.cache_experts())
        weights = view.weights if view.weights is not None else np.full(view.experts.shape, 1.0 / view.experts.shape[1])
        np.add.at(dense, view.experts.ravel(), weights.ravel())
        return dense / view.tokens

    def observe(self, view: LayerView) -> None:
        """``S = alpha * TopP(s) + (1 - alpha) * S`` for this layer."""
        if view.scores is not None and view.scores.shape[0] == 1:
            # one token (every decode layer) is its own mean: TopP is chosen on the scores as stored (widening
            # to float64 is exact and keeps their order) and only the chosen ones are widened
            scores = view.scores[0]
            top = self._top_set(scores)
            chosen = scores[top].astype(np.float64)
        else:
            scores = self.layer_scores(view)
            top = highest_set(scores, self._p)
            chosen = scores[top]
        row = self._priority[view.layer]
        row *= 1.0 - self.alpha
        row[top] += self.alpha * chosen

    def _top_set(self, scores: np.ndarray) -> np.ndarray:
        """:func:`highest_set` of ``scores`` in their own dtype: the ones at least the ``top_p``-th highest when
        no tie crosses it (partitioned in place on a copy), else the exact choice in float64."""
        k = len(scores) - self._p
        if k > 0 and scores.dtype == _FLOAT16:
            # float16 compares are emulated one number at a time; the numbers' bit patterns as unsigned
            # integers order as the numbers do from +0 to +inf (no sign bit, no NaN), the largest shows
            bits = scores.view(_BITS)
            part = bits.copy()
            part.partition((k, len(part) - 1))
            if part.item(-1) <= _INF_BITS:
                near = (bits >= part[k]).nonzero()[0]
                if near.size == self._p:
                    return near
                return highest_set(scores.astype(np.float64), self._p)
        if k > 0:
            part = scores.copy()
            part.partition(k)
            near = (scores >= part[k]).nonzero()[0]
            if near.size == self._p:
                return near
        return highest_set(scores.astype(np.float64), self._p)

    def priority(self, layer: int) -> np.ndarray:
        return self._priority[layer]

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        # the (priority, id) order is total, so the candidates' order does not matter
        resident = view.cache.resident[layer]
        candidates = list(resident.difference(protected) if protected else resident)
        priority = self._priority[layer].take(candidates).tolist()
        if n == 1:  # the usual single victim: the lowest (priority, id), without sorting the rest
            return [min(zip(priority, candidates))[1]] if candidates else []
        return [e for _, e in sorted(zip(priority, candidates))[:n]]


#: 003 Table 6 (App. A.4): HybriMoE's scheduling overhead, 3.01% of end-to-end inference time on average
SCHEDULING_SHARE = 0.0301


def hybrid_schedule(view: LayerView, loads: bool = True,
                    times: PerTokens | None = None) -> tuple[list[int], list[int]]:
    """HybriMoE's hybrid scheduling: (gpu in execution order, cpu in execution order).

    Experts resident or in flight count as cached (the layer waits for its
    prefetches first). Sorted cached-first, each group by tokens (most first,
    then id). Each round compares the GPU's finish time if it takes the head
    with the CPU's if it takes the tail and gives the expert to the earlier one:
    the GPU starts with the shared experts, the CPU with a synchronisation, and
    an uncached head waits for its transfer behind the ones before it. With
    ``loads`` false the GPU never takes an uncached expert: the CPU gets them all.
    ``times``: the cost model's (GPU kernel, CPU) expert times by token count, kept between calls.
    """
    costs = view.costs
    resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
    active, counts = view.active, view.counts
    if not active:
        return [], []
    times = PerTokens.of(times, costs, expert_times)
    launch = view.expert_launch_s
    if counts[0] == counts[-1]:
        # one token count (every decode layer): (-tokens, id) order is id order, and every expert takes the
        # same times (each the sum the general case forms per expert)
        cached = sorted(e for e in active if e in resident or e in in_flight) if in_flight \
            else sorted(e for e in active if e in resident)
        if len(cached) < len(active):
            cached_now = resident.union(in_flight) if in_flight else resident
            order = cached + sorted(e for e in active if e not in cached_now)
        else:
            order = cached
        kernel, cpu_s = times[counts[0]]
        gpu_time = [kernel + launch] * len(order)
        cpu_time = [cpu_s] * len(order)
    else:
        # (-tokens, id) pairs sort most tokens first, then id
        cached_pairs: list[tuple[int, int]] = []
        uncached_pairs: list[tuple[int, int]] = []
        for e, n in zip(active, counts):
            (cached_pairs if e in resident or e in in_flight else uncached_pairs).append((-n, e))
        cached_pairs.sort()
        uncached_pairs.sort()
        pairs = cached_pairs + uncached_pairs
        order = [e for _, e in pairs]
        cached = cached_pairs
        # each expert's GPU kernel (with its launch) and CPU time, computed once per token count
        gpu_time, cpu_time = [], []
        for m, _ in pairs:
            kernel, cpu_s = times[-m]
            gpu_time.append(kernel + launch)
            cpu_time.append(cpu_s)
    shared = costs.gpu_shared(view.tokens) + view.shared_launch_s if costs.model.shared_intermediate_size else 0.0
    return head_tail(order, len(cached), gpu_time, cpu_time, shared, costs.expert_load, costs.sync_s, loads)


def head_tail(order: list[int], first_uncached: int, gpu_time: list[float], cpu_time: list[float], shared: float,
              expert_load: float, sync_s: float, loads: bool) -> tuple[list[int], list[int]]:
    """The rounds of :func:`hybrid_schedule` over experts in ``order`` (cached first, the uncached from index
    ``first_uncached``), with each one's GPU time (kernel and launch) and CPU time."""
    gpu_t, cpu_t, move_t = shared, 0.0, 0.0
    gpu: list[int] = []
    cpu: list[int] = []
    head, tail = 0, len(order) - 1
    while head <= tail:
        uncached_head = head >= first_uncached
        gpu_end = gpu_t
        if uncached_head:
            gpu_end = max(gpu_end, move_t + expert_load) if loads else math.inf
        gpu_end += gpu_time[head]
        cpu_end = cpu_t + (sync_s if not cpu else 0.0) + cpu_time[tail]
        if gpu_end <= cpu_end:
            if uncached_head:
                move_t += expert_load
            gpu_t = gpu_end
            gpu.append(order[head])
            head += 1
        else:
            cpu_t = cpu_end
            cpu.append(order[tail])
            tail -= 1
    return gpu, cpu


@register_component
@dataclass
class HybridScheduling(Assignment):
    """HybriMoE's head/tail hybrid scheduling by cumulative finish time (see :func:`hybrid_schedule`);
    in the prefill over the cached experts only (000 Sec. VI-B) unless ``prefill_loads``."""

    name = "hybrimoe"
    any_negative = ("solve_us",)
    #: let the prefill load uncached experts on demand as decoding does (000 Sec. VI-B: it does not)
    prefill_loads: bool = False
    #: let decoding load uncached experts on demand (HybriMoE's rule and public code); false: they run on the
    #: CPU and only the layer-wise prefetch moves experts, as 000 reproduced HybriMoE (Sec. VI-E, VI-F;
    #: docs/reproduction.md). The rule loads an expert only when its copy and kernel end before the CPU would
    #: finish it, so this changes nothing where the CPU always wins: one-token decode steps of top-2 routing
    #: on rtx4090 (the bundled Mixtral trace: two CPU experts, 2 x 4.8 ms, end before one 13.5 ms copy);
    #: with fewer cores (hw.cpu.cores=4), bigger batches or more experts per token it acts
    decode_loads: bool = True
    #: scheduling time per layer, microseconds, on the critical path (negative: ``solve_share`` of the run)
    solve_us: float = -1.0
    #: scheduling time as a share of end-to-end time (003 Table 6: HybriMoE 3.01% on average)
    solve_share: float = SCHEDULING_SHARE
    _last_solve_s: float = field(default=0.0, repr=False)
    _clock: SolveClock | None = field(default=None, repr=False)
    _times: PerTokens | None = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        self._clock = SolveClock.checked(self.solve_share, self.solve_us, SCHEDULING_SHARE)

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        if self._clock is None:
            self._clock = SolveClock(self.solve_share, self.solve_us)
        self._last_solve_s = self._clock.charge(view)
        self._times = PerTokens.of(self._times, view.costs, expert_times)
        loads = self.prefill_loads if view.phase == "prefill" else self.decode_loads
        return hybrid_schedule(view, loads=loads, times=self._times)


def ranked_until_uncached(ranked, cached, n: int) -> list[int]:
    """The best-ranked experts up to and including the ``n``-th one not cached. The cached ones stay in
    the list so that the system protects them: a better-ranked expert is never evicted for a worse one."""
    picks: list[int] = []
    missing = 0
    for e in ranked:
        if missing >= n:
            break
        picks.append(e)
        if not cached(e):
            missing += 1
    return picks


@register_component
@dataclass
class LayerWisePrefetch(Prefetch):
    """HybriMoE's layer-wise prefetch: during decoding, the ``n`` experts the next layer most likely uses
    among those not already cached (resident or arriving).

    Ranked by the trace's ``pred_next_layer`` when present, else by the
    score-aware cache's priorities of the next layer (as the public
    implementation does; flagged in the notes). ``wait``: the next layer's
    experts start only after every prefetch into it has arrived.
    """

    name = "hybrimoe-layer"
    phases = ("decode",)
    columns = ("pred_next_layer",)
    #: experts prefetched into the next layer per step (000 Sec. VI-D: 1 is HybriMoE's best)
    n: int = 1
    #: the layer waits for all its outstanding prefetches before computing (public code's wait_prefetch)
    wait: bool = True
    _predictor: bool = True
    _priority: object = None

    def configure(self, ctx: RunContext) -> None:
        if self.n < 0:
            raise ConfigError(f"prefetch.n={self.n} is negative", field="prefetch.n", fix="use 0 or more")
        self._predictor = "pred_next_layer" in ctx.columns
        if not self._predictor:
            ctx.notes.append("hybrimoe-layer: the trace has no pred_next_layer column; the next layer's "
                             "score-aware priorities choose the prefetches (as HybriMoE's public code)")

    @property
    def issued_per_layer(self) -> int | None:
        """``n``: experts prefetched into the next layer per decode step."""
        return self.n if self.n >= 0 else None

    def use_priorities(self, cache: CachePolicy) -> None:
        self._priority = getattr(cache, "priority", None)

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        target = view.layer + 1
        if view.phase != "decode" or self.n <= 0 or target >= view.num_layers:
            return []
        if self._predictor:
            ranked = ranked_predictions(view.predictors.get("pred_next_layer", []))
        elif self._priority is not None:
            row = self._priority(target)
            ranked = np.lexsort((np.arange(len(row)), -row)).tolist()
        else:
            return []
        resident, in_flight = view.cache.resident[target], view.cache.in_flight[target]
        # the n-th uncached comes within the first few ranked: both sets asked, no union built
        cached = (lambda e: e in resident or e in in_flight) if in_flight else resident.__contains__
        return [(target, e) for e in ranked_until_uncached(ranked, cached, self.n)]


@dataclass
class HybriMoESystem(ComposedSystem):
    """Updates the score-aware priorities first, then schedules; adds the wait for outstanding prefetches."""

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        if isinstance(self.prefetch, LayerWisePrefetch):
            self.prefetch.use_priorities(self.cache)

    def _place(self, view: LayerView) -> LayerPlan:
        observe = getattr(self.cache, "observe", None)
        if observe is not None:
            observe(view)
        plan = super()._place(view)
        solve_s = getattr(self.assign, "_last_solve_s", 0.0)
        if solve_s:
            plan.overhead_s["predict"] = solve_s
        if getattr(self.prefetch, "wait", False) and view.arrivals:
            wait = max(view.arrivals.values()) - view.now
            if wait > 0:
                plan.overhead_s["wait_cache"] = wait
        return plan


register_system("hybrimoe", SystemSpec(
    "HybriMoE (baseline of 000): score-aware cache, hybrid head/tail CPU-GPU scheduling (its scheduling time "
    "3.01% of the run, 003 Table 6), layer-wise prefetch of 1 expert into the next layer with wait_prefetch",
    cache="score-aware", assign="hybrimoe", prefetch="hybrimoe-layer", system_class=HybriMoESystem,
    runtime="ktransformers-eager"))
