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

console = Console()
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
