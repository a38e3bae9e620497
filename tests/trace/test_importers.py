"""Importers on the real logs in ../shared/real-traces and on small hand-written fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moesim.cli import main
from moesim.errors import ConfigError, TraceFormatError
from moesim.trace.importers import import_trace
from moesim.trace.importers.detect import detect_format, format_of
from moesim.trace.io import iter_steps, read_frame, read_meta
from moesim.trace.validate import validate_trace

REPO = Path(__file__).resolve().parents[2]
REAL = REPO.parent / "shared" / "real-traces"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason=f"real router logs not found at {REAL}")


def _table(path: Path):
    return read_frame(path)


# ----------------------------------------------------------------------------- real logs
@needs_real
def test_humaneval_with_raw_prefill_joined(tmp_path):
    out = tmp_path / "he.parquet"
    src = REAL / "speculative-moe"
    report = import_trace("speculative-moe", [src / "humaneval_2_routing.jsonl", src / "routing_raw.jsonl"], out)
    # request 0: 135 prefill + 83 decode tokens, request 1: 255 decode tokens, 32 layers each
    assert (report.rows, report.steps, report.prefill_steps, report.requests) == (15_136, 339, 1, 2)
    assert dict(report.repaired) == {"tie_rows_imputed": 8, "tie_rows_imputed_position_unknown": 29,
                                     "tie_rows_imputed_prefill": 122, "rows_reordered_by_weight": 0,
                                     "raw_rows_used_where_processed_lacks_them": 0}
    meta = read_meta(out)
    assert meta.weights_renormalized and meta.model.name == "mixtral-8x7b"
    req0 = meta.source["requests"][0]
    assert req0["alignment"]["raw_rows_matched_in_order"] == 2579
    assert req0["alignment"]["processed_decode_rows"] == 2648
    assert (req0["prefill_tokens"], req0["decode_tokens"]) == (135, 83)
    assert meta.source["requests"][1]["prefill_tokens"] is None
    df = _table(out)
    first = df[df.step == 0]
    assert set(first.phase) == {"prefill"} and len(first) == 135 * 32
    assert df[df.request == 0].position.max() == 135 + 82
    assert df[df.request == 1].step.min() == 84
    validate_trace(out)


@needs_real
def test_gsm8k_import_reports_repairs(tmp_path):
    out = tmp_path / "gsm.parquet"
    report = import_trace("speculative-moe", [REAL / "speculative-moe" / "gsm8k_2_routing.jsonl"], out)
    # 7,889 logged rows; problems decode 168 and 79 tokens -> 247 steps x 32 layers
    assert (report.rows, report.steps, report.requests) == (7_904, 247, 2)
    assert report.repaired["tie_rows_imputed_position_unknown"] == 7_904 - 7_889
    assert any("repaired: tie_rows_imputed_position_unknown 15" in line for line in report.summary_lines())
    assert read_meta(out).source["repairs"] == {"tie_rows_imputed_position_unknown": 15}


@needs_real
def test_raw_capture_alone_locates_gaps_exactly(tmp_path):
    report = import_trace("speculative-moe", [REAL / "speculative-moe" / "routing_raw.jsonl"], tmp_path / "r.parquet")
    # 6,777 logged rows = 4,198 prefill + 2,579 decode; 32 x (135 + 83) = 6,976 after repair
    assert (report.rows, report.steps) == (6_976, 84)
    assert report.repaired["tie_rows_imputed_prefill"] == 32 * 135 - 4_198
    assert report.repaired["tie_rows_imputed"] == 32 * 83 - 2_579


@needs_real
@pytest.mark.parametrize("name", ["token_distri_8.jsonl", "token_distri_8_prefill_forward2_ids.npz"])
def test_qwen3_prefill(tmp_path, name):
    out = tmp_path / "q.parquet"
    report = import_trace("vllm-qwen3-prefill", [REAL / "soryxie-vllm-qwen3-30b-a3b" / name], out)
    assert (report.rows, report.steps, report.prefill_steps) == (2050 * 48, 1, 1)
    if name.endswith(".jsonl"):
        # forwards 0-1: 19 + 4 tokens; forwards 3-31: 29 x 4 tokens; each x 48 layers
        assert dict(report.dropped) == {"warm_up_forwards_0_1": 23 * 48, "dummy_dp_batches_forwards_3_plus": 116 * 48}
    step = next(iter_steps(out))
    assert step.tokens == 2050 and step.weights is None
    npz = np.load(REAL / "soryxie-vllm-qwen3-30b-a3b" / "token_distri_8_prefill_forward2_ids.npz")["topk_ids"]
    assert np.array_equal(step.experts[:2050], npz[0])


@needs_real
def test_flame_moe(tmp_path):
    out = tmp_path / "f.parquet"
    path = REAL / "DynaNDE-Simulator-flame-moe-290m" / "flame-moe-290m_layers2-9_2048tok_top6.npz"
    report = import_trace("flame-moe", [path], out)
    assert (report.rows, report.steps, report.layers_present) == (8 * 2048, 1, list(range(8)))
    meta = read_meta(out)
    assert not meta.weights_renormalized
    step = next(iter_steps(out))
    raw = np.load(path)
    assert np.array_equal(step.token_id[:2048], raw["token_ids"])
    sums = step.weights.sum(axis=1)
    assert sums.min() < 0.5 and sums.max() < 1.0  # top-6 probabilities, not renormalized


@needs_real
def test_vllm_moe_logger_joins_five_layers(tmp_path):
    out = tmp_path / "q15.parquet"
    files = sorted((REAL / "vLLM-MoE-Logger-qwen1.5-moe").glob("moe_layer*.jsonl"))
    report = import_trace("vllm-moe-logger", files, out)
    # 12,805 rows per file - 8,192 - 256 - 65 = 4,292 real rows (1,406 prefill + 127 decode steps)
    assert (report.rows, report.steps, report.prefill_steps) == (5 * 4_292, 128, 1)
    assert dict(report.dropped) == {"profiling_dummy": 5 * 8192, "dummy": 5 * 256, "warm_up": 5 * 65}
    assert report.layers_present == [0, 8, 12, 18, 23] and report.num_layers == 24
    steps = list(iter_steps(out))
    assert steps[0].tokens == 1406 and steps[1].tokens == 25 and steps[-1].tokens == 11
    assert [layer for layer, _ in steps[1].layers()] == [0, 8, 12, 18, 23]
    validate_trace(out)


@needs_real
def test_cerebras_olmoe_drops_profiling_dummy(tmp_path):
    out = tmp_path / "o.parquet"
    report = import_trace("cerebras-olmoe", [REAL / "cerebras-assesment2-olmoe" / "moe_routes.jsonl"], out)
    assert dict(report.dropped) == {"profiling_dummy": 2048}
    assert (report.rows, report.layers_present) == (4_471, [0])
    assert read_meta(out).weights_renormalized


@needs_real
def test_aggregate_folder_is_refused(tmp_path, capsys):
    folder = REAL / "OLMoE-routing-stats"
    with pytest.raises(TraceFormatError, match="aggregate expert counts"):
        import_trace("olmoe-routing-stats", [folder], tmp_path / "x.parquet")
    with pytest.raises(TraceFormatError, match="not per-token routing"):
        import_trace("cerebras-olmoe", [folder / "olmoe" / "expert_counts" / "arxiv.json"], tmp_path / "x.parquet")
    assert main(["trace", "import", "--format", "olmoe-routing-stats", str(folder),
                 "--out", str(tmp_path / "x.parquet")]) == 2
    assert "aggregate expert counts" in capsys.readouterr().err
    assert not (tmp_path / "x.parquet").exists()


# ----------------------------------------------------------------------------- fixtures
def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _spec_row(layer, idx, experts, probs, pid=0, raw=False):
    row = {"dataset": "humaneval", "problem_id": pid, "layer": layer, "experts": experts, "gating_probs": probs}
    row["token_pos" if raw else "token_idx"] = idx
    return row


def _raw_fixture(path: Path) -> Path:
    """Prefill of 3 tokens, 2 decode steps over 32 layers; layer 1 lacks prefill pos 1, layer 5 lacks decode step 1."""
    rows = []
    for layer in range(32):
        for pos in range(3):
            if not (layer == 1 and pos == 1):
                rows.append(_spec_row(layer, pos, [pos % 8, (pos + 1) % 8], [0.7, 0.3], raw=True))
    for step in range(2):
        for layer in range(32):
            if not (layer == 5 and step == 1):
                rows.append(_spec_row(layer, 0, [(layer + step) % 8, (layer + step + 3) % 8], [0.6, 0.4], raw=True))
    return _jsonl(path, rows)


def test_raw_fixture_repairs_dropped_tie_rows(tmp_path):
    report = import_trace("speculative-moe", [_raw_fixture(tmp_path / "raw.jsonl")], tmp_path / "t.parquet")
    assert (report.rows, report.steps) == (32 * 5, 3)
    assert report.repaired["tie_rows_imputed_prefill"] == 1 and report.repaired["tie_rows_imputed"] == 1
    df = _table(tmp_path / "t.parquet")
    fixed = df[(df.layer == 1) & (df.position == 1)].iloc[0]
    assert list(fixed.weights) == [0.5, 0.5] and list(fixed.experts) == [0, 1]  # copies position 0
    fixed = df[(df.layer == 5) & (df.step == 2)].iloc[0]
    assert list(fixed.weights) == [0.5, 0.5] and list(fixed.experts) == [5, 0]  # copies decode step 0


def _processed_fixture(path: Path, skip: dict[int, int]) -> Path:
    """Decode steps 0 and 1 of 32 layers, as the raw fixture routes them, minus ``skip`` {layer: step}."""
    rows = []
    for layer in range(32):
        steps = [s for s in (0, 1) if skip.get(layer) != s]
        for idx, step in enumerate(steps):
            rows.append(_spec_row(layer, idx, [(layer + step) % 8, (layer + step + 3) % 8], [0.6, 0.4]))
    return _jsonl(path, rows)


def test_processed_fixture_with_raw_alignment(tmp_path):
    raw = _raw_fixture(tmp_path / "raw.jsonl")  # raw lacks layer 5 at decode step 1
    # processed lacks layer 7 step 0 (the raw row fills it) and keeps layer 5 step 1 (fills the raw gap)
    proc = _processed_fixture(tmp_path / "humaneval_2_routing.jsonl", {7: 0})
    report = import_trace("speculative-moe", [proc, raw], tmp_path / "t.parquet")
    assert report.repaired["raw_rows_used_where_processed_lacks_them"] == 1
    assert report.repaired["tie_rows_imputed"] == 0 and report.repaired["tie_rows_imputed_prefill"] == 1
    info = read_meta(tmp_path / "t.parquet").source["requests"][0]["alignment"]
    assert (info["raw_decode_rows"], info["processed_decode_rows"], info["raw_rows_matched_in_order"]) == (63, 63, 62)
    df = _table(tmp_path / "t.parquet")
    assert list(df[(df.layer == 5) & (df.step == 2)].iloc[0].experts) == [6, 1]  # from the processed file
    assert list(df[(df.layer == 7) & (df.step == 1)].iloc[0].experts) == [7, 2]  # from the raw capture
    assert list(df[(df.layer == 7) & (df.step == 2)].iloc[0].experts) == [0, 3]  # on its exact step


def test_processed_and_raw_missing_the_same_row(tmp_path):
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    proc = _processed_fixture(tmp_path / "humaneval_2_routing.jsonl", {5: 1})
    report = import_trace("speculative-moe", [proc, raw], tmp_path / "t.parquet")
    assert report.repaired["tie_rows_imputed"] == 1  # layer 5, decode step 1: in neither log
    df = _table(tmp_path / "t.parquet")
    fixed = df[(df.layer == 5) & (df.step == 2)].iloc[0]
    assert list(fixed.weights) == [0.5, 0.5] and list(fixed.experts) == [5, 0]


def test_processed_fixture_alone_pads_short_layers(tmp_path):
    rows = [_spec_row(layer, i, [1, 2], [0.9, 0.1]) for layer in range(32) for i in range(4 if layer else 3)]
    report = import_trace("speculative-moe", [_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "t.parquet")
    assert (report.rows, report.steps) == (32 * 4, 4)
    assert report.repaired["tie_rows_imputed_position_unknown"] == 1


def _logger_fixture(path: Path, layer: int, sizes=(8, 4, 3, 5, 2, 2, 1)) -> Path:
    rows = [{"type": "meta", "layers_logged": [layer]}]
    for forward, size in enumerate(sizes):
        for i in range(size):
            ids = [0, 1, 2, 3] if forward < 2 else [(i + forward) % 60, 10, 20, 30 + layer]
            rows.append({"type": "route", "req_id": "r1", "token_idx": i, "layer": layer, "topk_ids": ids,
                         "topk_weights": [0.3, 0.2, 0.1, 0.05]})
    return _jsonl(path, rows)


def test_vllm_moe_logger_fixture_drops_dummies(tmp_path):
    files = [_logger_fixture(tmp_path / f"moe_layer{layer}.jsonl", layer) for layer in (3, 9)]
    report = import_trace("vllm-moe-logger", files, tmp_path / "t.parquet")
    assert dict(report.dropped) == {"profiling_dummy": 16, "dummy": 8, "warm_up": 6}
    assert (report.rows, report.steps, report.prefill_steps) == (2 * 10, 4, 1)
    steps = list(iter_steps(tmp_path / "t.parquet"))
    assert [s.tokens for s in steps] == [5, 2, 2, 1]
    assert steps[1].request.tolist() == [1, 2, 1, 2]  # decode slots 0, 1 of layers 3 and 9
    assert "layers 3, 9 joined by line number across separate runs (identical forward sizes checked)" in report.notes
    alone = import_trace("vllm-moe-logger", files[:1], tmp_path / "one.parquet")
    assert not any("joined" in note for note in alone.notes)  # one layer's log joins nothing
    bad = _logger_fixture(tmp_path / "moe_layer12.jsonl", 12, sizes=(8, 4, 3, 5, 2, 1, 1))
    with pytest.raises(TraceFormatError, match="forward structure differs"):
        import_trace("vllm-moe-logger", files + [bad], tmp_path / "u.parquet")


def test_cerebras_fixture_drops_leading_uniform_rows(tmp_path):
    rows = [{"type": "meta"}]
    rows += [{"type": "route", "token_idx": i, "layer": 0, "topk_ids": list(range(8)), "topk_weights": [0.125] * 8}
             for i in range(5)]
    rows += [{"type": "route", "token_idx": 5 + i, "layer": 0, "topk_ids": [9, 8, 7, 6, 5, 4, 3, 2],
              "topk_weights": [0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]} for i in range(3)]
    report = import_trace("cerebras-olmoe", [_jsonl(tmp_path / "m.jsonl", rows)], tmp_path / "t.parquet")
    assert dict(report.dropped) == {"profiling_dummy": 5} and report.rows == 3
    assert report.repaired["rows_reordered_by_weight"] == 3
    assert list(_table(tmp_path / "t.parquet").experts[0][:2]) == [8, 9]  # highest weight first


def test_qwen3_fixture_keeps_forward_2_only(tmp_path):
    lines = []
    for forward, tokens in enumerate([2, 1, 3, 1]):
        for layer in range(48):
            lines.append({"topk_weights": [tokens, 8],
                          "topk_ids": [[(t + layer + k) % 128 for k in range(8)] for t in range(tokens)]})
    report = import_trace("vllm-qwen3-prefill", [_jsonl(tmp_path / "q.jsonl", lines)], tmp_path / "t.parquet")
    assert dict(report.dropped) == {"warm_up_forwards_0_1": 3 * 48, "dummy_dp_batches_forwards_3_plus": 48}
    assert report.rows == 3 * 48
    with pytest.raises(TraceFormatError, match="whole number of 48-layer forwards"):
        import_trace("vllm-qwen3-prefill", [_jsonl(tmp_path / "short.jsonl", lines[:100])], tmp_path / "u.parquet")


# ----------------------------------------------------------------------------- malformed input
@pytest.mark.parametrize("line, field, fix", [
    ("{not json", "line", "repair or delete"),
    (json.dumps({"dataset": "humaneval", "problem_id": 0, "layer": 0, "experts": [1, 2], "token_idx": 1}),
     "gating_probs", "needs 'gating_probs'"),
    (json.dumps(_spec_row(0, 1, [1, 2, 3], [0.5, 0.3])), "experts", "exactly 2"),
    (json.dumps(_spec_row(0, 1, [1, 9], [0.6, 0.4])), "experts", "8 routed experts"),
    (json.dumps(_spec_row(0, -1, [1, 2], [0.6, 0.4])), "token_idx", "0 or more"),
    (json.dumps(_spec_row(0, 1.5, [1, 2], [0.6, 0.4])), "token_idx", "0 or more"),
])
def test_malformed_line_names_file_line_field_and_fix(tmp_path, capsys, line, field, fix):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_spec_row(0, 0, [1, 2], [0.6, 0.4])) + "\n" + line + "\n")
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError) as err:
        import_trace("speculative-moe", [path], out)
    message = str(err.value)
    assert f"{path} line 2" in message and f"field '{field}'" in message and fix in message
    assert "\n" not in message and not out.exists()
    assert main(["trace", "import", "--format", "speculative-moe", str(path), "--out", str(out)]) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and "Traceback" not in err_text


@pytest.mark.parametrize("arrays, field, words", [
    ({"token_ids": [1, 2]}, "layers", "no array 'layers' (it has: token_ids)"),
    (None, None, "not a readable npz file"),
])
def test_a_flame_moe_npz_without_its_arrays_names_the_missing_one(tmp_path, arrays, field, words):
    path = tmp_path / "f.npz"
    if arrays is None:
        np.save(tmp_path / "lone.npy", np.zeros(3))  # an .npy under an .npz name: no archive at all
        (tmp_path / "lone.npy").rename(path)
    else:
        np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
    with pytest.raises(TraceFormatError) as err:
        import_trace("flame-moe", [path], tmp_path / "t.parquet")
    assert words in str(err.value) and (field is None or f"field '{field}'" in str(err.value))
    assert not (tmp_path / "t.parquet").exists()


def test_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="unknown import format 'nope'"):
        import_trace("nope", [tmp_path], tmp_path / "t.parquet")


def test_a_folder_given_as_source_is_answered_with_its_log_files(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("moe_layer8.jsonl", "moe_layer0.jsonl", "README.md", "prompts.txt"):
        (logs / name).write_text("{}\n")
    code = main(["trace", "import", str(logs), "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().endswith("not a file (fix: name its log files instead: moe_layer0.jsonl, moe_layer8.jsonl)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["trace", "import", str(empty), "--out", str(tmp_path / "t.parquet")]) == 2
    assert "this folder holds none" in capsys.readouterr().err


# ----------------------------------------------------------------------------- format detection
@needs_real
@pytest.mark.parametrize("fmt, files", [
    ("flame-moe", ["DynaNDE-Simulator-flame-moe-290m/flame-moe-290m_layers2-9_2048tok_top6.npz"]),
    ("cerebras-olmoe", ["cerebras-assesment2-olmoe/moe_routes.jsonl"]),
    ("vllm-qwen3-prefill", ["soryxie-vllm-qwen3-30b-a3b/token_distri_8.jsonl"]),
    ("vllm-qwen3-prefill", ["soryxie-vllm-qwen3-30b-a3b/token_distri_16_prefill_forward2_ids.npz"]),
    ("vllm-moe-logger", ["vLLM-MoE-Logger-qwen1.5-moe/moe_layer0.jsonl", "vLLM-MoE-Logger-qwen1.5-moe/moe_layer8.jsonl"]),
    ("speculative-moe", ["speculative-moe/gsm8k_2_routing.jsonl", "speculative-moe/routing_raw.jsonl"]),
])
def test_every_real_log_is_told_by_its_first_records(fmt, files):
    assert detect_format([REAL / f for f in files]) == fmt


def test_fixtures_are_told_apart_and_import_as_with_their_format(tmp_path):
    logger = _logger_fixture(tmp_path / "moe_layer3.jsonl", 3)  # meta without model_id: 4 experts per route
    cerebras = _jsonl(tmp_path / "m.jsonl", [{"type": "meta"}, {"type": "route", "token_idx": 0, "layer": 0,
                                                                 "topk_ids": list(range(8)), "topk_weights": [0.125] * 8}])
    named = _jsonl(tmp_path / "named.jsonl", [{"type": "meta", "model_id": "allenai/OLMoE-1B-7B-0924"}])
    qwen3 = _jsonl(tmp_path / "q.jsonl", [{"topk_weights": [1, 8], "topk_ids": [list(range(8))]}])
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    np.savez(tmp_path / "f.npz", layers=np.arange(2, 4), token_ids=np.zeros(3), indices=np.zeros((2, 3, 6)),
             scores=np.zeros((2, 3, 6)))
    np.savez(tmp_path / "ids.npz", topk_ids=np.zeros((48, 2, 8)))
    found = {path.name: format_of(path) for path in (logger, cerebras, named, qwen3, raw, tmp_path / "f.npz",
                                                      tmp_path / "ids.npz")}
    assert found == {"moe_layer3.jsonl": "vllm-moe-logger", "m.jsonl": "cerebras-olmoe", "named.jsonl": "cerebras-olmoe",
                     "q.jsonl": "vllm-qwen3-prefill", "raw.jsonl": "speculative-moe", "f.npz": "flame-moe",
                     "ids.npz": "vllm-qwen3-prefill"}
    given = import_trace("speculative-moe", [raw], tmp_path / "given.parquet")
    told = import_trace(None, [raw], tmp_path / "told.parquet")
    assert _table(tmp_path / "given.parquet").equals(_table(tmp_path / "told.parquet"))
    assert told.notes[-1].startswith("format speculative-moe told from") and given.notes == told.notes[:-1]


@pytest.mark.parametrize("content", [b"hello\n", b"\xff\xfe\x00", b'{"dataset": "x"}\n', b"[1, 2]\n",
                                     b'{"topk_id": [[1]], "other": 1}\n'])
def test_a_log_no_format_lays_out_so_is_one_line_naming_it(tmp_path, capsys, content):
    path = tmp_path / "log.jsonl"
    path.write_bytes(content)
    out = tmp_path / "t.parquet"
    assert format_of(path) is None
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "--format NAME" in err and not out.exists()


@pytest.mark.parametrize("name,content", [("log.jsonl", b""), ("log.jsonl", b"\n \n"), ("log.npz", b"")])
def test_an_empty_log_is_called_empty(tmp_path, capsys, name, content):
    """Not 'cannot tell which tool wrote this log': no tool's format would help."""
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "t.parquet"
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"moesim: error: {path}: file has no records (it is empty or blank) (fix: give a log the tool " \
                  "has written records to)\n"
    assert not out.exists()


