"""Importance-driven expert scheduling (004_91681cee0e4a4add.txt, Sec. 5).

Components:

* ``importance-router`` (substitute, Sec. 5.1, Alg. 1): per token, the
  (k+1)-th highest router score is beta; routed experts scoring above
  ``(1 + alpha) * beta`` are top-score, the other routed ones low-score. A
  low-score expert that is neither resident nor a top-score expert of some
  token in the batch (the set C) is replaced by an inactive expert scoring in
  ``[(1 - alpha) * beta, beta]`` that is resident or in C (the alternative set
  A); the highest-scoring alternatives replace the lowest-scoring low-score
  experts. Needs the ``scores`` column. A bigger cache leaves the router
  fewer non-resident experts to replace, so where copies are cheap and GPU
  experts are not it can run slower: Qwen3-30B-A3B, 4 requests decoded
  together, 64 + 200 tokens, rtx4090 at twice its PCIe bandwidth, TPOT
  150.7 ms at ``cache.slots=960`` and 156.9 ms at 1920, as substitutions per
  layer fall from 7.2 to 5.6 and distinct experts per layer rise from 22.7
  to 24.4 (with ``substitute=none``: 172.1 and 159.3 ms).
* ``top-score`` (prefetch, Sec. 5.2): each token's highest predicted experts
  for the next layer (``pred_next_layer``, ``per_token`` of them), ranked by
  how many tokens predict them, then by rank in the prediction. In decoding
  the prefetches are issued after the layer's resident GPU experts and the
  prediction that names them, which runs the next layer's attention and gate
  on the GPU (Sec. 4.2, GPU parts (2)-(4); ``LayerPlan.prefetch_after_predict``);
  ``prefetch.after_resident=false`` issues them at plan time with no prediction
  cost, ``prefetch.predict_cost=false`` keeps the timing with a free prediction.
* ``score-history`` (cache, Sec. 5.3): evicts the expert with the lowest
  average router score over the last ``n`` iterations, inactive experts'
  scores included; experts the layer is using are protected (the system
  passes them as ``protected``). Needs ``scores``.
* ``two-pointer`` (assign, Sec. 5.4, Alg. 2): experts already on the GPU (or
  arriving) run there; the rest, sorted by tokens descending, are taken from
  the front for loading while the cumulative load time is at most the
  cumulative CPU time, and from the back for the CPU otherwise.
* ``static-first``: the ablation baseline's cache: the first experts of every
  layer stay resident, nothing is ever evicted (Sec. 6.3, "Baseline").

The ``importance`` system composes them. Ablation (Sec. 6.3, Fig. 16):
baseline = ``cache=static-first assign=resident``; +CE = ``cache=score-history
assign=gpu``; +ER adds ``substitute=importance-router``; +Pre adds
``prefetch=top-score``; +BA adds ``assign=two-pointer`` (the full system).

Sec. 5.2's queue clearing: once the predicted layer's gate has run, the
prefetches still queued (not yet on the wire) are dropped and their slots
freed (``LayerPlan.cancel_queued_prefetches``); a queued prefetch of an expert
the layer then computes on the GPU stays, as that expert's load.
``--set prefetch.clear_queue=false`` keeps every prefetch (an ablation).

Runtime: ``pytorch-eager``. 004 Sec. 6.1 implements the system on PyTorch (Python
without the GIL) over the transformers library's model code, launching kernels
eagerly; Sec. 7 treats KTransformers as a separate system it does not compare with.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.policy.assign import Assignment
from moesim.hw.cost import CostModel
from moesim.policy.base import LayerPlan, LayerView, PerTokens, RunContext, token_mean
from moesim.policy.cache import CachePolicy
from moesim.policy.prefetch import Prefetch, ranked_predictions
from moesim.policy.systems import ComposedSystem, Substitution, SystemSpec, register_component, register_system


class ObservingSystem(ComposedSystem):
    """A composed system whose components see every layer's routing, GPU experts or not.

    ``ComposedSystem`` tells the cache only about experts that ran on the GPU
    (``touch``); score- and workload-based caches need the whole layer, so
    each component with an ``observe(view)`` method gets the (substituted)
    view first.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        # looked up once: _place runs for every layer of every step
        self._observers = [observe for component in (self.cache, self.assign, self.prefetch)
                           if (observe := getattr(component, "observe", None)) is not None]

    def _place(self, view: LayerView) -> LayerPlan:
        for observe in self._observers:
            observe(view)
        return super()._place(view)


