"""The ``moesim`` command line.

Every command turns bad input into one line on stderr and exit status 2
(:class:`moesim.errors.MoesimError`); nothing here prints a traceback for a
user mistake.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console

from moesim.errors import MoesimError

console = Console(width=None if Console().is_terminal else 160)
err_console = Console(stderr=True)


def _write_json(data: object, out: str | None) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=float)
    if out in (None, "-"):
        click.echo(text)
    else:
        from moesim.util import atomic_write_text
        atomic_write_text(Path(out), text + "\n")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moesim")
def cli() -> None:
    """Simulate and compare MoE expert-offloading policies on one GPU plus a CPU."""


# ----------------------------------------------------------------------------- trace
@cli.group()
def trace() -> None:
    """Inspect, validate, import, synthesize and compare router traces."""


@trace.command("validate")
@click.argument("file", type=click.Path(dir_okay=False))
def trace_validate(file: str) -> None:
    """Check FILE against trace format v1."""
    from moesim.trace.validate import validate_trace
    summary = validate_trace(file)
    console.print(f"{file}: valid trace v1, {summary.rows:,} rows, {summary.steps:,} steps, "
                  f"columns: {', '.join(summary.columns)}")


@trace.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON under stable keys.")
def trace_inspect(file: str, as_json: bool) -> None:
    """Statistics of a trace: shape, skew, temporal reuse, co-activation, predictor recall."""
    from moesim.trace.stats import render_stats, trace_stats
    stats = trace_stats(file)
    if as_json:
        _write_json(stats, None)
    else:
        render_stats(stats, console, title=file)


@trace.command("compare")
@click.argument("first", type=click.Path(dir_okay=False))
@click.argument("second", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print both statistics as JSON.")
def trace_compare(first: str, second: str, as_json: bool) -> None:
    """Inspect statistics of two traces side by side."""
    from moesim.trace.stats import render_comparison, trace_stats
    a, b = trace_stats(first), trace_stats(second)
    if as_json:
        _write_json({"a": a, "b": b}, None)
    else:
        render_comparison(a, b, console, names=(first, second))


@trace.command("import")
@click.option("--format", "fmt", required=True, help="Source log format (see --list-formats).")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output trace (.parquet).")
def trace_import(fmt: str, sources: tuple[str, ...], out: str) -> None:
    """Convert another tool's per-token routing log into a v1 trace."""
    from moesim.trace.importers import import_trace
    report = import_trace(fmt, [Path(s) for s in sources], Path(out))
    for line in report.summary_lines():
        console.print(line)


@trace.command("synth")
@click.option("--model", "model", required=True, help="Model preset name or preset YAML.")
@click.option("--requests", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--decode-len", default=128, show_default=True, type=click.IntRange(min=0))
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="Requests decoded together in one step.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Generator parameter (see `moesim trace synth --help-params`).")
@click.option("--no-scores", is_flag=True, help="Leave out the full `scores` column (smaller files).")
@click.option("--out", required=True, type=click.Path(dir_okay=False))
def trace_synth(model: str, requests: int, prompt_len: int, decode_len: int, batch: int, seed: int,
                settings: tuple[str, ...], no_scores: bool, out: str) -> None:
    """Synthesize a trace with realistic skew, locality, co-activation and predictor columns."""
    from moesim.trace.synth import SynthConfig, synthesize
    config = SynthConfig.from_settings(model=model, requests=requests, prompt_len=prompt_len,
                                       decode_len=decode_len, batch=batch, seed=seed,
                                       settings=_parse_settings(settings), scores=not no_scores)
    path = synthesize(config, Path(out))
    console.print(f"wrote {path}")


