"""``moesim trace``: validate, inspect, compare, import, synthesize and upgrade traces."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import click

from moesim.cli.app import (InputPath, JsonFlagCommand, check_outputs, cli, console, err_console, open_output,
                            parse_settings, preset_help, say_wrote, write_json)
from moesim.cli.measure_cmd import capture_command
from moesim.errors import MoesimError
from moesim.util import PARQUET


@cli.group()
def trace() -> None:
    """Inspect, validate, import, synthesize, compare and upgrade router traces (capture one from a model with
    `moesim capture`, also `moesim trace capture`)."""


# `moesim trace capture`, where one looks for it beside import and synth: the same command as `moesim capture`
trace.add_command(capture_command, "capture")


@trace.command("validate", cls=JsonFlagCommand)
# a folder is refused by validate_trace, not by click, so that --json says so as it says every other fault
@click.argument("file", type=InputPath())
@click.option("--json", "as_json", is_flag=True,
              help="Print the result as JSON: ok, and the problem found (the check stops at the first) "
                   "(stdout; --json - the same; the exit status is as without it).")
def trace_validate(file: str, as_json: bool) -> None:
    """Check FILE against the trace format (docs/trace-format.md; version 2, or 1)."""
    from moesim.trace.io import read_meta
    from moesim.trace.validate import validate_trace
    from moesim.trace.validated import record_validated
    try:
        with _reading_rows("trace validate", [file], passes=1, validation=False) as progress:
            summary = validate_trace(file, progress=progress("checking"))  # always the whole pass, recorded or not
    except MoesimError as err:
        if as_json:  # the JSON says what is wrong; the error line and exit status stay as without --json
            write_json(_validation_json(file, problem=err), None)
        raise
    record_validated(file)
    version = read_meta(file).schema_version
    if as_json:
        write_json(_validation_json(file, summary=summary, version=version), None)
        return
    console.print(f"{file}: valid trace v{version}, {summary.rows:,} rows, {summary.steps:,} steps, "
                  f"columns: {', '.join(summary.columns)}")


@contextmanager
def _reading_rows(title: str, files: list[str], passes: int,
                  validation: bool = True) -> Iterator[Callable[[str], Callable[[int], None]]]:
    """Progress over the rows a command reads: ``passes`` over each file, plus the validation pass over each
    file not recorded as valid (``validation``). Yields ``progress(label)``, the callback of one pass: a
    10-million-row trace takes minutes to count, which a silent command would leave unexplained."""
    from moesim.progress import Progress
    from moesim.trace.validate import will_validate
    rows = [_rows_in(f) for f in files]
    checked = {f: _rows_in(f) for f in files if validation and will_validate(f)}  # a file given twice: once
    total = None if None in rows or None in checked.values() else sum(rows) * passes + sum(checked.values())
    with Progress(title, total=total or None, unit="rows", console=err_console) as bar:
        yield lambda label: (lambda n: bar.advance(n, label=label))


def _rows_in(file: str) -> int | None:
    """The rows of a trace per its footer (None where it cannot be read: the validation pass then says why)."""
    from moesim.trace.io import _open
    try:
        return _open(file).metadata.num_rows
    except MoesimError:
        return None


def _validation_json(file: str, *, summary=None, version: int | None = None,
                     problem: MoesimError | None = None) -> dict:
    """``trace validate --json``: the same keys whether the trace passed or not (None where unknown)."""
    problems = [] if problem is None else [{"message": str(problem), "field": problem.field, "row": problem.row,
                                            "fix": problem.fix}]
    return {"file": file, "ok": problem is None, "problems": problems, "schema_version": version,
            "rows": summary.rows if summary else None, "steps": summary.steps if summary else None,
            "requests": summary.requests if summary else None, "columns": summary.columns if summary else None}


@trace.command("inspect", cls=JsonFlagCommand)
@click.argument("file", type=InputPath(dir_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Print the statistics as JSON under stable keys (stdout; --json - the same).")
def trace_inspect(file: str, as_json: bool) -> None:
    """Statistics of a trace: shape, skew, temporal reuse, co-activation, predictor recall."""
    from moesim.trace.stats import render_stats, trace_stats
    from moesim.trace.validate import checked_meta
    with _reading_rows("trace inspect", [file], passes=1) as progress:
        checked_meta(file, progress=progress("checking"))
        stats = trace_stats(file, validate=False, progress=progress("counting"))
    if as_json:
        write_json(stats, None)
    else:
        render_stats(stats, console, title=file)


@trace.command("compare", cls=JsonFlagCommand)
@click.argument("first", type=InputPath(dir_okay=False))
@click.argument("second", type=InputPath(dir_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Print both statistics and the distances as JSON (stdout; --json - the same).")
def trace_compare(first: str, second: str, as_json: bool) -> None:
    """Statistics of two traces side by side, and how far apart their routing is: Jensen-Shannon divergence
    of per-layer expert popularity, reuse and co-activation differences."""
    from moesim.trace.stats import compare_traces, render_comparison
    from moesim.trace.validate import checked_meta
    with _reading_rows("trace compare", [first, second], passes=1) as progress:
        checked_meta(first, progress=progress(f"checking {Path(first).name}"))
        checked_meta(second, progress=progress(f"checking {Path(second).name}"))
        both = compare_traces(first, second, progress=progress("counting"))
    if as_json:
        write_json(both, None)
    else:
        render_comparison(both["a"], both["b"], console, names=(first, second), distances=both["distances"])


@trace.command("upgrade")
@click.argument("file", type=InputPath(dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The trace in format v2 (.parquet).")
def trace_upgrade(file: str, out: str) -> None:
    """Write FILE in trace format v2: the same rows, scores as one binary value a row (docs/trace-format.md)."""
    from moesim.trace.upgrade import upgrade_trace
    check_outputs([("FILE", file)], {"out": PARQUET}, out=out)
    with _reading_rows("trace upgrade", [file], passes=2, validation=False) as progress, open_output(out, "--out") as path:
        done = upgrade_trace(file, path, progress=progress("writing"))
    what = ("scores rewritten as one binary value a row" if done.rewrote_scores else
            "scores already one binary value a row" if done.has_scores else "no scores column")
    say_wrote(console, f"wrote {out}: trace v2 from v{done.from_version}, {done.rows:,} rows, {what}")


@trace.command("import")
@click.option("--format", "fmt", default=None,
              help="Source log format (see --list-formats); by default told from the files' first records.")
@click.argument("sources", nargs=-1, type=InputPath(exists=True))
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Output trace (.parquet).")
@click.option("--list-formats", is_flag=True, help="List the formats --format reads and exit.")
def trace_import(fmt: str | None, sources: tuple[str, ...], out: str | None, list_formats: bool) -> None:
    """Convert another tool's per-token routing log into a trace."""
    from moesim.trace.importers import import_trace
    if list_formats:
        _print_formats()
        return
    for name, value, fix in (("SOURCES", sources, "name the log files to convert"),
                             ("--out", out, "e.g. --out trace.parquet")):
        if not value:
            raise MoesimError("missing", field=name, fix=fix)
    check_outputs([("SOURCES", source) for source in sources], {"out": PARQUET}, out=out)
    from moesim.progress import Progress
    # in bytes of the logs read (a long log was '0 files' until it was all imported); MiB, or KiB for small logs
    total = sum(Path(s).stat().st_size for s in sources if Path(s).is_file())
    unit, scale = ("MiB", 2**20) if total >= 10 * 2**20 else ("KiB", 2**10)
    with Progress("trace import", total=total / scale or None, unit=unit, console=err_console) as bar, \
            open_output(out, "--out") as path:
        bar.advance(0, label=", ".join(Path(s).name for s in sources[:3]) + (" ..." if len(sources) > 3 else ""))
        report = import_trace(fmt, [Path(s) for s in sources], path,
                              progress=lambda nbytes, log: bar.advance(nbytes / scale, label=log.name))
        report.out = Path(out)  # where it lands, not the file it was written to first
    for line in report.summary_lines():  # each one line however long (a pipe's console wraps at 160 columns)
        console.print(line, markup=False, highlight=False, soft_wrap=True)


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
              help=preset_help("Model preset name or preset YAML [default with --fit: the real trace's model]."))
