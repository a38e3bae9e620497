"""validate_trace: one test per malformed input; each message names file, column/key, row (when a row is at
fault) and a fix, and ``moesim trace validate`` exits 2 with one line on stderr."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.cli import main
from moesim.errors import TraceFormatError
from moesim.model.spec import ModelSpec
from moesim.trace.io import write_trace
from moesim.trace.schema import META_KEY, TraceMeta, scores_to_arrow
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


def test_scores_bytes_not_num_experts_float16_values(tmp_path, capsys):
    table = _valid(tmp_path)
    scores = scores_to_arrow(np.full((ROWS, 7), 0.125, np.float16), 7)
    _check(_save(tmp_path, _replace(table, "scores", scores)), capsys,
           "field 'scores'", "14 bytes per row", "8 scores (num_experts)")


def test_scores_of_another_type_name_both_accepted_forms(tmp_path, capsys):
    table = _valid(tmp_path)
    scores = pa.FixedSizeListArray.from_arrays(pa.array(np.full(ROWS * 8, 0.125, np.float32)), 8)
    _check(_save(tmp_path, _replace(table, "scores", scores)), capsys,
           "field 'scores'", "expected fixed_size_binary[16] or fixed_size_list<item: halffloat>[8]")


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


@pytest.mark.parametrize("key, value, field, detail", [
    ("top_k", 10**9, "moesim.model.top_k", "beyond the limit of 1,024"),
    ("num_layers", -3, "moesim.model.num_layers", "must be a positive integer, got -3"),
    ("hidden_size", None, "moesim.model.hidden_size", "missing required model field"),
])
def test_bad_model_metadata_names_its_field_once(tmp_path, capsys, key, value, field, detail):
    # The model's own error used to be pasted whole into the trace's: the path twice, two "(fix: ...)".
    table = _valid(tmp_path)
    meta = json.loads(table.schema.metadata[META_KEY])
    if value is None:
        del meta["model"][key]
    else:
        meta["model"][key] = value
    path = _save(tmp_path, table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}))
    _check(path, capsys, f"field '{field}'", detail)
    with pytest.raises(TraceFormatError) as err:
        validate_trace(path)
    assert str(err.value).count(str(path)) == 1 and str(err.value).count("fix:") == 1


def test_not_parquet(tmp_path, capsys):
    path = tmp_path / "routes.parquet"
    path.write_text('{"layer": 0, "experts": [1, 2]}\n')
    _check(path, capsys, "not a Parquet file", "moesim trace import")


def test_a_parquet_file_cut_short_is_damaged_not_foreign(tmp_path, capsys):
    whole = _save(tmp_path, _valid(tmp_path))
    path = tmp_path / "cut.parquet"
    path.write_bytes(whole.read_bytes()[:-100])
    _check(path, capsys, "cut short or damaged", "copy it again")


# ----------------------------------------------------------------------------- scores: fast check, beside the run
def _bad_scores(tmp_path, row: int, value: float, name: str = "bad-scores.parquet"):
    table = _valid(tmp_path)
    scores = np.full((ROWS, 8), 0.125, np.float16)
    scores[row, 3] = value
    column = pa.FixedSizeListArray.from_arrays(pa.array(scores.ravel()), 8)
    return _save(tmp_path, _replace(table, "scores", column), name)


def test_score_bit_bound_is_exactly_the_valid_range():
    """Every float16 bit pattern: at most SCORE_BITS_MAX iff a number in [+0, SCORE_MAX]; the only valid
    value above it is -0.0, which the exact check lets through."""
    from moesim.trace.validate import SCORE_BITS_MAX, SCORE_MAX
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(np.float16).astype(np.float64)
    valid = np.isfinite(values) & (values >= 0) & (values <= SCORE_MAX)
    assert ((bits <= SCORE_BITS_MAX) == (valid & (bits != 0x8000))).all()
    assert values[SCORE_BITS_MAX] <= SCORE_MAX < np.nextafter(np.float16(values[SCORE_BITS_MAX]), np.float16(2))


SPECIAL = [0.0, -0.0, 0.5, 1.0, 1.0009765625, 1.001953125, -0.5, -1e-7, 7.0, np.inf, -np.inf, np.nan, 6e-8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(SPECIAL), min_size=3, max_size=3), min_size=1, max_size=12))
def test_fast_score_check_agrees_with_the_exact_one(rows):
    """The one-pass bit test refuses exactly the batches the value test refuses, naming the same first row."""
    from moesim.trace.validate import SCORE_MAX, _check_scores
    scores = np.array(rows, dtype=np.float16)
    wide = scores.astype(np.float64)
    bad_rows = ~(np.isfinite(wide) & (wide >= 0) & (wide <= SCORE_MAX)).all(axis=1)
    if bad_rows.any():
        with pytest.raises(TraceFormatError, match=f"row {int(np.argmax(bad_rows)) + 10}:"):
            _check_scores(scores, "f.parquet", 10)
    else:
        _check_scores(scores, "f.parquet", 10)


def test_unread_scores_are_checked_beside_the_run_and_refuse_it(tmp_path, monkeypatch):
    """checked_meta returns before the scores check ends (it runs on a thread while the run goes on);
    settle waits for it and raises its error, naming file, field and row, for this and every later run."""
    import threading

    import moesim.trace.validate as validate
    path = _bad_scores(tmp_path, row=6, value=np.nan)
    release = threading.Event()
    original = validate._check_lazy

    def held(*args):
        assert release.wait(30)
        original(*args)
    monkeypatch.setattr(validate, "_check_lazy", held)
    monkeypatch.setattr(validate, "_CHECKED", {})
    meta = validate.checked_meta(path, ())  # a run that does not read scores starts now
    assert meta.model == MODEL
    state = validate._CHECKED[validate._stamp(path)]
    assert state.deferred is not None and state.deferred.thread.is_alive() and state.done == frozenset()
    release.set()
    for _ in range(2):  # the first run's result is refused, and the next one's
        with pytest.raises(TraceFormatError, match=r"bad-scores.parquet, field 'scores', row 6: score nan"):
            validate.settle(path)
    with pytest.raises(TraceFormatError, match="field 'scores', row 6"):
        validate.checked_meta(path, ["scores"])  # a run that reads them waits for the same check


def test_a_run_that_reads_scores_checks_them_before_it_starts(tmp_path, monkeypatch):
    import moesim.trace.validate as validate
    monkeypatch.setattr(validate, "_CHECKED", {})
    path = _bad_scores(tmp_path, row=2, value=-0.5)
    with pytest.raises(TraceFormatError, match="field 'scores', row 2: score -0.5"):
        validate.checked_meta(path, ["scores"])


def test_valid_scores_checked_beside_the_run_are_checked_once(tmp_path, monkeypatch):
    import moesim.trace.validate as validate
    _valid(tmp_path)
    path = tmp_path / "valid.parquet"
    monkeypatch.setattr(validate, "_CHECKED", {})
    calls = []
    original = validate._check_lazy
    monkeypatch.setattr(validate, "_check_lazy", lambda *args: (calls.append(args[1]), original(*args)))
    validate.checked_meta(path, ())
    validate.settle(path)
    validate.checked_meta(path, ["scores"])
    validate.checked_meta(path)
    validate.settle(path)
    state = validate._CHECKED[validate._stamp(path)]
    assert calls == [["scores"]] and state.done == frozenset({"scores"}) and state.deferred is None


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 20), st.integers(1, 40), st.integers(0, 2**16))
def test_duplicate_rows_by_column_pairs_equal_those_by_sorting(top_k, rows, seed):
    from moesim.trace.validate import _duplicate_rows
    experts = np.random.default_rng(seed).integers(0, top_k + 3, size=(rows, top_k)).astype(np.int16)
    ordered = np.sort(experts, axis=1)
    assert (_duplicate_rows(experts) == (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)).all()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 3)] * 3, st.sampled_from([0, 1, 5, 2**40, 2**60])), min_size=1, max_size=30))
def test_composite_order_key_agrees_with_row_by_row_comparison(keys):
    """Strictly increasing rows are recognised as such when the key widths fit one int64; the answer is
    never a wrong yes (a False only sends the batch to the exact check)."""
    from moesim.trace.validate import _increasing
    columns = [np.array(c, dtype=np.int64) for c in zip(*keys)]
    truth = all(a < b for a, b in zip(keys, keys[1:]))
    fits = sum(int(c.max()).bit_length() for c in columns) <= 62
    assert _increasing(columns) == (truth and fits)


def test_wait_for_checks_leaves_no_check_running_and_keeps_errors(tmp_path, monkeypatch):
    """Before a sweep forks its workers: every thread checking beside a run has ended; a fault found
    still refuses the run that settles."""
    import moesim.trace.validate as validate
    monkeypatch.setattr(validate, "_CHECKED", {})
    path = _bad_scores(tmp_path, row=4, value=np.inf)
    validate.checked_meta(path, ())
    validate.wait_for_checks()
    assert not validate._CHECKED[validate._stamp(path)].deferred.thread.is_alive()
    with pytest.raises(TraceFormatError, match="field 'scores', row 4: score inf"):
        validate.settle(path)


def test_validate_json_lists_the_problem_and_keeps_the_exit_status(tmp_path, capsys):
    """`trace validate` had no --json while inspect and compare do: it takes the same flag (`--json`, `--json -`;
    `--json FILE.json` refused with how to redirect), says ok and the problem found, and exits as without it."""
    _valid(tmp_path)
    good = tmp_path / "valid.parquet"
    assert main(["trace", "validate", str(good), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert json.loads(captured.out) == {"file": str(good), "ok": True, "problems": [], "schema_version": 2,
                                        "rows": ROWS, "steps": 3, "requests": 1,
                                        "columns": ["request", "step", "phase", "position", "layer", "experts",
                                                    "scores"]}
    assert main(["trace", "validate", "--json", "-", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    table = pq.read_table(good)
    layer = table.column("layer").to_numpy().copy()
    layer[5] = 9
    bad = _save(tmp_path, _replace(table, "layer", pa.array(layer, type=table.schema.field("layer").type)))
    assert main(["trace", "validate", str(bad)]) == 2
    line = capsys.readouterr().err
    assert main(["trace", "validate", str(bad), "--json", "-"]) == 2
    captured = capsys.readouterr()
    assert captured.err == line and line.count("\n") == 1  # the same one line as without --json
    data = json.loads(captured.out)
    assert (data["ok"], data["rows"], data["columns"]) == (False, None, None)
    [problem] = data["problems"]
    assert (problem["field"], problem["row"]) == ("layer", 5) and problem["fix"]
    assert line == f"moesim: error: {problem['message']}\n"
    assert main(["trace", "validate", str(bad), "--json", str(tmp_path / "v.json")]) == 2
    err = capsys.readouterr().err
    assert "--json takes no file here: it prints the JSON on stdout (write it to a file with --json > " in err
    assert err.count("\n") == 1 and not (tmp_path / "v.json").exists()


def test_validate_json_of_a_folder_says_so_in_json(tmp_path, capsys):
    """A folder was refused by click before the command ran: one line on stderr and no JSON on stdout, where a
    script reads `ok`; a missing file had its JSON."""
    folder = tmp_path / "traces.parquet"
    folder.mkdir()
    assert main(["trace", "validate", str(folder), "--json", "-"]) == 2
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ok"] is False and "folder" in data["problems"][0]["message"]
    assert captured.err.count("\n") == 1 and str(folder) in captured.err
