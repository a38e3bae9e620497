"""The Python API's arguments (:mod:`moesim.api`): the defaults of ``hw`` and ``system``, ``--set`` parameters
from keyword arguments and a ``settings`` dict, and the checks that make a wrong argument one line naming it in
the caller's terms: a misspelt keyword with the argument meant, a value of the wrong kind, an error below the
API under the keyword it came from rather than its command-line option or dotted ``--set`` key."""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import re
from typing import Any, Mapping, Sequence

from moesim import notebook
from moesim import sweep as sweep_module
from moesim.errors import ConfigError, MoesimError, slip_of

DEFAULT_HW = "rtx4090"
#: the system ``moesim.replay`` and ``moesim replay`` use when none is named (``--system all`` compares
#: every system on the command line; the API replays one system per call)
DEFAULT_SYSTEM = "gpu-only-lru"


#: command-line options that errors raised below the API name, as a Python caller spells them
PYTHON_NAMES = {"--system": "system", "--model": "model", "--engine": "engine", "--workers": "workers",
                "--address": "address", "--out": "out", "--slo": "slo", "--window": "window", "--hw": "hw",
                "--requests": "requests", "--qps": "qps", "--scheduler": "scheduler", "--seed": "seed"}

#: where a sweep spec takes settings, as :func:`python_wording` names it
SPEC_SETTINGS = "'set': "
#: ``--set KEY=VALUE`` (a value in brackets may hold commas), and any that follow it with a space between
_SETTING = r"--set ([\w.\-]+)=(\[[^\]]*\]|[^\s,;)]+)"
_SETTINGS = re.compile(rf"{_SETTING}(?: {_SETTING})*")
#: an option's value, where one follows it: a placeholder (NAME), a number, or one of the words a fix gives
_OPTION = re.compile(r"--([a-z][a-z-]*)(?:[ =]([A-Z][A-Z_]*\b|\d[\d.]*|ray\b|local\b))?")


@contextlib.contextmanager
def python_names(serving: bool = False, spec: bool = False) -> Any:
    """Errors in a caller's own terms: ``field 'system'`` rather than ``--system``, a ``--set`` parameter as the
    keyword argument it came from (``cache__alpha``), and a fix such as ``--set cache.n=8`` as
    ``settings={'cache.n': 8}`` (:func:`python_wording`; ``spec``: the call takes a sweep spec, where it is
    ``'set': {'cache.n': 8}``). A short or misspelt parameter gets the full key it
    looks like (``qps``: ``workload.qps`` when ``serving``). In Jupyter, they and an interrupt show the caller's
    lines only."""
    try:
        yield
    except KeyboardInterrupt as err:  # Kernel > Interrupt: the cell's line, not two screens of SimPy and the pool
        err._render_traceback_ = functools.partial(notebook.callers_traceback, err)  # type: ignore[attr-defined]
        raise
    except MoesimError as err:
        err._render_traceback_ = functools.partial(notebook.callers_traceback, err)  # type: ignore[attr-defined]
        sweep_module.full_key_guess(err, serving)
        name = PYTHON_NAMES.get(err.field or "")
        if err.field == "--set":
            key = set_parameter(err)
            name = key.replace(".", "__") if key else "settings"
        if name is not None:
            err.field = name
        err.reword(functools.partial(python_wording, settings=SPEC_SETTINGS if spec else "settings="))
        raise


def python_wording(text: str, settings: str = "settings=") -> str:
    """``text`` of an error, written for the command line, in a Python caller's terms: ``--set cache.n=8``
    (and any ``--set`` after it) as ``settings={'cache.n': 8}``, an option as its argument (``--requests``:
    ``requests=``, ``--engine local``: ``engine='local'``), ``moesim --import my_policies.py ...`` as
    ``import my_policies``. ``settings`` names where the settings go (``'set': `` in a sweep spec). The
    command line keeps the words as written; this is the one place the API's differ.

    >>> python_wording("choose one with --set cache=score-history --set cache.n=8 as well (--requests)")
    "choose one with settings={'cache': 'score-history', 'cache.n': 8} as well (requests=)"
    """
    text = re.sub(r"moesim --import (\S+?)(?:\.py)? \.\.\.", r"import \1", text)
    text = text.replace("`moesim sweep --help`", "help(moesim.sweep)")
    text = re.sub(r"`moesim systems(?: ([\w.-]+))?`", _systems_call, text)
    text = _SETTINGS.sub(lambda run: settings + _settings_dict(run), text)
    text = re.sub(r"--set (parameters?)\b", r"\1", text)  # "a dict of --set parameters"
    return _OPTION.sub(_argument, text)


