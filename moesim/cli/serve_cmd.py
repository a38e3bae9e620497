"""``moesim serve-sim``: requests arriving over time, batched by a scheduler."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import click

from moesim.api import DEFAULT_HW, DEFAULT_SYSTEM
from moesim.cli.app import (HW_PROFILE, InputPath, check_outputs, cli, console, err_console, hw_title, open_output,
                            parse_settings, setting_files, hw_help, print_skipped, print_title, say_wrote, to_stdout,
                            write_json)
from moesim.cli.replay_cmd import print_metric_docs, system_choice
from moesim.errors import MoesimError
from moesim.hw.profile import profile_path
from moesim.util import FIGURE, PARQUET

if TYPE_CHECKING:
    from moesim.analysis.metrics import MetricDoc


@cli.command("serve-sim")
@click.argument("traces", nargs=-1, metavar="TRACE...", type=InputPath(dir_okay=False))
@click.option("--hw", default=DEFAULT_HW, show_default=True, type=HW_PROFILE, help=hw_help())
@click.option("--system", "system", default=[DEFAULT_SYSTEM], multiple=True,
              help="System; several separated by commas or repeated, or 'all' (one run per system and QPS).  "
                   f"[default: {DEFAULT_SYSTEM}]")
@click.option("--qps", default="1", show_default=True, help="Arrival rate(s), requests/s, comma-separated.")
@click.option("--requests", "requests", default=None, type=click.IntRange(min=1),
              help="Requests sent (workload.requests, default 100).")
@click.option("--scheduler", default=None, help="static | vllm | sarathi | llamacpp (default vllm).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="workload.*, scheduler.* or any replay parameter, e.g. workload.arrival=gamma.")
@click.option("--slo", default=None, metavar="ttft_ms=..,tpot_ms=..", help="SLOs for goodput.")
@click.option("--json", "json_out", default=None, metavar="OUT",
              help="Write metrics as JSON ('-': stdout, which then holds the JSON only). One system: its run's "
                   "metrics, or with several --qps a list of them in --qps order. Several systems or 'all': an "
                   "object keyed by system name, each holding that; a skipped system's runs are "
                   "{system, qps, skipped: reason} (as `moesim replay --json`).")
@click.option("--requests-out", "requests_out", default=None, metavar="OUT.parquet",
              help="Per-request TTFT, TPOT, latency and queueing (one run only).")
@click.option("--requests-plot", "requests_plot", default=None, metavar="OUT.png",
              help="Each request as a row: queued, prefill, decode, preemptions (one run only).")
@click.option("--plot", "plot_out", default=None, metavar="OUT.png", help="Latency percentiles vs QPS per system.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--help-metrics", is_flag=True,
              help="List the keys of the --json metrics of a run (unit, meaning); with --json OUT, as JSON.")
@click.pass_context
def serve_sim(ctx: click.Context, traces: tuple[str, ...], hw: str, system: tuple[str, ...], qps: str,
              requests: int | None, scheduler: str | None, settings: tuple[str, ...], slo: str | None,
              json_out: str | None, requests_out: str | None, requests_plot: str | None, plot_out: str | None,
              seed: int, help_metrics: bool) -> None:
    """Serve requests drawn from TRACE... arriving over time, batched by a scheduler; per-request latencies."""
    if help_metrics:
        serving_metric_help(json_out)
        return
    if not traces:
        raise click.MissingParameter(ctx=ctx, param=next(p for p in ctx.command.params if p.name == "traces"))
    from moesim.analysis.serving import (arrivals_text, parse_slo, plot_latency_vs_qps, plot_requests, request_frame,
                                         serving_metrics, write_requests)
    from moesim.sim.serving import serve
    from moesim.trace.validate import checked_meta
    parsed = parse_settings(settings)
    check_outputs([("TRACE", t) for t in traces] + [("--hw", str(profile_path(hw)))] + setting_files(parsed),
                  {"requests_out": PARQUET, "requests_plot": FIGURE, "plot": FIGURE}, json=json_out,
                  requests_out=requests_out, requests_plot=requests_plot, plot=plot_out)
    out = err_console if to_stdout(json_out) else console  # stdout holds the JSON only
    for trace_file in traces:
        checked_meta(trace_file, ())
    for option, key, value in (("--requests", "workload.requests", requests), ("--scheduler", "scheduler", scheduler)):
        _given_once(parsed, key, option, value)
    slos = parse_slo(slo)
    systems, everything = system_choice(system)
    qps_given = click.get_current_context().get_parameter_source("qps") != click.core.ParameterSource.DEFAULT
    qps = _rate_option(qps, qps_given, parsed)
    rates = _rates(qps, parsed, "--qps" if qps_given or "workload.qps" not in parsed else "workload.qps")
    _check_read(parsed, rates[0], qps_given)
    if plot_out:
        _check_rated(parsed, rates[0])
    for option, value in (("--requests-out", requests_out), ("--requests-plot", requests_plot)):
        if value and len(systems) * len(rates) > 1:
            raise MoesimError(f"{option} needs one system and one QPS", field=option,
                              fix="pass a single --system and --qps")
    rows, last, skipped, first_error = [], None, {}, None
    runtimes: dict[str, str] = {}  # per system: the runtime its runs were charged launches and CPU kernels by
    runs: dict[str, list[dict]] = {}  # per system, per rate of --qps: its metrics, or why it was skipped
    per_run = _requests_per_run(parsed)
    with _serving_progress(per_run, len(systems) * len(rates)) as bar:
        for name in systems:
            runs[name] = []
            before = bar.done
            try:
                for rate in rates:
                    bar.advance(0, label=f"{name} at {rate} req/s")
                    last = serve(list(traces), hw, name, {**parsed, "workload.qps": rate}, seed=seed,
                                 progress=bar.advance)
                    rows.append(serving_metrics(last, slos))
                    runs[name].append(rows[-1])
                    runtimes[name] = last.engine.runtime
            except MoesimError as err:
                if not everything or not _skippable_in_serving(err):
                    raise
                skipped[name] = str(err)  # a bound that needs the trace's future, a missing column
                first_error = first_error or err
                runs[name] += [_skipped_run(name, rate, parsed, str(err)) for rate in rates[len(runs[name]):]]
                # the requests its runs will not finish count as done: the bar ends whole (as replay's)
                bar.advance(max(per_run * len(rates) - (bar.done - before), 0))
    if not rows:
        raise first_error  # nothing ran: the reason is the user's to fix, not a table of skips (as replay)
    from rich.table import Table
    print_title(out, f"serving on {hw_title(hw, parsed)}")
    table = Table()
    for col in ("system", "QPS", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "E2E p99 ms", "req/s", "preempt",
                *(("goodput",) if slos else ())):
        table.add_column(col, justify="left" if col == "system" else "right")
    from moesim.analysis.report import number_text
    for m in rows:  # "-" where a figure is undefined: TPOT of prompts alone, the rate of a replayed arrival log
        table.add_row(m["system"], "-" if math.isnan(m["qps"]) else f"{m['qps']:g}",
                      f"{number_text(m['ttft_ms_p50'], 1)} / {number_text(m['ttft_ms_p99'], 1)}",
                      f"{number_text(m['tpot_ms_p50'], 1)} / {number_text(m['tpot_ms_p99'], 1)}",
                      number_text(m["e2e_ms_p99"], 1), number_text(m["throughput_rps"], 3), str(m["preemptions"]),
                      *((f"{m['goodput_rps']:.3f} ({m['slo_attainment']:.0%})",) if slos else ()))
    out.print(table)
    out.print(runtimes_line(runtimes), markup=False, highlight=False)
    for line in serving_notes(rows):
        out.print(line, markup=False, highlight=False)
    print_skipped(out, skipped, len(systems))
    if json_out:
        write_json(json_runs(runs, several_systems=len(systems) > 1, several_rates=len(rates) > 1), json_out)
    if requests_out and last is not None:
        with open_output(requests_out, "--requests-out") as path:
            write_requests(request_frame(last), path)
        say_wrote(out, f"wrote {requests_out}")
    if requests_plot and last is not None:
        with open_output(requests_plot, "--requests-plot", FIGURE) as path:
            plot_requests(request_frame(last), path, title=f"{systems[0]} on {hw_title(hw, parsed)}: "
                                                             f"{len(last.requests)} requests "
                                                             f"{arrivals_text(last.workload)}")
        say_wrote(out, f"wrote {requests_plot}")
    if plot_out:
        with open_output(plot_out, "--plot", FIGURE) as path:
            plot_latency_vs_qps(rows, path, hw=hw_title(hw, parsed))
        say_wrote(out, f"wrote {plot_out}")


def serving_metric_docs() -> dict[str, MetricDoc]:
    """Every key of one run's ``moesim serve-sim --json`` metrics (``serving_metrics`` in
    moesim/analysis/serving.py, docs/serving.md, Metrics), in the order ``--help-metrics`` lists them; the
    engine's keys are ``moesim replay``'s (:data:`moesim.analysis.metrics.METRIC_DOCS`)."""
    from moesim.analysis.metrics import METRIC_DOCS, MetricDoc
    from moesim.analysis.serving import ENGINE_KEYS, PERCENTILES, SLO_KEYS
    docs = {
        "system": MetricDoc("", "the system served"),
        "scheduler": MetricDoc("", "the scheduler that batched the requests (--scheduler): static, vllm, sarathi "
                                   "or llamacpp"),
        "arrival": MetricDoc("", "the arrival process (workload.arrival): poisson, gamma, trace or closed"),
        "qps": MetricDoc("requests/s", "the arrival rate asked for (--qps, workload.qps); null for arrivals that "
                                       "set none (trace, closed)"),
        "requests": MetricDoc("requests", "requests served (--requests, workload.requests)"),
        "offered_qps": MetricDoc("requests/s", "offered load: requests over the time of the last arrival"),
        "kv_tokens": MetricDoc("tokens", "KV entries the requests had: workload.kv_tokens, or what the GPU memory "
                                         "beside the expert cache holds; -1: unlimited (a system that ignores "
                                         "GPU memory)"),
        "kv_peak_tokens": MetricDoc("tokens", "most KV entries written (tokens computed) during one engine step; "
                                              "entries allocated but not yet written are not counted"),
        "kv_block_tokens": MetricDoc("tokens", "KV entries per block the scheduler allocates "
                                               "(scheduler.kv_block_tokens; 1: per token)"),
        "kv_blocks": MetricDoc("blocks", "the KV budget in whole blocks: kv_tokens // kv_block_tokens; -1: "
                                         "unlimited"),
        "kv_peak_blocks": MetricDoc("blocks", "most KV blocks held during one engine step, allocated ones not yet "
                                              "written included (scheduler.kv_allocation=prompt, as vllm and sarathi "
                                              "run, allocates a prompt's blocks when it is admitted)"),
        "kv_watermark_blocks": MetricDoc("blocks", "blocks a waiting request's admission had to leave free "
                                                   "(scheduler.kv_watermark of kv_blocks, rounded down)"),
        "kv_tokens_set": MetricDoc("", "true where workload.kv_tokens set the KV budget, false where it is what "
                                       "the expert cache left"),
        "kv_tokens_per_slot": MetricDoc("tokens", "KV entries one expert slot's bytes would hold, what a slot "
                                                  "given up (--set cache.slots) adds; 0: unknown"),
    }
    latencies = {
        "queue_ms": "queueing delay: from a request's arrival to the start of its first step",
        "ttft_ms": "time to first token: from a request's arrival to the end of the step that computes its last "
                   "prompt token (for a request without prompt, its first decode token)",
        "tpot_ms": "time per output token of a request: (finish - first token) / (tokens out - 1), over the "
                   "requests with more than one token out",
        "e2e_ms": "end-to-end latency: from a request's arrival to its last token",
    }
    for name, meaning in latencies.items():
        for i, q in enumerate(PERCENTILES):
            docs[f"{name}_p{q}"] = MetricDoc("ms", f"{_ordinal(q)} over requests of the {meaning}" if i == 0
                                             else f"{_ordinal(q)} of the same")
        docs[f"{name}_mean"] = MetricDoc("ms", "mean of the same")
    docs.update({
        "throughput_rps": MetricDoc("requests/s", "finished requests over the time of the last finish (never "
                                                  "above offered_qps)"),
        "output_tokens_per_s": MetricDoc("tokens/s", "every token the requests returned, the one a prefill ends "
                                                     "with included, over the time of the last finish"),
        "preemptions": MetricDoc("", "requests preempted for want of KV entries (each time), summed over requests"),
        "recomputed_tokens": MetricDoc("tokens", "tokens prefilled again after preemptions"),
        "slo": MetricDoc("ms", f"with --slo only: the limits given, keyed by {', '.join(SLO_KEYS)}"),
        "slo_attainment": MetricDoc("fraction", "with --slo only: the share of requests meeting every limit"),
        "goodput_rps": MetricDoc("requests/s", "with --slo only: requests meeting every limit over the time of "
                                               "the last finish (DistServe, OSDI'24)"),
        "engine": MetricDoc("", "the engine's metrics over the whole run, as `moesim replay --json` gives them "
                                "(the keys engine.* below)"),
    })
    for key in ENGINE_KEYS:
        docs[f"engine.{key}"] = METRIC_DOCS[key]
    docs["engine.makespan_s"] = MetricDoc("s", "simulated time of the whole run: the last request's finish")
    docs["engine.breakdown_ms"] = MetricDoc("ms", "critical-path time per category (attention, gpu_compute, "
                                                  "wait_cache, cpu_other, sync, launch, ...), all layers, whole run")
    docs["engine.sim_wall_s"] = MetricDoc("s", "wall-clock time the run took (not simulated time)")
    return docs


def _ordinal(q: int) -> str:
    return "median" if q == 50 else f"{q}th percentile"


def serving_metric_help(json_out: str | None = None) -> None:
    """``--help-metrics``: the keys of a run's metrics as a table, or with ``--json OUT`` as JSON (as
    ``moesim replay --help-metrics``)."""
    print_metric_docs(serving_metric_docs(), "keys of moesim serve-sim --json (one object per run; several rates: a "
                      "list of them in --qps order; several systems: an object keyed by system name)", json_out)


def json_runs(runs: dict[str, list[dict]], several_systems: bool, several_rates: bool) -> object:
    """--json's shape, fixed by the command line as replay's is, never by how many runs succeeded: a rate's
    run is its metrics (a list of them in --qps order for several rates); several systems (or 'all') are an
    object keyed by system name holding that, a skipped system's runs being {system, qps, skipped: reason}."""
    shaped = {name: entries if several_rates else entries[0] for name, entries in runs.items()}
    return shaped if several_systems else next(iter(shaped.values()))


