"""``moesim replay`` (one system, several, or all) and ``moesim systems``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from moesim.api import DEFAULT_HW, DEFAULT_SYSTEM  # one default for the API and the CLI
from moesim.cli.app import (HW_PROFILE, InputPath, PipeConsole, check_outputs, cli, console, err_console, hw_parts,
                            hw_title, open_output, parse_settings, setting_files, hw_help, preset_help, print_skipped, print_title,
                            say_wrote, to_stdout, write_json)
from moesim.analysis.params import system_record, system_records, system_rows
from moesim.errors import MoesimError
from moesim.hw.profile import profile_path
from moesim.util import FIGURE, PARQUET


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
@click.argument("trace_file", metavar="TRACE", required=False, type=InputPath(dir_okay=False))
@click.option("--hw", default=DEFAULT_HW, show_default=True, type=HW_PROFILE,
              help=hw_help())
@click.option("--system", "system", default=[DEFAULT_SYSTEM], multiple=True,
              help="System to replay; several separated by commas or repeated to compare them; 'all' for every "
                   f"system (see `moesim systems`; `moesim systems NAME` lists its parameters).  "
                   f"[default: {DEFAULT_SYSTEM}]")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Parameter, e.g. cache.slots_per_layer=4, hw.pcie.bandwidth_scale=0.5, cache=lru "
                   "(see --help-params).")
@click.option("--model", "model_preset", default=None,
              help=preset_help("Check the trace against this model preset (a name or a preset YAML)."))
@click.option("--json", "json_out", default=None, metavar="OUT",
              help="Write metrics as JSON ('-': stdout, which then holds the JSON only; the table goes to stderr; "
                   "--help-metrics lists the keys).")
@click.option("--timeline", "timeline_out", default=None, metavar="OUT.parquet", help="Write the timeline.")
@click.option("--chrome-trace", "chrome_out", default=None, metavar="OUT.json",
              help="Write a Chrome/Perfetto trace of the timeline.")
@click.option("--plot", "plot_out", default=None, metavar="OUT.png",
              help="Gantt of CPU, GPU and PCIe (with --system all: the time breakdown per system).")
@click.option("--window", "window", default=None, metavar="STEP:STEP",
              help="Steps the --plot Gantt and the --chrome-trace show, first and last inclusive [default: "
                   "the Gantt the first two, the Chrome trace every step].")
@click.option("--decisions", "decisions_out", default=None, metavar="OUT.parquet", help="Write the decision log.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1),
              help="Seed of the random choices some components make (dali's initial cache, substitute=random); "
                   "every other part of a replay is deterministic.")
@click.option("--help-params", is_flag=True,
              help="List the --set parameters of each --system (default, unit, meaning); with --json OUT, as "
                   "JSON (as `moesim systems NAME --json`).")
@click.option("--help-metrics", is_flag=True,
              help="List the keys of the --json metrics (unit, meaning); with --json OUT, as JSON.")
def replay(trace_file: str | None, hw: str, system: tuple[str, ...], settings: tuple[str, ...],
           model_preset: str | None, json_out: str | None, timeline_out: str | None, chrome_out: str | None,
           plot_out: str | None, window: str | None, decisions_out: str | None, seed: int,
           help_params: bool, help_metrics: bool) -> None:
    """Replay TRACE through the simulator under one system or all of them."""
    if help_metrics:
        _print_metric_docs(json_out)
        return
    from moesim.sim.run import columns_read
    from moesim.trace.io import keeping_decoded
    systems, everything = system_choice(system)
    several = len(systems) > 1  # one decode, with every optional column they read
    if several and not help_params:
        _check_parameters_taken(systems, parse_settings(settings))
    columns = set().union(*(columns_read(name, parse_settings(settings)) for name in systems)) if several else ()
    with keeping_decoded(columns) if several else contextlib.nullcontext():
        _replay(trace_file, hw, systems, everything, settings, model_preset, json_out, timeline_out, chrome_out,
                plot_out, window, decisions_out, seed, help_params)


def _replay(trace_file: str | None, hw: str, systems: list[str], everything: bool, settings: tuple[str, ...],
            model_preset: str | None, json_out: str | None, timeline_out: str | None, chrome_out: str | None,
            plot_out: str | None, window: str | None, decisions_out: str | None, seed: int,
            help_params: bool) -> None:
    from moesim.analysis.report import render_comparison_table, render_metrics
    if help_params:
        if json_out:  # `--json -` promises JSON on stdout, not the tables: what `moesim systems NAME --json` gives
            check_outputs(json=json_out)
            docs = [system_record(name) for name in systems]
            write_json(docs[0] if len(docs) == 1 else docs, json_out)
            return
        for name in systems:  # each system asked for, in turn
            _print_system(name)
        return
    if trace_file is None:
        raise MoesimError("no trace given", field="TRACE",
                          fix="e.g. moesim replay traces/mixtral-8x7b-humaneval.parquet --system all")
    from moesim.trace.validate import checked_meta
    parsed = parse_settings(settings)
    check_outputs([("TRACE", trace_file), ("--hw", str(profile_path(hw)))] + setting_files(parsed),
                  {"timeline": PARQUET, "decisions": PARQUET, "plot": FIGURE}, json=json_out,
                  timeline=timeline_out, chrome_trace=chrome_out, plot=plot_out, decisions=decisions_out)
    out = err_console if to_stdout(json_out) else console  # stdout holds the JSON only
    checked_meta(trace_file, ())  # required columns now; each system's own columns when it is set up
    steps = _parse_window(window)
    if steps and not (plot_out or chrome_out):
        raise MoesimError("--window chooses the steps of the --plot Gantt and the --chrome-trace",
                          field="--window", fix="add --plot OUT.png or --chrome-trace OUT.json")
    if steps:
        _check_window(trace_file, steps)
    per_run_files = [o for o in (timeline_out, chrome_out, decisions_out) if o]
    if len(systems) > 1 and (per_run_files or steps):
        raise MoesimError("--timeline, --chrome-trace, --decisions and --window need a single system",
                          field="--system", fix="pass --system NAME")
    from moesim.policy.systems import SYSTEMS
    results = {}
    skipped: dict[str, str] = {}
    runs: dict = {}  # replays a portfolio bound (oracle) reuses: it runs every listed system too
    first_error: MoesimError | None = None
    rows = _trace_rows(trace_file)
    with _replay_progress(rows, systems) as bar:
        for name in sorted(systems, key=lambda n: bool(n in SYSTEMS and SYSTEMS[n].portfolio)):
            before = bar.done
            try:
                results[name] = _replay_one(trace_file, hw, name, parsed, model_preset, seed, bar,
                                            record=bool(timeline_out or chrome_out or decisions_out
                                                        or (plot_out and len(systems) == 1)),
                                            decisions=bool(decisions_out), runs=runs)
            except MoesimError as err:
                if not everything or not _skippable(err, parsed):  # a system named is one the user wants
                    raise
                skipped[name] = str(err)  # e.g. a system that needs a column this trace lacks
                first_error = first_error or err
                if name not in runs:  # the rows its replay will not read count as done: the bar ends whole
                    bar.advance(max(rows - (bar.done - before), 0))
    if not results:
        raise first_error  # nothing ran: the reason is the user's to fix, not a table of skips
    metrics_by_system = {name: results[name][0] for name in systems if name in results}
    _add_gap_to_lower_bound(metrics_by_system, runs, trace_file, hw, parsed)
    inputs = {"trace": trace_file, "hw": hw, "settings": parsed, "seed": seed, "model": model_preset}
    parts = hw_parts(hw, parsed)
    if parts is not None:  # the profile's GPU and host CPU: a file name says neither
        inputs["hw_parts"] = parts
    for m in metrics_by_system.values():
        m["inputs"] = inputs  # what a saved JSON came from
    given = f" ({', '.join(f'{k}={v}' for k, v in parsed.items())})" if parsed else ""  # what the table is of
    if len(systems) == 1:
        metrics_, frames = results[systems[0]]
        print_title(out, f"{systems[0]} on {Path(trace_file).name} / {hw_title(hw, parsed, parts)}{given}")
        render_metrics(metrics_, out)
        _write_outputs(metrics_, frames, json_out, timeline_out, chrome_out, plot_out, decisions_out,
                       meta={"trace": trace_file, "hw": hw, "system": systems[0]}, steps=steps, out=out)
    else:
        print_title(out, f"{Path(trace_file).name} on {hw_title(hw, parsed, parts)}{given}")
        render_comparison_table(metrics_by_system, out)
        from moesim.analysis.identical import decision_logs, identical_lines
        for line in identical_lines(metrics_by_system, decision_logs(trace_file, hw, parsed, model_preset=model_preset,
                                                                     seed=seed)):
            out.print(line, markup=False, highlight=False)
        print_skipped(out, skipped, len(systems))
        if json_out:
            write_json({name: metrics_by_system.get(name) or {"system": name, "skipped": skipped[name],
                                                                "inputs": inputs} for name in systems}, json_out)
        if plot_out:
            from moesim.analysis.plots import plot_breakdown
            with open_output(plot_out, "--plot", FIGURE) as path:
                plot_breakdown(list(metrics_by_system.values()), path)
            say_wrote(out, f"wrote {plot_out}")


def _print_metric_docs(json_out: str | None = None) -> None:
    from moesim.analysis.metrics import METRIC_DOCS
    print_metric_docs(METRIC_DOCS, "keys of moesim replay --json (one object; with several systems, one per system)",
                      json_out)


def print_metric_docs(docs: dict, title: str, json_out: str | None = None) -> None:
    """``--help-metrics``: each key of a command's JSON with its unit and meaning, as a table, or with ``--json
    OUT`` as JSON."""
    from rich.table import Table
    if json_out:  # `--json -` promises JSON on stdout, not the table
        check_outputs(json=json_out)
        write_json({key: {"unit": doc.unit, "meaning": doc.meaning} for key, doc in docs.items()}, json_out)
        return
    table = Table(title=title, title_justify="left", width=min(console.width, 120))
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    table.add_column("meaning", ratio=1, overflow="fold")
    for key, doc in docs.items():
        table.add_row(key, doc.unit or "-", doc.meaning)
    console.print(table)


def _check_window(trace_file: str, steps: tuple[int, int]) -> None:
    """A --window that holds none of the trace's steps fails before the replay (its outputs would be empty)."""
    from moesim.trace.io import step_range
    have = step_range(trace_file)
    if have is None or steps[1] < have[0] or steps[0] > have[1]:
        raise MoesimError(f"no step in {steps[0]}:{steps[1]}", field="--window",
                          fix=f"the trace has steps {have[0]} to {have[1]}" if have else "the trace has no steps")


