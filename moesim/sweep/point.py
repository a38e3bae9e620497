"""One point of a sweep replayed in a worker, its metrics as one flat row; failures become rows too."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from moesim.errors import MissingColumnError, MoesimError, UnservableError
from moesim.sweep.spec import Point

#: called with each finished point's row
Finished = Callable[[dict[str, Any]], None]
#: how the error of a point whose worker process died begins (not the point's input: tells ``moesim sweep``)
WORKER_DIED = "its worker process died"
#: how many times a point whose worker process died (kill -9, the OOM killer, a crash) runs again before
#: it is recorded as failed, with either engine
RETRIES_AFTER_WORKER_DEATH = 1
#: key of a failed point's row (never stored) saying its system cannot run on its trace at all: it needs a
#: trace column the trace lacks; a system that ``systems: all`` brought in is then left out, not failed
UNRUNNABLE = "_unrunnable"


def flatten_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """A metrics dict as flat columns: breakdown per category, lists joined, ``system`` dropped, and the
    nested ``lower_bound`` (:func:`moesim.sim.run.add_lower_bound`) as the last columns, ``lower_bound_<key>``
    (a portfolio's ``slots_by_metric`` as ``lower_bound_slots_by_metric_<metric>``)."""
    out: dict[str, Any] = {}
    bound: dict[str, Any] = {}
    for key, value in m.items():
        if key == "system":
            continue
        if key == "lower_bound":
            for name, part in value.items():
                if isinstance(part, dict):
                    bound.update({f"lower_bound_{name}_{k}": v for k, v in part.items()})
                else:
                    bound[f"lower_bound_{name}"] = part
        elif key == "breakdown_ms":
            out.update({f"breakdown_{cat}_ms": float(v) for cat, v in value.items()})
        elif isinstance(value, (list, tuple)):
            out[key] = "; ".join(str(v) for v in value)
        else:
            out[key] = value
    out.update(bound)
    return out


def no_lower_bound() -> dict[str, float]:
    """The bound's columns of a serving point: NaN (a serving run has no replay bound to measure it against)."""
    from moesim.sim.run import LOWER_BOUND_KEYS
    return {"gap_to_lower_bound": float("nan"), **{f"lower_bound_{k}": float("nan") for k in LOWER_BOUND_KEYS}}


def replay_columns() -> list[str]:
    """The metric columns of a replayed point's row (:func:`flatten_metrics` of ``metrics`` with the lower
    bound), in its order, known before any run; a portfolio's ``lower_bound_slots_by_metric_<metric>`` aside."""
    from moesim.analysis.metrics import METRIC_DOCS
    from moesim.sim.bookkeeping import BREAKDOWN
    from moesim.sim.run import LOWER_BOUND_KEYS
    template: dict[str, Any] = {k: None for k in METRIC_DOCS if k not in ("inputs", "skipped")}
    template.update(breakdown_ms=dict.fromkeys(BREAKDOWN, 0.0), lower_bound=dict.fromkeys(LOWER_BOUND_KEYS))
    return list(flatten_metrics(template))


def metric_columns(points: Iterable[Point]) -> list[str]:
    """The metric columns the rows of ``points`` have when they run: a replayed point's, a serving point's, or
    both in a sweep of both. A sweep whose points all failed gets them too, empty (NaN), so that
    ``frame["tpot_ms_mean"]`` reads NaN instead of raising KeyError."""
    from moesim.sim.workload import is_serving_key
    kinds = {any(is_serving_key(k) for k, _ in point.settings) for point in points}
    return columns_of_kinds(replayed=False in kinds, serving=True in kinds)


def columns_of_kinds(replayed: bool, serving: bool) -> list[str]:
    """The metric columns of replayed points' rows, serving points' rows, or both (replayed first)."""
    columns: dict[str, None] = {}
    if replayed:
        columns.update(dict.fromkeys(replay_columns()))
    if serving:
        from moesim.analysis.serving import serving_columns
        columns.update(dict.fromkeys([*serving_columns(), *no_lower_bound()]))
    return list(columns)


def run_point(point: Point, trace_path: str, hw: Any) -> dict[str, Any]:
    """Replay one point; a failure becomes a row with ``status='error'`` and the reason, never an exception.

    A replayed point's row holds its metrics, its physical lower bound (``lower_bound_makespan_s``,
    ``lower_bound_ttft_ms``, ``lower_bound_tpot_ms_mean``, ``lower_bound_slots``; a portfolio's also
    ``lower_bound_slots_by_metric_<metric>``) and ``gap_to_lower_bound``, as ``moesim.replay`` gives them
    (:func:`moesim.sim.run.add_lower_bound`). A serving point (``workload.*`` settings) has no replay bound:
    those columns are NaN in its row.
    """
    started = time.perf_counter()
    row = point.columns()
    serving = False
    try:
        from moesim.analysis.metrics import metrics
        from moesim.sim import run
        from moesim.sim.workload import is_serving_key
        profile = cached_profile(hw) if isinstance(hw, str) else hw
        settings = point.settings_str()
        serving = any(is_serving_key(k) for k in settings)
        if serving:
            from moesim.analysis.serving import serving_row  # sweeps over workload.* serve instead of replaying
            row.update(status="ok", error="", **serving_row([trace_path], profile, point.system, settings,
                                                            model_preset=point.model, seed=point.seed),
                       **no_lower_bound())
        else:
            result = run.simulate(trace_path, profile, point.system, settings, model_preset=point.model,
                                  seed=point.seed, timeline=False, decisions=False)
            m = run.add_lower_bound(metrics(result), result, trace_path, profile, point.system, settings,
                                    bound_memos(trace_path, profile))
            row.update(status="ok", error="", **flatten_metrics(m))
    except Exception as err:  # noqa: BLE001 - a failing point is recorded, it must not stop the others
        if serving and isinstance(err, MoesimError) and err.wording is None:
            from moesim.sim.serving import spec_wording  # a fix naming serve-sim's --requests: the spec's key
            err.reword(spec_wording)
        row.update(status="error", error=describe_error(err))
        if isinstance(err, (MissingColumnError, UnservableError)):  # left out when it came in through `all`
            row[UNRUNNABLE] = True
    row.update(point_wall_s=time.perf_counter() - started,
               finished_at=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
               worker=f"{socket.gethostname()}:{os.getpid()}")
    return row


def columns_of(points: list[Point]) -> list[str]:
    """The optional trace columns any of ``points`` reads: a worker decodes a trace with them all, once."""
    from moesim.sim.run import columns_read
    distinct = {(p.system, tuple(p.settings_str().items())) for p in points}
    return sorted({c for system, settings in distinct for c in columns_read(system, dict(settings))})


#: per process: (profile file, its mtime and size) -> parsed profile; parsing the YAML costs about 0.1 s,
#: as much as replaying a short trace
_PROFILES: dict[tuple[str, int, int], Any] = {}


def cached_profile(hw: str) -> Any:
    """The profile named or pointed to by ``hw``, parsed once per process while its file is unchanged."""
    from moesim.hw.profile import load_profile, profile_path
    path = profile_path(hw)
    if not path.is_file():
        return load_profile(hw)  # raises the usual one-line error
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _PROFILES:
        _PROFILES[key] = load_profile(path)
    return _PROFILES[key]


#: per process: (trace file, its mtime and size, the profile object's id) -> (that profile, the floors of
#: :func:`moesim.sim.run.add_lower_bound`): points of a sweep that differ only in what a bound does not depend
#: on (the system, its own parameters, a cache size that plans the same slots) share one
_BOUNDS: dict[tuple[str, int, int, int], tuple[Any, dict]] = {}
#: how many (trace, profile) pairs :data:`_BOUNDS` keeps before it starts afresh: a few, since each holds its
#: steps' bound terms (about 12 bytes per routed expert of the trace) and points come trace by trace, profile
#: by profile
_BOUNDS_KEPT = 8


def bound_memos(trace_path: str, profile: Any) -> dict:
    """The floors computed in this process for ``trace_path`` on ``profile`` (a parsed profile, one object per
    file while it is unchanged: :func:`cached_profile`), to share between this process's points."""
    stat = os.stat(trace_path)
    key = (os.path.abspath(trace_path), stat.st_mtime_ns, stat.st_size, id(profile))
    entry = _BOUNDS.get(key)
    if entry is None or entry[0] is not profile:  # the entry holds its profile: no other object takes its id
        if len(_BOUNDS) >= _BOUNDS_KEPT:
            _BOUNDS.clear()
        entry = _BOUNDS[key] = (profile, {})
    return entry[1]


def input_fingerprint(trace_path: str, hw: str) -> str:
    """What a point's result depends on besides its parameters, which its id holds: the content of its
    profile (a small YAML file; a profile name stands for the bundled file) and the identity of its trace
    (size and modification time: hashing gigabytes of trace would cost more than replaying it). A
    resume runs a finished point again when this changed."""
    from moesim.hw.profile import profile_path
    trace = os.stat(trace_path)
    profile = profile_path(hw)
    key = {"trace": [trace.st_size, trace.st_mtime_ns],
           "hw": hashlib.sha256(profile.read_bytes()).hexdigest() if profile.is_file() else hw}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def own_code(point: Point) -> tuple[list[str], list[type]]:
    """What of one's own ``point`` runs (its system's class, or a component it names or swaps in with
    ``--set ROLE=NAME``): the classes, and the files of the modules defining them (a policy module imported by
    ``--import``, ``import:`` or ``import`` in Python; a class defined in a notebook cell has none)."""
    import sys
    from moesim.policy.checked import is_catalogue
    from moesim.policy.systems import COMPONENTS, ROLES, SYSTEMS
    spec = SYSTEMS.get(point.system)
    if spec is None:
        return [], []
    chosen = {**spec.roles(), **{k: v for k, v in spec.defaults if k in ROLES},
              **{k: v for k, v in point.settings if k in ROLES}}
    found = [spec.system_class] + [COMPONENTS.get(role, {}).get(str(name)) for role, name in chosen.items()]
    classes = [cls for cls in found if cls is not None and not is_catalogue(cls)]
    files = {getattr(sys.modules.get(cls.__module__), "__file__", None) for cls in classes}
    return sorted(f for f in files if f and os.path.isfile(f)), classes


#: class attributes whose repr is their value (a parameter's default: ``decay: float = 0.9``)
PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None))