def test_logs_of_two_formats_are_refused_together(tmp_path):
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    logger = _logger_fixture(tmp_path / "moe_layer3.jsonl", 3)
    with pytest.raises(TraceFormatError, match=r"different formats \(raw.jsonl: speculative-moe; "
                                               r"moe_layer3.jsonl: vllm-moe-logger\)"):
        import_trace(None, [raw, logger], tmp_path / "t.parquet")


def test_the_output_never_replaces_a_source_log(tmp_path, capsys):
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    text = raw.read_text()
    assert main(["trace", "import", str(raw), "--out", str(raw)]) == 2
    assert "would overwrite an input (SOURCES" in capsys.readouterr().err and raw.read_text() == text


def test_the_summary_names_the_output_and_it_lands_when_stdout_is_closed(tmp_path):
    import subprocess
    import sys
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    out = tmp_path / "t.parquet"
    command = f"{sys.executable} -m moesim.cli trace import {raw} --out {out}"
    shown = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith(f"wrote {out} (speculative-moe")
    out.unlink()
    closed = subprocess.run(f"{command} | true; echo ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash",
                            capture_output=True, text=True, timeout=120)
    assert closed.stdout.strip() == "0" and validate_trace(out) is not None


def _flame_fixture(path: Path, layers) -> Path:
    tokens = 3
    indices = np.tile(np.arange(6, dtype=np.int16), (len(layers), tokens, 1))
    scores = np.tile(np.linspace(0.3, 0.05, 6, dtype=np.float32), (len(layers), tokens, 1))
    np.savez(path, layers=np.asarray(layers, np.int16), token_ids=np.arange(tokens, dtype=np.int32),
             indices=indices, scores=scores)
    return path


