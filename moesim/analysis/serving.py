"""Per-request metrics of a serving run: TTFT, TPOT, end-to-end latency, queueing; percentiles, goodput, a figure.

Definitions (per request, simulated seconds):

* queueing delay: from arrival to the start of the first step that computes one of its tokens;
* TTFT: from arrival to the end of the step that computes its last prompt token (its first token out;
  for a request without prompt, its first decode token);
* TPOT: (finish - first token) / (tokens out - 1), tokens out being its decode tokens plus the one
  the prefill ends with;
* end-to-end latency: from arrival to the end of the step that computes its last token.

Goodput is the rate of requests meeting every SLO given (DistServe, Zhong et al., OSDI'24, Sec. 2):
finished requests within ``ttft_ms`` and ``tpot_ms``, per second of the run. Offered load is the
requests sent over the time of the last arrival; throughput is the requests finished over the time
of the last finish, so it can never exceed the offered load; output tokens per second count every
token the requests returned (the tokens out of TPOT) over the same time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from moesim.errors import ConfigError, did_you_mean
from moesim.sim.serving import ServeResult
from moesim.sim.workload import RATED_ARRIVALS, WorkloadConfig

REQUEST_COLUMNS = ("request", "source", "source_request", "prompt_tokens", "output_tokens", "arrival_s",
                   "scheduled_s", "first_token_s", "finish_s", "queue_ms", "ttft_ms", "tpot_ms", "e2e_ms",
                   "preemptions", "computed_tokens", "recomputed_tokens")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
PERCENTILES = (50, 90, 99)
#: the latencies a run's metrics give percentiles and a mean of (``ttft_ms_p50``, ..., ``ttft_ms_mean``)
LATENCIES = ("queue_ms", "ttft_ms", "tpot_ms", "e2e_ms")
#: the engine metrics a serving run's metrics hold under ``engine`` (``serving_metrics``), as ``moesim replay``
#: gives them
ENGINE_KEYS = ("makespan_s", "gpu_hit_rate", "demand_loads", "prefetches", "cpu_util", "gpu_util", "pcie_util",
               "expert_slots", "slots_per_layer", "breakdown_ms", "sim_wall_s", "notes", "cost_fallbacks")
#: the keys of a run's metrics before its latencies, in their order (``serving_metrics``)
RUN_KEYS = ("scheduler", "arrival", "qps", "requests", "offered_qps", "kv_tokens", "kv_peak_tokens", "kv_tokens_set",
            "kv_tokens_per_slot", "kv_block_tokens", "kv_blocks", "kv_peak_blocks", "kv_watermark_blocks")
#: the keys of a run's metrics after its latencies, without SLOs (``serving_metrics``)
RATE_KEYS = ("throughput_rps", "output_tokens_per_s", "preemptions", "recomputed_tokens")


def parse_slo(slo: str | Mapping[str, Any] | None) -> dict[str, float]:
    """SLOs as ``{key: limit in ms}``, from ``ttft_ms=500,tpot_ms=100`` (``--slo``) or a dict (``moesim.serve``);
    one line naming the fix on a bad entry, the same for both."""
    if slo is None:
        return {}
    if isinstance(slo, Mapping):
        return checked_slo(slo.items())
    if not isinstance(slo, str):
        raise ConfigError(f"an SLO is a dict or a string, got {slo!r}", field="--slo",
                          fix="e.g. {'ttft_ms': 500, 'tpot_ms': 100} or 'ttft_ms=500,tpot_ms=100'")
    pairs = []
    for item in [p.strip() for p in slo.split(",")] if slo.strip() else []:  # `--slo ""`: no SLO, refused below
        if not item:  # `--slo a=1,,b=2`: a variable that expanded to nothing, most likely
            raise ConfigError(f"an empty SLO in '{slo}'", field="--slo",
                              fix="write e.g. ttft_ms=500,tpot_ms=100 (leave the SLO out for no goodput)")
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"bad SLO '{item}'", field="--slo",
                              fix=f"write KEY=VALUE with KEY in {', '.join(SLO_KEYS)}")
        pairs.append((key.strip(), value.strip()))
    return checked_slo(pairs)


def checked_slo(pairs: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """(key, limit) pairs as SLOs: each key one of SLO_KEYS, each limit a positive number of milliseconds."""
    pairs = list(pairs)
    if not pairs:
        raise ConfigError("no SLO given", field="--slo",
                          fix="write e.g. ttft_ms=500,tpot_ms=100 (leave the SLO out for no goodput)")
    out: dict[str, float] = {}
    for key, value in pairs:
        if key not in SLO_KEYS:
            raise ConfigError(f"unknown SLO '{key}'", field="--slo",
                              fix=f"{did_you_mean(str(key), SLO_KEYS)}the SLOs are {', '.join(SLO_KEYS)}")
        if key in out:  # the later value would win unseen
            raise ConfigError(f"SLO '{key}' given twice", field="--slo", fix="give each SLO once")
        out[key] = _slo_limit(key, value)
    return out


def _slo_limit(key: str, value: Any) -> float:
    try:
        if isinstance(value, bool):  # an int to float(), but True is no number of milliseconds
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):  # TypeError: None, a list, ... from the Python API
        raise ConfigError(f"SLO '{key}={value}' is not a number", field="--slo",
                          fix=_unit_fix(key, value) or "write e.g. ttft_ms=500") from None
    if not (number > 0 and math.isfinite(number)):  # nan compares false; inf would make the SLO no limit
        raise ConfigError(f"SLO '{key}={value}' must be a positive, finite number of milliseconds", field="--slo",
                          fix="write e.g. ttft_ms=500")
    return number


#: units a limit may be written with by habit (``ttft_ms=0.5s``), in milliseconds
SLO_UNITS = {"ms": 1.0, "s": 1e3, "us": 1e-3, "µs": 1e-3}


def _unit_fix(key: str, value: Any) -> str | None:
    """For a limit written with a unit (``0.5s``), the same limit in the key's milliseconds."""
    import re
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(ms|s|us|µs)\s*", str(value))
    if not match:
        return None
    try:
        number = float(match.group(1)) * SLO_UNITS[match.group(2)]
    except ValueError:
        return None
    if not (number > 0 and math.isfinite(number)):  # no limit to suggest: -500, 0 or inf would be refused next
        return None
    return f"the unit is in the key ({key}: milliseconds), the value a bare number: write {key}={number:g}"