# ----------------------------------------------------------------------------- router (Alg. 1)
def token_thresholds(scores: np.ndarray, k: int, alpha: float) -> tuple[float, float, float]:
    """(T, L, R) = ((1 + alpha) beta, beta, (1 - alpha) beta), beta the (k+1)-th highest score."""
    n = len(scores)
    beta = float(np.partition(scores.astype(np.float64), n - 1 - k)[n - 1 - k]) if k < n else 0.0
    return (1 + alpha) * beta, beta, (1 - alpha) * beta


def layer_thresholds(scores: np.ndarray, k: int, alpha: float) -> list[tuple[float, float, float]]:
    """:func:`token_thresholds` of every token row at once (one partition of the layer's scores; the
    (k+1)-th highest score is the same number in any float width)."""
    n = scores.shape[1]
    if k >= n:
        return [token_thresholds(row, k, alpha) for row in scores]
    part = scores.copy()  # np.partition's copy and partition, without its wrapper
    part.partition(n - 1 - k, axis=1)
    betas = part[:, n - 1 - k].tolist()
    return [((1 + alpha) * beta, beta, (1 - alpha) * beta) for beta in betas]


#: 004 Sec. 6.2: "we use a ratio of 0.35 in S1, 0.3 in S2, and 0.25 in S3" (Table 1's models, preset names)
PAPER_ALPHA = {"deepseek-moe-16b": 0.35, "xverse-moe-a4.2b": 0.3, "qwen2-57b-a14b": 0.25}
#: for a model 004 did not run: S2's ratio, the middle one
DEFAULT_ALPHA = 0.3


