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
highest-priority experts are prefetched. The cache evicts the expert with the
fewest activations in the current requests' EAM (least frequently used,
request-level), ties broken by the run-wide count.

Simplifications, each a parameter or a note: the EAMC keeps the last
``eamc_size`` finished requests (first in, first out); it starts empty unless
``prefetch.calibration`` names a trace whose requests seed it (the paper
builds it offline), and the report says which. Each token row's request
comes with the view (``LayerView.requests``); a request counts as finished
after its last step in the trace, read once from the trace file: the moment a
serving system sees its end of sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from moesim.errors import ConfigError
from moesim.policy.base import LayerView, RunContext
from moesim.policy.cache import CachePolicy
from moesim.policy.catalog.importance import ObservingSystem
from moesim.policy.prefetch import Prefetch
from moesim.policy.systems import SystemSpec, register_component, register_system


def request_eams(path: str, num_layers: int, num_experts: int) -> dict[int, np.ndarray]:
    """Every request's complete EAM from a trace file."""
    table = pq.read_table(path, columns=["request", "layer", "experts"])
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
    """EAMs of the requests being served and the EAMC of finished ones (shared by prefetch and cache)."""

    num_layers: int
    num_experts: int
    eamc_size: int
    #: request -> its last step (its end of sequence)
    last_step: dict[int, int]
    live: dict[int, np.ndarray] = field(default_factory=dict)
    collection: deque = field(default_factory=deque)
    total: np.ndarray | None = None
    _seen: tuple[int, int] = (-1, -1)
    _step: int = -1

    @classmethod
    def from_trace(cls, path: str, num_layers: int, num_experts: int, eamc_size: int) -> "ActivationTracker":
        last = pq.read_table(path, columns=["step", "request"]).group_by("request").aggregate([("step", "max")])
        last_step = dict(zip(last.column("request").to_pylist(), last.column("step_max").to_pylist()))
        tracker = cls(num_layers, num_experts, eamc_size, last_step)
        tracker.total = np.zeros((num_layers, num_experts))
        return tracker

    def add_to_collection(self, eam: np.ndarray) -> None:
        norm = float(np.linalg.norm(eam))
        if norm == 0 or self.eamc_size <= 0:
            return
        self.collection.append(eam.ravel() / norm)
        while len(self.collection) > self.eamc_size:
            self.collection.popleft()

    def observe(self, view: LayerView) -> None:
        """Add this layer's routing to the batch's EAMs; retire requests whose last step has passed."""
        if (view.step, view.layer) == self._seen:
            return
        self._seen = (view.step, view.layer)
        if view.step != self._step:
            self._step = view.step
            for r in [r for r in self.live if self.last_step.get(r, -1) < view.step]:
                self.add_to_collection(self.live.pop(r))
        owners = row_owners(view)
        layer = view.layer
        for r in np.unique(owners):
            eam = self.live.setdefault(int(r), np.zeros((self.num_layers, self.num_experts)))
            np.add.at(eam[layer], view.experts[owners == r].ravel().astype(np.int64), 1)
        assert self.total is not None
        np.add.at(self.total[layer], view.experts.ravel().astype(np.int64), 1)

    def batch_eam(self, view: LayerView) -> np.ndarray:
        ids = np.unique(row_owners(view))
        out = np.zeros((self.num_layers, self.num_experts))
        for r in ids:
            if int(r) in self.live:
                out += self.live[int(r)]
        return out

    def best_match(self, eam: np.ndarray) -> np.ndarray | None:
        """The EAMC entry most similar to ``eam`` (cosine), as a layers x experts matrix."""
        if not self.collection:
            return None
        norm = float(np.linalg.norm(eam))
        if norm == 0:
            return None
        similarity = np.stack(self.collection) @ (eam.ravel() / norm)
        return self.collection[int(np.argmax(similarity))].reshape(self.num_layers, self.num_experts)


_TRACKERS: dict[int, ActivationTracker] = {}


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
    #: trace whose requests seed the EAMC before the run (empty: start empty)
    calibration: str = ""
    tracker: ActivationTracker | None = field(default=None, repr=False)
    _per_layer: int = 0

    def configure(self, ctx: RunContext) -> None:
        if ctx.trace_path is None:
            raise ConfigError("eam-match needs the trace file for each request's end of sequence", field="prefetch",
                              fix="replay from a trace file")
        m = ctx.model
        self.tracker = ActivationTracker.from_trace(ctx.trace_path, m.num_layers, m.num_experts, self.eamc_size)
        self._per_layer = self.per_layer or m.top_k
        if self.calibration:
            for eam in request_eams(self.calibration, m.num_layers, m.num_experts).values():
                self.tracker.add_to_collection(eam)
        else:
            ctx.notes.append("eam-match: EAM collection starts empty and fills with the replayed trace's finished "
                             "requests (set prefetch.calibration=PATH to seed it)")
        _TRACKERS[id(ctx)] = self.tracker

    def observe(self, view: LayerView) -> None:
        assert self.tracker is not None
        self.tracker.observe(view)

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        tracker = self.tracker
        assert tracker is not None
        match = tracker.best_match(tracker.batch_eam(view))
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
    """Least frequently used over the current requests' EAM (MoE-Infinity's activation-aware cache)."""

    name = "request-lfu"
    eamc_size: int = 0
    tracker: ActivationTracker | None = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        tracker = _TRACKERS.get(id(ctx))
        if tracker is None and ctx.trace_path is not None:
            m = ctx.model
            tracker = ActivationTracker.from_trace(ctx.trace_path, m.num_layers, m.num_experts, self.eamc_size)
        self.tracker = tracker

    def observe(self, view: LayerView) -> None:
        if self.tracker is not None:
            self.tracker.observe(view)

    def touch(self, view: LayerView, used: list[int]) -> None:
        self.observe(view)

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        candidates = [e for e in view.cache.resident[layer] if e not in protected]
        if self.tracker is None:
            return sorted(candidates)[:n]
        current = self.tracker.batch_eam(view)[layer]
        total = self.tracker.total[layer] if self.tracker.total is not None else current
        return sorted(candidates, key=lambda e: (current[e], total[e], e))[:n]


class MoEInfinitySystem(ObservingSystem):
    """Prefetch and cache share one activation tracker (configured in that order)."""

    def configure(self, ctx: RunContext) -> None:
        self.prefetch.configure(ctx)
        for role, component in self.components.items():
            if role != "prefetch":
                component.configure(ctx)
        self.notes = ctx.notes
        _TRACKERS.pop(id(ctx), None)


register_system("moe-infinity", SystemSpec(
    "MoE-Infinity: request-level expert activation matrices; prefetch by matching past requests' matrices, "
    "least-frequently-used eviction over the current requests' activations, every expert on the GPU",
    cache="request-lfu", assign="gpu", prefetch="eam-match", system_class=MoEInfinitySystem, runtime="pytorch-eager"))
