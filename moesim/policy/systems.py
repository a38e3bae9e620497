"""Systems: named compositions of cache, assignment and prefetch components.

``build_system("gpu-only-lru", {"cache": "belady"})`` swaps a component by its
registry name; ``{"cache.calibration": "x.parquet"}`` sets a parameter.
"""

from __future__ import annotations

import numbers
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.errors import ConfigError, MoesimError, TraceFormatError, did_you_mean
from moesim.model.spec import ModelSpec
from moesim.policy.assign import AllCPU, AllGPU, Assignment, BestSplit, ResidentOnGPU
from moesim.policy.base import Component, LayerPlan, LayerView, PolicyError, RunContext, kept_rewrites
from moesim.policy.cache import (AllResident, BeladyCache, CachePolicy, LRUCache, NoCache, SlotSpread, StaticCache,
                                 make_room)
from moesim.policy.prefetch import NoPrefetch, PerfectPrefetch, Prefetch
from moesim.trace.io import read_meta

COMPONENTS: dict[str, dict[str, type[Component]]] = {
    "cache": {c.name: c for c in (NoCache, LRUCache, StaticCache, AllResident, BeladyCache)},
    "assign": {c.name: c for c in (AllCPU, AllGPU, ResidentOnGPU, BestSplit)},
    "prefetch": {c.name: c for c in (NoPrefetch, PerfectPrefetch)},
}


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
        return sorted({c for component in self.components.values() for c in component.columns})

    def for_model(self, model: ModelSpec) -> None:
        """Let each component settle its model-dependent defaults before the memory plan reads them."""
        check_calibrations(self.components, model)
        for component in self.components.values():
            component.for_model(model)

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

    def _place(self, view: LayerView) -> LayerPlan:
        gpu, cpu = self.assign.split(view)
        plan = LayerPlan(None, cpu)  # positional: a fifth cheaper than by keyword, every layer
        if not gpu:
            if self._prefetching:
                self._plan_prefetch(view, plan)
            return plan
        layer = view.layer
        state = view.cache
        resident, in_flight = state.resident[layer], state.in_flight[layer]
        if in_flight:
            present = [e for e in gpu if e in resident or e in in_flight]
            missing = [e for e in gpu if e not in resident and e not in in_flight]
        else:  # the common case, one set to look in
            present = [e for e in gpu if e in resident]
            missing = [e for e in gpu if e not in resident] if len(present) < len(gpu) else []
        if missing:
            missing = self.cache.admission_order(view, layer, missing)
            fits, evict = make_room(self.cache, view, layer, missing, set(present))
            plan.evictions = evict
            plan.loads = missing[:fits]
            plan.streamed = missing[fits:]
        # resident first (they can start at once), then loads in queue order, then streamed
        if in_flight:
            ready = [e for e in present if e in resident]
            arriving = sorted((e for e in present if e not in resident), key=lambda e: view.arrivals.get(e, 0.0))
            present = ready + arriving
        plan.gpu = present + plan.loads + plan.streamed
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
        evicted = set(plan.evictions)
        # per layer, the slots still free to a prefetch
        quota_left: dict[int, int] = {}
        pool_left = None if state.pool is None else state.pool - state.held() + len(evicted) - len(plan.loads)
        victims: _Victims | None = None  # built at the first eviction, then kept for the plan
        for layer, expert in wanted:
            if (state.has(layer, expert) and (layer, expert) not in evicted) \
                    or (layer == view.layer and expert in plan.gpu):
                continue
            if layer not in quota_left:  # the layer's quota less what it holds and loads, plus what the plan drops
                dropped = sum(1 for (l, _) in evicted if l == layer) if evicted else 0
                loading = len(plan.loads) if layer == view.layer else 0
                quota_left[layer] = state.capacity[layer] - state.used(layer) + dropped - loading
            full = quota_left[layer] <= 0
            if full or (pool_left is not None and pool_left <= 0):
                if victims is None:
                    victims = _Victims(self.cache, view, plan, wanted, evicted)
                victim = victims.next(layer, full)
                if victim is None:
                    continue
                plan.evictions.append(victim)
                evicted.add(victim)
                if victim[0] in quota_left:
                    quota_left[victim[0]] += 1
                if pool_left is not None:
                    pool_left += 1
            plan.prefetches.append((layer, expert))
            quota_left[layer] -= 1
            if pool_left is not None:
                pool_left -= 1


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
        victim = self._from_layer(layer) if own_layer else self._from_pool(layer)
        if victim is not None and self._pairs is not None:
            self._pairs.add(victim)
        return victim

    def _from_layer(self, layer: int) -> tuple[int, int] | None:
        ranked, evicted = self._ranked.get(layer), self.evicted
        while ranked and (layer, ranked[0]) in evicted:
            ranked.pop(0)
        if not ranked:
            if layer in self._exhausted:
                return None
            view = self.view
            wanted_here = [e for l, e in self.wanted if l == layer]
            keep = set(wanted_here)
            keep |= view.cache.in_flight[layer]
            if evicted:
                keep.update(e for l, e in evicted if l == layer)
            if layer == view.layer:
                keep.update(self.plan.gpu)
            ranked = self._ranked[layer] = list(self.cache.victims(view, layer, len(wanted_here), keep))
            if len(ranked) < len(wanted_here):
                self._exhausted.add(layer)
            if not ranked:
                return None
        return layer, ranked.pop(0)

    def _from_pool(self, layer: int) -> tuple[int, int] | None:
        if self._pairs is None:
            view = self.view
            pairs = set(self.wanted) | {(l, e) for l, f in enumerate(view.cache.in_flight) for e in f}
            self._pairs = pairs | {(view.layer, e) for e in self.plan.gpu} | self.evicted
        pairs = self.cache.pool_victims(self.view, 1, self._pairs, layer)
        return pairs[0] if pairs else None


