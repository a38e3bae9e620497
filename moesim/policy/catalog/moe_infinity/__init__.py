"""MoE-Infinity baseline: request-level activation tracing for prefetch and caching.

MoE-Infinity (Xue et al., arXiv 2401.14361; cited as a baseline in
004_91681cee0e4a4add.txt Sec. 6.1 and 002_95ae8307b42d2a8d.txt Sec. 2.3)
traces, per request, an Expert Activation Matrix (EAM): layers x experts,
tokens of the request routed to each expert so far. Finished requests' EAMs
form the EAM collection (EAMC). While a forward pass runs, the EAM of the
requests in the batch is matched against the EAMC by the cosine similarity of
each layer's row, averaged over the layers (``ExpertTracer.find_most_similar``,
``moe_infinity/memory/expert_tracer.py``); the best match predicts the coming
layers: expert e of layer l' (l < l' <= l +
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

Where moesim departs from the public code (github.com/EfficientMoE/MoE-Infinity):

* prefetch breadth: ``ExpertPrefetcher.prefetch_experts`` enqueues every expert
  of every layer from the current one on (``ExpertPredictor.predict`` adds 1e-8
  to each count, decay ``1 - (l' - l) / (L + 1)``), in priority order; here
  ``lookahead`` layers and ``per_layer`` experts each, decay over ``L``. Each
  prediction empties the queue anyway (:class:`MoEInfinitySystem`), so only
  the head of the list ever moves; the bound keeps plans short;
* eviction: ``ArcherTaskPool::RemoveCachedSparseNode`` evicts GPU experts
  outside the current prediction's list by their in-cache visit counts; here
  the paper's activation-aware priority above (current requests' share,
  discounted by depth);
* EAMC: the code keeps ``trace_capacity`` = 1000 EAMs and replaces the one
  matched least often (``ExpertTracer.finish_entry``); here ``eamc_size`` = 100,
  first in, first out (seeded requests are the oldest and leave first);
* matching: ``find_most_similar`` overwrites the collection's layers up to
  the current one with uniform rows, so those layers rank no entry above
  another; here every observed layer counts, as the paper's partial-EAM
  matching describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.cache import CachePolicy
from moesim.policy.catalog.importance import ObservingSystem
from moesim.policy.catalog.moe_infinity.eam import ActivationTracker, calibration_eams, moved_rows
from moesim.policy.catalog.moe_infinity.order import EvictionOrder
from moesim.policy.prefetch import Prefetch
from moesim.policy.state import even_quotas
from moesim.policy.systems import SystemSpec, register_component, register_system

#: ``RunContext.shared`` key of the activation tracker the prefetch builds and the cache reads
TRACKER = "moe-infinity.tracker"
#: ``prefetch.calibration`` value for leave-one-out seeding from the replayed trace
OTHERS = "others"


@register_component
@dataclass
class EamPrefetch(Prefetch):
    """Activation-matrix matching prefetch (MoE-Infinity); see the module docstring."""

    name = "eam-match"
    #: finished requests' EAMs kept for matching (a choice of moesim's; MoE-Infinity's public code keeps up to
    #: ``trace_capacity`` = 1000 by default, ``moe_infinity/utils/config.py``)
    eamc_size: int = 100
    #: later layers of the same pass to prefetch for (a choice of moesim's; the public code lists every
    #: later layer, see the module docstring) (layers)
    lookahead: int = 2
    #: experts per target layer at most (0: the model's top-k; a choice of moesim's)
    per_layer: int = 0
    #: what seeds the EAMC: "others" (the replayed trace, leave-one-out), a trace path, or "none" (start empty)
    calibration: str = OTHERS
    #: the activation matrices, shared with the request-lfu cache (built in configure, not a parameter)
    tracker: ActivationTracker | None = field(default=None, repr=False, init=False)
    _per_layer: int = 0
    #: later layers one plan prefetches for, the lookahead cut at the model's last layer (set by for_model)
    _targets: int = 0

    def for_model(self, model: ModelSpec) -> None:
        # before the memory plan: a system's prefetch buffer is sized from issued_per_layer
        self._per_layer = self.per_layer or model.top_k
        self._targets = max(min(self.lookahead, model.num_layers - 1), 0)

    @property
    def issued_per_layer(self) -> int | None:
        """``per_layer`` (0: the model's top-k) experts for each of the ``lookahead`` later layers."""
        return self._per_layer * self._targets

    def configure(self, ctx: RunContext) -> None:
        if ctx.trace_path is None:
            raise ConfigError("eam-match needs the trace file for each request's end of sequence", field="prefetch",
                              fix="replay from a trace file")
        m = ctx.model
        self.tracker = ActivationTracker.from_trace(ctx.trace_path, m.num_layers, m.num_experts, self.eamc_size)
        self.for_model(m)
        self._seed(ctx)
        ctx.shared[TRACKER] = self.tracker

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
        exclude = frozenset(tracker.batch_ids(view))
        if not tracker.has_entries_besides(exclude):  # nothing to match: the batch EAM is not needed
            return []
        match = tracker.best_match(tracker.batch_eam(view), exclude)
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
    #: the prefetch's activation matrices when it runs beside this cache, else its own (not a parameter)
    tracker: ActivationTracker | None = field(default=None, repr=False, init=False)
    _start: list[int] = field(default_factory=list, repr=False)
    #: (by the current requests, by the whole run) priority of every expert of every layer
    _current: np.ndarray | None = field(default=None, repr=False)
    _total: np.ndarray | None = field(default=None, repr=False)
    #: the tracker's row versions and batch generation the kept priorities were computed from
    _versions: list[int] | None = field(default=None, repr=False)
    _generation: int = -1
    #: each layer's depth weight 1 - layer / L, as a column
    _depth: np.ndarray | None = field(default=None, repr=False)
    #: the resident experts in eviction order, kept between pool evictions
    _order: "EvictionOrder | None" = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        tracker = ctx.shared.get(TRACKER)
        if tracker is None and ctx.trace_path is not None:
            m = ctx.model
            # its own tracker needs no EAM collection: the cache ranks by the current requests' and the
            # whole run's counts, never by a matched EAM
            tracker = ActivationTracker.from_trace(ctx.trace_path, m.num_layers, m.num_experts, 0)
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
            stale = np.array(moved_rows(self._versions, tracker.row_version), dtype=np.intp)
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
            self._versions = list(tracker.row_version)
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
    """``layer * width + expert`` of every resident expert, ascending."""
    return np.flatnonzero(resident_mask(state.resident, width))


def resident_mask(resident: list[set[int]], width: int) -> np.ndarray:
    """Layers x experts, True where resident."""
    mask = np.zeros((len(resident), width), dtype=bool)
    for layer, experts in enumerate(resident):
        mask[layer, list(experts)] = True
    return mask


class MoEInfinitySystem(ObservingSystem):
    """Prefetch and cache share one activation tracker (configured in that order). Each layer's prediction
    replaces the prefetches still queued from the previous one: ``ExpertPrefetcher.prefetch_experts``
    (``moe_infinity/memory/expert_prefetcher.py``) calls ``replace_cache_candidates``, whose
    ``ArcherTaskPool::ReplaceCacheCandidates`` (``core/prefetch/task_scheduler.h``) empties the prefetch
    queues before the new list is enqueued; a copy already on the link finishes."""

    def _place(self, view: LayerView) -> LayerPlan:
        plan = super()._place(view)
        # another prefetch swapped in keeps its own queue
        plan.cancel_queued_prefetches = isinstance(self.prefetch, EamPrefetch)
        return plan

    def configure(self, ctx: RunContext) -> None:
        self.prefetch.configure(ctx)
        for role, component in self.components.items():
            if role != "prefetch":
                component.configure(ctx)
        self.notes = ctx.notes
        self.rewrites = {}


register_system("moe-infinity", SystemSpec(
    "MoE-Infinity: request-level expert activation matrices; prefetch by matching past requests' matrices, "
    "least-frequently-used eviction over the current requests' activations, every expert on the GPU",
    cache="request-lfu", assign="gpu", prefetch="eam-match", system_class=MoEInfinitySystem, runtime="pytorch-eager"))