def request_frame(result: ServeResult) -> Any:
    """One row per request (REQUEST_COLUMNS), times in seconds, latencies in milliseconds."""
    import pandas as pd
    rows = []
    for r in result.requests:
        tpot = (r.finish_s - r.first_token_s) / (r.emitted - 1) if r.emitted > 1 else float("nan")
        rows.append({
            "request": r.request, "source": r.source, "source_request": r.source_request,
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "arrival_s": r.arrival_s,
            "scheduled_s": r.scheduled_s, "first_token_s": r.first_token_s, "finish_s": r.finish_s,
            "queue_ms": (r.scheduled_s - r.arrival_s) * 1e3, "ttft_ms": (r.first_token_s - r.arrival_s) * 1e3,
            "tpot_ms": tpot * 1e3, "e2e_ms": (r.finish_s - r.arrival_s) * 1e3,
            "preemptions": r.preemptions, "computed_tokens": r.computed_tokens,
            "recomputed_tokens": r.recomputed_tokens})
    return pd.DataFrame(rows, columns=list(REQUEST_COLUMNS))


def _percentiles(values: np.ndarray, name: str) -> dict[str, float]:
    values = values[~np.isnan(values)]
    out = {f"{name}_p{q}": float(np.percentile(values, q)) if len(values) else float("nan") for q in PERCENTILES}
    out[f"{name}_mean"] = float(values.mean()) if len(values) else float("nan")
    return out


