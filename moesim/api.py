"""The Python API, for Jupyter and scripts: ``moesim.replay`` and ``moesim.sweep``.

Parameters are the ``--set`` keys of the command line. Give them as keyword
arguments with ``__`` for ``.`` or as a ``settings`` dict; both may be mixed::

    import moesim
    r = moesim.replay("traces/mixtral-8x7b-humaneval.parquet", hw="a100-40g", system="gpu-only-lru",
                      cache__slots_per_layer=2, hw__pcie__bandwidth_scale=0.5)
    r = moesim.replay(trace, system="gpu-only-lru", settings={"cache.slots_per_layer": 2, "cache": "belady"})
    r.metrics            # one-row DataFrame, the keys of `moesim replay --json` as columns (the nested
                         # lower_bound as lower_bound_makespan_s, ...; gap_to_lower_bound as it is)
    r.timeline           # one row per interval a resource was busy (TIMELINE_COLUMNS)
    r.decisions          # the decision log (DECISION_COLUMNS)
    r.steps              # one row per forward pass: phase, start, latency, tokens, and its decisions counted
    r.save("runs/lru")   # a folder of Parquet files and metrics.json; moesim.load_replay("runs/lru") reads it
    r.plot_timeline()    # Gantt of CPU, GPU and PCIe (a matplotlib Figure; Jupyter shows it as an image)
    r.plot_timeline(steps=(10, 12))   # other steps; the title says which are shown

    df = moesim.sweep({"traces": [trace], "systems": "all", "hw": ["a100-40g", "h100-pcie"],
                       "grid": {"cache__slots_per_layer": [1, 2, 3]}})

``moesim.sweep`` takes the spec of ``moesim sweep`` (a dict or a YAML path,
see :mod:`moesim.sweep`) and returns a tidy DataFrame: one row per point, every
parameter and metric a column. With ``out=`` it is resumable like the CLI.
Points that failed keep their row (``status == "error"``) and a
:class:`SweepPointsFailed` warning gives the reasons.

``system`` defaults to :data:`DEFAULT_SYSTEM` here and on the command line.
Values are passed as strings to the same parser the CLI uses, so ``True``,
``4`` and ``"4"`` all work.

Imports of pandas, SimPy and matplotlib happen on first use, so that
``import moesim`` stays quick for the command line.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from moesim import notebook
from moesim import sweep as sweep_module
from moesim.errors import ConfigError, MoesimError
from moesim.analysis.runs import ReplayResult, load_replay, step_frame  # noqa: F401 - moesim.api's names
from moesim.util import is_missing, warn_at_caller

DEFAULT_HW = "rtx4090"
#: the system ``moesim.replay`` and ``moesim replay`` use when none is named (``--system all`` compares
#: every system on the command line; the API replays one system per call)
DEFAULT_SYSTEM = "gpu-only-lru"


#: command-line options that errors raised below the API name, as a Python caller spells them
PYTHON_NAMES = {"--system": "system", "--model": "model", "--engine": "engine", "--workers": "workers",
                "--address": "address", "--out": "out", "--slo": "slo", "--window": "window"}


@contextlib.contextmanager
def python_names() -> Any:
    """Errors in a caller's own terms: ``field 'system'`` rather than ``--system``, and a ``--set`` parameter
    as the keyword argument it came from (``cache__alpha``)."""
    try:
        yield
    except MoesimError as err:
        err._render_traceback_ = functools.partial(notebook.callers_traceback, err)  # type: ignore[attr-defined]
        name = PYTHON_NAMES.get(err.field or "")
        if err.field == "--set":
            key = re.search(r"parameter '([^']+)'", err.detail)
            name = key.group(1).replace(".", "__") if key else "settings"
        if name is None:
            raise
        err.rename_field(name)
        raise


@contextlib.contextmanager
def keyword_fields(params: Mapping[str, Any]) -> Any:
    """An error about a parameter given as a keyword argument names that keyword (``cache__alpha``), as the
    caller spelled it, not the dotted ``--set`` key (``cache.alpha``); a profile field an ``hw__`` keyword set
    (``gpu.memory_gib`` of ``hw__gpu__memory_gib``) too."""
    try:
        yield
    except MoesimError as err:
        names = {sweep_module.normalize_key(k): k for k in params}
        field_ = err.field or ""
        name = names.get(field_) or (names.get(f"hw.{field_}") if "." in field_ else None)
        if name is not None:
            err.rename_field(name)
        raise


def settings_from(settings: Mapping[str, Any] | None = None, **params: Any) -> dict[str, str]:
    """``--set`` settings from a dict and keyword arguments (``cache__slots_per_layer=4``).

    >>> settings_from({"cache": "lru"}, cache__slots_per_layer=4, engine__timeline=True)
    {'cache': 'lru', 'cache.slots_per_layer': '4', 'engine.timeline': 'true'}
    """
    checked_settings(settings)
    out: dict[str, str] = {}
    for source in (settings or {}, params):
        for key, value in source.items():
            key = sweep_module.normalize_key(key)
            if key in out:
                raise ConfigError(f"parameter '{key}' given twice", field=key, fix="give it once")
            if getattr(value, "ndim", 0) > 0:  # a numpy array (or Series) printed as '[2 1 2]', which no parser reads
                value = value.tolist()
            out[key] = sweep_module.setting_str(value)
    return out


def checked_settings(settings: Any) -> None:
    """One line for ``settings`` that is no dict (a list of ``KEY=VALUE`` strings, as on the command line)."""
    if settings is not None and not isinstance(settings, Mapping):
        raise ConfigError(f"settings must be a dict of --set parameters, got {settings!r}", field="settings",
                          fix="e.g. settings={'cache': 'lru', 'cache.slots_per_layer': 2}")


#: the figures a serving run's one-line repr shows
SERVE_REPR_METRICS = ("qps", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "throughput_rps")


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
                              fix=guess + ("(other keywords are --set parameters, e.g. cache__slots_per_layer=2)"
                                           if settings else f"{call} takes {', '.join(own)}"))
            err._render_traceback_ = functools.partial(notebook.callers_traceback, err)  # type: ignore[attr-defined]
            raise err
        return function(*args, **kwargs)
    return checked


def is_setting_name(key: str) -> bool:
    """Whether keyword ``key`` is spelt as a ``--set`` parameter: dotted (``__``), a role or another top-level one."""
    from moesim.policy.systems import ROLES
    return "__" in key or "." in key or key in ROLES or key in ("runtime", "scheduler")


def slip_of(key: str, names: Sequence[str]) -> str:
    """"did you mean NAME? " for the ``names`` a keyword is a typing slip of ("" for none): as the rest of moesim
    guesses (:func:`moesim.errors.did_you_mean`), or one letter swapped with the next, added, dropped or changed,
    which that misses in a short name (it rates ``qsp`` against ``qps`` 0.67, under its 0.7)."""
    from moesim.errors import did_you_mean
    guess = did_you_mean(key, names)
    if guess:
        return guess
    near = [name for name in names if one_slip(key, name)]
    return f"did you mean {' or '.join(near)}? " if near else ""


def one_slip(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one edit: two neighbouring letters swapped, or one added, dropped or
    changed."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


#: ``moesim.load_replay``, its keywords checked as this module's own functions' are (named as this module's, where
#: pickle finds it)
load_replay = checked_keywords(load_replay)
load_replay.__module__ = __name__


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
        return os.fspath(trace)
    several = isinstance(trace, Sequence) and all(isinstance(t, (str, os.PathLike)) for t in trace)
    raise ConfigError(f"trace must be one trace file's path, got {trace!r}", field="trace",
                      fix="replay one trace per call; moesim.sweep({'traces': [...], ...}) replays several"
                      if several else "e.g. 'traces/mixtral-8x7b-humaneval.parquet'")


def profile_label(hw: Any) -> str:
    """The ``hw`` column of a result: a profile's name or path as given, a HardwareProfile object's name (its
    repr, every curve of the profile, filled the cell before)."""
    return hw.name if hasattr(hw, "gpu") and isinstance(getattr(hw, "name", None), str) else os.fspath(hw)


def checked_run_inputs(hw: Any, seed: Any, system: Any = DEFAULT_SYSTEM, model: Any = None) -> None:
    """One-line errors for a ``hw``, ``seed``, ``system`` or ``model`` of the wrong kind (the command line's
    types check them there)."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a preset name or a preset YAML path, got {model!r}", field="model",
                          fix="e.g. model='mixtral-8x7b', or leave it out to take the trace's own")
    if not isinstance(system, str):
        raise ConfigError(f"system must be one system's name, got {system!r}", field="system",
                          fix="run one system per call (moesim.sweep runs several: systems=[...])")
    if system == "all" or "," in system:  # the command line's --system all / a,b: several runs, one table
        raise ConfigError(f"system={system!r} names several systems; a call replays one", field="system",
                          fix="moesim.sweep({'traces': [TRACE], 'hw': [HW], 'systems': "
                              + ("'all'" if system == "all" else repr(system.split(",")))
                              + "}) gives one row per system")
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