def _skipped_run(system: str, rate: str, settings: dict[str, str], reason: str) -> dict:
    """A run that did not happen, where its metrics would be; its ``qps`` as the metrics would give it."""
    from moesim.sim.workload import RATED_ARRIVALS, split_settings
    workload = split_settings({**settings, "workload.qps": rate}).workload
    return {"system": system, "qps": workload.qps if workload.arrival in RATED_ARRIVALS else float("nan"),
            "skipped": reason}


def runtimes_line(runtimes: dict[str, str]) -> str:
    """The runtime each system ran on (its launch costs and CPU kernel efficiency), the line ``moesim replay``
    prints under its table: the runtimes shared by the most systems first."""
    groups: dict[str, list[str]] = {}
    for name, runtime in runtimes.items():
        groups.setdefault(runtime, []).append(name)
    return ("runtimes (launch costs, CPU kernel efficiency; --set runtime=NAME): "
            + "; ".join(f"{runtime} ({', '.join(names)})"
                        for runtime, names in sorted(groups.items(), key=lambda kv: -len(kv[1]))))


#: what a serving row shows: two systems alike in all of these at one rate are one row twice
SERVED = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_p99", "throughput_rps", "preemptions")


def serving_notes(rows: list[dict]) -> list[str]:
    """The runs' notes, each once, and the systems whose rows are identical at a rate (the notes, or a
    ``moesim replay`` of the two, say why)."""
    from moesim.analysis.report import shared_notes
    from moesim.analysis.serving import preemption_notes
    lines = [f"note: {n}" for n in shared_notes((m["system"], m["engine"]) for m in rows)]
    lines += [f"note: {note}" for note in preemption_notes(rows)]
    alike: dict[tuple, list[str]] = {}
    for m in rows:
        alike.setdefault((m["qps"], *(m[k] for k in SERVED)), []).append(m["system"])
    for key, names in alike.items():
        if len(names) > 1:
            lines.append(f"identical rows {', '.join(names)} at {key[0]:g} req/s (the notes say which mechanism "
                         f"did not act; `moesim replay TRACE --system {','.join(names)}` explains in full)")
    return lines