class ServingMetrics(dict):
    """A serving run's metrics (:func:`serving_metrics`; ``moesim.serve(...).metrics``): a dict, as before, whose
    keys are also attributes (``m.ttft_ms_p90`` is ``m["ttft_ms_p90"]``), and :meth:`frame` gives them as a
    one-row DataFrame, as ``moesim.replay(...).metrics`` is. ``moesim serve-sim --help-metrics`` gives every
    key's unit and meaning; the main ones are annotated below. Latencies are in milliseconds, each as
    ``<name>_p50``, ``_p90``, ``_p99`` and ``_mean`` over requests; rates in requests (or tokens) per second."""

    system: str
    scheduler: str
    arrival: str
    #: the arrival rate asked for; NaN for arrivals that set none (an arrival file, a closed loop)
    qps: float
    requests: int
    #: requests over the time of the last arrival
    offered_qps: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    ttft_ms_mean: float
    tpot_ms_p50: float
    tpot_ms_p90: float
    tpot_ms_p99: float
    tpot_ms_mean: float
    e2e_ms_p50: float
    e2e_ms_p90: float
    e2e_ms_p99: float
    e2e_ms_mean: float
    queue_ms_p50: float
    queue_ms_p90: float
    queue_ms_p99: float
    queue_ms_mean: float
    #: finished requests over the time of the last finish (never above ``offered_qps``)
    throughput_rps: float
    output_tokens_per_s: float
    preemptions: int
    recomputed_tokens: int
    #: with an SLO only: the share of requests meeting every limit, and their rate
    slo_attainment: float
    goodput_rps: float
    #: the engine's metrics over the whole run, as ``moesim replay`` names them
    engine: dict

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            if name.startswith("__"):  # copy, pickle and pandas probe dunders: no metric is one
                raise AttributeError(name) from None
            why = " (it needs an SLO: moesim.serve(..., slo={'ttft_ms': 500}))" \
                if name in ("slo", "slo_attainment", "goodput_rps") else ""
            raise AttributeError(f"no metric '{name}' in this run{why}; {did_you_mean(name, list(self))}"
                                 "the keys are listed by `moesim serve-sim --help-metrics`") from None

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *(k for k in self if k.isidentifier())})

    def frame(self) -> Any:
        """One row, a column per metric: the engine's as ``engine_<key>`` (:func:`flat_serving_metrics`), the
        SLO limits as ``slo_<key>``."""
        import pandas as pd
        flat = flat_serving_metrics(self) if "engine" in self else {k: v for k, v in self.items() if k != "system"}
        limits = flat.pop("slo", None) or {}
        return pd.DataFrame([{"system": self.get("system"), **flat, **{f"slo_{k}": v for k, v in limits.items()}}])


def serving_metrics(result: ServeResult, slo: dict[str, float] | None = None) -> ServingMetrics:
    """Percentiles of every latency, throughput, offered load, goodput, preemptions and the engine's metrics.

    KV peaks: ``kv_peak_tokens`` is the most entries written in one step (computed tokens), ``kv_peak_blocks``
    the most blocks held, allocated ones not yet written included (a prompt admitted whole under vLLM or
    Sarathi-Serve holds all its blocks from its first chunk on)."""
    from moesim.analysis.metrics import metrics
    frame = request_frame(result)
    w = result.workload
    end = float(frame.finish_s.max())
    out: dict[str, Any] = {"system": result.engine.system, "scheduler": result.scheduler, "arrival": w.arrival,
                           "qps": w.qps if w.arrival in RATED_ARRIVALS else float("nan"),
                           "requests": len(frame), "offered_qps": float(result.offered_qps),
                           "kv_tokens": result.kv_tokens if result.kv_tokens is not None else -1,
                           "kv_peak_tokens": result.kv_peak, "kv_tokens_set": w.kv_tokens > 0,
                           "kv_tokens_per_slot": result.kv_tokens_per_slot,
                           "kv_block_tokens": result.kv_block_tokens,
                           "kv_blocks": result.kv_blocks if result.kv_blocks is not None else -1,
                           "kv_peak_blocks": result.kv_peak_blocks, "kv_watermark_blocks": result.kv_watermark_blocks}
    for name in LATENCIES:
        out.update(_percentiles(frame[name].to_numpy(dtype=float), name))
    out["throughput_rps"] = len(frame) / end if end > 0 else float("nan")
    # every token a request returns, the one its prefill ends with too (as TPOT counts them)
    returned = sum(r.emitted for r in result.requests)
    out["output_tokens_per_s"] = returned / end if end > 0 else float("nan")
    out["preemptions"] = int(frame.preemptions.sum())
    out["recomputed_tokens"] = int(frame.recomputed_tokens.sum())
    if slo:
        ok = np.ones(len(frame), dtype=bool)
        for key, limit in slo.items():
            ok &= (frame[key].fillna(0.0) <= limit).to_numpy()
        out["slo"] = dict(slo)
        out["slo_attainment"] = float(ok.mean())
        out["goodput_rps"] = float(ok.sum()) / end if end > 0 else float("nan")
    engine = metrics(result.engine)
    out["engine"] = {k: engine[k] for k in ENGINE_KEYS}
    return ServingMetrics(out)


