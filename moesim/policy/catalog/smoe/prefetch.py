"""SMoE's token-wise prefetch (000_dba2fecbbc66318b.txt, Sec. IV-D, IV-E) and SMoE-Flex's layer choice.

The predictor's accuracy per layer (offline from a trace, or online while
decoding), the layers SMoE-Flex switches off, the predictor's GPU time, and
Table I's prefetch count per model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.hw.cost import roofline_s
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerView, RunContext
from moesim.policy.prefetch import Prefetch, ranked_predictions
from moesim.policy.systems import register_component

EVICTION_MODES = ("fixed", "adaptive")


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
        rows = list(view.experts) if self._history else view.predictors.get("pred_next_token", [])  # predicted_rows
        ranked = rows[0].tolist() if len(rows) == 1 and type(rows[0]) is np.ndarray else None
        if ranked is None or len(set(ranked)) < len(ranked):  # ranked_predictions's shortcut for one row or not
            ranked = ranked_predictions(rows)
        resident, in_flight = view.cache.resident[layer], view.cache.in_flight[layer]
        if self.eviction == "adaptive":
            return [(layer, e) for e in ranked[:self._n] if e not in resident and e not in in_flight]
        picks: list[tuple[int, int]] = []  # Fixed-N: the first n uncached, however far down the ranking
        n = self._n
        for e in ranked:
            if e not in resident and (not in_flight or e not in in_flight):
                picks.append((layer, e))
                if len(picks) == n:
                    break
        return picks


# ----------------------------------------------------------------------------- system