def _rates(qps: str, settings: dict[str, str], option: str = "--qps") -> list[str]:
    """The arrival rates of ``--qps`` (or of ``option``), each checked with the other settings before any
    run starts."""
    from moesim.errors import ConfigError
    from moesim.policy.base import SET_MAXIMUM
    from moesim.sim.workload import RATED_ARRIVALS, split_settings
    rates = [r.strip() for r in qps.split(",")]
    if not all(rates):
        raise ConfigError(f"an empty rate in '{qps}'", field=option, fix="give rates in requests/s, e.g. 0.5,1,2")
    from moesim.sim.serving import check_rate
    from moesim.util import host_bytes_available
    for rate in rates:
        try:
            workload = split_settings({**settings, "workload.qps": rate}).workload
            check_rate(workload, host_bytes_available())
            arrival = workload.arrival
        except ConfigError as err:
            if err.field != "workload.qps":
                raise
            if _is_rate(rate):  # a rate, refused with the others (too low for the requests): its own words
                err.rename_field(option)
                raise
            # the bound said: '1e308' is positive and finite, yet no rate
            raise ConfigError(f"'{rate}' is not a rate in requests/s", field=option,
                              fix=f"give positive finite rates up to {SET_MAXIMUM:g}, e.g. 0.5,1,2") from err
    if len(rates) > 1 and arrival not in RATED_ARRIVALS:  # every run would be the same
        raise ConfigError(f"workload.arrival={arrival} sets no rate, so {len(rates)} rates would run alike",
                          field="--qps", fix="give one --qps, or rates with workload.arrival=poisson or gamma")
    seen: dict[float, str] = {}
    for rate in rates:  # one rate twice ran twice, and its two rows were called two systems alike
        if float(rate) in seen:
            spelt = f" (as {seen[float(rate)]} and {rate})" if seen[float(rate)] != rate else ""
            raise ConfigError(f"the rate {rate} is given twice in '{qps}'{spelt}", field=option,
                              fix="give each rate once")
        seen[float(rate)] = rate
    return rates