def test_a_flame_moe_layer_listed_twice_is_refused_not_written_as_duplicate_rows(tmp_path, capsys):
    """It was written (exit 0, 'layers 0 of 8') as a trace holding every layer-0 row twice, which trace validate
    then refused."""
    good = import_trace("flame-moe", [_flame_fixture(tmp_path / "ok.npz", [2, 3])], tmp_path / "ok.parquet")
    assert (good.rows, good.layers_present) == (6, [0, 1])
    path = _flame_fixture(tmp_path / "f.npz", [2, 2])
    out = tmp_path / "t.parquet"
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"moesim: error: {path}, field 'layers': transformer layer 2 is listed 2 times in 'layers' ([2, 2]) "
        "(fix: each MoE layer's routing appears once (the extract lists layers 2..9))\n")
    assert not out.exists()


def test_write_import_refuses_two_rows_for_one_token(tmp_path):
    from moesim.trace.importers._common import RoutingRows, new_report, write_import
    report, model = new_report("flame-moe", tmp_path / "t.parquet", "flame-moe-290m")
    rows = RoutingRows(top_k=model.top_k, with_weights=False)
    for _ in range(2):
        rows.add(request=0, step=0, phase=0, position=np.arange(2), layer=1, experts=np.tile(np.arange(6), (2, 1)))
    with pytest.raises(TraceFormatError) as err:
        write_import(tmp_path / "t.parquet", rows, model, report, {"files": ["a.npz"]}, weights_renormalized=False)
    assert str(err.value) == ("a.npz, field 'layer': the logs give the routing of request 0, position 0 at MoE layer 1 "
                              "(step 0) twice (fix: give each layer's and each token's routing once)")
    assert not (tmp_path / "t.parquet").exists()


