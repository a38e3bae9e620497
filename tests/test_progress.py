"""Progress on stderr: plain lines when stderr is no terminal (pipes, logs), quiet for quick work."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from moesim.progress import Progress, plain_interval
from tests.factories import write_trace_and_profile

ROOT = Path(__file__).resolve().parents[1]


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_plain_lines_count_done_and_left():
    stream = Pipe()
    with Progress("sweep", total=4, unit="points", stream=stream, interval_s=0) as bar:
        for i in range(4):
            bar.advance(1, label=f"point {i}", extra=f"{i // 2} failed")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("sweep: 1/4 points (25%)") and "left" in lines[0] and "(point 0, 0 failed)" in lines[0]
    assert lines[3].startswith("sweep: 4/4 points (100%)") and "(point 3, 1 failed)" in lines[3]
    assert lines[-1].startswith("sweep: done, 4/4 points (100%) in ")


def test_quick_work_prints_nothing_when_piped():
    stream = Pipe()
    with Progress("replay", total=10, stream=stream, interval_s=30) as bar:
        bar.advance(10)
    assert stream.getvalue() == ""


def test_a_single_long_step_still_shows_the_command_is_alive():
    """The timer thread writes while nothing advances (one long measurement)."""
    stream = Pipe()
    with Progress("validate", total=3, stream=stream, interval_s=0.2) as bar:
        bar.advance(0, label="measuring cpu curve")
        time.sleep(0.75)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("validate: 0/3 (0%)") for line in lines[:-1])
    assert "measuring cpu curve" in lines[0] and lines[-1].startswith("validate: done")


def test_failure_is_reported_as_stopped():
    stream = Pipe()
    try:
        with Progress("sweep", total=2, stream=stream, interval_s=0) as bar:
            bar.advance(1)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert stream.getvalue().splitlines()[-1].startswith("sweep: stopped, 1/2 (50%)")


def test_disabled_prints_nothing():
    stream = Pipe()
    with Progress("x", total=2, stream=stream, interval_s=0, enabled=False) as bar:
        bar.advance(2)
    assert stream.getvalue() == ""


def test_interval_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "2.5")
    assert plain_interval() == 2.5
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "soon")
    assert plain_interval() == 10.0 and plain_interval() == 10.0
    assert capsys.readouterr().err == ("moesim: note: MOESIM_PROGRESS_INTERVAL='soon' is not a number of seconds: "
                                       "progress lines every 10 s\n")  # once
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "")
    assert plain_interval() == 10.0 and capsys.readouterr().err == ""


def test_terminal_gets_a_rich_bar():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    stream = Terminal()
    with Progress("sweep", total=3, stream=stream, interval_s=0) as bar:
        assert bar._bar is not None
        bar.advance(3)
    assert "sweep: done" not in stream.getvalue()  # no plain lines on a terminal


def test_a_label_is_shown_as_it_is_not_read_as_markup():
    """A file named run[bold].jsonl in the bar's label: rich would take "[bold]" for a style tag."""
    from rich.console import Console

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    stream = Terminal()
    console = Console(file=stream, force_terminal=True, width=150)
    with Progress("trace import", total=2, stream=stream, interval_s=0, console=console) as bar:
        bar.advance(0, label="run[bold].jsonl")
        bar._bar.refresh()
        shown = stream.getvalue()
    assert "0/2 (0%) run[bold].jsonl" in shown and "\x1b[1mtrace import" in shown  # the title still bold


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moesim", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MOESIM_PROGRESS_INTERVAL": "0"}, timeout=300)


def test_long_commands_report_progress_on_a_piped_stderr(tmp_path):
    trace, hw = write_trace_and_profile(tmp_path, 3, decode=6)
    done = _cli(["replay", trace, "--hw", hw, "--system", "all", "--set", "cache.slots_per_layer=2"],
                tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("replay: ")]
    assert lines and lines[-1].startswith("replay: done") and "rows" in lines[-1]
    assert "importance" in done.stdout and "(100%)" in lines[-1]  # a skipped system's rows count as done
    assert any("(oracle)" in line for line in lines)  # the system being replayed is named
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"traces": [str(trace)], "hw": [str(hw)], "systems": ["cpu-only", "static-hot"]}))
    done = _cli(["sweep", str(spec), "--out", str(tmp_path / "r.parquet"), "--workers", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("sweep: ")]
    assert lines[-1].startswith("sweep: done, 2/2 points (100%)") and any("0 failed" in line for line in lines)
    log = tmp_path / "log.jsonl"
    log.write_text("")
    done = _cli(["trace", "import", "--format", "speculative-moe", str(log), "--out", str(tmp_path / "i.parquet")],
                tmp_path)
    assert any(line.startswith("trace import: ") for line in done.stderr.splitlines()), done.stderr


def test_a_closed_stderr_leaves_the_work_unreported_not_failed(monkeypatch):
    """Issue: `moesim replay T --json - 2>&-` (stderr closed: Python's sys.stderr is None) exited 1 with nothing
    on stdout: Progress asked None whether it was a terminal (AttributeError), an internal error whose line
    could not be shown either. With no stderr, progress now says nothing and the command goes on."""
    monkeypatch.setattr(sys, "stderr", None)
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "not a number")  # its note goes to stderr too
    with Progress("replay", total=2, unit="rows") as bar:
        bar.advance(2, label="cpu-only")
    assert not bar.enabled and bar.lines == 0 and plain_interval() == 10.0


def test_a_command_run_with_stderr_closed_prints_its_json(tmp_path):
    trace, hw = write_trace_and_profile(tmp_path, 3, decode=6)
    done = subprocess.run([sys.executable, "-m", "moesim", "replay", trace, "--hw", hw, "--system", "all",
                           "--json", "-"], stdout=subprocess.PIPE, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=lambda: os.close(2))
    assert done.returncode == 0
    assert "cpu-only" in json.loads(done.stdout)
