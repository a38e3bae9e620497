"""BuddyMoE: substitute a missing expert with a resident buddy (002_95ae8307b42d2a8d.txt).

Offline (Sec. 3.2-3.3): on a calibration trace, per layer, co-activation counts
M(i, j) (tokens routing to both i and j; optionally weighted by
``min(p_i, p_j)`` of the renormalized top-k probabilities), Laplace smoothing
``M <- M + epsilon`` off the diagonal, ``q_{j|i} = M(i,j) / sum_j' M(i,j')``
with ``q_{i|i} = 0`` (Eq. 4). The buddy list of i is the shortest prefix of
its peers by descending q (ids ascending among equal q) whose cumulative q
reaches ``alpha`` (the CFT, Eq. 5-6), capped at ``k_max``; experts never
activated get no buddies. Sec. 3.3 allows "a per-layer alpha_l or a monotone
schedule" (Sec. 3.2: early layers co-activate more diffusely, later ones in
tighter clusters; Sec. 3.4: early layers tolerate more aggressive replacement):
``alpha`` is one number for every MoE layer, ``FIRST:LAST`` a linear schedule
from the first MoE layer's value to the last's (``0.99:0.9``: longer lists
early, shorter late), or one value per MoE layer (``[0.99,0.97,...]``, as
``cache.slots_per_layer`` takes its quotas; quote either form in a YAML sweep
spec). Each layer's lists use its own alpha; the report gives the values and
the mean list length at the first, middle and last MoE layer, as Sec. 3.3
reports the |B_l(i; alpha_l)| distributions. Sec. 3.3 (i) accumulates both the
binary and the weighted counts but never says how the two make one q; here q
comes from one of them, binary unless ``weighted=true``. 002 gives no epsilon;
the default 1 is add-one (Laplace) smoothing in its usual form.

Sec. 3.3 says a larger alpha gives longer lists, Sec. 5.2 calls its alpha 0.99
runs (|B| = 2) "stricter" than 0.95 (|B| = 16): the two cannot both hold for
one list; Eq. 5 is followed (a larger alpha never shortens a list), and |B| is
read as the cap ``k_max``. Defaults alpha 0.95, k_max 16, rho 3 are the best
configuration of Tables 2-4 (Sec. 5.1 names the CFT "tau" there).

Runtime (Sec. 3.1, 3.3, Alg. 1), per layer:

1. distribution gate (Eq. 2): delta = share of the layer's requested experts
   not on the GPU (an expert arriving counts as on it); no substitution at all
   when ``delta >= beta``. 002 gives beta in [0, 1] and no value for its
   experiments; the default 1 is the loosest gate inside that range (it closes
   only when every requested expert is missing); ``beta=off`` (or any beta
   above 1) switches the gate off, so that a layer whose every routed expert is
   missing (delta = 1, common with few slots) may substitute too;
2. TAE gate (Eq. 1): a token whose normalised entropy of its renormalized
   top-k probabilities is ``<= tau`` keeps its experts; with ``tau < 0`` the
   threshold is the ``tau_percentile``-th percentile of the layer's TAE on the
   calibration trace (Sec. 3.1 (iii), p in [10, 20]; 10 by default, the range's
   lower end: the fewest tokens barred);
3. Alg. 1: each routed expert not on the GPU is replaced by the first of its
   first ``search_limit`` (H) buddies that is resident and not already in the
   token's set U_t; U_t grows with each pick (uniqueness). Eq. 3's text only
   lowers the score of a buddy the token already took; Alg. 1, the
   implementation of Sec. 4, forbids it outright, and that is what is done;
4. at most ``rho`` replacements per token (the replacement budget of Sec. 5.1;
   0 = no limit).

Where no buddy qualifies, the expert is fetched as routed (the "prefetch the
original" fallback of Sec. 3.1). The other fallback the paper names, dropping
the expert, needs an engine mechanism moesim lacks (a token computing fewer
than top-k experts). An expert already arriving (prefetched) counts as on the
GPU; only resident experts serve as buddies. With the default eta = kappa = 0
the priority score Psi (Eq. 3) is q_{j|i} itself: the buddy list's order.

Optional refinements of Sec. 3.1-3.3 that are left out, each off by default in
the paper or without a value there: eta (needs normalised router logits; the
trace keeps probabilities), kappa (hop(j) is 0 on one GPU), the temperature T
and the margin gamma of the TAE gate, and down-weighting warm-up steps in the
profile.

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
from functools import lru_cache

import numpy as np

from moesim.errors import ConfigError
from moesim.policy.base import LayerView, RunContext, Substitutions
from moesim.policy.prefetch import LastTokenPredictor, Prefetch, ranked_predictions
from moesim.policy.systems import Substitution, SystemSpec, register_component, register_system
from moesim.trace.io import read_table, trace_columns
from moesim.trace.schema import score_rows


def renormalized(probabilities: np.ndarray) -> np.ndarray:
    """Rows scaled to sum 1 (the top-k probabilities p~ of Sec. 3.1)."""
    p = np.asarray(probabilities, dtype=np.float64)
    return p / np.maximum(p.sum(axis=-1, keepdims=True), 1e-12)


def tae(top_k_probabilities: np.ndarray) -> np.ndarray:
    """Eq. 1: normalised entropy of each row's renormalized top-k probabilities, in [0, 1]."""
    p = renormalized(top_k_probabilities)
    k = p.shape[-1]
    if k < 2:
        return np.zeros(p.shape[:-1])
    positive = p > 0
    if positive.all():  # the usual case: no 0 log 0 to define
        terms = p * np.log(p)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(positive, p * np.log(p), 0.0)
    return -terms.sum(axis=-1) / _log(k)