def _is_rate(text: str) -> bool:
    """Whether ``text`` is a number of requests/s that --set takes: positive, finite, within its bound."""
    from moesim.policy.base import SET_MAXIMUM
    try:
        value = float(text)
    except ValueError:
        return False
    return 0 < value <= SET_MAXIMUM


def _rate_option(qps: str, qps_given: bool, settings: dict[str, str]) -> str:
    """The rates to run: --qps, or ``--set workload.qps`` when --qps is left at its default (every run's
    workload.qps is --qps, so the --set value was dropped unseen); both given is refused."""
    from moesim.errors import ConfigError
    if "workload.qps" not in settings:
        return qps
    if qps_given:
        raise ConfigError(f"the arrival rate is given twice: --qps {qps} and --set workload.qps="
                          f"{settings['workload.qps']}", field="--qps", fix="give it once (--qps takes several)")
    return settings["workload.qps"]


def _given_once(settings: dict[str, str], key: str, option: str, value: object) -> None:
    """Set ``key`` from its shorthand ``option``; both given is refused, as for --qps (the option won and the
    --set value was dropped unseen, while moesim.serve refuses the pair)."""
    from moesim.errors import ConfigError
    if value is None:
        return
    if key in settings:
        raise ConfigError(f"{key} is given twice: {option} {value} and --set {key}={settings[key]}", field=option,
                          fix="give it once")
    settings[key] = str(value)


