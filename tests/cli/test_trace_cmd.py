"""`moesim trace` subcommands as a user runs them: progress, output streams and exit statuses."""

from __future__ import annotations

from moesim.cli import main
from moesim.trace.io import read_meta


def test_synth_reports_progress_in_rows_on_stderr(tmp_path, capsys, monkeypatch):
    """A long synthesis (minutes for a DeepSeek-V3 trace of many thousand tokens) printed nothing until it ended."""
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")
    out = tmp_path / "s.parquet"
    args = ["trace", "synth", "--model", "mixtral-8x7b", "--requests", "2", "--prompt-len", "3", "--decode-len", "5",
            "--no-scores", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    rows = 2 * (3 + 5) * 32
    lines = [line for line in captured.err.splitlines() if line.startswith("trace synth: ")]
    assert lines and lines[-1].startswith(f"trace synth: done, {rows:,}/{rows:,} rows (100%)")
    assert captured.out.strip() == f"wrote {out}: {rows:,} rows"
    assert read_meta(out).source["requests"] == 2



def test_a_synthesis_killed_mid_way_leaves_nothing_the_next_run_does_not_remove(tmp_path):
    """kill -9 during `trace synth` left a hidden ..NAME.PID.tmp.parquet.PID.tmp (hundreds of MB) that no
    later run removed; now the next run to the same output removes what the killed one left."""
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "t.parquet"
    out.write_bytes(b"before")
    killed = subprocess.Popen([sys.executable, "-m", "moesim", "trace", "synth", "--model", "deepseek-v3",
                               "--requests", "4", "--prompt-len", "512", "--decode-len", "4000", "--out", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:  # until it writes beside t.parquet
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert len(os.listdir(tmp_path)) == 2 and out.read_bytes() == b"before"  # the output untouched
    assert main(["trace", "synth", "--model", "mixtral-8x7b", "--prompt-len", "2", "--decode-len", "2",
                 "--no-scores", "--out", str(out)]) == 0
    assert os.listdir(tmp_path) == ["t.parquet"]


def _fit_must_not_run(*args, **kwargs):
    raise AssertionError("the fit ran before the bad input was refused")


def test_synth_fit_refuses_a_bad_model_or_setting_before_fitting(tmp_path, capsys, monkeypatch):
    """`--fit REAL --model typo` (or `--set typo=1`) ran the whole fit, dozens of candidate traces, then failed."""
    import moesim.trace.synth
    from tests.trace.test_synth_fit import REAL
    monkeypatch.setattr(moesim.trace.synth, "fit_params", _fit_must_not_run)
    out = tmp_path / "like.parquet"
    for extra, field in ((["--model", "mixtral-8x7"], "--model"), (["--set", "skew_firs=1"], "skew_firs"),
                         (["--set", "cluster_size=99"], "cluster_size")):
        assert main(["trace", "synth", "--fit", str(REAL), *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"field '{field}'" in err
    assert not out.exists()


def test_synth_fit_for_another_model_says_the_statistics_will_differ(tmp_path, capsys, monkeypatch):
    import functools

    import moesim.trace.synth
    from tests.trace.test_synth_fit import REAL
    monkeypatch.setattr(moesim.trace.synth, "fit_params",
                        functools.partial(moesim.trace.synth.fit_params, rounds=1, steps=1))
    out = tmp_path / "like.parquet"
    args = ["trace", "synth", "--fit", str(REAL), "--prompt-len", "2", "--decode-len", "2", "--no-scores", "--out",
            str(out)]
    assert main([*args, "--model", "olmoe-1b-7b"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert ("note: fitted to a mixtral-8x7b trace (8 experts, top-2, 32 layers) and drawn for olmoe-1b-7b "
            "(64 experts, top-8, 16 layers): its statistics will not be the fitted ones") in printed
    assert read_meta(out).model.name == "olmoe-1b-7b"
    assert main([*args, "--model", "mixtral-8x7b"]) == 0  # the real trace's own model: nothing to say
    assert "drawn for" not in capsys.readouterr().out


def test_a_setting_without_a_value_is_shown_one_of_this_commands_own(capsys):
    """`trace synth --set skew_first` suggested `--set cache.slots_per_layer=4`, a replay parameter."""
    assert main(["trace", "synth", "--model", "mixtral-8x7b", "--set", "skew_first", "--out", "x.parquet"]) == 2
    assert capsys.readouterr().err == ("moesim: error: field '--set': 'skew_first' is not KEY=VALUE "
                                       "(fix: write e.g. --set skew_first=0.5)\n")
    assert main(["replay", "t.parquet", "--set", "cache"]) == 2
    assert "(fix: write e.g. --set cache.slots_per_layer=4)" in capsys.readouterr().err


def test_a_huge_request_count_is_refused_in_one_line_without_allocating_per_request(tmp_path):
    """`moesim trace synth --requests 2147483648` built a list of lengths per request before its size check
    refused them, over 4 GB (the fuzz test that drew this count had the test run killed for memory). Now the
    check is arithmetic: one line, exit 2, well under 1 GB of address space."""
    import subprocess
    import sys
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30)); "
            "from moesim.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "trace", "synth", "--model", "mixtral-8x7b", "--requests",
                           "2147483648", "--out", str(tmp_path / "x.parquet")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert "2,147,483,648 requests" in line and "beyond the limit of 2,147,483,647" in line
    assert not (tmp_path / "x.parquet").exists()


def test_inspect_validate_compare_and_upgrade_report_progress_in_rows(tmp_path, capsys, monkeypatch):
    """They read a trace once or twice (validation, then counting or writing) and printed nothing while they ran:
    23 s of silence for a 1.2-million-row trace's `inspect`, minutes for ten million rows."""
    import json
    import re
    monkeypatch.setenv("MOESIM_CACHE_DIR", "off")  # the validation pass runs every time
    trace = tmp_path / "s.parquet"
    assert main(["trace", "synth", "--model", "mixtral-8x7b", "--requests", "2", "--prompt-len", "3",
                 "--decode-len", "5", "--no-scores", "--out", str(trace)]) == 0
    rows = 2 * (3 + 5) * 32
    capsys.readouterr()
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")  # a line per batch read
    # inspect validates and counts; compare of a file with itself, checked already in this process, counts twice
    runs = {"inspect": (["trace", "inspect", str(trace), "--json", "-"], 2 * rows),
            "validate": (["trace", "validate", str(trace)], rows),
            "upgrade": (["trace", "upgrade", str(trace), "--out", str(tmp_path / "v2.parquet")], 2 * rows),
            "compare": (["trace", "compare", str(trace), str(trace), "--json", "-"], 2 * rows)}
    for name, (args, read) in runs.items():
        assert main(args) == 0
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.startswith(f"trace {name}: ")]
        assert len(lines) > 1 and lines[-1].startswith(f"trace {name}: done, {read:,}/{read:,} rows (100%)"), \
            captured.err
        assert all(re.match(rf"trace {name}: [\d,]+/{read:,} rows", line) for line in lines[:-1])
        if "--json" in args:
            json.loads(captured.out)  # stdout stays JSON alone


def test_the_fit_says_it_is_reading_the_real_trace_before_any_candidate(tmp_path, capsys, monkeypatch):
    """`--fit` showed "fit: 0 candidate traces, 10s elapsed" while it took the real trace's statistics."""
    import moesim.trace.synth
    from moesim.errors import MoesimError
    from tests.trace.test_synth_fit import REAL

    def stop(*args, **kwargs):
        raise MoesimError("stopped here")
    monkeypatch.setattr(moesim.trace.synth, "fit_params", stop)
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")
    assert main(["trace", "synth", "--fit", str(REAL), "--out", str(tmp_path / "f.parquet")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fit: ")]
    assert lines and lines[0].endswith(f"(statistics of {REAL.name})")


def test_trace_capture_is_the_capture_command(capsys):
    """`moesim trace capture ...`, where trace import and synth are, was "No such command 'capture'"."""
    from moesim.cli.app import cli
    assert cli.commands["trace"].commands["capture"] is cli.commands["capture"]
    assert main(["trace", "capture", "--model", "x"]) == 2
    assert "Missing option '--prompts'. (see 'moesim trace capture --help')" in capsys.readouterr().err