# ----------------------------------------------------------------------------- a user's own policies, checked
#
# The catalogue's components and systems keep the policy interface by construction (and their tests); one of a
# user's own is checked as it runs: each method's result where a system reads it, the view unchanged by the call,
# the method's own errors named; and a system class of one's own, its whole plan. Each fault is one line
# (:class:`PolicyError`) naming the component and method, the step and layer, and the fix.


def is_catalogue(cls: type) -> bool:
    """Whether ``cls`` is moesim's own (a catalogue system or component), not a user's."""
    module = getattr(cls, "__module__", None) or ""
    return module == "moesim" or module.startswith("moesim.")


def check_users_policies(system: ComposedSystem) -> None:
    """Check every component of ``system`` that is not the catalogue's as it runs, and the plans of a system
    class of one's own (the catalogue's run as they are)."""
    for role, component in system.components.items():
        if is_catalogue(type(component)):
            continue
        _check_has_methods(role, component)
        for method, check in (*_RESULT_CHECKS.get(role, {}).items(), *_COMMON_CHECKS.items()):
            if callable(getattr(type(component), method, None)):
                try:
                    setattr(component, method, _CheckedMethod(component, role, method, check))
                except AttributeError:  # a component with __slots__: its plans are still checked by the engine
                    pass
    if not is_catalogue(type(system)):
        system.plan = _CheckedPlan(system)  # type: ignore[method-assign]


#: per role, the methods one of which a component must define (the base class's does nothing, or raises), and
#: how to define it
_REQUIRED = {
    "assign": (("split",), "split(self, view) returning (gpu, cpu), two lists that hold view.active"),
    "cache": (("victims", "initial"), "victims(self, view, layer, n, protected, incoming=None) returning up to n "
                                      "resident experts to evict, or, for a cache that never evicts, "
                                      "initial(self, layer, capacity) returning the experts it keeps"),
    "prefetch": (("candidates",), "candidates(self, view) returning (layer, expert) pairs to load ahead"),
    "substitute": (("rewrite",), "rewrite(self, view) returning (token row, top-k slot, new expert) rewrites"),
    "defer": (("choose",), "choose(self, view, plan) returning experts of plan.cpu to finish one layer late"),
}


def _check_has_methods(role: str, component: Component) -> None:
    """Refuse a user's component that defines none of its role's methods (it would do nothing, or fail at the
    first layer)."""
    if role not in _REQUIRED:
        return
    methods, how = _REQUIRED[role]
    base = next(c for c in type(component).__mro__ if is_catalogue(c) and getattr(c, "role", "") == role
                and c.__dict__.get("name") is None)
    if all(getattr(type(component), m, None) is getattr(base, m, None) for m in methods):
        raise PolicyError(f"has no {' or '.join(methods)} of its own",
                          source=f"{role} '{component.name}' ({type(component).__name__})", fix=f"define {how}")


def _fault(who: str, view: LayerView | None, problem: str, fix: str) -> PolicyError:
    where = f"at step {view.step}, layer {view.layer}, " if view is not None else ""
    return PolicyError(f"{where}{problem}", source=who, fix=fix)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _iterable(value: Any) -> bool:
    return value is not None and not isinstance(value, (str, bytes, Mapping)) and hasattr(value, "__iter__")


def _ints(who: str, view: LayerView | None, value: Any, what: str, fix: str) -> list[int]:
    """``value`` as a list of ints (numpy integers and arrays taken too); one line naming what else it holds."""
    if not _iterable(value):
        raise _fault(who, view, f"returned {_short(value)} as {what}, not a list of expert ids", fix)
    out = []
    for e in value:
        if not _is_int(e):
            raise _fault(who, view, f"returned {_short(e)} in {what}, not an expert id (an int)", fix)
        out.append(int(e))
    return out


def _pairs(who: str, view: LayerView | None, value: Any, what: str, fix: str) -> list[tuple[int, int]]:
    """``value`` as a list of (layer, expert) tuples of ints; one line naming an item that is none."""
    if not _iterable(value):
        raise _fault(who, view, f"returned {_short(value)} as {what}, not a list of (layer, expert) pairs", fix)
    out = []
    for item in value:
        if not (_iterable(item) and len(item) == 2 and all(map(_is_int, item))):
            raise _fault(who, view, f"returned {_short(item)} in its list, not a (layer, expert) pair of ints", fix)
        out.append((int(item[0]), int(item[1])))
    return out


def _returned_none(who: str, view: LayerView | None, fix: str, nothing: str) -> PolicyError:
    return _fault(who, view, "returned None", f"{fix}; did you forget `return`? ({nothing})")


def coverage_fault(active: Sequence[int], gpu: Sequence[int], cpu: Sequence[int],
                   deferred: Sequence[int] = ()) -> str:
    """What is wrong with computing ``gpu`` on the GPU, ``cpu`` on the CPU and ``deferred`` after the layer when
    ``active`` are routed ("" when each routed expert is computed exactly once, on one side)."""
    seen: dict[int, str] = {}
    for side, experts in (("on the GPU", gpu), ("on the CPU", cpu), ("deferred", deferred)):
        for e in experts:
            if e in seen:
                return f"plans expert {e} twice " + (side if seen[e] == side else f"({seen[e]} and {side})")
            seen[e] = side
    routed = set(active)
    stray = [e for e in seen if e not in routed]
    if stray:
        return (f"plans expert{'s' if len(stray) > 1 else ''} {', '.join(map(str, stray))} not routed at this "
                f"layer (routed: {', '.join(map(str, active))})")
    missing = [e for e in active if e not in seen]
    if missing:
        return f"leaves out routed expert{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    return ""


