"""Telling which tool wrote a log: every real log and fixture by its first records, and one line for a log of no
known format, an empty, compressed or truncated one, a misspelled field, or logs of two formats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moesim.cli import main
from moesim.errors import ConfigError, TraceFormatError
from moesim.trace.importers import import_trace
from moesim.trace.importers.detect import detect_format, format_of
from tests.trace.test_importers import REAL, _jsonl, _logger_fixture, _raw_fixture, _spec_row, _table, needs_real


def test_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="unknown import format 'nope'"):
        import_trace("nope", [tmp_path], tmp_path / "t.parquet")


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


# ----------------------------------------------------------------------------- files that hold no routing
def _counters(path, pairs: bool):
    """An OLMoE-routing-stats .json conversion: per-layer counters, of experts or of (expert, expert) pairs."""
    layer = {f"{i},{j}": i + j for i in range(2) for j in range(3)} if pairs else {str(e): 10 + e for e in range(8)}
    path.write_text(json.dumps([layer, layer]))
    return path


def _outputs(path):
    """speculative-moe's *_outputs.jsonl: prompts and generated text, no routing."""
    return _jsonl(path, [{"problem_id": 0, "task_id": "HumanEval/0", "prompt": "def f():", "generated": " pass"}])


def _lfs_pointer(path):
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 143000000\n")
    return path


def _torch_save(path):
    """What torch.save writes (DynaNDE-Simulator's per-layer routing files): a zip holding a pickle."""
    import zipfile
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("samples/data.pkl", b"\x80\x02}q\x00.")
        archive.writestr("samples/version", "3\n")
    return path


def _trace(path):
    """A moesim trace, given to the importer as if it were a log."""
    import_trace(None, [_raw_fixture(path.with_suffix(".jsonl"))], path)
    return path


@pytest.mark.parametrize("make, words, fix", [
    (lambda d: _counters(d / "arxiv.json", pairs=False), "holds aggregate expert counts", "import a per-token log"),
    (lambda d: _counters(d / "c4.json", pairs=True), "holds aggregate expert counts", "import a per-token log"),
    (lambda d: _outputs(d / "gsm8k_2_outputs.jsonl"), "holds prompts and generated text", "*_routing.jsonl"),
    (lambda d: _lfs_pointer(d / "humaneval_full_routing.jsonl"),
     "a Git LFS pointer (to a file of 143000000 bytes), not the log itself", "git lfs pull"),
    (lambda d: _trace(d / "gsm8k.parquet"), "a Parquet file (a moesim trace, or another Parquet table), not a "
                                             "tool's routing log", "a trace needs no import"),
    (lambda d: _torch_save(d / "samples.pt"), "a PyTorch file (torch.save), which no import format reads",
     "numpy.savez: layers, token_ids, indices, scores"),
], ids=["expert-counters", "pair-counters", "outputs", "lfs-pointer", "trace", "torch-save"])
def test_a_file_that_holds_no_routing_says_what_it_holds(tmp_path, capsys, make, words, fix):
    """Counters copied out of OLMoE-routing-stats/ (their path no longer says what they are), speculative-moe's
    outputs file, a Git LFS pointer, a trace and a torch.save file were all 'cannot tell which tool wrote this
    log'; the pointer with --format was 'line 1: not valid JSON', the trace 'not UTF-8 text'."""
    path = make(tmp_path)
    out = tmp_path / "t.parquet"
    for fmt in (None, "speculative-moe"):
        with pytest.raises(TraceFormatError) as err:
            import_trace(fmt, [path], out)
        if fmt is None or "outputs" not in path.name:  # the outputs file with --format: its missing fields
            assert words in str(err.value) and fix in str(err.value)
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and str(path) in said and words in said and not out.exists()


def _other_model_log(path, model_id="Qwen/Qwen2-57B-A14B-Instruct", top_k=8):
    """A vLLM MoE logger log of a model no format reads: 64 experts, top-8, as OLMoE's, layer 0."""
    routes = [{"type": "route", "req_id": "r0", "token_idx": i, "layer": 0,
               "topk_ids": [(i + j) % 64 for j in range(8)],
               "topk_weights": [0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]} for i in range(6)]
    return _jsonl(path, [{"type": "meta", "model_id": model_id, "top_k": top_k}] + routes)


def test_a_logger_log_of_another_model_is_refused_not_imported_under_a_known_model(tmp_path, capsys):
    """A Qwen2-MoE log (top-8 routes) was told to be cerebras-olmoe by its routes' length and written as an
    OLMoE-1B-7B trace, exit 0; with --format either logger format imported it the same way or failed on its
    routes' length, never naming the model the log says it is."""
    path = _other_model_log(tmp_path / "routes.jsonl")
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError, match="a vLLM MoE logger log of model 'Qwen/Qwen2-57B-A14B-Instruct'") as err:
        import_trace(None, [path], out)
    assert "field 'model_id'" in str(err.value) and "cerebras-olmoe: allenai/OLMoE-1B-7B-0924" in str(err.value)
    for fmt in ("cerebras-olmoe", "vllm-moe-logger"):
        with pytest.raises(TraceFormatError, match=f"line 1, field 'model_id': the log's meta names model "
                                                   f"'Qwen/Qwen2-57B-A14B-Instruct'; {fmt} reads logs of"):
            import_trace(fmt, [path], out)
    assert main(["trace", "import", str(path), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not out.exists()


def test_a_logger_meta_whose_top_k_is_not_the_models_is_refused(tmp_path):
    path = _other_model_log(tmp_path / "routes.jsonl", model_id="allenai/OLMoE-1B-7B-0924", top_k=4)
    with pytest.raises(TraceFormatError, match="line 1, field 'top_k': the log's meta gives top_k 4; "
                                               "allenai/OLMoE-1B-7B-0924 routes 8 experts a token"):
        import_trace(None, [path], tmp_path / "t.parquet")
    ok = _other_model_log(tmp_path / "ok.jsonl", model_id="allenai/OLMoE-1B-7B-0924")
    assert import_trace(None, [ok], tmp_path / "t.parquet").rows == 6


@pytest.mark.parametrize("fmt", [None, "speculative-moe"])
def test_a_log_saved_with_a_byte_order_mark_or_crlf_lines_imports(tmp_path, fmt):
    """A log an editor saved with a UTF-8 byte-order mark was 'cannot tell which tool wrote this log', and with
    --format 'line 1: not valid JSON'."""
    plain = _raw_fixture(tmp_path / "routing_raw.jsonl")
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n"))
    expected = import_trace(fmt, [plain], tmp_path / "a.parquet")
    got = import_trace(fmt, [marked], tmp_path / "b.parquet")
    assert (got.rows, got.steps, dict(got.repaired)) == (expected.rows, expected.steps, dict(expected.repaired))
    assert _table(tmp_path / "a.parquet").equals(_table(tmp_path / "b.parquet"))
