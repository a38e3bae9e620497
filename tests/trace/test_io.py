"""Trace I/O: round trip of every column, streaming by step, atomic writes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.model.spec import ModelSpec
from moesim.trace.io import Step, TraceWriter, iter_steps, read_frame, read_meta, write_trace
from moesim.trace.schema import SCHEMA_VERSION, TraceMeta

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


def test_steps_are_read_one_row_group_at_a_time(tmp_path, monkeypatch):
    """A replay's steps are read a row group at a time: pyarrow's reader over the whole file kept the list
    columns of every row group it had read until the end, so a replay's memory grew with the trace (16 million
    rows of Mixtral: 383 MiB, 196 MiB a row group at a time). The steps are those of the whole-file reader."""
    import pyarrow.parquet as pq
    import moesim.trace.writer as writer
    monkeypatch.setattr(writer, "ROW_GROUP_ROWS", 40)  # 50 steps of 21 rows: 27 row groups, steps across them
    data = _trace_data(steps=50, tokens=7)
    path = write_trace(tmp_path / "t.parquet", data, TraceMeta(model=MODEL))
    assert pq.ParquetFile(path).metadata.num_row_groups == 27
    groups_read: list = []
    real_iter = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        groups_read.append(kwargs.get("row_groups"))
        return real_iter(self, *args, **kwargs)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    steps = list(iter_steps(path, batch_rows=16))
    assert groups_read == [[g] for g in range(27)]
    assert [s.step for s in steps] == list(range(50)) and all(s.rows == 21 for s in steps)
    assert np.array_equal(np.concatenate([s.experts for s in steps]), data["experts"])


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


def test_scores_are_one_uncompressed_binary_value_per_row_of_little_endian_float16(tmp_path):
    """Format v2: no per-value repetition levels to decode, and no zstd (it saved 13% and made the read five
    times slower)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    data = _trace_data()
    path = write_trace(tmp_path / "t.parquet", data, TraceMeta(model=MODEL))
    pf = pq.ParquetFile(path)
    assert read_meta(path).schema_version == SCHEMA_VERSION == 2
    assert pf.schema_arrow.field("scores").type == pa.binary(2 * MODEL.num_experts)
    group = pf.metadata.row_group(0)
    codecs = {group.column(i).path_in_schema: group.column(i).compression for i in range(group.num_columns)}
    assert codecs["scores"] == "UNCOMPRESSED" and codecs["step"] == "ZSTD"
    first = pq.read_table(path, columns=["scores"]).column(0)[0].as_py()
    assert first == data["scores"][0].astype("<f2").tobytes()


def test_a_version_1_trace_with_scores_as_lists_reads_and_validates_as_before(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from moesim.trace.schema import META_KEY
    from moesim.trace.validate import validate_trace
    data = _trace_data()
    data["weights"] = -np.sort(-data["weights"], axis=1)  # highest first, as the validator wants
    table = pq.read_table(write_trace(tmp_path / "v2.parquet", data, TraceMeta(model=MODEL)))
    meta = json.loads(table.schema.metadata[META_KEY])
    meta["schema_version"] = 1
    as_list = pa.FixedSizeListArray.from_arrays(pa.array(data["scores"].ravel(), pa.float16()), MODEL.num_experts)
    old = table.set_column(table.column_names.index("scores"), "scores", as_list)
    path = tmp_path / "v1.parquet"
    pq.write_table(old.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}), path)
    assert read_meta(path).schema_version == 1
    assert validate_trace(path).rows == len(data["step"])
    back = np.concatenate([s.scores for s in iter_steps(path)])
    assert back.dtype == np.float16 and np.array_equal(back, data["scores"])
    assert np.array_equal(np.stack(read_frame(path).scores.to_numpy()), data["scores"])


def test_read_frame_gives_each_row_its_scores_as_float16_values(tmp_path):
    data = _trace_data()
    frame = read_frame(write_trace(tmp_path / "t.parquet", data, TraceMeta(model=MODEL)))
    assert len(frame) == len(data["step"])
    scores = np.stack(frame.scores.to_numpy())
    assert scores.dtype == np.float16 and np.array_equal(scores, data["scores"])
    assert np.array_equal(np.stack(frame.experts.to_numpy()), data["experts"])


