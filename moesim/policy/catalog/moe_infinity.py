"""MoE-Infinity baseline: request-level activation tracing for prefetch and caching.

MoE-Infinity (Xue et al., arXiv 2401.14361; cited as a baseline in
004_91681cee0e4a4add.txt Sec. 6.1 and 002_95ae8307b42d2a8d.txt Sec. 2.3)
traces, per request, an Expert Activation Matrix (EAM): layers x experts,
tokens of the request routed to each expert so far. Finished requests' EAMs
form the EAM collection (EAMC). While a forward pass runs, the EAM of the
requests in the batch is matched against the EAMC by cosine similarity; the
best match predicts the coming layers: expert e of layer l' (l < l' <= l +
``lookahead``) gets priority ``ratio(l', e) * (1 - (l' - l) / L)``, its share
of the matched EAM's tokens at l' discounted by distance, and the
highest-priority experts are prefetched. The cache is one model-wide pool of
expert slots (any layer may take any free slot; ``CachePolicy.layout = "pool"``)
with layer-aware eviction: the victim is the resident expert of lowest priority
``ratio(l, e) * (1 - l / L)`` over all layers, its share of the current requests'
activations at its layer discounted by depth, the same discount as the prefetch
priority (experts of early layers are kept: prefetching has the least time to
hide their loads); ties go to the run-wide count, then to the later layer. The
pool starts with the first experts of every layer, spread evenly.

EAMC seeding (``prefetch.calibration``). MoE-Infinity builds its EAMC offline
from traced requests before serving, and 004 Sec. 6.2 notes that its prefetch
"requires historical router's data" and loses accuracy "when records are
incomplete"; so the collection is seeded from a calibration trace by default:

* ``others`` (default): the replayed trace's requests, leave-one-out: the EAMC
  holds every request's complete EAM, and a batch is matched only against the
  EAMs of requests it does not hold, so no request predicts itself from its own
  future routing (a stand-in for a held-out trace of the same workload);
* a trace path: that trace's requests (a held-out calibration trace of the
  same model);
* ``none``: the collection starts empty and fills online.

The report says which. The EAMC keeps at most ``eamc_size`` requests (first
in, first out; a seed larger than that keeps its lowest request ids); a
finished request already in the collection is not added twice. Each token row's request
comes with the view (``LayerView.requests``); a request counts as finished
after its last step in the trace, read once from the trace file: the moment a
serving system sees its end of sequence.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from moesim.errors import ConfigError, TraceFormatError
from moesim.policy.base import LayerView, RunContext
from moesim.policy.cache import CachePolicy
from moesim.policy.catalog.importance import ObservingSystem
from moesim.policy.prefetch import Prefetch
from moesim.policy.state import even_quotas
from moesim.policy.systems import SystemSpec, register_component, register_system
from moesim.trace.io import read_table


def request_eams(path: str, num_layers: int, num_experts: int) -> dict[int, np.ndarray]:
    """Every request's complete EAM from a trace file."""
    table = read_table(path, ["request", "layer", "experts"])
    requests = table.column("request").to_numpy().astype(np.int64)
    layers = table.column("layer").to_numpy().astype(np.int64)
    experts = table.column("experts").combine_chunks()
    width = experts.type.list_size
    flat = experts.flatten().to_numpy().reshape(-1, width).astype(np.int64)
    out: dict[int, np.ndarray] = {}
    for r in np.unique(requests):
        rows = requests == r
        cells = (layers[rows, None] * num_experts + flat[rows]).ravel()
        out[int(r)] = np.bincount(cells, minlength=num_layers * num_experts).reshape(num_layers, num_experts)
    return out


def row_owners(view: LayerView) -> np.ndarray:
    """Request id of every token row (an executor that gives none serves one request, id 0)."""
    return view.requests if view.requests is not None else np.zeros(view.tokens, dtype=np.int64)


