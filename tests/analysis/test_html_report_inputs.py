"""`moesim report` on results it cannot fully draw: a prefill-only sweep, columns missing or of the wrong type."""

from __future__ import annotations

import html

import numpy as np
import pytest

from moesim.cli import main
from tests.analysis.test_figures import results


def report(frame, tmp_path, capsys, *extra: str) -> tuple[int, str, str]:
    """Exit status, the page (or '') and stderr plus stdout of `moesim report` on ``frame``."""
    path = tmp_path / "r.parquet"
    frame.to_parquet(path)
    page = tmp_path / "report.html"
    code = main(["report", str(path), "--out", str(page), "--no-gantt", *extra])
    captured = capsys.readouterr()
    return code, page.read_text() if page.exists() else "", captured.err + captured.out


def test_a_prefill_only_sweep_is_reported_by_ttft(tmp_path, capsys):
    """TPOT is undefined in every row of a prefill-only trace's sweep: the report failed with
    "field '--y': column 'tpot_ms_mean' has no finite values", an option `moesim report` does not have."""
    frame = results()
    frame = frame.assign(ttft_ms=frame["tpot_ms_mean"] * 10, tpot_ms_mean=np.nan)
    code, page, said = report(frame, tmp_path, capsys)
    assert code == 0, said
    assert "<h2>TTFT (ms) by setting and system</h2>" in page
    assert '<figure id="tpot_vs_slots">' in page and "TTFT (no run decoded a token) against GPU cache" in page
    assert "--y" not in said and "--y" not in page
    # the fastest by TTFT: static-hot (60 ms base) beats gpu-only-lru (100 ms); the bound is not counted
    assert page.count('<td class="text">static-hot</td>') == 6


@pytest.mark.parametrize("change, words", [
    (lambda f: f.drop(columns=["tpot_ms_mean"]), "TPOT (ms) by setting"),  # nothing to rank by: no table
    (lambda f: f.drop(columns=["gpu_hit_rate"]), "no hit-rate figure: no column 'gpu_hit_rate'"),
    (lambda f: f.drop(columns=["cache.slots_per_layer"]), "the sweep varies no cache size"),
    (lambda f: f.assign(tpot_ms_mean=f["tpot_ms_mean"].astype(str)), "TPOT (ms) by setting"),
])
def test_a_figure_or_table_the_results_cannot_give_is_left_out_with_the_reason(tmp_path, capsys, change, words):
    """Each of these was an internal error (KeyError, TypeError in pivot_table) and no page."""
    code, page, said = report(change(results()), tmp_path, capsys)
    assert code == 0, said
    assert "internal error" not in said and "<h2>All points</h2>" in page
    if words.startswith("TPOT"):
        assert words not in page
    else:
        assert html.escape(words) in page and words in said


def test_results_without_a_trace_column_say_why_there_is_no_gantt(tmp_path, capsys):
    frame = results().drop(columns=["trace"])
    path = tmp_path / "r.parquet"
    frame.to_parquet(path)
    code = main(["report", str(path), "--out", str(tmp_path / "report.html")])
    said = capsys.readouterr()
    assert code == 0 and "internal error" not in said.err + said.out
    assert "no Gantt chart: field 'trace': the point has no 'trace'" in said.err  # a note: stderr, as plot's
    assert said.out.strip() == f"wrote {tmp_path / 'report.html'}"


def test_results_without_systems_are_one_line_naming_the_file_and_column(tmp_path, capsys):
    code, page, said = report(results().drop(columns=["system"]), tmp_path, capsys)
    assert code == 2 and page == ""
    assert said.strip().splitlines() == [f"moesim: error: {tmp_path / 'r.parquet'}, field 'system': not a sweep "
                                         "result (no 'system' column) (fix: give the --out file of `moesim sweep`)"]