def _systems_call(command: re.Match) -> str:
    """```moesim systems``` as ``moesim.systems()``, ```moesim systems smoe``` as ``moesim.systems('smoe')``
    (a placeholder, NAME, as it is)."""
    name = command.group(1)
    return f"moesim.systems({_literal(name) if name else ''})"


def _settings_dict(run: re.Match) -> str:
    pairs = re.findall(_SETTING, run.group(0))
    return "{" + ", ".join(f"{_literal(key)}: {_literal(value)}" for key, value in pairs) + "}"


def _argument(option: re.Match) -> str:
    name = PYTHON_NAMES.get(f"--{option.group(1)}")
    if name is None:  # an option the API has no argument for (`ray start --head`): as written
        return option.group(0)
    return f"{name}={_literal(option.group(2)) if option.group(2) else ''}"


def _literal(value: str) -> str:
    """A setting's value or key as Python writes it: a number, True/False, a list, a placeholder (VALUE, KEY,
    <int>) as they are; other words quoted."""
    if re.fullmatch(r"-?\d+(\.\d*)?(e-?\d+)?|\[.*\]|[A-Z][A-Z_]*|<\w+>", value):
        return value
    if value.lower() in ("true", "false"):
        return value.capitalize()
    return repr(value)


def set_parameter(err: MoesimError) -> str | None:
    """The dotted key an error about one ``--set`` parameter (field ``--set``) names in its text."""
    key = re.search(r"parameter '([^']+)'", err.detail)
    return key.group(1) if key else None