def test_import_trace_from_python_never_replaces_a_source_log(tmp_path):
    """The command line refused it; moesim.trace.importers.import_trace wrote the trace over the log."""
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    text = raw.read_text()
    with pytest.raises(TraceFormatError) as err:
        import_trace(None, [str(raw)], str(raw))
    assert str(err.value) == (f"{raw}, field 'out': would overwrite the source log {raw} "
                              "(fix: write the trace to another file, e.g. one ending in .parquet)")
    assert raw.read_text() == text


def test_import_trace_takes_one_path_alone_as_one_source(tmp_path):
    """A lone str was taken letter by letter ('r: not a file')."""
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    listed = import_trace("speculative-moe", [raw], tmp_path / "a.parquet")
    for one in (str(raw), raw):
        alone = import_trace("speculative-moe", one, tmp_path / "b.parquet")
        assert (alone.rows, alone.steps, alone.requests) == (listed.rows, listed.steps, listed.requests) \
            and alone.rows > 0
        assert _table(tmp_path / "b.parquet").equals(_table(tmp_path / "a.parquet"))


@pytest.mark.parametrize("record, field, has, fix", [
    ({"dataset": "gsm8k", "problem_id": 0, "layer": 0, "experts": [1, 0], "gating_prob": [0.6, 0.4], "token_idx": 0},
     "gating_probs", "it has 'gating_prob'", "rename 'gating_prob' to 'gating_probs'"),
    ({"topk_weights": [1, 8], "topk_id": [list(range(8))]}, "topk_ids", "it has 'topk_id'",
     "rename 'topk_id' to 'topk_ids'"),
])
def test_a_misspelled_field_is_named_not_called_an_unknown_log(tmp_path, capsys, record, field, has, fix):
    """It was 'cannot tell which tool wrote this log', field '--format'."""
    path = _jsonl(tmp_path / "log.jsonl", [record])
    out = tmp_path / "t.parquet"
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"moesim: error: {path}, field '{field}': looks like a ")
    assert has in err and f"(fix: {fix}, or name the format with --format" in err and not out.exists()