@register_component
@dataclass
class ImportanceRouter(Substitution):
    """Expert-cache router (004 Sec. 5.1, Alg. 1): low-score routed experts not on the GPU are
    replaced by inactive, similarly scored experts that are resident or top-score for another token.

    The printed Alg. 1 takes alternatives with scores in [R, L) and counts every low-score
    expert in B_t; the text (Sec. 5.1) keeps low-score experts that are resident or top-score
    and calls the alternatives' range "between (1-alpha)beta and beta". This follows the text:
    B_t holds only the low-score experts that would need a load or the CPU, and the
    alternatives' range is closed at beta (the (k+1)-th expert itself, score exactly beta,
    is the most similar inactive expert). "In GPU" is "already in GPU memory" (Sec. 5.1):
    resident; a prefetch still in flight does not count, neither as a kept low-score expert
    nor as an alternative. The router works in decoding only: 004's prefill is "a
    traditional offloading-based LLM approach" (Sec. 4, Online inference) that computes
    every routed expert.

    Bounds: a routed expert scoring exactly T is low-score. Alg. 1 tests "> T" on line 6
    and "< T" on line 13, which would leave it in neither group and drop it from E[t];
    the text calls experts "above" T top-score, so the rest are low-score. Alternatives
    rank by score, highest first (Alg. 1 line 19), ties to the lower id. Sec. 5.4 adds that a
    token could prefer alternatives more tokens of the batch use, even ones not yet on
    the GPU; it gives one example and no rule for weighing batch size against score or
    against Alg. 1's "in GPU or C" condition, so the router keeps Alg. 1's ranking.
    """

    name = "importance-router"
    phases = ("decode",)
    columns = ("scores",)
    requires = {"scores": "router scores decide top- and low-score"}
    #: substitution threshold alpha (-1: 004's for the model, Sec. 6.2: 0.35 in S1 on deepseek-moe-16b, 0.3 in
    #: S2 on XVERSE-MoE-A4.2B, 0.25 in S3 on Qwen2-57B-A14B; S2's 0.3 for a model 004 did not run, noted)
    alpha: float = -1.0
    #: the run's threshold (``alpha`` resolved for the model)
    threshold: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.threshold = self.alpha  # the value asked for, until a run resolves -1 for its model

    def configure(self, ctx: RunContext) -> None:
        # resolved per run, so that a component configured again for another model takes that model's alpha
        self.threshold = self.alpha
        if self.threshold == -1.0:
            self.threshold = PAPER_ALPHA.get(ctx.model.name.lower(), DEFAULT_ALPHA)
            if ctx.model.name.lower() not in PAPER_ALPHA:
                ctx.notes.append(f"importance-router: 004 sets alpha for its three models only; using "
                                 f"{DEFAULT_ALPHA} (S2's, the middle of 0.35, 0.3, 0.25) for {ctx.model.name} "
                                 f"(set substitute.alpha)")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"alpha must lie in [0, 1], got {self.threshold}", field="substitute.alpha",
                              fix="--set substitute.alpha=0.3")

    def rewrite(self, view: LayerView) -> list[tuple[int, int, int]]:
        if view.phase != "decode":
            return []
        if view.scores is None:
            raise ConfigError("substitute 'importance-router' got a layer without router scores", field="scores",
                              fix="replay a trace with the 'scores' column")
        k = view.experts.shape[1]
        scores = view.scores
        if scores.shape[0] == 1:
            return self._rewrite_one(view.experts[0].tolist(), scores[0], view.cache.resident[view.layer])
        bounds = layer_thresholds(scores, k, self.threshold)
        rows = view.experts.tolist()
        # scores as Python floats (the same numbers, compared without numpy scalars): each token's routed
        # experts', and its other experts' only where it has an expert to replace
        routed_scores = [scores[t].take(row).tolist() for t, row in enumerate(rows)]
        top_set = {e for row, r, (high, _, _) in zip(rows, routed_scores, bounds)
                   for e, score in zip(row, r) if score > high}
        resident = view.cache.resident[view.layer]
        available = resident | top_set if top_set else resident  # read only
        out: list[tuple[int, int, int]] = []
        for t, (row, r, (high, low, floor)) in enumerate(zip(rows, routed_scores, bounds)):
            # low-score experts needing a load or the CPU, lowest score first (they go first)
            needy = sorted((slot for slot, e in enumerate(row) if r[slot] <= high and e not in available),
                           key=lambda slot: (r[slot], slot))
            if not needy:
                continue
            others = list(available.difference(row))  # any order: the alternatives are sorted below
            # alternatives: highest score first, then lowest id
            alternatives = sorted((-score, e) for e, score in zip(others, scores[t].take(others).tolist())
                                  if floor <= score <= low)
            out += [(t, slot, e) for slot, (_, e) in zip(needy, alternatives)]
        return out

    def _rewrite_one(self, row: list[int], scores: np.ndarray, resident: set[int]) -> list[tuple[int, int, int]]:
        """:meth:`rewrite` of a one-token layer (every decode step of one request). A token's top-score experts
        are among its own, so an expert of its row is "in GPU or C" only when resident, and the alternatives
        are the resident experts outside its row: no set of top-score experts to build."""
        missing = [slot for slot, e in enumerate(row) if e not in resident]
        if not missing:
            return []
        n, k = len(scores), len(row)
        if k >= n:
            high, low, floor = token_thresholds(scores, k, self.threshold)
        else:
            part = scores.copy()
            part.partition(n - 1 - k)
            low = part.item(n - 1 - k)  # beta, as layer_thresholds reads it
            high, floor = (1 + self.threshold) * low, (1 - self.threshold) * low
        r = scores.take(row).tolist()
        needy = sorted((slot for slot in missing if r[slot] <= high), key=lambda slot: (r[slot], slot))
        if not needy:
            return []
        others = list(resident.difference(row))  # any order: the alternatives are sorted below
        alternatives = sorted((-score, e) for e, score in zip(others, scores.take(others).tolist())
                              if floor <= score <= low)
        return [(0, slot, e) for slot, (_, e) in zip(needy, alternatives)]


