"""Sweep specs: their parsing, their points, and the checks made before any point runs."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moesim.errors import ConfigError, MoesimError, did_you_mean, slip_of
from moesim.util import read_yaml

SPEC_KEYS = ("trace", "traces", "hw", "system", "systems", "seed", "seeds", "model", "set", "grid", "zip", "import",
             "per_system")
#: what a ``per_system`` entry may hold
PER_SYSTEM_KEYS = ("set", "grid")
DEFAULT_HW = "rtx4090"


# ----------------------------------------------------------------------------- points
@dataclass(frozen=True)
class Point:
    """One replay of a sweep; ``trace`` and ``hw`` as written in the spec."""

    trace: str
    hw: str
    system: str
    seed: int = 0
    model: str | None = None
    #: ``--set`` keys and values (typed as in the spec), sorted by key
    settings: tuple[tuple[str, Any], ...] = ()

    @functools.cached_property  # a sweep looks each point's id up several times; a million points, millions
    def point_id(self) -> str:
        key = {"trace": self.trace, "hw": self.hw, "system": self.system, "seed": self.seed,
               "model": self.model, "settings": self.settings_str()}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def settings_str(self) -> dict[str, str]:
        """Settings as the strings ``--set`` would pass."""
        return {k: setting_str(v) for k, v in self.settings}

    def columns(self) -> dict[str, Any]:
        out: dict[str, Any] = {"point_id": self.point_id, "trace": self.trace, "hw": self.hw,
                               "system": self.system, "seed": self.seed}
        if self.model is not None:
            out["model"] = self.model
        out.update(self.settings)
        return out


def setting_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def normalize_key(key: str) -> str:
    """``cache__slots_per_layer`` -> ``cache.slots_per_layer`` (Python-friendly spelling)."""
    return str(key).replace("__", ".")


def full_key_guess(err: MoesimError, serving: bool) -> None:
    """Start the fix of an error about an unknown parameter with the full keys it is short for or a slip of
    (``qps``: ``workload.qps``; ``timeline``: ``engine.timeline``), where it guesses none: a system checks a key
    against its components' parameters only, and those by the whole key. ``serving``: the workload and
    scheduler keys are choices too (a serving run, or a sweep, which serves when given them)."""
    named = re.search(r"unknown parameter '([^']+)'(?: for system '([^']+)')?", err.detail)
    if named is None or "did you mean" in (err.fix or ""):
        return
    key, system = named.groups()
    choices = setting_keys(system, serving)
    guess = did_you_mean(key, choices)
    if not guess and "." not in key:  # the part after the dot, or a slip of it
        ends = {choice.rpartition(".")[2]: choice for choice in choices}
        near = slip_of(key, list(ends)).removeprefix("did you mean ").removesuffix("? ")
        full = [ends[end] for end in near.split(" or ") if end in ends]
        guess = f"did you mean {' or '.join(full)}? " if full else ""
    if guess:
        err.add_guess(guess)


def setting_keys(system: str | None, serving: bool) -> list[str]:
    """The ``--set`` keys a run of ``system`` reads (of the engine, the memory model, its components, and a
    serving run's workload and scheduler)."""
    import dataclasses

    from moesim.policy.systems import COMPONENTS, SYSTEMS
    from moesim.sim.run import ReplaySettings
    replay = ReplaySettings()
    keys = [f"{section}.{f.name}" for section in ("engine", "memory")
            for f in dataclasses.fields(getattr(replay, section))]
    keys += ["cache.slots", "cache.slots_per_layer", "runtime"]
    spec = SYSTEMS.get(system or "")
    for role, name in (spec.roles().items() if spec is not None else ()):
        component = COMPONENTS.get(role, {}).get(name)
        keys += [f"{role}.{p}" for p in (component.parameters() if component is not None else ())]
    if serving:
        from moesim.sim.workload import WorkloadConfig
        keys += [f"workload.{f.name}" for f in dataclasses.fields(WorkloadConfig)] + ["scheduler"]
    return keys


# ----------------------------------------------------------------------------- spec
@dataclass
class SystemAxes:
    """Parameters of one system's points only (a ``per_system`` entry): a policy of one's own takes keys the
    catalogue's systems refuse, so they cannot go in the spec's shared ``set`` or ``grid``."""

    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class SweepSpec:
    """A parsed sweep spec: the axes, and the folder relative paths resolve against."""

    traces: list[str]
    hw: list[str]
    systems: list[str]
    seeds: list[int] = field(default_factory=lambda: [0])
    model: str | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    zips: list[dict[str, list[Any]]] = field(default_factory=list)
    base_dir: Path = field(default_factory=Path.cwd)
    source: str = "sweep spec"
    #: systems the spec names itself (not through ``all``): one that cannot run a point's kind is a spec error
    named: tuple[str, ...] = ()
    #: parameters only some systems take: system -> its own fixed settings and grid, added to the spec's
    per_system: dict[str, SystemAxes] = field(default_factory=dict)

    def points(self) -> list[Point]:
        """Every point, in spec order (traces outermost), duplicates dropped: a trace or profile file written
        two ways (``t.parquet`` and ``./t.parquet``, its absolute path, a symlink to it) is one file, named as
        first written (:func:`_one_spelling`)."""
        axes = [[{k: v} for v in values] for k, values in self.grid.items()]
        axes += [[dict(zip(group, row)) for row in zip(*group.values())] for group in self.zips]
        seen: dict[str, Point] = {}
        traces = _one_spelling(self.traces, lambda trace: os.path.realpath(self.resolve(trace)))
        hws = _one_spelling(self.hw, lambda hw: _profile_file(self.resolve_hw(hw)))
        for trace, hw, system, seed in itertools.product(traces, hws, self.systems, self.seeds):
            own = self.per_system.get(system, SystemAxes())
            own_axes = [[{k: v} for v in values] for k, values in own.grid.items()]
            for combo in itertools.product(*axes, *own_axes):
                settings = {**self.fixed, **own.fixed}
                for part in combo:
                    settings.update(part)
                point = Point(trace, hw, system, seed, self.model, tuple(sorted(settings.items())))
                seen.setdefault(point.point_id, point)
        return list(seen.values())

    def parameter_keys(self) -> list[str]:
        """``--set`` keys in spec order: fixed, grid, then zipped."""
        keys = list(self.fixed) + list(self.grid)
        for group in self.zips:
            keys += list(group)
        for own in self.per_system.values():
            keys += [k for k in [*own.fixed, *own.grid] if k not in keys]
        return keys

    def resolve(self, path: str) -> str:
        """A trace or profile path relative to the spec's folder (profile names stay names)."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return str(p)
        return str(self.base_dir / p)

    def resolve_hw(self, hw: str) -> str:
        if hw.endswith((".yaml", ".yml")) or "/" in hw:
            return self.resolve(hw)
        return hw


def load_spec(spec: str | os.PathLike | dict[str, Any]) -> SweepSpec:
    """Parse a spec file or dict; every mistake is one :class:`ConfigError` line naming the key."""
    if isinstance(spec, dict):
        return parse_spec(spec, source="sweep spec", base_dir=Path.cwd())
    path = Path(spec)
    if not path.exists() or path.is_dir():
        raise ConfigError("sweep spec not found", source=str(path), fix="check the path")
    if _parquet_file(path):  # `moesim sweep TRACE.parquet` was told the file is "not UTF-8 text"
        raise ConfigError("a Parquet file (a trace or sweep results), not a sweep spec", source=str(path),
                          fix="give a YAML spec (see `moesim sweep --help`) that lists it under traces:")
    data = read_yaml(path, ConfigError)
    # a spec from a pipe (`moesim sweep <(...)`) has no folder of its own: its paths are the current folder's
    base_dir = path.resolve().parent if path.is_file() else Path.cwd()
    return parse_spec(data, source=str(path), base_dir=base_dir)


def _parquet_file(path: Path) -> bool:
    """A regular file that starts with Parquet's magic bytes (a pipe is not peeked at: it reads once)."""
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"PAR1"
    except OSError:  # read_yaml says why
        return False


def parse_spec(data: Any, *, source: str, base_dir: Path) -> SweepSpec:
    if not isinstance(data, dict):
        raise ConfigError("a sweep spec is a mapping", source=source,
                          fix="write keys such as traces:, systems:, hw:, grid: (see `moesim sweep --help`)")
    unknown = [k for k in data if k not in SPEC_KEYS]
    if unknown:
        raise ConfigError(f"unknown key '{unknown[0]}'", source=source, field=str(unknown[0]),
                          fix=f"{did_you_mean(str(unknown[0]), SPEC_KEYS)}valid keys: {', '.join(SPEC_KEYS)}; "
                              "put --set parameters under grid:, zip: or set:")

    def named(singular: str, plural: str, default: list[Any] | None, what: str) -> list[str]:
        """An axis of names or paths: a mapping or a nested list is a slip, not one odd name."""
        raw = data.get(plural, data.get(singular))
        if isinstance(raw, dict):
            raise ConfigError(f"a mapping is not a list of {what}s", source=source, field=plural,
                              fix=f"write {plural}: [...], one {what} per item")
        values = axis(singular, plural, default)
        for i, value in enumerate(values):
            if isinstance(value, (dict, list)) or value is None:
                article = "an" if what[0] in "aeiou" else "a"
                raise ConfigError(f"{value!r} is not {article} {what}", source=source, field=plural, row=i,
                                  fix=f"write {plural}: [...], one {what} per item")
            if isinstance(value, str) and not value.strip():  # else read as the spec's folder ('is a folder')
                raise ConfigError(f"the {what} is empty", source=source, field=plural, row=i,
                                  fix=f"give the {what}, or drop the item")
        return [str(value) for value in values]

    def axis(singular: str, plural: str, default: list[Any] | None) -> list[Any]:
        if singular != plural and singular in data and plural in data:
            raise ConfigError(f"both '{singular}' and '{plural}' given", source=source, field=plural,
                              fix="keep one of them")
        value = data.get(plural, data.get(singular, default))
        if value is None:
            raise ConfigError(f"'{plural}' is missing", source=source, field=plural,
                              fix=f"add e.g. {plural}: [...]")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ConfigError(f"'{plural}' is empty", source=source, field=plural, fix="list at least one value")
        return values

    imports = data.get("import")
    if imports is not None:  # policies of one's own register before the systems are looked up
        from moesim.policy.imports import import_policies
        imports = imports if isinstance(imports, list) else [imports]
        for i, name in enumerate(imports):
            if not isinstance(name, str):
                raise ConfigError(f"{name!r} is not a module", source=source, field="import", row=i,
                                  fix="list Python files (relative to the spec) or module names, e.g. "
                                      "import: [my_policies.py]")
        import_policies(imports, base_dir=base_dir, field="import", source=source)
    traces = named("trace", "traces", None, "path")
    hws = named("hw", "hw", [DEFAULT_HW], "profile name or path")
    systems = named("system", "systems", None, "name")
    seeds = axis("seed", "seeds", [0])
    for i, seed in enumerate(seeds):
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ConfigError(f"seed {seed!r} is not an integer in [0, 2**63)", source=source, field="seeds",
                              row=i, fix="use whole numbers from 0 to 9223372036854775807")
    model = data.get("model")
    fixed = _settings_map(data.get("set") or {}, "set", source)
    grid = {k: _distinct(_values(v, f"grid.{k}", source)) for k, v in _settings_map(data.get("grid") or {}, "grid",
                                                                                    source).items()}
    zips_raw = data.get("zip") or []
    zips_raw = [zips_raw] if isinstance(zips_raw, dict) else zips_raw
    if not isinstance(zips_raw, list):
        raise ConfigError("'zip' must be a mapping or a list of mappings", source=source, field="zip",
                          fix="write zip: {key: [..], other: [..]} with equal-length lists")
    zips = []
    for i, group in enumerate(zips_raw):
        group = {k: _values(v, f"zip.{k}", source) for k, v in _settings_map(group, f"zip[{i}]", source).items()}
        lengths = {k: len(v) for k, v in group.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"zipped lists differ in length ({lengths})", source=source, field=f"zip[{i}]",
                              fix="give every key of a zip group the same number of values")
        if group:
            zips.append(group)
    expanded = _expand_systems(systems, source)
    spec = SweepSpec(traces=traces, hw=hws, systems=expanded, seeds=seeds,
                     model=str(model) if model is not None else None, fixed=fixed, grid=grid, zips=zips,
                     base_dir=base_dir, source=source, named=tuple(s for s in systems if s != "all"),
                     per_system=_per_system(data.get("per_system"), expanded, source))
    _check_disjoint(spec)
    return spec


def _per_system(value: Any, systems: list[str], source: str) -> dict[str, SystemAxes]:
    """The ``per_system`` section: for each system it names (one of the spec's), its own ``set`` and ``grid``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("'per_system' must map system names to their own set: and grid:", source=source,
                          field="per_system", fix="write e.g. per_system: {smoe: {grid: {prefetch.n: [1, 2]}}}")
    out = {}
    for name, entry in value.items():
        where = f"per_system.{name}"
        if name not in systems:
            raise ConfigError(f"'{name}' is not one of the spec's systems", source=source, field=where,
                              fix=f"{did_you_mean(str(name), systems)}name a system listed under systems:")
        if not isinstance(entry, dict) or not entry:
            raise ConfigError(f"{entry!r} is not a mapping of set: and grid:", source=source, field=where,
                              fix="write e.g. {grid: {prefetch.n: [1, 2]}, set: {cache.alpha: 0.9}}")
        unknown = [k for k in entry if k not in PER_SYSTEM_KEYS]
        if unknown:
            raise ConfigError(f"unknown key '{unknown[0]}'", source=source, field=f"{where}.{unknown[0]}",
                              fix=f"{did_you_mean(str(unknown[0]), PER_SYSTEM_KEYS)}a system's entry holds "
                                  "set: and grid:")
        fixed = _settings_map(entry.get("set") or {}, f"{where}.set", source)
        grid = {k: _distinct(_values(v, f"{where}.grid.{k}", source))
                for k, v in _settings_map(entry.get("grid") or {}, f"{where}.grid", source).items()}
        out[name] = SystemAxes(fixed, grid)
    return out


def _settings_map(value: Any, where: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"'{where}' must be a mapping of --set keys", source=source, field=where,
                          fix="write e.g. cache.slots_per_layer: [1, 2, 4]")
    out: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for key, entry in value.items():
        name = normalize_key(key)
        if name in out:  # `prefetch__n` and `prefetch.n` are one parameter: the later one silently won
            raise ConfigError(f"'{name}' is given twice in {where} (as '{spelled[name]}' and '{key}')",
                              source=source, field=f"{where}.{name}", fix="keep one of them")
        out[name], spelled[name] = entry, key
    return out


def _values(value: Any, where: str, source: str) -> list[Any]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError("empty list of values", source=source, field=where, fix="list at least one value")
    for i, v in enumerate(values):
        if isinstance(v, (dict, list)) or v is None:
            raise ConfigError(f"value {v!r} is not a number or string", source=source, field=where, row=i,
                              fix="list plain values, e.g. [1, 2, 4]")
    return values


def _distinct(values: list[Any]) -> list[Any]:
    """A grid's values, each once: 1 and 1.0 (or "1.0") are one point, not two rows of the same replay under two
    point ids. The first spelling stays, so the ids of points already run do not change."""
    def key(value: Any) -> Any:
        if isinstance(value, bool):
            return setting_str(value)
        try:
            return float(value)
        except (TypeError, ValueError):  # a name (cache=lru)
            return setting_str(value)

    seen: dict[Any, Any] = {}
    for value in values:
        seen.setdefault(key(value), value)
    return list(seen.values())


def _one_spelling(values: list[str], file_of: Callable[[str], str]) -> list[str]:
    """``values`` (traces or profiles as the spec writes them), each file once (``file_of``: its real path):
    the first spelling stays, as in a grid (:func:`_distinct`), so points already run keep their ids. A point's
    id holds that spelling, not the real path, so ids do not depend on where the spec and its files lie: a
    folder moved with its results, or data reached through a symlinked folder, keeps them."""
    seen: dict[str, str] = {}
    for value in values:
        seen.setdefault(file_of(value), value)
    return list(seen.values())


def _profile_file(hw: str) -> str:
    """The real path of the file behind a profile name or path (``rtx4090`` is the bundled
    ``hwprofiles/rtx4090.yaml``), as :func:`moesim.sweep.point.cached_profile` reads it."""
    from moesim.hw.profile import profile_path
    return os.path.realpath(profile_path(hw))


def _expand_systems(systems: list[str], source: str) -> list[str]:
    from moesim.policy.systems import check_system_name, system_names
    out: list[str] = []
    for name in systems:
        if name == "all":
            out += system_names()
        elif "," in name:  # the command line's --system a,b: was 'unknown system', "did you mean" one of them
            parts = [part.strip() for part in name.split(",")]
            raise ConfigError(f"'{name}' names several systems in one item", source=source, field="systems",
                              fix=f"list them, one system per item: systems: [{', '.join(parts)}] "
                                  f"(in Python, 'systems': {parts!r})")
        else:
            check_system_name(name, field="systems", source=source, or_all=True)
            out.append(name)
    return list(dict.fromkeys(out))


def _check_disjoint(spec: SweepSpec) -> None:
    shared = [("set", spec.fixed), ("grid", spec.grid)] + [(f"zip[{i}]", g) for i, g in enumerate(spec.zips)]
    # each system's points read the shared sections and its own: a key in two of them would be set twice
    for name, own in [("", SystemAxes()), *spec.per_system.items()]:
        seen: dict[str, str] = {}
        sections = shared + [(f"per_system.{name}.set", own.fixed), (f"per_system.{name}.grid", own.grid)]
        for section, keys in sections:
            for key in keys:
                if key in seen:
                    raise ConfigError(f"'{key}' appears in both {seen[key]} and {section}", source=spec.source,
                                      field=key, fix="vary each parameter in one place only")
                seen[key] = section


def check_spec(spec: SweepSpec, points: list[Point]) -> None:
    """Fail now, with one line, on anything that would make every point of a kind fail.

    Missing or malformed traces, unknown profiles, unknown ``--set`` keys or
    values of the wrong type, and values a trace's model refuses (a per-layer
    list of the wrong length: each system's ``for_model`` with that model). A cache that does not fit on one GPU is not a
    spec error: it fails its points only, which are recorded with the reason.
    """
    from moesim.hw.profile import load_profile
    from moesim.model.presets import load_preset
    from moesim.sim.run import check_runtime, members, parse_settings
    from moesim.policy.systems import build_system
    from moesim.trace.validate import checked_meta

    models = {}
    for i, trace in enumerate(spec.traces):
        path = spec.resolve(trace)
        if Path(path).is_dir():  # it was 'not found'
            raise ConfigError(f"trace '{trace}' is a folder, not a trace file ({path})", source=spec.source,
                              field="traces", row=i, fix="give the path of a .parquet file")
        if not Path(path).is_file():
            raise ConfigError(f"trace '{trace}' not found (looked at {path})", source=spec.source, field="traces",
                              row=i, fix="give a path relative to the spec file's folder, or an absolute one")
        # the whole validation pass, once, before any point runs; a fault names the trace, then where it is listed
        models[trace] = _reraise(lambda path=path: checked_meta(path), spec, "traces").model
    if spec.model:
        _reraise(lambda: load_preset(spec.model), spec, "model")
    profiles = {hw: _reraise(lambda hw=hw: load_profile(spec.resolve_hw(hw)), spec, "hw") for hw in spec.hw}
    from moesim.sim.workload import is_serving_key, split_settings
    # each value of each parameter is checked in the first point that has it with that trace, profile and system,
    # not in every combination: a grid of six 10-value axes is 60 checks, not a million (a value refused only
    # beside some others fails those points, recorded with the reason, as a cache too large for the GPU does)
    seen: set[tuple] = set()
    for point in points:
        settings = point.settings_str()
        where = (point.trace, point.hw, point.system)
        facets = {where, *((*where, k, v) for k, v in settings.items())}
        if facets <= seen:
            continue
        seen |= facets
        if any(is_serving_key(k) for k in settings):
            from moesim.sim.serving import check_servable  # a serving point
            settings = _reraise(lambda: split_settings(settings).replay, spec, None)  # the rest: replay settings
            if point.system in spec.named:  # through `all`, a system that cannot serve is left out of the sweep
                _reraise(lambda: check_servable(point.system, settings), spec, "systems")
        system = point.system
        parsed = _reraise(lambda: parse_settings(settings), spec, None, system)
        profile = _reraise(lambda: profiles[point.hw].with_overrides(parsed.hw), spec, None, system)
        _reraise(lambda: check_runtime(profile, parsed.runtime), spec, None, system)
        quotas = parsed.cache.slots_per_layer or []
        for model in {models[t] for t in spec.traces}:
            if any(q > model.num_experts for q in quotas):  # more slots than experts: wrong on any GPU
                raise ConfigError(f"cache.slots_per_layer={max(quotas)} outside [0, {model.num_experts}] "
                                  f"({model.name} has {model.num_experts} experts per layer)", source=spec.source,
                                  field="cache.slots_per_layer", fix=f"use 0..{model.num_experts}")
        for member in members(point.system):
            built = _reraise(lambda m=member: build_system(m, dict(parsed.system)), spec, None, system)
            # what the trace's model decides (a per-layer list's length): known now, before any point runs
            _reraise(lambda: built.for_model(models[point.trace]), spec, None, system)


def _reraise(call: Callable[[], Any], spec: SweepSpec, field_: str | None, system: str | None = None) -> Any:
    """``call()``, its error as one line naming where the spec gives what is wrong (``system``: the point's,
    whose ``per_system`` entry may be where)."""
    try:
        return call()
    except MoesimError as err:
        full_key_guess(err, serving=True)  # a spec that sets workload.* serves
        if err.source and err.source != spec.source and field_ and (err.field or Path(err.source).is_file()):
            # a fault inside a file the spec lists (a profile's field, a trace cut short; not a file not
            # found, the spec's own fault): that file and its field, as `moesim replay` names them, then
            # where the spec lists it
            raise ConfigError(f"{err.detail} (listed in {spec.source} under '{field_}')", source=err.source,
                              field=err.field, row=err.row, fix=err.fix) from None
        where = f" ({err.source})" if err.source and err.source != spec.source else ""
        fix = err.fix
        if field_ is None and err.field == "--set":  # a parameter: name it where the spec gives it
            field_, seed = _setting_field(spec, err.detail, system)
            if seed:
                fix = "seeds are not a --set parameter: list them at the top level, e.g. seeds: [0, 1]"
            elif field_ and not field_.startswith("per_system.") and len(spec.systems) > 1:
                section = "set" if field_.startswith("set.") else "grid"  # a zipped key goes to a grid there
                fix = (f"{fix}; or give it only to the systems that take it, under "
                       f"per_system.NAME.{section}, not to {system}")
        elif field_ is None and err.field:  # a profile field an hw.* override names, or a parameter's value:
            field_ = _spec_field(spec, f"hw.{err.field}", system) or _spec_field(spec, err.field, system)
        raise ConfigError(f"{err.detail}{where}", source=spec.source, field=field_ or err.field,
                          row=err.row, fix=fix) from None


def _setting_field(spec: SweepSpec, detail: str, system: str | None = None) -> tuple[str | None, bool]:
    """The spec's own name for the ``--set`` parameter an error names (``grid.cache.alpha``), and whether
    it is a seed given as a parameter."""
    named = re.search(r"parameter '([^']+)'", detail)
    if named is None:
        return None, False
    key = named.group(1)
    field_ = _spec_field(spec, key, system)
    return field_, field_ is not None and key in ("seed", "seeds")


def _spec_field(spec: SweepSpec, key: str, system: str | None = None) -> str | None:
    """``key`` as the spec gives it: ``set.KEY``, ``grid.KEY``, ``zip[i].KEY`` or, for ``system``'s points,
    ``per_system.SYSTEM.set.KEY`` or ``.grid.KEY`` (None: not there)."""
    sections = [("set", spec.fixed), ("grid", spec.grid)] + [(f"zip[{i}]", g) for i, g in enumerate(spec.zips)]
    own = spec.per_system.get(system or "")
    if own is not None:
        sections += [(f"per_system.{system}.set", own.fixed), (f"per_system.{system}.grid", own.grid)]
    for section, keys in sections:
        if key in keys:
            return f"{section}.{key}"
    return None
