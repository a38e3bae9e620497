"""The values a sweep's points ran with for the parameters they leave at their defaults, written into their rows.

A parameter column of a sweep's results (a ``--set`` key some point sets: ``prefetch.n``, ``cache.slots``,
``hw.pcie.bandwidth_scale``, a component swap such as ``cache``) was empty in the rows of the points that did not
set it, whatever value they ran with: nothing in a row said which ``n`` produced it, and ``moesim plot`` put
those rows apart from (or averaged them with) the rows that set the same value. Each such cell now holds the
value the point ran with, where the parameter applies to its system; the row's ``defaults_filled`` names the
cells so filled ("; " between keys, "" when none), so a reader tells a value the spec set from one it left.

What a filled cell holds:

* a component's parameter (``prefetch.n``) or swap (``cache``): the point's system built with the point's own
  settings (and the system's own defaults), its component's field (its name for a swap); empty where that
  component has no such parameter. A default the run resolves when it starts ("-1: the paper's value for the
  model", DALI's ``cache.prefetch_slots`` "-1: twice what the prefetcher issues per layer") is recorded as what
  it resolved to for the point: the system is set up as the point's run sets it up (its trace, profile and
  model; not run) and the component read where it tells the value (the field itself, resolved in place, or the
  attribute :data:`_RESOLVED_AS` names). Where it does not tell one (a per-layer ``substitute.tau``, a per-plan
  ``solve_us``, llama.cpp's ``cache.n_cpu_moe``, which the memory plan decides) the cell holds the default as
  written (``-1``). A point that spells such a ``-1`` (or another negative "choose for me") itself is recorded
  the same way, as what it resolved to, and the cell is named in ``defaults_filled``: its rows and those of the
  points that leave the default agree, as the run did. A portfolio bound
  (``oracle``): the value its own schedules share, empty where they differ or one lacks the parameter;
* ``engine.*`` and ``memory.*``: the value parsed for the point (the system's own defaults included);
  ``memory.expert_dtype`` left empty by default is the dtype the point's model gives, which the run uses;
* ``hw.*``: the system's own override if it has one, else the profile's value (its default when the file omits
  an optional field); empty for a field that is not a single value;
* ``cache.slots``: the experts the point's memory plan held (``expert_slots``), for a point that ran and whose
  system has a cache; ``cache.slots_per_layer`` is not filled (a plan's spread has no single value: see
  ``slot_spread`` and ``slots_per_layer``);
* ``workload.*``, ``scheduler`` and ``scheduler.*``: in a serving point's row only (a replayed point has no
  workload), and a ``workload.*`` setting only where the point's arrival process reads it.

A point's id and its store identity do not change: the id stays a hash of the settings as the spec writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from moesim.sweep.spec import Point, setting_str
from moesim.util import is_missing

#: the column naming, per row, the parameter cells filled with the value the point ran with
FILLED = "defaults_filled"
#: no value to fill: the parameter does not apply to the point's system (or is not known for it)
_NONE = object()
#: parameters whose value a point's row tells (its memory plan), not its settings
_ROW_KEYS = ("cache.slots", "cache.slots_per_layer")
#: the undotted ``--set`` keys whose columns are parameters (``runtime``'s column is the metric naming the
#: runtime each point ran on, filled by the run itself)
_UNDOTTED = ("cache", "assign", "prefetch", "substitute", "defer", "scheduler")


def is_parameter(column: str) -> bool:
    """Whether a results column is a ``--set`` parameter: a dotted key, a component swap or ``scheduler``."""
    return "." in column or column in _UNDOTTED


def fill_keys(spec_keys: Iterable[str], rows: Iterable[dict[str, Any]]) -> list[str]:
    """The parameter columns to fill: the spec's ``--set`` keys, then those of rows already stored (another
    spec's, in the same file)."""
    keys = dict.fromkeys(k for k in spec_keys if is_parameter(k))
    for row in rows:
        keys.update(dict.fromkeys(k for k in row if is_parameter(k)))
    return list(keys)


def to_fill(keys: Iterable[str], settings: dict[str, str], row: dict[str, Any]) -> list[str]:
    """The keys of ``row`` to fill: those its point neither set nor holds, and those it set to a negative number
    its cell still holds as written (a "-1: choose for me" spelled out resolves as the default -1 does)."""
    return [k for k in keys if (k not in settings and is_missing(row.get(k)))
            or (_negative(settings.get(k)) and _same_number(row.get(k), settings[k]))]


def _negative(text: str | None) -> bool:
    try:
        return text is not None and float(text) < 0
    except ValueError:
        return False


def _same_number(value: Any, text: str) -> bool:
    """Whether a cell holds the number ``text`` writes (a cell never filled holds the setting itself)."""
    try:
        return not isinstance(value, bool) and float(value) == float(text)
    except (TypeError, ValueError):
        return False