# ----------------------------------------------------------------------------- decoded once per process
@pytest.fixture
def decodes(monkeypatch):
    """Count the Parquet decodes behind iter_steps (a fresh cache)."""
    import moesim.trace.io as io
    monkeypatch.setattr(io, "_DECODED", type(io._DECODED)())
    monkeypatch.setattr(io, "_KEEP", [True])  # as in a sweep worker
    calls: list[tuple] = []
    real = io._decode_steps

    def counted(path, columns, batch_rows):
        calls.append((str(path), None if columns is None else tuple(columns)))
        yield from real(path, columns, batch_rows)
    monkeypatch.setattr(io, "_decode_steps", counted)
    return calls


def _as_tuples(steps) -> list:
    return [(s.step, s.experts.tolist(), s.position.tolist(), s.scores.tolist() if s.scores is not None else None)
            for s in steps]


def test_a_trace_read_to_the_end_is_decoded_once_per_process_and_columns(tmp_path, decodes):
    data = _trace_data()
    path = write_trace(tmp_path / "t.parquet", data, TraceMeta(model=MODEL))
    first = list(iter_steps(path, columns=()))
    again = list(iter_steps(str(path), columns=[]))
    assert decodes == [(str(path), ())] and again == first and all(a is b for a, b in zip(first, again))
    with_scores = list(iter_steps(path, columns=["scores"]))  # other columns: a decode of their own
    assert len(decodes) == 2 and with_scores[0].scores is not None and first[0].scores is None
    assert _as_tuples(list(iter_steps(path, columns=["scores"]))) == _as_tuples(with_scores) and len(decodes) == 2


def test_shared_steps_are_read_only(tmp_path, decodes):
    path = write_trace(tmp_path / "t.parquet", _trace_data(), TraceMeta(model=MODEL))
    step = next(iter(list(iter_steps(path))))
    for array in (step.experts, step.layer, step.weights, step.scores, step.predictors["pred_residual"][0]):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1


def test_a_rewritten_file_is_decoded_again(tmp_path, decodes):
    path = tmp_path / "t.parquet"
    write_trace(path, _trace_data(seed=0), TraceMeta(model=MODEL))
    before = _as_tuples(iter_steps(path))
    write_trace(path, _trace_data(seed=1), TraceMeta(model=MODEL))
    after = _as_tuples(iter_steps(path))
    assert len(decodes) == 2 and after != before
    assert after == _as_tuples(_trace_steps_fresh(path))


def _trace_steps_fresh(path):
    import moesim.trace.io as io
    return list(io._decode_steps(path, None, 65_536))


def test_a_trace_over_the_limit_or_read_partly_is_not_kept(tmp_path, decodes, monkeypatch):
    import moesim.trace.io as io
    path = write_trace(tmp_path / "t.parquet", _trace_data(), TraceMeta(model=MODEL))
    next(iter(iter_steps(path)))  # a reader that stops early
    assert io._DECODED == {}
    monkeypatch.setattr(io, "DECODED_CACHE_BYTES", 2_000)  # less than the trace
    streamed = _as_tuples(iter_steps(path))
    assert io._DECODED == {} and streamed == _as_tuples(iter_steps(path)) and len(decodes) == 3


