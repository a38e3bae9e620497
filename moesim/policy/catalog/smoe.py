"""SMoE: hybrid CPU/GPU MoE inference with dynamic expert caching (000_dba2fecbbc66318b.txt).

Systems:

* ``smoe``: prefill places each expert by the rule of Alg. 1 (GPU when
  ``T_CPU(e) > T_GPU(e) + T_PCIe``) and streams the GPU experts through the
  engine's two staging buffers (the ping-pong pipeline of Alg. 1 / Fig. 7);
  decode applies the same rule with T_PCIe zero for a cached expert and
  infinite for a miss (SMoE never loads on demand while decoding, Sec. IV-C),
  so hits run on the GPU wherever it is the faster device and misses on the
  CPU; it starts from a cache of the experts each layer used most in the
  prefill (Sec. IV-E) and refreshes it with token-wise prefetch (Sec. IV-D)
  under Fixed-N LFU eviction (the setting of Sec. VI-D), two experts per layer
  (Table I).
* ``smoe-flex``: the same, with prefetch switched off on the half of the layers
  where the token-wise predictor is least accurate and three experts prefetched
  on the others (Sec. IV-D, VI-D, VI-F).

Timing of the decode cache updates (Sec. IV-E): token-wise prefetches enter
the transfer queue once the layer's GPU experts have finished
(``LayerPlan.prefetch_after_gpu``) and have the rest of the forward pass,
until the same layer of the next token, to arrive. The decode cache is filled
when the prefill ends (Sec. IV-E: the slots are allocated only then and take
the layer's most activated prefill experts as the first cache): the plan of a
prefill pass's last layer queues, for every layer, its most used prefill
experts, after that layer's GPU work; these fill transfers count as
prefetches. Prompts prefilled back to back (000 runs one request at a time)
are one prefill: their counts add up until a decode step. Token-wise prefetch
runs from the first decode step on.

Cache size: Sec. IV-E sizes the decode cache by the GPU memory left over; the
eight experts per layer of Sec. VI-D are what a 24 GB RTX 4090 left beside
4-bit DeepSeek-V3 (Sec. IV-D). moesim takes the slots its memory plan leaves on
the replayed profile; ``cache.slots_per_layer=8`` sets the paper's.

The predictor (Sec. IV-D: an MLP shaped like the MoE gate; Sec. IV-E: started
on the GPU as soon as the layer's attention output is there) is charged on
every decode layer that predicts, as ``predict`` time (Sec. VI-E's
``predict_time``), ahead of the layer's experts on both devices (the plan,
and with it the CPU thread, waits for it; Fig. 13 stacks it into the layer's
time, 000 does not say whether it overlaps the gate): by default the roofline
time of a gate-shaped GEMV (hidden x experts, bf16) on the profile's GPU plus
two kernel launches (the linear layer and its top-k); the paper calls it
negligible and gives no figure, so ``prefetch.predict_us`` overrides it.

Prefetch count per layer (``prefetch.n``) follows Table I / Sec. VI-D: 2 on
DeepSeek-V3, 3 on Qwen3 (Sec. VI-D puts the larger count down to Qwen3's
smaller experts; moesim gives 3 to every Qwen3 model by name); other models
take 2, noted. SMoE-Flex prefetches 3 (Sec. VI-F, Fig. 15, stated for
DeepSeek-V3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.hw.cost import roofline_s
from moesim.model.spec import ModelSpec
from moesim.policy.assign import Assignment
from moesim.policy.base import LayerPlan, LayerView, PerTokens, RunContext, expert_times, split_plan
from moesim.policy.cache import CachePolicy
from moesim.policy.prefetch import Prefetch, ranked_predictions
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system

EVICTION_MODES = ("fixed", "adaptive")


# ----------------------------------------------------------------------------- cache
@register_component
@dataclass
class SMoELFUCache(CachePolicy):
    """Least-frequently-used eviction with counts of every routed token (000 Sec. IV-E).

    SMoE records expert activation frequencies in the prefill and keeps
    collecting them during decoding; victims are the resident experts with the
    fewest activations (ties, on which 000 is silent: the one routed longest
    ago, then the lower id). The cache starts empty: SMoE allocates and fills
    its slots only after the prefill.

    Never victims: an expert arriving, and the experts the current layer
    computes on the GPU. 000 replaces experts once the layer's GPU work is done,
    when those are free again; moesim's plan evicts when it is made, before
    that work, so it keeps them (they have just been counted, so they are
    rarely the least frequent anyway).
    """

    name = "smoe-lfu"
    #: per layer, each expert's eviction order (activation count, the observation that last routed to it,
    #: id), kept as the counts change: plain lists, since a layer touches its top-k experts only, where
    #: numpy's per-call overhead would exceed the work
    _order: list[list[tuple[int, int, int]]] = field(default_factory=list, repr=False)
    _clock: int = 0

    def configure(self, ctx: RunContext) -> None:
        layers, experts = ctx.model.num_layers, ctx.model.num_experts
        self._order = [[(0, 0, e) for e in range(experts)] for _ in range(layers)]
        self._clock = 0

    def initial(self, layer: int, capacity: int) -> list[int]:
        return []

    def observe(self, view: LayerView) -> None:
        """Count this layer's activations (every phase, every device)."""
        self._clock += 1
        clock, order = self._clock, self._order[view.layer]
        if view.experts.size == len(view.active):  # one token each (a decode layer of one request)
            for expert in view.active:
                order[expert] = (order[expert][0] + 1, clock, expert)
            return
        for expert, tokens in zip(view.active, view.counts):
            order[expert] = (order[expert][0] + tokens, clock, expert)

    def frequency(self, layer: int, expert: int) -> int:
        return self._order[layer][expert][0]

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        resident = view.cache.resident[layer]
        candidates = resident.difference(protected) if protected else resident
        # least frequent, then least recent, then lowest id
        return sorted(candidates, key=self._order[layer].__getitem__)[:n]


