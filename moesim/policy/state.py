"""Residency of experts on the GPU: the state both executors keep and policies read.

The executor (simulator or real backend) owns one :class:`CacheState`; it
changes it only by executing plans (evict, start a load, finish a load).
Policies receive it inside a :class:`~moesim.policy.base.LayerView` and must
treat it as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moesim.errors import ConfigError


@dataclass
class CacheState:
    """Per-layer resident and in-flight experts with a fixed slot capacity per layer."""

    capacity: list[int]
    resident: list[set[int]] = field(default_factory=list)
    in_flight: list[set[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.resident:
            self.resident = [set() for _ in self.capacity]
        if not self.in_flight:
            self.in_flight = [set() for _ in self.capacity]

    @property
    def num_layers(self) -> int:
        return len(self.capacity)

    def used(self, layer: int) -> int:
        """Slots taken: resident experts plus loads that already hold their slot."""
        return len(self.resident[layer]) + len(self.in_flight[layer])

    def free(self, layer: int) -> int:
        return self.capacity[layer] - self.used(layer)

    def has(self, layer: int, expert: int) -> bool:
        """Resident or on its way."""
        return expert in self.resident[layer] or expert in self.in_flight[layer]

    # -- mutations: executors only --------------------------------------------
    def preload(self, layer: int, experts: list[int]) -> None:
        if len(experts) > self.capacity[layer]:
            raise ConfigError(f"initial resident set of layer {layer} has {len(experts)} experts but only "
                              f"{self.capacity[layer]} slots", field="cache.slots_per_layer")
        self.resident[layer] = set(experts)

    def evict(self, layer: int, expert: int) -> None:
        if expert not in self.resident[layer]:
            raise AssertionError(f"plan evicts expert {expert} of layer {layer}, which is not resident")
        self.resident[layer].discard(expert)

    def start_load(self, layer: int, expert: int) -> None:
        resident, in_flight = self.resident[layer], self.in_flight[layer]
        if expert in resident or expert in in_flight:
            raise AssertionError(f"plan loads expert {expert} of layer {layer}, which is already there")
        if len(resident) + len(in_flight) >= self.capacity[layer]:
            raise AssertionError(f"plan loads expert {expert} into full layer {layer} "
                                 f"({self.capacity[layer]} slots) without evicting")
        self.in_flight[layer].add(expert)

    def finish_load(self, layer: int, expert: int) -> None:
        self.in_flight[layer].discard(expert)
        self.resident[layer].add(expert)