def test_the_least_recently_used_trace_goes_first(tmp_path, decodes, monkeypatch):
    import moesim.trace.io as io
    paths = [write_trace(tmp_path / f"t{i}.parquet", _trace_data(seed=i), TraceMeta(model=MODEL)) for i in range(3)]
    list(iter_steps(paths[0]))
    size = next(iter(io._DECODED.values())).size
    monkeypatch.setattr(io, "DECODED_CACHE_BYTES", 2 * size + size // 2)  # room for two
    list(iter_steps(paths[1]))
    list(iter_steps(paths[0]))  # now the most recent
    list(iter_steps(paths[2]))  # evicts paths[1]
    assert [k[0] for k in io._DECODED] == [str(paths[0].resolve()), str(paths[2].resolve())]
    list(iter_steps(paths[0]))
    assert len(decodes) == 3


def test_traces_are_kept_only_where_asked(tmp_path, decodes, monkeypatch):
    """A single replay streams (memory bounded by a batch); keeping_decoded keeps them inside, and drops
    what it kept on leaving."""
    import moesim.trace.io as io
    monkeypatch.setattr(io, "_KEEP", [False])
    path = write_trace(tmp_path / "t.parquet", _trace_data(), TraceMeta(model=MODEL))
    list(iter_steps(path))
    list(iter_steps(path))
    assert len(decodes) == 2 and io._DECODED == {}
    with io.keeping_decoded():
        list(iter_steps(path))
        list(iter_steps(path))
        assert len(decodes) == 3 and len(io._DECODED) == 1
    assert io._DECODED == {} and io._KEEP == [False]


def _fields(step) -> tuple:
    """Everything a reader sees of a step: which optional columns it has, and the values."""
    def value(a):
        return None if a is None else a.tolist()
    return (step.step, step.experts.tolist(), value(step.weights), value(step.scores), value(step.token_id),
            {name: [row.tolist() for row in rows] for name, rows in step.predictors.items()})


def _alternate(*readers) -> list[list]:
    """Advance the readers one step each in turn (as a portfolio's members race), to the end."""
    got: list[list] = [[] for _ in readers]
    live = list(enumerate(readers))
    while live:
        for i, reader in list(live):
            step = next(reader, None)
            if step is None:
                live.remove((i, reader))
            else:
                got[i].append(step)
    return got


def test_readers_at_once_share_one_decode(tmp_path, decodes):
    """Two readers advancing in turn (a portfolio's members) decode the file once and get the same steps."""
    import moesim.trace.io as io
    path = write_trace(tmp_path / "t.parquet", _trace_data(steps=6), TraceMeta(model=MODEL))
    first, second = _alternate(iter_steps(path, columns=["scores"]), iter_steps(path, columns=["scores"]))
    assert len(decodes) == 1 and [s.step for s in first] == list(range(6))
    assert all(a is b for a, b in zip(first, second))
    assert len(io._DECODED) == 1 and list(iter_steps(path, columns=["scores"]))[5] is first[5]


def test_readers_of_fewer_columns_see_only_theirs(tmp_path, decodes):
    """Widened to a portfolio's union, one decode serves every column set, each reader getting what a
    decode of its own columns gives."""
    import moesim.trace.io as io
    path = write_trace(tmp_path / "t.parquet", _trace_data(), TraceMeta(model=MODEL))
    wanted = [(), ("scores",), ("pred_next_layer", "weights")]
    with io.keeping_decoded(columns=["scores", "weights", "pred_next_layer"]):
        got = _alternate(*(iter_steps(path, columns=c) for c in wanted))
        assert decodes == [(str(path), ("pred_next_layer", "scores", "weights"))]
        later = list(iter_steps(path, columns=["weights"]))  # a subset again: served by the same decode
        assert len(decodes) == 1
    for columns, steps in zip(wanted, got):
        assert [_fields(s) for s in steps] == [_fields(s) for s in io._decode_steps(path, columns, 65_536)]
    assert [_fields(s) for s in later] == [_fields(s) for s in io._decode_steps(path, ["weights"], 65_536)]
    assert got[1][0].scores is not None and got[0][0].scores is None and got[2][0].predictors.keys() == \
        {"pred_next_layer"}
    assert got[0][0].experts is got[1][0].experts  # views of the same arrays, not copies


def test_a_decode_over_the_limit_keeps_only_what_a_reader_has_yet_to_read(tmp_path, decodes, monkeypatch):
    import moesim.trace.io as io
    path = write_trace(tmp_path / "t.parquet", _trace_data(steps=8), TraceMeta(model=MODEL))
    step_bytes = io._step_bytes(_trace_steps_fresh(path)[0])
    decodes.clear()
    monkeypatch.setattr(io, "DECODED_CACHE_BYTES", 2 * step_bytes + step_bytes // 2)  # two steps and a half
    ahead, behind = iter_steps(path), iter_steps(path)
    got_behind = [next(behind)]  # both have joined (a reader joins at its first step)
    for _ in range(5):
        next(ahead)
    shared = behind.gi_frame.f_locals["shared"]
    assert io._DECODED == {}  # past the limit: out of the cache, no new reader joins it
    assert [s.step for s in shared.steps] == [1, 2, 3, 4]  # what the reader behind has yet to read
    got_behind += list(behind)
    assert [s.step for s in ahead] == [5, 6, 7] and shared.steps == [] and len(decodes) == 1
    assert _as_tuples(iter_steps(path)) == _as_tuples(got_behind) and len(decodes) == 2  # not kept
    assert _as_tuples(got_behind) == _as_tuples(_trace_steps_fresh(path))


def test_a_reader_that_stops_early_leaves_the_others_their_decode(tmp_path, decodes):
    import moesim.trace.io as io
    path = write_trace(tmp_path / "t.parquet", _trace_data(steps=5), TraceMeta(model=MODEL))
    quitter, stayer = iter_steps(path), iter_steps(path)
    next(quitter), next(stayer)
    quitter.close()  # a member pruned by the portfolio
    steps = [0, *[s.step for s in stayer]]
    assert steps == list(range(5)) and len(decodes) == 1 and len(io._DECODED) == 1
    list(iter_steps(path))
    assert len(decodes) == 1


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 3)), min_size=1, max_size=12, unique_by=lambda p: p[0]))
@settings(max_examples=60, deadline=None)
def test_layers_pair_each_layer_with_its_rows_whether_one_row_per_layer_or_more(layers):
    """A step's (layer, rows) pairs, including the shared list of steps with one row per layer."""
    layers = sorted(layers)
    ids = np.repeat([layer for layer, _ in layers], [rows for _, rows in layers]).astype(np.int16)
    n = len(ids)
    step = Step(step=0, request=np.zeros(n, np.int32), position=np.arange(n, dtype=np.int32), layer=ids,
                phase=np.zeros(n, np.int8), experts=np.zeros((n, 2), np.int16))
    pairs = step.layers()
    assert [layer for layer, _ in pairs] == [layer for layer, _ in layers]
    for (layer, rows), (_, count) in zip(pairs, layers):
        assert rows.stop - rows.start == count and set(ids[rows].tolist()) == {layer}
    assert pairs[-1][1].stop == n
    # a second step with the same layers gets the same pairs (shared when every layer has one row)
    again = Step(step=1, request=step.request, position=step.position, layer=ids.copy(), phase=step.phase,
                 experts=step.experts).layers()
    assert again == pairs