@click.option("--requests", default=None, type=click.IntRange(min=1),
              help="Requests [default: 1, the entries of --prompt-lens/--decode-lens, or with --fit the real "
                   "trace's].")
@click.option("--prompt-len", default=None, type=click.IntRange(min=1, max=1 << 20),
              help="Prompt tokens of every request [default: 128, with --fit each real request's own].")
@click.option("--decode-len", default=None, type=click.IntRange(min=0, max=1 << 24),
              help="Decode tokens of every request [default: 128, with --fit each real request's own].")
@click.option("--prompt-lens", default=None, metavar="N,N,...|@FILE",
              help="Prompt tokens of each request in order, e.g. 12,300,40 (at least 1 each), or @FILE with the "
                   "numbers separated by commas, spaces or lines; one per request (sets --requests when not "
                   "given). Instead of --prompt-len; wins over --fit.")
@click.option("--decode-lens", default=None, metavar="N,N,...|@FILE",
              help="Decode tokens of each request in order (0 or more each), as --prompt-lens.")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="Requests decoded together in one step (a request that has decoded all its tokens leaves the "
                   "steps after it) [default: 1, with --fit the real trace's].")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Generator parameter (see `moesim trace synth --help-params`); wins over --fit.")
@click.option("--fit", "fit", default=None, type=InputPath(dir_okay=False), metavar="REAL.parquet",
              help="Fit skew, reuse, co-activation, weight and predictor parameters to this real trace first; the "
                   "synthetic requests take its requests' prompt and decode lengths, in order (repeated when "
                   "--requests asks for more), unless lengths are given.")
