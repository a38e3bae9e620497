"""Importers on the real logs in ../shared/real-traces and on small hand-written fixtures (telling the formats
apart: test_importers_detect.py; bad logs, the output and the summary: test_importers_errors.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moesim.cli import main
from moesim.errors import TraceFormatError
from moesim.trace.importers import import_trace
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


# ----------------------------------------------------------------------------- progress
def test_import_reports_the_bytes_it_reads_as_it_goes(tmp_path, monkeypatch):
    """A long log was '0 files' in the progress lines until it was all imported: the importers now report the
    bytes they read, every PROGRESS_BYTES of a JSON-lines log and an npz once loaded."""
    from moesim.trace.importers import _common
    monkeypatch.setattr(_common, "PROGRESS_BYTES", 4096)
    log = _raw_fixture(tmp_path / "routing_raw.jsonl")
    seen: list[tuple[int, str]] = []
    import_trace(None, [log], tmp_path / "t.parquet", progress=lambda n, path: seen.append((n, path.name)))
    assert len(seen) > 3 and sum(n for n, _ in seen) == log.stat().st_size
    assert {name for _, name in seen} == {"routing_raw.jsonl"}


def test_the_import_command_counts_its_progress_in_bytes(tmp_path):
    import os
    import subprocess
    import sys
    log = _raw_fixture(tmp_path / "routing_raw.jsonl")
    done = subprocess.run([sys.executable, "-m", "moesim", "trace", "import", str(log), "--out",
                           str(tmp_path / "t.parquet")], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "MOESIM_PROGRESS_INTERVAL": "0"}, timeout=120)
    assert done.returncode == 0, done.stderr
    kib = f"{log.stat().st_size / 1024:,.0f}"
    assert f"trace import: done, {kib}/{kib} KiB (100%)" in done.stderr
