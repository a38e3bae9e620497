"""BuddyMoE: substitute a missing expert with a resident buddy (002_95ae8307b42d2a8d.txt).

Parts: the offline calibration (Sec. 3.2-3.3: co-activation counts, the buddy
lists of Eq. 4-6, the per-layer alpha schedule) is in :mod:`.calibration`; the
runtime substitution (Sec. 3.1, 3.3, Alg. 1: the TAE gate and the buddy picks)
in :mod:`.runtime`; the components and the ``buddymoe`` system are here.

Optional refinements of Sec. 3.1-3.3 that are left out, each off by default in
the paper or without a value there: eta (Eq. 3's local compatibility: 002 does
not say how z^(j) is normalised, and it would need every expert's score, a
column the replay otherwise leaves unread), kappa and the per-partition delta
(hop(j) is 0 and there is one partition on one GPU), Sec. 3.1's choice of beta
from a PCIe budget and its adaptive beta (beta is given), and down-weighting
warm-up steps in the profile. The TAE gate's two refinements are in, off by
default: the temperature T of Sec. 3.1 (ii) (``tae_temperature``; softmax(z/T)
restricted to S(x) is p_i^(1/T) renormalized over S(x), so the trace's
probabilities serve) and the margin gamma of Sec. 3.1's last sentence
(``margin``); see :mod:`.runtime`.

``random`` is the paper's random-replacement baseline (Sec. 5.1): a missing
expert becomes a uniformly drawn resident expert not in the token's set.

The ``buddymoe`` system: an LRU expert cache (002 names no replacement policy
for its cache; LRU is moesim's choice), every expert on the GPU, the
next layer's predicted experts prefetched during decoding (Fig. 3's pipeline:
"the CPU uses the attention output to predict the required experts for the next
block", from ``pred_next_layer``; one gate's worth, top_k experts per layer, the
most-voted over the batch), buddy substitution of what is still missing.
Prefetching every expert any token predicts, or prefetching in the prefill
(where a long prompt predicts nearly every expert), would leave nothing missing
and mute substitution; 002 measures decoding throughput with prefetch misses to
substitute (Sec. 2.3, Table 1), so both are off by default
(``prefetch.size=0`` and ``prefetch.prefill=true`` turn them on; the latter needs the trace's
``pred_next_layer`` column or a prompt prefilled in several steps: the stand-in predictor has no earlier
token of a request to go on in its first step).
``--set substitute=none`` is the paper's "Original", ``substitute=random``
its "Random".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerView, RunContext
from moesim.policy.catalog.buddymoe.calibration import (ALPHA_FORMS, ALPHA_KEY, alpha_schedule,  # noqa: F401
                                                        buddy_lists, coactivation, is_per_layer)
from moesim.policy.catalog.buddymoe.runtime import (TAE_ROUNDING, TaeGate, margin, renormalized,  # noqa: F401
                                                    substitute_buddies, substitute_buddies_at_once,
                                                    substitute_buddies_one, tae, tae_open, tempered, token_tae)
from moesim.policy.prefetch import LastTokenPredictor, Prefetch, ranked_predictions
from moesim.policy.systems import Substitution, SystemSpec, register_component, register_system
from moesim.trace.io import read_table, trace_columns
from moesim.trace.schema import score_rows


@register_component
@dataclass
class BuddySubstitution(Substitution):
    """Buddy expert substitution (002 Sec. 3-4, Alg. 1); parameters as in the module docstring."""

    name = "buddy"
    columns = ("weights", "scores")
    any_negative = ("tau",)
    #: calibration trace (path), 002 Sec. 3.3's held-out profiling set; empty: the replayed trace itself,
    #: flagged in the report
    calibration: str = ""
    #: cumulative frequency threshold (CFT) of Eq. 5 (the tables' "tau", Sec. 5.1; 0.95 in Tables 2-4's best
    #: configuration), in (0, 1]: one number for every MoE layer, FIRST:LAST linear from the first MoE layer
    #: to the last (0.99:0.9), or one per MoE layer ([0.99,0.97,...]) (002 Sec. 3.3: per-layer alpha_l)
    alpha: float | str = 0.95
    #: buddy list cap K_max (002 Sec. 3.4: typically 5-20; the tables' |B|, Sec. 5.1: 2-16; 16 in Tables 2-4's
    #: best configuration) (experts)
    k_max: int = 16
    #: Laplace smoothing added to every co-activation count before normalising (002 Sec. 3.3, (ii); no value
    #: there: 1 is add-one smoothing)
    epsilon: float = 1.0
    #: accumulate probability-weighted co-activations instead of binary ones (002 Sec. 3.3, (i))
    weighted: bool = False
    #: buddy search rank limit H of Alg. 1 (002 gives no value; 0: the whole list, at most k_max)
    search_limit: int = 0
    #: TAE gate threshold of Eq. 1 (002 Sec. 3.1); negative: the tau_percentile-th percentile on the
    #: calibration trace
    tau: float = -1.0
    #: with ``tau`` negative: which percentile of each layer's TAE on the calibration trace is the threshold
    #: (002 Sec. 3.1, (iii): p in [10, 20]; 10, its lower end)
    tau_percentile: float = 10.0
    #: distribution gate of Eq. 2 (002 Sec. 3.1): no substitution in a layer when this share of its experts
    #: is off the GPU (002 gives no value; 1: closes only when all are off; "off" or above 1: never closes)
    beta: float = 1.0
    #: replacement budget rho per token, 0: unlimited (002 Sec. 5.1; 3 in its best configurations) (experts)
    rho: int = 3
    #: temperature T of the TAE gate (002 Sec. 3.1 (ii): p~(x; T) = softmax(z/T) restricted to S(x), "T in
    #: [0.8, 1.2] works well"), dimensionless, > 0; 1: no smoothing. Taken from the trace's probabilities as
    #: p_i^(1/T) renormalized over S(x), which is that softmax exactly; a percentile tau is of the TAE at this T
    tae_temperature: float = 1.0
    #: probability margin gamma of the TAE gate (002 Sec. 3.1: replacement is forbidden when
    #: p~max - p~2nd >= gamma as well as when TAE <= tau), a difference of probabilities in [0, 1]; "off" (inf,
    #: the default; 002 gives no value) or above 1: no margin test
    margin: float = math.inf
    _buddies: list[list[list[int]]] = field(default_factory=list, repr=False)
    _tau: list[float] = field(default_factory=list, repr=False)
    #: each MoE layer's alpha, from ``alpha`` once the model is known
    _alphas: list[float] = field(default_factory=list, repr=False)

    def set_param(self, key: str, raw: str) -> None:
        if key in ("beta", "margin") and isinstance(raw, str) and raw.strip().lower() == "off":
            setattr(self, key, math.inf)  # a gate that never closes
            return
        if key in ("tae_temperature", "margin"):
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise self._bad(key, f"{raw!r} is not a number") from None
            setattr(self, key, value)
            self._check_gate()
            return
        if key == "alpha":
            values = alpha_schedule(raw)  # the form and the range now; the count once the model is known
            if not is_per_layer(raw):
                self.alpha = values[0]  # one number stays a float, as it always was
            else:  # a schedule or a list is kept as written (the report repeats it)
                self.alpha = raw.strip() if isinstance(raw, str) else raw
            return
        super().set_param(key, raw)

    @staticmethod
    def _bad(key: str, detail: str) -> ConfigError:
        fix = ("give a temperature above 0 (002 Sec. 3.1 (ii): 0.8 to 1.2 works well), e.g. "
               "--set substitute.tae_temperature=1" if key == "tae_temperature" else
               "give a margin gamma in [0, 1], or off (--set substitute.margin=off)")
        return ConfigError(detail, field=f"substitute.{key}", fix=fix)

    def _check_gate(self) -> None:
        """Refuse a temperature that is not a finite number above 0 and a negative or NaN margin."""
        t = self.tae_temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise self._bad("tae_temperature", f"substitute.tae_temperature={t} is not a number above 0")
        gamma = self.margin
        if not (isinstance(gamma, (int, float)) and gamma >= 0):  # NaN fails this too; inf is off
            raise self._bad("margin", f"substitute.margin={gamma} is not a number >= 0")

    def for_model(self, model: ModelSpec) -> None:
        # a per-layer alpha's count is known once the model is: a sweep's spec check refuses it here, before
        # any point runs
        alpha_schedule(self.alpha, model.num_layers)

    def configure(self, ctx: RunContext) -> None:
        self._check_gate()
        self._alphas = alpha_schedule(self.alpha, ctx.model.num_layers)
        if self.k_max < 1:
            raise ConfigError(f"substitute.k_max={self.k_max} below 1", field="substitute.k_max",
                              fix="--set substitute.k_max=16")
        if self.beta < 0.0:
            raise ConfigError(f"substitute.beta={self.beta} is negative", field="substitute.beta",
                              fix="use a share in [0, 1], or off (--set substitute.beta=off)")
        path = self.calibration or ctx.trace_path
        if path is None:
            raise ConfigError("buddy lists need a calibration trace", field="substitute.calibration",
                              fix="--set substitute.calibration=PATH")
        if not self.calibration:
            ctx.notes.append("buddy: buddy lists and TAE percentiles calibrated on the replayed trace itself "
                             "(set substitute.calibration=PATH for a held-out calibration trace)")
        # the gate reads the replayed trace's probabilities; without them it cannot close, whatever tau is
        replay_has_p = not ctx.columns or any(c in ctx.columns for c in ("weights", "scores"))
        self._calibrate(path, ctx, note_tae=replay_has_p)
        if is_per_layer(self.alpha):
            ctx.notes.append(self.schedule_note())
        if not replay_has_p:
            ctx.notes.append("buddy: the replayed trace has neither weights nor scores: the TAE gate (002 Eq. 1) "
                             "has no probabilities to go on and lets every token through")
        # the gate reads weights when the trace has them, else scores: the replay reads only that one
        if ctx.columns:
            self.columns = tuple(c for c in ("weights", "scores") if c in ctx.columns)[:1]
        if self.beta <= 1.0 and ctx.capacity and max(ctx.capacity) < ctx.model.top_k:
            ctx.notes.append(f"buddy: {max(ctx.capacity)} GPU slot(s) per layer for top-{ctx.model.top_k} routing: a "
                             f"decode token's buddy is already its own expert or the gate (delta >= beta = "
                             f"{self.beta:g}) closes, so substitution is rare (--set substitute.beta=off opens it)")

    def _calibrate(self, path: str, ctx: RunContext, note_tae: bool = True) -> None:
        model = ctx.model
        names = set(trace_columns(path))
        # the top-k probabilities come from weights when the trace has them, else from scores (never both)
        columns = ["layer", "experts"] + [c for c in ("weights", "scores") if c in names][:1]
        table = read_table(path, columns)
        layers = table.column("layer").to_numpy()
        k = model.top_k
        experts = table.column("experts").combine_chunks().flatten().to_numpy().reshape(-1, k).astype(np.int64)
        probs = self._top_k_probabilities(table, experts, model.num_experts)
        if probs is None and self.tau < 0 and note_tae:
            ctx.notes.append("buddy: calibration trace has neither weights nor scores; TAE gate off")
        if probs is None and self.weighted:
            ctx.notes.append("buddy: calibration trace has neither weights nor scores, so weighted=true has no "
                             "min(p_i, p_j) to weigh co-activations by (002 Sec. 3.3 (i)); counted binary")
        self._buddies, self._tau = [], []
        # the rows grouped by layer once (a stable sort keeps each layer's rows in trace order)
        by_layer = np.argsort(layers, kind="stable")
        bounds = np.searchsorted(layers[by_layer], np.arange(model.num_layers + 1)).tolist()
        experts = experts[by_layer]
        probs = None if probs is None else probs[by_layer]
        for layer in range(model.num_layers):
            rows = slice(bounds[layer], bounds[layer + 1])
            p = None if probs is None else probs[rows]
            m = coactivation(experts[rows], model.num_experts, p if self.weighted else None)
            self._buddies.append(buddy_lists(m, self._alphas[layer], self.k_max, self.epsilon))
            if self.tau >= 0:
                self._tau.append(self.tau)
            elif p is None or rows.start == rows.stop:
                self._tau.append(-np.inf)
            else:
                # the percentile of the TAE the gate compares (at the gate's temperature, Sec. 3.1 (ii))
                self._tau.append(float(np.percentile(tae(p, self.tae_temperature), self.tau_percentile)))

    def schedule_note(self) -> str:
        """The per-layer alpha and the mean buddy list length of the experts with buddies, at the first,
        middle and last MoE layer (002 Sec. 3.3 reports the |B_l(i; alpha_l)| distributions)."""
        layers = len(self._alphas)
        parts = []
        for layer in sorted({0, (layers - 1) // 2, layers - 1}):
            sizes = [len(b) for b in self._buddies[layer] if b]
            mean = f"{sum(sizes) / len(sizes):.2f}" if sizes else "none"
            parts.append(f"layer {layer}: alpha {self._alphas[layer]:.4g}, mean |B| {mean}")
        return (f"buddy: per-layer alpha {self.alpha} over {layers} MoE layers (002 Sec. 3.3); "
                + "; ".join(parts))

    @staticmethod
    def _top_k_probabilities(table, experts: np.ndarray, num_experts: int) -> np.ndarray | None:
        if "weights" in table.column_names:
            return table.column("weights").combine_chunks().flatten().to_numpy().reshape(experts.shape)
        if "scores" in table.column_names:
            scores = score_rows(table.column("scores"), num_experts)
            return np.take_along_axis(scores.astype(np.float64), experts, axis=1)
        return None

    def buddies(self, layer: int) -> list[list[int]]:
        return self._buddies[layer]

    def _probabilities(self, view: LayerView) -> np.ndarray | None:
        """The tokens' top-k probabilities: the routed weights, else the routed experts' scores."""
        if view.weights is not None:
            return view.weights
        if view.scores is not None:
            return np.take_along_axis(view.scores.astype(np.float64), view.experts.astype(np.int64), axis=1)
        return None

    def _allowed(self, view: LayerView) -> np.ndarray | None:
        p = self._probabilities(view)
        return None if p is None else tae_open(p, self._tau[view.layer], self.tae_temperature, self.margin)

    def _opens(self, view: LayerView) -> bool:
        """Whether the TAE gate lets a one-token layer's picks through (open without probabilities)."""
        gate = self._gate(view)
        return gate is None or gate[0]

    def _gate(self, view: LayerView) -> TaeGate | None:
        p = self._probabilities(view)
        return None if p is None else TaeGate(p, self._tau[view.layer], self.tae_temperature, self.margin)

    def rewrite(self, view: LayerView) -> Sequence[tuple[int, int, int]]:
        layer = view.layer
        resident, in_flight = view.cache.resident[layer], view.cache.in_flight[layer]
        active = view.active  # distinct: the missing ones are those neither resident nor arriving
        if in_flight:
            missing = sum(1 for e in active if e not in resident and e not in in_flight)
        else:
            missing = len(active) - len(resident.intersection(active))
        if missing == 0 or missing / len(active) >= self.beta:
            return []
        limit = self.search_limit or self.k_max
        if view.tokens == 1:  # every decode step of one request: the gate is asked only for picks
            picks = substitute_buddies_one(view.experts[0].tolist(), resident, in_flight, self._buddies[layer],
                                           limit, self.rho)
            return picks if picks and self._opens(view) else []
        on_gpu = resident | in_flight if in_flight else resident
        if view.tokens <= 16:
            return substitute_buddies(view.experts, on_gpu, resident, self._buddies[layer], limit, self._gate(view),
                                      self.rho)
        return substitute_buddies_at_once(view.experts, on_gpu, resident, self._buddies[layer], limit,
                                          self._allowed(view), self.rho)


