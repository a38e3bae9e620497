"""The ``moesim`` command line.

Every command turns bad input into one line on stderr and exit status 2
(:class:`moesim.errors.MoesimError`); nothing here prints a traceback for a
user mistake. Each command lives in its own module and registers with the
``moesim`` group of :mod:`moesim.cli.app` when imported here.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from moesim.cli import measure_cmd, replay_cmd, results_cmd, serve_cmd, trace_cmd  # noqa: F401 - registers them
from moesim.cli.app import cli, err_console, json_safe, stream_to_devnull  # noqa: F401 - json_safe: public
from moesim.cli.replay_cmd import replay  # noqa: F401 - the command object, for embedding
from moesim.errors import MoesimError
from moesim.util import Terminated, sigterm_interrupts, staged_outputs


def _say(text: str) -> None:
    err_console.print(text, markup=False, highlight=False, soft_wrap=True)


def _usage_line(err: click.UsageError, args: list[str]) -> str:
    """click's usage error as one line, pointing to the command's --help (click's parser errors, an option
    without its value say, carry no context: the command is then read off the command line)."""
    command = err.ctx.command_path if err.ctx is not None else _command_path(args)
    return f"moesim: error: {err.format_message()} (see '{command} --help')".replace("\n", " ")


def _command_path(args: list[str]) -> str:
    """'moesim trace import' for ``["trace", "import", "x", "--format"]``: the commands named, in turn."""
    path, command = ["moesim"], cli
    for arg in args:
        sub = command.commands.get(arg) if isinstance(command, click.Group) else None
        if sub is None:
            break
        path.append(arg)
        command = sub
    return " ".join(path)


def _internal_error(err: BaseException) -> str:
    import traceback
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return (f"moesim: internal error{where}: {text[:300]}; please report this with the command line "
            "and the output of the same command with --debug")


def _escape_undecodable_names() -> None:
    """A file name of bytes that are no UTF-8 (a shell passes them through) is printed with those bytes as
    escapes, as stderr already prints them: with a UTF-8 locale, stdout refused them (UnicodeEncodeError)
    wherever a table title or a "wrote" line named the file."""
    import contextlib
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            if stream.errors == "strict":
                stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; bad input exits 2 with one line, an internal error exits 1 with one line
    asking for a report (``--debug`` anywhere on the command line shows the traceback instead)."""
    args = list(sys.argv[1:] if argv is None else argv)
    _escape_undecodable_names()
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    code = 0
    try:
        args, modules = _imports(_expand_home(args))
        if modules:
            from moesim.policy.imports import import_policies
            import_policies(modules)  # before any command looks a system name up
        with sigterm_interrupts(), staged_outputs():  # a command's outputs land together, or none of them does
            try:
                code = _run_command(args)
            except BrokenPipeError:  # `moesim trace inspect T --json - | head`: the reader has what it wanted,
                stream_to_devnull(sys.stdout)  # and what the command wrote lands
    except MoesimError as err:
        from moesim.sweep.spec import full_key_guess
        full_key_guess(err, serving=args[:1] == ["serve-sim"])  # `--set qps=1`: did you mean workload.qps?
        if debug:  # a fault in a policy of one's own: where in its code; else where the refusal was raised
            _say_cause(err.__cause__ or err)
        _say(f"moesim: error: {err}")
        return err.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt) as err:
        if isinstance(err, Terminated) or isinstance(err.__cause__, Terminated):  # click wraps it in Abort
            _say("moesim: terminated")
            return 128 + signal.SIGTERM  # what a shell shows for `kill PID`
        if err_console.is_terminal:
            _say("")  # ends the line the terminal echoed ^C on; piped, it would be a stray blank line
        _say("moesim: interrupted")
        return 130
    except click.exceptions.NoArgsIsHelpError as err:  # `moesim`, `moesim trace`: the help, as it is laid out
        err.show()
        return 2
    except click.UsageError as err:
        _say(_usage_line(err, args))
        return 2
    except click.ClickException as err:
        _say(f"moesim: error: {err.format_message()}".replace("\n", " "))
        return 2
    except Exception as err:  # noqa: BLE001 - the last resort: one line, never a traceback
        if debug:
            raise
        _say(_internal_error(err))
        return 1
    return code


def _say_cause(cause: BaseException) -> None:
    """The traceback of what a one-line error was raised from (a policy of one's own that raised), or of the
    error itself (a registration refused while importing a module of one's own, a plan that broke the
    invariants): --debug showed the one line alone, whose fix points to that traceback."""
    import traceback
    sys.stderr.write("".join(traceback.format_exception(type(cause), cause, cause.__traceback__)))


def _expand_home(args: list[str]) -> list[str]:
    """``args`` with a leading ``~`` or ``~user`` of a value made the home folder, as a sweep spec's paths and
    ``--import`` take it: the shell leaves it alone when quoted or after '=' (``--json=~/m.json``), and
    '~' was then read as a folder of that name, with a fix (``mkdir -p ~/...``) that could not help."""
    expanded = []
    for arg in args:
        option, eq, value = arg.partition("=")
        if arg.startswith("~"):
            arg = os.path.expanduser(arg)
        elif option.startswith("--") and eq and value.startswith("~"):
            arg = f"{option}={os.path.expanduser(value)}"
        expanded.append(arg)
    return expanded


def _imports(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` without their ``--import MODULE`` (or ``--import=MODULE``) options, and the modules they name:
    like --debug, it may stand anywhere before a ``--``, and it serves every command."""
    rest, modules = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        if arg == "--import":
            if i + 1 == len(args):
                raise MoesimError("--import needs a value", field="--import",
                                  fix="give a Python file or module that registers policies: --import my_policies.py")
            modules.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("--import="):
            modules.append(arg.removeprefix("--import="))
        else:
            rest.append(arg)
        i += 1
    return rest, modules


#: the variable with which a shell asks for completions (``eval "$(_MOESIM_COMPLETE=bash_source moesim)"``)
COMPLETE_VAR = "_MOESIM_COMPLETE"


def _run_command(args: list[str]) -> int:
    """Parse ``args`` and run the command, or answer the shell's completion request. This is what click's
    own main does, but for the blank line it writes to stderr on Ctrl-C; ``--help`` and ``--version`` end in
    an exit status to return."""
    instruction = os.environ.get(COMPLETE_VAR)
    if instruction:
        from click.shell_completion import shell_complete
        return shell_complete(cli, {}, "moesim", COMPLETE_VAR, instruction)
    try:
        with cli.make_context("moesim", args) as ctx:
            cli.invoke(ctx)
    except click.exceptions.Exit as done:
        return done.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
