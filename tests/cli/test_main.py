"""`moesim.cli.main`: how a command's end is reported (exit status, the last line on stderr)."""

from __future__ import annotations

import pytest

from moesim.cli import cli, main
from tests.policy.test_imports import forget  # noqa: F401 (a fixture)


def _interrupted(**params: object) -> None:
    raise KeyboardInterrupt


def test_ctrl_c_is_one_line_on_a_piped_stderr(monkeypatch, capsys):
    """click's own main ends the terminal's ^C echo with a blank line; in a pipe or a log it is a stray one."""
    monkeypatch.setattr(cli.commands["systems"], "callback", _interrupted)
    assert main(["systems"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "moesim: interrupted\n" and captured.out == ""


@pytest.mark.parametrize("args, code", [(["--version"], 0), (["systems", "--help"], 0), (["nope"], 2), ([], 2)])
def test_help_version_and_usage_errors_keep_their_exit_status(args, code, capsys):
    assert main(args) == code
    captured = capsys.readouterr()
    assert (captured.out if code == 0 else captured.err).strip()


def test_shell_completion_answers(monkeypatch, capsys):
    """`eval "$(_MOESIM_COMPLETE=bash_source moesim)"` sets up bash completion; then bash asks for words."""
    monkeypatch.setenv("_MOESIM_COMPLETE", "bash_source")
    assert main([]) == 0
    assert "_moesim_completion()" in capsys.readouterr().out
    monkeypatch.setenv("_MOESIM_COMPLETE", "bash_complete")
    monkeypatch.setenv("COMP_WORDS", "moesim rep")
    monkeypatch.setenv("COMP_CWORD", "1")
    assert main([]) == 0
    assert capsys.readouterr().out.split() == ["plain,replay", "plain,report"]


_TRACE = "traces/mixtral-8x7b-humaneval.parquet"


def _run(args: list[str], stdout, **kwargs):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", "moesim", *args], cwd=root, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"}, **kwargs)


@pytest.mark.parametrize("args", [["systems"], ["systems", "--json", "-"], ["trace", "inspect", _TRACE, "--json"],
                                  ["replay", _TRACE, "--system", "cpu-only", "--json", "-"],
                                  ["replay", _TRACE, "--system", "cpu-only"]])
def test_stdout_on_a_full_disk_is_one_line_naming_it(args):
    """`moesim systems > /dev/full` (a full disk under stdout) ended in an internal error asking for a report."""
    import os
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        done = _run(args, full)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]  # replay --json - shows its table on stderr first
    assert "internal error" not in done.stderr and "Exception" not in done.stderr, done.stderr
    assert last.startswith("moesim: error: standard output") and "No space left on device" in last, last


def test_json_to_a_closed_stdout_is_one_line_naming_it():
    """`moesim replay T --json - >&-` ended in an internal error ('NoneType' object has no attribute 'write')."""
    import os
    done = _run(["replay", _TRACE, "--system", "cpu-only", "--json", "-"], None, preexec_fn=lambda: os.close(1))
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()[-1]
    assert "internal error" not in done.stderr and "standard output is closed" in err, done.stderr


