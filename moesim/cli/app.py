"""What every command shares: the consoles, JSON and output-file helpers, ``--set`` parsing and the
``moesim`` click group the command modules register with."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from moesim.errors import MoesimError


class PipeConsole(Console):
    """A console whose reader may go away (``moesim replay T --json m.json | head``): rich would exit with
    status 1 there; this console falls silent and the command goes on, so the files it writes still land.
    Once an output of the command goes to standard output (``--timeline /dev/stdout``), what this console
    says goes to stderr: stdout holds that output alone."""

    stdout_taken = False  # set by check_outputs, cleared at each command's start

    @property
    def file(self) -> Any:
        if self.stdout_taken and self._file is None and not self.stderr:
            return sys.stderr
        return Console.file.fget(self)

    @file.setter
    def file(self, new_file: Any) -> None:
        Console.file.fset(self, new_file)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stream_to_devnull(self.file)

    def _check_buffer(self) -> None:
        """As rich writes, but a stream that cannot take the text (a full disk under ``> out.txt``) is one
        line naming it (an internal error before); what was buffered for it goes nowhere."""
        try:
            super()._check_buffer()
        except OSError as err:  # a broken pipe rich has handled: the reader went away
            del self._buffer[:]
            self.quiet = True
            stream = self.file
            stream_to_devnull(stream)
            if stream is sys.stderr or stream is sys.__stderr__:
                return  # the error line would go there too: the exit status says it
            raise stream_error(err, "standard output") from None

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """As rich prints, but text to a pipe or a file keeps each line whole (a note is one line to grep),
        and no column of a table is narrower than the longest word of its cells and header: rich cuts them to
        '…' or to nothing where the console is narrow (a narrow terminal, or a pipe's 160 columns for a wide
        table), losing the figures. Such a table is drawn as narrow as its
        words allow, its lines longer than the console (a terminal wraps them)."""
        tables = [o for o in objects if isinstance(o, Table)]
        if not tables:
            if not self.is_terminal:  # in a pipe or a log, a note cut at the console's width splits a sentence
                kwargs.setdefault("soft_wrap", True)
            return super().print(*objects, **kwargs)
        kwargs.setdefault("crop", False)
        needed = max(keep_words_whole(self, table) for table in tables)
        if needed <= min(table.width or self.width for table in tables):
            return super().print(*objects, **kwargs)
        own = [table.width for table in tables]
        width, self.width = self.width, needed
        try:
            for table in tables:
                table.width = None  # a width of its own (or ratio columns) would squeeze the columns again
            super().print(*objects, **kwargs)
        finally:
            self.width = width
            for table, before in zip(tables, own):
                table.width = before


def keep_words_whole(console: Console, table: Table) -> int:
    """Give each column of ``table`` a minimum width that keeps every word of its cells and header whole
    (a column that does not wrap: every line); the table's width with every column at that minimum."""
    from rich.measure import Measurement
    wide = console.options.update_width(2**16)
    for column in table.columns:
        sizes = [Measurement.get(console, wide, cell) for cell in (column.header, *column.cells)]
        needed = max((size.maximum if column.no_wrap else size.minimum) for size in sizes)
        column.min_width = max(column.min_width or 0, needed)
    own, table.width = table.width, None
    try:
        return Measurement.get(console, wide, table).minimum
    finally:
        table.width = own


def stream_error(err: OSError, name: str) -> MoesimError:
    """The one line of a write to a standard stream that failed (``name``: 'standard output')."""
    return MoesimError(f"cannot write: {err.strerror or err}", source=name,
                       fix="free space where it is redirected, or redirect it elsewhere")


def stream_to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null: what is still buffered for a reader that went away
    goes nowhere, without a second error when Python flushes it at exit."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


# markup off: file names, notes and errors are printed as they are ("run[v2].parquet" is no style tag); the few
# styled lines ask for it with markup=True and escape what they quote. Highlighting off: on a terminal rich
# coloured parts of figures in notes ("1.00x" in two colours)
console = PipeConsole(markup=False, highlight=False, width=None if Console().is_terminal else 160)
err_console = PipeConsole(markup=False, highlight=False, stderr=True,
                          width=None if Console(stderr=True).is_terminal else 160)


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