def _bytecode(cls: type) -> bytes:
    """The methods ``cls`` defines as this process runs them (properties', static and class methods' functions
    too): their instructions, the code nested in them (:func:`_nested_code`), names, plain constants and
    default arguments (a module edited but not reloaded in a Python session still runs its old code), the
    module-level data they read (:func:`_globals_read`: ``THRESHOLD = 3`` edited in a notebook cell, or set on
    the module, kept the old value's results), and its plain class attributes (a parameter's default, which a
    dataclass keeps there and in ``__init__``'s defaults: editing ``decay: float = 0.9`` in a notebook cell kept
    the old default's results)."""
    from moesim.policy.checked import is_catalogue
    out = []
    for klass in (k for k in cls.__mro__ if not is_catalogue(k)):
        for key, value in vars(klass).items():
            functions = _functions_of(value)
            for function in functions:
                code = function.__code__
                defaults = tuple(d for d in (function.__defaults__ or ()) if isinstance(d, PLAIN_VALUES))
                out.append(code.co_code + repr((code.co_names, _plain_consts(code), defaults)).encode()
                           + _nested_code(code) + _globals_read(function))
            if not functions and (isinstance(value, PLAIN_VALUES) or (
                    isinstance(value, tuple) and all(isinstance(v, PLAIN_VALUES) for v in value))):
                out.append(repr((key, value)).encode())
    return b"".join(out)