def _as_written(key: str, settings: dict[str, str], value: Any) -> bool:
    """Whether ``value`` told for a key the point set is the setting itself: nothing resolved, nothing to fill."""
    return key in settings and _same_number(value, settings[key])


def row_settings(row: dict[str, Any]) -> dict[str, str]:
    """The settings a stored row's point set, as ``--set`` strings: its parameter cells that hold a value and were
    not filled (a whole number read back as a float, ``2.0``, as ``2``)."""
    filled = set(filter(None, str(row.get(FILLED) or "").split("; ")))
    out = {}
    for key, value in row.items():
        if is_parameter(key) and key not in filled and not is_missing(value):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            out[key] = setting_str(value)
    return out


class Defaults:
    """Resolves the values points ran with, keeping what it built for one sweep (systems and code may change
    between sweeps of a session)."""

    def __init__(self) -> None:
        self._built: dict[tuple, Any] = {}
        self._models: dict[tuple, Any] = {}
        #: values by what they depend on (all but the cache's size, which is the row's own): the points of a grid
        #: over cache.slots share them
        self._values: dict[tuple, dict[str, Any]] = {}
        #: systems set up as a run sets them up, to read what their defaults resolved to (None: the set-up failed)
        self._set_ups: dict[tuple, tuple[Any, int] | None] = {}
        self._kv_tokens: dict[str | None, int] = {}

    def fill(self, row: dict[str, Any], settings: dict[str, str], keys: Iterable[str], *, trace_path: str | None,
             hw_path: str | None) -> list[str]:
        """Write into ``row`` (a point of ``row['system']`` that set ``settings``) the value it ran with for each of
        ``keys`` it neither set nor holds, and add them to its ``defaults_filled``. Returns the keys filled.
        Never raises: a value that cannot be told is left empty."""
        todo = to_fill(keys, settings, row)
        filled = []
        if todo:
            values = self.values(str(row.get("system")), settings, todo, row=row, trace_path=trace_path,
                                 hw_path=hw_path, model=row.get("model"))
            for key in todo:
                if key in values and not _as_written(key, settings, values[key]):
                    row[key] = values[key]
                    filled.append(key)
        before = [k for k in str(row.get(FILLED) or "").split("; ") if k]
        row[FILLED] = "; ".join([*before, *filled])
        return filled

    def values(self, system: str, settings: dict[str, str], keys: list[str], *, row: dict[str, Any],
               trace_path: str | None, hw_path: str | None, model: Any = None) -> dict[str, Any]:
        """For each of ``keys`` that applies to ``system`` run with ``settings``: the value it ran with."""
        model = None if is_missing(model) else str(model)
        shared = tuple(k for k in keys if k not in _ROW_KEYS)
        others = {k: v for k, v in settings.items() if k not in _ROW_KEYS}
        memo = (system, tuple(sorted(others.items())), shared, trace_path, hw_path, model)
        if memo not in self._values:
            self._values[memo] = self._told(system, others, shared, {}, trace_path, hw_path, model)
        own = self._told(system, settings, [k for k in keys if k in _ROW_KEYS], row, trace_path, hw_path, model)
        return {k: v for values in (self._values[memo], own) for k, v in values.items()}

    def _told(self, system: str, settings: dict[str, str], keys: Iterable[str], row: dict[str, Any],
              trace_path: str | None, hw_path: str | None, model: str | None) -> dict[str, Any]:
        out = {}
        for key in keys:
            try:
                value = self._value(system, settings, key, row, trace_path, hw_path, model)
            except Exception:  # noqa: BLE001, S112 - a value not told is left empty; it must not stop the sweep
                continue
            if value is not _NONE and not is_missing(value):
                out[key] = _plain(value)
        return out

    # -- one key
    def _value(self, system: str, settings: dict[str, str], key: str, row: dict[str, Any], trace_path: str | None,
               hw_path: str | None, model: str | None) -> Any:
        from moesim.policy.systems import SYSTEMS
        from moesim.sim.workload import is_serving_key, split_settings
        serving = any(is_serving_key(k) for k in settings)
        if is_serving_key(key):
            return _serving_value(split_settings(settings), key) if serving else _NONE
        replay = split_settings(settings).replay if serving else settings
        spec = SYSTEMS.get(system)
        if spec is None:
            return _NONE
        if key == "cache.slots":
            held = row.get("expert_slots", row.get("engine_expert_slots"))
            if is_missing(held) or row.get("status") != "ok" or not spec.uses_cache:
                return _NONE
            return int(held)
        if key == "cache.slots_per_layer":
            return _NONE
        members = spec.portfolio or (system,)
        found = [self._single(member, replay, key, trace_path, hw_path, model) for member in members]
        first = found[0]
        if first is _NONE or any(v is _NONE or v != first for v in found[1:]):
            return _NONE
        return first

    def _single(self, system: str, settings: dict[str, str], key: str, trace_path: str | None,
                hw_path: str | None, model: str | None) -> Any:
        from moesim.policy.systems import ROLES
        from moesim.sim.run import parse_settings, with_system_defaults
        parsed = parse_settings(with_system_defaults(system, settings))
        section, _, rest = key.partition(".")
        if section == "engine" and rest:
            return _field(parsed.engine, rest)
        if section == "memory" and rest:
            value = _field(parsed.memory, rest)
            if rest == "expert_dtype" and value == "":  # the model's dtype, as the run's cost model takes it
                return self._model(trace_path, model).expert_dtype
            return value
        if section == "hw" and rest:
            if rest in parsed.hw:  # the system's own override (a point's own is a setting, not filled)
                return parsed.hw[rest]
            return _profile_value(self._profile(hw_path), rest)
        if section not in ROLES:
            return _NONE
        built = self._system(system, parsed.system)
        part = built.components.get(section)
        if part is None:
            return _NONE
        if not rest:  # a component swap: the component the point ran
            return part.name
        if rest not in part.parameters():
            return _NONE
        value = getattr(part, rest)
        if not _left_to_run(part, rest, value):
            return value
        return self._resolved(system, settings, section, rest, trace_path, hw_path, model, written=value)

    def _resolved(self, system: str, settings: dict[str, str], section: str, name: str, trace_path: str | None,
                  hw_path: str | None, model: str | None, *, written: Any) -> Any:
        """What ``section.name``, left at a default the run resolves ("-1: the paper's value for the model"),
        resolved to: read off the system set up as the point's run sets it up; ``written`` where the component
        does not tell (a per-layer or per-plan value, a count its memory plan decides) or the set-up fails."""
        set_up = self._set_up(system, settings, trace_path, hw_path, model)
        if set_up is None:  # not told: the cell keeps the value as written
            return written
        built, layers = set_up
        told = _resolved_value(built, layers, built.components[section], name)
        return written if told is _NONE else told

    def _set_up(self, system: str, settings: dict[str, str], trace_path: str | None, hw_path: str | None,
                model: str | None) -> tuple[Any, int] | None:
        """``system`` with ``settings`` as a run on the point's trace, profile and model configures it before its
        first step (moesim.sim.run.prepare, then the system's configure), never run; and the model's layers. None
        where that fails, tried once per set-up (every key a point resolves and every point alike reads it)."""
        from moesim.sim.memory import peak_kv_tokens
        from moesim.sim.run import prepare
        key = (system, tuple(sorted(settings.items())), trace_path, hw_path, model)
        if key not in self._set_ups:
            self._set_ups[key] = None
            try:
                if trace_path not in self._kv_tokens:  # the whole trace is read for it: once per trace
                    self._kv_tokens[trace_path] = peak_kv_tokens(str(trace_path))
                sim = prepare(str(trace_path), self._profile(hw_path), system, settings, model_preset=model,
                              kv_tokens=self._kv_tokens[trace_path], timeline=False, decisions=False)
                sim.system.configure(sim.ctx)
                self._set_ups[key] = (sim.system, sim.ctx.model.num_layers)
            except Exception:  # noqa: BLE001 - not told: the cells keep their values as written
                pass
        return self._set_ups[key]

    def _system(self, system: str, settings: dict[str, str]) -> Any:
        from moesim.policy.systems import build_system
        key = (system, tuple(sorted(settings.items())))
        if key not in self._built:
            self._built[key] = build_system(system, settings)
        return self._built[key]

    def _model(self, trace_path: str | None, preset: str | None) -> Any:
        key = (trace_path, preset)
        if key not in self._models:
            if preset:
                from moesim.model.presets import load_preset
                self._models[key] = load_preset(preset)
            else:
                from moesim.trace.io import read_meta
                self._models[key] = read_meta(str(trace_path)).model
        return self._models[key]

    @staticmethod
    def _profile(hw_path: str | None) -> Any:
        from moesim.sweep.point import cached_profile
        return cached_profile(str(hw_path))