# ----------------------------------------------------------------------------- prefetch (Sec. 5.2)
@register_component
@dataclass
class TopScorePrefetch(Prefetch):
    """Top-score prefetch for the next layer (004 Sec. 5.2) from ``pred_next_layer``.

    Only top-score experts are worth a load (Sec. 3, Fig. 5): per token, the
    first ``per_token`` experts of its prediction (the ones the next layer's
    gate scores highest), ranked over the batch by how many tokens predict
    them, then by rank in a prediction (Sec. 5.2 orders one token's experts
    by predicted score and gives no rule for merging a batch's; a trace holds
    ids only), at most ``size`` per layer. With ``clear_queue`` the importance
    system drops those still queued when the target layer's gate has run.

    Why one per token by default: Sec. 5.2 queues each token's top k predicted
    experts in score order and clears the queue at the gate, so in effect only
    the first few (the top-score ones, Sec. 6.3 Fig. 18) are loaded; which ones
    are top-score needs the predicted scores against T = (1 + alpha) beta, and a
    trace holds the predicted ids only. moesim also takes a prefetch's eviction
    when it is planned, not when its copy starts, so queuing all k would evict
    up to k experts a layer for copies the queue clearing then drops. One per
    token stands for the "only a few" top-score experts of Sec. 3 (Fig. 4);
    ``per_token=0`` queues the whole prediction (Sec. 5.2 read literally).
    """

    name = "top-score"
    columns = ("pred_next_layer",)
    requires = {"pred_next_layer": "the next layer's predicted experts"}
    #: predicted experts per token treated as top-score, highest predicted scores first (004 Sec. 5.2; 0: the
    #: whole prediction, the top k) (experts)
    per_token: int = 1
    #: experts loaded ahead per layer at most, 0: no cap beyond per_token (a cap of moesim's own; 004
    #: Sec. 5.2 sets none) (experts)
    size: int = 0
    #: drop still-queued prefetches once the predicted layer's gate has run (Sec. 5.2)
    clear_queue: bool = True
    #: in decoding, issue the prefetches after this layer's resident GPU experts and the GPU prediction
    #: (004 Sec. 4.2, GPU parts (2)-(4)); false: at plan time, with no prediction on the GPU (an ablation)
    after_resident: bool = True
    #: charge the prediction's GPU time (the next layer's attention and gate); false: it takes none, the
    #: prefetches still wait for the resident experts (an ablation; acts only with after_resident)
    predict_cost: bool = True
    _layers: int = 0
    _predict_memo: tuple[int, int, float] = (-1, -1, 0.0)

    def configure(self, ctx: RunContext) -> None:
        if self.per_token < 0:
            raise ConfigError(f"prefetch.per_token={self.per_token} is negative", field="prefetch.per_token",
                              fix="use 1 (each token's top prediction) or more, or 0 for the whole prediction")
        self._layers = ctx.model.num_layers
        self._predict_memo = (-1, -1, 0.0)

    @property
    def issued_per_layer(self) -> int | None:
        """``size``, the cap; None without one (size 0: each token's first ``per_token``, as many as the batch's
        tokens name)."""
        return self.size if self.size > 0 else None

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        predicted = view.predictors.get("pred_next_layer")
        if view.layer + 1 >= self._layers or not predicted:
            return []
        first = self.per_token or None  # 0: the whole prediction
        if len(predicted) == 1:  # one token: its prediction in order, unless it repeats an expert
            ranked = np.asarray(predicted[0][:first]).tolist()
            if len(set(ranked)) < len(ranked):
                ranked = ranked_predictions([predicted[0][:first]])
        else:
            ranked = ranked_predictions([p[:first] for p in predicted])
        return [(view.layer + 1, e) for e in (ranked[:self.size] if self.size else ranked)]

    def prediction_s(self, view: LayerView) -> float | None:
        """Seconds of this layer's next-layer prediction on the GPU, after its resident experts (Sec. 4.2's
        GPU part (3)); None where the prefetches go at plan time (the prefill, the last layer, the ablation).

        Reading of 004: Sec. 5.2 says the hidden states of the shared experts and the routed experts
        already on the GPU go through the next layer's attention (with its KV cache) and then its gate;
        Sec. 4.2's "the shared experts, attention, and gate of the next layer" lists the same chain, and
        a next-layer shared expert would follow that layer's attention, not feed its gate. So the
        prediction adds the next layer's attention and gate (``CostModel.attention``, which includes the
        gate, for this step's tokens and context); this layer's shared experts run anyway, before the
        resident experts. Kernel launches are left out: the runtime's ``kernels_per_layer`` counts all of a
        layer's non-expert kernels (pytorch-eager's 115 are 001 Sec. 2.3's 7,000 launches per token over 61
        layers, the MoE dispatch's included), and no source says how many of them the attention and gate
        are. The GPU pipeline of Sec. 4.2 is the decoding scheduler's (Sec. 4.1: prefill overlaps the next
        layer's loads with this layer's experts), so a prefill layer keeps plan-time prefetches with no
        prediction.
        """
        if not self.after_resident or view.phase != "decode" or view.layer + 1 >= self._layers:
            return None
        if not self.predict_cost:
            return 0.0
        tokens, context = view.tokens, view.context
        memo = self._predict_memo  # every layer of a step asks for the same figure
        if memo[0] == tokens and memo[1] == context:
            return memo[2]
        seconds = view.costs.attention(tokens, context)
        self._predict_memo = (tokens, context, seconds)
        return seconds