def system_choice(values: tuple[str, ...] | list[str] | str) -> tuple[list[str], bool]:
    """The systems of ``--system`` (comma-separated, repeatable; 'all' for the catalogue) and whether
    'all' was asked for (then a system that cannot run on this trace is skipped, not an error)."""
    from moesim.policy.systems import system_names
    names = [n.strip() for value in ([values] if isinstance(values, str) else values)
             for n in value.split(",") if n.strip()]
    if not names:
        raise MoesimError("no system given", field="--system", fix="e.g. --system gpu-only-lru or --system all")
    if "all" in names:
        return system_names(), True
    from moesim.policy.systems import check_system_name
    from moesim.sim.run import members
    for name in names:
        check_system_name(name, or_all=True)  # one line that offers 'all' too, which --system takes
        members(name)  # an unknown name fails now, before anything runs
    return list(dict.fromkeys(names)), False  # in the order given, each once


def _check_parameters_taken(systems: list[str], settings: dict[str, str]) -> None:
    """A component parameter (``prefetch.n``) that only some of the systems take is refused naming those that
    do: the replay refused it as unknown to the first that does not, and listed that one's parameters."""
    from moesim.policy.systems import ROLES
    swaps = {k: v for k, v in settings.items() if k in ROLES}  # a swapped component brings its own parameters
    for key, value in settings.items():
        if key.partition(".")[0] not in ROLES or key in ROLES or key in ("cache.slots", "cache.slots_per_layer"):
            continue  # engine.*, memory.*, hw.* and the slot counts: every system takes them
        takers = [name for name in systems if _takes(name, {**swaps, key: value})]
        if takers and len(takers) < len(systems):
            others = [name for name in systems if name not in takers]
            raise MoesimError(f"--set {key} is a parameter of {', '.join(takers)} only, not of {', '.join(others)}",
                              field=key, fix=f"replay --system {','.join(takers)} with it, the others without it")


