"""A sweep's results as the figures read them: the file, its parameter and metric columns, the finished
points, their labels and how their values group into lines and panels.

The input is the tidy frame of :mod:`moesim.sweep` (one row per point; the
parameters ``trace``, ``hw``, ``system``, ``seed`` and the ``--set`` keys;
the metrics of :func:`moesim.analysis.metrics.metrics`, with each replayed
point's physical lower bound as ``lower_bound_<key>`` and ``gap_to_lower_bound``,
NaN in serving points). Only points with ``status == "ok"`` are drawn.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from moesim.errors import ConfigError, did_you_mean
from moesim.policy.systems import ROLES

BASE_PARAMETERS = ("trace", "hw", "system", "seed", "model")
#: ``--set`` keys without a dot: the serving scheduler and component swaps (``cache=belady``); not ``runtime``,
#: whose column is the metric naming the runtime each point ran on (its system's own unless set)
UNDOTTED_SETTINGS = ("scheduler", *ROLES)

LABELS = {
    "tpot_ms_mean": "TPOT, mean (ms)", "tpot_ms_p50": "TPOT, p50 (ms)", "tpot_ms_p99": "TPOT, p99 (ms)",
    "ttft_ms": "TTFT (ms)", "decode_tokens_per_s": "decode throughput (tokens/s)",
    "prefill_tokens_per_s": "prefill throughput (tokens/s)", "gpu_hit_rate": "GPU hit rate",
    "cache.slots_per_layer": "GPU cache slots per layer", "cache.slots": "GPU cache slots, all layers", "slots_per_layer": "GPU cache slots per layer",
    "pcie_h2d_bytes": "PCIe host-to-device bytes", "prefetches": "prefetches issued",
    "makespan_s": "makespan (s)", "hw.pcie.bandwidth_scale": "PCIe bandwidth scale",
    "gpu_memory_gib": "GPU memory planned (GiB)", "expert_cache_gib": "GPU expert cache (GiB)",
    "gap_to_lower_bound": "makespan over its lower bound", "lower_bound_makespan_s": "makespan lower bound (s)",
    "lower_bound_ttft_ms": "TTFT lower bound (ms)", "lower_bound_tpot_ms_mean": "TPOT lower bound, mean (ms)",
    "lower_bound_slots": "experts held by the lower bound",
    # the rest of `moesim replay --help-metrics` (units as it gives them)
    "decode_tokens": "decode tokens", "prefill_tokens": "prefill tokens", "late_prefetches": "late prefetches",
    "cancelled_prefetches": "prefetches cancelled", "prefetch_precision": "prefetch precision",
    "demand_loads": "demand loads (experts)", "streamed_experts": "experts streamed",
    "evictions": "evictions (experts)", "cpu_util": "CPU utilisation", "gpu_util": "GPU utilisation",
    "pcie_util": "PCIe utilisation", "gpu_share_of_activations": "share of expert activations on the GPU",
    "substituted_experts": "experts substituted", "deferred_experts": "experts deferred",
    "substituted_weight_mass": "gate weight substituted per activation",
    "deferred_weight_mass": "gate weight deferred per activation", "expert_slots": "GPU expert slots",
    "sim_wall_s": "simulation wall-clock time (s)",
    # serving runs (docs/serving.md, moesim.analysis.serving): the swept workload and what each run measured
    "workload.qps": "arrival rate (requests/s)", "qps": "arrival rate (requests/s)",
    "workload.requests": "requests per run", "requests": "requests per run",
    "workload.kv_tokens": "KV cache budget (tokens)", "kv_tokens": "KV cache budget (tokens)",
    "kv_peak_tokens": "KV cache peak (tokens)", "kv_tokens_per_slot": "KV tokens per expert slot",
    "scheduler.kv_block_tokens": "KV block size (tokens)", "kv_block_tokens": "KV block size (tokens)",
    "kv_blocks": "KV cache budget (blocks)", "kv_peak_blocks": "KV cache peak (blocks)",
    "scheduler.kv_watermark": "KV admission watermark (share of blocks)",
    "scheduler.kv_allocation": "KV allocation (prompt or chunk)",
    "kv_watermark_blocks": "KV blocks kept free at admission",
    "offered_qps": "offered load (requests/s)", "throughput_rps": "throughput (requests/s)",
    "output_tokens_per_s": "output throughput (tokens/s)", "goodput_rps": "goodput (requests/s)",
    "slo_attainment": "share of requests within the SLOs", "preemptions": "preemptions",
    "recomputed_tokens": "tokens prefilled again",
}
#: the per-request latencies of a serving run (``ttft_ms_p99``: their 99th percentile over its requests)
SERVING_LATENCIES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "end-to-end latency", "queue": "queueing delay"}
#: parameters that set a metric on the x axis: drawn against ``slots_per_layer``, runs at two ``cache.slots``
#: are two points of the x axis, not averaged (systems without a cache sit at 0 whatever they asked)
X_SETTINGS = {metric: ("cache.slots", "cache.slots_per_layer")
              for metric in ("slots_per_layer", "expert_slots", "expert_cache_gib")}
_REPLAY_HIGHER = {"decode_tokens_per_s", "prefill_tokens_per_s", "gpu_hit_rate", "prefetch_precision",
                  "gpu_share_of_activations"}
#: metrics where more is better (a Pareto front maximises them; every other metric is minimised): the replay's,
#: the serving rates and SLO share, and a serving run's engine metrics (engine_ and the replay's name)
HIGHER_IS_BETTER = _REPLAY_HIGHER | {"throughput_rps", "goodput_rps", "output_tokens_per_s", "slo_attainment"} \
    | {f"engine_{name}" for name in _REPLAY_HIGHER}


# ----------------------------------------------------------------------------- loading and columns
def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """A sweep's results file as a DataFrame, or one line saying why not."""
    path = Path(path)
    if not path.is_file():
        _check_unmerged(path)
        raise ConfigError("results file not found", source=str(path), fix="give the --out file of `moesim sweep`")
    try:
        frame = pd.read_parquet(path)
    except Exception:  # noqa: BLE001 - any unreadable file gets the same answer, by what the bytes show
        raise ConfigError(unreadable_parquet(path), source=str(path), fix="give the --out file of `moesim sweep` "
                          "(a damaged one: run the sweep again into a new file)") from None
    if "point_id" not in frame.columns or "status" not in frame.columns:
        raise ConfigError("not a sweep result (no 'point_id'/'status' columns)", source=str(path),
                          fix="give the --out file of `moesim sweep`")
    if frame.empty:  # not "every point failed": there are none
        raise ConfigError("the results file holds no points", source=str(path),
                          fix="run `moesim sweep SPEC.yaml --out` into it first")
    return with_metric_columns(frame)