def test_an_npz_missing_or_misspelling_an_array_is_named(tmp_path):
    for name, arrays, words in (
            ("a.npz", {"layers": [2], "token_ids": [1], "indices": np.zeros((1, 1, 6)), "score": np.zeros((1, 1, 6))},
             "no array 'scores'; it has 'score' (fix: rename 'score' to 'scores'"),
            ("b.npz", {"layers": [2], "token_ids": [1], "indices": np.zeros((1, 1, 6))},
             "no array 'scores'; it has 'layers', 'token_ids', 'indices' (fix: give a complete flame-moe log")):
        np.savez(tmp_path / name, **{k: np.asarray(v) for k, v in arrays.items()})
        with pytest.raises(TraceFormatError) as err:
            import_trace(None, [tmp_path / name], tmp_path / "t.parquet")
        assert "field 'scores': looks like a flame-moe log, but the npz" in str(err.value)
        assert words in str(err.value)


@pytest.mark.parametrize("content", [b"PK\x03\x04 truncated", b"\x93NUMPY not an archive"])
def test_a_truncated_npz_is_called_unreadable_not_of_an_unknown_tool(tmp_path, capsys, content):
    path = tmp_path / "log.npz"
    path.write_bytes(content)
    assert main(["trace", "import", str(path), "--out", str(tmp_path / "t.parquet")]) == 2
    assert capsys.readouterr().err == (f"moesim: error: {path}: not a readable .npz archive (truncated, or not an "
                                       "npz) (fix: give the complete .npz file as it was written)\n")