# ----------------------------------------------------------------------------- assignment
@register_component
@dataclass
class SMoEAssign(Assignment):
    """The expert allocation rule of 000 Alg. 1, lines 1-6: GPU when ``T_CPU(e) > T_GPU(e) + T_PCIe``.

    ``T_PCIe`` is zero for a resident expert, the remaining transfer time for
    one in flight, one expert load in the prefill (on-demand loading, Sec. IV-B)
    and infinite in decoding, where SMoE never loads on demand (Sec. IV-C: the
    transfer latency would dominate) and computes cache misses on the CPU.
    ``T_GPU`` includes the kernel launches the engine charges.

    Sec. IV-B words the same choice as a count: the top-``K`` experts by load
    go to the GPU, ``K`` chosen so that their GPU and PCIe time stays below
    their CPU time. Line 3 tests each expert on its own, with one copy each, as
    printed; the experts it picks are those with a positive saving
    ``T_CPU - T_GPU - T_PCIe``, which (the saving growing with the tokens) are
    a head of the load ranking and the ``K`` of largest total saving.
    ``queue_aware`` instead counts the copies queued ahead of each expert.
    ``G`` is kept in load order, most tokens first (the view's order), so the
    ping-pong pipeline copies the heaviest expert first.
    """

    name = "smoe"
    #: load missing experts on demand in decoding too (the paper does not)
    decode_on_demand: bool = False
    #: T_PCIe counts the copies queued ahead of an expert (this layer's loads in flight and the experts
    #: already given to the GPU, most tokens first) instead of one expert's copy alone
    queue_aware: bool = False
    #: (GPU kernel, CPU) seconds by token count, kept between layers
    _times: PerTokens | None = field(default=None, repr=False)

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        times = self._times
        if times is None or times.costs is not view.costs:  # PerTokens.of, inline: it runs every layer
            times = self._times = PerTokens(view.costs, expert_times)
        if view.phase == "prefill" or self.decode_on_demand:
            return self._split_loading(view, times)
        # decoding: T_PCIe is 0 for a resident expert, the rest of its copy for one in flight, and infinite for
        # a miss, which runs on the CPU
        gpu, cpu = [], []
        launch, now, arrivals = view.expert_launch_s, view.now, view.arrivals
        resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
        if view.experts.size == len(view.active):  # one token each (a decode layer of one request)
            t_gpu, t_cpu = times[1]
            hit_on_gpu = t_cpu > t_gpu + launch  # the test below for every resident expert (T_PCIe 0)
            for expert in view.active:
                if expert in resident:
                    (gpu if hit_on_gpu else cpu).append(expert)
                elif expert in in_flight and t_cpu > t_gpu + launch + max(arrivals.get(expert, now) - now, 0.0):
                    gpu.append(expert)
                else:
                    cpu.append(expert)
            return gpu, cpu
        for expert, tokens in zip(view.active, view.counts):
            if expert in resident:
                transfer = 0.0
            elif expert in in_flight:
                transfer = max(arrivals.get(expert, now) - now, 0.0)
            else:
                cpu.append(expert)
                continue
            t_gpu, t_cpu = times[tokens]
            if t_cpu > t_gpu + launch + transfer:  # T_GPU: kernel and launches
                gpu.append(expert)
            else:
                cpu.append(expert)
        return gpu, cpu

    def _split_loading(self, view: LayerView, times: PerTokens) -> tuple[list[int], list[int]]:
        """:meth:`split` where a missing expert is loaded (the prefill, or decoding with ``decode_on_demand``)."""
        gpu, cpu = [], []
        queue_aware, load = self.queue_aware, view.costs.expert_load
        queued = self._queue_s(view) if queue_aware else 0.0
        launch, now, arrivals = view.expert_launch_s, view.now, view.arrivals
        resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
        for expert, tokens in zip(view.active, view.counts):
            # T_PCIe: 0 resident, the rest of its copy in flight, else one expert load
            if expert in resident:
                transfer = 0.0
            elif expert in in_flight:
                transfer = max(arrivals.get(expert, now) - now, 0.0)
            else:
                transfer = load
            copies = queue_aware and transfer == load
            if copies:
                transfer += queued  # the copies queued ahead of it
            t_gpu, t_cpu = times[tokens]
            if t_cpu > t_gpu + launch + transfer:  # T_GPU: kernel and launches
                gpu.append(expert)
                if copies:
                    queued += load
            else:
                cpu.append(expert)
        return gpu, cpu

    @staticmethod
    def _queue_s(view: LayerView) -> float:
        """Time until this layer's loads already in flight have arrived."""
        return max([0.0] + [at - view.now for at in view.arrivals.values()])