_SPLIT_FIX = "return (gpu, cpu): two lists that hold each expert of view.active once, e.g. (list(view.active), [])"
_VICTIMS_FIX = ("return at most n experts of view.cache.resident[layer], none of them in protected (in use at "
                "this layer or on its way), each once")
_POOL_FIX = ("return at most n (layer, expert) pairs, each resident (view.cache.resident[layer]) and none in "
             "protected, each once")
_CANDIDATES_FIX = "return a list of (layer, expert) pairs, layer in 0..{L} and expert in 0..{E}, each once"


def _check_split(who: str, view: LayerView, out: Any) -> tuple[list[int], list[int]]:
    if out is None:
        raise _returned_none(who, view, _SPLIT_FIX, "(list(view.active), []) puts every expert on the GPU")
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and not any(map(_is_int, out))):
        raise _fault(who, view, f"returned {_short(out)}, not a pair (gpu, cpu)", _SPLIT_FIX)
    gpu = _ints(who, view, out[0], "the GPU list", _SPLIT_FIX)
    cpu = _ints(who, view, out[1], "the CPU list", _SPLIT_FIX)
    problem = coverage_fault(view.active, gpu, cpu)
    if problem:
        raise _fault(who, view, problem, _SPLIT_FIX)
    return gpu, cpu


def _check_victims(who: str, view: LayerView, out: Any, layer: int, n: int, protected: set[int],
                   incoming: list[int] | None = None) -> list[int]:
    if out is None:
        raise _returned_none(who, view, _VICTIMS_FIX, "[] evicts nothing")
    victims = _ints(who, view, out, "its victims", _VICTIMS_FIX)
    if len(victims) > max(n, 0):
        raise _fault(who, view, f"returned {len(victims)} experts for n={n}", _VICTIMS_FIX)
    resident, seen = view.cache.resident[layer], set()
    for e in victims:
        if e in seen:
            raise _fault(who, view, f"returned expert {e} twice", _VICTIMS_FIX)
        if e in protected:
            raise _fault(who, view, f"returned expert {e}, which is protected (in use at this layer or on its way)",
                         _VICTIMS_FIX)
        if e not in resident:
            raise _fault(who, view, f"returned expert {e}, which is not resident in layer {layer}", _VICTIMS_FIX)
        seen.add(e)
    return victims


def _check_pool_victims(who: str, view: LayerView, out: Any, n: int, protected: set[tuple[int, int]],
                        layer: int) -> list[tuple[int, int]]:
    if out is None:
        raise _returned_none(who, view, _POOL_FIX, "[] evicts nothing")
    pairs = _pairs(who, view, out, "its victims", _POOL_FIX)
    if len(pairs) > max(n, 0):
        raise _fault(who, view, f"returned {len(pairs)} experts for n={n}", _POOL_FIX)
    seen: set[tuple[int, int]] = set()
    for pair in pairs:
        if pair in seen:
            raise _fault(who, view, f"returned {pair} twice", _POOL_FIX)
        if pair in protected:
            raise _fault(who, view, f"returned {pair}, which is protected", _POOL_FIX)
        if not 0 <= pair[0] < view.num_layers or pair[1] not in view.cache.resident[pair[0]]:
            raise _fault(who, view, f"returned {pair}, which is not resident", _POOL_FIX)
        seen.add(pair)
    return pairs


def _check_admission(who: str, view: LayerView, out: Any, layer: int, missing: list[int]) -> list[int]:
    fix = "return the experts of missing, each once, in the order they should get a slot"
    if out is None:
        raise _returned_none(who, view, fix, "return missing to keep their order")
    order = _ints(who, view, out, "its order", fix)
    if sorted(order) != sorted(missing):
        raise _fault(who, view, f"returned {_short(order)} for missing experts {_short(list(missing))}", fix)
    return order


def _check_candidates(who: str, view: LayerView, out: Any) -> list[tuple[int, int]]:
    layers, experts = view.num_layers, view.cache_experts()
    fix = _CANDIDATES_FIX.format(L=layers - 1, E=experts - 1)
    if out is None:
        raise _returned_none(who, view, fix, "[] prefetches nothing")
    pairs, seen = _pairs(who, view, out, "its candidates", fix), set()
    for layer, expert in pairs:
        if not 0 <= layer < layers:
            raise _fault(who, view, f"returned ({layer}, {expert}): layer {layer} outside 0..{layers - 1}", fix)
        if not 0 <= expert < experts:
            raise _fault(who, view, f"returned ({layer}, {expert}): expert {expert} outside 0..{experts - 1}", fix)
        if (layer, expert) in seen:
            raise _fault(who, view, f"returned ({layer}, {expert}) twice", fix)
        seen.add((layer, expert))
    return pairs


def _check_rewrite(who: str, view: LayerView, out: Any) -> Sequence[tuple[int, int, int]]:
    from moesim.policy.base import Substitutions
    fix = (f"return a list of (token row, top-k slot, new expert), row in 0..{view.tokens - 1}, slot in "
           f"0..{view.experts.shape[1] - 1}, expert in 0..{view.cache_experts() - 1}, each (row, slot) once")
    if out is None:
        raise _returned_none(who, view, fix, "[] rewrites nothing")
    if isinstance(out, Substitutions):
        return out
    if not _iterable(out):
        raise _fault(who, view, f"returned {_short(out)}, not a list of (row, slot, expert)", fix)
    rewrites, seen = [], set()
    bounds = (view.tokens, view.experts.shape[1], view.cache_experts())
    for item in out:
        if not (_iterable(item) and len(item) == 3 and all(map(_is_int, item))):
            raise _fault(who, view, f"returned {_short(item)} in its list, not a (row, slot, expert) of ints", fix)
        entry = tuple(int(x) for x in item)
        if not all(0 <= x < bound for x, bound in zip(entry, bounds)):
            raise _fault(who, view, f"returned {entry}, outside the layer's routing", fix)
        if entry[:2] in seen:
            raise _fault(who, view, f"rewrites row {entry[0]}, slot {entry[1]} twice", fix)
        seen.add(entry[:2])
        rewrites.append(entry)
    return rewrites


