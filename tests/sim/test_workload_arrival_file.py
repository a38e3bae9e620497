"""An arrival file that cannot be read as a table gets one line naming the file, what is wrong with it (empty,
not a CSV or Parquet file, a Parquet file cut short) and the fix; it said "unreadable (EmptyDataError)" or
"unreadable (ArrowInvalid)", the name of a pandas or Arrow exception."""

from __future__ import annotations

import gzip

import numpy as np
import pandas as pd
import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.sim.workload import WorkloadConfig, arrival_times
from tests.factories import write_trace_and_profile

FIX = "give a CSV or Parquet file with an arrival_s column: each request's arrival time in seconds"


def good_parquet(path):
    pd.DataFrame({"arrival_s": np.arange(1000) * 0.1}).to_parquet(path)
    return path


def cut_parquet(path):
    whole = good_parquet(path.with_name("whole.parquet")).read_bytes()
    path.write_bytes(whole[:len(whole) // 2])


@pytest.mark.parametrize("name, write, words", [
    ("a.csv", lambda p: p.write_bytes(b""), "the file is empty (0 bytes)"),
    ("a.parquet", lambda p: p.write_bytes(b""), "the file is empty (0 bytes)"),
    ("a.csv", lambda p: p.write_text("\n\n"), "the file is empty (no header line, no rows)"),
    ("a.parquet", cut_parquet, "not a Parquet file, or one cut short or damaged"),
    ("a.parquet", lambda p: p.write_text("arrival_s\n0.5\n"), "not a Parquet file, or one cut short or damaged"),
    ("a.csv", lambda p: p.write_bytes(gzip.compress(b"arrival_s\n0.5\n")), "neither a Parquet file nor a CSV file"),
    ("a.csv", lambda p: p.write_text("arrival_s\n0.5\n1,2,3\n"), "not a CSV file that can be read (Error tokenizing"),
])
def test_an_unreadable_arrival_file_says_what_is_wrong_and_the_fix(tmp_path, name, write, words):
    path = tmp_path / name
    write(path)
    w = WorkloadConfig(arrival="trace", arrival_file=str(path), requests=1)
    with pytest.raises(ConfigError) as err:
        arrival_times(w, np.random.default_rng(0))
    text = str(err.value)
    assert text.startswith(f"{path}, field 'workload.arrival_file': {words}") and text.endswith(f"(fix: {FIX})")
    assert "\n" not in text and "unreadable" not in err.value.detail and "Error)" not in text, text


def test_a_parquet_file_named_csv_is_read_as_parquet(tmp_path):
    path = good_parquet(tmp_path / "arrivals.csv")
    w = WorkloadConfig(arrival="trace", arrival_file=str(path), requests=3)
    assert arrival_times(w, np.random.default_rng(0)).tolist() == [0.0, 0.1, 0.2]


def test_serve_sim_refuses_an_empty_arrival_file_in_one_line(tmp_path, capsys):
    trace, hw = write_trace_and_profile(tmp_path, 7)
    (tmp_path / "arrivals.csv").write_bytes(b"")
    code = main(["serve-sim", trace, "--hw", hw, "--system", "cpu-only", "--requests", "1",
                 "--set", "workload.arrival=trace", "--set", f"workload.arrival_file={tmp_path / 'arrivals.csv'}"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"moesim: error: {tmp_path / 'arrivals.csv'}, field 'workload.arrival_file': "
                                 f"the file is empty (0 bytes) (fix: {FIX})\n")