def _left_to_run(part: Any, name: str, value: Any) -> bool:
    """Whether ``value`` of ``part``'s parameter ``name`` is a "choose for me" the run resolves: a negative
    number that is the parameter's default (-1: the paper's value for the model, twice what DALI's prefetcher
    issues per layer), or any negative of a parameter documented "negative: ..." (``any_negative``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value < 0:
        return False
    return value == part.parameters()[name] or name in getattr(part, "any_negative", ())


def _dali_buffer(built: Any, layers: int) -> Any:
    """DALI's prefetch buffer: ``cache.prefetch_slots``, or at -1 twice what its prefetcher issues per layer, as
    its memory plan reserves it (only a DALI system has the buffer; its cache swapped into another system ignores
    the field)."""
    from moesim.policy.catalog.dali import DaliSystem
    return built.reserved_slots(layers) if isinstance(built, DaliSystem) else _NONE


#: (component name, parameter) -> the public attribute where the component keeps what a default left to the run
#: resolved to, once configured (a component that resolves the field in place, as DALI's sizes do, needs none)
_RESOLVED_AS: dict[tuple[str, str], str] = {
    ("smoe-token", "n"): "count",
    ("next-layer", "size"): "count",
    ("ktrans-deferral", "deferred"): "count",
    ("importance-router", "alpha"): "threshold",
}


def _resolved_value(built: Any, layers: int, part: Any, name: str) -> Any:
    """What ``part``'s parameter ``name`` in the set-up system ``built`` (of a ``layers``-layer model) resolved
    to, or ``_NONE`` where the component does not tell."""
    names = [getattr(cls, "name", "") for cls in type(part).__mro__]  # a subclass resolves as its base
    if name == "prefetch_slots" and "dali-workload" in names:
        return _dali_buffer(built, layers)
    attribute = next((_RESOLVED_AS[(n, name)] for n in names if (n, name) in _RESOLVED_AS), None)
    if attribute is not None:
        return getattr(part, attribute)
    value = getattr(part, name)  # resolved in place by the set-up, or still the default it left
    return _NONE if _left_to_run(part, name, value) else value


def _field(obj: Any, name: str) -> Any:
    import dataclasses
    return getattr(obj, name) if name in {f.name for f in dataclasses.fields(obj)} else _NONE


def _profile_value(profile: Any, path: str) -> Any:
    """The profile's value at a dotted path (``pcie.bandwidth_scale``): its parsed field, which holds the default
    of an optional field the file omits, else the file's own entry; a single value only."""
    for node in (profile, profile.raw):
        for part in path.split("."):
            node = node.get(part, _NONE) if isinstance(node, dict) else getattr(node, part, _NONE)
            if node is _NONE:
                break
        if isinstance(node, (bool, int, float, str)):
            return node
    return _NONE