# ----------------------------------------------------------------------------- prefetch
def token_predictor_accuracy(path: str, num_layers: int, top_k: int) -> np.ndarray:
    """Per layer: mean fraction of a decode token's next-token experts that ``pred_next_token`` names.

    Without the column the history predictor (the next token repeats this
    token's experts) is scored instead. Layers without decode pairs score 0.
    """
    import pyarrow.parquet as pq
    import pandas as pd

    from moesim.trace.io import arrow_source
    trace = pq.ParquetFile(arrow_source(path))
    columns = ["request", "position", "layer", "phase", "experts"]
    has_pred = "pred_next_token" in trace.schema_arrow.names
    table = trace.read(columns=columns + (["pred_next_token"] if has_pred else []))
    request = table.column("request").to_numpy()
    position = table.column("position").to_numpy()
    layer = table.column("layer").to_numpy()
    phase = np.asarray(table.column("phase").to_pylist())
    experts = table.column("experts").combine_chunks().flatten().to_numpy().reshape(-1, top_k)
    preds = table.column("pred_next_token").to_pylist() if has_pred else experts.tolist()
    here = pd.MultiIndex.from_arrays([request, position, layer])
    target = here.get_indexer(pd.MultiIndex.from_arrays([request, position + 1, layer]))
    total = np.zeros(num_layers)
    pairs = np.zeros(num_layers)
    for row in np.flatnonzero((target >= 0) & (phase == "decode")):
        truth = set(experts[target[row]].tolist())
        total[layer[row]] += len(truth.intersection(preds[row] or [])) / top_k
        pairs[layer[row]] += 1
    return np.divide(total, pairs, out=np.zeros(num_layers), where=pairs > 0)