@dataclass
class ActivationTracker:
    """EAMs of the requests being served and the EAMC of finished ones (shared by prefetch and cache).

    EAM cells are token counts (whole numbers in float64), so sums of them are exact in any order: the
    batch's EAM is kept up to date as layers are observed instead of summed afresh for every layer, and
    ``row_version[layer]`` counts the changes of each layer's counts (the batch's and the run's), so a
    reader recomputes only the rows that moved.
    """

    num_layers: int
    num_experts: int
    eamc_size: int
    #: request -> its last step (its end of sequence)
    last_step: dict[int, int]
    live: dict[int, np.ndarray] = field(default_factory=dict)
    #: normalised EAMs, flattened, oldest first
    collection: deque = field(default_factory=deque)
    #: the request each collection entry came from (None: a held-out calibration trace's)
    owners: deque = field(default_factory=deque)
    total: np.ndarray | None = None
    row_version: np.ndarray | None = None
    #: changes whenever the batch EAM is summed afresh (another set of requests)
    batch_generation: int = 0
    _seen: tuple[int, int] = (-1, -1)
    _step: int = -1
    _ids_at: tuple[int, int] = (-1, -1)
    _ids: tuple[int, ...] = ()
    #: the batch whose EAM is kept (its requests) and that EAM: the sum of their live EAMs
    _batch_ids: tuple[int, ...] | None = None
    _batch: np.ndarray | None = None
    #: the collection stacked as one matrix (None: rebuilt at the next match)
    _stack: np.ndarray | None = None
    #: observations that moved counts so far, and what the latest one added: (layer, experts, tokens of
    #: each), added to the run's counts and to the kept batch EAM alike (None: not to the batch EAM alike)
    observations: int = 0
    last_added: tuple[int, list[int], list[int]] | None = None

    def __post_init__(self) -> None:
        if self.row_version is None:
            self.row_version = np.zeros(self.num_layers, dtype=np.int64)

    @classmethod
    def from_trace(cls, path: str, num_layers: int, num_experts: int, eamc_size: int) -> "ActivationTracker":
        table = read_table(path, ["step", "request"])
        requests, row_of = np.unique(table.column("request").to_numpy(), return_inverse=True)
        last = np.full(requests.size, -1, dtype=np.int64)
        np.maximum.at(last, row_of, table.column("step").to_numpy())
        last_step = dict(zip(requests.tolist(), last.tolist()))
        tracker = cls(num_layers, num_experts, eamc_size, last_step)
        tracker.total = np.zeros((num_layers, num_experts))
        return tracker

    def add_to_collection(self, eam: np.ndarray, request: int | None = None) -> None:
        norm = float(np.linalg.norm(eam))
        if norm == 0 or self.eamc_size <= 0 or (request is not None and request in self.owners):
            return
        self.collection.append(eam.ravel() / norm)
        self.owners.append(request)
        while len(self.collection) > self.eamc_size:
            self.collection.popleft()
            self.owners.popleft()
        self._stack = None

    def batch_ids(self, view: LayerView) -> tuple[int, ...]:
        """The distinct requests of the view's token rows, ascending (found once per layer)."""
        if (view.step, view.layer) != self._ids_at:
            owners = row_owners(view)
            self._ids = (int(owners[0]),) if owners.size == 1 else tuple(np.unique(owners).tolist())
            self._ids_at = (view.step, view.layer)
        return self._ids

    def observe(self, view: LayerView) -> None:
        """Add this layer's routing to the batch's EAMs; retire requests whose last step has passed."""
        seen = (view.step, view.layer)
        if seen == self._seen:  # the cache and the prefetch both observe every layer
            return
        self._seen = seen
        if view.step != self._step:
            self._step = view.step
            for r in [r for r in self.live if self.last_step.get(r, -1) < view.step]:
                self.add_to_collection(self.live.pop(r), r)
                if self._batch_ids is not None and r in self._batch_ids:
                    self._batch_ids = None  # the kept batch EAM no longer sums live EAMs
        layer, ids = view.layer, self.batch_ids(view)
        counts = np.bincount(view.experts.ravel(), minlength=self.num_experts)  # tokens per expert
        if len(ids) == 1:
            per_request = [(ids[0], counts)]
        else:
            owners = row_owners(view)
            per_request = [(r, np.bincount(view.experts[owners == r].ravel(), minlength=self.num_experts))
                           for r in ids]
        for r, routed in per_request:
            eam = self.live.get(r)
            if eam is None:
                eam = self.live[r] = np.zeros((self.num_layers, self.num_experts))
            eam[layer] += routed
            if self._batch_ids is not None and r in self._batch_ids:
                self._batch[layer] += routed
        assert self.total is not None and self.row_version is not None
        self.total[layer] += counts
        self.row_version[layer] += 1
        self.observations += 1
        batch = self._batch_ids
        # the view's distinct experts and their tokens: what this layer added, expert by expert
        self.last_added = (layer, view.active, view.counts) \
            if batch is not None and all(r in batch for r in ids) else None

    def batch_eam(self, view: LayerView) -> np.ndarray:
        """The sum of the live EAMs of the view's requests (kept between layers; read-only)."""
        ids = self.batch_ids(view)
        if ids != self._batch_ids or self._batch is None:
            out = np.zeros((self.num_layers, self.num_experts))
            for r in ids:
                if r in self.live:
                    out += self.live[r]
            self._batch_ids, self._batch = ids, out
            self.batch_generation += 1
        return self._batch

    def best_match(self, eam: np.ndarray, exclude: frozenset[int] = frozenset()) -> np.ndarray | None:
        """The EAMC entry most similar to ``eam`` (cosine), as a layers x experts matrix, leaving out the
        entries of the requests in ``exclude`` (the batch's own: leave-one-out)."""
        kept = [i for i, owner in enumerate(self.owners) if owner is None or owner not in exclude]
        if not kept:
            return None
        norm = float(np.linalg.norm(eam))
        if norm == 0:
            return None
        if self._stack is None:
            self._stack = np.stack(list(self.collection))
        entries = self._stack if len(kept) == len(self.owners) else self._stack[kept]
        similarity = entries @ (eam.ravel() / norm)
        return self.collection[kept[int(np.argmax(similarity))]].reshape(self.num_layers, self.num_experts)