def _check_choose(who: str, view: LayerView, out: Any, plan: LayerPlan) -> list[int]:
    fix = "return experts of plan.cpu (each once) whose results may arrive one layer late"
    if out is None:
        raise _returned_none(who, view, fix, "[] defers nothing")
    chosen = _ints(who, view, out, "its choice", fix)
    if len(set(chosen)) < len(chosen) or not set(chosen) <= set(plan.cpu):
        raise _fault(who, view, f"returned {_short(chosen)}, not distinct experts of plan.cpu "
                                f"{_short(list(plan.cpu))}", fix)
    return chosen


def _check_initial(who: str, view: None, out: Any, layer: int, capacity: int) -> list[int]:
    fix = "return at most capacity distinct expert ids, the experts resident before the first step"
    if out is None:
        raise _returned_none(who, None, fix, "[] starts the layer empty")
    experts = _ints(who, None, out, "its initial experts", fix)
    if len(set(experts)) < len(experts) or len(experts) > capacity:
        raise _fault(who, None, f"initial({layer}, {capacity}) returned {_short(experts)}: "
                                f"{'an expert twice' if len(set(experts)) < len(experts) else 'more than capacity'}",
                     fix)
    return experts


#: per role, each method whose result a system reads, and its check (called as check(who, view, out, *args))
_RESULT_CHECKS: dict[str, dict[str, Callable[..., Any]]] = {
    "assign": {"split": _check_split},
    "cache": {"victims": _check_victims, "pool_victims": _check_pool_victims,
              "admission_order": _check_admission, "initial": _check_initial, "touch": None, "spread": None},
    "prefetch": {"candidates": _check_candidates},
    "substitute": {"rewrite": _check_rewrite},
    "defer": {"choose": _check_choose},
}
#: methods of every role checked for their own errors only
_COMMON_CHECKS: dict[str, Callable[..., Any] | None] = {"configure": None, "for_model": None}

_READ_ONLY_FIX = ("a view is read-only, the engine plans and runs the layer from it: keep state in the component's "
                  "own fields, and copy what you would change (sorted(view.active), set(view.cache.resident[layer]))")


class _ViewSnapshot:
    """What a view held before a policy's call, to tell whether the call changed it: its routing, this layer's
    resident and in-flight experts as sets, every layer's as counts (cheap enough to take at every call)."""

    __slots__ = ("fields", "copies", "resident", "in_flight", "counts")

    def __init__(self, view: LayerView) -> None:
        cache = view.cache
        self.fields = (view.experts, view.active, view.counts, view.arrivals, view.cache)
        self.copies = (view.experts.copy(), list(view.active), list(view.counts), dict(view.arrivals))
        self.resident, self.in_flight = set(cache.resident[view.layer]), set(cache.in_flight[view.layer])
        self.counts = ([len(r) for r in cache.resident], [len(f) for f in cache.in_flight])

    def changed(self, view: LayerView) -> str:
        """The first part of ``view`` that is not as it was ("" when none)."""
        names = ("view.experts", "view.active", "view.counts", "view.arrivals", "view.cache")
        now = (view.experts, view.active, view.counts, view.arrivals, view.cache)
        for name, before, after in zip(names, self.fields, now):
            if before is not after:
                return f"replaced {name}"
        experts, active, counts, arrivals = self.copies
        if not np.array_equal(view.experts, experts):
            return "changed view.experts"
        for name, before, after in zip(names[1:4], (active, counts, arrivals),
                                       (view.active, view.counts, view.arrivals)):
            if before != after:
                return f"changed {name}"
        cache = view.cache
        for name, sets, here, counts in (("resident", cache.resident, self.resident, self.counts[0]),
                                         ("in_flight", cache.in_flight, self.in_flight, self.counts[1])):
            if sets[view.layer] != here:
                return f"changed view.cache.{name}[{view.layer}]"
            for layer, (held, count) in enumerate(zip(sets, counts)):
                if len(held) != count:
                    return f"changed view.cache.{name}[{layer}]"
        return ""