def _takes(system: str, settings: dict[str, str]) -> bool:
    """Whether every single system a replay of ``system`` runs knows each parameter of ``settings`` (a value
    it refuses still counts as known: the replay then says what is wrong with it)."""
    from moesim.errors import ConfigError
    from moesim.sim.run import check_settings, members
    for member in members(system):
        try:
            check_settings(member, settings)
        except ConfigError as err:
            if err.field == "--set":  # unknown to this system (a bad value names the parameter instead)
                return False
    return True


def _add_gap_to_lower_bound(by_system: dict[str, dict], runs: dict, trace_file: str, hw: str,
                            settings: dict[str, str]) -> None:
    """Each system's distance from its physical lower bound (:func:`moesim.sim.run.add_lower_bound`: its own
    memory plan, workload and defaults, e.g. mixtral-offloading's int4 experts)."""
    from moesim.progress import Progress
    from moesim.sim.run import add_lower_bound
    memos: dict[tuple, dict] = {}
    with Progress("lower bounds", total=len(by_system), unit="systems", console=err_console) as bar:
        for name, m in by_system.items():
            bar.advance(0, label=name)
            add_lower_bound(m, runs[name], trace_file, hw, name, settings, memos)
            bar.advance(1)


def _skippable(err: MoesimError, settings: dict[str, str]) -> bool:
    """Errors that concern one system only (a missing column, a cache it cannot fit), not the run;
    a --set value outside its valid range is the user's mistake for every system."""
    from moesim.errors import ConfigError
    if err.field in settings and "outside" in err.detail:
        return False
    return isinstance(err, ConfigError) and err.field not in ("--system", "--set", "--model")


