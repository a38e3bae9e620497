"""Cache components: which experts stay resident in each layer's GPU slots.

A cache component answers three questions for the system that owns it: the
initial resident set of a layer, which experts to evict when ``n`` slots are
needed (never one in ``protected``), and what to remember when experts are
used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from moesim.policy.base import Component, LayerView, RunContext
from moesim.policy.future import FutureRouting
from moesim.policy.state import CacheState, even_quotas


@dataclass(frozen=True)
class SlotSpread:
    """How a cache uses its slots: per-layer quotas, and a model-wide pool when ``pool`` is set.

    ``cached``, when set, is the part of each layer's quota the cache itself fills; the rest is room for
    a system's buffer beside the cache (DALI's prefetch buffer)."""

    capacity: list[int]
    pool: int | None = None
    cached: list[int] | None = None


class CachePolicy(Component):
    role = "cache"
    #: "layer": per-layer quotas; "pool": one model-wide pool (a layer may take any free slot)
    layout: ClassVar[str] = "layer"
    #: the setting that sizes the cache when not the memory plan's slots (named in a note when it holds fewer)
    sized_by: ClassVar[str] = ""

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """Spread ``total`` slots of the memory plan over the layers.

        Per-layer caches take the user's explicit quotas (``requested``, from
        ``cache.slots_per_layer``) or an even spread with the remainder over
        evenly spaced layers (:func:`~moesim.policy.state.even_quotas`); pool
        caches put ``total`` in one pool, at most ``experts`` per layer.
        """
        if self.layout == "pool":
            return SlotSpread([min(experts, total)] * layers, min(total, layers * experts))
        if requested is not None:
            return SlotSpread(list(requested))
        return SlotSpread(even_quotas(total, layers, experts))

    def pool_victims(self, view: LayerView, n: int, protected: set[tuple[int, int]],
                     layer: int) -> list[tuple[int, int]]:
        """Up to ``n`` resident (layer, expert) pairs of any layer to evict when the model-wide pool is full.

        Default: this policy's own per-layer choice, taken first in ``layer`` and
        then in the layers whose next turn in the forward pass is farthest away
        (the one just run first): a pass visits layers in order.
        """
        layers = view.cache.num_layers
        order = [layer] + [l for l in ((view.layer - b) % layers for b in range(layers)) if l != layer]
        out: list[tuple[int, int]] = []
        for other in order:
            keep = {e for (l, e) in protected if l == other}
            out += [(other, e) for e in self.victims(view, other, n - len(out), keep)]
            if len(out) >= n:
                break
        return out[:n]

    def initial(self, layer: int, capacity: int) -> list[int]:
        """Experts resident before the first step: the first ``capacity`` ids, as a loader that
        fills each layer's slots in order leaves them (mixtral-offloading keeps the first experts
        of every layer on the GPU)."""
        return list(range(capacity))

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        """Up to ``n`` resident experts of ``layer`` to evict for ``incoming``, none of them in ``protected``."""
        return []

    def admission_order(self, view: LayerView, layer: int, missing: list[int]) -> list[int]:
        """Which missing experts should get a slot first (the rest are streamed)."""
        return missing

    def touch(self, view: LayerView, used: list[int]) -> None:
        """Record that ``used`` experts of ``view.layer`` ran on the GPU now."""


@dataclass
class NoCache(CachePolicy):
    """Nothing is ever cached (systems that compute every routed expert on the CPU)."""

    name = "none"

    def initial(self, layer: int, capacity: int) -> list[int]:
        return []


@dataclass
class LRUCache(CachePolicy):
    """Least-recently-used eviction per layer (as in Mixtral-offloading's expert cache)."""

    name = "lru"
    #: per layer, a distinct stamp per expert: larger is more recent (never used: by id, below 0)
    _stamp: list[dict[int, int]] = field(default_factory=list)
    _clock: int = 0

    def configure(self, ctx: RunContext) -> None:
        experts = ctx.model.num_experts
        self._stamp = [{e: e - experts for e in range(experts)} for _ in ctx.capacity]
        self._clock = 0

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        if n <= 0:
            return []
        stamp = self._stamp[layer]
        # stamps are distinct, so the order candidates come in never matters
        candidates = view.cache.resident[layer] - protected if protected else view.cache.resident[layer]
        if n == 1 and candidates:
            return [min(candidates, key=stamp.__getitem__)]
        return sorted(candidates, key=stamp.__getitem__)[:n]

    def touch(self, view: LayerView, used: list[int]) -> None:
        stamp = self._stamp[view.layer]
        clock = self._clock
        for e in used:  # a plain loop: about twice a dict.update(zip(...))'s speed for a top-k of experts
            clock += 1
            stamp[e] = clock
        self._clock = clock


@dataclass
class StaticCache(CachePolicy):
    """The hottest experts of each layer pinned for the whole run; nothing is loaded later.

    Hotness comes from a calibration trace (``cache.calibration``, a path); by
    default from the replayed trace itself, which the report flags as
    profile-guided on the same data (Fiddler-style offline profiling).
    """

    name = "static-hot"
    #: calibration trace (path) the hottest experts are counted on; empty: the replayed trace itself, flagged
    calibration: str = ""
    _hot: list[list[int]] = field(default_factory=list)

    def configure(self, ctx: RunContext) -> None:
        from moesim.policy.future import expert_frequencies  # pure numpy over the trace file
        path = self.calibration or ctx.trace_path
        if not self.calibration:
            ctx.notes.append("static-hot: hot experts counted on the replayed trace itself "
                             "(set cache.calibration=PATH for a separate calibration trace)")
        freq = expert_frequencies(path, ctx.model)
        self._hot = []
        for layer, cap in enumerate(ctx.capacity):
            order = np.lexsort((np.arange(ctx.model.num_experts), -freq[layer]))
            self._hot.append([int(e) for e in order[:cap]])

    def initial(self, layer: int, capacity: int) -> list[int]:
        return self._hot[layer][:capacity]


@dataclass
class AllResident(CachePolicy):
    """Every expert resident from the start (the all-in-GPU bound)."""

    name = "all"
    _experts: int = 0

    def configure(self, ctx: RunContext) -> None:
        self._experts = ctx.model.num_experts

    def initial(self, layer: int, capacity: int) -> list[int]:
        return list(range(min(self._experts, capacity)))


@dataclass
class BeladyCache(CachePolicy):
    """Belady's optimal replacement per layer: evict the expert used again farthest in the future.

    Needs the whole trace up front (a bound, not a deployable policy).
    """

    name = "belady"
    _future: FutureRouting | None = None
    _experts: int = 0

    def configure(self, ctx: RunContext) -> None:
        self._future = FutureRouting.load(ctx.trace_path, ctx.model)
        self._experts = ctx.model.num_experts

    def initial(self, layer: int, capacity: int) -> list[int]:
        """The experts this layer uses soonest: the optimal starting contents."""
        assert self._future is not None
        first = {e: self._future.next_use(layer, e, -1) for e in range(self._experts)}
        return sorted(sorted(first, key=lambda e: (first[e], e))[:capacity])

    def _next(self, view: LayerView, layer: int, expert: int) -> int:
        assert self._future is not None
        # a later layer of this step still counts this step's use; this and earlier layers do not
        from_step = view.step if layer > view.layer else view.step + 1
        return self._future.next_use(layer, expert, from_step)

    def admission_order(self, view: LayerView, layer: int, missing: list[int]) -> list[int]:
        return sorted(missing, key=lambda e: (self._next(view, layer, e), e))

    def victims(self, view: LayerView, layer: int, n: int, protected: set[int],
                incoming: list[int] | None = None) -> list[int]:
        """Farthest next use first; with ``incoming`` known, an expert is evicted only for one used sooner."""
        if n <= 0:
            return []
        # each expert's next use looked up once: the ranking and the comparisons below share them
        upcoming = {e: self._next(view, layer, e) for e in view.cache.resident[layer] if e not in protected}
        candidates = sorted(upcoming, key=lambda e: (-upcoming[e], e))
        if incoming is None:
            return candidates[:n]
        arriving = {e: self._next(view, layer, e) for e in incoming}
        chosen = []
        for victim, newcomer in zip(candidates, sorted(arriving, key=lambda e: (arriving[e], e))):
            if len(chosen) == n or upcoming[victim] <= arriving[newcomer]:
                break
            chosen.append(victim)
        return chosen


def make_room(cache: CachePolicy, view: LayerView, layer: int, incoming: list[int],
              protected: set[int]) -> tuple[int, list[tuple[int, int]]]:
    """How many of the ``incoming`` experts (in admission order) fit in ``layer``, and which
    (layer, expert) pairs to evict for them (other layers' only when a model-wide pool is full)."""
    state: CacheState = view.cache
    in_flight = state.in_flight[layer]
    if state.pool is None:  # CacheState.free, inline: a plan with a miss asks it every layer
        free = state.capacity[layer] - len(state.resident[layer]) - len(in_flight)
    else:
        free = state.free(layer)
    wanted = len(incoming)
    if wanted <= free:
        return wanted, []
    keep = protected | in_flight if in_flight else protected
    if state.pool is None:
        evict = cache.victims(view, layer, wanted - free, keep, incoming[free:] if free else incoming)
        pairs = []
        for e in evict:  # a plain loop: a comprehension is a call of its own
            pairs.append((layer, e))
        return free + len(evict), pairs
    # the quota of the layer binds first: room there comes from the layer itself
    own_room = state.capacity[layer] - state.used(layer)
    need_here = max(wanted - own_room, 0)
    pairs = [(layer, e) for e in cache.victims(view, layer, need_here, keep, incoming[own_room:])] \
        if need_here else []
    pool_room = state.pool - state.held() + len(pairs)
    fits = min(own_room + len(pairs), wanted)
    if fits > pool_room:
        # loads in flight elsewhere need no protecting: victims are resident, and they are not yet
        taken = {(layer, e) for e in keep} | set(pairs)
        pairs += cache.pool_victims(view, fits - pool_room, taken, layer)
        fits = min(fits, state.pool - state.held() + len(pairs))
    return max(fits, 0), pairs