@click.option("--no-scores", is_flag=True, help="Leave out the full `scores` column (smaller files).")
@click.option("--help-params", is_flag=True,
              help="List the generator parameters (default for --model, meaning) and exit.")
@click.option("--out", default=None, type=click.Path(dir_okay=False))
def trace_synth(model: str | None, requests: int | None, prompt_len: int | None, decode_len: int | None,
                prompt_lens: str | None, decode_lens: str | None, batch: int | None, seed: int,
                settings: tuple[str, ...], fit: str | None, no_scores: bool, help_params: bool,
                out: str | None) -> None:
    """Synthesize a trace with realistic skew, locality, co-activation and predictor columns."""
    from moesim.trace.synth import SynthConfig, synth_rows, synthesize
    if help_params:
        _print_synth_params(model)
        return
    if out is None:
        raise MoesimError("missing", field="--out", fix="e.g. --out synthetic.parquet")
    check_outputs([("--fit", fit)], {"out": PARQUET}, out=out)
    lists: dict[str, list[int]] = {}  # the per-request lengths given, by SynthConfig field
    for name, values in (("prompt_lens", _length_list(prompt_lens, "--prompt-lens", prompt_len, "--prompt-len", 1)),
                         ("decode_lens", _length_list(decode_lens, "--decode-lens", decode_len, "--decode-len", 0))):
        if values is not None:
            lists[name] = values
    shape = {"requests": 1, "prompt_len": 128, "decode_len": 128, "batch": 1}
    given = {k: v for k, v in {"requests": requests, "prompt_len": prompt_len, "decode_len": decode_len,
                               "batch": batch}.items() if v is not None}
    if requests is None and lists:  # the first list sets the count; the other must agree with it
        given["requests"] = len(next(iter(lists.values())))
    _check_list_counts(lists, given.get("requests"), requests is not None)
    chosen = parse_settings(settings, example="skew_first=0.5")
    fitted: dict[str, str] = {}
    result = None
    if fit is not None:
        from moesim.trace.validate import checked_meta
        real_model = checked_meta(fit).model
        # a bad --model or --set is refused before the fit, which draws dozens of candidate traces
        SynthConfig.from_settings(model=model or real_model, seed=seed, settings=chosen, **{**shape, **given})
        result = _fit(fit, seed)
        shape.update(result.shape)
        fitted = result.settings()
        model = model or real_model
        lists = {**_fitted_lengths(result, given.get("requests", shape["requests"]), given), **lists}
    if model is None:
        raise MoesimError("missing", field="--model", fix="name a preset, e.g. --model mixtral-8x7b, or --fit REAL")
    config = SynthConfig.from_settings(model=model, seed=seed, settings={**fitted, **chosen},
                                       scores=not no_scores, **{**shape, **given}, **lists)
    if fit is not None:
        config.fitted_to = fit
        _note_other_model(real_model, config.model)
        _print_lengths(result, config)
    _check_synth_size(config)
    from moesim.progress import Progress
    rows = synth_rows(config)
    with Progress("trace synth", total=rows, unit="rows", console=err_console) as bar, \
            open_output(out, "--out") as path:
        synthesize(config, path, progress=bar.advance)
    say_wrote(console, f"wrote {out}: {rows:,} rows")


