"""Systems: named compositions of cache, assignment and prefetch components.

``build_system("gpu-only-lru", {"cache": "belady"})`` swaps a component by its
registry name; ``{"cache.calibration": "x.parquet"}`` sets a parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moesim.errors import ConfigError, TraceFormatError, did_you_mean
from moesim.model.spec import ModelSpec
from moesim.policy.assign import AllCPU, AllGPU, Assignment, BestSplit, ResidentOnGPU
from moesim.policy.base import Component, LayerPlan, LayerView, RunContext, kept_rewrites, split_plan
from moesim.policy.cache import (AllResident, BeladyCache, CachePolicy, LRUCache, NoCache, SlotSpread, StaticCache,
                                 make_room)
from moesim.policy.checked import check_users_policies, is_catalogue
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
    if CATALOGUE_SYSTEMS:  # a system of one's own: its components are named now, not at its first run
        for role, component in spec.roles().items():
            registry = COMPONENTS.get(role, {})
            if component not in registry:
                raise ConfigError(f"system '{name}': no {role} component is registered as {component!r}",
                                  field=f"SystemSpec.{role}",
                                  fix=f"{did_you_mean(str(component), registry)}use one of: {', '.join(registry)} "
                                      f"(a component of one's own: register it, @register_component, before "
                                      "the system)")
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
                          fix=f"{did_you_mean(name, SYSTEMS)}use one of: {', '.join(valid)}; a system of one's "
                              "own is registered by importing its module: moesim --import my_policies.py ..., "
                              "or import: [my_policies.py] in a sweep spec")


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
                          f"cache.slots_per_layer (`moesim systems {name}` lists them all)")


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
