"""Systems: named compositions of cache, assignment and prefetch components.

``build_system("gpu-only-lru", {"cache": "belady"})`` swaps a component by its
registry name; ``{"cache.calibration": "x.parquet"}`` sets a parameter.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from moesim.errors import ConfigError, did_you_mean
from moesim.policy.assign import AllCPU, AllGPU, BestSplit, ResidentOnGPU
from moesim.policy.base import Component
from moesim.policy.cache import AllResident, BeladyCache, LRUCache, NoCache, StaticCache
from moesim.policy.checked import is_catalogue
# Deferral and Substitution are the registry's names as before composed.py held them
from moesim.policy.composed import ComposedSystem, Deferral, NoDeferral, NoSubstitution, Substitution  # noqa: F401
from moesim.policy.prefetch import NoPrefetch, PerfectPrefetch

COMPONENTS: dict[str, dict[str, type[Component]]] = {
    "cache": {c.name: c for c in (NoCache, LRUCache, StaticCache, AllResident, BeladyCache)},
    "assign": {c.name: c for c in (AllCPU, AllGPU, ResidentOnGPU, BestSplit)},
    "prefetch": {c.name: c for c in (NoPrefetch, PerfectPrefetch)},
}


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
    params = getattr(cls, "__dataclass_params__", None)
    if CATALOGUE_COMPONENTS and params is not None and params.frozen:
        # its --set failed as an internal error (FrozenInstanceError), and so did state kept in configure
        raise ConfigError(f"{what} is a frozen dataclass: its parameters cannot be set, nor its state kept",
                          field="name", fix="decorate it with @dataclass, not @dataclass(frozen=True)")
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
        _check_defaults(name, spec)
        module = sys._getframe(1).f_globals.get("__name__", "")
        _check_not_taken(name, spec, module)
        REGISTERED_BY[name] = module
    SYSTEMS[name] = spec


#: the module that registered each system of one's own, by name: another module may not take the name
REGISTERED_BY: dict[str, str] = {}


def _check_not_taken(name: str, spec: SystemSpec, module: str) -> None:
    """Refuse a name another module of one's own registered: the later module replaced the earlier one's
    system without a word (two --import modules that both register 'mine' ran the second's). The same module
    registering it again (a notebook cell run twice, a module imported again) replaces it."""
    taken = SYSTEMS.get(name)
    by = REGISTERED_BY.get(name)
    if taken is not None and by is not None and by != module:
        raise ConfigError(f"system '{name}' is already registered by module {by} ({taken.description!r}); "
                          f"module {module} cannot take its name", field="name",
                          fix=f"register one of them under another name, e.g. '{name}-2'")


#: settings of a SystemSpec's defaults that the run's set-up reads, not the system's components
_RUN_SETTINGS = ("engine", "memory", "hw", "runtime", "cache.slots", "cache.slots_per_layer")


def _check_defaults(name: str, spec: SystemSpec) -> None:
    """Refuse a system of one's own whose defaults are not (key, value) pairs, or set a component parameter the
    system does not take or to a value it does not take: a dict failed at the first run as an internal error
    (ValueError: too many values to unpack), and a slip was refused then as a ``--set`` the user never gave."""
    how = "defaults=(('cache.decay', '0.5'),): a tuple of (key, value) pairs, as --set KEY=VALUE would give them"
    pairs = spec.defaults
    if isinstance(pairs, (str, dict)) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                 for p in pairs):
        raise ConfigError(f"system '{name}': defaults {pairs!r} are not (key, value) pairs",
                          field="SystemSpec.defaults", fix=how)
    own = [(k, v) for k, v in pairs if k.partition(".")[0] not in _RUN_SETTINGS and k not in _RUN_SETTINGS]
    if not own:
        return
    SYSTEMS[name], before = spec, SYSTEMS.get(name)
    try:
        build_system(name)  # applies the defaults as a run does
    except ConfigError as err:
        raise ConfigError(f"system '{name}': its defaults {', '.join(f'{k}={v}' for k, v in own)}: {err.detail}",
                          field="SystemSpec.defaults", fix=err.fix) from None
    finally:
        if before is None:
            del SYSTEMS[name]
        else:
            SYSTEMS[name] = before


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


def own_registrations() -> list[tuple[str, object]]:
    """The components and systems of one's own registered in this process, in registration order by kind,
    for :func:`register_again` in another: a sweep's Ray workers start afresh, not forked from the notebook
    or script whose cells or imports registered them."""
    components = [("component", cls) for role, registry in COMPONENTS.items() for name, cls in registry.items()
                  if (role, name) not in CATALOGUE_COMPONENTS]
    systems = [("system", (name, spec, REGISTERED_BY.get(name, ""))) for name, spec in SYSTEMS.items()
               if name not in CATALOGUE_SYSTEMS]
    return components + systems


def register_again(entries: list[tuple[str, object]]) -> None:
    """Register in this process what :func:`own_registrations` listed in another (checked there already)."""
    for kind, what in entries:
        if kind == "component":
            COMPONENTS.setdefault(what.role, {})[what.name] = what  # type: ignore[attr-defined]
        else:
            name, spec, module = what  # type: ignore[misc]
            SYSTEMS[name] = spec
            REGISTERED_BY[name] = module


def system_names(all_systems: bool = False) -> list[str]:
    """Systems `--system all` runs (or every registered one)."""
    return [n for n, spec in SYSTEMS.items() if spec.listed or all_systems]


def own_weights(name: str, settings: Mapping[str, str] | None = None) -> str:
    """The weight settings a system's defaults impose (``memory.expert_dtype=int4`` for mixtral-offloading),
    or "" when it runs the replay's weights. A default the replay's ``settings`` set too is the replay's: with
    ``--set memory.expert_dtype=int4 --set memory.non_expert_dtype=int4`` every system runs those weights."""
    spec = SYSTEMS.get(name)
    given = settings or {}
    return ", ".join(f"{k}={v}" for k, v in spec.defaults if k.startswith("memory.") and k not in given) \
        if spec else ""


def portfolio_members(name: str, settings: Mapping[str, str] | None = None) -> tuple[str, ...]:
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
                and not SYSTEMS[n].ignores_memory and not own_weights(n, settings)
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


#: options of the commands that a --set key names by mistake, each with an example value
_OPTIONS = {"seed": "3", "hw": "rtx4090", "system": "smoe"}


def _refuse_unknown(name: str, key: str, chosen: dict[str, str], parts: dict[str, Component]) -> None:
    """The error for ``--set key`` that system ``name``'s components do not take: which other components of
    the role take it (prefetch.n with no prefetcher chosen), or else every parameter they do take."""
    if not key.strip():
        raise ConfigError("a setting with no parameter name", field="--set",
                          fix="write --set KEY=VALUE, e.g. --set cache.slots_per_layer=4")
    if key in _OPTIONS:  # not a setting: an option of the command (a keyword argument in Python)
        raise ConfigError(f"unknown parameter '{key}' for system '{name}': {key} is an option of its own",
                          field="--set", fix=f"give it as --{key} {_OPTIONS[key]}")
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
