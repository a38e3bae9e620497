"""The composed system: a layer planned by a cache, an assignment and a prefetch component, with
substitution and deferral around them; the engine and the real backend execute its plan.

The registry of components and named systems is :mod:`moesim.policy.systems`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moesim.errors import ConfigError, TraceFormatError
from moesim.model.spec import ModelSpec
from moesim.policy.assign import Assignment
from moesim.policy.base import Component, LayerPlan, LayerView, RunContext, kept_rewrites, split_plan
from moesim.policy.cache import CachePolicy, SlotSpread, make_room
from moesim.policy.checked import check_users_policies
from moesim.policy.prefetch import NoPrefetch, Prefetch
from moesim.trace.io import read_meta


class Substitution(Component):
    """Rewrites a layer's routing before anything else is decided (002, 004)."""

    role = "substitute"

    def rewrite(self, view: LayerView) -> Sequence[tuple[int, int, int]]:
        """(token row, top-k slot, new expert) replacements: a list, or many at once as
        :class:`~moesim.policy.base.Substitutions`."""
        return []


class Deferral(Component):
    """Moves some CPU experts past the layer's end, overlapping the next layer (001 Sec. 4)."""

    role = "defer"

    def choose(self, view: LayerView, plan: LayerPlan) -> list[int]:
        """Experts of ``plan.cpu`` whose results may arrive one layer late."""
        return []


@dataclass
class NoSubstitution(Substitution):
    name = "none"


@dataclass
class NoDeferral(Deferral):
    name = "none"