def with_metric_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the metric columns of a kind of point (replayed, serving:
    :func:`moesim.sweep.point.columns_of_kinds`) none of whose points ran, those it lacks added empty (NaN),
    where a sweep writes them. A sweep whose every point failed has them since 0c38e6f; a file an older moesim
    wrote for one has none, and ``frame["tpot_ms_mean"]`` raised KeyError on it alone. Where points of a kind
    ran, the file's columns are what they measured and stay as they are. A row is a serving point's when it
    sets a ``workload.*`` or ``scheduler`` parameter (or holds a serving run's ``scheduler``)."""
    from moesim.sim.workload import is_serving_key
    from moesim.sweep.engines import INPUT_COLUMNS, LOCATION_COLUMNS, WALL_CLOCK_COLUMNS
    from moesim.sweep.point import columns_of_kinds
    keys = [c for c in frame.columns if is_serving_key(str(c))]
    serving = frame[keys].notna().any(axis=1) if keys else pd.Series(False, index=frame.index)
    failed = frame["status"] != "ok"
    wanted = columns_of_kinds(replayed=bool((~serving).any() and failed[~serving].all()),
                              serving=bool(serving.any() and failed[serving].all()))
    missing = [c for c in wanted if c not in frame.columns]
    if not missing:
        return frame
    last = WALL_CLOCK_COLUMNS + LOCATION_COLUMNS + INPUT_COLUMNS  # a sweep writes these last, in this order
    empty = pd.DataFrame(np.nan, index=frame.index, columns=missing)
    frame = pd.concat([frame, empty], axis=1)
    head = [c for c in frame.columns if c not in last]
    return frame[head + [c for c in last if c in frame.columns]]


def _check_unmerged(path: Path) -> None:
    """A sweep stopped (killed) before it first wrote ``path`` keeps its finished points in ``path.parts/``:
    say so, rather than "not found" as if no sweep had run."""
    from moesim.sweep.store import PARTS_SUFFIX
    parts = path.with_name(path.name + PARTS_SUFFIX)
    done = len(list(parts.glob("*.parquet"))) if parts.is_dir() else 0
    if done:
        raise ConfigError(f"not written yet: the sweep stopped before merging its {done} finished point(s), "
                          f"kept in {parts}/", source=str(path),
                          fix="run the same `moesim sweep SPEC.yaml --out` command again: it resumes and writes it")


#: the four bytes a Parquet file starts and ends with
PARQUET_MAGIC = b"PAR1"


def unreadable_parquet(path: Path) -> str:
    """Why Parquet could not read ``path``: empty, cut short (its footer, written last, missing) or no Parquet."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty"
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if head != PARQUET_MAGIC:
        return "not a Parquet file"
    if tail != PARQUET_MAGIC:
        return "a Parquet file cut short (its footer is missing)"
    return "a damaged Parquet file"


def parameter_columns(frame: pd.DataFrame) -> list[str]:
    """The parameter columns: trace, hw, system, seed, model, every dotted ``--set`` key and the undotted ones
    (``scheduler``, a component swap). A sweep over ``scheduler`` was averaged by the figures
    without a word, and the report listed its points twice with nothing telling them apart."""
    return [c for c in (*BASE_PARAMETERS, *UNDOTTED_SETTINGS) if c in frame.columns] + \
        [c for c in frame.columns if "." in c]


def varying(frame: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    return [c for c in columns if c in frame.columns and frame[c].nunique(dropna=False) > 1]


#: other words for a base parameter, suggested when a column of that name is asked for (too far apart to spell alike)
COLUMN_WORDS = {"hardware": "hw", "profile": "hw", "gpu": "hw", "policy": "system", "systems": "system",
                "traces": "trace", "seeds": "seed"}


def column(frame: pd.DataFrame, name: str, role: str, source: str | None = None) -> str:
    """``name`` (or its ``__`` spelling) if ``frame`` has it, else one line listing what it has."""
    if not isinstance(name, str):  # a list of metrics failed as "'list' object has no attribute 'replace'"
        raise ConfigError(f"{role} must be one column's name, got {name!r}", source=source, field=role,
                          fix="one figure per column: call the function once for each (e.g. y='tpot_ms_mean')")
    for candidate in (name, name.replace("__", ".")):
        if candidate in frame.columns:
            return candidate
    params = parameter_columns(frame)
    metrics = [c for c in frame.columns if c not in params and frame[c].dtype.kind in "biuf"]
    word = COLUMN_WORDS.get(name.lower())
    hint = f"did you mean '{word}'? " if word in params else did_you_mean(name, params + metrics)
    raise ConfigError(f"no column '{name}'", source=source, field=role,
                      fix=f"{hint}parameters: {', '.join(params)}; metrics: {', '.join(metrics)}")


class UnevenMeans(UserWarning):
    """Points of a figure average fewer runs than others (runs that failed or were not run, or an x value
    that several settings share): their means are over other values of the averaged parameters, so they do
    not compare with the rest."""


def fewer_runs(runs: pd.Series | None, full: pd.Series | None = None) -> str:
    """What to say of ``runs`` (runs averaged per point) when some points have fewer than ``full`` (per point:
    the runs over every averaged value; default: the most of any point); ''."""
    if runs is None or runs.empty:
        return ""
    full = pd.Series(runs.max(), index=runs.index) if full is None else full
    short = runs[runs < full]
    if short.empty:
        return ""
    few, most = _span(short), _span(full[short.index])
    runs_word = "run" if few == "1" else "runs"
    return (f"{len(short)} of {len(runs)} points average {few} {runs_word} instead of {most} (runs failed or not "
            "run, or an x value that several settings share)")


def _span(values: pd.Series) -> str:
    low, high = int(values.min()), int(values.max())
    return f"{low}" if low == high else f"{low} to {high}"


def failed_points(frame: pd.DataFrame) -> int:
    """Rows of ``frame`` whose status is not 'ok' (points a figure leaves out)."""
    return int((frame["status"] != "ok").sum()) if "status" in frame.columns else 0


def failed_note(frame: pd.DataFrame) -> str:
    """What a figure says of the points it leaves out because they failed (their status is not 'ok'); ''."""
    failed = failed_points(frame)
    return f"{failed} of {len(frame)} points failed, not drawn (their 'error' column says why)" if failed else ""


def ok_rows(frame: pd.DataFrame, source: str | None = None) -> pd.DataFrame:
    ok = frame[frame["status"] == "ok"] if "status" in frame.columns else frame
    if ok.empty:
        raise ConfigError("no finished points to draw (every point failed)", source=source, field="status",
                          fix="see the 'error' column of the results")
    return ok


def headline_metric(frame: pd.DataFrame) -> str:
    """The latency the standard figures and the report's table compare: mean TPOT, or TTFT where no run
    decoded a token (a prefill-only trace leaves TPOT undefined in every row)."""
    for name in ("tpot_ms_mean", "ttft_ms"):
        if name in frame.columns and frame[name].dtype.kind in "biuf" and \
                np.isfinite(frame[name].astype(float)).any():
            return name
    return "tpot_ms_mean"


def label(name: str) -> str:
    """A column's name for an axis or title, with its unit: "TTFT, p99 (ms)" for ``ttft_ms_p99``, "arrival
    rate (requests/s)" for ``workload.qps``; a serving run's engine metric as its replay namesake (``engine_``
    left off); a column no table knows by its name (with its unit where ``moesim replay --help-metrics`` gives
    one)."""
    import re
    if name in LABELS:
        return LABELS[name]
    latency = re.fullmatch(r"(ttft|tpot|e2e|queue)_ms_(p\d+|mean)", name)
    if latency:
        return f"{SERVING_LATENCIES[latency.group(1)]}, {latency.group(2)} (ms)"
    part = re.fullmatch(r"breakdown_(\w+)_ms", name)
    if part:
        return f"time in {part.group(1).replace('_', ' ')} (ms)"
    if name.startswith("engine_") and label(name[len("engine_"):]) != name[len("engine_"):]:
        return label(name[len("engine_"):])
    from moesim.analysis.metrics import METRIC_DOCS
    doc = METRIC_DOCS.get(name)
    return f"{name} ({doc.unit})" if doc and doc.unit and doc.unit not in ("fraction", "ratio") else name


def bound_kind(system: str) -> str:
    """"bound", "reference" or "" (a deployable system), told by the system's spec, not its words: a
    portfolio of schedules (``SystemSpec.portfolio``, the oracle) is a bound within the memory budget; a
    system that ignores GPU memory (``SystemSpec.ignores_memory``, all-in-gpu) a reference, not a bound
    (schedules within the budget may beat it). A description saying "bound" ("prefetch bound to the next
    layer") made a user's own system one, left out of the fastest."""
    from moesim.policy.systems import SYSTEMS
    spec = SYSTEMS.get(system)
    if spec is None:
        return ""
    return "bound" if spec.portfolio else "reference" if spec.ignores_memory else ""


def is_bound(system: str) -> bool:
    """Bounds and references (oracle, all-in-GPU) are drawn dashed and ranked with no system: they are not
    deployable systems (:func:`bound_kind`)."""
    return bool(bound_kind(system))


def system_label(system: str) -> str:
    """A system's name as tables and legends show it: "oracle (bound)", "all-in-gpu (reference)", "smoe"."""
    kind = bound_kind(str(system))
    return f"{system} ({kind})" if kind else str(system)


def hue_names(data: pd.DataFrame, hue: str | None, hues: Sequence[Any]) -> list[str]:
    """Legend entries of ``hues``: systems as :func:`system_label` gives them, "(substitutes)" after one whose
    runs in ``data`` replaced routed experts (:func:`substituting`); other values as they are."""
    if hue != "system":
        return [str(h) for h in hues]
    subs = substituting(data)
    replaced = set(data.loc[subs, "system"].astype(str)) if subs.any() else set()
    return [system_label(h) + (" (substitutes)" if str(h) in replaced else "") for h in hues]


#: what the report's tables put after a system that substitutes routed experts (its footnote says how many)
SUBSTITUTES_MARK = "\u2020"


def substituting(frame: pd.DataFrame) -> pd.Series:
    """Per row, whether its run replaced routed experts by others (buddymoe, importance): its time is not that
    of the model as routed. By the ``substituted_experts`` metric where the results hold it (a substituting
    system that replaced none computed every routed expert); else by the system's spec and a ``substitute``
    swap of the row."""
    from moesim.policy.systems import SYSTEMS
    if "substituted_experts" in frame.columns:
        return pd.to_numeric(frame["substituted_experts"], errors="coerce").fillna(0).gt(0)
    swapped = frame["substitute"] if "substitute" in frame.columns else pd.Series(None, index=frame.index)
    out = []
    for system, swap in zip(frame["system"], swapped):
        name = swap if isinstance(swap, str) and swap else getattr(SYSTEMS.get(str(system)), "substitute", "none")
        out.append(name != "none")
    return pd.Series(out, index=frame.index, dtype=bool)


def routed_activations(frame: pd.DataFrame) -> pd.Series:
    """Per row, the routed (token, expert) activations of its run: the ``activations`` column where the results
    hold one, else its tokens (prefill and decode) times the MoE layers and top-k of its trace's model, read
    from the trace file where it is here; NaN where neither is known."""
    nan = pd.Series(np.nan, index=frame.index, dtype=float)
    if "activations" in frame.columns:
        return pd.to_numeric(frame["activations"], errors="coerce").astype(float)
    if not {"prefill_tokens", "decode_tokens"} <= set(frame.columns):
        return nan
    tokens = pd.to_numeric(frame["prefill_tokens"], errors="coerce").fillna(0) + \
        pd.to_numeric(frame["decode_tokens"], errors="coerce").fillna(0)
    paths = frame["trace_path"] if "trace_path" in frame.columns else \
        frame["trace"] if "trace" in frame.columns else None
    if paths is None:
        return nan
    per_token = {path: _routed_per_token(path) for path in paths.dropna().unique()}
    return tokens * paths.map(per_token).astype(float)


def _routed_per_token(path: Any) -> float:
    """MoE layers times top-k of the model a trace was recorded with; NaN when the file is not here."""
    from moesim.trace.io import read_meta
    try:
        model = read_meta(str(path)).model
    except Exception:  # noqa: BLE001 - moved, deleted or unreadable: the share is then unknown, not an error
        return float("nan")
    return float(model.num_layers * model.top_k)


def substitution_note(frame: pd.DataFrame, mark: str = SUBSTITUTES_MARK) -> str:
    """What ``mark`` means under a table of ``frame``'s rows, with each substituting system's share of routed
    experts substituted (``substituted_experts`` over the routed activations) over those rows; ''."""
    subs = substituting(frame)
    if "system" not in frame.columns or not subs.any():
        return ""
    rows = frame[subs]
    share = pd.to_numeric(rows.get("substituted_experts"), errors="coerce") / routed_activations(rows) \
        if "substituted_experts" in rows.columns else pd.Series(np.nan, index=rows.index)
    parts = []
    for system in ordered_systems(rows["system"].unique()):
        mine = share[rows["system"] == system].dropna()
        count = rows.loc[rows["system"] == system].get("substituted_experts")
        if len(mine):
            low, high = mine.min(), mine.max()
            span = f" ({low:.1%} to {high:.1%} over its points)" if high - low >= 0.0005 else ""
            parts.append(f"{system} {mine.mean():.1%}{span}")
        elif count is not None and count.notna().any():
            parts.append(f"{system} {count.mean():,.0f} experts a run on average (the share needs the trace "
                         "file, not found here)")
        else:
            parts.append(f"{system} (the results do not say how many)")
    return (f"{mark} substitutes routed experts by others: it does not compute every expert the trace routes, so "
            "its time is not that of the model as routed; ranked all the same. Share of routed experts "
            "substituted (substituted_experts over routed activations): " + "; ".join(parts) + ".")


def ordered_systems(values: Sequence[Any]) -> list[Any]:
    """Systems in registry order (as `moesim systems` lists them), bounds last, unknown names at the end."""
    from moesim.policy.systems import SYSTEMS
    rank = {name: i for i, name in enumerate(SYSTEMS)}
    return sorted(values, key=lambda s: (is_bound(str(s)), rank.get(str(s), len(rank)), str(s)))


def sorted_values(series: pd.Series) -> list[Any]:
    values = list(series.dropna().unique())
    try:
        return sorted(values)
    except TypeError:  # numbers, then words (a parameter's values and its NOT_SET)
        return sorted(values, key=lambda v: (isinstance(v, str), v if isinstance(v, str) else float(v)))


#: the hue or panel of runs whose row holds no value of a parameter: their system has no such parameter, or
#: (results written before a sweep recorded the values points ran with) their sweep left it at its default
NOT_SET = "not set"


def as_groups(data: pd.DataFrame, columns: Sequence[str | None]) -> pd.DataFrame:
    """``data`` with each of ``columns`` (hue, facet) fit to name lines and panels: whole numbers stored as
    floats (a parameter some rows lack reads back as float) shown as whole numbers, and a missing value as
    :data:`NOT_SET` (such rows were dropped unseen)."""
    out = data
    for name in filter(None, columns):
        values = data[name]
        whole = values.dtype.kind == "f" and bool(np.all(np.mod(values.dropna(), 1) == 0))
        if not whole and not values.isna().any():
            continue
        if out is data:
            out = data.copy()
        out[name] = pd.Series([NOT_SET if pd.isna(v) else int(v) if whole else v for v in values],
                              index=values.index, dtype=object)
    return out


#: no metric of a run comes near this magnitude; beyond it matplotlib's axis margins overflow
DRAWABLE = 1e300


def check_drawable(data: pd.DataFrame, columns: Sequence[tuple[str, str]], source: str | None) -> None:
    """One line for a numeric axis column (name, argument) holding a value too large to draw (an internal
    error in matplotlib's tick placement before)."""
    for name, role in columns:
        if data[name].dtype.kind not in "biuf":
            continue
        values = data[name].to_numpy(dtype=float)
        huge = values[np.abs(values) > DRAWABLE]
        if huge.size:
            raise ConfigError(f"column '{name}' holds {huge[0]:g}, too large to draw", source=source, field=role,
                              fix="check how the results file was written: no run's metric comes near it")


# ----------------------------------------------------------------------------- the profile in titles
def hw_parts_for(hw: Any, settings: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The GPU and host CPU of profile ``hw`` (a name, a path or a HardwareProfile) as a run with ``settings``
    saw them (its ``hw.*`` settings applied: ``hw.cpu.cores=16`` is 16 cores); None where the profile cannot be
    read."""
    from moesim.errors import MoesimError
    from moesim.hw.profile import load_profile
    from moesim.hw.title import profile_parts
    from moesim.sim.run import parse_settings
    hw_settings = {k: setting_text(v) for k, v in (settings or {}).items() if str(k).startswith("hw.")}
    try:
        # a profile object as the API takes it: its str() is its repr, which names no file
        profile = hw if hasattr(hw, "gpu") else load_profile(str(hw))
        return profile_parts(profile.with_overrides(parse_settings(hw_settings).hw))
    except (MoesimError, OSError):
        return None


def hw_named(hw: str, settings: dict[str, Any] | None = None, *, path: Any = None,
             parts: dict[str, Any] | None = None) -> str:
    """``hw`` as a figure's title names it, with its GPU and host CPU as a table's title does
    (moesim.hw.title.profile_title): ``parts`` if given, else read from its profile (``path``, a file or a
    HardwareProfile, else ``hw``)
    with the ``hw.*`` of ``settings`` applied; ``hw`` alone where the profile cannot be read."""
    from moesim.hw.title import profile_title
    return profile_title(hw, parts if parts is not None else hw_parts_for(path or hw, settings))


def setting_text(value: Any) -> str:
    """A setting as ``--set`` writes it (a whole number read back from a results file as 4.0: 4)."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy's: a bool column's flag is np.bool_
        value = value.item()
    if isinstance(value, float) and value.is_integer():  # a column with gaps turned its ints into floats
        return str(int(value))
    from moesim.sweep.spec import setting_str
    return setting_str(value)


def on_hardware(data: pd.DataFrame) -> str:
    """'on PROFILE (GPU + CPU, cores, DRAM)' for each profile the rows of ``data`` ran on ('; ' between them),
    as :func:`hw_named` names it with the ``hw.*`` settings all its rows share (the profile's own values of a
    field its rows vary); '' without an ``hw`` column. A figure's title says by it what machine it is of: a
    profile's file name says neither its GPU nor its host CPU."""
    if "hw" not in data.columns:
        return ""
    named = []
    for hw in pd.unique(data["hw"].dropna()):
        rows = data[data["hw"] == hw]
        paths = rows["hw_path"].dropna() if "hw_path" in rows.columns else pd.Series(dtype=object)
        shared = {c: rows[c].iloc[0] for c in rows.columns
                  if str(c).startswith("hw.") and rows[c].notna().all() and rows[c].nunique() == 1}
        named.append(hw_named(str(hw), shared, path=str(paths.iloc[0]) if len(paths) else None))
    return "on " + "; ".join(named) if named else ""
