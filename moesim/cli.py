"""The ``moesim`` command line.

Every command turns bad input into one line on stderr and exit status 2
(:class:`moesim.errors.MoesimError`); nothing here prints a traceback for a
user mistake.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click
from rich.console import Console

from moesim.errors import MoesimError

console = Console(width=None if Console().is_terminal else 160)
err_console = Console(stderr=True)


def json_safe(data: object) -> object:
    """``data`` with NaN and infinities as None (JSON has no NaN: strict parsers and jq reject it)."""
    import math

    import numpy as np
    if isinstance(data, dict):
        return {str(k): json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    if isinstance(data, np.ndarray):
        return json_safe(data.tolist())
    if isinstance(data, (bool, np.bool_)):
        return bool(data)
    if isinstance(data, (int, np.integer)):
        return int(data)
    if isinstance(data, (float, np.floating)):
        return float(data) if math.isfinite(data) else None
    return data


def _write_json(data: object, out: str | None) -> None:
    text = json.dumps(json_safe(data), indent=2, sort_keys=True, default=str, allow_nan=False)
    if out in (None, "-"):
        click.echo(text)
    else:
        from moesim.util import atomic_write_text
        with _output(out, "--json") as path:
            atomic_write_text(path, text + "\n")


def _check_outputs(**outputs: str | None) -> None:
    """Every output path can be written: checked before any work starts (one line, exit 2)."""
    from moesim.util import check_output_path
    for option, path in outputs.items():
        if path and path != "-":
            check_output_path(path, "--" + option.replace("_", "-"))


def _output(path: str | Path, option: str):
    """Where a writer puts ``path``'s content (a special file such as /dev/null is written directly,
    never replaced); an OS error while writing becomes one line naming the file."""
    from moesim.util import output_file
    return output_file(path, option)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moesim")
def cli() -> None:
    """Simulate and compare MoE expert-offloading policies on one GPU plus a CPU.

    Bad input exits 2 with one line naming the file, the field and the fix;
    add --debug anywhere on the command line to see a traceback of an internal error.
    """


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
    from moesim.trace.validate import checked_meta
    checked_meta(file)
    stats = trace_stats(file)
    if as_json:
        _write_json(stats, None)
    else:
        render_stats(stats, console, title=file)


@trace.command("compare")
@click.argument("first", type=click.Path(dir_okay=False))
@click.argument("second", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print both statistics and the distances as JSON.")
def trace_compare(first: str, second: str, as_json: bool) -> None:
    """Statistics of two traces side by side, and how far apart their routing is: Jensen-Shannon divergence
    of per-layer expert popularity, reuse and co-activation differences."""
    from moesim.trace.stats import compare_traces, render_comparison
    from moesim.trace.validate import checked_meta
    checked_meta(first)
    checked_meta(second)
    both = compare_traces(first, second)
    if as_json:
        _write_json(both, None)
    else:
        render_comparison(both["a"], both["b"], console, names=(first, second), distances=both["distances"])


@trace.command("import")
@click.option("--format", "fmt", default=None, help="Source log format (see --list-formats).")
@click.argument("sources", nargs=-1, type=click.Path(exists=True))
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Output trace (.parquet).")
@click.option("--list-formats", is_flag=True, help="List the formats --format reads and exit.")
def trace_import(fmt: str | None, sources: tuple[str, ...], out: str | None, list_formats: bool) -> None:
    """Convert another tool's per-token routing log into a v1 trace."""
    from moesim.trace.importers import import_trace
    if list_formats:
        _print_formats()
        return
    for name, value, fix in (("--format", fmt, "see moesim trace import --list-formats"),
                             ("SOURCES", sources, "name the log files to convert"),
                             ("--out", out, "e.g. --out trace.parquet")):
        if not value:
            raise MoesimError("missing", field=name, fix=fix)
    _check_outputs(out=out)
    from moesim.progress import Progress
    with Progress("trace import", unit="files", console=err_console) as bar, _output(out, "--out") as path:
        bar.advance(0, label=", ".join(Path(s).name for s in sources[:3]) + (" ..." if len(sources) > 3 else ""))
        report = import_trace(fmt, [Path(s) for s in sources], path)
        bar.advance(len(sources))
    for line in report.summary_lines():
        console.print(line)