def _functions_of(value: Any) -> list[Any]:
    """The Python functions a class attribute runs: a method, a static or class method's function, a property's
    getter, setter and deleter (none: not code)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if hasattr(f, "__code__")]
    return [value] if hasattr(value, "__code__") else []


def _nested_code(code: Any) -> bytes:
    """The instructions, names and plain constants of the code nested in ``code`` (its lambdas, comprehensions
    and inner functions, in order, recursively): editing ``key=lambda e: e * 2`` to ``* 3`` changes them (b""
    when there is none, so the fingerprint of a method without nested code is what it was before these were
    hashed)."""
    return b"".join(inner.co_code + repr((inner.co_names, _plain_consts(inner))).encode()
                    for inner in _inner_codes(code))


def _plain_consts(code: Any) -> tuple:
    """``code``'s constants but the code objects nested in it."""
    return tuple(c for c in code.co_consts if not hasattr(c, "co_code"))


def _inner_codes(code: Any) -> Iterator[Any]:
    """The code objects nested in ``code``, each before the ones nested in it, in the order of its constants."""
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield const
            yield from _inner_codes(const)


def _globals_read(function: Any) -> bytes:
    """The module-level data ``function`` reads, as stable bytes (b"" when it reads none, so the fingerprint of a
    policy reading none is what it was before these were hashed).

    The names its code uses (``co_names``, through its nested code objects too: lambdas, comprehensions) that
    are names of its module's globals (``function.__globals__``: a notebook's namespace for a class defined in
    a cell), sorted, each with its value as :func:`_data_text` writes it. Only simple data enters: numbers,
    strings, bytes, bools, None, and tuples, lists, dicts, sets and frozensets of them. Values of other kinds
    (functions, modules, classes, arrays, objects) are left out, so a constant that only a module-level helper
    function reads, or one read as an attribute of another module (``config.THRESHOLD``), does not enter; nor
    do a closure's variables. A name that is an attribute name as well (``self.limit`` beside a global
    ``limit``) enters too: at worst a point runs again when it need not."""
    code = getattr(function, "__code__", None)
    namespace = getattr(function, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return b""
    names = set(code.co_names).union(*(inner.co_names for inner in _inner_codes(code)))
    read = []
    for name in sorted(names):
        if name in namespace:
            text = _data_text(namespace[name])
            if text is not None:
                read.append((name, text))
    return repr(read).encode() if read else b""


def _data_text(value: Any, within: tuple[int, ...] = ()) -> str | None:
    """``value`` written the same way in every process when it is simple data (see :func:`_globals_read`), else
    None. A subclass of a plain type (an IntEnum member, a numpy float) is written as its plain value; dicts in
    their order, sets sorted (their order changes with the process's string hashing)."""
    if value is None:
        return "None"
    for kind in (bool, int, float, complex, str, bytes):  # bool before int
        if isinstance(value, kind):
            return kind.__repr__(value)
    if not isinstance(value, (tuple, list, dict, set, frozenset)) or id(value) in within:  # not data, or a cycle
        return None
    within = (*within, id(value))
    if isinstance(value, dict):
        items = [(_data_text(k, within), _data_text(v, within)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    texts = [_data_text(v, within) for v in value]
    if any(t is None for t in texts):
        return None
    if isinstance(value, list):
        return "[" + ", ".join(texts) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(texts) + ("," if len(texts) == 1 else "") + ")"
    return f"{'frozenset' if isinstance(value, frozenset) else 'set'}({', '.join(sorted(texts))})"


def own_system(point: Point) -> str:
    """The composition of ``point``'s system when it is one of one's own (its SystemSpec: the components and
    defaults it names), "" for a catalogue system: registering it again with another ``assign=`` kept the old
    composition's results."""
    from moesim.policy.systems import CATALOGUE_SYSTEMS, SYSTEMS
    spec = SYSTEMS.get(point.system)
    return "" if spec is None or point.system in CATALOGUE_SYSTEMS else repr(spec)


def with_own_code(fingerprint: str, point: Point, memo: dict[tuple, bytes] | None = None) -> str:
    """``fingerprint`` (:func:`input_fingerprint`) of a point that runs code of one's own, with that code hashed
    in (its files, the bytecode loaded and the module-level data its methods read: :func:`_bytecode`): editing a
    policy and rerunning the sweep runs its points again instead of keeping the old code's results. A point of
    catalogue code keeps ``fingerprint`` as it is.

    ``memo``: the code read so far in this sweep, by system and component swaps (a sweep's points share a few;
    kept by the caller for one sweep only, since the code may change between sweeps of one session)."""
    from moesim.policy.systems import ROLES
    key = (point.system, tuple((k, v) for k, v in point.settings if k in ROLES))
    code = memo.get(key) if memo is not None else None
    if code is None:
        code = _own_code_bytes(point)
        if memo is not None:
            memo[key] = code
    if not code:
        return fingerprint
    return hashlib.sha256(fingerprint.encode() + code).hexdigest()[:16]


def _own_code_bytes(point: Point) -> bytes:
    """The system's composition, the module files and the bytecode of the code of one's own ``point`` runs
    (b"" for catalogue code only)."""
    files, classes = own_code(point)
    system = own_system(point)
    if not classes and not system:
        return b""
    return system.encode() + b"".join(Path(path).read_bytes() for path in files) + \
        b"".join(_bytecode(cls) for cls in classes)


def describe_error(err: BaseException) -> str:
    """One line: a user error's own message, or the exception type, message and where it was raised. A Ray
    task's error is described by the worker's own (Ray's text holds the remote traceback, in terminal colours)."""
    cause = getattr(err, "cause", None)
    if type(err).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        return describe_error(cause)
    if isinstance(err, MoesimError):
        return str(err)
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return _TERMINAL_COLOURS.sub("", f"{type(err).__name__}: {err}{where}").replace("\n", " ")


#: a terminal's colour codes (ESC [ ... m), which a message from a worker may carry
_TERMINAL_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def error_row(point: Point, message: str) -> dict[str, Any]:
    return {**point.columns(), "status": "error", "error": message,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="microseconds")}