def preemption_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Why runs preempted: a line per rate and KV budget naming the runs that preempted, how often and the
    tokens they prefilled again, and, where the budget is what the expert cache left, what a slot given up
    would add (none for runs without preemptions)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for m in rows:
        if m["preemptions"]:
            slots = None if m["kv_tokens_set"] else m["engine"]["expert_slots"]
            paged = (m.get("kv_blocks", -1), m.get("kv_block_tokens", 1))
            groups.setdefault((m["qps"], m["kv_tokens"], slots, m["kv_tokens_per_slot"], paged), []).append(m)
    lines = []
    for (qps, kv_tokens, slots, per_slot, (blocks, block_tokens)), runs in groups.items():
        rate = "" if math.isnan(qps) else f" at {qps:g} req/s"
        if block_tokens > 1:  # the budget as the scheduler used it: whole blocks
            rate = f" in {blocks:,} blocks of {block_tokens}{rate}"
        budget = "workload.kv_tokens" if slots is None else \
            (f"the GPU memory {slots:,} expert slots leave; each slot fewer holds {per_slot:,} more: "
             f"--set cache.slots=N trades them, docs/serving.md")
        listed = "; ".join(f"{m['system']} {m['preemptions']:,} preemption{'s' if m['preemptions'] > 1 else ''}, "
                           f"{m['recomputed_tokens']:,} token{'s' if m['recomputed_tokens'] != 1 else ''} "
                           "prefilled again" for m in runs)
        lines.append(f"KV entries for {kv_tokens:,} tokens{rate} ({budget}): {listed}")
    return lines