def _serving_value(serving: Any, key: str) -> Any:
    """A serving point's workload or scheduler setting; a workload setting its arrival process does not read
    (``workload.qps`` of a closed loop) has none."""
    from moesim.sim.workload import READ_BY
    section, _, rest = key.partition(".")
    if section == "workload":
        if key in READ_BY and serving.workload.arrival not in READ_BY[key]:
            return _NONE
        return _field(serving.workload, rest)
    if key == "scheduler":
        return serving.scheduler
    import dataclasses

    from moesim.policy.scheduler import build_scheduler
    scheduler = build_scheduler(serving.scheduler, serving.scheduler_params)
    fields: set[str] = {f.name for f in dataclasses.fields(scheduler) if not f.name.startswith("_")} \
        if dataclasses.is_dataclass(scheduler) else set()
    return getattr(scheduler, rest) if rest in fields else _NONE


def _plain(value: Any) -> Any:
    """A value as a results cell takes it: a number, bool or string as it is (a numpy number as Python's), anything
    else (a per-layer list) as ``--set`` would write it."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return value if isinstance(value, (bool, int, float, str)) else setting_str(value)


def fill_point(resolver: Defaults, row: dict[str, Any], point: Point, keys: Iterable[str]) -> list[str]:
    """:meth:`Defaults.fill` for the row of ``point``, just run (its trace and profile as the row names them)."""
    return resolver.fill(row, point.settings_str(), keys, trace_path=row.get("trace_path"),
                         hw_path=row.get("hw_path"))


def fill_stored(resolver: Defaults, rows: dict[str, dict[str, Any]], keys: list[str],
                current: Callable[[dict[str, Any]], str | None], points: dict[str, Point]) -> list[str]:
    """Fill the stored ``rows`` (point id -> row) that finished and whose recorded input fingerprint is what
    ``current(row)`` gives now (the trace, profile and code of one's own they ran with are those of now, the
    test a resume keeps a row by): a row of an older file, or of another spec's point, then says what it ran
    with too. Rows that may have run with other code or files stay as they are. Returns the ids of the rows
    changed."""
    changed = []
    for pid, row in rows.items():
        if row.get("status") != "ok":
            continue
        point = points.get(pid)
        settings = point.settings_str() if point is not None else row_settings(row)
        if not to_fill(keys, settings, row):
            continue
        try:
            same = row.get("input_fingerprint") is not None and row.get("input_fingerprint") == current(row)
        except Exception:  # noqa: BLE001 - its files gone or unreadable: it stays as it is
            same = False
        if not same:
            continue
        before = row.get(FILLED)
        if resolver.fill(row, settings, keys, trace_path=row.get("trace_path"), hw_path=row.get("hw_path")) \
                or before != row.get(FILLED):
            changed.append(pid)
    return changed