def _trace_rows(trace_file: str) -> int:
    from moesim.trace.io import _open, read_meta
    read_meta(trace_file)  # a malformed trace fails here, with one line
    return _open(trace_file).metadata.num_rows


def _replay_progress(rows: int, systems: list[str]):
    """Progress over every row each replay reads (``rows`` each; an oracle's members run once, shared with
    the table)."""
    from moesim.progress import Progress
    from moesim.sim.run import members
    replays = {member for name in systems for member in members(name)}
    return Progress("replay", total=max(rows * len(replays), 1), unit="rows", console=err_console)


def _replay_one(trace_file: str, hw: str, system: str, settings: dict[str, str], model_preset: str | None,
                seed: int, bar, record: bool, decisions: bool, runs: dict | None = None) -> tuple[dict, dict]:
    from moesim.analysis.metrics import metrics
    from moesim.sim.result import result_to_frames
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
    lead, on = _timeline_member(metrics_) or (None, "")
    if lead:  # a portfolio's timeline and logs are its best member's on TPOT (makespan): say whose
        meta = {**meta, "timeline_of": lead}
    shown = f"{meta['system']} (timeline of {lead}, its best schedule on {on})" if lead else meta["system"]
    whose = f" ({lead}'s, {meta['system']}'s best schedule on {on})" if lead else ""  # the file does not say
    if json_out:
        write_json(metrics_, json_out)
    if timeline_out:
        from moesim.analysis.timeline import write_timeline
        with open_output(timeline_out, "--timeline") as path:
            write_timeline(frames["timeline"], path)
        say_wrote(out, f"wrote {timeline_out}{whose}")
    if decisions_out:
        from moesim.analysis.timeline import write_decisions
        with open_output(decisions_out, "--decisions") as path:
            write_decisions(frames["decisions"], path)
        say_wrote(out, f"wrote {decisions_out}{whose}")
    if chrome_out:
        from moesim.analysis.chrome import write_chrome_trace
        with open_output(chrome_out, "--chrome-trace") as path:
            write_chrome_trace(frames["timeline"], path, meta, steps=steps)
        say_wrote(out, f"wrote {chrome_out} (open in https://ui.perfetto.dev)")
    if plot_out:
        from moesim.analysis.plots import plot_gantt, settings_note
        with open_output(plot_out, "--plot", FIGURE) as path:
            inputs = metrics_.get("inputs") or {}
            machine = hw_title(str(inputs.get("hw", "")), inputs.get("settings") or {}, inputs.get("hw_parts"))
            # the --set values, as the table's title gives them: two replays that differ in them drew the same title
            plot_gantt(frames["timeline"], path, steps=steps,
                       title=f"{shown} on {Path(meta['trace']).name} / {machine}"
                             f"{settings_note(inputs.get('settings') or {})}")
        say_wrote(out, f"wrote {plot_out}")