@python_names()
@checked_keywords
def replay(trace: str | os.PathLike, hw: str = DEFAULT_HW, system: str = DEFAULT_SYSTEM, *,
           settings: Mapping[str, Any] | None = None, seed: int = 0, model: str | None = None,
           timeline: bool | None = None, decisions: bool | None = None, **params: Any) -> ReplayResult:
    """Replay ``trace`` on hardware profile ``hw`` under ``system`` (a registered name).

    ``params``: ``--set`` parameters with ``__`` for ``.``; ``settings``: the
    same as a dict with dotted keys. ``model`` checks the trace against a
    preset. Set ``timeline``/``decisions`` to False for a faster replay
    without them (kept by default; ``engine.timeline``/``engine.decisions``
    among the settings do the same).
    """
    import pandas as pd

    from moesim.analysis.metrics import metrics
    from moesim.sim.result import result_to_frames
    from moesim.sim.run import add_lower_bound, simulate
    trace = checked_trace(trace)
    checked_flags(**{k: v for k, v in (("timeline", timeline), ("decisions", decisions)) if v is not None})
    checked_run_inputs(hw, seed, system, model)
    given = settings_from(settings, **params)
    timeline, decisions = (kept(name, flag, given) for name, flag in (("timeline", timeline),
                                                                      ("decisions", decisions)))
    with keyword_fields(params):
        result = simulate(trace, hw, system, given, model_preset=model, seed=int(seed), timeline=timeline,
                          decisions=decisions)
    raw = add_lower_bound(metrics(result), result, trace, hw, system, given)
    frames = result_to_frames(result)
    row = {"trace": trace, "hw": profile_label(hw), "system": system, "seed": int(seed),
           **sweep_module.flatten_metrics(raw)}
    return ReplayResult(metrics=pd.DataFrame([row]), timeline=frames["timeline"], decisions=frames["decisions"],
                        system=system, trace=str(trace), raw_metrics=raw,
                        steps=step_frame(result.steps, frames["decisions"]))