@lru_cache(maxsize=None)
def _log(k: int) -> np.floating:
    return np.log(k)


#: how far one token's TAE in plain floats (:func:`token_tae`) may lie from :func:`tae`'s, with room to
#: spare: both round the same sums and logarithms, in other orders (a few ulps, under 1e-13 for k <= 64)
TAE_ROUNDING = 1e-9


def token_tae(probabilities: list[float]) -> float:
    """Eq. 1 for one token's top-k probabilities, in plain floats (:func:`tae` to within TAE_ROUNDING)."""
    k = len(probabilities)
    if k < 2:
        return 0.0
    total = max(sum(probabilities), 1e-12)
    entropy = 0.0
    for p in probabilities:
        p /= total
        if p > 0:
            entropy -= p * math.log(p)
    return entropy / math.log(k)


class TaeGate:
    """The TAE gate of one layer's tokens (Sec. 3.1): ``gate[t]`` is True where token t's TAE exceeds tau.

    A token is looked at only when asked about (Alg. 1 asks only for a token with a replacement to make).
    Its TAE in plain floats settles the comparison unless it lies within TAE_ROUNDING of tau; then
    numpy's :func:`tae` of the layer's tokens decides, as it always did.
    """

    def __init__(self, probabilities: np.ndarray, tau: float) -> None:
        self.probabilities, self.tau = probabilities, tau
        self._exact: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.probabilities)

    def __getitem__(self, token: int) -> bool:
        value = token_tae(self.probabilities[token].tolist())
        if abs(value - self.tau) > TAE_ROUNDING:
            return value > self.tau
        if self._exact is None:
            self._exact = tae(self.probabilities) > self.tau
        return bool(self._exact[token])


def coactivation(experts: np.ndarray, num_experts: int, probabilities: np.ndarray | None = None) -> np.ndarray:
    """M(i, j): tokens routing to both i and j (weighted by min(p_i, p_j) when probabilities are given)."""
    k = experts.shape[1]
    if k < 2 or not len(experts):
        return np.zeros((num_experts, num_experts))
    if probabilities is None:
        # whole counts: each unordered slot pair once, M = C + C^T (exact, and half the cells)
        first, second = np.triu_indices(k, 1)
        cells = (experts[:, first] * num_experts + experts[:, second]).ravel()
        once = np.bincount(cells, minlength=num_experts * num_experts).reshape(num_experts, num_experts)
        return (once + once.T).astype(np.float64)
    p = renormalized(probabilities)
    pairs = [(a, b) for a in range(k) for b in range(k) if a != b]
    first, second = (np.array(slots) for slots in zip(*pairs))
    # every (token, a, b) cell at once, in the order slot pair by slot pair, token by token (the transposed
    # ravel): a weighted count adds the same terms in the same order as one pass per slot pair would
    cells = (experts[:, first] * num_experts + experts[:, second]).T.ravel()
    w = np.minimum(p[:, first], p[:, second]).T.ravel()
    return np.bincount(cells, weights=w, minlength=num_experts * num_experts).reshape(num_experts, num_experts)