@given(st.integers(1, 6), st.booleans(), st.booleans(), st.booleans())
@settings(max_examples=40, deadline=None)
def test_one_row_layers_are_the_rows_slicing_gives(rows_per_layer, weights, scores, one_request):
    """A step's rows split by layer (what the engine reads per layer of a decode step) equal each
    column's slice, row by row; a step with several rows in a layer is not split."""
    rng = np.random.default_rng(rows_per_layer)
    ids = np.repeat(np.arange(5, dtype=np.int16), rows_per_layer)
    n = len(ids)
    # one request (a step of one row per layer is one token), or, as a log may have it, several
    requests = np.full(n, rng.integers(0, 4), np.int32) if one_request else rng.integers(0, 4, n).astype(np.int32)
    step = Step(step=0, request=requests, position=np.arange(n, dtype=np.int32),
                layer=ids, phase=np.ones(n, np.int8), experts=rng.integers(0, 16, (n, 2)).astype(np.int16),
                weights=rng.random((n, 2), np.float32) if weights else None,
                scores=rng.random((n, 16)).astype(np.float16) if scores else None)
    split = step.one_row_layers()
    if rows_per_layer > 1:
        assert split is None
        return
    assert split is not None
    for i, (_, rows) in enumerate(step.layers()):
        assert split.active[i] == step.experts[rows][0].tolist()
        for name in ("experts", "request", "weights", "scores"):
            column, row = getattr(step, name), getattr(split, name)[i]
            if column is None:
                assert row is None
            else:
                assert row.dtype == column.dtype and row.shape == column[rows].shape
                assert np.array_equal(row, column[rows])


@pytest.mark.parametrize("chosen, expected", [(None, "system"), ("mimalloc", "mimalloc")])
def test_traces_decode_into_the_c_allocator_unless_the_user_chose_one(tmp_path, chosen, expected):
    """mimalloc, pyarrow's default, made a prefill's first decode slower and bigger (benchmarks/trace_io.py
    --prefill); a pool named in ARROW_DEFAULT_MEMORY_POOL is the user's and stays."""
    import os
    import subprocess
    import sys

    from tests.factories import random_routing, tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             random_routing(np.random.default_rng(0), model, requests=1, prompt=3, decode=2))
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    code = ("import sys, pyarrow as pa; from moesim.trace.io import iter_steps; "
            "before = pa.default_memory_pool().backend_name; n = sum(1 for _ in iter_steps(sys.argv[1])); "
            "print(before, pa.default_memory_pool().backend_name, n)")
    done = subprocess.run([sys.executable, "-c", code, str(trace)], env=env, capture_output=True, text=True,
                          check=True)
    before, after, steps = done.stdout.split()
    if chosen is None and before == "system":
        pytest.skip("this pyarrow's default pool is the C library's already")
    assert before != after or chosen  # the decode switched it (or left the user's choice alone)
    assert (after, int(steps)) == (expected, 3)


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=40), min_size=1, max_size=6),
       st.sampled_from([np.int16, np.int32, np.int64]))
