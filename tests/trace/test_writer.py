"""TraceWriter: a trace appears whole at its path or not at all, and a path it cannot take is refused first."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moesim.errors import TraceFormatError
from moesim.model.spec import ModelSpec
from moesim.trace import writer as writer_mod
from moesim.trace.schema import TraceMeta
from moesim.trace.writer import TraceWriter, write_trace

MODEL = ModelSpec(name="tiny", num_layers=2, num_experts=4, top_k=2, hidden_size=8, moe_intermediate_size=16)
ROWS = {"request": [0, 0], "step": [0, 0], "phase": ["prefill", "prefill"], "position": [0, 0], "layer": [0, 1],
        "experts": np.array([[0, 1], [2, 3]])}


def test_a_folder_as_the_output_is_refused_before_anything_is_written(tmp_path):
    """It failed at the very end with IsADirectoryError from the rename, the temporary file left beside."""
    folder = tmp_path / "out.parquet"
    folder.mkdir()
    with pytest.raises(TraceFormatError) as raised:
        TraceWriter(folder, TraceMeta(model=MODEL))
    assert (raised.value.source, raised.value.field) == (str(folder), "out")
    assert "directory" in str(raised.value) and str(folder / "trace.parquet") in raised.value.fix
    assert sorted(os.listdir(tmp_path)) == ["out.parquet"] and not os.listdir(folder)


def test_a_failed_rename_into_place_leaves_no_temporary_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))
    monkeypatch.setattr(writer_mod.os, "replace", refuse)
    with pytest.raises(PermissionError):
        write_trace(tmp_path / "t.parquet", ROWS, TraceMeta(model=MODEL))
    assert os.listdir(tmp_path) == []


def test_a_file_staged_by_the_command_is_written_in_place_not_under_a_second_temporary_name(tmp_path):
    """moesim.util.output_file stages a command's output as .NAME.PID.tmp.SUFFIX; the writer put its own
    temporary file inside that name (..NAME.PID.tmp.SUFFIX.PID.tmp), which a kill -9 left behind for good."""
    from moesim.util import output_file, staged_outputs
    seen: list[str] = []
    target = tmp_path / "t.parquet"
    with staged_outputs(), output_file(target) as staged:
        writer = TraceWriter(staged, TraceMeta(model=MODEL))
        writer.write(ROWS)
        seen = sorted(os.listdir(tmp_path))
        writer.close()
    assert seen == [staged.name] == [f".t.{os.getpid()}.tmp.parquet"]
    assert os.listdir(tmp_path) == ["t.parquet"]


def _step_rows(step: int) -> dict:
    """One decode step of one token over MODEL's two layers."""
    return {"request": [0, 0], "step": [step, step], "phase": ["decode", "decode"], "position": [step, step],
            "layer": [0, 1], "experts": np.array([[0, 1], [2, 3]])}


def test_many_small_writes_are_gathered_into_whole_row_groups(tmp_path, monkeypatch):
    """Each write was a row group of its own: a synthetic trace of short requests, written a step at a time,
    had 40,000 groups of 128 rows, a file 4.5 times larger and validated 9 times slower."""
    import pyarrow.parquet as pq

    from moesim.trace.io import iter_steps
    monkeypatch.setattr(writer_mod, "ROW_GROUP_ROWS", 64)
    path = tmp_path / "t.parquet"
    with TraceWriter(path, TraceMeta(model=MODEL)) as writer:
        for step in range(100):  # 200 rows in writes of 2
            writer.write(_step_rows(step))
    groups = pq.ParquetFile(path).metadata
    assert [groups.row_group(i).num_rows for i in range(groups.num_row_groups)] == [64, 64, 64, 8]
    assert [s.step for s in iter_steps(path)] == list(range(100))


def test_a_writer_closes_a_row_group_early_once_its_rows_hold_row_group_bytes(tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    monkeypatch.setattr(writer_mod, "ROW_GROUP_BYTES", 1)
    path = tmp_path / "t.parquet"
    with TraceWriter(path, TraceMeta(model=MODEL)) as writer:
        for step in range(3):
            writer.write(_step_rows(step))
    assert pq.ParquetFile(path).metadata.num_row_groups == 3


def test_list_columns_are_compressed_with_dictionaries_as_the_flat_ones(tmp_path):
    """parquet_options named the columns, but a list column's options apply under its values' path
    (experts.list.element): experts, weights and the predictors were written uncompressed, without dictionary."""
    import pyarrow.parquet as pq
    rows = {**ROWS, "weights": np.array([[0.6, 0.4], [0.7, 0.3]]), "pred_next_layer": [[1, 2], []]}
    path = write_trace(tmp_path / "t.parquet", rows, TraceMeta(model=MODEL))
    group = pq.ParquetFile(path).metadata.row_group(0)
    chunks = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    for leaf in ("experts.list.element", "weights.list.element", "pred_next_layer.list.element", "step"):
        assert chunks[leaf].compression == "ZSTD" and chunks[leaf].has_dictionary_page, leaf


def test_small_tables_gathered_are_joined_into_blocks(tmp_path, monkeypatch):
    """Each table gathered costs about 11 KB of objects beside its rows: a row group of one-token steps held
    32,768 of them (360 MB); they are joined COMPACT_TABLES at a time."""
    import pyarrow.parquet as pq
    monkeypatch.setattr(writer_mod, "COMPACT_TABLES", 4)
    path = tmp_path / "t.parquet"
    with TraceWriter(path, TraceMeta(model=MODEL)) as writer:
        for step in range(10):
            writer.write(_step_rows(step))
        assert len(writer._writer._pending) <= 4
    table = pq.read_table(path)
    assert table.column("step").to_pylist() == [s for s in range(10) for _ in range(2)]
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