@python_names()
@checked_keywords
def sweep(grid: Mapping[str, Any] | str | os.PathLike, *, out: str | os.PathLike | None = None,
          workers: int | None = None, engine: str = "local", address: str | None = None,
          progress: bool | None = None) -> Any:
    """Run a sweep spec (dict or YAML path) and return one row per point as a DataFrame.

    Relative paths in a dict spec resolve against the current folder, in a
    YAML spec against the file's folder. ``out``: a ``.parquet`` file that
    makes the sweep resumable (finished points are skipped); without it, the
    same call after a KeyboardInterrupt in this session runs only the points
    not finished before. ``workers``:
    processes (default: all cores; 1 runs in this process). ``engine``:
    ``local`` or ``ray`` (``address`` of an existing cluster, default a local
    Ray instance). ``progress``: a progress bar (default: on a terminal, and in
    a notebook as one line updated in place, every 10 s or
    ``MOESIM_PROGRESS_INTERVAL``).
    Failed points have ``status == "error"`` and the reason in ``error``. A
    system that ``systems: all`` brings in and that cannot run on a trace (it
    needs a column the trace lacks) has no rows for that trace; a warning
    (:class:`SweepSystemsLeftOut`) says why.
    """
    checked_sweep_inputs(grid, workers, progress, out)
    if address is not None and engine != "ray":  # the sweep module's own line says "--address needs --engine ray"
        raise ConfigError(f"address={address!r} is a Ray cluster's, but engine={engine!r}", field="address",
                          fix="add engine='ray', or leave address out")
    spec = sweep_module.load_spec(plain_spec(grid) if isinstance(grid, Mapping) else grid)
    in_kernel = notebook.in_notebook()
    if progress is None:
        from rich.console import Console
        progress = in_kernel or Console(stderr=True).is_terminal
    # in a notebook the plain progress lines (one every 10 s) piled up in the cell: there, one line updated
    console = SimpleNamespace(file=notebook.NotebookLine()) if progress and in_kernel else None
    scratch = notebook.scratch_out(spec) if out is None else None
    try:
        frame, summary = sweep_module.run_sweep(spec, out if scratch is None else scratch, workers=workers,
                                                engine=engine, address=address, progress=progress, console=console)
    except BaseException:  # a KeyboardInterrupt in a notebook, or an error: what finished waits for the rerun
        if console is not None:
            console.file.stopped()
        if scratch is not None:
            notebook.say_kept(scratch, len(spec.points()))
        raise
    if scratch is not None:
        scratch.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            scratch.parent.rmdir()
    warn_failed_points(frame)
    if summary.left_out:
        warn_at_caller("left out (a system 'all' brought in that cannot run on a trace):\n"
                       + "\n".join(f"  {line}" for line in summary.left_out), SweepSystemsLeftOut)
    return one_type_per_column(frame)