@settings(max_examples=60, deadline=None)
def test_layer_bounds_are_where_the_layer_changes_whichever_step_computed_them_first(columns, dtype):
    """Small steps share bounds by their layer column: each step still gets its own column's bounds."""
    for values in columns + columns[::-1]:
        layer = np.array(sorted(values), dtype=dtype)
        step = Step(step=0, request=np.zeros(len(layer), np.int32), position=np.arange(len(layer), dtype=np.int32),
                    layer=layer, phase=np.ones(len(layer), np.int8), experts=np.zeros((len(layer), 2), np.int16))
        change = [i for i in range(1, len(layer)) if layer[i] != layer[i - 1]]
        assert step.layer_bounds.tolist() == [0, *change, len(layer)]


@pytest.mark.parametrize("reader", ["read_meta", "read_frame", "read_table", "iter_steps"])
def test_a_folder_given_as_a_trace_is_named_a_folder(tmp_path, reader):
    """Readers said 'not a Parquet file (fix: convert the log with `moesim trace import`)' of a folder."""
    import moesim.trace.io as trace_io
    from moesim.errors import TraceFormatError
    folder = tmp_path / "run.parquet"
    folder.mkdir()
    with pytest.raises(TraceFormatError, match="is a folder, not a trace file") as raised:
        result = getattr(trace_io, reader)(folder)
        list(result) if reader == "iter_steps" else None
    assert raised.value.source == str(folder) and raised.value.fix == "give a .parquet file"


@pytest.mark.parametrize("command", [["trace", "inspect"], ["trace", "validate"], ["replay"]])
def test_a_gzip_compressed_trace_is_named_compressed_with_how_to_decompress_it(tmp_path, capsys, command):
    """It was 'not a Parquet file (fix: convert the log with `moesim trace import`)'."""
    import gzip

    from moesim.cli import main
    plain = tmp_path / "t.parquet"
    write_trace(plain, {"request": [0], "step": [0], "phase": ["decode"], "position": [0], "layer": [0],
                        "experts": np.array([[0, 1]])}, TraceMeta(model=ModelSpec(
                            name="tiny", num_layers=1, num_experts=4, top_k=2, hidden_size=8, moe_intermediate_size=8)))
    packed = tmp_path / "t.parquet.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert main([*command, str(packed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{packed}: gzip-compressed" in err
    # t.parquet exists: the command given never writes over it
    assert f"gzip -dc {packed} > {tmp_path / 't-decompressed.parquet'}" in err


def _tiny_trace(path):
    return write_trace(path, {"request": [0], "step": [0], "phase": ["decode"], "position": [0], "layer": [0],
                              "experts": np.array([[0, 1]])},
                       TraceMeta(model=ModelSpec(name="tiny", num_layers=1, num_experts=4, top_k=2, hidden_size=8,
                                                 moe_intermediate_size=8)))