@dataclass
class ComposedSystem:
    """Plans a layer: substitute, split the experts, admit the GPU ones into the cache, prefetch, defer."""

    name: str
    cache: CachePolicy
    assign: Assignment
    prefetch: Prefetch
    description: str = ""
    substitute: Substitution = field(default_factory=NoSubstitution)
    defer: Deferral = field(default_factory=NoDeferral)
    #: True for bounds that assume every expert fits in GPU memory
    ignores_memory: bool = False
    #: True when the system needs no GPU cache at all
    uses_cache: bool = True
    notes: list[str] = field(default_factory=list)
    #: (step, layer) -> the routing rewrites planned there (what a substitution-aware bound replays)
    rewrites: dict[tuple[int, int], list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def components(self) -> dict[str, Component]:
        return {"cache": self.cache, "assign": self.assign, "prefetch": self.prefetch,
                "substitute": self.substitute, "defer": self.defer}

    def needed_columns(self) -> list[str]:
        columns = {c for component in self.components.values() for c in component.columns}
        if not isinstance(self.substitute, NoSubstitution) or not isinstance(self.defer, NoDeferral):
            # the engine counts the gate weight a rewrite or deferral touches (substituted_weight_mass,
            # deferred_weight_mass), whether or not the component itself reads the weights
            columns.add("weights")
        return sorted(columns)

    def for_model(self, model: ModelSpec) -> None:
        """Let each component settle its model-dependent defaults before the memory plan reads them."""
        check_calibrations(self.components, model)
        for component in self.components.values():
            component.for_model(model)

    def check_columns(self, ctx: RunContext) -> None:
        """Refuse a trace that lacks a column a component requires (before :meth:`configure`)."""
        for component in self.components.values():
            component.check_columns(ctx)

    def configure(self, ctx: RunContext) -> None:
        for component in self.components.values():
            component.configure(ctx)
        self.notes = ctx.notes
        self.rewrites = {}

    def initial(self, layer: int, capacity: int) -> list[int]:
        return self.cache.initial(layer, capacity)

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """How this system's cache uses ``total`` expert slots of the memory plan (its cache policy decides)."""
        return self.cache.spread(total, layers, experts, requested)

    def reserved_slots(self, layers: int) -> int:
        """Expert slots the system needs besides its cache (a prefetch buffer), taken from the same budget."""
        return 0

    def plan(self, view: LayerView) -> LayerPlan:
        if not self._substituting and not self._deferring:  # most systems: placing the experts is the plan
            return self._place(view)
        substitutions = self.substitute.rewrite(view) if self._substituting else []
        if substitutions:
            self.rewrites[(view.step, view.layer)] = kept_rewrites(substitutions)
            view = view.substituted(substitutions)
        plan = self._place(view)
        plan.substitutions = substitutions
        if self._deferring and plan.cpu:
            plan.deferred = self.defer.choose(view, plan)
            if plan.deferred:
                deferred = set(plan.deferred)
                plan.cpu = [e for e in plan.cpu if e not in deferred]
        return plan

    def planner(self) -> Callable[[LayerView], LayerPlan]:
        """What an executor calls for each layer, fetched once per run: :meth:`plan`, or :meth:`_place` itself
        where plan would only call it (a system that neither substitutes nor defers, and whose ``plan`` is
        this class's own, not overridden, nor replaced on the class or the instance, as a notebook's spy is):
        the same plans, one call fewer per layer."""
        plan = self.plan
        if getattr(plan, "__func__", None) is _COMPOSED_PLAN and not self._substituting and not self._deferring:
            return self._place
        return plan

    def _place(self, view: LayerView) -> LayerPlan:
        gpu, cpu = self.assign.split(view)
        plan = split_plan([], cpu)  # every layer: without calling the class
        if not gpu:
            if self._prefetching:
                self._plan_prefetch(view, plan)
            return plan
        layer = view.layer
        state = view.cache
        resident, in_flight = state.resident[layer], state.in_flight[layer]
        # plain loops, not comprehensions: a comprehension is a call of its own, and this runs every layer
        present: list[int] = []
        missing: list[int] = []
        arriving: list[int] = []
        if in_flight:
            for e in gpu:
                if e in resident:
                    present.append(e)
                elif e in in_flight:
                    present.append(e)
                    arriving.append(e)
                else:
                    missing.append(e)
        else:  # the common case, one set to look in
            for e in gpu:
                if e in resident:
                    present.append(e)
                else:
                    missing.append(e)
        if missing:
            missing = self.cache.admission_order(view, layer, missing)
            fits, evict = make_room(self.cache, view, layer, missing, set(present))
            plan.evictions = evict
            plan.loads = missing[:fits]
            plan.streamed = missing[fits:]
        # resident first (they can start at once), then loads in queue order, then streamed
        if arriving:  # some GPU experts are still on their way: they go after the resident ones
            ready = []
            for e in present:
                if e in resident:
                    ready.append(e)
            if len(arriving) == 2:  # what the stable sort below does with two, without its key calls
                arrivals = view.arrivals
                if arrivals.get(arriving[1], 0.0) < arrivals.get(arriving[0], 0.0):
                    arriving.reverse()
            elif len(arriving) > 2:
                arrivals = view.arrivals
                arriving.sort(key=lambda e: arrivals.get(e, 0.0))
            ready += arriving
            present = ready
        plan.gpu = present + plan.loads + plan.streamed if missing else present
        self.cache.touch(view, plan.gpu)
        if self._prefetching:
            self._plan_prefetch(view, plan)
        return plan

    def __post_init__(self) -> None:
        # decided once: plan() runs for every layer of every step
        self._prefetching = not isinstance(self.prefetch, NoPrefetch)
        self._substituting = not isinstance(self.substitute, NoSubstitution)
        self._deferring = not isinstance(self.defer, NoDeferral)
        check_users_policies(self)

    def _plan_prefetch(self, view: LayerView, plan: LayerPlan) -> None:
        wanted = self.prefetch.candidates(view)
        if not wanted:
            return
        state = view.cache
        # looked up once: CacheState.has and .used, inline, for each wanted expert
        resident, in_flight, capacity = state.resident, state.in_flight, state.capacity
        this_layer, gpu, loads = view.layer, plan.gpu, plan.loads
        evictions, prefetches = plan.evictions, plan.prefetches
        evicted = set(evictions)
        # per layer, the slots still free to a prefetch
        quota_left: dict[int, int] = {}
        pool_left = None if state.pool is None else state.pool - state.held() + len(evicted) - len(loads)
        victims: _Victims | None = None  # built at the first eviction, then kept for the plan
        for layer, expert in wanted:
            if (expert in resident[layer] or expert in in_flight[layer]) \
                    and (not evicted or (layer, expert) not in evicted):
                continue
            if layer == this_layer and expert in gpu:
                continue
            left = quota_left.get(layer)
            if left is None:  # the layer's quota less what it holds and loads, plus what the plan drops
                left = capacity[layer] - len(resident[layer]) - len(in_flight[layer])
                if evicted:
                    for pair in evicted:
                        if pair[0] == layer:
                            left += 1
                if layer == this_layer:
                    left -= len(loads)
            full = left <= 0
            if full or (pool_left is not None and pool_left <= 0):
                if victims is None:
                    victims = _Victims(self.cache, view, plan, wanted, evicted)
                victim = victims.next(layer, full)
                if victim is None:
                    quota_left[layer] = left
                    continue
                evictions.append(victim)
                evicted.add(victim)
                if victim[0] == layer:
                    left += 1
                elif victim[0] in quota_left:
                    quota_left[victim[0]] += 1
                if pool_left is not None:
                    pool_left += 1
            prefetches.append((layer, expert))
            quota_left[layer] = left - 1
            if pool_left is not None:
                pool_left -= 1


#: ComposedSystem.plan as defined here: planner() hands out _place only while plan is still this function
_COMPOSED_PLAN = ComposedSystem.plan


class _Victims:
    """Resident experts a prefetch may drop, one at a time, in the cache policy's order.

    Never one of the wanted experts, a load in flight, the layer's GPU experts or what the plan already
    evicts (``evicted``, which grows as the plan does). From a layer whose quota is full, the cache
    policy ranks the layer's candidates once for as many victims as the layer has wanted experts (its
    ``victims(n)`` are the first ``n`` of one ranking, so this is the order that asking for one at a time
    gives) and later victims come off that list; when it runs out (a pool eviction took some), it is
    ranked again, unless the ranking held fewer than asked for: then every candidate was in it, and
    candidates only leave as the plan grows, so ranking again would find none. From a full model-wide
    pool, each victim is the cache policy's pool choice.
    """

    __slots__ = ("cache", "view", "plan", "wanted", "evicted", "_ranked", "_exhausted", "_pairs")

    def __init__(self, cache: CachePolicy, view: LayerView, plan: LayerPlan, wanted: list[tuple[int, int]],
                 evicted: set[tuple[int, int]]) -> None:
        self.cache, self.view, self.plan, self.wanted, self.evicted = cache, view, plan, wanted, evicted
        self._ranked: dict[int, list[int]] = {}
        #: layers whose candidates have all been ranked (and taken or evicted since)
        self._exhausted: set[int] = set()
        self._pairs: set[tuple[int, int]] | None = None

    def next(self, layer: int, own_layer: bool) -> tuple[int, int] | None:
        """The next (layer, expert) to evict for a prefetch into ``layer``: from that layer when its quota
        is full (``own_layer``), else (a full model-wide pool) wherever the cache policy chooses."""
        if own_layer:
            # the layer's ranking, kept last-first: its next victim is popped off the end
            ranked = self._ranked.get(layer)
            if ranked:
                evicted = self.evicted
                while ranked:
                    expert = ranked.pop()
                    if (layer, expert) not in evicted:
                        victim = layer, expert
                        break
                else:
                    victim = self._rank(layer)
            else:
                victim = self._rank(layer)
        else:
            victim = self._from_pool(layer)
        if victim is not None and self._pairs is not None:
            self._pairs.add(victim)
        return victim

    def _rank(self, layer: int) -> tuple[int, int] | None:
        """The first victim of a fresh ranking of ``layer``'s candidates (none once they ran out)."""
        if layer in self._exhausted:
            return None
        view, evicted = self.view, self.evicted
        wanted_here = []
        for l, e in self.wanted:
            if l == layer:
                wanted_here.append(e)
        keep = set(wanted_here)
        keep |= view.cache.in_flight[layer]
        if evicted:
            for l, e in evicted:
                if l == layer:
                    keep.add(e)
        if layer == view.layer:
            keep.update(self.plan.gpu)
        ranked = list(self.cache.victims(view, layer, len(wanted_here), keep))
        if len(ranked) < len(wanted_here):
            self._exhausted.add(layer)
        if not ranked:
            self._ranked[layer] = ranked
            return None
        ranked.reverse()
        self._ranked[layer] = ranked
        return layer, ranked.pop()

    def _from_pool(self, layer: int) -> tuple[int, int] | None:
        if self._pairs is None:
            view = self.view
            pairs = set(self.wanted) | {(l, e) for l, f in enumerate(view.cache.in_flight) for e in f}
            self._pairs = pairs | {(view.layer, e) for e in self.plan.gpu} | self.evicted
        pairs = self.cache.pool_victims(self.view, 1, self._pairs, layer)
        return pairs[0] if pairs else None


#: ``calibration`` values a component reads as something other than a trace path (and the empty string,
#: which every component takes for the replayed trace or none); the rest name a trace file
CALIBRATION_WORDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("prefetch", "smoe-token"): ("self",),
    ("prefetch", "eam-match"): ("others", "none"),
}
#: components that check a calibration trace's routing shape themselves
_OWN_SHAPE_CHECK = {("prefetch", "eam-match")}