def write_requests(frame: Any, path: str | os.PathLike) -> None:
    """The per-request frame as Parquet, written whole or not at all."""
    from pathlib import Path

    from moesim.util import tmp_path_for
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot_latency_vs_qps(rows: Any, path: str | os.PathLike | None = None, metric: str = "ttft_ms",
                        title: str | None = None, hw: str | None = None, setting: str = "") -> Any:
    """p50/p90/p99 of ``metric`` against offered QPS, one colour per system (rows: serving_metrics dicts,
    ``moesim.serve`` runs or a frame). Drawn without pyplot (a notebook's backend and figures are left alone);
    displays as a PNG. The legend, right of the axes, gives each system's colour and each percentile's line
    style apart (nine system-and-percentile entries inside the axes covered the lines). Runs that differ in
    another parameter (a sweep's traces or schedulers) are averaged per system and rate, and the title says
    over which; ``setting`` (a line under the title) says what the runs drawn share."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.lines import Line2D

    from moesim.analysis.figure_style import LOG_RATIO, log_axis, system_styles
    from moesim.analysis.plots import DisplayFigure, fit_width, save_figure
    from moesim.analysis.sweep_results import ordered_systems, system_label
    frame = serving_frame(rows)
    columns = [percentile_column(frame, metric, q, "metric") for q in PERCENTILES]
    if not frame["qps"].notna().any():  # closed loops and arrival logs: empty axes before
        raise ConfigError("no run has an arrival rate to draw against (closed-loop clients or an arrival log)",
                          field="rows", fix="give runs with workload.arrival=poisson or gamma, or draw each "
                                            "run's requests (plot_requests)")
    requests = frame["requests"].dropna().unique() if "requests" in frame.columns else []
    if hw is None:
        hw = machines(frame)
    # points that differ in anything else (traces, schedulers, hardware, seeds) are averaged per system and rate
    averaged = averaged_parameters(frame)
    frame = frame.groupby(["system", "qps"], sort=False)[columns].mean().reset_index()
    fig = DisplayFigure(figsize=(7.6, 4.2), layout="constrained")
    FigureCanvasAgg(fig)  # fit_width measures the title
    ax = fig.subplots()
    styles = dict(zip(PERCENTILES, ("-", "--", ":")))
    handles, names = [], []
    systems = ordered_systems(frame["system"].unique())  # the legend in the sweep figures' order and looks
    looks = system_styles(systems)
    for system in systems:
        group = frame[frame["system"] == system].sort_values("qps")
        colour, marker = looks[system]["color"], looks[system]["marker"]
        for q, style in styles.items():
            ax.plot(group.qps, group[f"{metric}_p{q}"], style, color=colour, marker=marker, markersize=3,
                    label=f"{system} p{q}")
        handles.append(Line2D([], [], color=colour, marker=marker, markersize=4))
        names.append(system_label(str(system)))
    handles += [Line2D([], [], color="#333333", linestyle=style) for style in styles.values()]
    names += [f"p{q}" for q in styles]
    short = metric.removesuffix("_ms").upper()
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel(f"{short} (ms)")
    values = frame[columns].to_numpy(dtype=float)
    values = values[np.isfinite(values) & (values > 0)]
    if values.size and values.max() > LOG_RATIO * values.min():  # log only where it spans a decade or more
        log_axis(ax)
    rates = frame["qps"].to_numpy(dtype=float)
    rates = rates[np.isfinite(rates) & (rates > 0)]
    if rates.size and rates.max() > LOG_RATIO * rates.min():  # 0.01 to 4 req/s: the knee was a smear at x = 0
        log_axis(ax, "x")
    ax.grid(True, alpha=0.3)
    fig.legend(handles, names, loc="outside right center", fontsize=8, frameon=False)
    if title is None:
        each = f", {int(requests[0]):,} requests a run" if len(requests) == 1 else ""
        where = f" on {hw}" if hw else ""  # the rows do not say which profile served them
        title = f"{short} per request vs arrival rate{where}{each}: p50, p90, p99 per system"
    note = "; ".join(part for part in (setting, f"mean over {', '.join(averaged)}" if averaged else "") if part)
    fit_width(fig, ax.set_title(title + (f"\n{note}" if note else ""), loc="left", fontsize=10))
    if path is not None:
        save_figure(fig, path)
    return fig


#: the phases of a request's life on the request timeline, with their colours (the Okabe-Ito palette of the figures)
REQUEST_PHASES = (("arrival_s", "scheduled_s", "#BBBBBB", "queued"),
                  ("scheduled_s", "first_token_s", "#E69F00", "prefill to first token"),
                  ("first_token_s", "finish_s", "#0072B2", "decode"))


def arrivals_text(workload: WorkloadConfig) -> str:
    """What set a run's arrivals, for a title: an open loop's rate; a closed loop's clients and a replayed
    arrival log have no rate (``qps`` is nan in their metrics)."""
    if workload.arrival in RATED_ARRIVALS:
        return f"at {workload.qps:g} req/s"
    if workload.arrival == "closed":
        clients = workload.concurrency
        return f"from {clients} closed-loop client{'s' if clients != 1 else ''}"
    return f"arriving at the times of {os.path.basename(workload.arrival_file)}"


def plot_requests(frame: Any, path: str | os.PathLike | None = None, title: str = "") -> Any:
    """Each request of one serving run as a row, in order of arrival: queued (arrival to its first
    scheduled step), prefill until its first token, decode until it finishes; requests that were
    preempted (their KV cache dropped and recomputed) are marked at their finish. ``frame``: the
    per-request table (:func:`request_frame`, ``ServeRun.requests``). Displays as a PNG in Jupyter."""
    from matplotlib.ticker import MaxNLocator

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from moesim.analysis.plots import DisplayFigure, fit_width, save_figure
    if len(frame) == 0:
        raise ConfigError("no request to draw", field="requests", fix="serve at least one request")
    rows = frame.sort_values(["arrival_s", "request"], kind="stable").reset_index(drop=True)
    y = np.arange(len(rows))
    fig = DisplayFigure(figsize=(9, min(2.0 + 0.12 * len(rows), 9.0)), layout="constrained")
    FigureCanvasAgg(fig)  # fit_width measures the title
    ax = fig.add_subplot()
    height = 0.8 if len(rows) <= 60 else 1.0  # many rows: touching bars read as areas
    # milliseconds for a short run, seconds past 10 s (six-digit millisecond ticks read badly)
    scale, unit = (1e3, "ms") if float(rows["finish_s"].max()) < 10.0 else (1.0, "s")
    for start, end, colour, label in REQUEST_PHASES:
        begin = rows[start].to_numpy(dtype=float) * scale
        ax.barh(y, rows[end].to_numpy(dtype=float) * scale - begin, left=begin, height=height, color=colour,
                linewidth=0, label=label)
    preempted = rows["preemptions"].to_numpy() > 0
    if preempted.any():
        ax.plot(rows["finish_s"].to_numpy(dtype=float)[preempted] * scale, y[preempted], "x", color="#D55E00",
                markersize=4, label=f"preempted ({int(preempted.sum())} request{'s' if preempted.sum() > 1 else ''})")
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first arrival on top
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # rows are requests: no 2.5th
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("request, in order of arrival")
    ax.grid(True, axis="x", alpha=0.3)
    # below the axes: inside, a burst of arrivals (all queued from the start) put rows behind it
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8, frameon=False)
    # the profile's parts and the arrivals ran past the right edge, cut off mid-rate
    fit_width(fig, ax.set_title(title or f"{len(rows)} requests", loc="left", fontsize=10))
    if path is not None:
        save_figure(fig, path)
    return fig


def max_qps_under_slo(rows: Any, slo: str | Mapping[str, float], percentile: int = 90) -> dict[str, float]:
    """Per system, the highest QPS up to which every rate's ``percentile`` of each SLO metric meets it (nan: none).
    ``slo`` as ``moesim.serve`` takes it: a dict or ``"ttft_ms=500,tpot_ms=100"``."""
    frame = serving_frame(rows)
    try:
        limits = parse_slo(slo)
    except ConfigError as err:  # named as this function's argument, not as the command line's --slo
        err.rename_field("slo")
        raise
    columns = {key: percentile_column(frame, key, percentile, "slo") for key in limits}
    out: dict[str, float] = {}
    for system, group in frame.groupby("system", sort=False):
        group = group.sort_values("qps")
        ok = np.ones(len(group), dtype=bool)
        for key, limit in limits.items():
            ok &= (group[columns[key]].fillna(0.0) <= limit).to_numpy()
        # every rate up to it must pass: a lucky sample above a failing rate does not count
        passing = int(np.argmin(ok)) if not ok.all() else len(ok)
        out[str(system)] = float(group.qps.iloc[passing - 1]) if passing else math.nan
    return out


def serving_frame(rows: Any) -> Any:
    """Serving runs as a frame: a frame, ``serving_metrics`` dicts or ``moesim.serve`` runs (their ``metrics``);
    one line when there is none or they are no serving runs (a KeyError on 'system' before)."""
    import pandas as pd
    if isinstance(rows, pd.DataFrame):
        frame = rows
    else:
        # a moesim.serve run's machine, as titles name it, beside its metrics
        frame = pd.DataFrame([{**r.metrics, "hw_title": r.hw} if getattr(r, "hw", "") else getattr(r, "metrics", r)
                              for r in rows])
    missing = [c for c in ("system", "qps") if c not in frame.columns]
    if frame.empty or missing:
        got = "no serving runs given" if frame.empty else \
            f"the rows are no serving runs (no column {', '.join(repr(c) for c in missing)})"
        raise ConfigError(got, field="rows",
                          fix="give the runs of moesim.serve (or their .metrics), one per system and rate")
    return frame


def percentile_column(frame: Any, metric: str, percentile: int, role: str) -> str:
    """The column of ``metric``'s ``percentile`` (``ttft_ms_p90``); one line naming the latencies and
    percentiles there are otherwise (a KeyError on 'ttft_p90' before)."""
    column = f"{metric}_p{percentile}"
    if column in frame.columns:
        return column
    if percentile not in PERCENTILES:
        raise ConfigError(f"no p{percentile} of {metric}: runs keep p{', p'.join(map(str, PERCENTILES))}",
                          field="percentile", fix=f"use one of {', '.join(map(str, PERCENTILES))}")
    latencies = sorted({c.rsplit("_p", 1)[0] for c in frame.columns if c.endswith(f"_p{percentile}")})
    raise ConfigError(f"no latency '{metric}' in the runs", field=role,
                      fix=f"{did_you_mean(str(metric), latencies)}use one of {', '.join(latencies)}")


def serving_row(traces: list[str], hw: Any, system: str, settings: dict[str, str], **kwargs: Any) -> dict[str, Any]:
    """One serving run as flat columns (a sweep row): summary metrics, the engine's prefixed with ``engine_``."""
    from moesim.sim.serving import serve
    return flat_serving_metrics(serving_metrics(serve(traces, hw, system, settings, **kwargs)))


