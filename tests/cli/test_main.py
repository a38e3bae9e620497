"""`moesim.cli.main`: how a command's end is reported (exit status, the last line on stderr)."""

from __future__ import annotations

import pytest

from moesim.cli import cli, main


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
