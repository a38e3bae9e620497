"""`moesim sweep`'s console lines (running the points and the results file: tests/sweep/)."""

from __future__ import annotations

import shutil

import pytest

from moesim.cli import main
from tests.factories import TIGHT_GPU, write_spec, write_sweep_files


def failed_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("failed: ")]


def test_each_failed_line_names_the_trace_and_the_settings_that_vary(tmp_path, capsys):
    """In a two-trace sweep the lines read `failed: gpu-only-lru on hw.yaml (<id>)`: which trace failed, and at
    which grid value, was not said."""
    write_sweep_files(tmp_path, seed=5)
    other = write_sweep_files(tmp_path / "other", seed=6)
    shutil.move(other / "t.parquet", tmp_path / "u.parquet")
    path = write_spec(tmp_path, traces=["t.parquet", "u.parquet"], systems=["gpu-only-lru"],
                      grid={"cache.slots_per_layer": [1, 6]}, set=TIGHT_GPU)
    assert main(["sweep", str(path), "--out", str(tmp_path / "r.parquet"), "--workers", "1"]) == 1
    lines = failed_lines(capsys)
    assert [line.split(": field ")[0].rsplit(", point ", 1)[0] for line in sorted(lines)] == [
        "failed: gpu-only-lru on t.parquet / hw.yaml (cache.slots_per_layer=6",
        "failed: gpu-only-lru on u.parquet / hw.yaml (cache.slots_per_layer=6"]
    assert all("does not fit" in line for line in lines)


def test_traces_of_one_file_name_are_named_as_the_spec_writes_them(tmp_path, capsys):
    """a/t.parquet and b/t.parquet are both t.parquet: the line names them as the spec does."""
    for folder, seed in (("a", 5), ("b", 6)):
        write_sweep_files(tmp_path / folder, seed=seed)
    path = write_spec(tmp_path, traces=["a/t.parquet", "b/t.parquet"], hw=["a/hw.yaml"], systems=["gpu-only-lru"],
                      grid={"cache.slots_per_layer": [1, 6]}, set=TIGHT_GPU)
    assert main(["sweep", str(path), "--out", str(tmp_path / "r.parquet"), "--workers", "1"]) == 1
    assert sorted(line.split(", point ")[0] for line in failed_lines(capsys)) == [
        "failed: gpu-only-lru on a/t.parquet / a/hw.yaml (cache.slots_per_layer=6",
        "failed: gpu-only-lru on b/t.parquet / a/hw.yaml (cache.slots_per_layer=6"]


@pytest.mark.parametrize("command", [["plot", "--x", "system", "--y", "ttft_ms", "--out", "f.png"],
                                     ["report", "--no-gantt", "--out", "r.html"]])
def test_finished_points_not_yet_merged_are_said_to_be_left_out(tmp_path, capsys, command):
    """Issue: after `kill -9` of a sweep between two merges, `moesim plot OUT` and `moesim report OUT` drew the
    points OUT held (15 of 39 finished in a try) and said nothing of those waiting in OUT.parts/. Now a note
    counts them and names the command that merges them."""
    import pandas as pd

    from moesim.sweep import load_spec, run_sweep
    write_sweep_files(tmp_path, seed=5)
    out = tmp_path / "r.parquet"
    run_sweep(load_spec(write_spec(tmp_path, systems=["cpu-only", "gpu-only-lru"])), out, workers=1)
    args = [command[0], str(out), *(str(tmp_path / a) if a.endswith((".png", ".html")) else a for a in command[1:])]
    assert main(args) == 0
    assert "not merged" not in capsys.readouterr().err  # a complete sweep: nothing waits
    parts = tmp_path / "r.parquet.parts"
    parts.mkdir()
    waiting = pd.read_parquet(out).head(1).assign(point_id="0123456789abcdef")
    waiting.to_parquet(parts / "0123456789abcdef.parquet")
    (parts / ".lock").write_text("")
    assert main(args) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "not merged" in line]
    assert notes == [f"note: {out}: 1 finished point(s) in {parts}/ are not merged into it yet and are left out "
                     f"(a sweep still running, or one stopped by kill -9; the same `moesim sweep SPEC.yaml --out "
                     f"{out}` command merges them)"]


@pytest.mark.parametrize("command, why", [
    (["sweep", "spec.yaml"], "is for --json only"),
    (["plot", "r.parquet", "--x", "system", "--y", "ttft_ms"], "is not taken: this command writes files only"),
    (["report", "r.parquet"], "is not taken: this command writes files only")])
def test_standard_output_as_out_is_refused_without_naming_a_missing_option(tmp_path, capsys, command, why):
    """`moesim plot R --out -` said "'-' (standard output) is for --json only", an option that plot and report
    do not have (nor sweep had); the line now says these commands write files only."""
    write_sweep_files(tmp_path, seed=5)
    write_spec(tmp_path, systems=["cpu-only"])
    (tmp_path / "r.parquet").write_bytes(b"")  # never read: the output is refused first
    args = [command[0], *(str(tmp_path / a) if a.endswith((".yaml", ".parquet")) else a for a in command[1:])]
    assert main([*args, "--out", "-"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"moesim: error: field '--out': '-' (standard output) {why} (fix: give a file name)"]
    assert not (tmp_path / "r.parquet.parts").exists()


def test_json_holds_the_summary_and_every_row_and_stdout_nothing_else(tmp_path, capsys):
    """`moesim sweep SPEC --out R --json - | jq` had no such option. Now stdout holds the JSON alone (the summary
    line and the failed lines on stderr), also when a point failed (exit 1: its row says why), and a rerun's JSON
    counts the points already done."""
    import json
    write_sweep_files(tmp_path, seed=5)
    path = write_spec(tmp_path, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 6]}, set=TIGHT_GPU)
    out = tmp_path / "r.parquet"
    args = ["sweep", str(path), "--out", str(out), "--workers", "1", "--json", "-"]
    assert main(args) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert {k: doc[k] for k in ("points", "ran", "skipped", "failed", "out", "left_out")} == {
        "points": 2, "ran": 2, "skipped": 0, "failed": 1, "out": str(out), "left_out": []}
    assert [(row["cache.slots_per_layer"], row["status"]) for row in doc["rows"]] == [(1, "ok"), (6, "error")]
    assert doc["rows"][0]["tpot_ms_mean"] > 0 and "does not fit" in doc["rows"][1]["error"]
    assert doc["rows"][1]["tpot_ms_mean"] is None  # NaN is no JSON
    assert "2 points: 2 run" in captured.err and "failed: gpu-only-lru" in captured.err
    to_file = tmp_path / "r.json"
    assert main([*args[:-1], str(to_file)]) == 1
    assert json.loads(to_file.read_text())["skipped"] == 1  # the failed point ran again
    assert capsys.readouterr().out.endswith(f"wrote {to_file}\n")
