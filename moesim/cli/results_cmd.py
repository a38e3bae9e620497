"""``moesim sweep``, ``moesim plot`` and ``moesim report``: grids of replays and their figures."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.markup import escape

from moesim.cli.app import (InputPath, check_outputs, cli, console, err_console, open_output, say_wrote,
                            write_json)
from moesim.errors import MoesimError
from moesim.util import FIGURE, HTML, PARQUET

if TYPE_CHECKING:
    import pandas as pd

    from moesim.sweep import SweepSummary
    from moesim.sweep.spec import Point, SweepSpec


@cli.command("sweep")
@click.argument("spec_file", metavar="SPEC.yaml", type=InputPath(dir_okay=False))
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
@click.option("--json", "json_out", default=None, metavar="OUT",
              help="Also write the summary and the spec's rows as JSON ('-': stdout, which then holds the JSON "
                   "only; the summary line goes to stderr). Not written when every point failed on bad input.")
def sweep_cmd(spec_file: str, out: str, workers: int | None, engine: str, address: str | None,
              json_out: str | None) -> None:
    """Replay every point of a grid over traces, hardware profiles, systems and --set parameters.

    \b
    SPEC.yaml (relative paths are relative to its folder):
      traces: [traces/mixtral-8x7b-humaneval.parquet]
      hw: [a100-40g, h100-pcie]
      systems: [gpu-only-lru, static-hot, smoe]  # or: all
      # import: [my_policies.py]                 # modules registering systems of one's own
      seeds: [0]
      set: {engine.staging_slots: 2}             # fixed for every point
      grid: {cache.slots_per_layer: [1, 2, 3]}   # cartesian product
      zip:                                       # varied together
        - {hw.pcie.bandwidth_scale: [0.5, 1.0], engine.kernels_per_expert: [3, 1]}
      per_system:                                # parameters only some systems take
        smoe: {grid: {prefetch.n: [1, 2]}}

    Each finished point is saved at once (OUT.parts/, merged into OUT), so an
    interrupted sweep resumes where it stopped; a finished point runs again when
    its trace or profile file, or the policy module of one's own it runs, has
    changed since. A failed point is recorded with
    its error; the exit status is then 1. A system that 'all' brings in and that
    cannot run on a trace (it needs a column the trace lacks), or cannot serve in a
    serving sweep, is left out of those points, with a line saying why.
    """
    from moesim.sweep import load_spec, run_sweep
    check_outputs([("SPEC", spec_file)], {"out": PARQUET}, out=out, json=json_out)
    existed = Path(out).exists()
    spec = load_spec(spec_file)
    try:
        frame, summary = run_sweep(spec, out, workers=workers, engine=engine, address=address,
                                   progress=True, console=err_console)
    except KeyboardInterrupt:
        err_console.print(f"sweep: every finished point is kept in {out}.parts/; the same command resumes",
                          markup=False, highlight=False, soft_wrap=True)
        raise
    errors = frame[frame["status"] != "ok"] if summary.failed else frame.iloc[:0]
    bad_input = 0 < summary.failed == summary.points and not any(_internal(e) for e in errors["error"])
    if bad_input and not existed:  # nothing worth keeping: every point failed on its input
        Path(out).unlink(missing_ok=True)
    else:
        console.print(_summary_line(summary, out), markup=False, highlight=False)
    for line in summary.left_out:  # systems `all` brought in that cannot run on a trace: not failures
        err_console.print(f"left out {line}", markup=False, highlight=False, soft_wrap=True)
    if bad_input:
        first = errors["error"].iloc[0]
        fix = _fix_of(first) or "fix the spec"
        every, which = (("the one point", "why") if summary.points == 1
                        else (f"all {summary.points} points", "the first"))
        raise MoesimError(f"{every} failed on bad input{'' if existed else ', nothing written'}; "
                          f"{which}: {_without_fix(first)}", source=spec_file,
                          fix=f"{fix} (every reason: column 'error' of {out})" if existed else fix)
    if json_out:  # before the exit status 1 of failed points: their rows say why
        write_json(_sweep_json(summary, out, frame), json_out)
    if summary.failed:
        for line in failed_lines(spec, errors.head(5)):
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        if len(errors) > 5:
            err_console.print(f"... and {len(errors) - 5} more (column 'error' of {out})", markup=False)
        # click's Exit, not sys.exit: the command's outputs (the --json file or text) land before the status 1
        raise click.exceptions.Exit(1)


def _sweep_json(summary: SweepSummary, out: str, frame: pd.DataFrame) -> dict:
    """``--json``: the summary's counts (as :class:`moesim.sweep.SweepSummary` names them), the results file, and
    one object per point of the spec as its row in OUT (empty cells null)."""
    import dataclasses
    import json
    rows = json.loads(frame.to_json(orient="records", double_precision=15))  # NaN as null, numpy types as JSON's
    return {**dataclasses.asdict(summary), "left_out": list(summary.left_out), "out": str(out), "rows": rows}


def failed_lines(spec: SweepSpec, rows: pd.DataFrame) -> list[str]:
    """One line per failed point of ``rows``: its system, trace (its file name, or as the spec writes it where
    two of the spec's traces share a name), profile and the settings that vary between the spec's points, then
    its id and error (a row of a point outside the spec: its system, trace and profile)."""
    points = {point.point_id: point for point in spec.points()}
    varying_set = _varying_keys(list(points.values()))
    varying = [key for key in dict.fromkeys((*spec.parameter_keys(), "seed")) if key in varying_set]
    names = [Path(trace).name for trace in spec.traces]
    lines = []
    for row in rows.to_dict("records"):
        point = points.get(row["point_id"])
        if point is None:
            lines.append(f"failed: {row['system']} on {Path(str(row['trace'])).name} / {row['hw']} "
                         f"(point {row['point_id']}): {row['error']}")
            continue
        trace = Path(point.trace).name if names.count(Path(point.trace).name) == 1 else point.trace
        values = {**point.settings_str(), "seed": str(point.seed)}
        given = "".join(f"{key}={values[key]}, " for key in varying if key in values)
        lines.append(f"failed: {point.system} on {trace} / {point.hw} ({given}point {point.point_id}): "
                     f"{row['error']}")
    return lines


def _varying_keys(points: list[Point]) -> set[str]:
    """The ``--set`` keys (and ``seed``) whose value is not the same at every point."""
    keys: dict[str, set[str | None]] = {}
    for point in points:
        values = {**point.settings_str(), "seed": str(point.seed)}
        for key in dict.fromkeys([*values, *keys]):
            keys.setdefault(key, set()).add(values.get(key))
    return {key for key, seen in keys.items() if len(seen) > 1}


def _summary_line(summary: SweepSummary, out: str) -> str:
    ran = f"{summary.ran} run"
    why = [f"{n} {what}" for n, what in ((summary.changed, "because their trace, profile or policy module changed"),
                                         (summary.retried, "retried after a worker process died")) if n]
    if why:
        ran += f" ({', '.join(why)})"
    line = (f"{summary.points} point{'s' if summary.points != 1 else ''}: {ran}, {summary.skipped} already in {out}, {summary.failed} failed "
            f"({summary.wall_s:.1f} s) -> {out}")
    if summary.others:  # plot and report read the whole file: say it holds more than this spec
        line += (f"; it also holds {summary.others} row{'s' if summary.others > 1 else ''} of points outside this "
                 "spec, which `moesim plot` and `moesim report` show too (another file keeps sweeps apart)")
    return line


#: the " (fix: ...)" a :class:`MoesimError` line ends with
_FIX = re.compile(r" \(fix: (.*)\)$")


def _fix_of(error: str) -> str | None:
    match = _FIX.search(str(error))
    return match.group(1) if match else None


def _without_fix(error: str) -> str:
    """A point's one-line error without its fix, which the sweep's own error line carries (once)."""
    return _FIX.sub("", str(error))


def _internal(error: str) -> bool:
    """A point's error from a bug (recorded with where it was raised) or a dead worker, not from its input."""
    from moesim.sweep.point import WORKER_DIED
    return re.search(r"\(at [\w.]+\.py:\d+\)$", str(error)) is not None or str(error).startswith(WORKER_DIED)


@cli.command("plot")
@click.argument("results", metavar="RESULTS.parquet", type=InputPath(dir_okay=False))
@click.option("--x", "x", required=True, metavar="PARAM|METRIC",
              help="Column on the x axis, e.g. cache.slots_per_layer, or a metric such as gpu_memory_gib.")
@click.option("--y", "y", required=True, metavar="METRIC", help="Metric on the y axis, e.g. tpot_ms_mean.")
@click.option("--hue", default=None, metavar="PARAM",
              help="One line (or bar, or marker colour) per value of this column [default: system, when the "
                   "results hold several and neither --x nor --facet is system; none: average over them].")
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
    import warnings

    from moesim.analysis.figures import (UnevenMeans, column, load_results, parameter_columns, plot_results,
                                         plot_scatter)
    from moesim.analysis.sweep_results import failed_points
    check_outputs([("RESULTS", results)], {"out": FIGURE}, out=out)
    frame = load_results(results)
    if kind == "auto":
        kind = "line" if column(frame, x, "--x", results) in parameter_columns(frame) else "scatter"
    hue = _default_hue(frame, hue, x, facet, kind)
    with warnings.catch_warnings(record=True) as caught, open_output(out, "--out", FIGURE) as path, \
            _option_names():
        warnings.simplefilter("always", UnevenMeans)
        if kind == "scatter":
            plot_scatter(frame, x=x, y=y, hue=hue, facet=facet, pareto=pareto, path=path, source=results)
        else:
            plot_results(frame, x=x, y=y, hue=hue, facet=facet, path=path, source=results)
    say_wrote(console, f"wrote {out}")
    _note_unmerged(results, frame)
    failed = failed_points(frame)
    if failed:
        err_console.print(f"note: {failed} of {len(frame)} points failed and are not drawn (status 'error'; "
                          "their reasons are in the 'error' column and in `moesim report`)", highlight=False)
    for warning in caught:
        if issubclass(warning.category, UnevenMeans):
            err_console.print(f"note: {warning.message}", highlight=False)
        else:  # recorded with the rest: shown as it would have been
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def _note_unmerged(results: str, frame: pd.DataFrame) -> None:
    """Finished points a sweep keeps in RESULTS.parts/ but has not merged into RESULTS yet (a sweep still
    running, or one stopped by kill -9 between two merges) are not in the figures: say how many, and how to
    take them in. They were left out without a word (15 of 39 finished points drawn after a kill -9)."""
    from moesim.sweep.store import PARTS_SUFFIX
    parts = Path(results).with_name(Path(results).name + PARTS_SUFFIX)
    if not parts.is_dir() or "point_id" not in frame.columns:
        return
    merged = set(frame["point_id"].astype(str))
    waiting = sum(part.stem not in merged for part in parts.glob("*.parquet"))
    if waiting:
        err_console.print(f"note: {results}: {waiting} finished point(s) in {parts}/ are not merged into it yet "
                          f"and are left out (a sweep still running, or one stopped by kill -9; the same "
                          f"`moesim sweep SPEC.yaml --out {results}` command merges them)", highlight=False,
                          markup=False)


#: the figure functions' keyword arguments, as `moesim plot` spells them
FIGURE_OPTIONS = {"x": "--x", "y": "--y", "hue": "--hue", "facet": "--facet"}


@contextlib.contextmanager
def _option_names() -> Iterator[None]:
    """Errors of the figure functions name their Python keyword (``y``); here the option is ``--y``."""
    try:
        yield
    except MoesimError as err:
        if err.field in FIGURE_OPTIONS:
            err.rename_field(FIGURE_OPTIONS[err.field])
        raise


def _default_hue(frame: pd.DataFrame, hue: str | None, x: str, facet: str | None, kind: str) -> str | None:
    """Systems are what a sweep compares: a line (or colour) each unless asked otherwise; averaging TPOT
    over systems and bounds would hide the comparison."""
    if hue is not None:
        return None if hue == "none" else hue
    if "system" not in frame.columns or "system" in (x, facet):
        return None
    return "system" if kind == "scatter" or frame["system"].nunique() > 1 else None


@cli.command("report")
@click.argument("results", metavar="RESULTS.parquet", type=InputPath(dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), metavar="REPORT.html")
@click.option("--gantt/--no-gantt", default=True, show_default=True,
              help="Replay one point again to draw its CPU/GPU/PCIe Gantt chart (needs its trace).")
@click.option("--title", default=None, help="Page title [default: the results file name].")
def report_cmd(results: str, out: str, gantt: bool, title: str | None) -> None:
    """One self-contained HTML page (images embedded) with the standard figures and tables of a sweep."""
    import warnings

    from moesim.analysis.figures import UnevenMeans, load_results
    from moesim.analysis.html_report import write_report
    check_outputs([("RESULTS", results)], {"out": HTML}, out=out)
    frame = load_results(results)
    missing: list[str] = []
    with warnings.catch_warnings(record=True) as caught, open_output(out, "--out") as path:
        warnings.simplefilter("always", UnevenMeans)
        write_report(frame, path, title=title or Path(results).name, gantt=gantt, source=results, missing=missing)
    say_wrote(console, f"wrote {out}")
    _note_unmerged(results, frame)
    for reason in missing:  # notes on stderr, as `moesim plot` gives them: stdout keeps the "wrote" line alone
        err_console.print(f"[yellow]note:[/] {escape(reason)}", highlight=False, markup=True)
    for warning in caught:  # as `moesim plot` says it (the figure says it too), not as a Python warning
        if issubclass(warning.category, UnevenMeans):
            err_console.print(f"note: {warning.message}", highlight=False, markup=False)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