def _timeline_member(metrics_: dict) -> tuple[str, str] | None:
    """The member of a portfolio bound (oracle) whose replay its timeline, decisions and Chrome trace are, and
    the metric it is best on: the one that gave its TPOT, or its makespan on a trace without decode steps (whose
    outputs said 'best schedule on TPOT' too); None for any other system."""
    given = dict(part.split("=", 1) for part in (metrics_.get("portfolio_best") or "").split("; ") if "=" in part)
    if given.get("tpot_ms_mean"):
        return given["tpot_ms_mean"], "TPOT"
    return (given["makespan_s"], "makespan") if given.get("makespan_s") else None


@cli.command("systems")
@click.argument("name", required=False, metavar="[NAME]")
@click.option("--json", "json_out", default=None, metavar="OUT",
              help="Write the list (with NAME: the system's parameters) as JSON ('-': stdout).")
def systems_cmd(name: str | None, json_out: str | None) -> None:
    """List the systems; with NAME, every parameter of that system with its default, unit and meaning."""
    if json_out:
        check_outputs(json=json_out)
        write_json(system_record(name) if name else system_records(), json_out)
        return
    if name:
        _print_system(name)
        return
    from rich.table import Table

    from moesim.policy.systems import SYSTEMS
    narrow = PipeConsole(markup=False, width=min(console.width, 100))
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
                 highlight=False, soft_wrap=False)  # wrapped to the table's 100 columns, piped or not


def _print_system(name: str) -> None:
    from rich.table import Table
    from rich.text import Text

    from moesim.analysis.params import format_default
    from moesim.policy.systems import SYSTEMS, check_system_name
    check_system_name(name, field="NAME")
    console.print(f"[bold]{name}[/]: {escape(SYSTEMS[name].description)}", highlight=False, markup=True)
    table = Table(title_justify="left", width=min(console.width, 120))
    table.add_column("--set key", style="bold", no_wrap=True)
    table.add_column("default", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    table.add_column("meaning", ratio=1, overflow="fold")
    for key, doc, note in system_rows(name):
        if doc is None:
            table.add_row(Text(key, style="cyan"), "", "", note, style="dim" if key.endswith("= none") else None)
        else:
            meaning = doc.meaning or "(undocumented)"
            table.add_row(key, format_default(doc.default), doc.unit or "-", meaning)
    console.print(table)
    console.print("hw.<field>: any hardware-profile field, e.g. hw.pcie.bandwidth_scale=0.5, hw.cpu.cores=16 "
                  "(hwprofiles/README.md documents them).", markup=False, highlight=False)