def _length_list(text: str | None, option: str, scalar: int | None, scalar_option: str,
                 minimum: int) -> list[int] | None:
    """The numbers of --prompt-lens/--decode-lens (a comma list or @FILE), checked, or None when not given."""
    import re

    from moesim.trace.synth_params import checked_lengths
    if text is None:
        return None
    if scalar is not None:
        raise MoesimError(f"given with {scalar_option}", field=option,
                          fix=f"give {scalar_option} (every request) or {option} (each request), not both")
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise MoesimError(f"cannot read {text[1:]}: {getattr(err, 'strerror', None) or err}", field=option,
                              fix=f"{option} @FILE with FILE a text file of numbers, or {option} 12,300,40") from None
    # commas, spaces or line breaks between numbers; an empty entry (5,,9 or a trailing comma) is refused
    entries = re.split(r"\s*,\s*|\s+", text.strip()) if text.strip() else []
    values = [int(e) if re.fullmatch(r"[+-]?\d+", e) else e for e in entries]
    return checked_lengths(values, option[2:].replace("-", "_"), minimum, field=option)


def _check_list_counts(lists: dict[str, list[int]], requests: int | None, from_option: bool) -> None:
    """Each length list has one entry per request: --requests when given, else the first list's count."""
    for name, values in lists.items():
        option = "--" + name.replace("_", "-")
        if requests is None or len(values) == requests:
            continue
        if from_option:
            raise MoesimError(f"has {len(values)} entries for --requests {requests}", field=option,
                              fix=f"give {requests} lengths, one per request, or --requests {len(values)}")
        raise MoesimError(f"has {len(values)} entries, --prompt-lens {requests}", field=option,
                          fix="give --prompt-lens and --decode-lens one length per request each")


def _note_other_model(real, synthetic) -> None:
    """Parameters fitted to one model's routing do not give another model's (skew and co-activation depend on
    the number of experts and top-k): say so when --model names another."""
    if (real.num_experts, real.top_k, real.num_layers) != (synthetic.num_experts, synthetic.top_k,
                                                            synthetic.num_layers):
        console.print(f"note: fitted to a {real.name} trace ({real.num_experts} experts, top-{real.top_k}, "
                      f"{real.num_layers} layers) and drawn for {synthetic.name} ({synthetic.num_experts} experts, "
                      f"top-{synthetic.top_k}, {synthetic.num_layers} layers): its statistics will not be the fitted "
                      "ones (omit --model to draw for the real trace's model)", markup=False, highlight=False)