def test_a_logger_log_without_its_meta_line_is_told_by_its_routes(tmp_path):
    """It was 'cannot tell which tool wrote this log', though --format read it."""
    logger = _logger_fixture(tmp_path / "moe_layer3.jsonl", 3)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(logger.read_text().splitlines(keepends=True)[1:]))
    cerebras = _jsonl(tmp_path / "c.jsonl", [{"type": "route", "token_idx": i, "layer": 0,
                                              "topk_ids": list(range(8)), "topk_weights": [0.5] + [0.5 / 7] * 7}
                                             for i in range(3)])
    assert (format_of(bare), format_of(cerebras)) == ("vllm-moe-logger", "cerebras-olmoe")
    told = import_trace(None, [bare], tmp_path / "t.parquet")
    given = import_trace("vllm-moe-logger", [logger], tmp_path / "g.parquet")
    assert (told.rows, told.steps, told.layers_present) == (given.rows, given.steps, [3]) and told.rows > 0
    assert import_trace(None, [cerebras], tmp_path / "c.parquet").rows == 3


def test_a_bad_expert_in_an_npz_is_located_by_layer_and_token_not_line(tmp_path):
    """npz files have no lines: flame-moe said 'layer 2 line 1' for token 1, the qwen3 extract 'line 0' always."""
    flame = _flame_fixture(tmp_path / "f.npz", [2, 3])
    arrays = dict(np.load(flame))
    arrays["indices"][1, 2, 3] = 64
    np.savez(flame, **arrays)
    with pytest.raises(TraceFormatError) as err:
        import_trace("flame-moe", [flame], tmp_path / "t.parquet")
    assert str(err.value).startswith(f"{flame} layer 3 token 2, field 'indices': expert id in [0, 1, 2, 64, 4, 5] "
                                     "outside [0, 64)")
    ids = np.tile(np.arange(8, dtype=np.int16), (48, 3, 1))
    ids[5, 1, 0] = 200
    np.savez(tmp_path / "q.npz", topk_ids=ids)
    with pytest.raises(TraceFormatError) as err:
        import_trace("vllm-qwen3-prefill", [tmp_path / "q.npz"], tmp_path / "t.parquet")
    assert str(err.value).startswith(f"{tmp_path / 'q.npz'} layer 5 token 1, field 'topk_ids': expert id in "
                                     "[200, 1, 2, 3, 4, 5, 6, 7] outside [0, 128)")