def buddy_lists(m: np.ndarray, alpha: float, k_max: int, epsilon: float) -> list[list[int]]:
    """Eq. 4-6: each expert's buddies, best first (none for an expert never co-activated)."""
    n = m.shape[0]
    active = m.sum(axis=1) > 0
    smoothed = m + epsilon
    np.fill_diagonal(smoothed, 0.0)
    q = smoothed / np.maximum(smoothed.sum(axis=1, keepdims=True), 1e-300)
    # per row, its first ``width`` peers by q descending and then by id, itself left out: no list is longer
    peers = _leading_peers(q, min(k_max, n - 1))
    covered = np.cumsum(np.take_along_axis(q, peers, axis=1), axis=1)  # non-decreasing along each row
    # the minimal prefix reaching alpha; one past the leading peers when none of them reach it (capped below)
    sizes = (covered < alpha - 1e-12).sum(axis=1) + 1
    sizes = np.maximum(1, np.minimum(sizes, k_max)).tolist()
    return [peers[i, :sizes[i]].tolist() if active[i] else [] for i in range(n)]


ALPHA_KEY = "substitute.alpha"
ALPHA_FORMS = ("give one number for every MoE layer (substitute.alpha=0.95), FIRST:LAST for a linear schedule "
               "from the first MoE layer to the last (substitute.alpha=0.99:0.9), or one value per MoE layer "
               "(substitute.alpha=[0.99,0.97,...])")


def alpha_schedule(value: float | str | Sequence[float], layers: int | None = None) -> list[float]:
    """The CFT alpha of each MoE layer (002 Sec. 3.3: "a per-layer alpha_l or a monotone schedule").

    ``value``: a number (every layer), ``"FIRST:LAST"`` (linear from the first MoE layer to the last, both
    ends exact; a one-layer model takes FIRST) or one value per MoE layer (``"[a,b,...]"``, ``"a,b,..."`` or
    a list; one value alone is every layer's, as in ``cache.slots_per_layer``). With ``layers`` None only
    the form and the range are checked, and the values as written are returned. Every refusal is one
    :class:`ConfigError` line naming ``substitute.alpha``.
    """
    ramp = False
    if isinstance(value, str):
        text = value.strip()
        if text[:1] == "[" or text[-1:] == "]":  # brackets only as a matching pair, as in slots_per_layer
            if len(text) < 2 or text[0] != "[" or text[-1] != "]":
                raise _malformed(value)
            text = text[1:-1].strip()
        ramp = ":" in text
        items: list = [x.strip() for x in text.split(":" if ramp else ",")]
        if "" in items or (ramp and (len(items) != 2 or "," in text)):  # "0.9,", "0.9:", "a:b:c", "[]"
            raise _malformed(value)
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    try:
        values = [float(x) for x in items]
    except (TypeError, ValueError):
        raise _malformed(value) from None
    if not values:
        raise _malformed(value)
    for v in values:
        if not 0.0 < v <= 1.0:
            if len(values) == 1:
                # YAML reads an unquoted 1:0.9 as the base-60 number 60.9
                yaml = "; quote a FIRST:LAST schedule in a YAML spec ('1:0.9'), which reads 1:0.9 unquoted as 60.9" \
                    if v >= 60 else ""
                raise ConfigError(f"{ALPHA_KEY}={v} outside (0, 1]", field=ALPHA_KEY,
                                  fix=f"--set {ALPHA_KEY}=0.95{yaml}")
            raise ConfigError(f"{ALPHA_KEY}={_text(value)}: {v} outside (0, 1]", field=ALPHA_KEY,
                              fix="give every value in (0, 1], e.g. 0.99:0.9")
    if layers is None:
        return values
    if ramp:
        first, last = values
        if layers == 1:
            return [first]
        # both ends exact, and a constant schedule is its number at every layer
        return [first + (last - first) * i / (layers - 1) for i in range(layers - 1)] + [last]
    if len(values) == 1:
        return values * layers
    if len(values) != layers:
        raise ConfigError(f"{ALPHA_KEY} lists {len(values)} values, the model has {layers} MoE layers",
                          field=ALPHA_KEY, fix=f"give one value per MoE layer ({layers}), one number for all, "
                                               "or FIRST:LAST for a linear schedule (e.g. 0.99:0.9)")
    return values


