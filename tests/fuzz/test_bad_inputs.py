"""Bad input never gets through: each generated invalid input, through every command that reads it, exits 2
with exactly one line on stderr naming the file (or option), no traceback, no output file left, in time.

The corpus (tests/fuzz/corpus.py, mutations in tests/fuzz/mutations.py) covers traces, hardware profiles, sweep specs, ``--set`` values, output
paths and importer logs; hypothesis draws cases from it here, in this process. The whole corpus (500+
inputs) runs with ``benchmarks/fuzz_bad_inputs.py``, which prints counts by outcome.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.cli import main
from tests.fuzz.corpus import build, run_case
from tests.fuzz.mutations import trace_mutations

CORPUS_SIZE = 160


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fuzz"), seed=14, size=CORPUS_SIZE)


def test_every_family_is_in_the_corpus(corpus):
    assert {c.family for c in corpus} == {"trace", "profile", "set", "spec", "output", "import", "path"}
    assert len(corpus) == CORPUS_SIZE


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_input_is_one_named_line_and_exit_2(corpus, data):
    case = data.draw(st.sampled_from(corpus), label="case")
    command = data.draw(st.sampled_from(case.commands), label="command")
    outcome, err = run_case(case, command, limit_s=60)
    assert outcome == "clean", (case.family, case.name, command, outcome, err)


#: faults in optional columns only (scores, weights, token ids): the two systems below read none of them
UNREAD_FAULTS = sorted(n for n in trace_mutations()
                       if any(c in n for c in ("score", "weight", "token_id")) and "as_string" not in n)


@pytest.mark.parametrize("system", ["gpu-only-lru", "cpu-only"])
def test_faults_in_columns_a_system_never_reads_refuse_its_replay(tmp_path, system):
    """Those columns are checked beside the run; a fault still gives the one line and exit 2, and no output."""
    import numpy as np
    import pyarrow.parquet as pq

    from tests.fuzz.corpus import Case, write_valid
    rng = np.random.default_rng(5)
    base = write_valid(tmp_path / "valid.parquet", rng)
    assert len(UNREAD_FAULTS) == 19  # 9 of scores (3 in the list form of version 1), 7 of weights, 3 of token ids
    for name in UNREAD_FAULTS:
        path = tmp_path / f"{name}.parquet"
        pq.write_table(trace_mutations()[name](pq.read_table(base), rng), path)
        out = tmp_path / f"{name}.json"
        case = Case("trace", name, [], names=str(path), outputs=[out])
        command = ["replay", str(path), "--hw", "rtx4090", "--system", system, "--json", str(out)]
        outcome, err = run_case(case, command)
        assert outcome == "clean", (name, outcome, err)


def test_every_trace_mutation_fails_trace_validate(corpus):
    traces = [c for c in corpus if c.family == "trace"]
    bad = [(c.name, run_case(c, c.commands[0])) for c in traces]
    assert [(name, r) for name, r in bad if r[0] != "clean"] == []


def test_internal_error_is_one_line_asking_for_a_report(monkeypatch, capsys):
    import moesim.cli.replay_cmd as replay_cmd
    monkeypatch.setattr(replay_cmd, "parse_settings", lambda s: 1 / 0)
    assert main(["replay", "traces/mixtral-8x7b-humaneval.parquet", "--system", "gpu-only-lru"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "please report" in err and "ZeroDivisionError" in err
    assert "Traceback" not in err
    with pytest.raises(ZeroDivisionError):  # --debug shows the real traceback
        main(["--debug", "replay", "traces/mixtral-8x7b-humaneval.parquet", "--system", "gpu-only-lru"])


@pytest.mark.parametrize("args, command", [
    (["replay", "--bogus"], "moesim replay"),
    # click's parser errors carry no command: it is read off the command line
    (["replay", "t.parquet", "--hw"], "moesim replay"),
    (["trace", "import", "x.jsonl", "--format"], "moesim trace import"),
    (["--bogus"], "moesim"),
])
def test_usage_errors_are_one_line_pointing_to_the_commands_help(capsys, args, command):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and args[-1] in err and err.rstrip().endswith(f"(see '{command} --help')")


@pytest.mark.parametrize("args", [[], ["trace"]])
def test_a_group_without_its_command_shows_its_help(capsys, args):
    """Not the help flattened into one error line."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Usage: {' '.join(['moesim', *args])} [OPTIONS] COMMAND [ARGS]...\n")
    assert "\nCommands:\n" in err and "moesim: error" not in err


def test_special_files_are_written_not_replaced(tmp_path, capsys):
    import stat
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    import threading
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    code = main(["replay", "traces/mixtral-8x7b-humaneval.parquet", "--system", "gpu-only-lru", "--json", str(fifo)])
    reader.join(timeout=30)
    assert code == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a pipe
    assert b'"tpot_ms_mean"' in got[0]
    assert main(["replay", "traces/mixtral-8x7b-humaneval.parquet", "--system", "gpu-only-lru", "--json",
                 "/dev/null"]) == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if Path("/dev/full").exists():
        capsys.readouterr()
        assert main(["replay", "traces/mixtral-8x7b-humaneval.parquet", "--system", "gpu-only-lru", "--json",
                     "/dev/full"]) == 2
        assert "/dev/full" in capsys.readouterr().err and stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_stale_temporaries_of_dead_writers_are_cleaned(tmp_path):
    import subprocess
    import sys
    from moesim.util import atomic_write_text
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    stale = tmp_path / f".out.json.{dead}.tmp"
    live = tmp_path / f".out.json.{os.getppid()}.tmp"
    stale.write_text("half")
    live.write_text("being written")
    atomic_write_text(tmp_path / "out.json", "{}")
    assert not stale.exists() and live.exists() and (tmp_path / "out.json").read_text() == "{}"



@pytest.mark.parametrize("name", sorted(trace_mutations()))
def test_each_trace_fault_is_refused_by_the_validator_naming_file_and_field(tmp_path, name):
    import numpy as np
    import pyarrow.parquet as pq

    from moesim.errors import TraceFormatError
    from moesim.trace.validate import validate_trace
    from tests.fuzz.corpus import write_valid
    rng = np.random.default_rng(3)
    base = write_valid(tmp_path / "valid.parquet", rng)
    validate_trace(base)  # the base is valid
    path = tmp_path / f"{name}.parquet"
    pq.write_table(trace_mutations()[name](pq.read_table(base), rng), path)
    with pytest.raises(TraceFormatError) as err:
        validate_trace(path)
    assert str(path) in str(err.value) and "fix:" in str(err.value)
