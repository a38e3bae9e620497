"""BuddyMoE's offline calibration (002_95ae8307b42d2a8d.txt, Sec. 3.2-3.3): the co-activation counts, the
buddy lists of Eq. 4-6 and the per-layer CFT schedule ``alpha_schedule``.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moesim.errors import ConfigError
from moesim.policy.catalog.buddymoe.runtime import renormalized


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
