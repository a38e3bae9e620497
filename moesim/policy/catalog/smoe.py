"""SMoE: hybrid CPU/GPU MoE inference with dynamic expert caching (000_dba2fecbbc66318b.txt).

Systems:

* ``smoe``: prefill places each expert by the rule of Alg. 1 (GPU when
  ``T_CPU(e) > T_GPU(e) + T_PCIe``) and streams the GPU experts through the
  engine's two staging buffers (the ping-pong pipeline of Alg. 1 / Fig. 7);
  decode computes resident experts on the GPU and the rest on the CPU, starts
  from a cache of the experts each layer used most in the prefill (Sec. IV-E),
  and refreshes it with token-wise prefetch (Sec. IV-D) under Fixed-N LFU
  eviction (the setting of Sec. VI-D), two experts per layer (Table I).
* ``smoe-flex``: the same, with prefetch switched off on the half of the layers
  where the token-wise predictor is least accurate and three experts prefetched
  on the others (Sec. IV-D, VI-D, VI-F).

Timing of the decode cache updates (Sec. IV-E): token-wise prefetches enter
the transfer queue once the layer's GPU experts have finished
(``LayerPlan.prefetch_after_gpu``) and have the rest of the forward pass,
until the same layer of the next token, to arrive. The initial decode
cache is filled by prefetches issued at the first decode step of each layer,
right after the prefill (Sec. IV-E fills the slots "once the prefilling
ends"); token-wise prefetch skips that one layer-step, and these fill
transfers count as prefetches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.policy.assign import Assignment
from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.cache import CachePolicy
from moesim.policy.prefetch import NoPrefetch, Prefetch
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system

EVICTION_MODES = ("fixed", "adaptive")


# ----------------------------------------------------------------------------- cache
@register_component
@dataclass
class SMoELFUCache(CachePolicy):
    """Least-frequently-used eviction with counts of every routed token (000 Sec. IV-E).

    SMoE records expert activation frequencies in the prefill and keeps
    collecting them during decoding; victims are the resident experts with the
    fewest activations (ties: least recently used, then lower id). The cache
    starts empty: SMoE allocates and fills its slots only after the prefill.
    """

    name = "smoe-lfu"
    _freq: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False)
    _stamp: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False)
    _clock: int = 0

    def configure(self, ctx: RunContext) -> None:
        shape = (ctx.model.num_layers, ctx.model.num_experts)
        self._freq = np.zeros(shape, dtype=np.int64)
        self._stamp = np.zeros(shape, dtype=np.int64)
        self._clock = 0

    def initial(self, layer: int, capacity: int) -> list[int]:
        return []

    def observe(self, view: LayerView) -> None:
        """Count this layer's activations (every phase, every device)."""
        self._freq[view.layer, view.active] += view.counts
        self._clock += 1
        self._stamp[view.layer, view.active] = self._clock

    def frequency(self, layer: int, expert: int) -> int:
        return int(self._freq[layer, expert])

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        freq, stamp = self._freq[layer], self._stamp[layer]
        candidates = [e for e in view.cache.resident[layer] if e not in protected]
        candidates.sort(key=lambda e: (freq[e], stamp[e], e))
        return candidates[:n]


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
    """

    name = "smoe"
    #: load missing experts on demand in decoding too (the paper does not)
    decode_on_demand: bool = False

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        gpu, cpu = [], []
        for expert, tokens in zip(view.active, view.counts):
            (gpu if self.prefers_gpu(view, expert, tokens) else cpu).append(expert)
        return gpu, cpu

    def prefers_gpu(self, view: LayerView, expert: int, tokens: int) -> bool:
        costs = view.costs
        t_cpu = costs.cpu_expert(tokens)
        t_gpu = costs.gpu_expert(tokens) + view.expert_launch_s
        return t_cpu > t_gpu + self.transfer_s(view, expert)

    def transfer_s(self, view: LayerView, expert: int) -> float:
        if view.resident(expert):
            return 0.0
        if expert in view.cache.in_flight[view.layer]:
            return max(view.arrivals.get(expert, view.now) - view.now, 0.0)
        if view.phase == "prefill" or self.decode_on_demand:
            return view.costs.expert_load
        return math.inf


# ----------------------------------------------------------------------------- prefetch
def ranked_predictions(rows: list[np.ndarray]) -> list[int]:
    """Experts predicted for a layer, by how many tokens predict them, then best rank, then id."""
    votes: dict[int, list[int]] = {}
    for row in rows:
        for rank, expert in enumerate(row.tolist()):
            entry = votes.setdefault(int(expert), [0, rank])
            entry[0] += 1
            entry[1] = min(entry[1], rank)
    return sorted(votes, key=lambda e: (-votes[e][0], votes[e][1], e))


def token_predictor_accuracy(path: str, num_layers: int, top_k: int) -> np.ndarray:
    """Per layer: mean fraction of a decode token's next-token experts that ``pred_next_token`` names.

    Without the column the history predictor (the next token repeats this
    token's experts) is scored instead. Layers without decode pairs score 0.
    """
    import pyarrow.parquet as pq
    import pandas as pd

    names = pq.ParquetFile(path).schema_arrow.names
    columns = ["request", "position", "layer", "phase", "experts"]
    has_pred = "pred_next_token" in names
    table = pq.read_table(path, columns=columns + (["pred_next_token"] if has_pred else []))
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


@register_component
@dataclass
class TokenWisePrefetch(Prefetch):
    """Token-wise prefetch (000 Sec. IV-D, IV-E): at each decode layer, load the experts the predictor
    expects this layer to use at the *next* token, giving the transfer a whole forward pass.

    ``eviction=fixed`` (Fixed-N): the ``n`` best-ranked predicted experts not yet
    cached are loaded every step, replacing the ``n`` least frequently used;
    ``eviction=adaptive``: only those of the top-``n`` predictions that are not
    cached are loaded (0 to ``n`` transfers). Victims come from the system's cache
    policy (LFU in SMoE). ``flex_off_fraction`` > 0 is SMoE-Flex: prefetch is off
    on that fraction of layers, the ones where the predictor is least accurate on
    the ``calibration`` trace (default: the replayed trace, flagged in the notes).

    Without a ``pred_next_token`` column the history predictor stands in (the
    next token is predicted to use this token's experts) and the notes say so.
    """

    name = "smoe-token"
    columns = ("pred_next_token",)
    #: experts prefetched per layer and step (000 Table I: 2 for DeepSeek-V3, 3 for Qwen3)
    n: int = 2
    #: "fixed" (Fixed-N) or "adaptive" (000 Sec. IV-E)
    eviction: str = "fixed"
    #: SMoE-Flex: fraction of layers (least accurate predictor first) with prefetch off
    flex_off_fraction: float = 0.0
    #: trace that ranks the layers by predictor accuracy (empty: the replayed trace)
    calibration: str = ""
    #: critical-path cost of the cache update per prefetching layer (000 Sec. VI-E: about 0.01 ms)
    management_us: float = 10.0
    _history: bool = False
    _disabled: frozenset[int] = frozenset()

    def configure(self, ctx: RunContext) -> None:
        if self.eviction not in EVICTION_MODES:
            raise ConfigError(f"unknown eviction mode '{self.eviction}'", field="prefetch.eviction",
                              fix=f"use one of {', '.join(EVICTION_MODES)}")
        if self.n < 0:
            raise ConfigError(f"prefetch.n={self.n} is negative", field="prefetch.n", fix="use 0 or more")
        if not 0.0 <= self.flex_off_fraction < 1.0:
            raise ConfigError(f"flex_off_fraction={self.flex_off_fraction} outside [0, 1)",
                              field="prefetch.flex_off_fraction", fix="use e.g. 0.5")
        self._history = "pred_next_token" not in ctx.columns
        if self._history:
            ctx.notes.append("smoe-token: the trace has no pred_next_token column; a history predictor stands "
                             "in (the next token is predicted to reuse this token's experts at each layer)")
        self._disabled = frozenset(self._flex_layers(ctx)) if self.flex_off_fraction > 0 else frozenset()

    def _flex_layers(self, ctx: RunContext) -> list[int]:
        path = self.calibration or ctx.trace_path
        if path is None:
            raise ConfigError("SMoE-Flex needs a trace to rank layers by predictor accuracy",
                              field="prefetch.calibration", fix="give a calibration trace path")
        accuracy = token_predictor_accuracy(path, ctx.model.num_layers, ctx.model.top_k)
        off = int(math.floor(self.flex_off_fraction * ctx.model.num_layers))
        layers = sorted(np.lexsort((np.arange(len(accuracy)), accuracy))[:off].tolist())
        source = "the replayed trace itself (set prefetch.calibration=PATH)" if not self.calibration else path
        ctx.notes.append(f"smoe-flex: prefetch off on {off} of {ctx.model.num_layers} layers with the least "
                         f"accurate token-wise predictor on {source}: {layers}")
        return layers

    def enabled(self, layer: int) -> bool:
        return self.n > 0 and layer not in self._disabled

    def predicted(self, view: LayerView) -> list[int]:
        rows = list(view.experts) if self._history else view.predictors.get("pred_next_token", [])
        return ranked_predictions(rows)

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        if view.phase != "decode" or not self.enabled(view.layer):
            return []
        ranked = self.predicted(view)
        cached = lambda e: view.cache.has(view.layer, e)  # noqa: E731
        if self.eviction == "fixed":
            picks = [e for e in ranked if not cached(e)][:self.n]
        else:
            picks = [e for e in ranked[:self.n] if not cached(e)]
        return [(view.layer, e) for e in picks]


# ----------------------------------------------------------------------------- system
@dataclass
class SMoESystem(ComposedSystem):
    """Prefill by Alg. 1 with ping-pong streaming; decode with a prefill-filled cache and token-wise prefetch."""

    #: per layer, token counts of the last prefill, waiting to fill the decode cache
    _fill: dict[int, dict[int, int]] = field(default_factory=dict)

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        self._fill = {}

    def _place(self, view: LayerView) -> LayerPlan:
        observe = getattr(self.cache, "observe", None)
        if observe is not None:
            observe(view)
        if view.phase == "prefill":
            return self._prefill(view)
        if view.layer in self._fill:
            return self._decode_with_fill(view)
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
        plan = super()._place(view)
        # Sec. IV-E: "once the computation of the MoE layer on the GPU is completed, the current
        # prefetch task is submitted to an asynchronous transfer queue"
        plan.prefetch_after_gpu = True
        if plan.prefetches and isinstance(self.prefetch, TokenWisePrefetch) and self.prefetch.management_us:
            plan.overhead_s["cache_management"] = self.prefetch.management_us * 1e-6
        return plan

    def _decode_with_fill(self, view: LayerView) -> LayerPlan:
        """First decode step after a prefill: fill this layer's slots with its most used prefill experts."""
        counts = self._fill.pop(view.layer)
        prefetch, self.prefetch = self.prefetch, _NO_PREFETCH
        try:
            plan = super()._place(view)
        finally:
            self.prefetch = prefetch
        layer, state = view.layer, view.cache
        top = sorted(counts, key=lambda e: (-counts[e], e))[:state.capacity[layer]]
        missing = [e for e in top if not state.has(layer, e)]
        room = state.free(layer) - len(plan.loads)
        if len(missing) > room:
            protected = set(top) | set(plan.gpu) | state.in_flight[layer]
            victims = self.cache.victims(view, layer, len(missing) - room, protected)
            plan.evictions += [(layer, e) for e in victims]
            room += len(victims)
        plan.prefetches += [(layer, e) for e in missing[:max(room, 0)]]
        return plan


_NO_PREFETCH = NoPrefetch()

register_system("smoe", SystemSpec(
    "SMoE (000): prefill by T_CPU > T_GPU + T_PCIe with ping-pong streaming (Alg. 1); decode with a "
    "prefill-filled LFU cache and token-wise prefetch, Fixed-N (Sec. IV-D, IV-E)",
    cache="smoe-lfu", assign="smoe", prefetch="smoe-token", system_class=SMoESystem, runtime="ktransformers-eager"))
register_system("smoe-flex", SystemSpec(
    "SMoE-Flex (000 Sec. IV-D, VI-D): SMoE with token-wise prefetch off on the half of the layers where the "
    "predictor is least accurate and 3 experts prefetched on the rest",
    cache="smoe-lfu", assign="smoe", prefetch="smoe-token", system_class=SMoESystem,
    defaults=(("prefetch.n", "3"), ("prefetch.flex_off_fraction", "0.5")), runtime="ktransformers-eager"))