def _parse_settings(settings: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in settings:
        if "=" not in item:
            raise MoesimError(f"--set '{item}' is not KEY=VALUE", fix="write e.g. --set cache.slots_per_layer=4")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


# ----------------------------------------------------------------------------- replay
DEFAULT_HW = "rtx4090"


@cli.command()
@click.argument("trace_file", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--hw", default=DEFAULT_HW, show_default=True,
              help="Hardware profile: a name in hwprofiles/ or a YAML path.")
@click.option("--system", "system", default="all", show_default=True,
              help="System to replay, or 'all' to compare every system (see `moesim systems`).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Parameter, e.g. cache.slots_per_layer=4, hw.pcie.bandwidth_scale=0.5, cache=lru.")
@click.option("--model", "model_preset", default=None, help="Check the trace against this model preset.")
@click.option("--json", "json_out", default=None, metavar="OUT", help="Write metrics as JSON ('-' for stdout).")
@click.option("--timeline", "timeline_out", default=None, metavar="OUT.parquet", help="Write the timeline.")
@click.option("--chrome-trace", "chrome_out", default=None, metavar="OUT.json",
              help="Write a Chrome/Perfetto trace of the timeline.")
@click.option("--plot", "plot_out", default=None, metavar="OUT.png",
              help="Gantt of CPU, GPU and PCIe (with --system all: the time breakdown per system).")
@click.option("--decisions", "decisions_out", default=None, metavar="OUT.parquet", help="Write the decision log.")
@click.option("--seed", default=0, show_default=True, type=int)
def replay(trace_file: str, hw: str, system: str, settings: tuple[str, ...], model_preset: str | None,
           json_out: str | None, timeline_out: str | None, chrome_out: str | None, plot_out: str | None,
           decisions_out: str | None, seed: int) -> None:
    """Replay TRACE through the simulator under one system or all of them."""
    from moesim.analysis.report import render_comparison_table, render_metrics
    from moesim.policy.systems import system_names
    parsed = _parse_settings(settings)
    systems = system_names() if system == "all" else [system]
    per_run_files = [o for o in (timeline_out, chrome_out, decisions_out) if o]
    if len(systems) > 1 and per_run_files:
        raise MoesimError("--timeline, --chrome-trace and --decisions need a single system",
                          field="--system", fix="pass --system NAME")
    from moesim.policy.systems import SYSTEMS
    results = {}
    skipped: dict[str, str] = {}
    runs: dict = {}  # replays a portfolio bound (oracle) reuses: it runs every listed system too
    for name in sorted(systems, key=lambda n: bool(n in SYSTEMS and SYSTEMS[n].portfolio)):
        try:
            results[name] = _replay_one(trace_file, hw, name, parsed, model_preset, seed,
                                        record=bool(timeline_out or chrome_out or decisions_out
                                                    or (plot_out and len(systems) == 1)),
                                        decisions=bool(decisions_out), runs=runs)
        except MoesimError as err:
            if len(systems) == 1 or not _skippable(err):
                raise
            skipped[name] = str(err)  # e.g. a system that needs a column this trace lacks
    metrics_by_system = {name: results[name][0] for name in systems if name in results}
    _add_gap_to_lower_bound(metrics_by_system, runs, trace_file, hw, parsed)
    if len(systems) == 1:
        metrics_, frames = results[systems[0]]
        render_metrics(metrics_, console, title=f"{systems[0]} on {Path(trace_file).name} / {hw}")
        _write_outputs(metrics_, frames, json_out, timeline_out, chrome_out, plot_out, decisions_out,
                       meta={"trace": trace_file, "hw": hw, "system": systems[0]})
    else:
        render_comparison_table(metrics_by_system, console, title=f"{Path(trace_file).name} on {hw}")
        from moesim.analysis.identical import decision_logs, identical_lines
        for line in identical_lines(metrics_by_system, decision_logs(trace_file, hw, parsed, model_preset=model_preset,
                                                                     seed=seed)):
            console.print(line, markup=False, highlight=False)
        for name, reason in skipped.items():
            from rich.markup import escape
            console.print(f"[yellow]skipped {name}:[/] {escape(reason)}", highlight=False)
        if json_out:
            _write_json(metrics_by_system, json_out)
        if plot_out:
            from moesim.analysis.plots import plot_breakdown
            plot_breakdown(list(metrics_by_system.values()), plot_out)
            console.print(f"wrote {plot_out}")


def _add_gap_to_lower_bound(by_system: dict[str, dict], runs: dict, trace_file: str, hw: str,
                            settings: dict[str, str]) -> None:
    """Each system's distance from its physical lower bound (its own memory plan, workload and defaults,
    e.g. mixtral-offloading's int4 experts)."""
    from moesim.sim.run import result_lower_bound, with_system_defaults
    memos: dict[tuple, dict] = {}
    for name, m in by_system.items():
        own = with_system_defaults(name, settings)
        memo = memos.setdefault(tuple(sorted(own.items())), {})
        bound = result_lower_bound(trace_file, hw, own, runs[name], memo)
        m["lower_bound"] = bound
        m["gap_to_lower_bound"] = m["makespan_s"] / bound["makespan_s"] if bound["makespan_s"] else float("nan")


def _skippable(err: MoesimError) -> bool:
    """Errors that concern one system only (a missing column, a cache it cannot fit), not the run."""
    from moesim.errors import ConfigError
    return isinstance(err, ConfigError) and err.field not in ("--system", "--set", "--model")


def _replay_one(trace_file: str, hw: str, system: str, settings: dict[str, str], model_preset: str | None,
                seed: int, record: bool, decisions: bool, runs: dict | None = None) -> tuple[dict, dict]:
    import pyarrow.parquet as pq
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from moesim.analysis.metrics import metrics
    from moesim.sim.engine import result_to_frames
    from moesim.sim.run import members, simulate
    from moesim.trace.io import read_meta
    read_meta(trace_file)  # a malformed trace fails here, with one line
    total_rows = pq.ParquetFile(trace_file).metadata.num_rows * len(members(system))
    with Progress(TextColumn(f"[bold]{system}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeRemainingColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:
        task = bar.add_task(system, total=max(total_rows, 1))
        result = simulate(trace_file, hw, system, settings, reuse=runs, model_preset=model_preset, seed=seed,
                          progress=lambda rows: bar.advance(task, rows), timeline=record, decisions=decisions)
    if runs is not None:
        runs[system] = result
    return metrics(result), result_to_frames(result)


def _write_outputs(metrics_: dict, frames: dict, json_out: str | None, timeline_out: str | None,
                   chrome_out: str | None, plot_out: str | None, decisions_out: str | None, meta: dict) -> None:
    if json_out:
        _write_json(metrics_, json_out)
    if timeline_out:
        from moesim.analysis.timeline import write_timeline
        write_timeline(frames["timeline"], timeline_out)
        console.print(f"wrote {timeline_out}")
    if decisions_out:
        from moesim.analysis.timeline import write_decisions
        write_decisions(frames["decisions"], decisions_out)
        console.print(f"wrote {decisions_out}")
    if chrome_out:
        from moesim.analysis.chrome import write_chrome_trace
        write_chrome_trace(frames["timeline"], chrome_out, meta)
        console.print(f"wrote {chrome_out} (open in https://ui.perfetto.dev)")
    if plot_out:
        from moesim.analysis.plots import plot_gantt
        plot_gantt(frames["timeline"], plot_out, title=f"{meta['system']} on {Path(meta['trace']).name}")
        console.print(f"wrote {plot_out}")


@cli.command("systems")
def systems_cmd() -> None:
    """List the systems and the parameters `--set` reaches."""
    from rich.table import Table

    from moesim.policy.systems import SYSTEMS, all_parameters
    from moesim.sim.run import common_parameters
    table = Table(title="systems", show_lines=True)
    table.add_column("system", style="bold")
    table.add_column("what it does")
    table.add_column("its --set parameters and component swaps")
    for name, spec in SYSTEMS.items():
        label = name if spec.listed else f"{name} (part of oracle)"
        table.add_row(label, spec.description, "\n".join(all_parameters(name)))
    console.print(table)
    console.print("Every system also takes: " + ", ".join(common_parameters()))


# ----------------------------------------------------------------------------- capture
@cli.command("capture")
@click.option("--model", "model", required=True, metavar="PATH_OR_ID",
              help="Checkpoint directory (config.json + *.safetensors) or Hugging Face model id.")
@click.option("--prompts", required=True, type=click.Path(dir_okay=False),
              help="Prompts: JSONL (field 'prompt' or 'text', or 'token_ids') or plain text, one per line.")
@click.option("--max-new-tokens", required=True, type=click.IntRange(min=0),
              help="Greedy tokens generated (and fed back: one decode step each) per prompt.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="Prompts generated together (left-padded) in one batch.")
@click.option("--calibration-prompts", default=None, type=click.Path(dir_okay=False),
              help="Prompts for fitting pred_residual and pred_next_token (never written to the trace).")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Weights dtype; auto keeps the checkpoint's.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda if present), cpu, cuda, cuda:N.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output trace (.parquet).")
def capture_command(model: str, prompts: str, max_new_tokens: int, batch: int, calibration_prompts: str | None,
                    dtype: str, device: str, out: str) -> None:
    """Record a Hugging Face MoE model's router decisions under greedy generation into a v1 trace."""
    from moesim.trace.capture import CaptureConfig, capture
    from moesim.trace.capture.model import require_torch
    require_torch()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    config = CaptureConfig(model=model, prompts=Path(prompts), out=Path(out), max_new_tokens=max_new_tokens,
                           batch=batch, calibration_prompts=Path(calibration_prompts) if calibration_prompts
                           else None, dtype=dtype, device=device)
    report = capture(config, progress=err_console.is_terminal)
    for line in report.summary_lines():
        console.print(line, markup=False, highlight=False)


# ----------------------------------------------------------------------------- sweep, plot, report
@cli.command("sweep")
@click.argument("spec_file", metavar="SPEC.yaml", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), metavar="RESULTS.parquet",
              help="Results, one row per point; points already in it are skipped.")
@click.option("--workers", default=None, type=click.IntRange(min=1), help="Parallel workers [default: all cores].")
@click.option("--engine", default="local", show_default=True, type=click.Choice(["local", "ray"]),
              help="local: a process pool; ray: Ray tasks.")
@click.option("--address", default=None, metavar="ADDR",
              help="Ray cluster to join (auto, or HEAD_IP:6379) [default: start a local Ray instance].")
def sweep_cmd(spec_file: str, out: str, workers: int | None, engine: str, address: str | None) -> None:
    """Replay every point of a grid over traces, hardware profiles, systems and --set parameters.

    \b
    SPEC.yaml (relative paths are relative to its folder):
      traces: [traces/mixtral-8x7b-humaneval.parquet]
      hw: [a100-40g, h100-pcie]
      systems: [gpu-only-lru, static-hot]        # or: all
      seeds: [0]
      set: {engine.staging_slots: 2}             # fixed for every point
      grid: {cache.slots_per_layer: [1, 2, 3]}   # cartesian product
      zip:                                       # varied together
        - {hw.pcie.bandwidth_scale: [0.5, 1.0], engine.kernels_per_expert: [3, 1]}

    Each finished point is saved at once (OUT.parts/, merged into OUT), so an
    interrupted sweep resumes where it stopped. A failed point is recorded with
    its error; the exit status is then 1.
    """
    from moesim.sweep import load_spec, run_sweep
    spec = load_spec(spec_file)
    frame, summary = run_sweep(spec, out, workers=workers, engine=engine, address=address,
                               progress=err_console.is_terminal, console=err_console)
    console.print(f"{summary.points} points: {summary.ran} run, {summary.skipped} already in {out}, "
                  f"{summary.failed} failed ({summary.wall_s:.1f} s) -> {out}", markup=False, highlight=False)
    if summary.failed:
        errors = frame[frame["status"] != "ok"]
        for _, row in errors.head(5).iterrows():
            err_console.print(f"failed: {row['system']} on {row['hw']} ({row['point_id']}): {row['error']}",
                              markup=False, highlight=False, soft_wrap=True)
        if len(errors) > 5:
            err_console.print(f"... and {len(errors) - 5} more (column 'error' of {out})", markup=False)
        sys.exit(1)


@cli.command("plot")
@click.argument("results", metavar="RESULTS.parquet", type=click.Path(dir_okay=False))
@click.option("--x", "x", required=True, metavar="PARAM", help="Column on the x axis, e.g. cache.slots_per_layer.")
@click.option("--y", "y", required=True, metavar="METRIC", help="Metric on the y axis, e.g. tpot_ms_mean.")
@click.option("--hue", default=None, metavar="PARAM", help="One line (or bar) per value of this column.")
@click.option("--facet", default=None, metavar="PARAM", help="One panel per value of this column.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), metavar="FIG.png|svg|pdf")
def plot_cmd(results: str, x: str, y: str, hue: str | None, facet: str | None, out: str) -> None:
    """Plot a metric of a sweep against a parameter (points that differ in other parameters are averaged)."""
    from moesim.analysis.figures import load_results, plot_results
    plot_results(load_results(results), x=x, y=y, hue=hue, facet=facet, path=out, source=results)
    console.print(f"wrote {out}")


@cli.command("report")
@click.argument("results", metavar="RESULTS.parquet", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), metavar="REPORT.html")
@click.option("--gantt/--no-gantt", default=True, show_default=True,
              help="Replay one point again to draw its CPU/GPU/PCIe Gantt chart (needs its trace).")
@click.option("--title", default=None, help="Page title [default: the results file name].")
def report_cmd(results: str, out: str, gantt: bool, title: str | None) -> None:
    """One self-contained HTML page (images embedded) with the standard figures and tables of a sweep."""
    from moesim.analysis.figures import load_results
    from moesim.analysis.html_report import write_report
    write_report(load_results(results), out, title=title or Path(results).name, gantt=gantt, source=results)
    console.print(f"wrote {out}")


# ----------------------------------------------------------------------------- serving workloads
@cli.command("serve-sim")
@click.argument("traces", nargs=-1, required=True, metavar="TRACE...", type=click.Path(dir_okay=False))
@click.option("--hw", default=DEFAULT_HW, show_default=True, help="Hardware profile: a name or a YAML path.")
@click.option("--system", "system", default="gpu-only-lru", show_default=True,
              help="System, several separated by commas, or 'all' (one run per system and QPS).")
@click.option("--qps", default="1", show_default=True, help="Arrival rate(s), requests/s, comma-separated.")
@click.option("--requests", "requests", default=None, type=click.IntRange(min=1),
              help="Requests sent (workload.requests, default 100).")
@click.option("--scheduler", default=None, help="static | vllm | sarathi | llamacpp (default vllm).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="workload.*, scheduler.* or any replay parameter, e.g. workload.arrival=gamma.")
@click.option("--slo", default=None, metavar="ttft_ms=..,tpot_ms=..", help="SLOs for goodput.")
@click.option("--json", "json_out", default=None, metavar="OUT", help="Write metrics as JSON ('-' for stdout).")
@click.option("--requests-out", "requests_out", default=None, metavar="OUT.parquet",
              help="Per-request TTFT, TPOT, latency and queueing (one run only).")
@click.option("--plot", "plot_out", default=None, metavar="OUT.png", help="Latency percentiles vs QPS per system.")
@click.option("--seed", default=0, show_default=True, type=int)
def serve_sim(traces: tuple[str, ...], hw: str, system: str, qps: str, requests: int | None, scheduler: str | None,
              settings: tuple[str, ...], slo: str | None, json_out: str | None, requests_out: str | None,
              plot_out: str | None, seed: int) -> None:
    """Serve requests drawn from TRACE... arriving over time, batched by a scheduler; per-request latencies."""
    from moesim.analysis.serving import parse_slo, plot_latency_vs_qps, request_frame, serving_metrics, write_requests
    from moesim.sim.serving import serve
    from moesim.trace.io import read_meta
    for trace_file in traces:
        read_meta(trace_file)
    parsed = _parse_settings(settings)
    if requests is not None:
        parsed["workload.requests"] = str(requests)
    if scheduler is not None:
        parsed["scheduler"] = scheduler
    slos = parse_slo(slo)
    if system == "all":
        from moesim.policy.systems import system_names
        systems = system_names()
    else:
        systems = [s.strip() for s in system.split(",") if s.strip()]
    rates = [r.strip() for r in qps.split(",") if r.strip()]
    if requests_out and len(systems) * len(rates) > 1:
        raise MoesimError("--requests-out needs one system and one QPS", field="--requests-out",
                          fix="pass a single --system and --qps")
    rows, last, skipped = [], None, {}
    for name in systems:
        try:
            for rate in rates:
                last = serve(list(traces), hw, name, {**parsed, "workload.qps": rate}, seed=seed)
                rows.append(serving_metrics(last, slos))
        except MoesimError as err:
            if system != "all" or not _skippable_in_serving(err):
                raise
            skipped[name] = str(err)  # a bound that needs the trace's future, a missing column
    from rich.table import Table
    table = Table(title=f"serving on {hw}", title_justify="left")
    for col in ("system", "QPS", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "E2E p99 ms", "req/s", "preempt",
                *(("goodput",) if slos else ())):
        table.add_column(col, justify="left" if col == "system" else "right")
    for m in rows:
        table.add_row(m["system"], f"{m['qps']:g}", f"{m['ttft_ms_p50']:.1f} / {m['ttft_ms_p99']:.1f}",
                      f"{m['tpot_ms_p50']:.1f} / {m['tpot_ms_p99']:.1f}", f"{m['e2e_ms_p99']:.1f}",
                      f"{m['throughput_rps']:.3f}", str(m["preemptions"]),
                      *((f"{m['goodput_rps']:.3f} ({m['slo_attainment']:.0%})",) if slos else ()))
    console.print(table)
    for name, reason in skipped.items():
        from rich.markup import escape
        console.print(f"[yellow]skipped {name}:[/] {escape(reason)}", highlight=False)
    if json_out:
        _write_json(rows[0] if len(rows) == 1 else rows, json_out)
    if requests_out and last is not None:
        write_requests(request_frame(last), requests_out)
        console.print(f"wrote {requests_out}")
    if plot_out:
        plot_latency_vs_qps(rows, plot_out)
        console.print(f"wrote {plot_out}")


def _skippable_in_serving(err: MoesimError) -> bool:
    """With --system all: errors of one system (it cannot serve, or lacks a column), not of the run."""
    from moesim.errors import ConfigError
    return isinstance(err, ConfigError) and err.field not in ("--set", "--model", "--slo", "scheduler") \
        and not (err.field or "").startswith(("workload.", "scheduler."))


# ----------------------------------------------------------------------------- profile and validate
def _command_line() -> str:
    return "moesim " + " ".join(sys.argv[1:])


def _progress_labels(total: int, title: str):
    """A rich progress bar advanced once per label (hidden when stderr is not a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn
    bar = Progress(TextColumn(f"[bold]{title}"), BarColumn(), TextColumn("{task.description}"),
                   console=err_console, transient=True, disable=not err_console.is_terminal)
    task = bar.add_task("", total=total)

    def step(label: str) -> None:
        bar.update(task, advance=1, description=label)
    return bar, step


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MoesimError("the real backend needs torch", field="torch",
                          fix="pip install -e '.[torch]'") from None


def _measure(model, device: str, threads: int, quick: bool, name: str, out: Path) -> Path:
    from moesim.hw.profiler import ProfileConfig, measure_profile, measurement_count, write_profile
    _require_torch()
    from backends.torch_backend import check_device
    check_device(device)
    config = ProfileConfig(model=model, device=device, threads=threads, quick=quick, command=_command_line(),
                           name=name)
    bar, step = _progress_labels(measurement_count(model), "profile")
    with bar:
        data = measure_profile(config, progress=step)
    return write_profile(data, out)


@cli.command("profile")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cuda: this GPU; cpu: the CPU-only stand-in (no GPU needed).")
@click.option("--model", "model_name", required=True, help="Model preset name or preset YAML: the shape measured.")
@click.option("--layers", default=None, type=click.IntRange(min=1),
              help="MoE layers of the profiled shape (curves are per layer; match `validate --layers`).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="Torch threads of the CPU expert pool (0: every core).")
@click.option("--quick", is_flag=True, help="Fewer points and repetitions (a quick look, not a reference).")
@click.option("--name", default="", help="Profile name (default: HOST-DEVICE).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output profile YAML.")
def profile_command(device: str, model_name: str, layers: int | None, threads: int, quick: bool, name: str,
                    out: str) -> None:
    """Measure a hardware profile v1 (every curve the cost model reads) for one model shape."""
    import dataclasses

    from moesim.model.presets import load_preset
    model = load_preset(model_name)
    if layers is not None:
        model = dataclasses.replace(model, num_layers=layers)
    path = _measure(model, device, threads, quick, name, Path(out))
    console.print(f"wrote {path} (load it with --hw {path} or --profile {path})")


@cli.command("validate")
@click.option("--real", is_flag=True, help="Execute on real kernels and compare with the simulator.")
@click.option("--trace", "trace_file", required=True, type=click.Path(dir_okay=False))
@click.option("--systems", required=True, help="Comma-separated systems, e.g. cpu-only,gpu-only-lru,static-hot.")
@click.option("--profile", "profile_path", default=None,
              help="Hardware profile of this machine (default: measure one first, into OUT/profile.yaml).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--layers", default=None, type=click.IntRange(min=1),
              help="Run only the first N MoE layers of the trace (models larger than host memory).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="Torch threads of the CPU expert pool (0: every core).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Parameter for both executors, e.g. cache.slots_per_layer=4.")
@click.option("--quick-profile", is_flag=True, help="Measure the profile with fewer points (tests).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Report directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
def validate_command(real: bool, trace_file: str, systems: str, profile_path: str | None, device: str,
                     layers: int | None, threads: int, settings: tuple[str, ...], quick_profile: bool, out: str,
                     as_json: bool) -> None:
    """Run the same trace and systems on real kernels and in the simulator; report errors and decision agreement."""
    from moesim.analysis.validation import (MEASURED_PROFILE_SETTINGS, run_validation, truncate_trace,
                                            write_report)
    from moesim.hw.profile import load_profile
    from moesim.sim.run import members
    from moesim.trace.io import read_meta
    if not real:
        raise MoesimError("only real-kernel validation exists", field="--real", fix="pass --real")
    names = [s.strip() for s in systems.split(",") if s.strip()]
    if not names:
        raise MoesimError("no system given", field="--systems", fix="e.g. --systems cpu-only,gpu-only-lru")
    for name in names:
        members(name)  # unknown systems fail here, before anything runs
    out_dir = Path(out)
    read_meta(trace_file)
    if layers is not None:
        trace_file = str(truncate_trace(trace_file, layers, out_dir / f"trace-{layers}-layers.parquet"))
    parsed = _parse_settings(settings)
    if profile_path is None:
        profile_path = str(_measure(read_meta(trace_file).model, device, threads, quick_profile, "",
                                    out_dir / "profile.yaml"))
    _require_torch()
    profile = load_profile(profile_path)
    if "measured by moesim profile" in profile.sources.get("gpu", ""):
        parsed = {**MEASURED_PROFILE_SETTINGS, **parsed}
    bar, step = _progress_labels(2 * len(names), "validate")
    with bar:
        report, results = run_validation(trace_file, names, profile, device=device, settings=parsed,
                                         threads=threads, command=_command_line(), profile_label=profile_path,
                                         progress=step)
    files = write_report(report, results, out_dir)
    if as_json:
        _write_json(report.to_dict(), None)
        return
    from rich.table import Table
    table = Table(title=f"{Path(trace_file).name}: simulated vs measured on {device}", title_justify="left")
    for col in ("system", "TTFT real/sim ms", "error", "TPOT real/sim ms", "error", "same decisions"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for c in report.systems:
        table.add_row(c.system, f"{c.real['ttft_ms']:.3f} / {c.sim['ttft_ms']:.3f}", f"{c.ttft_error_pct:+.1f}%",
                      f"{c.real['tpot_ms_mean']:.3f} / {c.sim['tpot_ms_mean']:.3f}", f"{c.tpot_error_pct:+.1f}%",
                      f"{c.decisions.share:.1%}")
    console.print(table)
    console.print(f"ranking by TPOT: {'same' if report.same_ranking('tpot_ms_mean') else 'DIFFERENT'}; "
                  f"wrote {files['markdown']}, {files['json']}, {files['plot']}")


# ----------------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="moesim", standalone_mode=False)
    except MoesimError as err:
        err_console.print(f"moesim: error: {err}", markup=False, highlight=False, soft_wrap=True)
        return err.exit_code
    except click.exceptions.Abort:
        err_console.print("moesim: interrupted", markup=False)
        return 130
    except click.ClickException as err:
        err.show()
        return 2
    except KeyboardInterrupt:
        err_console.print("moesim: interrupted", markup=False)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
