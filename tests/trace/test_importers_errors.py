"""Importing bad logs and misusing the import: malformed lines, missing or short arrays, bad experts, bytes that are
not UTF-8, duplicate rows, a folder or no source given; the output never replaces a source log, and the summary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moesim.cli import main
from moesim.errors import TraceFormatError
from moesim.trace.importers import import_trace
from moesim.trace.validate import validate_trace
from tests.trace.test_importers import _jsonl, _logger_fixture, _raw_fixture, _spec_row, _table


# ----------------------------------------------------------------------------- malformed input
@pytest.mark.parametrize("line, field, fix", [
    ("{not json", "line", "repair or delete"),
    (json.dumps({"dataset": "humaneval", "problem_id": 0, "layer": 0, "experts": [1, 2], "token_idx": 1}),
     "gating_probs", "needs 'gating_probs'"),
    (json.dumps(_spec_row(0, 1, [1, 2, 3], [0.5, 0.3])), "experts", "exactly 2 numbers, this format's top_k (a log "
                                                                    "of another tool or model: check --format"),
    (json.dumps(_spec_row(0, 1, [1, 2**40], [0.6, 0.4])), "experts", "expert id 1099511627776 is out of"),
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


def test_no_source_names_the_python_argument(tmp_path):
    """From Python, no log to convert named the field 'SRC', neither the keyword nor the CLI's SOURCES."""
    from moesim.errors import ConfigError
    from moesim.trace.importers import import_trace
    with pytest.raises(ConfigError, match=r"^field 'sources': no source files given"):
        import_trace(None, [], tmp_path / "t.parquet")


# ----------------------------------------------------------------------------- logs cut short
def _processed_rows(tokens: int = 20) -> list[dict]:
    """One problem's processed log in upstream order: layer by layer, ``tokens`` decode tokens each."""
    return [_spec_row(layer, i, [layer % 8, (layer + 1) % 8], [0.7, 0.3]) for layer in range(32) for i in range(tokens)]


@pytest.mark.parametrize("keep, field, words", [
    (18 * 20 + 7, "layer", "has no rows for MoE layer(s) 19-31 (its last row is line 367): the log is cut short"),
    (32 * 20 - 10, "token_idx", "has 10 decode rows at layer 31 against 20 at its longest layer"),
])
def test_a_processed_log_cut_short_is_refused_not_padded_with_invented_ties(tmp_path, capsys, keep, field, words):
    """A log cut at a line boundary parsed cleanly, and its missing rows were re-inserted as [0.5, 0.5] ties
    (or whole layers were left out of the request): 13 of 20 rows of layer 18 invented, exit 0."""
    path = _jsonl(tmp_path / "gsm8k_2_routing.jsonl", _processed_rows()[:keep])
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError, match="cut short") as err:
        import_trace("speculative-moe", [path], out)
    assert f"field '{field}'" in str(err.value) and words in str(err.value) and not out.exists()
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and str(path) in said and "fix: use the complete log" in said


def _raw_rows(prompt: int = 10, steps: int = 3) -> list[dict]:
    """One problem's raw capture in upstream order: the prefill layer by layer, then each decode step's 32 layers."""
    prefill = [_spec_row(layer, pos, [pos % 8, (pos + 1) % 8], [0.7, 0.3], raw=True)
               for layer in range(32) for pos in range(prompt)]
    decode = [_spec_row(layer, 0, [(layer + step) % 8, (layer + step + 3) % 8], [0.6, 0.4], raw=True)
              for step in range(steps) for layer in range(32)]
    return prefill + decode


@pytest.mark.parametrize("keep, field, words", [
    (20 * 10 + 4, "layer", "prefill has no rows for MoE layer(s) 21-31 (its last row is line 204)"),
    (31 * 10 + 4, "token_pos", "prefill ends at token_pos 3 at layer 31 against 9 at its longest layer"),
    (32 * 10 + 32 * 2 + 20, "layer", "line 385, field 'layer': humaneval problem 0's decode step 2 has no rows for "
                                     "its last MoE layer(s) 20-31: the log is cut short"),
])
def test_a_raw_capture_cut_short_is_refused_not_padded_with_invented_ties(tmp_path, capsys, keep, field, words):
    """routing_raw.jsonl cut at a line boundary imported with exit 0: cut in the prefill, a prefill-only trace of
    the first layers (layers 0-25 of 32 for the real file cut in half); cut in the decode, the last step's missing
    layers written as [0.5, 0.5] ties."""
    path = _jsonl(tmp_path / "routing_raw.jsonl", _raw_rows()[:keep])
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError, match="cut short") as err:
        import_trace("speculative-moe", [path], out)
    assert f"field '{field}'" in str(err.value) and words in str(err.value) and not out.exists()
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and str(path) in said and "fix: use the complete log" in said and not out.exists()