def flat_serving_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """``serving_metrics`` as flat columns: ``system`` dropped, the engine's keys prefixed with ``engine_``
    (its breakdown one column per category, its lists joined by "; ")."""
    out = {k: v for k, v in m.items() if k not in ("system", "engine")}
    for key, value in m["engine"].items():
        if key == "breakdown_ms":
            out.update({f"engine_breakdown_{cat}_ms": float(v) for cat, v in value.items()})
        elif isinstance(value, (list, tuple)):
            out[f"engine_{key}"] = "; ".join(map(str, value))
        else:
            out[f"engine_{key}"] = value
    return out


def serving_columns() -> list[str]:
    """The columns of :func:`serving_row`, in its order, known before any run: a sweep whose serving points all
    failed has them too (empty), as one whose points ran does."""
    from moesim.sim.bookkeeping import BREAKDOWN
    latencies = {f"{name}_{stat}": None for name in LATENCIES for stat in (*(f"p{q}" for q in PERCENTILES), "mean")}
    engine = {**dict.fromkeys(ENGINE_KEYS), "breakdown_ms": dict.fromkeys(BREAKDOWN, 0.0)}
    template = {**dict.fromkeys(RUN_KEYS), **latencies, **dict.fromkeys(RATE_KEYS), "engine": engine}
    return list(flat_serving_metrics(template))


