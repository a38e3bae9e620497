"""trace_stats on a hand-built trace whose every statistic is worked out below."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from moesim.cli import main
from moesim.model.spec import ModelSpec
from moesim.trace import stats as stats_mod
from moesim.trace.io import write_trace
from moesim.trace.schema import TraceMeta
from moesim.trace.stats import render_comparison, render_stats, sparkline, trace_stats

TOY = ModelSpec(name="toy", num_layers=2, num_experts=6, top_k=3, hidden_size=8, moe_intermediate_size=8)

# Two requests, three steps, 2 MoE layers, 6 experts, top-3.
#   step 0: prefill of request 0 (positions 0, 1)
#   step 1: prefill of request 1 (position 0)
#   step 2: decode of request 0 (position 2) and request 1 (position 1)
# Routed sets (layer 0 | layer 1):
#   r0p0 [0,1,2] | [1,2,3]      r0p1 [0,3,4] | [1,2,4]      r0p2 [0,1,5] | [1,2,5]
#   r1p0 [5,0,1] | [1,4,5]      r1p1 [2,3,4] | [1,3,0]
ROWS = [  # step, layer, request, position, phase, experts, pred_next_layer, pred_next_token
    (0, 0, 0, 0, 0, [0, 1, 2], [1, 2, 0], [0, 1, 2]),
    (0, 0, 0, 1, 0, [0, 3, 4], [4], [0, 1, 5]),
    (0, 1, 0, 0, 0, [1, 2, 3], [5], [1, 2, 3]),
    (0, 1, 0, 1, 0, [1, 2, 4], [], [4]),
    (1, 0, 1, 0, 0, [5, 0, 1], [], [2, 3]),
    (1, 1, 1, 0, 0, [1, 4, 5], [0], [0, 1, 3, 5]),
    (2, 0, 0, 2, 1, [0, 1, 5], [1, 2, 5, 3], [5]),
    (2, 0, 1, 1, 1, [2, 3, 4], [0, 3, 1], [5]),
    (2, 1, 0, 2, 1, [1, 2, 5], [2], [5]),
    (2, 1, 1, 1, 1, [1, 3, 0], [2], [5]),
]


def write_toy(path) -> None:
    cols = list(zip(*ROWS))
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.array(cols[4], dtype=np.int8), "experts": np.array(cols[5]),
            "pred_next_layer": cols[6], "pred_next_token": cols[7]}
    write_trace(path, data, TraceMeta(model=TOY, source={"kind": "synthetic"}))


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.parquet"
    write_toy(path)
    return path


def check_toy(s: dict) -> None:
    assert s["tokens"] == 5 and s["tokens_by_phase"] == {"prefill": 3, "decode": 2}
    assert s["requests"] == 2
    assert s["steps"] == {"prefill": 2, "decode": 1}
    assert (s["layers"], s["num_experts"], s["top_k"], s["rows"]) == (2, 6, 3, 10)
    # top 10% of 6 experts = 1 expert. Layer 0 counts: e0 4, e1 3, e2..e5 2 each -> 4/15.
    # Layer 1 counts: e1 5, e2 3, e3 2, e4 2, e5 2, e0 1 -> 5/15.
    assert s["top10_share_by_layer"] == pytest.approx([4 / 15, 5 / 15])
    assert s["top10_share"] == pytest.approx((4 / 15 + 5 / 15) / 2)
    # Layer 0: r0p1 vs r0p0 shares {0} -> 1/3; r0p2 vs r0p1 {0} -> 1/3; r1p1 vs r1p0 {} -> 0: mean 2/9.
    # Layer 1: {1,2} -> 2/3; {1,2} -> 2/3; r1p1 vs r1p0 {1} -> 1/3: mean 5/9. First tokens excluded.
    assert s["reuse_prev_token_by_layer"] == pytest.approx([2 / 9, 5 / 9])
    assert s["reuse_prev_token"] == pytest.approx((2 / 9 + 5 / 9) / 2)
    # Co-activation, layer 0: pivot 0 has peers 1:3, 5:2, 2:1, 3:1, 4:1 (total 8), top-4 = 7 -> 7/8;
    # every other pivot has at most 4 peers -> 1. Mean (5 + 7/8) / 6.
    # Layer 1: pivot 1 has peers 2:3, 3:2, 4:2, 5:2, 0:1 (total 10), top-4 = 9 -> 0.9; others 1.
    assert s["coactivation_top4_share_by_layer"] == pytest.approx([(5 + 7 / 8) / 6, (5 + 0.9) / 6])
    assert s["coactivation_top4_share"] == pytest.approx((5 + 7 / 8 + 5 + 0.9) / 12)
    # pred_next_layer, layer-0 rows vs the same token at layer 1:
    #   [1,2,0] vs [1,2,3] 2; [4] vs [1,2,4] 1; [] vs [1,4,5] 0; [1,2,5,3] vs [1,2,5] 3; [0,3,1] vs [1,3,0] 3
    #   -> 9 / 15. pred_next_token vs the request's next token at the same layer:
    #   L0 r0p0 [0,1,2] vs [0,3,4] 1; r0p1 [0,1,5] vs [0,1,5] 3; r1p0 [2,3] vs [2,3,4] 2;
    #   L1 r0p0 [1,2,3] vs [1,2,4] 2; r0p1 [4] vs [1,2,5] 0; r1p0 [0,1,3,5] vs [1,3,0] 3 -> 11 / 18.
    assert s["predictor_recall"] == pytest.approx({"pred_next_layer": 9 / 15, "pred_next_token": 11 / 18})
    # distinct experts per (step, layer): prefill 5, 4, 3, 3 -> 3.75; decode 6, 5 -> 5.5
    assert s["unique_experts_per_layer_step"] == pytest.approx({"prefill": 3.75, "decode": 5.5})
    # prefill coverage: distinct / uniform union 6 * (1 - (1 - 3/6)^n). Step 0 (n = 2, uniform 4.5):
    # layer 0 {0,1,2,3,4} 5 -> 10/9, layer 1 {1,2,3,4} 4 -> 8/9; step 1 (n = 1, uniform 3): 3/3, 3/3.
    assert s["prefill_coverage"] == pytest.approx((10 / 9 + 8 / 9 + 1 + 1) / 4)
    assert s["weight_top1_share"] is None


def test_hand_built_trace_has_the_worked_out_statistics(toy):
    check_toy(trace_stats(toy))


def test_statistics_do_not_depend_on_chunk_boundaries(toy, monkeypatch):
    # three rows per read batch: steps and per-request state cross batch boundaries
    monkeypatch.setattr(stats_mod, "CHUNK_ROWS", 3)
    check_toy(trace_stats(toy))


def test_inspect_json_prints_the_stable_keys(toy, capsys):
    assert main(["trace", "inspect", "--json", str(toy)]) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("tokens", "requests", "steps", "layers", "num_experts", "top_k", "top10_share_by_layer",
                "reuse_prev_token_by_layer", "coactivation_top4_share", "predictor_recall"):
        assert key in printed
    assert printed["steps"] == {"prefill": 2, "decode": 1}
    assert printed["predictor_recall"]["pred_next_layer"] == pytest.approx(0.6)


def test_json_dash_is_the_json_flag_as_replay_takes_it(toy, capsys):
    """`--json -` (replay's form) works for inspect and compare too; a '-' anywhere else is still refused."""
    assert main(["trace", "inspect", "--json", str(toy)]) == 0
    flag = capsys.readouterr().out
    for args in (["trace", "inspect", str(toy), "--json", "-"], ["trace", "inspect", "--json", "-", str(toy)]):
        assert main(args) == 0
        assert capsys.readouterr().out == flag
    assert main(["trace", "compare", str(toy), str(toy), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["a"] == json.loads(flag)
    assert main(["trace", "inspect", str(toy), "-"]) == 2
    assert "unexpected extra argument (-)" in capsys.readouterr().err
    # replay's `--json FILE` habit: one line saying how to get the file, nothing written
    assert main(["trace", "compare", str(toy), str(toy), "--json", str(toy.parent / "cmp.json")]) == 2
    err = capsys.readouterr().err
    assert "--json takes no file here: it prints the JSON on stdout (write it to a file with --json > " in err
    assert err.count("\n") == 1 and not (toy.parent / "cmp.json").exists()


def test_inspect_and_compare_render_tables(toy, tmp_path, capsys):
    other = tmp_path / "other.parquet"
    write_toy(other)
    assert main(["trace", "inspect", str(toy)]) == 0
    out = capsys.readouterr().out
    assert "prev-token reuse" in out and "0.222" in out
    assert re.search(r"prefill coverage \(of a uniform router's\) +│ +1\.000", out)
    assert main(["trace", "compare", str(toy), str(other)]) == 0
    out = capsys.readouterr().out
    assert "B vs A" in out and "+0.0%" in out


def test_render_functions_accept_any_console(toy):
    from rich.console import Console
    console = Console(record=True, width=120)
    s = trace_stats(toy)
    render_stats(s, console, title="toy")
    changed = dict(s, top10_share=s["top10_share"] * 1.5)
    render_comparison(s, changed, console, names=("a", "b"))
    text = console.export_text()
    assert "+50.0%" in text and "toy" in text


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([None, 1.0]) == " ▁"


def test_missing_file_is_one_line_error(tmp_path, capsys):
    assert main(["trace", "inspect", str(tmp_path / "nope.parquet")]) == 2
    assert "file not found" in capsys.readouterr().err


def write_toy_with_expert(path, expert: int) -> None:
    """The toy trace with the first row's last routed expert replaced by ``expert``."""
    cols = list(zip(*ROWS))
    experts = np.array(cols[5])
    experts[0, 2] = expert
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.array(cols[4], dtype=np.int8), "experts": experts}
    write_trace(path, data, TraceMeta(model=TOY, source={"kind": "synthetic"}))


@pytest.mark.parametrize("expert", [7, 40])
def test_statistics_of_an_expert_id_out_of_range_are_refused_naming_file_and_field(tmp_path, toy, expert):
    # 7 (of 6 experts) was counted silently as layer 1's expert 1; 40 failed with a numpy broadcast error
    from moesim.errors import TraceFormatError
    from moesim.trace.stats import compare_traces
    bad = tmp_path / "bad.parquet"
    write_toy_with_expert(bad, expert)
    with pytest.raises(TraceFormatError) as raised:
        trace_stats(bad)
    assert (raised.value.source, raised.value.field, raised.value.row) == (str(bad), "experts", 0)
    with pytest.raises(TraceFormatError, match="bad.parquet"):
        compare_traces(toy, bad)


def test_prefill_coverage_of_a_batch_that_leaves_experts_out(tmp_path):
    """One 4-token prefill step routing every token to experts 0-2 of 6 (top-3) at both layers, then a decode
    step that touches all six: a uniform router reaches 6 * (1 - (1/2)^4) = 5.625 experts with 4 tokens, the
    step reaches 3, so the coverage is 3 / 5.625 at each layer; decode steps do not count."""
    rows = [(0, layer, 0, pos, 0, [0, 1, 2]) for layer in (0, 1) for pos in range(4)]
    rows += [(1, layer, 0, 4, 1, [3, 4, 5]) for layer in (0, 1)]
    cols = list(zip(*rows))
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.array(cols[4], dtype=np.int8), "experts": np.array(cols[5])}
    path = tmp_path / "narrow.parquet"
    write_trace(path, data, TraceMeta(model=TOY, source={"kind": "synthetic"}))
    s = trace_stats(path)
    assert s["prefill_coverage"] == pytest.approx(3 / 5.625)
    assert s["unique_experts_per_layer_step"]["prefill"] == 3


def test_prefill_coverage_is_none_without_a_prefill_step(tmp_path):
    rows = [(step, 0, 0, step, 1, [0, 1, 2]) for step in range(3)]
    cols = list(zip(*rows))
    data = {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
            "phase": np.array(cols[4], dtype=np.int8), "experts": np.array(cols[5])}
    path = tmp_path / "decode.parquet"
    write_trace(path, data, TraceMeta(model=TOY, source={"kind": "synthetic"}))
    assert trace_stats(path)["prefill_coverage"] is None


def test_uniform_union_is_the_expected_distinct_count():
    # 8 experts, top-2, 2 tokens: each expert missed with probability (3/4)^2, so 8 * 7/16 = 3.5 reached
    assert stats_mod.uniform_union(2, 8, 2) == pytest.approx(3.5)
    assert stats_mod.uniform_union(1, 128, 8) == pytest.approx(8)


def test_inspect_shows_the_shared_experts_and_dense_layers_a_capture_recorded(tmp_path, capsys):
    """A user checks a capture's model shape with inspect: it showed routed experts and top-k only, so a capture
    that lost DeepSeek's shared expert or its dense first layers looked the same as a right one."""
    import dataclasses
    shaped = dataclasses.replace(TOY, num_shared_experts=2, shared_intermediate_size=16, num_dense_layers=1,
                                 dense_intermediate_size=32)
    cols = list(zip(*ROWS))
    path = tmp_path / "shaped.parquet"
    write_trace(path, {"step": cols[0], "layer": cols[1], "request": cols[2], "position": cols[3],
                       "phase": np.array(cols[4], dtype=np.int8), "experts": np.array(cols[5])},
                TraceMeta(model=shaped, source={"kind": "synthetic"}))
    s = trace_stats(path)
    assert (s["num_shared_experts"], s["num_dense_layers"]) == (2, 1)
    assert (s["num_experts"], s["top_k"]) == (6, 3)
    assert main(["trace", "inspect", str(path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "shared experts / dense layers" in line)
    assert row.split("│")[2].strip() == "2 / 1"