def _unprivileged(args: list[str], cwd) -> "subprocess.CompletedProcess":
    """``python -m moesim ARGS`` as a user whom file permissions bind: root without the capabilities that
    override them (setpriv), else this user."""
    import os
    import shutil
    import subprocess
    import sys
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop the capability that overrides file permissions")
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    return subprocess.run([*prefix, sys.executable, "-m", "moesim", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("command", [["trace", "inspect", "T"], ["replay", "T"], ["sweep", "spec.yaml", "--out",
                                                                                  "out.parquet"]])
def test_a_trace_without_read_permission_is_named_unreadable(tmp_path, command):
    """Through a sweep spec it was 'not a Parquet file (fix: convert the log with `moesim trace import`)'."""
    trace = _tiny_trace(tmp_path / "t.parquet")
    trace.chmod(0)
    (tmp_path / "spec.yaml").write_text(f"traces: [{trace.name}]\nsystems: [gpu-only-lru]\n")
    done = _unprivileged([str(trace) if a == "T" else a for a in command], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert str(trace) in done.stderr and ("not readable" in done.stderr or "Permission denied" in done.stderr)
    assert "trace import" not in done.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_an_empty_file_given_as_a_trace_is_named_empty(tmp_path):
    """It was 'not a Parquet file (fix: convert the log with `moesim trace import`)': no log to convert."""
    from moesim.errors import TraceFormatError
    from moesim.trace.validate import validate_trace
    empty = tmp_path / "t.parquet"
    empty.write_bytes(b"")
    for read in (read_meta, validate_trace):
        with pytest.raises(TraceFormatError, match="the file is empty") as raised:
            read(empty)
        assert raised.value.source == str(empty) and "trace import" not in str(raised.value)


@pytest.mark.parametrize("command", [["trace", "inspect"], ["trace", "validate"], ["replay"],
                                     ["trace", "compare", "OTHER"]])
def test_a_trace_whose_name_is_not_utf8_is_read(tmp_path, capsys, command):
    """pyarrow cannot encode such a name: the command ended in an internal error (UnicodeEncodeError)."""
    import os

    from moesim.cli import main
    good = _tiny_trace(tmp_path / "good.parquet")
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/t\xff.parquet")
    os.rename(good, odd)
    other = _tiny_trace(tmp_path / "other.parquet")
    args = [str(other) if a == "OTHER" else a for a in command] + [odd]
    assert main([*args, "--json", "-"] if command[0] != "replay" else [*args, "--json", str(tmp_path / "m.json")]) \
        == 0, capsys.readouterr().err
    assert "internal error" not in capsys.readouterr().err


@pytest.mark.parametrize("command", [["replay"], ["trace", "inspect"], ["trace", "validate"]])
def test_moesim_own_other_files_given_as_the_trace_are_named(tmp_path, capsys, command):
    """A hardware profile, a sweep spec or a replay's --json given as the trace was 'not a Parquet file (fix:
    convert the log with `moesim trace import`)', and `moesim trace import` then said it cannot tell which
    tool wrote the "log": the error names the file's kind and where it goes instead."""
    import json
    from pathlib import Path

    from moesim.cli import main
    profile = Path(__file__).resolve().parents[2] / "hwprofiles" / "rtx4090.yaml"
    spec = tmp_path / "spec.yaml"
    spec.write_text("traces: [t.parquet]\nsystems: [cpu-only]\n")
    metrics = tmp_path / "run.json"
    metrics.write_text(json.dumps({"system": "cpu-only", "ttft_ms": 1.0, "tpot_ms_mean": 2.0}, indent=2))
    expected = {profile: "not a trace but a hardware profile (YAML) (fix: give it as the hardware profile (--hw)",
                spec: "not a trace but a sweep spec (YAML) (fix: run it with `moesim sweep` (moesim.sweep from",
                metrics: "not a trace but moesim's JSON output (the --json metrics or a --chrome-trace)"}
    for path, said in expected.items():
        assert main([*command, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: {said}" in err and "trace import" not in err
    other = tmp_path / "log.json"  # any other file is still a log to import
    other.write_text('{"layers": []}\n')
    assert main([*command, str(other)]) == 2
    assert "not a Parquet file" in capsys.readouterr().err


def test_a_profile_given_as_the_trace_from_python_names_the_argument():
    """From Python the fix names the hw= argument, as the command line names --hw."""
    from pathlib import Path

    import moesim
    from moesim.errors import TraceFormatError
    profile = Path(__file__).resolve().parents[2] / "hwprofiles" / "rtx4090.yaml"
    with pytest.raises(TraceFormatError) as err:
        moesim.replay(profile)
    assert str(err.value) == (f"{profile}: not a trace but a hardware profile (YAML) (fix: give it as the hardware "
                              "profile (hw=), and a trace (.parquet) as the trace)")


@pytest.mark.parametrize("command", [["replay"], ["trace", "inspect"], ["trace", "validate"]])
def test_a_dash_for_the_trace_says_traces_are_not_read_from_standard_input(capsys, command):
    """`moesim replay - < t.parquet` said '-: file not found (fix: check the path)'."""
    from moesim.cli import main
    assert main([*command, "-"]) == 2
    err = capsys.readouterr().err
    assert err == ("moesim: error: -: a trace is read from a file, not from standard input ('-') (fix: save it to a "
                   ".parquet file and give that file's path)\n")