def one_type_per_column(frame: Any) -> Any:
    """``frame`` with each column that mixes kinds of values (``cache.slots_per_layer`` swept over ``2`` and
    ``"[2,1,...]"``) as strings, as the sweep's own results file holds it: ``frame.to_parquet`` refused such a
    column (ArrowInvalid), and a resumed sweep, read back from its file, gave strings where a fresh one gave
    both."""
    for name in frame.columns:
        if frame[name].dtype == object:
            kinds = {type(v) for v in frame[name] if not is_missing(v)}
            if len(kinds) > 1:
                frame[name] = [None if is_missing(v) else sweep_module.setting_str(v) for v in frame[name]]
    return frame


#: keys of a sweep spec whose value is a list of values (of runs, not of one value)
SPEC_AXES = ("trace", "traces", "hw", "system", "systems", "seed", "seeds")


def plain_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A dict spec as its YAML would read: the values of an axis, of a ``grid`` or ``zip`` key given as a tuple,
    a range, a numpy array or a Series become a list (each was taken as one value: '[16 32]' is not a valid int),
    numpy numbers Python ones (a numpy seed was refused as no integer)."""
    out = dict(spec)
    for key in SPEC_AXES:
        if key in out:
            out[key] = plain_values(out[key])
    if isinstance(out.get("set"), Mapping):  # one value each: a list or array there is per-layer slots
        out["set"] = {k: setting_list(plain_number(v)) for k, v in out["set"].items()}
    if isinstance(out.get("grid"), Mapping):
        out["grid"] = settings_values(out["grid"])
    zips = out.get("zip")
    if isinstance(zips, Mapping):
        out["zip"] = settings_values(zips)
    elif isinstance(zips, (list, tuple)):
        out["zip"] = [settings_values(g) if isinstance(g, Mapping) else g for g in zips]
    if isinstance(out.get("per_system"), Mapping):  # each system's own set: and grid:, read as the spec's
        out["per_system"] = {name: plain_spec(own) if isinstance(own, Mapping) else own
                             for name, own in out["per_system"].items()}
    return out


def settings_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A ``grid`` or ``zip`` mapping's lists of values; a value that is itself a list (per-layer slots, as
    :func:`replay` takes them) as the string ``--set`` reads (the spec refused it as no number or string)."""
    out: dict[str, Any] = {}
    for key, given in values.items():
        plain = plain_values(given)
        out[key] = [setting_list(v) for v in plain] if isinstance(plain, list) else plain
    return out