@contextlib.contextmanager
def keyword_fields(params: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> Any:
    """An error about a parameter given as a keyword argument names that keyword (``cache__alpha``), as the
    caller spelled it, not the dotted ``--set`` key (``cache.alpha``); a profile field an ``hw__`` keyword set
    (``gpu.memory_gib`` of ``hw__gpu__memory_gib``) too. A parameter from the ``settings`` dict is named by its
    key there (an unknown one was named as a keyword the caller never wrote: ``cache__slots_per_layr`` for
    ``settings={"cache.slots_per_layr": 2}``)."""
    try:
        yield
    except MoesimError as err:
        names = {sweep_module.normalize_key(k): k for k in params}
        field_ = err.field or ""
        if field_ == "--set":
            key = set_parameter(err) or ""
            in_settings = {sweep_module.normalize_key(k): str(k) for k in (settings or {})}
            name = names.get(key) or in_settings.get(key)
        else:
            name = names.get(field_) or (names.get(f"hw.{field_}") if "." in field_ else None)
        if name is not None:
            err.rename_field(name)
        raise


def settings_from(settings: Mapping[str, Any] | None = None, shorthands: Mapping[str, tuple[str, Any]] | None = None,
                  **params: Any) -> dict[str, str]:
    """``--set`` settings from a dict, keyword arguments (``cache__slots_per_layer=4``) and ``shorthands``
    (argument -> (key, value): :func:`moesim.serve`'s ``qps=`` for ``workload.qps``). One key given twice is
    refused naming both spellings as the caller wrote them (``qps=1 and workload__qps=2``).

    >>> settings_from({"cache": "lru"}, cache__slots_per_layer=4, engine__timeline=True)
    {'cache': 'lru', 'cache.slots_per_layer': '4', 'engine.timeline': 'true'}
    """
    checked_settings(settings)
    given = [(name, key, value, f"{name}={value!r}") for name, (key, value) in (shorthands or {}).items()]
    given += [(str(key), key, value, f"settings={{{key!r}: {value!r}}}") for key, value in (settings or {}).items()]
    given += [(key, key, value, f"{key}={value!r}") for key, value in params.items()]
    out: dict[str, str] = {}
    spelled: dict[str, tuple[str, str]] = {}  # key -> (field, as the caller wrote it)
    for name, key, value, written in given:
        key = sweep_module.normalize_key(key)
        if key in out:
            first, first_written = spelled[key]
            raise ConfigError(f"{first_written} and {written} both set parameter '{key}'", field=first,
                              fix=f"give one of them (e.g. {first_written} alone)")
        spelled[key] = (name, written)
        if getattr(value, "ndim", 0) > 0:  # a numpy array (or Series) printed as '[2 1 2]', which no parser reads
            value = value.tolist()
        out[key] = sweep_module.setting_str(whole_number(value))
    return out


def whole_number(value: Any) -> Any:
    """A float that holds a whole number as that int: a count read from a results table (a column with gaps is
    float) or from ``np.linspace`` was "'2.0' is not a valid int"; a float parameter reads "2" as 2.0. Lists
    (per-layer slots) element by element; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(whole_number(v) for v in value)
    if isinstance(value, float) or type(value).__name__.startswith("float"):  # numpy floats too
        number = float(value)
        return int(number) if number.is_integer() and abs(number) < 2**53 else value  # 1e300 stays as written
    return value


def checked_settings(settings: Any) -> None:
    """One line for ``settings`` that is no dict (a list of ``KEY=VALUE`` strings, as on the command line)."""
    if settings is not None and not isinstance(settings, Mapping):
        raise ConfigError(f"settings must be a dict of parameters, got {settings!r}", field="settings",
                          fix="e.g. settings={'cache': 'lru', 'cache.slots_per_layer': 2}")


def checked_keywords(function: Any) -> Any:
    """Decorator: a keyword argument ``function`` does not take is one line naming the argument it is a slip of
    (``qsp=`` for ``qps``, ``step=`` for ``steps``), not Python's "unexpected keyword argument" TypeError. Where
    ``function`` takes ``--set`` parameters as keywords (:func:`replay`, :func:`serve`), a keyword that is no
    slip of an argument is one of those, for the system to check (a slip taken as one was refused as unknown to
    the system, and the fix listed every parameter but the argument meant)."""
    import inspect
    arguments = inspect.signature(function).parameters
    own = [name for name, arg in arguments.items()
           if arg.kind not in (arg.VAR_KEYWORD, arg.VAR_POSITIONAL) and name != "self"]
    settings = any(arg.kind is arg.VAR_KEYWORD for arg in arguments.values())
    call = f"{function.__qualname__}()"

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for key in kwargs:
            if key in own or settings and is_setting_name(key):
                continue
            guess = "did you mean hw? " if key in ("hardware", "profile") and "hw" in own else slip_of(key, own)
            if settings and not guess:
                continue  # a --set parameter, for the system to check
            err = ConfigError(f"{call} has no argument '{key}'", field=key,
                              fix=guess + ("(other keywords are parameters of the system, e.g. cache__slots_per_layer=2)"
                                           if settings else f"{call} takes {', '.join(own)}"))
            err._render_traceback_ = functools.partial(notebook.callers_traceback, err)  # type: ignore[attr-defined]
            raise err
        return function(*args, **kwargs)
    return checked


def is_setting_name(key: str) -> bool:
    """Whether keyword ``key`` is spelt as a ``--set`` parameter: dotted (``__``), a role or another top-level one."""
    from moesim.policy.systems import ROLES
    return "__" in key or "." in key or key in ROLES or key in ("runtime", "scheduler")


def checked_flags(**flags: Any) -> None:
    """One line for a switch given as something other than True or False (``timeline="no"`` is truthy)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}", field=name,
                              fix=f"e.g. {name}=False")