def check_calibrations(components: dict[str, Component], model: ModelSpec) -> None:
    """Refuse, with one line naming the parameter, a ``<role>.calibration`` path that is no moesim trace or
    is a trace of another routing shape than the replayed model (layers, experts, top-k); checked before the
    run, whether or not the component's settings read it."""
    for role, component in components.items():
        if "calibration" not in component.parameters():
            continue
        value = getattr(component, "calibration", "")
        if not isinstance(value, str):
            continue
        words = CALIBRATION_WORDS.get((role, component.name), ())
        if (role, component.name) == ("prefetch", "eam-match"):
            if value.strip().lower() in ("", *words):
                continue
        elif value == "" or value in words:
            continue
        key = f"{role}.calibration"
        fix = (f"give a moesim trace of {model.name} ({model.num_layers} layers x {model.num_experts} experts, "
               f"top-{model.top_k}), {' or '.join(repr(w) for w in words) + ', ' if words else ''}"
               f"or leave it empty")
        try:
            meta = read_meta(value)
        except TraceFormatError as err:
            raise ConfigError(f"cannot read calibration trace {value}: {err.detail}", field=key, fix=fix) from None
        mismatch = model.routing_mismatch(meta.model)
        if mismatch and (role, component.name) not in _OWN_SHAPE_CHECK:
            raise ConfigError(f"calibration trace {value} ({meta.model.name}) does not match the replayed "
                              f"{model.name} ({mismatch})", field=key, fix=fix)