@register_component
@dataclass
class RandomSubstitution(Substitution):
    """Random replacement (002 Sec. 5.1 baseline): a missing expert becomes a random resident one."""

    name = "random"
    _rng: np.random.Generator | None = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        self._rng = np.random.default_rng([ctx.seed, 2])

    def rewrite(self, view: LayerView) -> list[tuple[int, int, int]]:
        assert self._rng is not None
        resident = view.cache.resident[view.layer]
        on_gpu = resident | view.cache.in_flight[view.layer]
        out = []
        pool = sorted(resident)
        for t in range(view.tokens):
            row = [int(e) for e in view.experts[t]]
            used = set(row)
            for slot, e in enumerate(row):
                if e in on_gpu:
                    continue
                choices = [b for b in pool if b not in used]
                if not choices:
                    continue
                b = choices[int(self._rng.integers(len(choices)))]
                out.append((t, slot, b))
                used.add(b)
        return out


@register_component
@dataclass
class NextLayerPrefetch(Prefetch):
    """Prefetch of the next layer's predicted experts (002 Fig. 3; a gate applied a layer early)."""

    name = "next-layer"
    columns = ("pred_next_layer",)
    #: experts loaded ahead per layer, most-predicted first (-1: the model's top_k, one gate's worth;
    #: 0: every expert any token predicts)
    size: int = -1
    #: prefetch during the prefill too (002 measures decoding). Without a pred_next_layer column the
    #: stand-in predictor guesses from the request's earlier tokens, and a prompt prefilled in one step has
    #: none: then this changes nothing (the bundled Mixtral trace); with the column, or a prefill in chunks, it acts
    prefill: bool = False
    #: ``size`` for this run (-1 resolved to the model's top_k)
    _count: int = 0
    _layers: int = 0

    _fallback: LastTokenPredictor | None = field(default=None, repr=False)

    def for_model(self, model: ModelSpec) -> None:
        # resolved before the memory plan too: a system's prefetch buffer is sized from issued_per_layer
        self._count = model.top_k if self.size == -1 else self.size

    def configure(self, ctx: RunContext) -> None:
        if self.size < -1:
            raise ConfigError(f"prefetch.size={self.size} is below -1", field="prefetch.size",
                              fix="use -1 (top_k), 0 (all predicted) or a count")
        # resolved per run: a system configured again for another model takes that model's top_k
        self.for_model(ctx.model)
        self._layers = ctx.model.num_layers
        self._fallback = None
        if "pred_next_layer" not in ctx.columns:
            self._fallback = LastTokenPredictor()
            ctx.notes.append("next-layer: the trace has no pred_next_layer column; each token is predicted to "
                             "use, at the next layer, what its request's previous token used there")

    @property
    def count(self) -> int:
        """Experts prefetched per layer in this run (``size``, or the model's top_k when -1; 0: all predicted)."""
        return self._count

    @property
    def issued_per_layer(self) -> int | None:
        """``count`` (None for size 0: every expert any token predicts, as many as the batch's tokens name)."""
        return self._count if self._count > 0 else None

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        predicted = self._fallback.predict(view) if self._fallback else view.predictors.get("pred_next_layer")
        if (view.phase == "prefill" and not self.prefill) or view.layer + 1 >= self._layers or not predicted:
            return []
        ranked, target = ranked_predictions(predicted), view.layer + 1
        return [(target, e) for e in (ranked[:self._count] if self._count else ranked)]


register_system("buddymoe", SystemSpec(
    "BuddyMoE (002): LRU expert cache, next-layer prefetch of top_k experts in decoding, missing experts "
    "replaced by resident buddies "
    "from co-activation lists (TAE and distribution gates, budget rho)",
    cache="lru", assign="gpu", prefetch="next-layer", substitute="buddy", runtime="llamacpp"))