def test_a_raw_capture_with_a_repeated_line_is_refused_not_split_into_steps_of_invented_ties(tmp_path):
    """A decode line given twice started a new forward: its step and an extra one each lacked half the layers,
    written as [0.5, 0.5] ties (the real routing_raw.jsonl with one line repeated: 85 steps, 32 rows invented)."""
    rows = _raw_rows()
    repeated = 32 * 10 + 32 + 12  # decode step 1, layer 12
    path = _jsonl(tmp_path / "routing_raw.jsonl", rows[:repeated + 1] + rows[repeated:])
    with pytest.raises(TraceFormatError, match=r"line 353, field 'layer': humaneval problem 0's decode step 1 has no "
                                               r"rows for its last MoE layer\(s\) 13-31: a line is repeated or out "
                                               r"of order"):
        import_trace(None, [path], tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_a_raw_capture_with_two_lines_swapped_across_a_step_boundary_is_refused(tmp_path):
    """Layer 31 of decode step 0 swapped with layer 0 of step 1 made a step of those two rows alone, its 30 other
    layers written as ties (the real routing_raw.jsonl so edited: 85 steps, exit 0)."""
    rows = _raw_rows()
    last = 32 * 10 + 31  # decode step 0, layer 31
    rows[last], rows[last + 1] = rows[last + 1], rows[last]
    path = _jsonl(tmp_path / "routing_raw.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"line 352, field 'layer': humaneval problem 0's decode step 1 has no "
                                               r"rows for 30 of its 32 MoE layers \(1-30\): a line is repeated or "
                                               r"out of order"):
        import_trace(None, [path], tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_a_raw_capture_cut_at_a_step_boundary_or_with_a_few_trailing_ties_still_imports(tmp_path):
    whole_steps = _jsonl(tmp_path / "a.jsonl", _raw_rows()[:32 * 10 + 32 * 2])
    assert import_trace("speculative-moe", [whole_steps], tmp_path / "a.parquet").decode_steps == 2
    last_ties = _jsonl(tmp_path / "b.jsonl", _raw_rows()[:-3])  # the last step's layers 29-31 dropped as ties
    report = import_trace("speculative-moe", [last_ties], tmp_path / "b.parquet")
    assert (report.decode_steps, report.repaired["tie_rows_imputed"]) == (3, 3)


def test_a_few_tie_drops_per_layer_are_still_re_inserted(tmp_path):
    rows = [r for r in _processed_rows() if not (r["layer"] == 3 and r["token_idx"] >= 16)]  # 4 of 20 missing
    report = import_trace("speculative-moe", [_jsonl(tmp_path / "p.jsonl", rows)], tmp_path / "t.parquet")
    assert (report.rows, report.repaired["tie_rows_imputed_position_unknown"]) == (32 * 20, 4)



@pytest.mark.parametrize("sizes, words", [
    ((8, 4, 3, 5, 2, 2), "7 forwards here, 6 in moe_layer3.jsonl (the shorter log is cut short)"),
    ((8, 4, 3, 5, 2, 1, 1), "forward 5 has 2 rows here, 1 in moe_layer3.jsonl"),
])
def test_joined_logger_runs_name_the_forward_where_they_part(tmp_path, sizes, words):
    """The message showed the first five forward sizes of each run, which agree (dummies, warm-up, prefill,
    first decode step) wherever the runs part: "[8192, 256, 65, 1406, 25]... vs [8192, 256, 65, 1406, 25]..."."""
    short = _logger_fixture(tmp_path / "moe_layer3.jsonl", 3, sizes)
    whole = _logger_fixture(tmp_path / "moe_layer9.jsonl", 9)
    with pytest.raises(TraceFormatError) as err:
        import_trace("vllm-moe-logger", [short, whole], tmp_path / "t.parquet")
    assert f"{whole}, field 'token_idx': forward structure differs from moe_layer3.jsonl: {words}" in str(err.value)


# ----------------------------------------------------------------------------- one log given twice
def _cerebras_log(path: Path) -> Path:
    rows = [{"type": "meta"}] + [{"type": "route", "token_idx": i, "layer": 0, "topk_ids": [9, 8, 7, 6, 5, 4, 3, 2],
                                  "topk_weights": [0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]} for i in range(3)]
    return _jsonl(path, rows)


@pytest.mark.parametrize("second, words", [
    (lambda log: log, "the same log as {log}, named again"),
    (lambda log: log.parent / "." / log.name, "the same log as {log}, named again"),
    (lambda log: Path(shutil.copy(log, log.parent / "copy.jsonl")), "a copy of {log} (the same bytes)"),
], ids=["twice", "another-spelling", "copy"])
def test_one_log_given_twice_is_refused_not_imported_as_two_requests(tmp_path, capsys, second, words):
    """``moe_routes.jsonl moe_routes.jsonl`` wrote 2 requests of the same routing, exit 0 (and so did a flame-moe
    npz or a token_distri log named twice, or a copy of it)."""
    log = _cerebras_log(tmp_path / "moe_routes.jsonl")
    other = second(log)
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError) as err:
        import_trace(None, [log, other], out)
    assert str(err.value).startswith(f"{other}, field 'sources': {words.format(log=log)}") and not out.exists()
    assert main(["trace", "import", str(log), str(other), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not out.exists()


def test_a_qwen3_log_and_its_npz_extract_together_are_refused(tmp_path):
    """``token_distri_8*`` names the log and its forward-2 extract: they became two prefill requests of one batch."""
    lines, forward2 = [], []
    for forward, tokens in enumerate([2, 1, 3, 1]):
        for layer in range(48):
            ids = [[(t + layer + k) % 128 for k in range(8)] for t in range(tokens)]
            lines.append({"topk_weights": [tokens, 8], "topk_ids": ids})
            if forward == 2:
                forward2.append(ids)
    log = _jsonl(tmp_path / "token_distri_8.jsonl", lines)
    npz = tmp_path / "token_distri_8_prefill_forward2_ids.npz"
    np.savez(npz, topk_ids=np.asarray(forward2, dtype=np.int16))
    with pytest.raises(TraceFormatError,
                       match=r"field 'topk_ids': holds the same prefill batch as token_distri_8.jsonl"):
        import_trace(None, [log, npz], tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()
    other = _jsonl(tmp_path / "token_distri_16.jsonl", [{**line, "topk_ids": [[(k + 1) % 128 for k in range(8)]] * line[
        "topk_weights"][0]} for line in lines])
    assert import_trace(None, [log, other], tmp_path / "t.parquet").prefill_steps == 2


@pytest.mark.parametrize("edit, words", [
    (lambda rows: rows[:3] + rows[2:], "line 4, field 'token_idx': token_idx 1 after 1"),
    (lambda rows: rows[:2] + rows[3:], "line 3, field 'token_idx': token_idx 2 after 0"),
], ids=["repeated", "lost"])
def test_a_cerebras_log_with_a_line_repeated_or_lost_is_refused(tmp_path, edit, words):
    """token_idx is a global running counter; a repeated line was imported as one more token (4,472 rows of the
    real log's 4,471), a lost one left out without a word."""
    rows = [{"type": "meta"}] + [{"type": "route", "token_idx": i, "layer": 0, "topk_ids": [9, 8, 7, 6, 5, 4, 3, 2],
                                  "topk_weights": [0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]} for i in range(4)]
    path = _jsonl(tmp_path / "moe_routes.jsonl", edit(rows))
    with pytest.raises(TraceFormatError, match="a line is repeated, missing or out of order") as err:
        import_trace(None, [path], tmp_path / "t.parquet")
    assert words in str(err.value) and not (tmp_path / "t.parquet").exists()


@pytest.mark.parametrize("sizes, words", [
    ((8, 4, 3, 5), "no decode forward after the 5-row prefill: the log is cut short"),
    ((8, 4, 3, 5, 2, 1, 2), "decode forward 6 has 2 rows after one of 1; decode batches of this run only shrink"),
], ids=["cut-in-prefill", "batch-grows"])
def test_a_logger_run_cut_in_its_prefill_or_whose_decode_batch_grows_is_refused(tmp_path, sizes, words):
    """The real moe_layer8.jsonl cut at line 9,000 imported as a 486-row prefill (of 1,406), exit 0; with one
    token_idx 0 line repeated, as one more decode step of one row."""
    log = _logger_fixture(tmp_path / "moe_layer3.jsonl", 3, sizes)
    with pytest.raises(TraceFormatError, match="field 'token_idx'") as err:
        import_trace(None, [log], tmp_path / "t.parquet")
    assert words in str(err.value) and not (tmp_path / "t.parquet").exists()


@pytest.mark.parametrize("fmt", ["cerebras-olmoe", "speculative-moe", "vllm-moe-logger"])
def test_an_npz_given_to_a_format_of_json_lines_is_named_as_an_archive(tmp_path, capsys, fmt):
    """It was 'line 1, field line: not UTF-8 text (byte 18 of the line)', fix 'repair or delete the garbled
    line', for a file with no garbled line to repair."""
    npz = tmp_path / "routing.npz"
    np.savez(npz, topk_ids=np.zeros((2, 3, 8), dtype=np.int16))
    assert main(["trace", "import", "--format", fmt, str(npz), "--out", str(tmp_path / "t.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(npz) in err and "zip archive" in err and "flame-moe" in err
    assert "garbled" not in err and not (tmp_path / "t.parquet").exists()


def test_a_binary_file_given_to_a_format_of_json_lines_is_named_binary(tmp_path, capsys):
    """It was 'line 1: not UTF-8 text', fix 'repair or delete the garbled line': there is no line to repair."""
    binary = tmp_path / "routing.jsonl"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe" * 40)
    assert main(["trace", "import", "--format", "speculative-moe", str(binary), "--out",
                 str(tmp_path / "t.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(binary) in err and "binary file" in err and "garbled" not in err
