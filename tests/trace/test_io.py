"""Trace I/O: round trip of every column, streaming by step, atomic writes."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.model.spec import ModelSpec
from moesim.trace.io import TraceWriter, iter_steps, read_meta, write_trace
from moesim.trace.schema import TraceMeta

MODEL = ModelSpec(name="tiny", num_layers=3, num_experts=6, top_k=2, hidden_size=8, moe_intermediate_size=16)


def _trace_data(steps: int = 4, tokens: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    step, layer, position = np.meshgrid(np.arange(steps), np.arange(MODEL.num_layers), np.arange(tokens),
                                        indexing="ij")
    n = step.size
    experts = np.stack([rng.permutation(MODEL.num_experts)[:2] for _ in range(n)])
    scores = rng.random((n, MODEL.num_experts)).astype(np.float16)
    return {
        "request": np.zeros(n, np.int32), "step": step.ravel(), "phase": np.where(step.ravel() == 0, "prefill", "decode"),
        "position": position.ravel() + step.ravel() * tokens, "layer": layer.ravel(), "experts": experts,
        "weights": rng.random((n, 2)).astype(np.float32), "scores": scores,
        "pred_next_layer": [list(range(i % 3)) for i in range(n)], "pred_residual": [[i % 6] for i in range(n)],
        "pred_next_token": [[1, 2, 3][: i % 4] for i in range(n)], "token_id": np.arange(n) * 7,
    }


def test_round_trip_every_column(tmp_path):
    data = _trace_data()
    meta = TraceMeta(model=MODEL, source={"kind": "synthetic", "seed": 0}, weights_renormalized=True)
    path = write_trace(tmp_path / "t.parquet", data, meta)
    back = read_meta(path)
    assert back.model == MODEL and back.source == {"kind": "synthetic", "seed": 0} and back.weights_renormalized
    steps = list(iter_steps(path))
    assert [s.step for s in steps] == [0, 1, 2, 3]
    cat = lambda key: np.concatenate([getattr(s, key) for s in steps])  # noqa: E731
    assert np.array_equal(cat("experts"), data["experts"])
    assert np.array_equal(cat("weights"), data["weights"])
    assert cat("scores").dtype == np.float16 and np.array_equal(cat("scores"), data["scores"])
    assert np.array_equal(cat("token_id"), data["token_id"])
    assert np.array_equal(cat("position"), data["position"]) and np.array_equal(cat("layer"), data["layer"])
    assert cat("phase").tolist() == [0 if p == "prefill" else 1 for p in data["phase"]]
    for name in ("pred_next_layer", "pred_residual", "pred_next_token"):
        got = [list(map(int, v)) for s in steps for v in s.predictors[name]]
        assert got == data[name], name
    assert steps[1].tokens == 3 and [layer for layer, _ in steps[1].layers()] == [0, 1, 2]


def test_streaming_yields_steps_in_order_with_bounded_batches(tmp_path, monkeypatch):
    data = _trace_data(steps=50, tokens=7)
    path = write_trace(tmp_path / "t.parquet", data, TraceMeta(model=MODEL))
    import pyarrow.parquet as pq
    seen: list[int] = []
    real_iter = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        for batch in real_iter(self, *args, **kwargs):
            seen.append(batch.num_rows)
            yield batch
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    steps = list(iter_steps(path, batch_rows=10))  # a step (21 rows) spans several batches
    assert [s.step for s in steps] == list(range(50))
    assert all(s.rows == 21 for s in steps)
    assert max(seen) <= 10 and sum(seen) == 50 * 21


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    path = tmp_path / "t.parquet"
    data = _trace_data()
    with pytest.raises(RuntimeError):
        with TraceWriter(path, TraceMeta(model=MODEL), ["weights"]) as writer:
            writer.write({k: data[k] for k in ("request", "step", "phase", "position", "layer", "experts", "weights")})
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "t.parquet"
    write_trace(path, _trace_data(steps=2), TraceMeta(model=MODEL))
    before = path.read_bytes()
    with pytest.raises(ValueError):
        with TraceWriter(path, TraceMeta(model=MODEL)) as writer:
            writer.write({"request": [0]})  # lacks columns
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_scores_are_written_plain_the_other_columns_with_dictionaries(tmp_path):
    """Dictionary pages of float16 scores save little and decode 5-8x slower than plain ones: the writer
    leaves them out for ``scores`` only."""
    import pyarrow.parquet as pq
    data = _trace_data()
    path = write_trace(tmp_path / "t.parquet", data, TraceMeta(model=MODEL))
    pf = pq.ParquetFile(path)
    group = pf.metadata.row_group(0)
    dictionary = {pf.schema_arrow.names[i]: group.column(i).has_dictionary_page for i in range(group.num_columns)}
    assert dictionary["scores"] is False
    assert dictionary["step"] and dictionary["token_id"]
    back = np.concatenate([s.scores for s in iter_steps(path)])
    assert np.array_equal(back, data["scores"])