def _print_formats() -> None:
    """One line per import format: its name and the first line of its module's description."""
    import importlib

    from moesim.trace.importers import AGGREGATE_FORMATS, FORMATS
    for name in sorted(FORMATS):
        module = importlib.import_module(FORMATS[name].__module__)
        doc = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
        doc = doc.removeprefix(f"``{name}``:").strip()
        console.print(f"{name:<20} {doc}", markup=False, highlight=False, soft_wrap=True)
    for name in AGGREGATE_FORMATS:
        console.print(f"{name:<20} (refused: aggregate expert counts, not per-token routing)", markup=False,
                      highlight=False, soft_wrap=True)


@trace.command("synth")
@click.option("--model", "model", default=None,
              help="Model preset name or preset YAML [default with --fit: the real trace's model].")
@click.option("--requests", default=None, type=click.IntRange(min=1),
              help="Requests [default: 1, with --fit the real trace's].")
@click.option("--prompt-len", default=None, type=click.IntRange(min=1, max=1 << 20),
              help="Prompt tokens per request [default: 128, with --fit the real trace's mean].")
@click.option("--decode-len", default=None, type=click.IntRange(min=0, max=1 << 24),
              help="Decode tokens per request [default: 128, with --fit the real trace's mean].")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="Requests decoded together in one step [default: 1, with --fit the real trace's].")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Generator parameter (see `moesim trace synth --help-params`); wins over --fit.")
@click.option("--fit", "fit", default=None, type=click.Path(dir_okay=False), metavar="REAL.parquet",
              help="Fit skew, reuse, co-activation, weight and predictor parameters to this real trace first.")
@click.option("--no-scores", is_flag=True, help="Leave out the full `scores` column (smaller files).")
@click.option("--help-params", is_flag=True,
              help="List the generator parameters (default for --model, meaning) and exit.")
@click.option("--out", default=None, type=click.Path(dir_okay=False))
def trace_synth(model: str | None, requests: int | None, prompt_len: int | None, decode_len: int | None,
                batch: int | None, seed: int, settings: tuple[str, ...], fit: str | None, no_scores: bool,
                help_params: bool, out: str | None) -> None:
    """Synthesize a trace with realistic skew, locality, co-activation and predictor columns."""
    from moesim.trace.synth import SynthConfig, synthesize
    if help_params:
        _print_synth_params(model)
        return
    if out is None:
        raise MoesimError("missing", field="--out", fix="e.g. --out synthetic.parquet")
    _check_outputs(out=out)
    shape = {"requests": 1, "prompt_len": 128, "decode_len": 128, "batch": 1}
    fitted: dict[str, str] = {}
    if fit is not None:
        result = _fit(fit, seed)
        shape.update(result.shape)
        fitted = result.settings()
        if model is None:
            from moesim.trace.io import read_meta
            model = read_meta(fit).model
    if model is None:
        raise MoesimError("missing", field="--model", fix="name a preset, e.g. --model mixtral-8x7b, or --fit REAL")
    given = {"requests": requests, "prompt_len": prompt_len, "decode_len": decode_len, "batch": batch}
    shape.update({k: v for k, v in given.items() if v is not None})
    config = SynthConfig.from_settings(model=model, seed=seed, settings={**fitted, **_parse_settings(settings)},
                                       scores=not no_scores, **shape)
    if fit is not None:
        config.fitted_to = fit
    _check_synth_size(config.model, config.requests, config.prompt_len, config.decode_len)
    with _output(out, "--out") as path:
        synthesize(config, path)
    console.print(f"wrote {out}")


#: positions and steps are int32 in a trace; rows beyond this would take days to write anyway
SYNTH_MAX_ROWS = 2**31 - 1