def setting_list(value: Any) -> Any:
    if getattr(value, "ndim", 0) > 0 or isinstance(value, (list, tuple)):
        return "[" + ",".join(str(plain_number(v)) for v in value) + "]"
    return value


def plain_values(value: Any) -> Any:
    if getattr(value, "ndim", 0) > 0:  # a numpy array or a Series
        return value.tolist()
    if isinstance(value, (tuple, range)):
        return [plain_number(v) for v in value]
    if isinstance(value, list):
        return [plain_number(v) for v in value]
    return plain_number(value)


def plain_number(value: Any) -> Any:
    """A numpy scalar as the Python number it holds; anything else as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


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


class SweepPointsFailed(UserWarning):
    """Some points of a sweep came back as errors (their rows have ``status == "error"``)."""


class SweepSystemsLeftOut(UserWarning):
    """Systems that ``systems: all`` brought in cannot run on some traces; their points there were left out."""


def warn_failed_points(frame: Any, shown: int = 5) -> str | None:
    """Warn (:class:`SweepPointsFailed`) with the reasons when rows of a sweep are errors; return the text."""
    if frame is None or "status" not in getattr(frame, "columns", ()) or frame.empty:
        return None
    failed = frame[frame["status"] != "ok"]
    if failed.empty:
        return None
    reasons = failed["error"].fillna("(no reason recorded)").astype(str).value_counts()
    lines = [f"{len(failed)} of {len(frame)} sweep points failed (rows with status 'error'); reasons:"]
    lines += [f"  {count} x {reason}" for reason, count in reasons.head(shown).items()]
    if len(reasons) > shown:
        lines.append(f"  ... and {len(reasons) - shown} more reasons (column 'error')")
    text = "\n".join(lines)
    warn_at_caller(text, SweepPointsFailed)
    return text


#: the traces shipped beside the package (``traces/`` of the checkout moesim is installed from)
TRACE_DIR = Path(__file__).resolve().parents[1] / "traces"


@notebook.callers_lines
@checked_keywords
def bundled_trace(name: str) -> Path:
    """The absolute path of a trace shipped in ``traces/`` (``"mixtral-8x7b-humaneval"``, ``.parquet``
    optional), so that a notebook or script finds it from whatever folder it runs in, as a profile name does."""
    from moesim.errors import did_you_mean
    shipped = sorted(p.stem for p in TRACE_DIR.glob("*.parquet"))
    stem = os.fspath(name).removesuffix(".parquet") if isinstance(name, (str, os.PathLike)) else None
    if stem not in shipped:
        raise ConfigError(f"no bundled trace named {name!r}", source=str(TRACE_DIR), field="name",
                          fix=f"{did_you_mean(str(name), shipped)}bundled: {', '.join(shipped) or 'none'}; "
                              "any other trace is given by its path")
    return TRACE_DIR / f"{stem}.parquet"


@python_names()
@checked_keywords
def slice_trace(trace: str | os.PathLike, out: str | os.PathLike, *, steps: int | None = None,
                requests: Sequence[int] | None = None) -> Path:
    """Write the first ``steps`` forward passes (and/or only ``requests``) of ``trace`` to ``out``.

    Quick experiments and notebooks on a piece of a long trace; the file keeps
    the trace's metadata and row order, so it is a valid trace.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from moesim.trace.io import parquet_options, read_meta, read_table
    from moesim.util import PARQUET, check_suffix, same_file, tmp_path_for
    check_suffix(Path(out), "out", PARQUET)
    if same_file(out, trace):
        raise ConfigError(f"would overwrite the trace it slices ({trace})", source=str(out), field="out",
                          fix="write the slice to another file")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1):
        raise ConfigError(f"steps must be a whole number of forward passes, 1 or more; got {steps!r}",
                          field="steps", fix="e.g. steps=40")
    if requests is not None:
        requests = checked_requests(requests)
    read_meta(trace)
    table = read_table(trace)
    mask = None
    if steps is not None:
        first = pc.min(table["step"]).as_py()
        mask = pc.less(table["step"], (first or 0) + int(steps))
    if requests is not None:
        chosen = pc.is_in(table["request"], value_set=_int_array(requests))
        mask = chosen if mask is None else pc.and_(mask, chosen)
    sliced = table.filter(mask) if mask is not None else table
    if sliced.num_rows == 0:
        raise ConfigError("the slice is empty", source=str(trace), field="steps" if steps is not None else "requests",
                          fix="ask for more steps or for requests the trace has")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(out)
    try:
        pq.write_table(sliced, tmp, **parquet_options(sliced.column_names))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


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