_TRACKERS: dict[int, ActivationTracker] = {}
#: ``prefetch.calibration`` value for leave-one-out seeding from the replayed trace
OTHERS = "others"


def calibration_eams(path: str, num_layers: int, num_experts: int) -> dict[int, np.ndarray]:
    """Every request's EAM of a calibration trace, refused with one line when it cannot be read or does
    not fit the model."""
    try:
        table = read_table(path, ["layer", "experts"])
    except (OSError, ValueError, KeyError, TraceFormatError) as err:
        reason = err.detail if isinstance(err, TraceFormatError) else err
        raise ConfigError(f"cannot read calibration trace {path}: {reason}", field="prefetch.calibration",
                          fix="give a moesim trace of the replayed model, 'others' or 'none'") from None
    layers = table.column("layer").to_numpy()
    experts = table.column("experts").combine_chunks().flatten().to_numpy()
    if (layers.size and int(layers.max()) >= num_layers) or (experts.size and int(experts.max()) >= num_experts):
        raise ConfigError(f"calibration trace {path} routes beyond the model's {num_layers} layers x {num_experts} "
                          f"experts", field="prefetch.calibration",
                          fix="give a trace of the replayed model, 'others' or 'none'")
    return request_eams(path, num_layers, num_experts)


@register_component
@dataclass
class EamPrefetch(Prefetch):
    """Activation-matrix matching prefetch (MoE-Infinity); see the module docstring."""

    name = "eam-match"
    #: finished requests' EAMs kept for matching
    eamc_size: int = 100
    #: later layers of the same pass to prefetch for
    lookahead: int = 2
    #: experts per target layer at most (0: the model's top-k)
    per_layer: int = 0
    #: what seeds the EAMC: "others" (the replayed trace, leave-one-out), a trace path, or "none" (start empty)
    calibration: str = OTHERS
    tracker: ActivationTracker | None = field(default=None, repr=False)
    _per_layer: int = 0

    def configure(self, ctx: RunContext) -> None:
        if ctx.trace_path is None:
            raise ConfigError("eam-match needs the trace file for each request's end of sequence", field="prefetch",
                              fix="replay from a trace file")
        m = ctx.model
        self.tracker = ActivationTracker.from_trace(ctx.trace_path, m.num_layers, m.num_experts, self.eamc_size)
        self._per_layer = self.per_layer or m.top_k
        self._seed(ctx)
        _TRACKERS[id(ctx)] = self.tracker

    def _seed(self, ctx: RunContext) -> None:
        """Fill the EAMC before the run (see the module docstring)."""
        tracker, m = self.tracker, ctx.model
        assert tracker is not None and ctx.trace_path is not None
        source = self.calibration.strip()
        if source.lower() in ("", "none"):
            ctx.notes.append("eam-match: EAM collection starts empty and fills with the replayed trace's finished "
                             "requests (prefetch.calibration=none)")
            return
        leave_one_out = source.lower() == OTHERS
        path = ctx.trace_path if leave_one_out else source
        eams = calibration_eams(path, m.num_layers, m.num_experts)
        for request in sorted(eams)[:max(self.eamc_size, 0)]:
            tracker.add_to_collection(eams[request], request if leave_one_out else None)
        seeded = len(tracker.collection)
        if leave_one_out:
            ctx.notes.append(f"eam-match: EAM collection seeded with {seeded} request(s) of the replayed trace, each "
                             f"batch matched only against requests it does not hold (leave-one-out; set "
                             f"prefetch.calibration=PATH for a held-out trace, or none to start empty)")
        else:
            ctx.notes.append(f"eam-match: EAM collection seeded with {seeded} request(s) of {path}")

    def observe(self, view: LayerView) -> None:
        assert self.tracker is not None
        self.tracker.observe(view)

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        tracker = self.tracker
        assert tracker is not None
        match = tracker.best_match(tracker.batch_eam(view), frozenset(tracker.batch_ids(view)))
        if match is None:
            return []
        layers = tracker.num_layers
        ranked: list[tuple[float, int, int]] = []
        for target in range(view.layer + 1, min(view.layer + 1 + self.lookahead, layers)):
            row = match[target]
            if row.sum() <= 0:
                continue
            priority = row / row.sum() * (1 - (target - view.layer) / layers)
            best = [e for e in np.argsort(-priority, kind="stable")[:self._per_layer] if priority[e] > 0]
            ranked += [(-float(priority[e]), target, int(e)) for e in best]
        return [(target, e) for _, target, e in sorted(ranked)]


