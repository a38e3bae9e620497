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
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--out", str(tmp_path / "r.parquet"), "--workers", "1"])
    assert exit_.value.code == 1
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
    with pytest.raises(SystemExit):
        main(["sweep", str(path), "--out", str(tmp_path / "r.parquet"), "--workers", "1"])
    assert sorted(line.split(", point ")[0] for line in failed_lines(capsys)) == [
        "failed: gpu-only-lru on a/t.parquet / a/hw.yaml (cache.slots_per_layer=6",
        "failed: gpu-only-lru on b/t.parquet / a/hw.yaml (cache.slots_per_layer=6"]