def _check_read(settings: dict[str, str], rate: str, qps_given: bool) -> None:
    """Refuse a workload setting the arrival process ignores (--qps 5 with a closed loop ran as if unset)."""
    from moesim.sim.workload import check_read
    check_read({**settings, "workload.qps": rate}, [*settings, *(["workload.qps"] if qps_given else [])],
               {"workload.qps": "--qps"} if qps_given else None)


def _check_rated(settings: dict[str, str], rate: str) -> None:
    """--plot draws latency against the arrival rate: refused, before any run, for arrivals that set none
    (it drew empty axes)."""
    from moesim.errors import ConfigError
    from moesim.sim.workload import RATED_ARRIVALS, split_settings
    arrival = split_settings({**settings, "workload.qps": rate}).workload.arrival
    if arrival not in RATED_ARRIVALS:
        raise ConfigError(f"--plot draws latency against the arrival rate, and workload.arrival={arrival} sets none",
                          field="--plot", fix="leave out --plot (--requests-plot draws each request), or use "
                                              "workload.arrival=poisson or gamma")


def _requests_per_run(settings: dict[str, str]) -> int:
    """The requests each run finishes: workload.requests."""
    from moesim.sim.workload import split_settings
    # --qps replaces workload.qps in every run, so a --set value of it is never checked here
    return split_settings({k: v for k, v in settings.items() if k != "workload.qps"}).workload.requests


def _serving_progress(requests: int, runs: int):
    """Progress over the requests every run finishes (``runs``: systems x rates, of ``requests`` each)."""
    from moesim.progress import Progress
    return Progress("serve-sim", total=requests * runs, unit="requests", console=err_console)


def _skippable_in_serving(err: MoesimError) -> bool:
    """With --system all: errors of one system (it cannot serve, or lacks a column), not of the run."""
    from moesim.errors import ConfigError
    return isinstance(err, ConfigError) and err.field not in ("--set", "--model", "--slo", "scheduler") \
        and not (err.field or "").startswith(("workload.", "scheduler."))
