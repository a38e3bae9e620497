"""The Python API, for Jupyter and scripts: ``moesim.replay``, ``moesim.serve``, ``moesim.sweep`` and
``moesim.systems``.

Parameters are the ``--set`` keys of the command line. Give them as keyword
arguments with ``__`` for ``.`` or as a ``settings`` dict; both may be mixed::

    import moesim
    r = moesim.replay("traces/mixtral-8x7b-humaneval.parquet", hw="a100-40g", system="gpu-only-lru",
                      cache__slots_per_layer=2, hw__pcie__bandwidth_scale=0.5)
    r = moesim.replay(trace, system="gpu-only-lru", settings={"cache.slots_per_layer": 2, "cache": "belady"})
    moesim.systems("gpu-only-lru")   # the parameters it takes: key, default, type, unit, meaning
    r.metrics            # one-row DataFrame, the keys of `moesim replay --json` as columns (the nested
                         # lower_bound as lower_bound_makespan_s, ...; gap_to_lower_bound as it is)
    r.timeline           # one row per interval a resource was busy (TIMELINE_COLUMNS)
    r.decisions          # the decision log (DECISION_COLUMNS)
    r.steps              # one row per forward pass: phase, start, latency, tokens, and its decisions counted
    r.save("runs/lru")   # a folder of Parquet files and result.json; moesim.load_replay("runs/lru") reads it
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

The arguments' defaults and checks are in :mod:`moesim.api_args`; a dict sweep
spec's values are made plain in :mod:`moesim.api_spec`.
"""

from __future__ import annotations

import contextlib
import filecmp
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from moesim import notebook
from moesim import sweep as sweep_module
from moesim.errors import ConfigError, MoesimError
from moesim.analysis.runs import ReplayResult, load_replay, step_frame  # noqa: F401 - moesim.api's names
from moesim.api_args import (DEFAULT_HW, DEFAULT_SYSTEM, SPEC_SETTINGS, checked_flags, checked_keywords,
                             checked_rate, checked_requests, checked_run_inputs, checked_settings, checked_sweep_inputs,
                             checked_trace, existing_trace, keyword_fields, kept, profile_label, python_names,
                             python_wording, settings_from)
from moesim.api_spec import one_type_per_column, plain_spec
from moesim.util import warn_at_caller

#: the figures a serving run's one-line repr shows
SERVE_REPR_METRICS = ("qps", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "throughput_rps")


#: ``moesim.load_replay``, its keywords checked as this module's own functions' are (named as this module's, where
#: pickle finds it)
load_replay = checked_keywords(load_replay)
load_replay.__module__ = __name__


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
    from moesim.analysis.sweep_results import hw_named
    from moesim.sim.run import add_lower_bound, simulate
    trace = checked_trace(trace)
    checked_flags(**{k: v for k, v in (("timeline", timeline), ("decisions", decisions)) if v is not None})
    checked_run_inputs(hw, seed, system, model)
    given = settings_from(settings, **params)
    timeline, decisions = (kept(name, flag, given) for name, flag in (("timeline", timeline),
                                                                      ("decisions", decisions)))
    with keyword_fields(params, settings):
        result = simulate(trace, hw, system, given, model_preset=model, seed=int(seed), timeline=timeline,
                          decisions=decisions)
    raw = add_lower_bound(metrics(result), result, trace, hw, system, given)
    frames = result_to_frames(result)
    # a metric with no value (all-in-gpu's lower_bound_slots: memory not enforced) as NaN: None made the column
    # object-typed, and so the column of every table concatenated from several systems' metrics
    flat = {key: math.nan if value is None else value for key, value in sweep_module.flatten_metrics(raw).items()}
    row = {"trace": trace, "hw": profile_label(hw), "system": system, "seed": int(seed), **flat}
    return ReplayResult(metrics=pd.DataFrame([row]), timeline=frames["timeline"], decisions=frames["decisions"],
                        system=system, trace=str(trace), raw_metrics=raw,
                        steps=step_frame(result.steps, frames["decisions"]),
                        hw=hw_named(Path(profile_label(hw)).name, given, path=hw), settings=dict(given))


@python_names(spec=True)
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
    if isinstance(grid, Mapping):
        grid = plain_spec(grid)
        checked_spec_traces(grid)
    spec = sweep_module.load_spec(grid)
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


