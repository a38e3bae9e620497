"""trace_stats at scale: per-request state freed after each request's last step, in narrow integers, with
every statistic as a straightforward count over all rows gives it."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.model.spec import ModelSpec
from moesim.trace import stats as stats_mod
from moesim.trace.io import write_trace
from moesim.trace.schema import TraceMeta
from moesim.trace.stats import _accumulate, trace_stats

TOY = ModelSpec(name="toy", num_layers=2, num_experts=6, top_k=2, hidden_size=8, moe_intermediate_size=8)

# One MoE layer shown (layer 1 routes the same sets shifted by one expert, so it has the same reuse).
#   step 0: prefill of request 0 (position 0)  [0, 1]
#   step 1: decode of request 0 (position 1)   [1, 2]   reuse 1/2 (1 again)
#   step 2: prefill of request 1 (position 0)  [3, 4]
#   step 3: decode of request 1 (position 1)   [3, 4]   reuse 2/2
#   step 4: decode of request 0 (position 2)   [2, 5]   reuse 1/2 (2 again; request 0 came back after a gap)
#   step 5: prefill of request 2 (position 0)  [0, 1]   first token: no reuse (its state was never request 0's)
ROWS = [(0, 0, 0, 0, [0, 1]), (1, 0, 1, 1, [1, 2]), (2, 1, 0, 0, [3, 4]), (3, 1, 1, 1, [3, 4]),
        (4, 0, 2, 1, [2, 5]), (5, 2, 0, 0, [0, 1])]  # step, request, position, phase, layer-0 experts


def write_gap_trace(path) -> None:
    rows = [(step, layer, request, position, phase, [(e + layer) % 6 for e in experts])
            for step, request, position, phase, experts in ROWS for layer in range(2)]
    cols = list(zip(*rows))
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.array(cols[4], dtype=np.int8), "experts": np.array(cols[5])}
    write_trace(path, data, TraceMeta(model=TOY, source={"kind": "synthetic"}))


@pytest.mark.parametrize("chunk_rows", [1, 2, 3, 65_536])
def test_reuse_of_a_request_that_comes_back_after_a_gap(tmp_path, monkeypatch, chunk_rows):
    monkeypatch.setattr(stats_mod, "CHUNK_ROWS", chunk_rows)  # 1, 2: one step per chunk, slots freed between
    path = tmp_path / "gap.parquet"
    write_gap_trace(path)
    s = trace_stats(path)
    assert s["reuse_prev_token_by_layer"] == [pytest.approx(2 / 3)] * 2  # (1/2 + 1 + 1/2) / 3 tokens
    assert (s["requests"], s["requests_with_prompt"], s["rows"]) == (3, 3, 12)
    assert s["tokens_by_phase"] == {"prefill": 3, "decode": 3}


def test_state_holds_the_requests_in_flight_in_the_narrowest_integer(tmp_path, monkeypatch):
    monkeypatch.setattr(stats_mod, "CHUNK_ROWS", 2)
    path = tmp_path / "gap.parquet"
    write_gap_trace(path)
    _, acc = _accumulate(path)
    assert acc.state.experts.dtype == np.int8  # 6 experts
    assert len(acc.state.experts) == 16  # never grown: at most 2 requests in flight
    assert (acc.state.experts == -1).all()  # every request finished and freed
    wide = ModelSpec(name="wide", num_layers=1, num_experts=256, top_k=2, hidden_size=8, moe_intermediate_size=8)
    state = stats_mod._RequestState(1, 2, 256, stats_mod._RequestSpans(np.arange(3), np.arange(3), 0))
    assert state.experts.dtype == np.int16 and wide.num_experts == 256


def reference_reuse(rows: list[tuple[int, int, int, int, list[int]]], layers: int, top_k: int) -> list[float]:
    """Previous-token reuse as the module docstring defines it, one row at a time with a dict of last sets."""
    last: dict[tuple[int, int], set[int]] = {}
    total, count = [0.0] * layers, [0] * layers
    for step, layer, request, position, experts in sorted(rows, key=lambda r: (r[2], r[1], r[0], r[3])):
        if (request, layer) in last:
            total[layer] += len(set(experts) & last[request, layer]) / top_k
            count[layer] += 1
        last[request, layer] = set(experts)
    return [t / n for t, n in zip(total, count)]


@pytest.mark.parametrize("chunk_rows", [7, 100, 65_536])
def test_statistics_match_a_row_by_row_count_on_interleaved_requests(tmp_path, monkeypatch, chunk_rows):
    monkeypatch.setattr(stats_mod, "CHUNK_ROWS", chunk_rows)
    rng = np.random.default_rng(5)
    model = ModelSpec(name="toy", num_layers=3, num_experts=200, top_k=4, hidden_size=8, moe_intermediate_size=8)
    rows, position = [], {}
    for step in range(60):  # requests join and leave at random; some come back after a pause
        batch = sorted(rng.choice(25, size=int(rng.integers(1, 6)), replace=False).tolist())
        for layer in range(model.num_layers):
            for request in batch:
                experts = rng.choice(model.num_experts, size=model.top_k, replace=False).tolist()
                rows.append((step, layer, request, position.get(request, 0), experts))
        for request in batch:
            position[request] = position.get(request, 0) + 1
    cols = list(zip(*rows))
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.ones(len(rows), dtype=np.int8), "experts": np.array(cols[4])}
    path = tmp_path / "interleaved.parquet"
    write_trace(path, data, TraceMeta(model=model, source={"kind": "synthetic"}))
    s = trace_stats(path)
    assert s["reuse_prev_token_by_layer"] == pytest.approx(reference_reuse(rows, model.num_layers, model.top_k))
    assert s["requests"] == len({r[2] for r in rows}) and s["requests_with_prompt"] == 0


@pytest.mark.parametrize("batch_size", [3, 7, 1000])
def test_reading_one_row_group_at_a_time_gives_pyarrows_batches(tmp_path, monkeypatch, batch_size):
    import pyarrow.parquet as pq

    from moesim.trace import writer as writer_mod
    from moesim.trace.io import iter_record_batches
    monkeypatch.setattr(writer_mod, "ROW_GROUP_ROWS", 50)  # two row groups of 50 rows: batches of 3 and 7 straddle them
    path = tmp_path / "groups.parquet"
    rows = [(step, layer, 0, step, 1, [0, 1]) for step in range(30) for layer in range(2)] + \
        [(30 + step, layer, 1, step, 1, [2, 3]) for step in range(20) for layer in range(2)]
    cols = list(zip(*rows))
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.array(cols[4], dtype=np.int8), "experts": np.array(cols[5])}
    write_trace(path, data, TraceMeta(model=TOY, source={"kind": "synthetic"}))
    pf = pq.ParquetFile(path)
    assert pf.metadata.num_row_groups == 2
    for columns in (pf.schema_arrow.names, ["request", "step", "phase"]):
        theirs = list(pf.iter_batches(batch_size=batch_size, columns=columns))
        ours = list(iter_record_batches(pf, batch_size, columns))
        assert [b.num_rows for b in ours] == [b.num_rows for b in theirs]
        assert all(a.equals(b) for a, b in zip(ours, theirs))