@register_component
@dataclass
class RequestLFUCache(CachePolicy):
    """Model-wide pool, layer-aware least-frequently-used over the current requests' EAM (MoE-Infinity).

    The priorities of every layer are kept as two layers x experts matrices; a row is recomputed only when
    the tracker's counts of that layer have moved (``ActivationTracker.row_version``) or the batch changed.
    """

    name = "request-lfu"
    layout = "pool"
    eamc_size: int = 0
    tracker: ActivationTracker | None = field(default=None, repr=False)
    _start: list[int] = field(default_factory=list, repr=False)
    #: (by the current requests, by the whole run) priority of every expert of every layer
    _current: np.ndarray | None = field(default=None, repr=False)
    _total: np.ndarray | None = field(default=None, repr=False)
    #: the tracker's row versions and batch generation the kept priorities were computed from
    _versions: np.ndarray | None = field(default=None, repr=False)
    _generation: int = -1
    #: each layer's depth weight 1 - layer / L, as a column
    _depth: np.ndarray | None = field(default=None, repr=False)
    #: the resident experts in eviction order, kept between pool evictions
    _order: "EvictionOrder | None" = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        tracker = _TRACKERS.get(id(ctx))
        if tracker is None and ctx.trace_path is not None:
            m = ctx.model
            tracker = ActivationTracker.from_trace(ctx.trace_path, m.num_layers, m.num_experts, self.eamc_size)
        self.tracker = tracker
        pool = ctx.pool if ctx.pool is not None else sum(ctx.capacity)
        self._start = even_quotas(pool, len(ctx.capacity), ctx.model.num_experts)
        layers = ctx.model.num_layers
        self._depth = np.array([[1 - layer / layers] for layer in range(layers)])
        self._current = self._total = self._versions = None
        self._generation = -1
        self._order = EvictionOrder(tracker, layers, ctx.model.num_experts) if tracker is not None else None

    def initial(self, layer: int, capacity: int) -> list[int]:
        return list(range(min(self._start[layer], capacity))) if self._start else []

    def observe(self, view: LayerView) -> None:
        if self.tracker is not None:
            self.tracker.observe(view)

    def touch(self, view: LayerView, used: list[int]) -> None:
        self.observe(view)

    def _priorities(self, view: LayerView) -> tuple[np.ndarray, np.ndarray]:
        """(priority by the current requests, by the whole run) of every expert of every layer: each
        row's share of its activations times the layer's depth weight ``1 - layer / L``."""
        tracker = self.tracker
        if tracker is None or tracker.total is None or self._depth is None:
            flat = np.zeros((view.cache.num_layers, view.cache_experts()))
            return flat, flat
        batch = tracker.batch_eam(view)
        if self._current is None or self._generation != tracker.batch_generation:
            self._current, self._total = np.zeros(batch.shape), np.zeros(batch.shape)
            stale = np.arange(batch.shape[0])
        else:
            stale = np.flatnonzero(self._versions != tracker.row_version)
        if stale.size == 1:  # the layer just observed
            layer = int(stale[0])
            depth = float(self._depth[layer, 0])
            self._current[layer] = row_share(batch[layer], depth)
            self._total[layer] = row_share(tracker.total[layer], depth)
        elif stale.size:
            depth = self._depth[stale]
            self._current[stale] = share(batch[stale], depth)
            self._total[stale] = share(tracker.total[stale], depth)
        if stale.size:
            self._versions = tracker.row_version.copy()
            self._generation = tracker.batch_generation
        return self._current, self._total

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        candidates = [e for e in view.cache.resident[layer] if e not in protected]
        current, total = self._priorities(view)
        ranked = zip(current[layer, candidates].tolist(), total[layer, candidates].tolist(), candidates)
        return [e for *_, e in sorted(ranked)[:n]]

    def pool_victims(self, view: LayerView, n: int, protected: set[tuple[int, int]],
                     layer: int) -> list[tuple[int, int]]:
        """The ``n`` resident experts of least (current priority, run priority, later layer, lower id)
        outside ``protected``, over every layer; :class:`EvictionOrder` keeps that order between calls,
        :meth:`ranked_victims` ranks every resident expert afresh (the same answer)."""
        if n <= 0:
            return []
        order = self._order
        if order is not None and order.sync(view):
            return order.least(n, protected)
        return self.ranked_victims(view, n, protected)

    def ranked_victims(self, view: LayerView, n: int, protected: set[tuple[int, int]]) -> list[tuple[int, int]]:
        """:meth:`pool_victims` from every resident expert's priorities, ranked afresh."""
        if n <= 0:
            return []
        current, total = self._priorities(view)
        state = view.cache
        width = current.shape[1]
        cells = resident_cells(state, width)  # layer * width + expert of every resident expert, ascending
        guarded = sorted(l * width + e for l, e in protected if e in state.resident[l])
        if guarded:
            cells = np.delete(cells, np.searchsorted(cells, guarded))
        current_of = current.ravel()[cells]
        if n < cells.size:  # only cells at most the n-th least current priority can be chosen
            near = np.flatnonzero(current_of <= np.partition(current_of, n - 1)[n - 1])
            cells, current_of = cells[near], current_of[near]
        layer_of, expert_of = np.divmod(cells, width)
        # lowest current priority, then lowest run priority, then the later layer, then the lower id
        order = np.lexsort((expert_of, -layer_of, total.ravel()[cells], current_of))[:n]
        return list(zip(layer_of[order].tolist(), expert_of[order].tolist()))


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
        self.versions: np.ndarray | None = None

    def sync(self, view: LayerView) -> bool:
        """Catch up with the tracker's counts and the pool's residents; False when only a from-scratch
        ranking can answer (no pool, or counts past ``2 ** count_bits``)."""
        tracker, state = self.tracker, view.cache
        batch = tracker.batch_eam(view)
        mirror = state.mirror
        if mirror is None or tracker.total is None:
            return False
        if tracker.batch_generation != self.generation or mirror is not self.mirror or mirror.journal is None:
            self._rebuild(batch, tracker.total, state)
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
                rows = np.flatnonzero(self.versions != tracker.row_version).tolist()
                self._count(batch, tracker.total, rows)
                self._rank(rows, resident)
                dirty.update(rows)
                self.versions = tracker.row_version.copy()
            self.observations = tracker.observations
        if dirty:
            self._heads(dirty)
        return self.exact

    def _residents(self, journal: list[tuple[int, int]], dirty: set[int]) -> None:
        """Replay the journal's loads and evictions, in order, on the ranked keys."""
        keys, ranked = self.keys, self.ranked
        for layer, expert in journal:
            if expert >= 0:
                insort(ranked[layer], keys[layer][expert])
            else:
                keep = ranked[layer]
                del keep[bisect_left(keep, keys[layer][~expert])]
        dirty.update(layer for layer, _ in journal)

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
        self.versions = self.tracker.row_version.copy()
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