def say_wrote(out: Console, text: str) -> None:
    """A "wrote X" line, said once every output of the command has landed (a later failure rolls them
    all back, and then nothing was written)."""
    from moesim.util import once_landed
    once_landed(lambda: out.print(text, highlight=False))


def write_json(data: object, out: str | None) -> None:
    """The JSON of ``--json``: on stdout for the flag form (``out`` None) at once, so that ``trace validate
    --json`` reports a fault it then exits 2 for; for ``--json -`` (``replay``, ``serve-sim``, whose other outputs
    may still fail) once every output has landed, so that a command that fails prints no JSON, as it writes no
    file."""
    text = json.dumps(json_safe(data), indent=2, sort_keys=True, default=str, allow_nan=False)
    if out is None:
        _print_json(text)
    elif to_stdout(out):  # `--json /dev/stdout` too: stdout then holds the JSON alone
        if sys.stdout is None:  # started with stdout closed (`>&-`): the JSON would go nowhere
            _print_json(text)  # says so now, before any other output is written
        from moesim.util import once_landed
        once_landed(lambda: _print_json(text))
    else:
        from moesim.util import atomic_write_text
        with open_output(out, "--json") as path:
            atomic_write_text(path, text + "\n")
        say_wrote(console, f"wrote {out}")  # stdout holds no JSON here


def _print_json(text: str) -> None:
    if sys.stdout is None:  # started with stdout closed (`>&-`): the JSON would go nowhere
        raise MoesimError("standard output is closed", field="--json",
                          fix="run it with stdout open, or write the JSON to a file")
    try:  # not click.echo: click exits with status 1 when the reader goes away
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `--json - | head`: the reader has what it wanted; the command goes on
        stream_to_devnull(sys.stdout)
    except OSError as err:  # a full disk under `> out.json`
        stream_to_devnull(sys.stdout)
        raise stream_error(err, "standard output") from None