@pytest.mark.parametrize("form", [["--json", "~/out dir/smoe.json"], ["--json=~/out dir/smoe.json"]])
def test_a_home_path_the_shell_left_alone_names_the_home_folder(form, tmp_path, monkeypatch, capsys):
    """Quoted, or after '=', the shell passes '~' on: it was taken as a folder named '~', and the fix said
    `mkdir -p ~/out dir`, which the shell expands to a folder that then already exists."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "out dir").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["systems", "smoe", *form]) == 0, capsys.readouterr().err
    assert (tmp_path / "out dir" / "smoe.json").is_file()
    assert not (tmp_path / "~").exists()


def test_a_home_trace_and_profile_the_shell_left_alone_are_read(files, monkeypatch, capsys):
    from pathlib import Path
    trace, hw = map(Path, files)
    monkeypatch.setenv("HOME", str(trace.parent))
    assert main(["replay", f"~/{trace.name}", f"--hw=~/{hw.name}", "--system", "cpu-only"]) == 0, \
        capsys.readouterr().err


@pytest.mark.parametrize("args, field", [
    (["replay", "", "--system", "cpu-only"], "TRACE"),
    (["replay", "{trace}", "--hw", "", "--system", "cpu-only"], "--hw"),
    (["serve-sim", "{trace}", "--hw=", "--requests", "2"], "--hw"),
    (["trace", "compare", "{trace}", ""], "SECOND"),
    (["sweep", "", "--out", "{folder}/r.parquet"], "SPEC.yaml"),
    (["report", "", "--out", "{folder}/r.html"], "RESULTS.parquet")])
def test_an_empty_input_path_is_refused_naming_its_option(args, field, files, capsys):
    """`moesim replay "$TRACE"` with TRACE unset said 'file not found' naming no file; an empty --hw, '.: is
    a folder'."""
    from pathlib import Path
    trace, _ = files
    args = [a.format(trace=trace, folder=Path(trace).parent) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: error: field '{field}': the path is empty") and err.count("\n") == 1, err


#: a system of one's own whose cache raises at its first decode step
FAULTY_POLICY = '''
from dataclasses import dataclass

from moesim.policy.cache import LRUCache
from moesim.policy.systems import SystemSpec, register_component, register_system


@register_component
@dataclass
class FaultyCache(LRUCache):
    name = "faulty-debug-cache"

    def touch(self, view, used):
        raise ZeroDivisionError("a slip in touch")


register_system("faulty-debug-sys", SystemSpec("LRU that fails", cache="faulty-debug-cache", assign="gpu"))
'''


def test_debug_shows_where_a_policy_of_ones_own_failed(files, tmp_path, capsys, forget):
    """Issue: a policy of one's own that raised was one line whose fix said "this error's __cause__ holds its
    traceback", and --debug printed the same line alone: nothing showed the line of the policy that raised.
    With --debug the cause's traceback comes first; without it, the one line stays alone."""
    trace, hw = files
    module = tmp_path / "faulty_policy.py"
    module.write_text(FAULTY_POLICY)
    args = ["--import", str(module), "replay", trace, "--hw", hw, "--system", "faulty-debug-sys"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "a slip in touch" in err
    assert "its traceback: --debug on the command line" in err  # the fix a command-line user can follow
    assert main([*args, "--debug"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert any(str(module) in line and "in touch" in line for line in lines)
    assert lines[-2] == "ZeroDivisionError: a slip in touch" and lines[-1].startswith("moesim: error: ")


#: a module that registers a system under a catalogue name, and one whose plan computes an expert twice
REFUSED_REGISTRATION = """
from moesim.policy.systems import SystemSpec, register_system
register_system("gpu-only-lru", SystemSpec("mine", cache="lru", assign="gpu"))
"""
TWICE = """
from moesim.policy.systems import ComposedSystem, SystemSpec, register_system


class Twice(ComposedSystem):
    def plan(self, view):
        plan = super().plan(view)
        plan.gpu = [*plan.gpu, plan.gpu[0]]
        return plan


register_system("twice-debug-sys", SystemSpec("computes an expert twice", cache="lru", assign="gpu",
                                              system_class=Twice))
"""


@pytest.mark.parametrize("source, system, raised_in, error", [
    (REFUSED_REGISTRATION, "gpu-only-lru", "register_system(", "refused_debug.py:3, field 'name': 'gpu-only-lru' is a "
                                                               "catalogue system"),
    (TWICE, "twice-debug-sys", "in __call__", "system 'twice-debug-sys' (Twice.plan): at step 0, layer 0, plans "
                                              "expert 0 twice on the GPU")])
def test_debug_shows_a_traceback_of_a_refusal_with_no_cause(files, tmp_path, capsys, forget, source, system,
                                                            raised_in, error):
    """A registration refused while importing a module of one's own, or a plan of one's own that broke the
    invariants, printed the one line alone with --debug: no traceback showed where it was raised. Without
    --debug it stays one line."""
    trace, hw = files
    module = tmp_path / "refused_debug.py"
    module.write_text(source)
    args = ["--import", str(module), "replay", trace, "--hw", hw, "--system", system]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"moesim: error: {error}"), err
    assert main([*args, "--debug"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):", lines
    assert any(raised_in in line for line in lines), lines
    assert lines[-1].startswith(f"moesim: error: {error}")


def test_the_help_says_policies_of_ones_own_are_checked_and_how_to_check_every_system(capsys):
    """`moesim --help` told how to import a system of one's own but not that its plans are checked as it runs
    (nor that --set engine.check=true does the same for every system), which only the notebook said."""
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "always checked as they run" in text and "--set engine.check=true checks every system's plans" in text
    assert "see the traceback behind it" in text  # --debug: behind a one-line refusal too