def _int_array(values: Sequence[int]) -> Any:
    import pyarrow as pa
    return pa.array([int(v) for v in values], type=pa.int32())


@dataclass
class ServeRun:
    """One serving run: per-request latencies, summary metrics (percentiles, goodput) and the engine's metrics."""

    requests: Any
    metrics: dict[str, Any]
    system: str
    traces: list[str]
    #: the arrival process and request count it ran (moesim.sim.workload.WorkloadConfig)
    workload: Any = None

    def _repr_html_(self) -> str:
        """The headline figures as a table, in the repr's terms: six significant digits, and a closed loop's or
        an arrival log's arrivals in place of its rate (``qps`` is nan there)."""
        from html import escape
        keys = ("qps", "offered_qps", "throughput_rps", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
                "e2e_ms_p99", "preemptions", "goodput_rps")
        rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in self._figures(keys))
        return f"<b>{escape(self.system)}</b> serving {len(self.requests)} requests<table>{rows}</table>"

    def _figures(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """(name, text) of the metrics ``keys`` names; with no rate, what set the arrivals comes first instead."""
        figures = [(k, f"{self.metrics[k]:.6g}") for k in keys if k in self.metrics]
        if self.workload is not None:
            from moesim.sim.workload import RATED_ARRIVALS
            if self.workload.arrival not in RATED_ARRIVALS:  # qps is nan: say what set the arrivals instead
                from moesim.analysis.serving import arrivals_text
                figures = [("arrivals", arrivals_text(self.workload))] + \
                    [(k, v) for k, v in figures if k not in ("qps", "offered_qps")]
        return figures

    @notebook.callers_lines
    @checked_keywords
    def plot_requests(self, path: str | os.PathLike | None = None, title: str | None = None) -> Any:
        """Each request as a row in order of arrival: queued, prefill to first token, decode; preempted ones
        marked. Displays as a PNG in Jupyter."""
        from moesim.analysis.serving import arrivals_text, plot_requests
        label = f"{self.system}: {len(self.requests)} requests" + \
            (f" {arrivals_text(self.workload)}" if self.workload is not None else "") if title is None else title
        return plot_requests(self.requests, path, title=label)

    def __repr__(self) -> str:
        """One line: what ran, what set its arrivals (an open loop's ``qps``; a closed loop's clients or an
        arrival log, which have no rate), its headline figures."""
        figures = [f"{k}={v!r}" if k == "arrivals" else f"{k}={v}" for k, v in self._figures(SERVE_REPR_METRICS)]
        return f"ServeRun(system={self.system!r}, requests={len(self.requests)}, {', '.join(figures)})"


def _trace_paths(traces: Any) -> list[str]:
    """``traces`` as a list of paths: one path, or a sequence of one or more; one line otherwise (an empty list
    reached the first trace's index)."""
    if isinstance(traces, (str, os.PathLike)):
        return [os.fspath(traces)]
    if not isinstance(traces, Sequence) or not all(isinstance(t, (str, os.PathLike)) for t in traces):
        raise ConfigError(f"traces must be a trace path or a list of them, got {traces!r}", field="traces",
                          fix="e.g. moesim.serve('traces/mixtral-8x7b-humaneval.parquet', ...)")
    if not traces:
        raise ConfigError("no trace given", field="traces",
                          fix="give a trace path, or a list of one or more (e.g. ['traces/mixtral-8x7b-humaneval."
                              "parquet'])")
    return [os.fspath(t) for t in traces]


@python_names()
@checked_keywords
def serve(traces: str | os.PathLike | Sequence[str | os.PathLike], hw: str = DEFAULT_HW,
          system: str = "gpu-only-lru", *, qps: float | None = None, requests: int | None = None,
          scheduler: str | None = None, slo: Mapping[str, float] | str | None = None,
          settings: Mapping[str, Any] | None = None, seed: int = 0, **params: Any) -> ServeRun:
    """Serve requests drawn from ``traces`` under ``system``: arrivals, a batching scheduler, per-request metrics.

    ``qps``, ``requests`` and ``scheduler`` are shorthands for ``workload__qps``,
    ``workload__requests`` and ``scheduler``; every ``workload.*``,
    ``scheduler.*`` and replay parameter is accepted as in :func:`replay`.
    ``slo``: ``{"ttft_ms": 500, "tpot_ms": 100}`` or ``"ttft_ms=500,tpot_ms=100"`` for goodput.
    """
    from moesim.analysis.serving import parse_slo, request_frame, serving_metrics
    from moesim.sim.serving import serve as run_serving
    from moesim.sim.workload import check_read
    paths = _trace_paths(traces)
    checked_settings(settings)
    short = {k: v for k, v in (("workload.qps", qps), ("workload.requests", requests), ("scheduler", scheduler))
             if v is not None}
    for key in (settings or {}):  # the settings' value won over the shorthand's without a word
        dotted = sweep_module.normalize_key(key)
        if dotted in short:
            name = dotted.removeprefix("workload.")
            raise ConfigError(f"{name}= and the setting '{key}' both set it", field=name,
                              fix=f"give one of them (e.g. {name}={short[dotted]!r} alone)")
    merged = settings_from({**short, **(settings or {})}, **params)
    slos = parse_slo(slo)  # the --slo check: a bad key or limit fails here, before any run
    checked_run_inputs(hw, seed, system)
    try:
        with keyword_fields(params):
            # workload__cv=4 with Poisson arrivals would change nothing; named as the caller gave it
            spelled = {**{key.replace("__", "."): key for key in params},
                       **{key: key.removeprefix("workload.") for key in short if key not in (settings or {})}}
            check_read(merged, list(merged), spelled)
            result = run_serving(paths, hw, system, merged, seed=int(seed))
    except MoesimError as err:  # a value given as a shorthand: its error under that keyword
        if err.field in short and err.field not in (settings or {}):
            err.rename_field(err.field.removeprefix("workload."))
        raise
    return ServeRun(requests=request_frame(result), metrics=serving_metrics(result, slos), system=system,
                    traces=paths, workload=result.workload)
