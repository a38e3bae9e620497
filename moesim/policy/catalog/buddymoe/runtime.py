"""BuddyMoE's runtime substitution (002_95ae8307b42d2a8d.txt, Sec. 3.1, 3.3, Alg. 1): the TAE of Eq. 1 and
its gate, and Alg. 1's buddy picks, token by token and for many tokens at once (the distribution gate of Eq. 2
is :meth:`BuddySubstitution.rewrite`'s first test).

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
   lower end: the fewest tokens barred). Sec. 3.1 (ii)'s temperature
   ``tae_temperature`` T smooths the probabilities first: p~(x; T) =
   softmax(z(x)/T) restricted to S(x). The trace keeps probabilities, not the
   logits z; but z = log p + c, so that softmax is exactly
   p_i^(1/T) / sum_{j in S(x)} p_j^(1/T) (:func:`tempered`), and T = 1 (the
   default) is Eq. 1 as it stands. The percentile is taken of the TAE at the
   same T. Sec. 3.1's margin: with ``margin`` gamma set, a token whose
   m(x) = p~max - p~2nd (of the same p~(x; T)) is ``>= gamma`` keeps its
   experts too ((TAE <= tau) or (m >= gamma) forbids replacement); off by
   default (002 gives no value). With top-2 routing the TAE and the margin are
   both monotone in p~max, and T keeps the tokens' order: a percentile tau at
   any T bars the same tokens (T acts only with a fixed tau there), and a
   margin acts only where it is stricter than tau;
3. Alg. 1: each routed expert not on the GPU is replaced by the first of its
   first ``search_limit`` (H) buddies that is resident and not already in the
   token's set U_t; U_t grows with each pick (uniqueness). Eq. 3's text only
   lowers the score of a buddy the token already took; Alg. 1, the
   implementation of Sec. 4, forbids it outright, and that is what is done;
4. at most ``rho`` replacements per token (the replacement budget of Sec. 5.1;
   0 = no limit), at each layer: Alg. 1 runs layer by layer, and Sec. 5.1 does
   not say whether the budget spans layers. Slots are visited in rank order
   (Alg. 1's k = 1..K), so the budget goes to the highest-weight missing
   experts first.

The probabilities p~ are the trace's weights (else its scores) renormalized
over S(x). 002 defines p = softmax(z) (Sec. 3; its DeepSeek-V2-Lite routes by
softmax); for a sigmoid router (DeepSeek-V3) p~ is its selected scores
renormalized, the weights the model applies.

Where no buddy qualifies, the expert is fetched as routed (the "prefetch the
original" fallback of Sec. 3.1). The other fallback the paper names, dropping
the expert, needs an engine mechanism moesim lacks (a token computing fewer
than top-k experts). An expert already arriving (prefetched) counts as on the
GPU; only resident experts serve as buddies. With the default eta = kappa = 0
the priority score Psi (Eq. 3) is q_{j|i} itself: the buddy list's order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from moesim.policy.base import Substitutions


def renormalized(probabilities: np.ndarray) -> np.ndarray:
    """Rows scaled to sum 1 (the top-k probabilities p~ of Sec. 3.1)."""
    p = np.asarray(probabilities, dtype=np.float64)
    return p / np.maximum(p.sum(axis=-1, keepdims=True), 1e-12)


def tempered(probabilities: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """p~(x; T) of 002 Sec. 3.1 (ii): softmax(z(x)/T) restricted to the top-k set S(x), from the
    probabilities (z = log p + c gives p_i^(1/T) / sum_{j in S(x)} p_j^(1/T) exactly). T = 1: the
    renormalized probabilities themselves (:func:`renormalized`, bit for bit)."""
    if temperature == 1.0:
        return renormalized(probabilities)
    p = np.asarray(probabilities, dtype=np.float64)
    # each row over its largest first (the ratios are all that count): a small T cannot underflow a whole row
    top = p.max(axis=-1, keepdims=True)
    scaled = np.divide(p, top, out=np.zeros_like(p), where=top > 0)
    return renormalized(scaled ** (1.0 / temperature))


def tae(top_k_probabilities: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Eq. 1: normalised entropy of each row's renormalized top-k probabilities, in [0, 1] (smoothed with
    temperature T first, Sec. 3.1 (ii): :func:`tempered`)."""
    p = tempered(top_k_probabilities, temperature)
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