def share(rows: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Each row's share of its activations times its depth weight (rows with none stay 0); activation
    counts, so the shares do not depend on which rows are computed together."""
    sums = rows.sum(axis=1, keepdims=True)
    return np.where(sums > 0, rows / np.where(sums > 0, sums, 1.0) * depth, rows)


def row_share(row: np.ndarray, depth: float) -> np.ndarray:
    """:func:`share` of one row (the same numbers, without the matrix's broadcasting)."""
    total = row.sum()
    return row / total * depth if total > 0 else row


def resident_cells(state, width: int) -> np.ndarray:
    """``layer * width + expert`` of every resident expert, ascending (from the pool's mask when it keeps one)."""
    mask = state.mirror.resident_mask if state.mirror is not None else resident_mask(state.resident, width)
    cells = np.flatnonzero(mask)
    if mask.shape[1] != width:  # a mirror mask is only as wide as the largest id it has seen
        layer_of, expert_of = np.divmod(cells, mask.shape[1])
        cells = layer_of * width + expert_of
    return cells


def resident_mask(resident: list[set[int]], width: int) -> np.ndarray:
    """Layers x experts, True where resident (a cache without a pool keeps no mask of its own)."""
    mask = np.zeros((len(resident), width), dtype=bool)
    for layer, experts in enumerate(resident):
        mask[layer, list(experts)] = True
    return mask


class MoEInfinitySystem(ObservingSystem):
    """Prefetch and cache share one activation tracker (configured in that order)."""

    def configure(self, ctx: RunContext) -> None:
        self.prefetch.configure(ctx)
        for role, component in self.components.items():
            if role != "prefetch":
                component.configure(ctx)
        self.notes = ctx.notes
        self.rewrites = {}
        _TRACKERS.pop(id(ctx), None)


register_system("moe-infinity", SystemSpec(
    "MoE-Infinity: request-level expert activation matrices; prefetch by matching past requests' matrices, "
    "least-frequently-used eviction over the current requests' activations, every expert on the GPU",
    cache="request-lfu", assign="gpu", prefetch="eam-match", system_class=MoEInfinitySystem, runtime="pytorch-eager"))