#: positions and steps are int32 in a trace; rows beyond this would take days to write anyway
SYNTH_MAX_ROWS = 2**31 - 1


def _check_synth_size(config) -> None:
    if config.prompt_lens is None and config.decode_lens is None:  # one length for all: no list per request, which
        tokens = config.prompt_len + config.decode_len              # for --requests 2147483648 took gigabytes
        total = config.requests * tokens
    else:  # lists as long as the ones given
        prompts, decodes = config.prompts(), config.decodes()
        tokens = max(p + d for p, d in zip(prompts, decodes))
        total = sum(prompts) + sum(decodes)
    if tokens > 2**31 - 1:
        raise MoesimError(f"{tokens:,} tokens per request exceed the trace's int32 positions",
                          field="--prompt-len/--decode-len", fix="use fewer than 2,147,483,647 tokens per request")
    rows = total * config.model.num_layers
    if rows > SYNTH_MAX_ROWS:
        raise MoesimError(f"{config.requests:,} requests of {total:,} tokens in all x {config.model.num_layers} "
                          f"layers = {rows:,} rows, beyond the limit of {SYNTH_MAX_ROWS:,}",
                          field="--requests/--prompt-len/--decode-len", fix="synthesize fewer or shorter requests")


def _fitted_lengths(result, requests: int, given: dict[str, int]) -> dict[str, list[int]]:
    """The real requests' lengths for the synthetic ones, for each of prompt and decode not given on the
    command line."""
    prompts, decodes = result.lengths(requests)
    fitted = {"prompt_lens": (prompts, "prompt_len"), "decode_lens": (decodes, "decode_len")}
    return {name: values for name, (values, scalar) in fitted.items() if scalar not in given}


def _print_lengths(result, config) -> None:
    """The real and the synthetic requests' lengths side by side (a served workload's spread of lengths)."""
    from rich.table import Table
    table = Table(title="request lengths (tokens; min / median / max)", title_justify="left")
    for col in ("", "real", "synthetic"):
        table.add_column(col, justify="left" if not col else "right")
    real = (result.real_prompt_lens, result.decode_lens)
    synthetic = (config.prompts(), config.decodes())
    table.add_row("requests", f"{len(real[0]):,}", f"{len(synthetic[0]):,}")
    table.add_row("prompt", _min_median_max(real[0]), _min_median_max(synthetic[0]))
    table.add_row("decode", _min_median_max(real[1]), _min_median_max(synthetic[1]))
    table.add_row("tokens in all", f"{sum(real[0]) + sum(real[1]):,}", f"{sum(synthetic[0]) + sum(synthetic[1]):,}")
    console.print(table)


def _min_median_max(values: list[int]) -> str:
    import statistics
    median = statistics.median(values)
    shown = f"{median:,.0f}" if float(median).is_integer() else f"{median:,.1f}"
    return f"{min(values):,} / {shown} / {max(values):,}"


def _fit(real: str, seed: int):
    """Fit the generator to ``real``, print fitted parameters and statistics against the real ones."""
    from rich.table import Table

    from moesim.progress import Progress
    from moesim.trace.synth import fit_params
    with Progress("fit", unit="candidate traces", console=err_console) as bar:
        bar.advance(0, label=f"statistics of {Path(real).name}")  # seconds a million rows, before any candidate
        result = fit_params(real, seed=seed, progress=lambda name: bar.advance(1, label=name))
    # the last candidate the fit drew (scaled down for a long trace, no predictors): `trace compare` measures
    # the trace written
    table = Table(title=f"fitted to {real} ({result.evaluations} candidate traces; `moesim trace compare {real} "
                        "OUT` measures the trace written)", title_justify="left")
    for col in ("statistic", "real", "fitted candidate", "difference"):
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
