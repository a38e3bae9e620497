"""Residency of experts on the GPU: the state both executors keep and policies read.

The executor (simulator or real backend) owns one :class:`CacheState`; it
changes it only by executing plans (evict, start a load, finish a load).
Policies receive it inside a :class:`~moesim.policy.base.LayerView` and must
treat it as read-only.

GPU memory for experts is one budget of slots (``moesim.sim.memory.MemoryPlan``).
A cache policy spreads it (:meth:`moesim.policy.cache.CachePolicy.spread`) as
per-layer quotas, as one model-wide pool, or both: ``capacity[layer]`` bounds
what one layer holds, ``pool`` (when set) bounds what all layers hold together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.errors import ConfigError


def even_quotas(total: int, layers: int, per_layer_max: int) -> list[int]:
    """``total`` slots over ``layers`` layers, at most ``per_layer_max`` each, every slot used.

    Each layer gets ``total // layers``; the ``total % layers`` left over go one
    each to layers spaced evenly through the model (layer ``i`` gets one when
    ``floor((i + 1) * r / L) > floor(i * r / L)``), so no stretch of layers is
    favoured. Slots beyond ``layers * per_layer_max`` cannot be used.

    >>> even_quotas(60, 32, 8).count(2), even_quotas(60, 32, 8).count(1)
    (28, 4)
    >>> even_quotas(5, 4, 8)
    [1, 1, 1, 2]
    """
    if layers <= 0:
        return []
    total = max(min(total, layers * per_layer_max), 0)
    base, extra = divmod(total, layers)
    return [base + ((i + 1) * extra // layers - i * extra // layers) for i in range(layers)]


def describe_quotas(capacity: list[int], pool: int | None = None) -> str:
    """Compact text of how slots are spread: ``60 slots: 2 x 28 layers, 1 x 4 layers (layers 0, 8, 16, 24)``."""
    if pool is not None:
        return f"{_slots(pool)} in one model-wide pool (at most {max(capacity, default=0)} per layer)"
    total = sum(capacity)
    groups: dict[int, list[int]] = {}
    for layer, n in enumerate(capacity):
        groups.setdefault(n, []).append(layer)
    parts = []
    for n, layers in sorted(groups.items(), key=lambda kv: (-len(kv[1]), -kv[0])):
        where = f" (layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))})" \
            if len(groups) > 1 and len(layers) <= 8 else ""
        parts.append(f"{n} x {len(layers)} layer{'s' if len(layers) > 1 else ''}{where}")
    return f"{_slots(total)}: {', '.join(parts)}"


def _slots(count: int) -> str:
    return f"{count} slot{'' if count == 1 else 's'}"


class PoolMirror:
    """Whole-model figures of a pooled cache, kept by its :class:`CountedSlots`: the slots all layers hold
    together and, for a reader that keeps its own order of the residents, a journal of the changes since it
    last looked; a layers x experts mask of the resident experts on request (:attr:`resident_mask`)."""

    #: entries past which a journal is dropped, checked as experts arrive (its reader then starts afresh)
    JOURNAL_LIMIT = 1 << 16

    def __init__(self, layers: int, width: int) -> None:
        self.held = 0
        self.layers, self.width = layers, max(width, 1)
        self.sets: list[CountedSlots] = []
        #: every resident expert added, ``(layer, expert)``, or dropped, ``(layer, ~expert)``, one by one
        #: in order since the reader emptied it; None when nobody reads it or a change was not noted one
        #: by one (a bulk update, an overflow)
        self.journal: list[tuple[int, int]] | None = None

    @property
    def resident_mask(self) -> np.ndarray:
        """Layers x experts, True where resident; as wide as the largest layer quota (or the largest resident
        id + 1, when larger). Built from the sets when asked: a pool's residents change several times per
        layer, and a mask kept up to date cost each change a numpy write that few plans read."""
        resident = [slots for slots in self.sets if slots.resident]
        width = max([self.width] + [max(slots) + 1 for slots in resident if slots])
        mask = np.zeros((self.layers, width), dtype=bool)
        for slots in resident:
            if slots:
                mask[slots.layer, list(slots)] = True
        return mask


class CountedSlots(set):
    """One layer's resident or in-flight experts in a pooled cache, mirrored in its :class:`PoolMirror`.

    With a model-wide pool, a plan asks how many slots all layers hold together
    (:meth:`CacheState.held`) several times per layer, and a pool-wide eviction order follows every
    resident expert of every layer; the mirror's tally and journal answer both without walking every
    layer's set. Every mutating set method keeps them exact, so executors may change the sets directly
    (the simulator's per-transfer bookkeeping adds and discards in place).
    """

    __slots__ = ("mirror", "layer", "resident")

    def __init__(self, experts, mirror: PoolMirror, layer: int, resident: bool) -> None:
        super().__init__()
        self.mirror, self.layer, self.resident = mirror, layer, resident
        mirror.sets.append(self)
        self.update(experts)

    def __reduce__(self):
        return set, (list(self),)  # a copy is a plain set: the mirror belongs to the live cache

    def add(self, expert: int) -> None:
        if expert not in self:
            set.add(self, expert)
            mirror = self.mirror
            mirror.held += 1
            if self.resident:
                journal = mirror.journal
                if journal is not None:
                    journal.append((self.layer, expert))
                    if len(journal) > mirror.JOURNAL_LIMIT:  # unread that long
                        mirror.journal = None

    def discard(self, expert: int) -> None:
        if expert in self:
            set.discard(self, expert)
            mirror = self.mirror
            mirror.held -= 1
            if self.resident:
                journal = mirror.journal
                if journal is not None:
                    journal.append((self.layer, ~expert))

    def remove(self, expert: int) -> None:
        if expert not in self:
            raise KeyError(expert)
        self.discard(expert)

    def pop(self) -> int:
        if not self:
            raise KeyError("pop from an empty set")
        expert = next(iter(self))
        self.discard(expert)
        return expert

    def __repr__(self) -> str:
        return repr(set(self))

    def _rebuilt(self, change, *others) -> "CountedSlots":
        before = len(self)
        change(self, *others)
        self.mirror.held += len(self) - before
        if self.resident:
            self.mirror.journal = None  # not noted one by one: a reader starts afresh
        return self

    def clear(self) -> None:
        self._rebuilt(set.clear)

    def update(self, *others) -> None:
        self._rebuilt(set.update, *others)

    def difference_update(self, *others) -> None:
        self._rebuilt(set.difference_update, *others)

    def intersection_update(self, *others) -> None:
        self._rebuilt(set.intersection_update, *others)

    def symmetric_difference_update(self, other) -> None:
        self._rebuilt(set.symmetric_difference_update, other)

    def __ior__(self, other):
        return self._rebuilt(set.__ior__, other)

    def __isub__(self, other):
        return self._rebuilt(set.__isub__, other)

    def __iand__(self, other):
        return self._rebuilt(set.__iand__, other)

    def __ixor__(self, other):
        return self._rebuilt(set.__ixor__, other)


@dataclass
class CacheState:
    """Resident and in-flight experts per layer, within per-layer quotas and an optional model-wide pool.

    With a pool the per-layer sets are :class:`CountedSlots` mirrored in one :class:`PoolMirror`
    (``mirror``: slots held, resident mask); per-layer quotas never need whole-model figures and keep
    plain sets.
    """

    #: most experts (resident + in flight) each layer may hold
    capacity: list[int]
    resident: list[set[int]] = field(default_factory=list)
    in_flight: list[set[int]] = field(default_factory=list)
    #: most experts all layers together may hold (None: only the per-layer quotas bind)
    pool: int | None = None
    mirror: PoolMirror | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.resident:
            self.resident = [set() for _ in self.capacity]
        if not self.in_flight:
            self.in_flight = [set() for _ in self.capacity]
        if self.pool is not None:
            self.mirror = mirror = PoolMirror(len(self.capacity), max(self.capacity, default=1))
            self.resident = [CountedSlots(s, mirror, layer, True) for layer, s in enumerate(self.resident)]
            self.in_flight = [CountedSlots(s, mirror, layer, False) for layer, s in enumerate(self.in_flight)]

    @property
    def num_layers(self) -> int:
        return len(self.capacity)

    @property
    def slots(self) -> int:
        """Experts the cache may hold at once over all layers."""
        total = sum(self.capacity)
        return total if self.pool is None else min(self.pool, total)

    def used(self, layer: int) -> int:
        """Slots taken: resident experts plus loads that already hold their slot."""
        return len(self.resident[layer]) + len(self.in_flight[layer])

    def held(self) -> int:
        """Slots taken over all layers."""
        if self.mirror is not None:
            return self.mirror.held
        return sum(map(len, self.resident)) + sum(map(len, self.in_flight))

    def free(self, layer: int) -> int:
        """Slots ``layer`` may still take: its quota's room, and the pool's when there is one."""
        room = self.capacity[layer] - self.used(layer)
        if self.pool is not None:
            room = min(room, self.pool - self.held())
        return room

    def has(self, layer: int, expert: int) -> bool:
        """Resident or on its way."""
        return expert in self.resident[layer] or expert in self.in_flight[layer]

    # -- mutations: executors only --------------------------------------------
    def preload(self, layer: int, experts: list[int]) -> None:
        held_elsewhere = self.held() - self.used(layer) if self.pool is not None else 0
        if len(experts) > self.capacity[layer] or \
                (self.pool is not None and held_elsewhere + len(experts) > self.pool):
            raise ConfigError(f"initial resident set of layer {layer} has {len(experts)} experts but only "
                              f"{self.free(layer) + self.used(layer)} slots are left for it",
                              field="cache.slots_per_layer")
        self.resident[layer].clear()
        self.resident[layer].update(experts)

    def evict(self, layer: int, expert: int) -> None:
        if expert not in self.resident[layer]:
            raise AssertionError(f"plan evicts expert {expert} of layer {layer}, which is not resident")
        self.resident[layer].discard(expert)

    def evict_all(self, pairs: list[tuple[int, int]]) -> None:
        """:meth:`evict` of each (layer, expert) in turn."""
        resident, mirror = self.resident, self.mirror
        if mirror is not None:  # CountedSlots.discard inlined: a pool evicts several experts per layer
            journal = mirror.journal
            for layer, expert in pairs:
                slots = resident[layer]
                if expert not in slots:
                    self.evict(layer, expert)
                set.discard(slots, expert)
                mirror.held -= 1
                if journal is not None:
                    journal.append((layer, ~expert))
            return
        for layer, expert in pairs:
            if expert not in resident[layer]:
                self.evict(layer, expert)  # names the one at fault
            resident[layer].discard(expert)

    def start_load(self, layer: int, expert: int) -> None:
        resident, in_flight = self.resident[layer], self.in_flight[layer]
        if expert in resident or expert in in_flight:
            raise AssertionError(f"plan loads expert {expert} of layer {layer}, which is already there")
        if len(resident) + len(in_flight) >= self.capacity[layer]:
            raise AssertionError(f"plan loads expert {expert} into full layer {layer} "
                                 f"({self.capacity[layer]} slots) without evicting")
        if self.pool is not None and self.held() >= self.pool:
            raise AssertionError(f"plan loads expert {expert} of layer {layer} into the full model-wide pool "
                                 f"({self.pool} slots) without evicting")
        in_flight.add(expert)

    def start_loads(self, layer: int, experts: list[int]) -> None:
        """:meth:`start_load` of each of ``experts`` in turn, its checks made once for all of them."""
        self.check_loads(layer, experts)
        self.in_flight[layer].update(experts)

    def check_loads(self, layer: int, experts: list[int]) -> None:
        """Refuse (as :meth:`start_load` would, naming the expert at fault) loads of ``experts`` into
        ``layer`` that exceed its slots or the pool, or that are there already."""
        resident, in_flight = self.resident[layer], self.in_flight[layer]
        if len(resident) + len(in_flight) + len(experts) > self.capacity[layer] \
                or (self.pool is not None and self.held() + len(experts) > self.pool) \
                or not resident.isdisjoint(experts) or (in_flight and not in_flight.isdisjoint(experts)) \
                or (len(experts) > 1 and len(set(experts)) < len(experts)):
            for expert in experts:
                self.start_load(layer, expert)  # raises at the first expert at fault

    def finish_load(self, layer: int, expert: int) -> None:
        self.in_flight[layer].discard(expert)
        self.resident[layer].add(expert)

    def cancel_load(self, layer: int, expert: int) -> None:
        """A queued load dropped before it started: its slot is free again."""
        self.in_flight[layer].discard(expert)
