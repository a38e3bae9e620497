"""``moesim trace upgrade``: a v1 trace rewritten in format v2 replays and reads the same."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.cli import main
from moesim.model.spec import ModelSpec
from moesim.trace.io import iter_steps, read_meta, write_trace
from moesim.trace.schema import META_KEY, TraceMeta
from moesim.trace.upgrade import upgrade_trace

MODEL = ModelSpec(name="tiny", num_layers=2, num_experts=8, top_k=2, hidden_size=8, moe_intermediate_size=16)


def _version_1(tmp_path, steps: int = 5):
    """A valid trace with scores, written as format v1 wrote it (scores a fixed-size list of float16)."""
    rng = np.random.default_rng(0)
    step, layer = np.meshgrid(np.arange(steps), np.arange(MODEL.num_layers), indexing="ij")
    n = step.size
    scores = rng.dirichlet(np.ones(MODEL.num_experts), n).astype(np.float16)
    experts = np.argsort(-scores.astype(np.float64), axis=1, kind="stable")[:, :2].astype(np.int16)
    weights = np.take_along_axis(scores, experts.astype(np.int64), axis=1).astype(np.float32)
    data = {"request": np.zeros(n, np.int32), "step": step.ravel(), "phase": ["decode"] * n,
            "position": step.ravel(), "layer": layer.ravel(), "experts": experts, "weights": weights,
            "scores": scores}
    table = pq.read_table(write_trace(tmp_path / "v2.parquet", data, TraceMeta(model=MODEL)))
    meta = json.loads(table.schema.metadata[META_KEY])
    meta["schema_version"] = 1
    as_list = pa.FixedSizeListArray.from_arrays(pa.array(scores.ravel()), MODEL.num_experts)
    old = table.set_column(table.column_names.index("scores"), "scores", as_list)
    path = tmp_path / "v1.parquet"
    pq.write_table(old.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}), path)
    return path, scores


def test_a_version_1_trace_comes_out_in_version_2_with_the_same_rows(tmp_path):
    path, scores = _version_1(tmp_path)
    done = upgrade_trace(path, tmp_path / "up.parquet")
    assert (done.rows, done.from_version, done.has_scores, done.rewrote_scores) == (10, 1, True, True)
    up = tmp_path / "up.parquet"
    assert read_meta(up).schema_version == 2 and read_meta(up).model == MODEL
    assert pq.ParquetFile(up).schema_arrow.field("scores").type == pa.binary(2 * MODEL.num_experts)
    before, after = list(iter_steps(path)), list(iter_steps(up))
    assert len(before) == len(after) == 5
    for a, b in zip(before, after):
        for name in ("request", "position", "layer", "phase", "experts", "weights", "scores"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(np.concatenate([s.scores for s in after]), scores)


def test_the_command_names_what_it_did_and_refuses_to_overwrite_its_input(tmp_path, capsys):
    path, _ = _version_1(tmp_path)
    out = tmp_path / "up.parquet"
    assert main(["trace", "upgrade", str(path), "--out", str(out)]) == 0
    assert "trace v2 from v1, 10 rows, scores rewritten" in capsys.readouterr().out
    assert main(["trace", "upgrade", str(out), "--out", str(tmp_path / "again.parquet")]) == 0
    assert "trace v2 from v2, 10 rows, scores already one binary value a row" in capsys.readouterr().out
    before = path.read_bytes()
    assert main(["trace", "upgrade", str(path), "--out", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would overwrite an input" in err and path.read_bytes() == before


def test_a_faulty_trace_is_refused_and_nothing_is_written(tmp_path, capsys):
    path, _ = _version_1(tmp_path)
    table = pq.read_table(path)
    bad = table.set_column(table.column_names.index("layer"), "layer", pa.array(np.full(10, 7, np.int16)))
    pq.write_table(bad, tmp_path / "bad.parquet")
    assert main(["trace", "upgrade", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "up.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field 'layer'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet", "v1.parquet", "v2.parquet"]


def test_upgrade_to_a_folder_is_refused_before_reading_the_trace(tmp_path):
    """moesim.trace.upgrade.upgrade_trace wrote the whole trace, then failed with IsADirectoryError."""
    import pytest

    from moesim.errors import TraceFormatError
    folder = tmp_path / "v2.parquet"
    folder.mkdir()
    with pytest.raises(TraceFormatError, match="output path is a directory") as raised:
        upgrade_trace(_version_1(tmp_path), folder)
    assert raised.value.field == "out"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_trace_of_one_row_group_a_step_comes_out_in_whole_row_groups(tmp_path):
    """Older writers ended a row group at every write (one a step for a synthetic trace of short requests:
    40,000 groups of 128 rows); upgrade copied the source's groups as they were."""
    path, _ = _version_1(tmp_path)
    table = pq.read_table(path)
    tiny = tmp_path / "tiny.parquet"
    pq.write_table(table, tiny, row_group_size=2)  # one group a step
    assert pq.ParquetFile(tiny).metadata.num_row_groups == 5
    upgrade_trace(tiny, tmp_path / "up.parquet")
    up = pq.ParquetFile(tmp_path / "up.parquet")
    assert up.metadata.num_row_groups == 1 and up.metadata.num_rows == 10
    assert [s.step for s in iter_steps(tmp_path / "up.parquet")] == list(range(5))