def is_per_layer(value: float | str | Sequence[float]) -> bool:
    """Whether ``alpha`` is written as a schedule or a list rather than one number."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return True
        return False
    return isinstance(value, (list, tuple))


def _text(value: float | str | Sequence[float]) -> str:
    return value.strip() if isinstance(value, str) else str(value)


def _malformed(value: float | str | Sequence[float]) -> ConfigError:
    return ConfigError(f"'{_text(value)}' is not a number, FIRST:LAST or one value per MoE layer", field=ALPHA_KEY,
                       fix=ALPHA_FORMS)


def _leading_peers(q: np.ndarray, width: int) -> np.ndarray:
    """Per row i, the first ``width`` columns other than i in the order (q descending, column ascending).

    The order of a stable argsort of each row, without sorting all of it: the columns above the row's
    ``width``-th highest q, then those tied with it, lowest first, until ``width`` are taken.
    """
    n = q.shape[0]
    if width <= 0:
        return np.zeros((n, 0), dtype=np.intp)
    if width >= n - 1:
        orders = np.argsort(-q, axis=1, kind="stable")
        return orders[orders != np.arange(n)[:, None]].reshape(n, n - 1)
    own = np.eye(n, dtype=bool)
    others = np.where(own, -np.inf, q)  # a row's own q is 0 and its rank must not count
    cut = -np.partition(-others, width - 1, axis=1)[:, width - 1:width]  # each row's width-th highest
    above = others > cut
    tied = others == cut
    tied &= np.cumsum(tied, axis=1) <= width - above.sum(axis=1, keepdims=True)
    rows, columns = np.nonzero(above | tied)  # width per row, rows in order
    order = np.lexsort((columns, -q[rows, columns], rows))
    return columns[order].reshape(n, width)


def substitute_buddies(experts: np.ndarray, on_gpu: set[int], resident: set[int], buddies: list[list[int]],
                       search_limit: int, allowed: Sequence[bool] | None = None, rho: int = 0
                       ) -> list[tuple[int, int, int]]:
    """Alg. 1 of 002 (with the TAE gate as ``allowed`` per token, an array or a :class:`TaeGate`, and
    budget ``rho``)."""
    out = []
    for t, row in enumerate(np.asarray(experts).tolist()):
        used = set(row)
        picks = []
        for slot, e in enumerate(row):
            if e in on_gpu:
                continue
            if rho and len(picks) >= rho:
                break
            # the first of e's first H buddies that is resident and not yet in U_t
            for b in buddies[e][:search_limit]:
                if b in resident and b not in used:
                    picks.append((t, slot, b))
                    used.add(b)
                    break
        # a token's picks depend on its own experts alone: its gate is asked only when it has some
        if picks and (allowed is None or allowed[t]):
            out += picks
    return out


def substitute_buddies_at_once(experts: np.ndarray, on_gpu: set[int], resident: set[int],
                               buddies: list[list[int]], search_limit: int, allowed: np.ndarray | None = None,
                               rho: int = 0) -> Substitutions | list[tuple[int, int, int]]:
    """:func:`substitute_buddies` for many tokens (a prefill's thousands): the same picks, found slot by slot
    for every token at once. Slot s of token t is replaced when its expert is off the GPU, t's gate is open
    and its budget not spent; by the first usable buddy that is neither one of t's experts nor already
    picked for an earlier slot of t."""
    experts = np.asarray(experts, dtype=np.int64)
    tokens, k = experts.shape
    if not tokens:
        return []
    ids = np.flatnonzero(np.bincount(experts.ravel()))  # the routed ids, ascending (np.unique without its sort)
    off_gpu = np.array([e not in on_gpu for e in ids.tolist()])
    usable = [[b for b in buddies[e][:search_limit] if b in resident] if off else []
              for e, off in zip(ids.tolist(), off_gpu.tolist())]
    width = max(map(len, usable), default=0)
    if width == 0:
        return []
    # per routed expert id, its usable buddies in order, padded with -1
    table = np.full((int(ids[-1]) + 1, width), -1, dtype=np.int64)
    for e, row in zip(ids.tolist(), usable):
        table[e, :len(row)] = row
    missing = np.zeros(int(ids[-1]) + 1, dtype=bool)
    missing[ids] = off_gpu
    open_gate = np.ones(tokens, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool)
    width_ids = max(int(ids[-1]), int(table.max())) + 1
    used = np.zeros((tokens, width_ids), dtype=bool)  # U_t: the token's experts, then its picks
    used[np.arange(tokens)[:, None], experts] = True
    replaced = np.zeros(tokens, dtype=np.int64)
    picks = []
    for slot in range(k):
        wants = open_gate & missing[experts[:, slot]]
        if rho:
            wants &= replaced < rho
        rows = np.flatnonzero(wants)
        if not rows.size:
            continue
        candidates = table[experts[rows, slot]]  # (rows, width)
        free = (candidates >= 0) & ~used[rows[:, None], candidates]
        found = free.any(axis=1)
        rows, chosen = rows[found], candidates[found, free[found].argmax(axis=1)]
        used[rows, chosen] = True
        replaced[rows] += 1
        picks.append((rows, np.full(rows.size, slot), chosen))
    if not picks:
        return []
    t, slot, b = (np.concatenate(part) for part in zip(*picks))
    order = np.lexsort((slot, t))
    return Substitutions(t[order], slot[order], b[order])


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
    _buddies: list[list[list[int]]] = field(default_factory=list, repr=False)
    _tau: list[float] = field(default_factory=list, repr=False)
    #: each MoE layer's alpha, from ``alpha`` once the model is known
    _alphas: list[float] = field(default_factory=list, repr=False)

    def set_param(self, key: str, raw: str) -> None:
        if key == "beta" and isinstance(raw, str) and raw.strip().lower() == "off":
            self.beta = math.inf
            return
        if key == "alpha":
            values = alpha_schedule(raw)  # the form and the range now; the count once the model is known
            if not is_per_layer(raw):
                self.alpha = values[0]  # one number stays a float, as it always was
            else:  # a schedule or a list is kept as written (the report repeats it)
                self.alpha = raw.strip() if isinstance(raw, str) else raw
            return
        super().set_param(key, raw)

    def configure(self, ctx: RunContext) -> None:
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
                self._tau.append(float(np.percentile(tae(p), self.tau_percentile)))

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
        return None if p is None else tae(p) > self._tau[view.layer]

    def _gate(self, view: LayerView) -> TaeGate | None:
        p = self._probabilities(view)
        return None if p is None else TaeGate(p, self._tau[view.layer])

    def rewrite(self, view: LayerView) -> Sequence[tuple[int, int, int]]:
        layer = view.layer
        resident, in_flight = view.cache.resident[layer], view.cache.in_flight[layer]
        on_gpu = resident | in_flight if in_flight else resident
        active = view.active  # distinct: the missing ones are those not in on_gpu
        missing = len(active) - len(on_gpu.intersection(active))
        if missing == 0 or missing / len(active) >= self.beta:
            return []
        limit = self.search_limit or self.k_max
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
    _layers: int = 0

    _fallback: LastTokenPredictor | None = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        if self.size < -1:
            raise ConfigError(f"prefetch.size={self.size} is below -1", field="prefetch.size",
                              fix="use -1 (top_k), 0 (all predicted) or a count")
        if self.size == -1:
            self.size = ctx.model.top_k
        self._layers = ctx.model.num_layers
        self._fallback = None
        if "pred_next_layer" not in ctx.columns:
            self._fallback = LastTokenPredictor()
            ctx.notes.append("next-layer: the trace has no pred_next_layer column; each token is predicted to "
                             "use, at the next layer, what its request's previous token used there")

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        predicted = self._fallback.predict(view) if self._fallback else view.predictors.get("pred_next_layer")
        if (view.phase == "prefill" and not self.prefill) or view.layer + 1 >= self._layers or not predicted:
            return []
        ranked, target = ranked_predictions(predicted), view.layer + 1
        return [(target, e) for e in (ranked[:self.size] if self.size else ranked)]


register_system("buddymoe", SystemSpec(
    "BuddyMoE (002): LRU expert cache, next-layer prefetch of top_k experts in decoding, missing experts "
    "replaced by resident buddies "
    "from co-activation lists (TAE and distribution gates, budget rho)",
    cache="lru", assign="gpu", prefetch="next-layer", substitute="buddy", runtime="llamacpp"))