def token_tae(probabilities: list[float], temperature: float = 1.0) -> float:
    """Eq. 1 for one token's top-k probabilities, in plain floats (:func:`tae` to within TAE_ROUNDING), at
    temperature T as :func:`tempered` smooths them."""
    k = len(probabilities)
    if k < 2:
        return 0.0
    if temperature != 1.0:
        top = max(probabilities)
        power = 1.0 / temperature
        probabilities = [(p / top) ** power for p in probabilities] if top > 0 else [0.0] * k
    total = max(sum(probabilities), 1e-12)
    entropy = 0.0
    for p in probabilities:
        p /= total
        if p > 0:
            entropy -= p * math.log(p)
    return entropy / math.log(k)


def margin(top_k_probabilities: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """002 Sec. 3.1's probability margin m(x) = p~max - p~2nd of each row's p~(x; T) (:func:`tempered`), in
    [0, 1]; with one expert per token (k = 1) p~2nd is 0."""
    p = np.sort(tempered(top_k_probabilities, temperature), axis=-1)
    return p[..., -1] - (p[..., -2] if p.shape[-1] > 1 else 0.0)


def tae_open(top_k_probabilities: np.ndarray, tau: float, temperature: float = 1.0,
             gamma: float = math.inf) -> np.ndarray:
    """The TAE gate of Sec. 3.1 for many tokens: open where TAE > tau and, with the margin on (gamma <= 1;
    m never exceeds 1, so a larger gamma bars nothing), m < gamma."""
    open_gate = tae(top_k_probabilities, temperature) > tau
    if gamma <= 1.0:
        open_gate &= margin(top_k_probabilities, temperature) < gamma
    return open_gate


class TaeGate:
    """The TAE gate of one layer's tokens (Sec. 3.1): ``gate[t]`` is True where token t's TAE exceeds tau
    (and, with the margin on, its margin is below gamma): :func:`tae_open` token by token.

    A token is looked at only when asked about (Alg. 1 asks only for a token with a replacement to make).
    Its TAE in plain floats settles the comparison unless it lies within TAE_ROUNDING of tau; then
    numpy's :func:`tae` of the layer's tokens decides, as it always did. The margin, when on, is numpy's
    :func:`margin` of the layer's tokens, as :func:`tae_open` has it.
    """

    def __init__(self, probabilities: np.ndarray, tau: float, temperature: float = 1.0,
                 gamma: float = math.inf) -> None:
        self.probabilities, self.tau, self.temperature, self.gamma = probabilities, tau, temperature, gamma
        self._exact: np.ndarray | None = None
        self._below_margin: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.probabilities)

    def __getitem__(self, token: int) -> bool:
        value = token_tae(self.probabilities[token].tolist(), self.temperature)
        if abs(value - self.tau) > TAE_ROUNDING:
            open_gate = value > self.tau
        else:
            if self._exact is None:
                self._exact = tae(self.probabilities, self.temperature) > self.tau
            open_gate = bool(self._exact[token])
        if open_gate and self.gamma <= 1.0:
            if self._below_margin is None:
                self._below_margin = margin(self.probabilities, self.temperature) < self.gamma
            return bool(self._below_margin[token])
        return open_gate


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


def substitute_buddies_one(row: list[int], resident: set[int], in_flight: set[int], buddies: list[list[int]],
                           search_limit: int, rho: int = 0) -> list[tuple[int, int, int]]:
    """:func:`substitute_buddies`'s picks for one token's experts ``row`` (on the GPU: resident or
    ``in_flight``), before its gate: the caller asks the gate only when there are picks."""
    used = set(row)
    picks = []
    for slot, e in enumerate(row):
        if e in resident or e in in_flight:
            continue
        if rho and len(picks) >= rho:
            break
        # the first of e's first H buddies that is resident and not yet in U_t
        for b in buddies[e][:search_limit]:
            if b in resident and b not in used:
                picks.append((0, slot, b))
                used.add(b)
                break
    return picks


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