def _own_line(err: BaseException) -> str:
    """Where ``err`` was raised in the user's code: the deepest frame outside moesim, Python and its packages."""
    frames = traceback.extract_tb(err.__traceback__)
    prefixes = tuple({os.path.join(p, "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    moesim_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
    own = [f for f in frames if not os.path.abspath(f.filename).startswith((moesim_dir, *prefixes))]
    frame = (own or frames)[-1] if frames else None
    return f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})" if frame else ""


def _raised(who: str, view: LayerView | None, err: Exception) -> PolicyError:
    text = " ".join(str(err).split())
    return _fault(who, view, f"raised {type(err).__name__}{': ' + text if text else ''}{_own_line(err)}",
                  "the fault is in the policy's own code; this error's __cause__ holds its traceback")


class _CheckedMethod:
    """A user's component method as a system calls it: its errors named, the view left as it was, its result
    checked (and given to the system as plain lists of ints)."""

    __slots__ = ("component", "method", "check", "who", "names")

    def __init__(self, component: Component, role: str, method: str, check: Callable[..., Any] | None) -> None:
        import inspect
        self.component, self.method, self.check = component, method, check
        self.who = f"{role} '{component.name}' ({type(component).__name__}.{method})"
        try:  # the arguments' names, as the method calls them
            self.names = [p for p in inspect.signature(getattr(type(component), method)).parameters][1:]
        except (TypeError, ValueError):
            self.names = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view = args[0] if args and isinstance(args[0], LayerView) else None
        before = _ViewSnapshot(view) if view is not None else None
        # lists, sets and plans handed in are the system's own (touch's ``used`` is the plan's GPU experts)
        given = [(i, _copied(a)) for i, a in enumerate(args) if isinstance(a, (list, set, LayerPlan))]
        try:
            out = getattr(type(self.component), self.method)(self.component, *args, **kwargs)
        except MoesimError:
            raise
        except Exception as err:
            raise _raised(self.who, view, err) from err
        if before is not None:
            changed = before.changed(view)
            if changed:
                raise _fault(self.who, view, changed, _READ_ONLY_FIX)
        for i, copy in given:
            if _copied(args[i]) != copy:
                name = self.names[i] if i < len(self.names) else f"#{i + 1}"
                raise _fault(self.who, view, f"changed its argument {name}",
                             "arguments are the system's own (used is the plan's GPU experts): read them, or "
                             "change a copy (list(used), set(protected))")
        if self.check is None:
            return out
        if view is None:
            return self.check(self.who, None, out, *args, **kwargs)
        return self.check(self.who, view, out, *args[1:], **kwargs)


def _copied(value: Any) -> Any:
    """A copy of a list, a set or a plan's lists, to compare with after a policy's call."""
    if isinstance(value, LayerPlan):
        return tuple(list(getattr(value, f)) for f in ("gpu", "cpu", "loads", "streamed", "prefetches", "evictions",
                                                       "writebacks", "deferred"))
    return type(value)(value)


_PLAN_FIX = "see LayerPlan (moesim.policy.base) for what each field holds; ComposedSystem.plan makes a valid plan"


class _CheckedPlan:
    """The plan of a system class of one's own as the engine calls it: its errors named, the view left as it
    was, and the plan checked against the invariants every plan keeps (:func:`plan_fault`)."""

    __slots__ = ("system", "who")

    def __init__(self, system: ComposedSystem) -> None:
        self.system = system
        self.who = f"system '{system.name}' ({type(system).__name__}.plan)"

    def __call__(self, view: LayerView) -> LayerPlan:
        before = _ViewSnapshot(view)
        try:
            plan = type(self.system).plan(self.system, view)
        except MoesimError:
            raise
        except Exception as err:
            raise _raised(self.who, view, err) from err
        changed = before.changed(view)
        if changed:
            raise _fault(self.who, view, changed, _READ_ONLY_FIX)
        if not isinstance(plan, LayerPlan):
            raise _fault(self.who, view, f"returned {_short(plan)}, not a LayerPlan", _PLAN_FIX)
        problem = plan_fault(view, plan)
        if problem:
            raise _fault(self.who, view, problem, _PLAN_FIX)
        return plan


def plan_fault(view: LayerView, plan: LayerPlan) -> str:
    """What ``plan`` breaks of what every plan keeps ("" when nothing): each routed expert computed once, on one
    side; every GPU expert resident, on its way, loaded or streamed; evictions of resident experts not in use;
    loads and prefetches of experts not there yet, within the layer's slots and the pool; write-backs only of
    evicted experts."""
    lists = {"gpu": plan.gpu, "cpu": plan.cpu, "loads": plan.loads, "streamed": plan.streamed,
             "deferred": plan.deferred}
    for name, value in lists.items():
        if not _iterable(value) or not all(map(_is_int, value)):
            return f"plan.{name} is {_short(value)}, not a list of expert ids"
    for name in ("prefetches", "evictions", "writebacks"):
        value = getattr(plan, name)
        if not _iterable(value) or not all(_iterable(p) and len(p) == 2 and all(map(_is_int, p)) for p in value):
            return f"plan.{name} is {_short(value)}, not a list of (layer, expert) pairs"
    routed = view.substituted(plan.substitutions) if plan.substitutions else view
    problem = coverage_fault(routed.active, plan.gpu, plan.cpu, plan.deferred)
    if problem:
        return problem
    cache, layer, layers = view.cache, view.layer, view.num_layers
    evictions = [(int(l), int(e)) for l, e in plan.evictions]
    evicted = set(evictions)
    gpu = set(plan.gpu)
    if len(evicted) < len(evictions):
        return "evicts an expert twice"
    for lay, e in evictions:
        if not 0 <= lay < layers or e not in cache.resident[lay]:
            return f"evicts expert {e} of layer {lay}, which is not resident"
        if lay == layer and e in gpu:
            return f"evicts expert {e}, which it computes on the GPU at this layer"
    if not {(int(l), int(e)) for l, e in plan.writebacks} <= evicted:
        return "writes back an expert it does not evict"
    resident, in_flight = cache.resident[layer], cache.in_flight[layer]
    loads, streamed = [int(e) for e in plan.loads], set(plan.streamed)
    if len(set(loads)) < len(loads):
        return "loads an expert twice"
    for e in loads:
        if e not in gpu:
            return f"loads expert {e}, which it does not compute on the GPU (loads are demand loads)"
        if e in in_flight or (e in resident and (layer, e) not in evicted):
            return f"loads expert {e}, which is already {'on its way' if e in in_flight else 'resident'}"
    if streamed & set(loads):
        return "both loads and streams an expert"
    for e in plan.gpu:
        if not ((e in resident and (layer, e) not in evicted) or e in in_flight or e in loads or e in streamed):
            return (f"GPU expert {e} is neither resident, on its way, loaded (plan.loads) nor streamed "
                    "(plan.streamed)")
    taking: dict[int, int] = {layer: len(loads)} if loads else {}
    prefetched: set[tuple[int, int]] = set()
    for lay, e in plan.prefetches:
        lay, e = int(lay), int(e)
        if not 0 <= lay < layers or not 0 <= e < view.cache_experts():
            return f"prefetches expert {e} of layer {lay}, outside the model"
        if (lay, e) in prefetched or (lay == layer and e in loads):
            return f"loads expert {e} of layer {lay} twice"
        if e in cache.in_flight[lay] or (e in cache.resident[lay] and (lay, e) not in evicted):
            return f"prefetches expert {e} of layer {lay}, which is already there"
        prefetched.add((lay, e))
        taking[lay] = taking.get(lay, 0) + 1
    if plan.cancel_queued_prefetches:
        return ""  # slots of the prefetches it drops free up first: what they are is the engine's to know
    dropped: dict[int, int] = {}
    for lay, _ in evictions:
        dropped[lay] = dropped.get(lay, 0) + 1
    for lay, count in taking.items():
        free = cache.capacity[lay] - cache.used(lay) + dropped.get(lay, 0)
        if count > free:
            return (f"loads {count} expert{'s' if count > 1 else ''} into layer {lay}, which has {max(free, 0)} "
                    f"free slot{'' if free == 1 else 's'} (evict first: plan.evictions)")
    if cache.pool is not None and sum(taking.values()) > cache.pool - cache.held() + len(evictions):
        return f"loads {sum(taking.values())} experts into the model-wide pool beyond its {cache.pool} slots"
    return ""


@dataclass(frozen=True)
class SystemSpec:
    """A named composition: a registry name per role, and the class that plans with them."""

    description: str
    cache: str = "none"
    assign: str = "cpu"
    prefetch: str = "none"
    substitute: str = "none"
    defer: str = "none"
    ignores_memory: bool = False
    uses_cache: bool = True
    #: a bound that runs several schedules and keeps, per metric, the best
    portfolio: tuple[str, ...] = ()
    #: the portfolio also runs every listed system that keeps to the memory budget
    portfolio_catalogue: bool = False
    #: listed by `moesim systems` and run by `--system all`
    listed: bool = True
    #: ComposedSystem or a subclass with its own planning steps
    system_class: type[ComposedSystem] = ComposedSystem
    #: default parameters of the composition, as ``--set`` would give them (engine.* and memory.* too);
    #: the user's own ``--set`` wins
    defaults: tuple[tuple[str, str], ...] = ()
    #: the software it runs on, a key of the profile's ``runtimes`` (launch costs, CPU kernel efficiency;
    #: 001_66a328d79a3cae8d.txt Sec. 2.3); ``generic`` takes the gpu section's launch_us and cuda_graph.
    #: ``--set runtime=NAME`` swaps it.
    runtime: str = "generic"

    def roles(self) -> dict[str, str]:
        return {role: getattr(self, role) for role in ROLES}


ROLES = ("cache", "assign", "prefetch", "substitute", "defer")

SYSTEMS: dict[str, SystemSpec] = {}


#: the systems and components moesim itself registers (set once the catalogue is imported, at the end of this
#: module): a user's own may not take their names
CATALOGUE_SYSTEMS: frozenset[str] = frozenset()
CATALOGUE_COMPONENTS: frozenset[tuple[str, str]] = frozenset()

#: the base class of each role's components, as the errors about a component name them
ROLE_BASES = {"cache": "CachePolicy", "assign": "Assignment", "prefetch": "Prefetch", "substitute": "Substitution",
              "defer": "Deferral"}


def register_component(cls: type[Component]) -> type[Component]:
    """Class decorator: make a component reachable by ``--set <role>=<name>``.

    ``cls.name`` must be the class's own (a subclass that keeps its parent's would replace the parent) and no
    catalogue component's; defining a class of the same name again (a notebook cell run twice) replaces it."""
    what = getattr(cls, "__name__", repr(cls))
    role = getattr(cls, "role", "")
    if not isinstance(cls, type) or not issubclass(cls, Component) or role not in ROLES:
        raise ConfigError(f"{what} is no component of a role: it cannot be registered", field="role",
                          fix=f"subclass one of {', '.join(ROLE_BASES.values())} (moesim.policy.cache, .assign, "
                              ".prefetch, .systems)")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name.strip():
        inherited = f" (it inherits '{cls.name}' from {cls.__mro__[1].__name__})" if cls.name else ""
        raise ConfigError(f"{what} has no name of its own{inherited}", field="name",
                          fix=f"give the class its own registry name, e.g. name = 'my-{role}'")
    taken = COMPONENTS.setdefault(role, {}).get(name)
    if taken is not None and taken is not cls:
        if (role, name) in CATALOGUE_COMPONENTS:
            raise ConfigError(f"{role} '{name}' is a catalogue component ({taken.__module__}.{taken.__name__}); "
                              f"{what} cannot take its name", field="name",
                              fix=f"give {what} another name, e.g. name = 'my-{name}'")
        if (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ConfigError(f"{role} '{name}' is already {taken.__module__}.{taken.__qualname__}; {what} "
                              "cannot take its name", field="name", fix=f"give {what} another name")
    COMPONENTS[role][name] = cls
    return cls


def register_system(name: str, spec: SystemSpec) -> None:
    """Make ``spec`` runnable as ``name`` (``moesim.replay(..., system=name)``, a sweep's ``systems``); a name
    the catalogue uses, or the command line reads otherwise (``all``, a comma), is refused. Registering a name
    of one's own again replaces it."""
    if not isinstance(name, str) or not name.strip() or name != name.strip() or "," in name or name == "all":
        raise ConfigError(f"{name!r} cannot be a system name", field="name",
                          fix="a system name is a word without commas or surrounding spaces, other than 'all' "
                              "(which means every system), e.g. 'my-lru'")
    if name in CATALOGUE_SYSTEMS:
        raise ConfigError(f"'{name}' is a catalogue system", field="name",
                          fix=f"register yours under another name, e.g. 'my-{name}' (to run {name} with other "
                              "parameters, give them as settings; `moesim systems " + name + "` lists them)")
    if not isinstance(spec, SystemSpec):
        raise ConfigError(f"system '{name}' must be a SystemSpec, got {spec!r}", field="spec",
                          fix="e.g. register_system(name, SystemSpec('what it does', cache='lru', assign='gpu'))")
    if not (isinstance(spec.system_class, type) and issubclass(spec.system_class, ComposedSystem)):
        raise ConfigError(f"system '{name}': system_class {spec.system_class!r} is no ComposedSystem", field="spec",
                          fix="subclass ComposedSystem (moesim.policy.systems) and override plan(self, view), or "
                              "leave system_class out to compose the components")
    SYSTEMS[name] = spec


for _cls in (NoSubstitution, NoDeferral):
    register_component(_cls)

register_system("cpu-only", SystemSpec(
    "KTransformers-style: routed experts on the CPU; attention and shared experts on the GPU (001 Sec. 3)",
    cache="none", assign="cpu", uses_cache=False))
register_system("gpu-only-lru", SystemSpec(
    "every expert computed on the GPU; per-layer LRU cache; on-demand loads (Mixtral-offloading style)",
    cache="lru", assign="gpu"))
register_system("static-hot", SystemSpec(
    "Fiddler-style: hottest experts pinned on the GPU, the rest on the CPU", cache="static-hot", assign="resident"))
register_system("all-in-gpu", SystemSpec(
    "reference, not a bound: every expert resident on the GPU, GPU memory not enforced (CPU-assisted "
    "schedules within the memory budget may beat it)", cache="all", assign="gpu", ignores_memory=True,
    runtime="ideal"))
register_system("oracle", SystemSpec(
    "bound within the memory budget: per metric (TPOT, TTFT, makespan), the best of schedules that know the "
    "whole trace (Belady cache with perfect next-layer prefetch and the best CPU/GPU split per layer; the "
    "trace's hottest experts pinned with the best split; Belady and LRU demand paging; these on an ideal "
    "runtime without launch or host costs) and of every listed system under the same memory budget; the notes "
    "name the schedule behind each metric",
    portfolio=("oracle-prefetch", "oracle-pinned", "belady", "gpu-only-lru"), portfolio_catalogue=True,
    runtime="ideal"))
register_system("oracle-prefetch", SystemSpec(
    "Belady cache, perfect next-layer prefetch, best CPU/GPU split per layer",
    cache="belady", assign="best", prefetch="perfect", listed=False, runtime="ideal"))
register_system("oracle-pinned", SystemSpec(
    "the trace's hottest experts pinned, best CPU/GPU split per layer", cache="static-hot", assign="best",
    listed=False, runtime="ideal"))
register_system("belady", SystemSpec(
    "every expert on the GPU, Belady's optimal eviction per layer, demand loads", cache="belady", assign="gpu",
    listed=False, runtime="ideal"))


def system_names(all_systems: bool = False) -> list[str]:
    """Systems `--system all` runs (or every registered one)."""
    return [n for n, spec in SYSTEMS.items() if spec.listed or all_systems]


def own_weights(name: str) -> str:
    """The weight settings a system's defaults impose (``memory.expert_dtype=int4`` for mixtral-offloading),
    or "" when it runs the replay's weights."""
    spec = SYSTEMS.get(name)
    return ", ".join(f"{k}={v}" for k, v in spec.defaults if k.startswith("memory.")) if spec else ""


def portfolio_members(name: str) -> tuple[str, ...]:
    """The single systems a portfolio bound runs: its own schedules, then (``portfolio_catalogue``) every
    listed catalogue system that keeps to the memory budget, keeps the replay's weight dtypes (a system whose
    defaults set ``memory.*``, like mixtral-offloading's int4 experts, runs other weights) and is not
    itself a portfolio. A user's own systems are not members: the bound they are measured against is the
    same whatever else is registered."""
    spec = SYSTEMS[name]
    if not spec.portfolio:
        return (name,)
    out = list(spec.portfolio)
    if spec.portfolio_catalogue:
        out += [n for n in system_names() if n not in out and not SYSTEMS[n].portfolio
                and not SYSTEMS[n].ignores_memory and not own_weights(n)
                and (n in CATALOGUE_SYSTEMS or not CATALOGUE_SYSTEMS)]
    return tuple(out)


def check_system_name(name: str, field: str = "--system", source: str | None = None, or_all: bool = False) -> None:
    """One line for a name that is no system: its likely meaning, then every system (and ``all`` where the
    caller takes it)."""
    if name not in SYSTEMS:
        valid = [*SYSTEMS, "all"] if or_all else list(SYSTEMS)
        raise ConfigError(f"unknown system '{name}'", source=source, field=field,
                          fix=f"{did_you_mean(name, SYSTEMS)}use one of: {', '.join(valid)}")


def build_system(name: str, settings: dict[str, str] | None = None) -> ComposedSystem:
    """Build a system, applying component swaps (``cache=lru``) and parameters (``cache.x=1``)."""
    check_system_name(name, or_all=True)
    spec = SYSTEMS[name]
    if spec.portfolio:
        raise ValueError(f"{name} is a portfolio of {spec.portfolio}: build its members")
    chosen = spec.roles()
    # engine/memory/hw defaults of the spec are applied by the executor's set-up, not here
    own = {k: v for k, v in spec.defaults if k.partition(".")[0] in ROLES}
    given = dict(settings or {})
    settings = {**own, **given}
    for role in ROLES:
        if role in settings:
            chosen[role] = settings.pop(role)
    parts: dict[str, Component] = {}
    for role, comp_name in chosen.items():
        registry = COMPONENTS[role]
        if comp_name not in registry:
            raise ConfigError(f"unknown {role} component '{comp_name}'", field=role,
                              fix=f"{did_you_mean(comp_name, registry)}use one of: {', '.join(registry)}")
        parts[role] = made(role, comp_name, registry[comp_name])
    for key, value in settings.items():
        role, _, param = key.partition(".")
        if role not in parts or param not in parts[role].parameters():
            if key in own and key not in given and chosen.get(role) != getattr(spec, role, None):
                continue  # the system's own setting of a component swapped for one without it
            _refuse_unknown(name, key, chosen, parts)
        set_checked(parts[role], param, value, key)
    return spec.system_class(name=name, description=spec.description, ignores_memory=spec.ignores_memory,
                             uses_cache=spec.uses_cache, **parts)  # type: ignore[arg-type]


def made(role: str, name: str, cls: type[Component]) -> Component:
    """A component of ``cls`` with its defaults; one line for a user's class whose parameters are not
    dataclass fields (the decorator forgotten) or which needs arguments (a field without a default)."""
    import dataclasses
    import typing
    who = f"{role} '{name}' ({cls.__name__})"
    if not is_catalogue(cls):
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        own = cls.__dict__.get("__annotations__", {})
        lost = [k for k, v in own.items() if not k.startswith("_") and k not in fields
                and not (v is typing.ClassVar or str(v).startswith(("ClassVar", "typing.ClassVar")))]
        if lost:
            raise ConfigError(f"{cls.__name__} is no dataclass: its field{'s' if len(lost) > 1 else ''} "
                              f"{', '.join(lost)} {'are' if len(lost) > 1 else 'is'} no parameter", source=who,
                              fix="decorate the class with @dataclass (under @register_component), as "
                                  "notebooks/custom_policy.ipynb does")
    try:
        return cls()
    except TypeError as err:
        if is_catalogue(cls):
            raise
        raise ConfigError(f"{who} cannot be made with no arguments: {err}",
                          fix="give every field a default (name: int = 4, or field(default_factory=list))") from None


def _refuse_unknown(name: str, key: str, chosen: dict[str, str], parts: dict[str, Component]) -> None:
    """The error for ``--set key`` that system ``name``'s components do not take: which other components of
    the role take it (prefetch.n with no prefetcher chosen), or else every parameter they do take."""
    if not key.strip():
        raise ConfigError("a setting with no parameter name", field="--set",
                          fix="write --set KEY=VALUE, e.g. --set cache.slots_per_layer=4")
    role, _, param = key.partition(".")
    takers = [c for c, comp in COMPONENTS.get(role, {}).items() if param and param in comp.parameters()]
    if role in parts and takers:
        raise ConfigError(f"{role} '{chosen[role]}' of system '{name}' has no parameter '{key}'; "
                          f"{role} {', '.join(takers)} {'has' if len(takers) == 1 else 'have'} it", field="--set",
                          fix=f"choose one with --set {role}={takers[0]} as well, or pick a system whose {role} "
                              f"takes {key} (`moesim systems NAME` lists a system's parameters)")
    keys = [f"{r}.{p}" for r, part in parts.items() for p in part.parameters()]
    valid = keys + [f"{r}=<{'|'.join(COMPONENTS[r])}>" for r in ROLES]
    guess = did_you_mean(key, [*keys, *ROLES, "cache.slots", "cache.slots_per_layer"])
    raise ConfigError(f"unknown parameter '{key}' for system '{name}'", field="--set",
                      fix=f"{guess}valid: {', '.join(valid)}, engine.*, memory.*, hw.*, cache.slots, "
                          "cache.slots_per_layer (`moesim systems` lists them all)")


#: closed ranges of parameters beyond the general rule (finite, not negative): (role, component, parameter)
PARAM_BOUNDS: dict[tuple[str, str, str], tuple[float, float]] = {
    ("substitute", "buddy", "tau_percentile"): (0.0, 100.0),
}


def set_checked(part: Component, param: str, value, key: str) -> None:
    """``part.set_param`` with every refusal naming what the parameter takes: a parameter whose negative
    default means "choose for me" (``prefetch.n=-1``) is offered that value beside ``>= 0``, and a
    parameter of :data:`PARAM_BOUNDS` is held to its range."""
    default = part.parameters()[param]
    try:
        part.set_param(param, value)
    except ConfigError as err:
        if isinstance(default, (int, float)) and not isinstance(default, bool) and default < 0 \
                and err.detail.endswith("is negative"):
            from moesim.analysis.params import parameter_docs
            meaning = next((d.meaning for d in parameter_docs(type(part)) if d.name == param), "")
            raise ConfigError(err.detail, field=key,
                              fix=f"give a value >= 0, or {default} as by default"
                                  + (f" ({key}: {meaning})" if meaning else "")) from None
        raise
    bounds = PARAM_BOUNDS.get((part.role, part.name, param))
    got = getattr(part, param)
    if bounds is not None and isinstance(got, (int, float)) and not bounds[0] <= got <= bounds[1]:
        raise ConfigError(f"{key}={got} outside [{bounds[0]:g}, {bounds[1]:g}]", field=key,
                          fix=f"give a value from {bounds[0]:g} to {bounds[1]:g}, e.g. {default}")


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


def all_parameters(name: str) -> list[str]:
    spec = SYSTEMS[name]
    if spec.portfolio:
        return sorted({p for member in spec.portfolio for p in all_parameters(member)})  # its own schedules
    out = []
    for role, comp_name in spec.roles().items():
        out += [f"{role}.{p}" for p in COMPONENTS[role][comp_name].parameters()]
        out.append(f"{role}=<{'|'.join(COMPONENTS[role])}>")
    return out


# Systems from the papers register themselves on import.
from moesim.policy import catalog  # noqa: E402,F401

CATALOGUE_SYSTEMS = frozenset(SYSTEMS)
CATALOGUE_COMPONENTS = frozenset((role, name) for role, registry in COMPONENTS.items() for name in registry)