def test_each_summary_line_stays_one_line_when_piped(tmp_path):
    """Piped, a summary line over 160 characters was broken in two ('layers\\nall of 32')."""
    import subprocess
    import sys
    raw = _raw_fixture(tmp_path / "raw.jsonl")
    out = tmp_path / ("a-long-folder-name-" * 5) / "trace.parquet"
    out.parent.mkdir()
    shown = subprocess.run([sys.executable, "-m", "moesim.cli", "trace", "import", str(raw), "--out", str(out)],
                           capture_output=True, text=True, timeout=120, check=False)
    lines = shown.stdout.splitlines()
    assert shown.returncode == 0 and len(lines[0]) > 160
    assert lines[0].startswith(f"wrote {out} (speculative-moe, model mixtral-8x7b): ")
    assert lines[0].endswith(" layers all of 32") and all(l.startswith(("wrote", "repaired", "dropped", "note"))
                                                          for l in lines)


def test_a_flame_moe_npz_with_too_few_token_ids_names_token_ids(tmp_path):
    """'indices' and 'scores' agree on 3 tokens; the 2 token ids are what is wrong (it blamed 'indices')."""
    path = tmp_path / "short.npz"
    np.savez(path, layers=np.array([2]), token_ids=np.array([5, 6]), indices=np.zeros((1, 3, 6), dtype=np.int64),
             scores=np.zeros((1, 3, 6)))
    with pytest.raises(TraceFormatError) as err:
        import_trace("flame-moe", [path], tmp_path / "t.parquet")
    assert err.value.field == "token_ids"
    assert "2 token ids for the 3 tokens of 'indices' and 'scores'" in str(err.value)
    assert not (tmp_path / "t.parquet").exists()