# ----------------------------------------------------------------------------- cache (Sec. 5.3)
@register_component
@dataclass
class ScoreHistoryCache(CachePolicy):
    """Evicts the lowest average router score over the last ``n`` iterations (004 Sec. 5.3).

    An iteration's score of an expert is its mean score over the tokens of that
    layer, inactive experts included. In-use protection: the system never
    offers an expert its current layer computes as a victim. The window is the
    ``n`` most recent iterations of the layer including the one being planned:
    its gate has run when the eviction is decided (Sec. 4.2, Fig. 9: the score
    bookkeeping runs on the CPU after the router).
    """

    name = "score-history"
    columns = ("scores",)
    requires = {"scores": "evictions rank experts by their recent scores"}
    #: the n iterations (forward passes) of score history per layer an eviction averages over (004 Sec. 5.3;
    #: the paper gives no value) (steps)
    n: int = 8
    _history: list[deque] = field(default_factory=list, repr=False)
    _sums: list[np.ndarray] = field(default_factory=list, repr=False)
    _seen: tuple[int, int] = (-1, -1)

    def configure(self, ctx: RunContext) -> None:
        if self.n < 1:
            raise ConfigError(f"n must be at least 1, got {self.n}", field="cache.n", fix="--set cache.n=8")
        self._history = [deque() for _ in ctx.capacity]
        self._sums = [np.zeros(ctx.model.num_experts) for _ in ctx.capacity]
        self._seen = (-1, -1)

    def observe(self, view: LayerView) -> None:
        if (view.step, view.layer) == self._seen or view.scores is None:
            return
        self._seen = (view.step, view.layer)
        scores = view.scores
        # one token's row is its own mean, kept as stored (float16, read only): the sums widen each of its
        # numbers to float64 exactly, as token_mean's copy would
        mean = scores[0] if scores.shape[0] == 1 else token_mean(scores)
        history, layer = self._history[view.layer], view.layer
        history.append(mean)
        self._sums[layer] += mean
        if len(history) > self.n:
            self._sums[layer] -= history.popleft()

    def touch(self, view: LayerView, used: list[int]) -> None:
        self.observe(view)  # in systems without observe hooks, layers with GPU experts still count

    def average(self, layer: int) -> np.ndarray:
        return self._sums[layer] / max(len(self._history[layer]), 1)

    def _average_of(self, layer: int, experts: list[int]) -> list[float]:
        """:meth:`average` of just ``experts`` (the same quotients; a decision ranks a few experts of many)."""
        count = max(len(self._history[layer]), 1)
        return [total / count for total in self._sums[layer].take(experts).tolist()]

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        candidates = list(view.cache.resident[layer].difference(protected))  # ranked below by a total order
        if not candidates:
            return []
        ranked = zip(self._average_of(layer, candidates), candidates)  # (average, id)
        if n == 1:
            return [min(ranked)[1]]
        return [e for _, e in sorted(ranked)[:n]]

    def admission_order(self, view: LayerView, layer: int, missing: list[int]) -> list[int]:
        if len(missing) < 2:
            return list(missing)
        return [e for _, e in sorted(zip([-a for a in self._average_of(layer, missing)], missing))]


@register_component
@dataclass
class StaticFirstCache(CachePolicy):
    """The first experts of every layer stay resident and nothing is evicted (004 Sec. 6.3 baseline)."""

    name = "static-first"


# ----------------------------------------------------------------------------- balancer (Alg. 2)
def two_pointer(counts: dict[int, int], t_load: float, cpu_time, load_head_start: float = 0.0
                ) -> tuple[list[int], list[int]]:
    """Alg. 2 of 004: (experts to load, experts for the CPU); ``cpu_time(tokens)`` gives B_i * t_cpu."""
    order = sorted(sorted(counts), key=counts.__getitem__, reverse=True)  # tokens descending, then id (stable)
    return pointer_rounds(order, t_load, [cpu_time(counts[e]) for e in order], load_head_start)


