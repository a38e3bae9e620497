"""validate_trace: one test per malformed input; each message names file, column/key, row (when a row is at
fault) and a fix, and ``moesim trace validate`` exits 2 with one line on stderr."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moesim.cli import main
from moesim.errors import TraceFormatError
from moesim.model.spec import ModelSpec
from moesim.trace.io import write_trace
from moesim.trace.schema import META_KEY, TraceMeta
from moesim.trace.validate import validate_trace

MODEL = ModelSpec(name="tiny", num_layers=4, num_experts=8, top_k=2, hidden_size=8, moe_intermediate_size=16)
ROWS = 12  # 3 steps x 4 layers, one token each


def _valid(tmp_path) -> pa.Table:
    n = ROWS
    data = {"request": np.zeros(n), "step": np.repeat(np.arange(3), 4), "phase": ["decode"] * n,
            "position": np.repeat(np.arange(3), 4), "layer": np.tile(np.arange(4), 3),
            "experts": np.array([[i % 8, (i + 1) % 8] for i in range(n)]),
            "scores": np.full((n, 8), 0.125)}
    path = write_trace(tmp_path / "valid.parquet", data, TraceMeta(model=MODEL))
    return pq.read_table(path)


def _save(tmp_path, table: pa.Table, name: str = "bad.parquet"):
    path = tmp_path / name
    pq.write_table(table, path)
    return path


def _replace(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, array.type), array)


def _check(path, capsys, *parts: str) -> None:
    with pytest.raises(TraceFormatError) as err:
        validate_trace(path)
    message = str(err.value)
    for part in (str(path), "fix:", *parts):
        assert part in message, (part, message)
    assert main(["trace", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("moesim: error: ") and str(path) in captured.err


def test_valid_trace_passes(tmp_path):
    table = _valid(tmp_path)
    summary = validate_trace(tmp_path / "valid.parquet")
    assert (summary.rows, summary.steps) == (ROWS, 3) and table.num_rows == ROWS


def test_missing_column(tmp_path, capsys):
    table = _valid(tmp_path)
    _check(_save(tmp_path, table.drop(["layer"])), capsys, "field 'layer'", "required column missing")


def test_mistyped_column(tmp_path, capsys):
    table = _valid(tmp_path)
    bad = _replace(table, "step", pa.array(np.repeat(np.arange(3), 4).astype(np.float64)))
    _check(_save(tmp_path, bad), capsys, "field 'step'", "double", "cast the column to int32")


def _experts(rows: list[list[int]]) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.array(rows, np.int16).ravel()), 2)


def test_expert_outside_range(tmp_path, capsys):
    table = _valid(tmp_path)
    rows = [[i % 8, (i + 1) % 8] for i in range(ROWS)]
    rows[7] = [3, 8]
    _check(_save(tmp_path, _replace(table, "experts", _experts(rows))), capsys,
           "field 'experts'", "row 7", "outside [0, 8)")


def test_duplicate_expert_in_row(tmp_path, capsys):
    table = _valid(tmp_path)
    rows = [[i % 8, (i + 1) % 8] for i in range(ROWS)]
    rows[5] = [4, 4]
    _check(_save(tmp_path, _replace(table, "experts", _experts(rows))), capsys,
           "field 'experts'", "row 5", "duplicate expert")


def test_experts_length_not_top_k(tmp_path, capsys):
    table = _valid(tmp_path)
    rows = [[i % 8, (i + 1) % 8] for i in range(ROWS)]
    rows[9] = [1, 2, 3]
    _check(_save(tmp_path, _replace(table, "experts", pa.array(rows, pa.list_(pa.int16())))), capsys,
           "field 'experts'", "row 9", "3 values", "top_k")


def test_scores_length_not_num_experts(tmp_path, capsys):
    table = _valid(tmp_path)
    scores = pa.FixedSizeListArray.from_arrays(pa.array(np.full(ROWS * 6, 0.1, np.float16)), 6)
    _check(_save(tmp_path, _replace(table, "scores", scores)), capsys,
           "field 'scores'", "list length 6", "num_experts")


def test_scores_row_length_not_num_experts(tmp_path, capsys):
    table = _valid(tmp_path)
    rows = [[0.125] * 8 for _ in range(ROWS)]
    rows[2] = [0.5] * 7
    _check(_save(tmp_path, _replace(table, "scores", pa.array(rows, pa.list_(pa.float16())))), capsys,
           "field 'scores'", "row 2", "7 values", "num_experts")


def test_steps_out_of_order(tmp_path, capsys):
    table = _valid(tmp_path)
    steps = np.repeat(np.arange(3), 4).astype(np.int32)
    steps[8:] = 0  # the third step's rows claim step 0 after step 1
    _check(_save(tmp_path, _replace(table, "step", pa.array(steps))), capsys,
           "field 'step'", "row 8", "out of order", "sort the rows")


def test_layer_out_of_range(tmp_path, capsys):
    table = _valid(tmp_path)
    layers = np.tile(np.arange(4), 3).astype(np.int16)
    layers[11] = 4
    _check(_save(tmp_path, _replace(table, "layer", pa.array(layers))), capsys,
           "field 'layer'", "row 11", "outside [0, 4)")


def test_missing_metadata(tmp_path, capsys):
    table = _valid(tmp_path).replace_schema_metadata(None)
    _check(_save(tmp_path, table), capsys, "field 'moesim'", "no 'moesim' key-value metadata")


def test_unknown_schema_version(tmp_path, capsys):
    table = _valid(tmp_path)
    meta = json.loads(table.schema.metadata[META_KEY])
    meta["schema_version"] = 7
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    _check(_save(tmp_path, table), capsys, "field 'moesim.schema_version'", "unknown schema_version 7")


def test_not_parquet(tmp_path, capsys):
    path = tmp_path / "routes.parquet"
    path.write_text('{"layer": 0, "experts": [1, 2]}\n')
    _check(path, capsys, "not a Parquet file", "moesim trace import")
