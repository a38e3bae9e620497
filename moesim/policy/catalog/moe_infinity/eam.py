"""MoE-Infinity's Expert Activation Matrices (EAMs): per request, tokens routed to each (layer, expert),
and the collection of finished requests' EAMs that predicts the coming layers (see the package docstring).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError, TraceFormatError
from moesim.policy.base import LayerView
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
    reader recomputes only the rows that moved (:func:`moved_rows`). A batch of one live request keeps
    that request's EAM itself as the batch EAM (a sum of one term), so a layer's routing is added once.

    A layer served to one request is noted (``_pending``) and added to the matrices when they are next read
    (:attr:`live`, :attr:`total`, :meth:`batch_eam`): a decode of one request reads them only when its
    batch changes or a prefetch has entries to match, while adding each layer at once cost several numpy
    calls per layer. The counts are whole numbers, so the sums are the same whenever they are added.
    """

    num_layers: int
    num_experts: int
    eamc_size: int
    #: request -> its last step (its end of sequence)
    last_step: dict[int, int]
    #: request -> its EAM (read through :attr:`live`, which adds the pending routing first)
    _live: dict[int, np.ndarray] = field(default_factory=dict)
    #: EAMs with unit-length rows (:func:`unit_rows`), flattened, oldest first
    collection: deque = field(default_factory=deque)
    #: the request each collection entry came from (None: a held-out calibration trace's)
    owners: deque = field(default_factory=deque)
    #: the run's tokens per (layer, expert) (read through :attr:`total`; None: not counted)
    _total: np.ndarray | None = None
    #: routing of one-request layers not yet added to that request's EAM and to the run's counts:
    #: (request, layer, experts, tokens of each)
    _pending: list[tuple[int, int, list[int], list[int]]] = field(default_factory=list)
    row_version: list[int] | None = None
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
    #: the requests a match last left out and the collection entries it kept (None: the collection changed)
    _kept: tuple[frozenset[int], list[int]] | None = None
    #: observations that moved counts so far, and what the latest one added: (layer, experts, tokens of
    #: each), added to the run's counts and to the kept batch EAM alike (None: not to the batch EAM alike)
    observations: int = 0
    last_added: tuple[int, list[int], list[int]] | None = None

    def __post_init__(self) -> None:
        if self.row_version is None:
            self.row_version = [0] * self.num_layers

    @property
    def live(self) -> dict[int, np.ndarray]:
        """Request -> the EAM of each request being served."""
        self._flush()
        return self._live

    @property
    def total(self) -> np.ndarray | None:
        """The run's tokens per (layer, expert), every observed request's (None: not counted)."""
        self._flush()
        return self._total

    @total.setter
    def total(self, counts: np.ndarray | None) -> None:
        self._flush()
        self._total = counts

    @property
    def counts_run(self) -> bool:
        """Whether the run's counts are kept (:attr:`total`), known without adding the pending routing."""
        return self._total is not None

    def _flush(self) -> None:
        """Add the pending one-request layers to their requests' EAMs and to the run's counts."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        width = self.num_experts
        if len(pending) <= 4:  # a few layers: row by row
            for request, layer, experts, tokens in pending:
                routed = np.zeros(width)
                routed[experts] = tokens
                self._live[request][layer] += routed
                self._total[layer] += routed
            return
        for request in {entry[0] for entry in pending}:
            cells: list[int] = []
            weights: list[int] = []
            for owner, layer, experts, tokens in pending:
                if owner == request:
                    base = layer * width
                    cells += [base + e for e in experts]
                    weights += tokens
            routed = np.bincount(cells, weights=weights, minlength=self.num_layers * width)
            routed = routed.reshape(self.num_layers, width)
            self._live[request] += routed
            self._total += routed

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
        if not eam.any() or self.eamc_size <= 0 or (request is not None and request in self.owners):
            return
        self.collection.append(unit_rows(eam).ravel())
        self.owners.append(request)
        while len(self.collection) > self.eamc_size:
            self.collection.popleft()
            self.owners.popleft()
        self._stack = None
        self._kept = None

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
            for r in [r for r in self._live if self.last_step.get(r, -1) < view.step]:
                self.add_to_collection(self.live.pop(r), r)
                if self._batch_ids is not None and r in self._batch_ids:
                    self._batch_ids = None  # the kept batch EAM no longer sums live EAMs
        layer, ids = view.layer, self.batch_ids(view)
        assert self._total is not None and self.row_version is not None
        kept = self._batch_ids
        if len(ids) == 1 and (kept is None or ids[0] not in kept or self._batch is self._live.get(ids[0])):
            # one request, whose EAM no other kept batch EAM sums: noted, added when read
            r = ids[0]
            if r not in self._live:
                self._live[r] = np.zeros((self.num_layers, self.num_experts))
            self._pending.append((r, layer, view.active, view.counts))
            self._counted(layer, ids, view)
            return
        self._flush()
        counts = np.bincount(view.experts.ravel(), minlength=self.num_experts)  # tokens per expert
        if len(ids) == 1:
            per_request = [(ids[0], counts)]
        else:
            owners = row_owners(view)
            per_request = [(r, np.bincount(view.experts[owners == r].ravel(), minlength=self.num_experts))
                           for r in ids]
        for r, routed in per_request:
            eam = self._live.get(r)
            if eam is None:
                eam = self._live[r] = np.zeros((self.num_layers, self.num_experts))
            eam[layer] += routed
            if self._batch_ids is not None and r in self._batch_ids and self._batch is not eam:
                self._batch[layer] += routed
        self._total[layer] += counts
        self._counted(layer, ids, view)

    def _counted(self, layer: int, ids: tuple[int, ...], view: LayerView) -> None:
        """Note that ``layer``'s counts moved, and what the view added when the kept batch EAM took it too."""
        self.row_version[layer] += 1
        self.observations += 1
        batch = self._batch_ids
        # the view's distinct experts and their tokens: what this layer added, expert by expert
        taken = batch is not None and (ids[0] in batch if len(ids) == 1 else all(r in batch for r in ids))
        self.last_added = (layer, view.active, view.counts) if taken else None

    def batch_eam(self, view: LayerView) -> np.ndarray:
        """The sum of the live EAMs of the view's requests (kept between layers; read-only)."""
        self.follow_batch(view)
        self._flush()
        return self._batch

    def follow_batch(self, view: LayerView) -> int:
        """Keep the view's batch as the batch whose EAM is kept (:meth:`batch_eam`), and return its
        ``batch_generation``, without adding the pending routing when the batch is the same."""
        ids = self.batch_ids(view)
        if ids != self._batch_ids or self._batch is None:
            live = self.live
            if len(ids) == 1 and ids[0] in live:
                out = live[ids[0]]  # its own EAM, which observe keeps up to date
            else:
                out = np.zeros((self.num_layers, self.num_experts))
                for r in ids:
                    if r in live:
                        out += live[r]
            self._batch_ids, self._batch = ids, out
            self.batch_generation += 1
        return self.batch_generation

    def has_entries_besides(self, exclude: frozenset[int]) -> bool:
        """Whether the collection holds an entry of a request outside ``exclude`` (one to match)."""
        return bool(self._entries_besides(exclude))

    def best_match(self, eam: np.ndarray, exclude: frozenset[int] = frozenset()) -> np.ndarray | None:
        """The EAMC entry most similar to ``eam``, as a layers x experts matrix (each row scaled to unit
        length), leaving out the entries of the requests in ``exclude`` (the batch's own: leave-one-out).

        Similarity is the cosine of each layer's row, summed over the layers: MoE-Infinity's
        ``ExpertTracer.find_most_similar`` (``moe_infinity/memory/expert_tracer.py``) ranks entries by one
        minus the mean over layers of the row-wise cosine, so every layer counts alike however its
        activations are spread. A layer the batch has not reached yet (a zero row) adds 0 to every entry.
        The first of equally similar entries wins (``argmin`` there, ``argmax`` here)."""
        kept = self._entries_besides(exclude)
        if not kept or not eam.any():
            return None
        if self._stack is None:
            self._stack = np.stack(list(self.collection))
        entries = self._stack if len(kept) == len(self.owners) else self._stack[kept]
        similarity = entries @ unit_rows(eam).ravel()
        return self.collection[kept[int(np.argmax(similarity))]].reshape(self.num_layers, self.num_experts)

    def _entries_besides(self, exclude: frozenset[int]) -> list[int]:
        """The collection entries not from the requests in ``exclude`` (kept until either changes)."""
        if self._kept is None or self._kept[0] != exclude:
            kept = [i for i, owner in enumerate(self.owners) if owner is None or owner not in exclude]
            self._kept = (exclude, kept)
        return self._kept[1]


def unit_rows(eam: np.ndarray) -> np.ndarray:
    """``eam`` with every nonzero row scaled to unit length (zero rows stay zero): the dot product of two
    such matrices is the sum over layers of their rows' cosines."""
    norms = np.linalg.norm(eam, axis=1, keepdims=True)
    return np.divide(eam, norms, out=np.zeros(eam.shape), where=norms > 0)


def moved_rows(seen: list[int], now: list[int]) -> list[int]:
    """The layers whose row version is not the one ``seen`` (their counts moved since)."""
    return [layer for layer, (then, version) in enumerate(zip(seen, now)) if then != version]


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