#: experts prefetched per layer and step in 000 Table I (Sec. VI-D), by model name prefix
PAPER_PREFETCH_N = {"deepseek-v3": 2, "qwen3": 3}
#: calibration value that ranks SMoE-Flex layers on the replayed trace itself (clairvoyant)
SELF = "self"


def paper_prefetch_n(model_name: str) -> int | None:
    """000 Table I's prefetch count for a model (None when the paper did not run it)."""
    for prefix, n in PAPER_PREFETCH_N.items():
        if model_name.lower().startswith(prefix):
            return n
    return None


def predictor_s(view: LayerView, kernels: int = 2) -> float:
    """GPU time of the token-wise predictor, an MLP shaped like the MoE gate (000 Sec. IV-D): a
    hidden x experts bf16 GEMV over the layer's tokens at the profile's roofline, plus its launches."""
    costs = view.costs
    gpu, model = costs.profile.gpu, costs.model
    params = model.hidden_size * model.num_experts
    return roofline_s(2.0 * view.tokens * params, 2.0 * params, gpu.peak_tflops["bf16"], gpu.roofline_efficiency,
                      gpu.mem_bandwidth_gbps, gpu.effective_bandwidth_efficiency) + costs.launches(kernels)


@dataclass
class OnlineAccuracy:
    """Per layer, how often the token-wise predictor named a decode token's experts one token ahead:
    each token's prediction is scored against what its request's next token routes at that layer."""

    hits: np.ndarray
    pairs: np.ndarray
    _last: dict[tuple[int, int], set[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, num_layers: int) -> "OnlineAccuracy":
        return cls(np.zeros(num_layers), np.zeros(num_layers))

    def record(self, view: LayerView, predicted_rows: list[np.ndarray]) -> None:
        requests = view.requests.tolist() if view.requests is not None else [0] * view.tokens
        top_k = view.experts.shape[1]
        for row, request in enumerate(requests):
            key = (request, view.layer)
            before = self._last.get(key)
            if before is not None:
                self.hits[view.layer] += len(before.intersection(view.experts[row].tolist())) / top_k
                self.pairs[view.layer] += 1
            if row < len(predicted_rows):
                self._last[key] = set(np.asarray(predicted_rows[row]).tolist())

    def accuracy(self) -> np.ndarray:
        return np.divide(self.hits, self.pairs, out=np.zeros_like(self.hits), where=self.pairs > 0)


def least_accurate(accuracy: np.ndarray, fraction: float) -> list[int]:
    """The ``floor(fraction * layers)`` layers of lowest accuracy (ties: lower layer first), sorted."""
    off = int(math.floor(fraction * len(accuracy)))
    return sorted(np.lexsort((np.arange(len(accuracy)), accuracy))[:off].tolist())


@register_component
@dataclass
class TokenWisePrefetch(Prefetch):
    """Token-wise prefetch (000 Sec. IV-D, IV-E): at each decode layer, load the experts the predictor
    expects this layer to use at the *next* token, giving the transfer a whole forward pass.

    ``eviction=fixed`` (Fixed-N): the ``n`` best-ranked predicted experts not yet
    cached are loaded every step, replacing the ``n`` least frequently used;
    ``eviction=adaptive``: only those of the top-``n`` predictions that are not
    cached are loaded (0 to ``n`` transfers). Victims come from the system's cache
    policy (LFU in SMoE): a cached expert that the predictor names is not kept
    for that (Sec. IV-E replaces the least frequently activated, predicted or
    not). An expert arriving counts as cached. 000's predictor scores every
    expert, so Fixed-N always finds ``n``; a trace's ``pred_next_token`` lists
    only so many, and when fewer than ``n`` of them are uncached, fewer move.
    ``n=-1`` takes 000 Table I's count for the model; ``n=0`` runs the
    predictor and loads nothing (Fig. 14's 0).

    ``flex_off_fraction`` > 0 is SMoE-Flex: prefetch (and prediction) is off on
    that fraction of layers, the ones where the predictor is least accurate
    (000 switches prefetch off there, Sec. VI-D; the predictor goes with it, as
    nothing on those layers reads it). The
    ranking comes from ``calibration``: a trace path (held out, as the paper trains
    and tunes on samples excluded from its experiments, Sec. IV-D); ``self``: the
    replayed trace itself (clairvoyant, flagged in the notes); empty (default):
    measured online over the first ``warmup`` decode steps, during which every
    layer prefetches.

    Without a ``pred_next_token`` column the history predictor stands in (the
    next token is predicted to use this token's experts) and the notes say so.
    """

    name = "smoe-token"
    any_negative = ("predict_us",)
    phases = ("decode",)
    columns = ("pred_next_token",)
    #: experts prefetched per layer and step (-1: 000 Table I's, 2 for DeepSeek-V3, 3 for Qwen3; 0: the
    #: predictor runs and nothing is prefetched, Fig. 14's 0; Fig. 14's -1, the initial cache alone, is
    #: prefetch=none)
    n: int = -1
    #: "fixed" (Fixed-N) or "adaptive" (000 Sec. IV-E; Sec. VI-D's experiments all use fixed)
    eviction: str = "fixed"
    #: SMoE-Flex: fraction of layers (least accurate predictor first) with prefetch off (000 Sec. IV-D, VI-D:
    #: "half of the layers", the smoe-flex system's 0.5)
    flex_off_fraction: float = 0.0
    #: SMoE-Flex layer ranking: a trace path, "self" (the replayed trace, clairvoyant) or "" (online warm-up)
    calibration: str = ""
    #: SMoE-Flex with online ranking: decode steps measured before the least accurate layers switch off (000
    #: does not say how it ranks layers; moesim measures them online unless a calibration trace is given; 16
    #: is moesim's choice, 000 gives no figure) (steps)
    warmup: int = 16
    #: critical-path cost of the cache update per prefetching layer (000 Sec. VI-E: about 0.01 ms)
    management_us: float = 10.0
    #: predictor time per predicting decode layer, microseconds (negative: a gate-shaped GEMV on the profile's GPU)
    predict_us: float = -1.0
    #: ``n`` for this run (-1 resolved to the model's Table I count)
    _n: int = 0
    _history: bool = False
    _disabled: frozenset[int] = frozenset()
    _online: OnlineAccuracy | None = field(default=None, repr=False)
    _decode_steps: int = 0
    _notes: list[str] = field(default_factory=list, repr=False)
    _predict_s: dict[int, float] = field(default_factory=dict, repr=False)

    def for_model(self, model: ModelSpec) -> None:
        # resolved before the memory plan too: a system's prefetch buffer is sized from issued_per_layer
        self._n = self.n
        if self.n == -1:
            paper = paper_prefetch_n(model.name)
            self._n = paper if paper is not None else PAPER_PREFETCH_N["deepseek-v3"]

    def configure(self, ctx: RunContext) -> None:
        self._predict_s = {}
        if self.eviction not in EVICTION_MODES:
            raise ConfigError(f"unknown eviction mode '{self.eviction}'", field="prefetch.eviction",
                              fix=f"use one of {', '.join(EVICTION_MODES)}")
        if self.n < -1:
            raise ConfigError(f"prefetch.n={self.n} is negative", field="prefetch.n",
                              fix="use 0 or more (-1: the paper's count for the model)")
        self.for_model(ctx.model)  # resolved per run: a system configured again for another model takes its count
        if self.n == -1 and paper_prefetch_n(ctx.model.name) is None:
            ctx.notes.append(f"smoe-token: 000 Table I gives no prefetch count for {ctx.model.name}; "
                             f"using DeepSeek-V3's {self._n} (set prefetch.n)")
        short = [slots for slots in ctx.capacity if slots < self._n]
        if short:  # the rest of n has nowhere to go: a larger n changes nothing there
            ctx.notes.append(f"smoe-token: {len(short)} of {len(ctx.capacity)} layers hold fewer slots than "
                             f"prefetch.n={self._n} (fewest {min(short)}): each prefetches at most its slots per step")
        if not 0.0 <= self.flex_off_fraction < 1.0:
            raise ConfigError(f"flex_off_fraction={self.flex_off_fraction} outside [0, 1)",
                              field="prefetch.flex_off_fraction", fix="use e.g. 0.5")
        if self.warmup < 1:
            raise ConfigError(f"prefetch.warmup={self.warmup} below 1", field="prefetch.warmup", fix="use e.g. 16")
        self._history = "pred_next_token" not in ctx.columns
        if self._history:
            ctx.notes.append("smoe-token: the trace has no pred_next_token column; a history predictor stands "
                             "in (the next token is predicted to reuse this token's experts at each layer)")
        self._disabled, self._online, self._decode_steps = frozenset(), None, 0
        if self.flex_off_fraction > 0:
            if self.calibration:
                self._disabled = frozenset(self._flex_layers(ctx))
            else:
                self._online = OnlineAccuracy.of(ctx.model.num_layers)
                ctx.notes.append(f"smoe-flex: layers ranked by the predictor's accuracy over the first "
                                 f"{self.warmup} decode steps (set prefetch.calibration=PATH for a held-out trace)")
        self._notes = ctx.notes

    def _flex_layers(self, ctx: RunContext) -> list[int]:
        clairvoyant = self.calibration == SELF
        path = ctx.trace_path if clairvoyant else self.calibration
        if path is None:
            raise ConfigError("SMoE-Flex needs a trace to rank layers by predictor accuracy",
                              field="prefetch.calibration", fix="give a calibration trace path")
        accuracy = token_predictor_accuracy(path, ctx.model.num_layers, ctx.model.top_k)
        layers = least_accurate(accuracy, self.flex_off_fraction)
        source = "the replayed trace itself (clairvoyant)" if clairvoyant else path
        ctx.notes.append(f"smoe-flex: prefetch off on {len(layers)} of {ctx.model.num_layers} layers with the "
                         f"least accurate token-wise predictor on {source}: {layers}")
        return layers

    @property
    def count(self) -> int:
        """Experts prefetched per layer and step in this run (``n``, or Table I's for the model when -1)."""
        return self._n

    @property
    def issued_per_layer(self) -> int | None:
        """``count``: Fixed-N loads that many each prefetching layer, adaptive at most that many."""
        return self._n if self._n >= 0 else None

    def predicts(self, layer: int) -> bool:
        """Whether the predictor runs at ``layer``: everywhere but SMoE-Flex's switched-off layers, ``n=0``
        included (000 Fig. 14: 0 is prediction without prefetch)."""
        return layer not in self._disabled

    def enabled(self, layer: int) -> bool:
        """Whether ``layer`` prefetches."""
        return self._n > 0 and layer not in self._disabled

    def predicted_rows(self, view: LayerView) -> list[np.ndarray]:
        return list(view.experts) if self._history else view.predictors.get("pred_next_token", [])

    def predicted(self, view: LayerView) -> list[int]:
        return ranked_predictions(self.predicted_rows(view))

    def predict_s(self, view: LayerView) -> float:
        if self.predict_us >= 0:
            return self.predict_us * 1e-6
        seconds = self._predict_s.get(view.tokens)  # the cost model is fixed for the run
        if seconds is None:
            seconds = self._predict_s[view.tokens] = predictor_s(view)
        return seconds

    def _warm_up(self, view: LayerView) -> None:
        """Online SMoE-Flex: score the predictor until the warm-up ends, then switch the worst layers off."""
        assert self._online is not None
        if view.layer == 0:
            self._decode_steps += 1
            if self._decode_steps > self.warmup:
                self._disabled = frozenset(least_accurate(self._online.accuracy(), self.flex_off_fraction))
                self._notes.append(f"smoe-flex: after {self.warmup} decode steps prefetch is off on "
                                   f"{len(self._disabled)} layers: {sorted(self._disabled)}")
                self._online = None
                return
        self._online.record(view, self.predicted_rows(view))

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        if view.phase != "decode":
            return []
        if self._online is not None:
            self._warm_up(view)
        layer = view.layer
        if self._n <= 0 or layer in self._disabled:  # not enabled(layer)
            return []
        ranked = ranked_predictions(self.predicted_rows(view))
        resident, in_flight = view.cache.resident[layer], view.cache.in_flight[layer]
        if self.eviction == "adaptive":
            return [(layer, e) for e in ranked[:self._n] if e not in resident and e not in in_flight]
        picks: list[tuple[int, int]] = []  # Fixed-N: the first n uncached, however far down the ranking
        for e in ranked:
            if e not in resident and e not in in_flight:
                picks.append((layer, e))
                if len(picks) == self._n:
                    break
        return picks


# ----------------------------------------------------------------------------- system
@dataclass
class SMoESystem(ComposedSystem):
    """Prefill by Alg. 1 with ping-pong streaming; decode with a prefill-filled cache and token-wise prefetch."""

    #: per layer, token counts of the prefill steps since the last decode step
    _fill: dict[int, dict[int, int]] = field(default_factory=dict)
    #: the cache policy's activation counter (LFU's), if it keeps one
    _observe: Callable[[LayerView], None] | None = field(default=None, repr=False, compare=False)
    #: SMoE's own components on per-layer quotas: a decode plan places the split's hits and the prefetches
    #: itself (:meth:`_decode_hits`), which is what the composed plan does for them, without its general cases
    _own_decode: bool = field(default=False, repr=False, compare=False)

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        self._fill = {}
        self._observe = getattr(self.cache, "observe", None)
        assign = self.assign
        self._own_decode = (type(self.cache) is SMoELFUCache and type(assign) is SMoEAssign
                            and not assign.decode_on_demand and type(self.prefetch) is TokenWisePrefetch
                            and ctx.pool is None)

    def _place(self, view: LayerView) -> LayerPlan:
        if self._observe is not None:
            self._observe(view)
        if view.phase == "prefill":
            plan = self._prefill(view)
            if view.layer == view.num_layers - 1:
                self._fill_cache(view, plan)
            return plan
        if self._fill:  # the next prefill starts a new count
            self._fill = {}
        return self._decode(view)

    def _prefill(self, view: LayerView) -> LayerPlan:
        """000 Alg. 1: GPU experts in load order, resident first, the rest streamed through two buffers."""
        gpu, cpu = self.assign.split(view)
        resident = view.cache.resident[view.layer]
        plan = LayerPlan(cpu=cpu)
        ready = [e for e in gpu if e in resident]
        arriving = sorted((e for e in gpu if e in view.cache.in_flight[view.layer]),
                          key=lambda e: view.arrivals.get(e, 0.0))
        plan.streamed = [e for e in gpu if not view.cache.has(view.layer, e)]
        plan.gpu = ready + arriving + plan.streamed
        self.cache.touch(view, plan.gpu)
        counts = self._fill.setdefault(view.layer, {})
        for expert, tokens in zip(view.active, view.counts):
            counts[expert] = counts.get(expert, 0) + tokens
        return plan

    def _decode(self, view: LayerView) -> LayerPlan:
        plan = self._decode_hits(view) if self._own_decode else super()._place(view)
        # Sec. IV-E: the prefetch task joins the asynchronous transfer queue when the layer's GPU
        # experts are done
        plan.prefetch_after_gpu = True
        prefetch = self.prefetch
        if isinstance(prefetch, TokenWisePrefetch) and prefetch.predicts(view.layer):
            plan.overhead_s["predict"] = prefetch.predict_s(view)
            if plan.prefetches and prefetch.management_us:
                plan.overhead_s["cache_management"] = prefetch.management_us * 1e-6
        return plan

    def _decode_hits(self, view: LayerView) -> LayerPlan:
        """A decode layer's plan as ``ComposedSystem._place`` makes it for SMoE's components, one step at a
        time: Alg. 1's split sends only hits (resident or arriving) to the GPU, so nothing is loaded on
        demand; the GPU runs the resident ones first, then those arriving, by arrival; token-wise prefetch
        (Fixed-N) loads its picks into the layer's free slots and evicts the least frequently used for
        the rest."""
        gpu, cpu = self.assign.split(view)
        plan = split_plan(gpu, cpu)
        layer, state = view.layer, view.cache
        in_flight = state.in_flight[layer]
        if in_flight and gpu:
            resident = state.resident[layer]
            ready = [e for e in gpu if e in resident]
            if len(ready) < len(gpu):
                arrivals = view.arrivals
                plan.gpu = ready + sorted((e for e in gpu if e not in resident),
                                          key=lambda e: arrivals.get(e, 0.0))
        wanted = self.prefetch.candidates(view)  # none cached: none resident, arriving or on the GPU
        if wanted:
            free = max(state.capacity[layer] - len(state.resident[layer]) - len(in_flight), 0)
            short = len(wanted) - free
            if short > 0:  # never a victim: an expert computed on the GPU here (the wanted and the arriving
                # ones are not resident, so no victims either)
                victims = self.cache.victims(view, layer, short, set(plan.gpu))
                plan.evictions = [(layer, e) for e in victims]
                wanted = wanted[:free + len(victims)]  # the rest find no slot
            plan.prefetches = wanted
        return plan

    def _fill_cache(self, view: LayerView, plan: LayerPlan) -> None:
        """Sec. IV-E, once the prefill ends: every layer's slots take its most used prefill experts,
        queued after this last layer's GPU work; LFU picks the victims of a layer already holding others.

        A plan cannot see whether another prefill step follows, so every prefill step fills; prompts
        prefilled back to back (then decoded together) count as one prefill: each fill ranks the
        counts of every prefill step since the last decode step, and the last one leaves the cache
        of all of them."""
        state = view.cache
        for layer, counts in sorted(self._fill.items()):
            top = sorted(counts, key=lambda e: (-counts[e], e))[:state.capacity[layer]]
            missing = [e for e in top if not state.has(layer, e)]
            room = state.free(layer)
            if len(missing) > room:
                protected = set(top) | state.in_flight[layer]
                if layer == view.layer:
                    protected |= set(plan.gpu)
                victims = self.cache.victims(view, layer, len(missing) - room, protected)
                plan.evictions += [(layer, e) for e in victims]
                room += len(victims)
            plan.prefetches += [(layer, e) for e in missing[:max(room, 0)]]
        plan.prefetch_after_gpu = True


register_system("smoe", SystemSpec(
    "SMoE (000): prefill by T_CPU > T_GPU + T_PCIe with ping-pong streaming (Alg. 1); decode with a "
    "prefill-filled LFU cache and token-wise prefetch, Fixed-N, 2 experts (3 on Qwen3) per layer (Sec. IV-D, IV-E, "
    "Table I)",
    cache="smoe-lfu", assign="smoe", prefetch="smoe-token", system_class=SMoESystem,
    runtime="ktransformers-eager"))
register_system("smoe-flex", SystemSpec(
    "SMoE-Flex (000 Sec. IV-D, VI-D): SMoE with token-wise prefetch off on the half of the layers where the "
    "predictor is least accurate (ranked online over the first decode steps, or on prefetch.calibration) and 3 "
    "experts prefetched on the rest",
    cache="smoe-lfu", assign="smoe", prefetch="smoe-token", system_class=SMoESystem,
    defaults=(("prefetch.n", "3"), ("prefetch.flex_off_fraction", "0.5")), runtime="ktransformers-eager"))
