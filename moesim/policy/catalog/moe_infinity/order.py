"""MoE-Infinity's model-wide eviction order, kept between calls (:class:`EvictionOrder`).

The ranking is :class:`~moesim.policy.catalog.moe_infinity.RequestLFUCache`'s (see the package docstring); this
module only keeps it up to date cheaply as routing is observed and experts are loaded and evicted.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heappop, heappush

import numpy as np

from moesim.policy.base import LayerView
from moesim.policy.catalog.moe_infinity.eam import ActivationTracker, moved_rows


class EvictionOrder:
    """The pool's resident experts in :class:`RequestLFUCache` eviction order, kept up to date between calls.

    The order is ascending (current priority, run priority, -layer, expert), each priority an expert's
    activation count over its layer's total times the layer's depth weight. Within one layer both
    shares are counts over the same total and weight, so they rank the layer's experts as the counts do
    (distinct whole counts below ``2 ** count_bits`` give distinct, equally ordered floats): a layer's
    experts are ranked by one integer per expert, ``(batch count, run count, expert)`` packed, and each
    layer keeps its resident experts' keys sorted, updated key by key as the tracker observes routing
    and as the pool's journal (:class:`~moesim.policy.state.PoolMirror`) reports experts loaded and
    evicted. Across layers the priorities themselves are compared, computed as the from-scratch ranking
    computes them, but only for each layer's least expert (its head, in one sorted list) and, while
    victims are taken, for the next experts of the layers reached.
    """

    def __init__(self, tracker: ActivationTracker, num_layers: int, num_experts: int) -> None:
        self.tracker = tracker
        self.expert_bits = max(num_experts - 1, 1).bit_length()
        self.count_bits = (63 - self.expert_bits) // 2
        self.batch_shift = self.count_bits + self.expert_bits
        self.expert_mask, self.count_mask = (1 << self.expert_bits) - 1, (1 << self.count_bits) - 1
        #: one batch token and one run token of an expert, in its packed key
        self.unit = (1 << self.batch_shift) | (1 << self.expert_bits)
        self.depth = [1 - layer / num_layers for layer in range(num_layers)]
        #: per layer, every expert's packed key
        self.keys: list[list[int]] = []
        #: each layer's batch and run totals
        self.batch_sum: list[int] = []
        self.run_sum: list[int] = []
        #: False once a count reaches 2 ** count_bits (the from-scratch ranking answers from then on)
        self.exact = True
        #: per layer, its resident experts' keys ascending
        self.ranked: list[list[int]] = []
        self.heads: list[tuple[float, float, int, int] | None] = [None] * num_layers
        #: the heads of the layers that hold resident experts, ascending
        self.order: list[tuple[float, float, int, int]] = []
        #: the pool whose journal this order follows
        self.mirror = None
        self.generation = -1
        self.observations = -1
        self.versions: list[int] | None = None

    def sync(self, view: LayerView) -> bool:
        """Catch up with the tracker's counts and the pool's residents; False when only a from-scratch
        ranking can answer (no pool, or counts past ``2 ** count_bits``)."""
        tracker, state = self.tracker, view.cache
        generation = tracker.follow_batch(view)  # the matrices themselves are read only to count afresh
        mirror = state.mirror
        if mirror is None or not tracker.counts_run:
            return False
        if generation != self.generation or mirror is not self.mirror or mirror.journal is None:
            self._rebuild(tracker.batch_eam(view), tracker.total, state)
            return self.exact
        dirty: set[int] = set()
        journal, resident = mirror.journal, state.resident
        if journal:
            self._residents(journal, dirty)
            journal.clear()
        if tracker.observations != self.observations:
            added = tracker.last_added
            if added is not None and tracker.observations == self.observations + 1:
                self._add(*added, resident[added[0]])
                dirty.add(added[0])
            else:
                rows = moved_rows(self.versions, tracker.row_version)
                self._count(tracker.batch_eam(view), tracker.total, rows)
                self._rank(rows, resident)
                dirty.update(rows)
                self.versions = list(tracker.row_version)
            self.observations = tracker.observations
        if dirty:
            self._heads(dirty)
        return self.exact

    def _residents(self, journal: list[tuple[int, int]], dirty: set[int]) -> None:
        """Replay the journal's loads and evictions, in order, on the ranked keys."""
        keys, ranked = self.keys, self.ranked
        last = -1
        for layer, expert in journal:
            if layer != last:  # a journal runs layer by layer: each layer's lists looked up once per run
                last, keep, layer_keys = layer, ranked[layer], keys[layer]
                dirty.add(layer)
            if expert >= 0:
                insort(keep, layer_keys[expert])
            else:
                del keep[bisect_left(keep, layer_keys[~expert])]

    def _add(self, layer: int, experts: list[int], tokens: list[int], resident: set[int]) -> None:
        """One observed layer's tokens per expert, added to the keys (and the ranked keys of residents)."""
        keys, keep, unit = self.keys[layer], self.ranked[layer], self.unit
        for expert, count in zip(experts, tokens):
            old = keys[expert]
            new = keys[expert] = old + count * unit
            if expert in resident:
                del keep[bisect_left(keep, old)]
                insort(keep, new)
        moved = sum(tokens)
        self.batch_sum[layer] += moved
        self.run_sum[layer] += moved
        self.exact = self.exact and self.run_sum[layer] <= self.count_mask

    def _rebuild(self, batch: np.ndarray, total: np.ndarray, state) -> None:
        layers = len(self.depth)
        self.keys = [[] for _ in range(layers)]
        self.batch_sum, self.run_sum, self.exact = [0] * layers, [0] * layers, True
        self._count(batch, total, list(range(layers)))
        self.mirror = state.mirror
        self.mirror.journal = []
        self.generation, self.observations = self.tracker.batch_generation, self.tracker.observations
        self.versions = list(self.tracker.row_version)
        self.ranked = [[] for _ in range(layers)]
        self._rank(range(layers), state.resident)
        self.heads, self.order = [None] * layers, []
        self._heads(range(layers))

    def _count(self, batch: np.ndarray, total: np.ndarray, rows: list[int]) -> None:
        """Pack the keys and totals of ``rows`` afresh from the counts."""
        if not rows:
            return
        b, t = batch[rows].astype(np.int64), total[rows].astype(np.int64)
        keys = (b << self.batch_shift) | (t << self.expert_bits) | np.arange(b.shape[1], dtype=np.int64)
        for layer, packed, in_batch, in_run in zip(rows, keys.tolist(), b.sum(axis=1).tolist(),
                                                   t.sum(axis=1).tolist()):
            self.keys[layer], self.batch_sum[layer], self.run_sum[layer] = packed, in_batch, in_run
            self.exact = self.exact and in_run <= self.count_mask

    def _rank(self, layers, resident: list[set[int]]) -> None:
        """Sort each of ``layers``' resident experts' keys afresh."""
        for layer in layers:
            self.ranked[layer] = sorted(map(self.keys[layer].__getitem__, resident[layer]))

    def _heads(self, layers) -> None:
        """Put each of ``layers``' least resident expert, with its priorities, in the sorted heads."""
        heads, order, ranked = self.heads, self.order, self.ranked
        for layer in layers:
            old = heads[layer]
            if old is not None:
                del order[bisect_left(order, old)]
            keep = ranked[layer]
            if keep:
                head = heads[layer] = self._priority(layer, keep[0])
                insort(order, head)
            else:
                heads[layer] = None

    def _priority(self, layer: int, key: int) -> tuple[float, float, int, int]:
        """(current priority, run priority, -layer, expert) as the from-scratch ranking computes them."""
        batch_sum, run_sum, depth = self.batch_sum[layer], self.run_sum[layer], self.depth[layer]
        return ((key >> self.batch_shift) / batch_sum * depth if batch_sum else 0.0,
                ((key >> self.expert_bits) & self.count_mask) / run_sum * depth if run_sum else 0.0,
                -layer, key & self.expert_mask)

    def least(self, n: int, protected: set[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ``n`` first resident experts outside ``protected``: the layers' ranked experts merged, a
        layer's next expert considered once its previous one is taken or passed over."""
        out: list[tuple[int, int]] = []
        order, ranked, waiting = self.order, self.ranked, []  # waiting: (priority, place in its layer's ranking)
        i, heads = 0, len(order)
        while True:
            if i < heads and (not waiting or order[i] < waiting[0][0]):
                priority, place = order[i], 0
                i += 1
            elif waiting:
                priority, place = heappop(waiting)
            else:
                break
            layer = -priority[2]
            cell = (layer, priority[3])
            if cell not in protected:
                out.append(cell)
                if len(out) == n:
                    break
            keep = ranked[layer]
            if place + 1 < len(keep):
                heappush(waiting, (self._priority(layer, keep[place + 1]), place + 1))
        return out