def averaged_parameters(frame: Any) -> list[str]:
    """The parameters other than the system and the rate in which ``frame``'s runs differ."""
    from moesim.analysis.sweep_results import parameter_columns, varying
    return [c for c in varying(frame, parameter_columns(frame)) if c not in ("system", "qps", "workload.qps")]


def machines(frame: Any) -> str | None:
    """The profiles runs of ``frame`` served on, as titles name them with their GPU and host CPU ('; ' between
    them): moesim.serve runs' own, or a sweep's ``hw`` column with the ``hw.*`` settings its rows share; None
    where the rows do not say."""
    from moesim.analysis.sweep_results import on_hardware
    if "hw_title" in frame.columns and frame["hw_title"].notna().any():
        return "; ".join(str(t) for t in frame["hw_title"].dropna().unique())
    return on_hardware(frame).removeprefix("on ") or None


def serving_figures(frame: Any) -> dict[str, tuple[Any, str]]:
    """The report's figures for a sweep of serving runs: name -> (figure, caption). One figure per metric and
    setting of the parameters other than the system, the rate and the seed (trace, profile, scheduler, ...):
    averaged together, a Mixtral trace's latencies and a small model's made one line of neither."""
    out = {}
    if not serving_frame(frame)["qps"].notna().any():
        return {"latency_vs_qps": (None, "no latency against the arrival rate: no run has one (closed-loop "
                                         "clients or an arrival log)")}
    split = [c for c in averaged_parameters(frame) if c != "seed"]
    groups = list(frame.groupby(split, sort=True, dropna=False)) if split else [((), frame)]
    hw = machines(frame) if "hw" not in split else None
    for metric, what in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                         ("e2e_ms", "end-to-end latency")):
        for i, (key, group) in enumerate(groups):
            values = key if isinstance(key, tuple) else (key,)
            setting = ", ".join(f"{c} = {os.path.basename(str(v)) if c == 'trace' else v}"
                                for c, v in zip(split, values))
            fig = plot_latency_vs_qps(group, metric=metric, hw=hw, setting=setting)
            out[f"{metric}_vs_qps" + (f"_{i}" if split else "")] = (
                fig, f"{what.capitalize()} per request against the arrival rate: p50 solid, p90 dashed, p99 "
                     f"dotted, one colour per system{f' ({setting})' if setting else ''}.")
    return out
