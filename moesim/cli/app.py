"""What every command shares: the consoles, JSON and output-file helpers, ``--set`` parsing and the
``moesim`` click group the command modules register with."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from moesim.errors import MoesimError

console = Console(width=None if Console().is_terminal else 160)
err_console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 160)


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


def write_json(data: object, out: str | None) -> None:
    text = json.dumps(json_safe(data), indent=2, sort_keys=True, default=str, allow_nan=False)
    if out in (None, "-"):
        click.echo(text)
    else:
        from moesim.util import atomic_write_text
        with open_output(out, "--json") as path:
            atomic_write_text(path, text + "\n")


def check_outputs(**outputs: str | None) -> None:
    """Every output path can be written: checked before any work starts (one line, exit 2)."""
    from moesim.util import check_output_path
    for option, path in outputs.items():
        if path and path != "-":
            check_output_path(path, "--" + option.replace("_", "-"))


def open_output(path: str | Path, option: str):
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


def parse_settings(settings: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in settings:
        if "=" not in item:
            raise MoesimError(f"--set '{item}' is not KEY=VALUE", fix="write e.g. --set cache.slots_per_layer=4")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out