def pointer_rounds(order: list[int], t_load: float, cpu_times: list[float], load_head_start: float = 0.0
                   ) -> tuple[list[int], list[int]]:
    """Alg. 2's rounds over experts in ``order`` (most tokens first), ``cpu_times`` each one's CPU time: the
    link takes the next from the head while it is ahead of the CPU, else the CPU takes the next from the
    tail."""
    load, cpu = [], []
    c_load, c_cpu = load_head_start, 0.0
    left, right = 0, len(order) - 1
    while left <= right:
        if c_load <= c_cpu:
            c_load += t_load
            load.append(order[left])
            left += 1
        else:
            c_cpu += cpu_times[right]
            cpu.append(order[right])
            right -= 1
    return load, cpu


@register_component
@dataclass
class TwoPointerBalancer(Assignment):
    """CPU-load balancer (004 Sec. 5.4, Alg. 2) for the experts not on the GPU.

    Generalisations, both exact for the paper's linear CPU model: the CPU time of
    B tokens is the profile's curve ``cpu_expert(B)`` rather than ``B * t_cpu``,
    and the load pointer starts at the time until a copy engine takes this layer's
    first load: the end of the earliest prefetch on the wire (none while an engine
    is idle). Prefetches still queued do not count: Sec. 5.2 clears them once the
    gate has run, and a demand load overtakes them anyway (with
    ``engine.copy_chunk_bytes`` it may overtake the running one sooner, not counted).
    Decoding only: in the prefill every routed expert is loaded and computed on
    the GPU (004 Sec. 4, Online inference: CPU computation "is less efficient than
    loading them into GPU memory" once each expert has many tokens).
    """

    name = "two-pointer"
    _cpu_times: PerTokens | None = field(default=None, repr=False)
    _copy_engines: int = field(default=1, repr=False)

    def configure(self, ctx: RunContext) -> None:
        self._copy_engines = ctx.costs.profile.pcie.copy_engines

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        if view.phase != "decode":
            return list(view.active), []
        layer = view.layer
        resident, in_flight = view.cache.resident[layer], view.cache.in_flight[layer]
        on_gpu = resident | in_flight if in_flight else resident  # read only
        active, counts = view.active, view.counts
        gpu = [e for e in active if e in on_gpu]
        if len(gpu) == len(active):
            return gpu, []
        # the link is free for a load when the first copy on the wire ends (queued prefetches are overtaken or
        # dropped, Sec. 5.2); with fewer copies in flight than engines one is idle now
        arrivals = view.arrivals
        pending = min(arrivals.values()) - view.now if len(arrivals) >= self._copy_engines else 0.0
        cpu_times = self._cpu_times = PerTokens.of(self._cpu_times, view.costs, _cpu_expert)
        if counts[0] == counts[-1]:  # one token count (every decode layer of one request): ids ascending
            rest = sorted(e for e in active if e not in on_gpu)
            load, cpu = pointer_rounds(rest, view.costs.expert_load, [cpu_times[counts[0]]] * len(rest),
                                       max(pending, 0.0))
        else:
            rest = {e: n for e, n in zip(active, counts) if e not in on_gpu}
            load, cpu = two_pointer(rest, view.costs.expert_load, cpu_times.__getitem__, max(pending, 0.0))
        return gpu + load, cpu


def _cpu_expert(costs: CostModel, tokens: int) -> float:
    return costs.cpu_expert(tokens)


class ImportanceSystem(ObservingSystem):
    """Clears the prefetch queue when a layer's real gate has run (004 Sec. 5.2), then loads what it needs;
    with the ``top-score`` prefetch, times its prefetches after the layer's resident GPU experts and the
    prediction (:meth:`TopScorePrefetch.prediction_s`, 004 Sec. 4.2)."""

    def _place(self, view: LayerView) -> LayerPlan:
        plan = super()._place(view)
        plan.cancel_queued_prefetches = bool(getattr(self.prefetch, "clear_queue", False))
        if isinstance(self.prefetch, TopScorePrefetch):  # another prefetch swapped in keeps plan-time timing
            plan.prefetch_after_predict = self.prefetch.prediction_s(view)
        return plan


register_system("importance", SystemSpec(
    "Importance-driven scheduling (004): expert-cache router, top-score next-layer prefetch, score-history "
    "eviction with in-use protection, two-pointer CPU-load balancer",
    cache="score-history", assign="two-pointer", prefetch="top-score", substitute="importance-router",
    system_class=ImportanceSystem, runtime="pytorch-eager"))