class JsonFlagCommand(click.Command):
    """A command whose ``--json`` is a flag (JSON on stdout) that also takes ``--json -``, the form
    ``replay`` and ``serve-sim`` use, so that one habit works everywhere; any other value after it stays an
    argument (``inspect --json T.parquet`` reads T)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for before, value in zip(args, args[1:]):
            if before == "--json" and (value.endswith(".json") or value.startswith("/dev/")) \
                    and value not in STDOUT_NAMES:  # `--json out.json`, as replay takes it
                raise click.UsageError(f"--json takes no file here: it prints the JSON on stdout "
                                       f"(write it to a file with --json > {value})", ctx=ctx)
        flag = [a for i, a in enumerate(args) if not (a in STDOUT_NAMES and i > 0 and args[i - 1] == "--json")]
        return super().parse_args(ctx, flag)


class InputPath(click.Path):
    """A file the command reads (or a profile's name): an empty value, what an unset shell variable gives
    (``moesim replay "$TRACE"``), is refused naming the option; it was read as the current folder ('.: is a
    folder') or as a file of no name ('file not found', naming none)."""

    def __init__(self, *args: Any, what: str = "a file name", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.what = what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            name = (param.opts[0] if param.opts and param.opts[0].startswith("-") else
                    param.human_readable_name.rstrip(".")) if param is not None else None
            raise MoesimError("the path is empty (an unset shell variable gives an empty one)", field=name,
                              fix=f"give {self.what}")
        return super().convert(value, param, ctx)


#: the type of a ``--hw`` option
HW_PROFILE = InputPath(what="a profile name or a YAML path")


#: what ``--json`` may be given to mean standard output, where it is a flag as where it takes a file
STDOUT_NAMES = ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")


def check_outputs(inputs: list[tuple[str, str | None]] | None = None, formats: dict[str, str] | None = None,
                  **outputs: str | None) -> None:
    """Every output path can be written, is named for its format (``formats``: an output's key of
    :data:`moesim.util.OUTPUT_FORMATS`) and is none of the command's ``inputs`` ((option, path) pairs)
    or another output: checked before any work starts (one line, exit 2)."""
    from moesim.util import check_output_path, same_file
    for option, path in outputs.items():
        if path is not None and str(path) == "":  # `--json "$OUT"` with OUT unset wrote nothing, exit 0
            check_output_path(path, "--" + option.replace("_", "-"))  # says it is empty
        if path == "-" and option != "json":
            # `moesim sweep --out -` was told "for --json only", an option sweep, plot and report lack
            why = "is for --json only" if "json" in outputs else "is not taken: this command writes files only"
            raise MoesimError(f"'-' (standard output) {why}", field="--" + option.replace("_", "-"),
                              fix="give a file name")
    _one_to_stdout(outputs)
    console.stdout_taken = any(to_stdout(path) for path in outputs.values())
    named = [(key, "--" + key.replace("_", "-"), path) for key, path in outputs.items() if path and path != "-"]
    read = [(option, path) for option, path in inputs or () if path]
    written: list[tuple[str, str]] = []
    for key, option, path in named:
        for what, others in (("an input", read), ("another output", written)):
            for other, other_path in others:
                if same_file(path, other_path):
                    raise MoesimError(f"would overwrite {what} ({other} {other_path})", source=path,
                                      field=option, fix="write it to another file")
        check_output_path(path, option, (formats or {}).get(key))
        if (formats or {}).get(key) is None:
            _not_named_as_another_format(path, option)
        written.append((option, path))


def _one_to_stdout(outputs: dict[str, str | None]) -> None:
    """At most one output goes to standard output ('-', /dev/stdout or any other name of fd 1): two would
    interleave there (``--json - --timeline /dev/stdout`` put Parquet bytes into the JSON). Standard output
    on /dev/null takes any number: nothing is kept to mix."""
    there = [("--" + key.replace("_", "-"), path) for key, path in outputs.items() if path and to_stdout(path)]
    if len(there) < 2 or _stdout_is_devnull():
        return
    named = [f"{option} {path}" for option, path in there]
    named_all = ", ".join(named[:-1]) + " and " + named[-1]
    raise MoesimError(f"{named_all} {'both' if len(named) == 2 else 'all'} write to standard output, where "
                      "they would mix", field=there[1][0],
                      fix="write all but one of them to a file")


def _stdout_is_devnull() -> bool:
    try:
        here, null = os.fstat(1), os.stat(os.devnull)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (null.st_dev, null.st_ino)


def _not_named_as_another_format(path: str, option: str) -> None:
    """A JSON output (``--json``, ``--chrome-trace``: no format of their own to end in) named as a file of
    another format (``timeline.parquet``, ``gantt.png``) is refused: it is a slip that would replace that
    file with JSON."""
    from moesim.util import OUTPUT_FORMATS, is_special_file
    suffix = Path(path).suffix.lower()
    if is_special_file(Path(path)):
        return
    for kind, suffixes in OUTPUT_FORMATS.items():
        if suffix in suffixes:
            raise MoesimError(f"this output is written as JSON, but its name has '{Path(path).suffix}' "
                              f"({kind})", source=path, field=option,
                              fix=f"name it e.g. {Path(path).with_suffix('.json').name}")


def to_stdout(path: str | None) -> bool:
    """Whether an output goes to standard output: '-', or a name of it such as /dev/stdout (the table then
    goes to stderr, so that stdout holds the JSON only)."""
    if path == "-":
        return True
    if not path:
        return False
    try:
        here, there = os.stat(path), os.fstat(1)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def open_output(path: str | Path, option: str, written_as: str | None = None):
    """Where a writer puts ``path``'s content (a special file such as /dev/null is written directly,
    never replaced); an OS error while writing becomes one line naming the file."""
    from moesim.util import output_file
    return output_file(path, option, written_as)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moesim")
def cli() -> None:
    """Simulate and compare MoE expert-offloading policies on one GPU plus a CPU.

    Bad input exits 2 with one line naming the file, the field and the fix;
    add --debug anywhere on the command line to see the traceback behind it, or behind an internal error.

    Systems of one's own: add --import my_policies.py (or a module name) anywhere on the command
    line, as often as needed; the module registers its components and systems when imported
    (moesim.policy.systems.register_component, register_system). Their components and plans are
    always checked as they run: a plan that computes an expert twice or leaves one out, computes one on
    the GPU that is neither resident nor loaded, evicts one that is not resident or loads beyond the
    slots, or an exception in their code, stops the run with one line naming the class and method, the
    step and the layer (exit 2). --set engine.check=true checks every system's plans the same way.
    """
    console.stdout_taken = False  # a command run before in this process (tests, notebooks) took stdout
    # pyarrow imports pandas at its first conversion and takes a Ctrl-C in that import for a missing pandas
    # (the command then runs on to the end); imported before any work, pandas leaves Ctrl-C to stop it
    import pandas  # noqa: F401


def preset_help(text: str) -> str:
    """``text`` followed by the bundled model presets' names (the --help of a --model option)."""
    from moesim.model.presets import available_presets
    return f"{text} Presets: {', '.join(available_presets())}."


def hw_help(text: str = "Hardware profile: a name or a YAML path.") -> str:
    """``text`` followed by the bundled hardware profiles' names (the --help of a --hw option)."""
    from moesim.hw.profile import available_profiles
    return f"{text} Profiles: {', '.join(available_profiles())}."


def hw_parts(hw: str, settings: dict[str, str]) -> dict[str, Any] | None:
    """The GPU and host CPU of profile ``hw`` as a run with ``settings`` saw them (its ``hw.*`` settings
    applied: ``hw.cpu.cores=16`` is 16 cores); None where the profile cannot be read (the run said why)."""
    from moesim.analysis.sweep_results import hw_parts_for
    return hw_parts_for(hw, settings)


def hw_title(hw: str, settings: dict[str, str], parts: dict[str, Any] | None = None) -> str:
    """``hw`` as a table's title names it, with its GPU and host CPU, which differ between the bundled
    profiles as much as their GPUs: 'rtx4090 (NVIDIA GeForce RTX 4090 + AMD EPYC 7T83, 10 cores, 102.4 GB/s
    DRAM)' (moesim.hw.title.profile_title, which figures use too)."""
    from moesim.hw.title import profile_title
    return profile_title(hw, parts or hw_parts(hw, settings))  # given: the caller's parts, read once


def print_title(out: Console, title: str) -> None:
    """A table's title on a line of its own, styled as rich styles titles: a title inside the table was wrapped
    at the table's width, which a profile's GPU and CPU (:func:`hw_title`) and the --set values outgrow."""
    from rich.text import Text
    out.print(Text(title, style="table.title"), highlight=False)


def print_skipped(out: Console, skipped: dict[str, str], systems: int) -> None:
    """The systems skipped and why, one line per reason (17 systems that do not fit one GPU are one line),
    and how many of the ``systems`` asked for that is."""
    from rich.markup import escape
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        out.print(f"[yellow]skipped {escape(', '.join(names))}:[/] {escape(reason)}", highlight=False, markup=True)
    if skipped:
        out.print(f"[yellow]{len(skipped)} of {systems} systems skipped[/] (reasons above; in --json, "
                  "each under its name with its reason as 'skipped')", highlight=False, markup=True)


def setting_files(settings: dict[str, str]) -> list[tuple[str, str]]:
    """The files ``--set`` values name (``workload.arrival_file``, a calibration trace such as
    ``cache.calibration``), as ``check_outputs`` inputs: an output given the same path would replace a file
    the run reads."""
    return [(f"--set {key}", value) for key, value in settings.items() if os.path.isfile(value)]


def parse_settings(settings: tuple[str, ...], example: str = "cache.slots_per_layer=4") -> dict[str, str]:
    """``--set KEY=VALUE`` options as a dict; ``example``: a setting the command takes, for the fix."""
    out: dict[str, str] = {}
    for item in settings:
        if "=" not in item:
            raise MoesimError(f"'{item}' is not KEY=VALUE", field="--set", fix=f"write e.g. --set {example}")
        key, value = item.split("=", 1)
        if key.strip() in out:
            raise MoesimError(f"--set {key.strip()} given twice", field=key.strip(), fix="give it once")
        out[key.strip()] = value.strip()
    return out