def test_bytes_that_are_not_utf8_are_located_by_line_deep_in_a_log(tmp_path, capsys):
    """The error gave 'byte 1004' for a bad byte at byte 435,180 of the file (the decoder's offset in its
    buffer) and no line; it names the line now, and the byte within it."""
    rows = [json.dumps(_spec_row(0, t, [1, 2], [0.6, 0.4])).encode() for t in range(3000)]
    rows[2500] = rows[2500].replace(b'"humaneval"', b'"human\xffeval"')
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    out = tmp_path / "t.parquet"
    assert main(["trace", "import", "--format", "speculative-moe", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{path} line 2501" in err and "field 'line'" in err
    bad_byte = rows[2500].index(b"\xff") + 1
    assert f"byte {bad_byte} of the line" in err
    assert not out.exists()


@pytest.mark.parametrize("fmt", [None, "speculative-moe"])
def test_a_gzip_compressed_log_is_refused_with_how_to_decompress_it(tmp_path, capsys, fmt):
    """It was 'cannot tell which tool wrote this log' (no --format) or 'not UTF-8 text (byte 1)' (--format)."""
    import gzip
    path = tmp_path / "routing.jsonl.gz"
    path.write_bytes(gzip.compress(json.dumps(_spec_row(0, 0, [1, 2], [0.6, 0.4])).encode() + b"\n"))
    out = tmp_path / "t.parquet"
    args = ["trace", "import", str(path), "--out", str(out)] + (["--format", fmt] if fmt else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{path}: gzip-compressed" in err and f"gzip -dc {path} > {tmp_path / 'routing.jsonl'}" in err
    assert not out.exists()


def test_no_source_names_the_python_argument(tmp_path):
    """From Python, no log to convert named the field 'SRC', neither the keyword nor the CLI's SOURCES."""
    from moesim.errors import ConfigError
    from moesim.trace.importers import import_trace
    with pytest.raises(ConfigError, match=r"^field 'sources': no source files given"):
        import_trace(None, [], tmp_path / "t.parquet")