def kept(name: str, flag: bool | None, given: Mapping[str, str]) -> bool | None:
    """Whether a replay keeps its timeline (or decision log): the argument, else True unless the settings say
    (None: the engine reads ``engine.timeline`` from them; ``settings={"engine.timeline": False}`` was overridden
    by the argument's default and the timeline kept without a word). Both given: refused, as a key given twice."""
    if f"engine.{name}" not in given:
        return True if flag is None else flag
    if flag is not None:
        raise ConfigError(f"{name}={flag!r} and the setting 'engine.{name}' both say whether to keep the {name}",
                          field=name, fix=f"give one of them (e.g. {name}={flag!r} alone)")
    return None


def checked_trace(trace: Any) -> str:
    """``trace`` as one path; one line for anything else (a list read as a missing file named "['a.parquet']")."""
    if isinstance(trace, (str, os.PathLike)):
        return existing_trace(trace)
    several = isinstance(trace, Sequence) and all(isinstance(t, (str, os.PathLike)) for t in trace)
    raise ConfigError(f"trace must be one trace file's path, got {trace!r}", field="trace",
                      fix="replay one trace per call; moesim.sweep({'traces': [...], ...}) replays several"
                      if several else "e.g. 'traces/mixtral-8x7b-humaneval.parquet'")


def existing_trace(trace: str | os.PathLike, field: str = "trace") -> str:
    """``trace`` as a path string; for a file that is not there, one line saying where it was looked for. A
    notebook's kernel runs in the notebook's folder, so ``traces/...`` written as from the repository's root
    was "file not found (fix: check the path)", with neither the folder nor :func:`moesim.bundled_trace` named."""
    from moesim.errors import TraceFormatError
    path = os.fspath(trace)
    if os.path.lexists(path):
        return path
    absolute = os.path.abspath(path)
    where = "" if os.path.isabs(path) else f" (looked at {absolute}: a relative path starts at the working folder)"
    bundled = bundled_name(path)
    fix = f"moesim.bundled_trace({bundled!r}) gives the bundled trace's path from any folder" if bundled \
        else "check the path" + ("" if os.path.isabs(path) else ", or give it as an absolute one")
    raise TraceFormatError(f"file not found{where}", source=path, field=field, fix=fix)


def bundled_name(path: str) -> str | None:
    """The name of the bundled trace ``path`` names by its file name, if any."""
    from moesim.api import TRACE_DIR
    name = os.path.basename(path).removesuffix(".parquet")
    return name if name and (TRACE_DIR / f"{name}.parquet").is_file() else None


def profile_label(hw: Any) -> str:
    """The ``hw`` column of a result: a profile's name or path as given, a HardwareProfile object's name (its
    repr, every curve of the profile, filled the cell before)."""
    return hw.name if hasattr(hw, "gpu") and isinstance(getattr(hw, "name", None), str) else os.fspath(hw)


def checked_rate(qps: Any) -> None:
    """One line for ``moesim.serve(qps=...)`` given several rates (a list, or ``"0.5,1"`` as ``--qps`` takes
    them): a call serves one rate, and the value was refused as "not a valid float" with the fix "give a float"."""
    several = isinstance(qps, (list, tuple, set, range)) or (isinstance(qps, str) and "," in qps) or \
        getattr(qps, "ndim", 0) > 0  # a numpy array or a Series of rates
    if several:
        rates = list(qps.split(",")) if isinstance(qps, str) else list(qps)
        grid = "[" + ", ".join(str(r).strip() for r in rates) + "]"
        raise ConfigError(f"qps={qps!r} is a list of rates; a call serves one", field="qps",
                          fix="call moesim.serve once per rate (for qps in ...: moesim.serve(..., qps=qps)), or "
                              "moesim.sweep({'traces': [TRACE], 'hw': [HW], 'systems': [SYSTEM], 'grid': "
                              f"{{'workload.qps': {grid}}}, 'set': {{'workload.requests': N}}}}) gives one row per rate")


