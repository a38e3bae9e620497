"""DALI's residual-based prefetch (Sec. 4.2) and workload-aware cache (Sec. 4.3, Alg. 2) of
003_46c415738ddfa491.txt, with the per-model settings of Sec. 6.4."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerView, RunContext
from moesim.policy.cache import CachePolicy
from moesim.policy.prefetch import LastTokenPredictor, Prefetch
from moesim.policy.systems import register_component


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
    #: charge each prediction's extra gate call, the next layer's gate on this layer's residual-corrected
    #: input (003 Sec. 6.3 (4): "prefetching requires additional gating computations for prediction"): one
    #: gate GEMM and one kernel launch on the layer's critical path (breakdown ``predict``); false: free
    gate_cost: bool = True
    _layers: int = 0
    _note: str | None = field(default=None, repr=False)
    #: the size a -1 resolved to for the last model (None: ``size`` was given)
    _paper: int | None = field(default=None, repr=False)

    _fallback: LastTokenPredictor | None = field(default=None, repr=False)
    #: (cost model, tokens, phase, seconds) of the last prediction_s figure
    _predict_memo: tuple = field(default=(None, -1, "", 0.0), repr=False)

    def for_model(self, model: ModelSpec) -> None:
        if self.size == -1 or self.size == self._paper:  # resolved again for each model, not kept from the first
            (_, self.size), self._note = paper_setting(model)
            self._paper = self.size
        if self.size < 0:  # before the memory plan sizes the buffer from it
            raise ConfigError(f"prefetch.size={self.size} is negative", field="prefetch.size",
                              fix="use 0 or more (-1: 003's size for the model)")

    @property
    def issued_per_layer(self) -> int | None:
        """``size`` (resolved for the model by ``for_model``): the next layer's experts prefetched per layer."""
        return self.size if self.size >= 0 else None

    def configure(self, ctx: RunContext) -> None:
        self.for_model(ctx.model)
        _note_once(ctx, self._note)
        self._layers = ctx.model.num_layers
        self._fallback = None
        self._predict_memo = (None, -1, "", 0.0)
        if "pred_residual" not in ctx.columns:
            self._fallback = LastTokenPredictor()
            ctx.notes.append("dali-residual: the trace has no pred_residual column; each token is predicted to "
                             "use, at the next layer, what its request's previous token used there")

    def prediction_s(self, view: LayerView) -> float:
        """Seconds of this layer's prediction: the next layer's gate for the layer's tokens and its launch (0
        at the last layer, with a prefetch size of 0, or with ``gate_cost`` off). The stand-in predictor of a
        trace without ``pred_residual`` is charged the same, as it stands in for that gate call. The CUDA
        stream switch the same passage names is not charged: 003 gives no figure for it."""
        if not self.gate_cost or not self.size or view.layer + 1 >= self._layers:
            return 0.0
        costs, tokens, phase = view.costs, view.tokens, view.phase
        memo = self._predict_memo  # every layer of a step asks for the same figure
        if memo[0] is costs and memo[1] == tokens and memo[2] == phase:
            return memo[3]
        seconds = costs.gate(tokens) + costs.launch_per_kernel(phase)
        self._predict_memo = (costs, tokens, phase, seconds)
        return seconds

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
    #: iterations per window of Alg. 2 (003 Fig. 12 caption: 4 for every model) (steps)
    w_size: int = 4
    #: experts swapped per window (-1: 003's for the model, 1 for Mixtral, 8 for DeepSeek and Qwen, Sec. 6.4)
    u_size: int = -1
    #: model-wide slots for prefetched experts, besides the cache, -1: twice the prefetch size, what the prefetcher
    #: issues per layer (twice the model's top-k for one that fixes no number) (moesim's room for 003 Sec. 4.2's
    #: residual prefetches, which the paper does not size) (slots)
    prefetch_slots: int = -1
    #: swap only where the incoming score exceeds the outgoing one (false: Alg. 2 literally)
    strict: bool = True
    #: per layer, the current window's workload of each expert it used so far (the others' is 0)
    _window: list[dict[int, float]] = field(default_factory=list, repr=False)
    #: per layer, the last closed window's workload, as ``_window``
    _last: list[dict[int, float]] = field(default_factory=list, repr=False)
    _windows: list[int] = field(default_factory=list, repr=False)
    _cached: list[set[int]] = field(default_factory=list, repr=False)
    _seen: tuple[int, int] = (-1, -1)
    _seed: int = 0
    _experts: int = 0
    _note: str | None = field(default=None, repr=False)
    #: the u_size a -1 resolved to for the last model (None: ``u_size`` was given)
    _paper: int | None = field(default=None, repr=False)

    def for_model(self, model: ModelSpec) -> None:
        if self.u_size == -1 or self.u_size == self._paper:  # resolved again for each model, not kept from the first
            (self.u_size, _), self._note = paper_setting(model)
            self._paper = self.u_size

    def configure(self, ctx: RunContext) -> None:
        self.for_model(ctx.model)
        _note_once(ctx, self._note)
        if self.w_size < 1 or self.u_size < 0:
            raise ConfigError(f"w_size >= 1, u_size >= 0 required (got w_size={self.w_size}, "
                              f"u_size={self.u_size})", field="cache.w_size",
                              fix="--set cache.w_size=4 --set cache.u_size=8 (-1: 003's for the model)")
        experts = ctx.model.num_experts
        self._experts = experts
        self._window = [{} for _ in ctx.capacity]
        self._last = [{} for _ in ctx.capacity]
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
        window = self._window[layer]
        for e, n in zip(view.active, view.counts):  # a decode layer's few experts: no array to index
            window[e] = window.get(e, 0.0) + n
        self._windows[layer] += 1
        return self._windows[layer] % self.w_size == 0

    def replacement(self, layer: int, protected: set[int]) -> tuple[list[int], list[int]]:
        """Alg. 2 lines 10-15: (experts to bring in, cached experts to drop); restarts the window's scores.
        ``protected``: cached experts that may not be dropped now (in use, or still arriving)."""
        window = self._window[layer]
        cached = self._cached[layer]
        # a window touches few experts: the scores of those it used, by ascending id; every other expert's is 0
        score = {e: w for e, w in sorted(window.items()) if w}
        incoming = self._best_uncached(score, cached)
        outgoing = sorted((e for e in cached if e not in protected), key=lambda e: (score.get(e, 0.0), e))
        swaps_in, swaps_out = [], []
        for new, old in zip(incoming, outgoing[:self.u_size]):
            if self.strict and score.get(new, 0.0) <= score.get(old, 0.0):
                break
            swaps_in.append(new)
            swaps_out.append(old)
        cached.difference_update(swaps_out)
        cached.update(swaps_in)
        self._last[layer] = window
        self._window[layer] = {}
        return swaps_in, swaps_out

    def _best_uncached(self, score: dict[int, float], cached: set[int]) -> list[int]:
        """The ``u_size`` uncached experts of highest window score, ids ascending among ties (Alg. 2 line 11);
        ``score``: the nonzero scores, by ascending id."""
        # reverse=True keeps a stable sort's order among equals: ascending ids
        best = sorted((e for e in score if e not in cached), key=score.__getitem__, reverse=True)[:self.u_size]
        if len(best) < self.u_size and not self.strict:  # then score-0 experts (never a strict swap), lowest ids first
            best += [e for e in range(self._experts) if e not in cached and e not in score][:self.u_size - len(best)]
        return best

    # -- plain-cache interface, for systems that swap this component in -----------------------
    def touch(self, view: LayerView, used: list[int]) -> None:
        if self.observe(view):
            self._last[view.layer] = self._window[view.layer]
            self._window[view.layer] = {}

    @property
    def _scores(self) -> list[np.ndarray]:
        """Every layer's current window workload, one number per expert (Alg. 2's scores; read only)."""
        return [self._dense(window) for window in self._window]

    def _dense(self, workload: dict[int, float]) -> np.ndarray:
        """A window's workload as one number per expert."""
        dense = np.zeros(self._experts)
        if workload:
            dense[list(workload)] = list(workload.values())
        return dense

    def _rank(self, layer: int) -> np.ndarray:
        return self._dense(self._window[layer]) + 1e-9 * self._dense(self._last[layer])

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