def checked_spec_traces(spec: Mapping[str, Any]) -> None:
    """A dict spec's traces that are not there, as :func:`replay` says it: where they were looked for, from the
    working folder (the spec's own line told to give a path relative to the spec file's folder, which a dict
    has none of), and :func:`bundled_trace` for a bundled trace's name."""
    for key in ("traces", "trace"):
        given = spec.get(key)
        for trace in [given] if isinstance(given, (str, os.PathLike)) else given if isinstance(given, list) else []:
            if isinstance(trace, (str, os.PathLike)):
                existing_trace(trace, field=key)


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
    # a point's reason as a Python caller would read it (its row keeps the words it was recorded with)
    lines += [f"  {count} x {python_wording(reason, settings=SPEC_SETTINGS)}"
              for reason, count in reasons.head(shown).items()]
    if len(reasons) > shown:
        more = len(reasons) - shown
        lines.append(f"  ... and {more} more reason{'s' if more > 1 else ''} (column 'error')")
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
def systems(name: str | None = None) -> Any:
    """The systems ``system=`` takes, or one system's parameters, as a DataFrame (what ``moesim systems`` and
    ``moesim systems NAME`` list).

    Without ``name``: one row per system (``name``, ``description``, ``listed``: whether ``system="all"`` on the
    command line runs it, ``runtime``, ``portfolio`` and the component of each role). With ``name``: one row
    per parameter ``settings=`` takes for it (``key``, ``default`` as a value of its ``type``, ``unit``,
    ``meaning``); ``.attrs["components"]`` holds the component in each role and what swaps in.
    """
    import pandas as pd

    from moesim.analysis.params import system_record, system_records
    if name is None:
        return pd.DataFrame(system_records())
    record = system_record(name, field="name")
    frame = pd.DataFrame(record["parameters"])
    frame.attrs.update(name=name, description=record["description"], components=record["components"])
    return frame


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
    read_meta(existing_trace(trace))
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
        # the same slice written again (a notebook run from the top) leaves the file as it was: a new
        # modification time made a resumable sweep over it run every finished point again
        if not (out.is_file() and filecmp.cmp(tmp, out, shallow=False)):
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _int_array(values: Sequence[int]) -> Any:
    import pyarrow as pa
    return pa.array([int(v) for v in values], type=pa.int32())


@dataclass
class ServeRun:
    """One serving run: per-request latencies, summary metrics (percentiles, goodput) and the engine's metrics."""

    requests: Any
    #: percentiles, throughput, goodput and the engine's metrics: a dict whose keys are also attributes
    #: (``run.metrics.ttft_ms_p90``), ``run.metrics.frame()`` a one-row DataFrame
    #: (:class:`moesim.analysis.serving.ServingMetrics`)
    metrics: dict[str, Any]
    system: str
    traces: list[str]
    #: the arrival process and request count it ran (moesim.sim.workload.WorkloadConfig)
    workload: Any = None
    #: the profile as titles name it, with its GPU and host CPU (moesim.hw.title); '' when not known
    hw: str = ""

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
        on = f"{self.system} on {self.hw}" if self.hw else self.system
        label = f"{on}: {len(self.requests)} requests" + \
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
        return [existing_trace(traces, field="traces")]
    if not isinstance(traces, Sequence) or not all(isinstance(t, (str, os.PathLike)) for t in traces):
        raise ConfigError(f"traces must be a trace path or a list of them, got {traces!r}", field="traces",
                          fix="e.g. moesim.serve('traces/mixtral-8x7b-humaneval.parquet', ...)")
    if not traces:
        raise ConfigError("no trace given", field="traces",
                          fix="give a trace path, or a list of one or more (e.g. ['traces/mixtral-8x7b-humaneval."
                              "parquet'])")
    return [existing_trace(t, field="traces") for t in traces]


@python_names(serving=True)
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
    from moesim.analysis.sweep_results import hw_named
    from moesim.sim.serving import serve as run_serving
    from moesim.sim.workload import check_read
    paths = _trace_paths(traces)
    checked_settings(settings)
    checked_rate(qps)
    short = {name: (key, value) for name, key, value in (("qps", "workload.qps", qps),
                                                          ("requests", "workload.requests", requests),
                                                          ("scheduler", "scheduler", scheduler)) if value is not None}
    merged = settings_from(settings, short, **params)
    slos = parse_slo(slo)  # the --slo check: a bad key or limit fails here, before any run
    checked_run_inputs(hw, seed, system, serving=True)
    try:
        with keyword_fields(params, settings):
            # workload__cv=4 with Poisson arrivals would change nothing; named as the caller gave it
            spelled = {**{key.replace("__", "."): key for key in params},
                       **{key: name for name, (key, _) in short.items()}}
            check_read(merged, list(merged), spelled)
            result = run_serving(paths, hw, system, merged, seed=int(seed))
    except MoesimError as err:  # a value given as a shorthand: its error under that keyword
        name = next((name for name, (key, _) in short.items() if key == err.field), None)
        if name is not None:
            err.rename_field(name)
        raise
    return ServeRun(requests=request_frame(result), metrics=serving_metrics(result, slos), system=system,
                    traces=paths, workload=result.workload,
                    hw=hw_named(Path(profile_label(hw)).name, merged, path=hw))