def checked_run_inputs(hw: Any, seed: Any, system: Any = DEFAULT_SYSTEM, model: Any = None,
                       serving: bool = False) -> None:
    """One-line errors for a ``hw``, ``seed``, ``system`` or ``model`` of the wrong kind (the command line's
    types check them there). ``serving``: the call is :func:`moesim.serve`, whose sweep needs ``workload.*``."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a preset name or a preset YAML path, got {model!r}", field="model",
                          fix="e.g. model='mixtral-8x7b', or leave it out to take the trace's own")
    if not isinstance(system, str):
        raise ConfigError(f"system must be one system's name, got {system!r}", field="system",
                          fix="run one system per call (moesim.sweep runs several: systems=[...])")
    if system == "all" or "," in system:  # the command line's --system all / a,b: several runs, one table
        # a sweep serves only when its points set workload.* (without, the fix led to replays, not serving)
        workload = ", 'set': {'workload.qps': QPS, 'workload.requests': N}" if serving else ""
        raise ConfigError(f"system={system!r} names several systems; a call {'serves' if serving else 'replays'} "
                          "one", field="system",
                          fix="moesim.sweep({'traces': [TRACE], 'hw': [HW], 'systems': "
                              + ("'all'" if system == "all" else repr(system.split(",")))
                              + workload + "}) gives one row per system")
    from moesim.hw.profile import HardwareProfile
    if not isinstance(hw, (str, os.PathLike, HardwareProfile)):
        raise ConfigError(f"hw must be a profile name, a YAML path or a HardwareProfile, got {hw!r}", field="hw",
                          fix=f"e.g. hw={DEFAULT_HW!r}")
    from moesim.policy.systems import SYSTEMS
    if isinstance(hw, str) and hw in SYSTEMS and not os.path.exists(hw):  # replay(trace, "smoe"): the 2nd is hw
        raise ConfigError(f"hw={hw!r} is a system, not a hardware profile", field="hw",
                          fix=f"system={hw!r} (the second argument is the profile, e.g. hw={DEFAULT_HW!r})")
    from moesim.sim.run import checked_seed
    checked_seed(seed)


def checked_sweep_inputs(grid: Any, workers: Any, progress: Any, out: Any = None) -> None:
    """One line for a spec, ``workers``, ``progress`` or ``out`` of the wrong kind (a TypeError deep in the pool
    or in pathlib before)."""
    if not isinstance(grid, (Mapping, str, os.PathLike)):
        raise ConfigError(f"the sweep spec must be a dict or a YAML file's path, got {grid!r}", field="grid",
                          fix="e.g. moesim.sweep({'traces': [TRACE], 'hw': ['rtx4090'], 'systems': ['smoe']})")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, numbers.Integral)):
        raise ConfigError(f"workers must be a whole number of processes, got {workers!r}", field="workers",
                          fix="e.g. workers=2 (1 runs the points in this process; None: every core)")
    if progress is not None:
        checked_flags(progress=progress)
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise ConfigError(f"out must be a .parquet file's path, got {out!r}", field="out",
                          fix="e.g. out='results.parquet' (or leave it out: the results are only returned)")
    if out is not None:  # as the command line checks --out: a folder that does not exist is not made
        from moesim.util import PARQUET, check_output_path
        check_output_path(out, "out", PARQUET)


def checked_requests(requests: Any) -> list[int]:
    """``requests`` as a list of request ids; one line for anything else (``requests=0`` failed with "'int' object
    is not iterable", ``['a']`` with a ValueError)."""
    if isinstance(requests, numbers.Integral) and not isinstance(requests, bool):
        raise ConfigError(f"requests must be a list of request ids, got {requests!r}", field="requests",
                          fix=f"e.g. requests=[{requests}] for that one request")
    ids = list(requests) if hasattr(requests, "__iter__") and not isinstance(requests, (str, bytes)) else None
    if ids is None or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in ids):
        raise ConfigError(f"requests must be a list of request ids, got {requests!r}", field="requests",
                          fix="e.g. requests=[0, 1]")
    return ids
