"""Prefetch components: what to load ahead of need, for which layer."""

from __future__ import annotations

from dataclasses import dataclass, field

from moesim.policy.base import Component, LayerView, RunContext
from moesim.policy.future import FutureRouting


class Prefetch(Component):
    role = "prefetch"

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        """(layer, expert) pairs worth loading now, most wanted first."""
        return []


@dataclass
class NoPrefetch(Prefetch):
    name = "none"


@dataclass
class PerfectPrefetch(Prefetch):
    """Loads exactly the experts the next layer to run will use (known from the trace): a bound."""

    name = "perfect"
    _future: FutureRouting | None = field(default=None, repr=False)
    _num_layers: int = 0

    def configure(self, ctx: RunContext) -> None:
        self._future = FutureRouting.load(ctx.trace_path, ctx.model)
        self._num_layers = ctx.model.num_layers

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        assert self._future is not None
        nxt = self._future.next_position(view.step, view.layer, self._num_layers)
        if nxt is None:
            return []
        step, layer = nxt
        return [(layer, e) for e in self._future.routed[(step, layer)]]
