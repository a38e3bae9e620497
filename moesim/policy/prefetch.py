"""Prefetch components: what to load ahead of need, for which layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.policy.base import Component, LayerView, RunContext
from moesim.policy.future import FutureRouting


def ranked_predictions(predicted: list[np.ndarray]) -> list[int]:
    """Experts predicted by any token, most tokens first, then best position in a token's list, then id."""
    if len(predicted) == 1:
        row = np.asarray(predicted[0]).tolist()
        if len(set(row)) == len(row):  # one token, no repeats: one vote each, positions in list order
            return row
    rows = [np.asarray(row) for row in predicted]
    if len(rows) > 16:
        return _ranked_at_once(rows)
    votes: dict[int, list[int]] = {}
    for row in rows:
        for position, e in enumerate(row.tolist()):
            entry = votes.setdefault(int(e), [0, position])
            entry[0] += 1
            entry[1] = min(entry[1], position)
    return sorted(votes, key=lambda e: (-votes[e][0], votes[e][1], e))


def _ranked_at_once(rows: list[np.ndarray]) -> list[int]:
    """:func:`ranked_predictions` of many tokens with array operations (a prefill's thousands)."""
    flat = np.concatenate(rows).astype(np.int64)
    if not flat.size:
        return []
    lengths = np.array([len(row) for row in rows])
    positions = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # place in its row
    votes = np.bincount(flat)
    best = np.full(votes.size, np.iinfo(np.int64).max)
    np.minimum.at(best, flat, positions)
    ids = np.flatnonzero(votes)
    return ids[np.lexsort((ids, best[ids], -votes[ids]))].tolist()


class Prefetch(Component):
    role = "prefetch"

    @property
    def issued_per_layer(self) -> int | None:
        """The most experts one layer's plan asks this prefetcher to load, known once ``for_model`` has run
        (a system sizing a prefetch buffer reads it before the run: DALI's ``cache.prefetch_slots``); None
        where no parameter fixes it (it depends on how many experts a batch's tokens route to or predict)."""
        return None

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        """(layer, expert) pairs worth loading now, most wanted first."""
        return []


@dataclass
class NoPrefetch(Prefetch):
    name = "none"

    @property
    def issued_per_layer(self) -> int | None:
        return 0


@dataclass
class PerfectPrefetch(Prefetch):
    """Loads exactly the experts the next layer to run will use (known from the trace): a bound."""

    name = "perfect"
    _future: FutureRouting | None = field(default=None, repr=False)

    # issued_per_layer stays None: the next layer's routed experts, as many as the batch's tokens route to

    def configure(self, ctx: RunContext) -> None:
        self._future = FutureRouting.load(ctx.trace_path, ctx.model)

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        assert self._future is not None
        nxt = self._future.next_position(view.step, view.layer)
        if nxt is None:
            return []
        step, layer = nxt
        return [(layer, e) for e in self._future.routed[(step, layer)]]


@dataclass
class LastTokenPredictor:
    """Trace-only stand-in for a next-layer predictor column: each token is predicted to route, at the
    next layer, as its request's previous token did there (temporal locality of experts, 003 Fig. 8).

    Call :meth:`predict` once per layer view, in trace order; it also records that layer's routing.
    """

    _last: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def predict(self, view: LayerView) -> list[np.ndarray]:
        """For every token row of ``view``, the experts it is predicted to use at ``view.layer + 1``."""
        requests = view.requests if view.requests is not None else np.zeros(view.tokens, dtype=np.int64)
        empty = np.empty(0, dtype=np.int64)
        predicted = [self._last.get((int(r), view.layer + 1), empty) for r in requests]
        for r, experts in zip(requests.tolist(), view.experts):
            self._last[(r, view.layer)] = experts
        return predicted