def _check_synth_size(model, requests: int, prompt_len: int, decode_len: int) -> None:
    tokens = prompt_len + decode_len
    if tokens > 2**31 - 1:
        raise MoesimError(f"{tokens:,} tokens per request exceed the trace's int32 positions",
                          field="--prompt-len/--decode-len", fix="use fewer than 2,147,483,647 tokens per request")
    rows = requests * tokens * model.num_layers
    if rows > SYNTH_MAX_ROWS:
        raise MoesimError(f"{requests:,} requests x {tokens:,} tokens x {model.num_layers} layers = {rows:,} rows, "
                          f"beyond the limit of {SYNTH_MAX_ROWS:,}", field="--requests/--prompt-len/--decode-len",
                          fix="synthesize fewer or shorter requests")


def _fit(real: str, seed: int):
    """Fit the generator to ``real``, print fitted parameters and statistics against the real ones."""
    from rich.table import Table

    from moesim.progress import Progress
    from moesim.trace.synth import fit_params
    with Progress("fit", unit="candidate traces", console=err_console) as bar:
        result = fit_params(real, seed=seed, progress=lambda name: bar.advance(1, label=name))
    table = Table(title=f"fitted to {real} ({result.evaluations} candidate traces)", title_justify="left")
    for col in ("statistic", "real", "synthetic", "difference"):
        table.add_column(col, justify="left" if col == "statistic" else "right")
    errors = result.relative_errors()
    for stat, value in result.target.items():
        fitted = result.fitted.get(stat)
        table.add_row(stat, f"{value:.3f}", "-" if fitted is None else f"{fitted:.3f}",
                      f"{errors[stat]:.1%}" if stat in errors else "-")
    console.print(table)
    p = result.params
    console.print(f"parameters: skew_first={p.skew_first} skew_last={p.skew_last} request_bias={p.request_bias} "
                  f"cluster_strength={p.cluster_strength} token_corr={p.token_corr} score_scale={p.score_scale}",
                  markup=False, highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    return result


def _print_synth_params(model: str | None) -> None:
    from rich.table import Table

    from moesim.analysis.params import format_default, parameter_docs
    from moesim.model.presets import load_preset
    from moesim.trace.synth import SynthParams
    defaults = SynthParams.for_model(load_preset(model)) if model else None
    table = Table(title=f"generator parameters (--set KEY=VALUE), defaults for {model or 'no model'}"
                        + ("" if model else "; pass --model for a model's own defaults"), title_justify="left")
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("default", no_wrap=True)
    table.add_column("meaning", overflow="fold")
    for doc in parameter_docs(SynthParams):
        value = getattr(defaults, doc.name) if defaults else doc.default
        table.add_row(doc.name, format_default(value), doc.meaning or "(undocumented)")
    console.print(table)


def _parse_settings(settings: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in settings:
        if "=" not in item:
            raise MoesimError(f"--set '{item}' is not KEY=VALUE", fix="write e.g. --set cache.slots_per_layer=4")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


# ----------------------------------------------------------------------------- replay
from moesim.api import DEFAULT_HW, DEFAULT_SYSTEM  # noqa: E402 - one default for the API and the CLI


def _parse_window(text: str | None) -> tuple[int, int] | None:
    """``--window STEP:STEP`` (inclusive; ``STEP`` alone is one step) as (first, last)."""
    if text is None:
        return None
    first, sep, last = text.partition(":")
    try:
        lo = int(first)
        hi = int(last) if sep else lo
    except ValueError:
        raise MoesimError(f"'{text}' is not STEP:STEP", field="--window", fix="e.g. --window 10:12") from None
    if lo < 0 or hi < lo:
        raise MoesimError(f"'{text}' is not a range of steps", field="--window",
                          fix="give FIRST:LAST with 0 <= FIRST <= LAST, e.g. --window 10:12")
    return lo, hi


@cli.command()
@click.argument("trace_file", metavar="TRACE", required=False, type=click.Path(dir_okay=False))
@click.option("--hw", default=DEFAULT_HW, show_default=True,
              help="Hardware profile: a name in hwprofiles/ or a YAML path.")
@click.option("--system", "system", default=DEFAULT_SYSTEM, show_default=True,
              help="System to replay, or 'all' to compare every system (see `moesim systems`; "
                   "`moesim systems NAME` lists its parameters).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Parameter, e.g. cache.slots_per_layer=4, hw.pcie.bandwidth_scale=0.5, cache=lru "
                   "(see --help-params).")
@click.option("--model", "model_preset", default=None, help="Check the trace against this model preset.")
@click.option("--json", "json_out", default=None, metavar="OUT",
              help="Write metrics as JSON ('-': stdout, which then holds the JSON only; the table goes to stderr).")
@click.option("--timeline", "timeline_out", default=None, metavar="OUT.parquet", help="Write the timeline.")
@click.option("--chrome-trace", "chrome_out", default=None, metavar="OUT.json",
              help="Write a Chrome/Perfetto trace of the timeline.")
@click.option("--plot", "plot_out", default=None, metavar="OUT.png",
              help="Gantt of CPU, GPU and PCIe (with --system all: the time breakdown per system).")
@click.option("--window", "window", default=None, metavar="STEP:STEP",
              help="Steps the --plot Gantt shows, first and last inclusive [default: the first two].")
@click.option("--decisions", "decisions_out", default=None, metavar="OUT.parquet", help="Write the decision log.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--help-params", is_flag=True, help="List the --set parameters of --system (default, unit, meaning).")
def replay(trace_file: str | None, hw: str, system: str, settings: tuple[str, ...], model_preset: str | None,
           json_out: str | None, timeline_out: str | None, chrome_out: str | None, plot_out: str | None,
           window: str | None, decisions_out: str | None, seed: int, help_params: bool) -> None:
    """Replay TRACE through the simulator under one system or all of them."""
    from moesim.trace.io import keeping_decoded
    with keeping_decoded() if system == "all" else contextlib.nullcontext():  # every system: one decode
        _replay(trace_file, hw, system, settings, model_preset, json_out, timeline_out, chrome_out, plot_out,
                window, decisions_out, seed, help_params)


def _replay(trace_file: str | None, hw: str, system: str, settings: tuple[str, ...], model_preset: str | None,
            json_out: str | None, timeline_out: str | None, chrome_out: str | None, plot_out: str | None,
            window: str | None, decisions_out: str | None, seed: int, help_params: bool) -> None:
    from moesim.analysis.report import render_comparison_table, render_metrics
    from moesim.policy.systems import system_names
    if help_params:
        _print_system(system if system != "all" else DEFAULT_SYSTEM)
        return
    if trace_file is None:
        raise MoesimError("no trace given", field="TRACE",
                          fix="e.g. moesim replay traces/mixtral-8x7b-humaneval.parquet --system all")
    from moesim.trace.validate import checked_meta
    _check_outputs(json=json_out, timeline=timeline_out, chrome_trace=chrome_out, plot=plot_out,
                   decisions=decisions_out)
    out = err_console if json_out == "-" else console  # stdout holds the JSON only
    parsed = _parse_settings(settings)
    checked_meta(trace_file, ())  # required columns now; each system's own columns when it is set up
    steps = _parse_window(window)
    if steps and not plot_out:
        raise MoesimError("--window chooses the steps of the --plot Gantt", field="--window",
                          fix="add --plot OUT.png")
    systems = system_names() if system == "all" else [system]
    per_run_files = [o for o in (timeline_out, chrome_out, decisions_out) if o]
    if len(systems) > 1 and (per_run_files or steps):
        raise MoesimError("--timeline, --chrome-trace, --decisions and --window need a single system",
                          field="--system", fix="pass --system NAME")
    from moesim.policy.systems import SYSTEMS
    results = {}
    skipped: dict[str, str] = {}
    runs: dict = {}  # replays a portfolio bound (oracle) reuses: it runs every listed system too
    first_error: MoesimError | None = None
    with _replay_progress(trace_file, systems) as bar:
        for name in sorted(systems, key=lambda n: bool(n in SYSTEMS and SYSTEMS[n].portfolio)):
            try:
                results[name] = _replay_one(trace_file, hw, name, parsed, model_preset, seed, bar,
                                            record=bool(timeline_out or chrome_out or decisions_out
                                                        or (plot_out and len(systems) == 1)),
                                            decisions=bool(decisions_out), runs=runs)
            except MoesimError as err:
                if len(systems) == 1 or not _skippable(err, parsed):
                    raise
                skipped[name] = str(err)  # e.g. a system that needs a column this trace lacks
                first_error = first_error or err
    if not results:
        raise first_error  # nothing ran: the reason is the user's to fix, not a table of skips
    metrics_by_system = {name: results[name][0] for name in systems if name in results}
    _add_gap_to_lower_bound(metrics_by_system, runs, trace_file, hw, parsed)
    if len(systems) == 1:
        metrics_, frames = results[systems[0]]
        render_metrics(metrics_, out, title=f"{systems[0]} on {Path(trace_file).name} / {hw}")
        _write_outputs(metrics_, frames, json_out, timeline_out, chrome_out, plot_out, decisions_out,
                       meta={"trace": trace_file, "hw": hw, "system": systems[0]}, steps=steps, out=out)
    else:
        render_comparison_table(metrics_by_system, out, title=f"{Path(trace_file).name} on {hw}")
        from moesim.analysis.identical import decision_logs, identical_lines
        for line in identical_lines(metrics_by_system, decision_logs(trace_file, hw, parsed, model_preset=model_preset,
                                                                     seed=seed)):
            out.print(line, markup=False, highlight=False)
        for name, reason in skipped.items():
            from rich.markup import escape
            out.print(f"[yellow]skipped {name}:[/] {escape(reason)}", highlight=False)
        if json_out:
            _write_json(metrics_by_system, json_out)
        if plot_out:
            from moesim.analysis.plots import plot_breakdown
            with _output(plot_out, "--plot") as path:
                plot_breakdown(list(metrics_by_system.values()), path)
            out.print(f"wrote {plot_out}")


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


def _skippable(err: MoesimError, settings: dict[str, str]) -> bool:
    """Errors that concern one system only (a missing column, a cache it cannot fit), not the run;
    a --set value outside its valid range is the user's mistake for every system."""
    from moesim.errors import ConfigError
    if err.field in settings and "outside" in err.detail:
        return False
    return isinstance(err, ConfigError) and err.field not in ("--system", "--set", "--model")


def _replay_progress(trace_file: str, systems: list[str]):
    """Progress over every row each replay reads (an oracle's members run once, shared with the table)."""
    import pyarrow.parquet as pq

    from moesim.progress import Progress
    from moesim.sim.run import members
    from moesim.trace.io import read_meta
    read_meta(trace_file)  # a malformed trace fails here, with one line
    rows = pq.ParquetFile(trace_file).metadata.num_rows
    replays = {member for name in systems for member in members(name)}
    return Progress("replay", total=max(rows * len(replays), 1), unit="rows", console=err_console)


def _replay_one(trace_file: str, hw: str, system: str, settings: dict[str, str], model_preset: str | None,
                seed: int, bar, record: bool, decisions: bool, runs: dict | None = None) -> tuple[dict, dict]:
    from moesim.analysis.metrics import metrics
    from moesim.sim.engine import result_to_frames
    from moesim.sim.run import simulate
    bar.advance(0, label=system)
    result = simulate(trace_file, hw, system, settings, reuse=runs, model_preset=model_preset, seed=seed,
                      progress=lambda rows: bar.advance(rows), timeline=record, decisions=decisions)
    if runs is not None:
        runs[system] = result
    return metrics(result), result_to_frames(result)


def _write_outputs(metrics_: dict, frames: dict, json_out: str | None, timeline_out: str | None,
                   chrome_out: str | None, plot_out: str | None, decisions_out: str | None, meta: dict,
                   steps: tuple[int, int] | None = None, out: Console = console) -> None:
    if json_out:
        _write_json(metrics_, json_out)
    if timeline_out:
        from moesim.analysis.timeline import write_timeline
        with _output(timeline_out, "--timeline") as path:
            write_timeline(frames["timeline"], path)
        out.print(f"wrote {timeline_out}")
    if decisions_out:
        from moesim.analysis.timeline import write_decisions
        with _output(decisions_out, "--decisions") as path:
            write_decisions(frames["decisions"], path)
        out.print(f"wrote {decisions_out}")
    if chrome_out:
        from moesim.analysis.chrome import write_chrome_trace
        with _output(chrome_out, "--chrome-trace") as path:
            write_chrome_trace(frames["timeline"], path, meta)
        out.print(f"wrote {chrome_out} (open in https://ui.perfetto.dev)")
    if plot_out:
        from moesim.analysis.plots import plot_gantt
        with _output(plot_out, "--plot") as path:
            plot_gantt(frames["timeline"], path, steps=steps,
                       title=f"{meta['system']} on {Path(meta['trace']).name}")
        out.print(f"wrote {plot_out}")


@cli.command("systems")
@click.argument("name", required=False, metavar="[NAME]")
def systems_cmd(name: str | None) -> None:
    """List the systems; with NAME, every parameter of that system with its default, unit and meaning."""
    if name:
        _print_system(name)
        return
    from rich.table import Table

    from moesim.policy.systems import SYSTEMS
    narrow = Console(width=min(console.width, 100))
    table = Table(title="systems (`moesim systems NAME` lists a system's --set parameters)", title_justify="left",
                  show_lines=False)
    table.add_column("system", style="bold", no_wrap=True)
    table.add_column("components (cache / assign / prefetch, + substitute, defer)", ratio=2)
    table.add_column("what it does", ratio=3)
    for system, spec in SYSTEMS.items():
        label = system if spec.listed else f"{system}*"
        if spec.portfolio:
            parts = "best of " + ", ".join(spec.portfolio)
        else:
            parts = " / ".join((spec.cache, spec.assign, spec.prefetch))
            parts += "".join(f" + {getattr(spec, r)}" for r in ("substitute", "defer") if getattr(spec, r) != "none")
        table.add_row(label, parts, spec.description)
    narrow.print(table)
    narrow.print("* part of oracle, not run by --system all. Every system also takes engine.*, memory.*, "
                 "cache.slots_per_layer and hw.<profile field>, e.g. hw.pcie.bandwidth_scale.", markup=False,
                 highlight=False)


def _print_system(name: str) -> None:
    from rich.table import Table

    from moesim.analysis.params import format_default, system_parameter_docs
    from moesim.errors import ConfigError
    from moesim.policy.systems import SYSTEMS
    if name not in SYSTEMS:
        raise ConfigError(f"unknown system '{name}'", field="NAME", fix=f"use one of: {', '.join(SYSTEMS)}")
    console.print(f"[bold]{name}[/]: {SYSTEMS[name].description}", highlight=False)
    table = Table(title_justify="left", width=min(console.width, 120))
    table.add_column("--set key", style="bold", no_wrap=True)
    table.add_column("default", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    table.add_column("meaning", ratio=1, overflow="fold")
    for key, doc, note in system_parameter_docs(name):
        if doc is None:
            table.add_row(f"[cyan]{key}[/]", "", "", note, style="dim" if key.endswith("= none") else None)
        else:
            meaning = doc.meaning or "(undocumented)"
            table.add_row(key, format_default(doc.default), doc.unit or "-", meaning)
    console.print(table)
    console.print("hw.<field>: any hardware-profile field, e.g. hw.pcie.bandwidth_scale=0.5, hw.cpu.cores=16 "
                  "(hwprofiles/README.md documents them).", markup=False, highlight=False)


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
    from moesim.progress import Progress
    # on a terminal capture draws its own token bar; otherwise plain lines say it is alive
    with Progress("capture", console=err_console, enabled=not err_console.is_terminal) as bar:
        bar.advance(0, label=f"{model} -> {out}")
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
              help="local: a process pool whose workers each decode a trace once for all their points; the "
                   "better choice on one machine, where Ray runs on the same cores and only adds its start-up "
                   "and shut-down (5-9 s for a local instance, measured on 2 cores) and 1-2 s per worker to import "
                   "moesim. ray: Ray tasks (trace, profile and decoded trace shared per worker the same way), "
                   "for a cluster (--address) or sweeps larger than one machine.")
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
    _check_outputs(out=out)
    existed = Path(out).exists()
    spec = load_spec(spec_file)
    frame, summary = run_sweep(spec, out, workers=workers, engine=engine, address=address,
                               progress=True, console=err_console)
    console.print(f"{summary.points} points: {summary.ran} run, {summary.skipped} already in {out}, "
                  f"{summary.failed} failed ({summary.wall_s:.1f} s) -> {out}", markup=False, highlight=False)
    if summary.failed:
        errors = frame[frame["status"] != "ok"]
        if summary.failed == summary.points and not any(_internal(e) for e in errors["error"]):
            if not existed:  # nothing worth keeping: every point failed on its input
                Path(out).unlink(missing_ok=True)
            raise MoesimError(f"all {summary.points} points failed on bad input; the first: {errors['error'].iloc[0]}",
                              source=spec_file, fix="fix the spec (reasons in column 'error' of the output)")
        for _, row in errors.head(5).iterrows():
            err_console.print(f"failed: {row['system']} on {row['hw']} ({row['point_id']}): {row['error']}",
                              markup=False, highlight=False, soft_wrap=True)
        if len(errors) > 5:
            err_console.print(f"... and {len(errors) - 5} more (column 'error' of {out})", markup=False)
        sys.exit(1)


def _internal(error: str) -> bool:
    """A point's error from a bug (recorded with where it was raised), not from its input."""
    import re
    return re.search(r"\(at [\w.]+\.py:\d+\)$", str(error)) is not None


@cli.command("plot")
@click.argument("results", metavar="RESULTS.parquet", type=click.Path(dir_okay=False))
@click.option("--x", "x", required=True, metavar="PARAM|METRIC",
              help="Column on the x axis, e.g. cache.slots_per_layer, or a metric such as gpu_memory_gib.")
@click.option("--y", "y", required=True, metavar="METRIC", help="Metric on the y axis, e.g. tpot_ms_mean.")
@click.option("--hue", default=None, metavar="PARAM",
              help="One line (or bar, or marker colour) per value of this column [scatter default: system].")
@click.option("--facet", default=None, metavar="PARAM", help="One panel per value of this column.")
@click.option("--kind", type=click.Choice(["auto", "line", "scatter"]), default="auto", show_default=True,
              help="line: y averaged per x value; scatter: one marker per run with the Pareto front "
                   "(auto: scatter when --x is a metric, not a parameter).")
@click.option("--pareto/--no-pareto", default=True, show_default=True, help="Draw the Pareto front (scatter).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), metavar="FIG.png|svg|pdf")
def plot_cmd(results: str, x: str, y: str, hue: str | None, facet: str | None, kind: str, pareto: bool,
             out: str) -> None:
    """Plot a metric of a sweep against a parameter (points that differ in other parameters are averaged)
    or against another metric (scatter, e.g. --x gpu_memory_gib --y tpot_ms_mean, or --x tpot_ms_mean
    --y ttft_ms, with the Pareto front of the deployable systems)."""
    from moesim.analysis.figures import column, load_results, parameter_columns, plot_results, plot_scatter
    _check_outputs(out=out)
    frame = load_results(results)
    if kind == "auto":
        kind = "line" if column(frame, x, "--x", results) in parameter_columns(frame) else "scatter"
    if kind == "scatter":
        with _output(out, "--out") as path:
            plot_scatter(frame, x=x, y=y, hue=hue or ("system" if "system" in frame.columns else None),
                         facet=facet, pareto=pareto, path=path, source=results)
    else:
        with _output(out, "--out") as path:
            plot_results(frame, x=x, y=y, hue=hue, facet=facet, path=path, source=results)
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
    _check_outputs(out=out)
    frame = load_results(results)
    with _output(out, "--out") as path:
        write_report(frame, path, title=title or Path(results).name, gantt=gantt, source=results)
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
    from moesim.trace.validate import checked_meta
    _check_outputs(json=json_out, requests_out=requests_out, plot=plot_out)
    out = err_console if json_out == "-" else console  # stdout holds the JSON only
    for trace_file in traces:
        checked_meta(trace_file, ())
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
    out.print(table)
    for name, reason in skipped.items():
        from rich.markup import escape
        out.print(f"[yellow]skipped {name}:[/] {escape(reason)}", highlight=False)
    if json_out:
        _write_json(rows[0] if len(rows) == 1 else rows, json_out)
    if requests_out and last is not None:
        with _output(requests_out, "--requests-out") as path:
            write_requests(request_frame(last), path)
        out.print(f"wrote {requests_out}")
    if plot_out:
        with _output(plot_out, "--plot") as path:
            plot_latency_vs_qps(rows, path)
        out.print(f"wrote {plot_out}")


def _skippable_in_serving(err: MoesimError) -> bool:
    """With --system all: errors of one system (it cannot serve, or lacks a column), not of the run."""
    from moesim.errors import ConfigError
    return isinstance(err, ConfigError) and err.field not in ("--set", "--model", "--slo", "scheduler") \
        and not (err.field or "").startswith(("workload.", "scheduler."))


# ----------------------------------------------------------------------------- profile and validate
def _command_line() -> str:
    return "moesim " + " ".join(sys.argv[1:])


def _progress_labels(total: int, title: str):
    """Progress advanced once per label (:class:`moesim.progress.Progress`: a bar on a terminal, plain
    lines on stderr otherwise)."""
    from moesim.progress import Progress
    bar = Progress(title, total=total, console=err_console)

    def step(label: str) -> None:
        bar.advance(1, label=label)
    return bar, step


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MoesimError("the real backend needs torch", field="torch",
                          fix="pip install -e '.[torch]'") from None


def _measure(models, device: str, threads: int, quick: bool, name: str, out: Path) -> Path:
    _require_torch()
    from backends.profiler import ProfileConfig, measure_profile, measurement_labels, write_profile
    from backends.torch_backend import check_device
    check_device(device)
    config = ProfileConfig(models=tuple(models), device=device, threads=threads, quick=quick,
                           command=_command_line(), name=name)
    bar, step = _progress_labels(len(measurement_labels(config)), "profile")
    with bar:
        data = measure_profile(config, progress=step)
    return write_profile(data, out)


@cli.command("profile")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cuda: this GPU; cpu: the CPU-only stand-in (no GPU needed).")
@click.option("--model", "model_names", required=True, multiple=True,
              help="Model preset name or preset YAML: a shape measured (repeat for several shapes).")
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="Torch threads of the CPU expert pool (0: every core).")
@click.option("--quick", is_flag=True, help="Fewer points and repetitions (a quick look, not a reference).")
@click.option("--name", default="", help="Profile name (default: HOST-DEVICE).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output profile YAML.")
def profile_command(device: str, model_names: tuple[str, ...], threads: int, quick: bool, name: str,
                    out: str) -> None:
    """Measure a hardware profile v1 (every curve the cost model reads) for one or more model shapes."""
    from moesim.model.presets import load_preset
    models = [load_preset(model_name) for model_name in model_names]
    path = _measure(models, device, threads, quick, name, Path(out))
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
    from moesim.trace.validate import checked_meta as read_meta
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
        profile_path = str(_measure([read_meta(trace_file).model], device, threads, quick_profile, "",
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
def _say(text: str) -> None:
    err_console.print(text, markup=False, highlight=False, soft_wrap=True)


def _usage_line(err: click.UsageError) -> str:
    """click's usage error as one line, pointing to the command's --help."""
    command = err.ctx.command_path if err.ctx is not None else "moesim"
    return f"moesim: error: {err.format_message()} (see '{command} --help')".replace("\n", " ")


def _internal_error(err: BaseException) -> str:
    import traceback
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return (f"moesim: internal error{where}: {text[:300]}; please report this with the command line "
            "and the output of the same command with --debug")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; bad input exits 2 with one line, an internal error exits 1 with one line
    asking for a report (``--debug`` anywhere on the command line shows the traceback instead)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        cli.main(args=args, prog_name="moesim", standalone_mode=False)
    except MoesimError as err:
        _say(f"moesim: error: {err}")
        return err.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        _say("moesim: interrupted")
        return 130
    except click.UsageError as err:
        _say(_usage_line(err))
        return 2
    except click.ClickException as err:
        _say(f"moesim: error: {err.format_message()}".replace("\n", " "))
        return 2
    except BrokenPipeError:  # e.g. `moesim trace inspect T | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return 0
    except Exception as err:  # noqa: BLE001 - the last resort: one line, never a traceback
        if debug:
            raise
        _say(_internal_error(err))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
