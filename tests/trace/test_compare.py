"""Distances between two traces: Jensen-Shannon of expert popularity, reuse and co-activation differences."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moesim.cli import main
from moesim.trace.stats import compare_traces, js_divergence
from tests.factories import tiny_model, write_tiny_trace


def test_js_divergence_hand_worked():
    assert js_divergence([1, 1], [1, 1]) == 0.0
    assert js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)  # disjoint: 1 bit
    # p = (1/2, 1/2), q = (1, 0): m = (3/4, 1/4); 0.5 KL(p||m) + 0.5 KL(q||m)
    kl_p = 0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25)
    kl_q = math.log2(1 / 0.75)
    assert js_divergence([2, 2], [7, 0]) == pytest.approx(0.5 * kl_p + 0.5 * kl_q)
    assert js_divergence([3, 1], [1, 3]) == pytest.approx(js_divergence([1, 3], [3, 1]))  # symmetric


def decode_steps(model, sets_by_layer: list[list[list[int]]]) -> list[dict]:
    """One request decoding one token per step; ``sets_by_layer[t][layer]`` is token t's routed set."""
    return [{"phase": "decode", "tokens": {0: (t, [[s] for s in by_layer])}}
            for t, by_layer in enumerate(sets_by_layer)]


@pytest.fixture
def model():
    return tiny_model(layers=2, experts=4, top_k=2)


def test_identical_traces_are_at_distance_zero(tmp_path, model):
    steps = decode_steps(model, [[[0, 1], [2, 3]], [[0, 1], [1, 2]], [[0, 2], [1, 2]]])
    a = write_tiny_trace(tmp_path / "a.parquet", model, steps)
    b = write_tiny_trace(tmp_path / "b.parquet", model, steps)
    d = compare_traces(a, b)["distances"]
    assert d["comparable"] and d["layers_compared"] == 2
    for key in ("popularity_js", "reuse_diff", "coactivation_tv", "coactivation_top4_diff"):
        assert d[key]["by_layer"] == [0.0, 0.0], key


def test_hand_worked_distances(tmp_path, model):
    # layer 0: A always {0, 1}; B always {2, 3}: disjoint popularity (JS 1), disjoint pairs (TV 1)
    # layer 1: A alternates {0, 1}, {2, 3} (reuse 0); B keeps {0, 1} (reuse 1)
    a = write_tiny_trace(tmp_path / "a.parquet", model,
                         decode_steps(model, [[[0, 1], [0, 1]], [[0, 1], [2, 3]], [[0, 1], [0, 1]]]))
    b = write_tiny_trace(tmp_path / "b.parquet", model,
                         decode_steps(model, [[[2, 3], [0, 1]], [[2, 3], [0, 1]], [[2, 3], [0, 1]]]))
    d = compare_traces(a, b)["distances"]
    assert d["popularity_js"]["by_layer"][0] == pytest.approx(1.0)
    # layer 1: A counts (2, 2, 1, 1) / 6, B counts (3, 3, 0, 0) / 6
    assert d["popularity_js"]["by_layer"][1] == pytest.approx(js_divergence([2, 2, 1, 1], [3, 3, 0, 0]))
    assert d["reuse_diff"]["by_layer"] == [pytest.approx(0.0), pytest.approx(1.0)]
    assert d["reuse_diff"]["mean_abs"] == pytest.approx(0.5)
    assert d["coactivation_tv"]["by_layer"][0] == pytest.approx(1.0)
    # layer 1: A pairs {0,1} x2, {2,3} x1 -> (2/3, 1/3); B {0,1} x3 -> (1, 0): TV = 1/3
    assert d["coactivation_tv"]["by_layer"][1] == pytest.approx(1 / 3)
    assert d["popularity_js"]["max"] == pytest.approx(1.0)


def test_different_expert_counts_are_not_compared(tmp_path, model):
    other = tiny_model(layers=2, experts=6, top_k=2)
    a = write_tiny_trace(tmp_path / "a.parquet", model, decode_steps(model, [[[0, 1], [0, 1]]]))
    b = write_tiny_trace(tmp_path / "b.parquet", other, decode_steps(other, [[[4, 5], [0, 1]]]))
    d = compare_traces(a, b)["distances"]
    assert d == {"comparable": False, "reason": "different expert counts (4 and 6): ids do not match",
                 "layers": {"a": 2, "b": 2}, "same_layer_count": True, "notes": []}


def test_cli_prints_and_writes_the_distances(tmp_path, model, capsys):
    a = write_tiny_trace(tmp_path / "a.parquet", model,
                         decode_steps(model, [[[0, 1], [0, 1]], [[0, 1], [2, 3]], [[0, 1], [0, 1]]]))
    b = write_tiny_trace(tmp_path / "b.parquet", model,
                         decode_steps(model, [[[2, 3], [0, 1]], [[2, 3], [0, 1]], [[2, 3], [0, 1]]]))
    assert main(["trace", "compare", str(a), str(b)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "popularity JS divergence" in out and "1.000 (layer 0)" in out and "co-activation TV" in out
    assert main(["trace", "compare", str(a), str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"a", "b", "distances"}
    assert data["distances"]["popularity_js"]["by_layer"][0] == pytest.approx(1.0)
    assert np.isfinite(data["distances"]["coactivation_tv"]["mean"])


def test_traces_of_different_logged_layers_say_they_share_none(tmp_path, capsys):
    """Two of an importer's per-layer logs (layers 1 and 2 of 3) have no layer to compare; one of them and
    a whole trace share one, which the title names."""
    from tests.factories import write_partial_trace
    one = write_partial_trace(tmp_path / "l1.parquet", [1])
    two = write_partial_trace(tmp_path / "l2.parquet", [2])
    whole = write_partial_trace(tmp_path / "all.parquet", [0, 1, 2])
    d = compare_traces(one, two)["distances"]
    assert not d["comparable"] and d["reason"] == "no MoE layer is logged in both traces (A logs layer 1, B logs layer 2)"
    d = compare_traces(one, whole)["distances"]
    assert d["comparable"] and d["layers_compared"] == 3 and d["layers_in_both"] == [1]
    assert main(["trace", "compare", str(one), str(whole)]) == 0
    # "logged in both: 1" read as one layer; it is layer 1 (and "0" as none)
    assert "distance of B from A (3 layers; logged in both: layer 1)" in capsys.readouterr().out
    two_of = write_partial_trace(tmp_path / "l12.parquet", [1, 2])
    assert main(["trace", "compare", str(two_of), str(whole)]) == 0
    assert "distance of B from A (3 layers; logged in both: layers 1, 2)" in capsys.readouterr().out


def test_different_moe_layer_counts_are_said_to_differ(tmp_path, model, capsys):
    """A of 2 MoE layers, B of 3: the distances set layers 0-1 against each other and B's layer 2 has no
    counterpart; compare said nothing of it (only the per-trace table's "layers" row differed)."""
    three = tiny_model(layers=3, experts=4, top_k=2)
    a = write_tiny_trace(tmp_path / "a.parquet", model, decode_steps(model, [[[0, 1], [0, 1]], [[0, 1], [2, 3]]]))
    b = write_tiny_trace(tmp_path / "b.parquet", three,
                         decode_steps(three, [[[0, 1], [0, 1], [1, 2]], [[0, 1], [0, 1], [1, 2]]]))
    said = ("different MoE layer counts: A has 2, B has 3; the distances set layers 0-1 of A against the same of B, "
            "index by index, and leave out B's layer 2")
    d = compare_traces(a, b)["distances"]
    assert d["comparable"] and d["layers_compared"] == 2
    assert (d["layers"], d["same_layer_count"], d["notes"]) == ({"a": 2, "b": 3}, False, [said])
    # layer 1: A (1, 1, 1, 1) / 4 against B (2, 2, 0, 0) / 4; reuse 0 in A, 1 in B
    assert d["popularity_js"]["by_layer"] == [0.0, pytest.approx(js_divergence([1, 1, 1, 1], [2, 2, 0, 0]))]
    assert d["reuse_diff"]["by_layer"] == [0.0, 1.0]
    assert main(["trace", "compare", str(b), str(a)]) == 0
    out = capsys.readouterr().out
    assert ("note: different MoE layer counts: A has 3, B has 2; the distances set layers 0-1 of A against the "
            "same of B, index by index, and leave out A's layer 2\n") in out
    assert main(["trace", "compare", str(a), str(b), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["distances"]["notes"] == [said]
    other = tiny_model(layers=3, experts=6, top_k=2)
    c = write_tiny_trace(tmp_path / "c.parquet", other, decode_steps(other, [[[0, 1], [0, 1], [4, 5]]]))
    d = compare_traces(a, c)["distances"]
    assert not d["comparable"] and d["notes"] == ["different MoE layer counts: A has 2, B has 3"]
    assert main(["trace", "compare", str(a), str(c)]) == 0
    assert "note: different MoE layer counts: A has 2, B has 3\ndistances: not computed" in capsys.readouterr().out
    d = compare_traces(a, a)["distances"]
    assert (d["same_layer_count"], d["notes"]) == (True, [])


def test_different_models_of_equal_expert_counts_are_said_to_differ(tmp_path, model, capsys):
    """FLAME-MoE-290M against OLMoE-1B-7B (64 experts each) gave a popularity JS divergence with no word that
    expert i of one model is not expert i of the other."""
    import dataclasses
    other = dataclasses.replace(model, name="other")
    steps = decode_steps(model, [[[0, 1], [2, 3]], [[0, 1], [1, 2]]])
    a = write_tiny_trace(tmp_path / "a.parquet", model, steps)
    b = write_tiny_trace(tmp_path / "b.parquet", other, steps)
    said = ("different models: A is tiny, B is other; the distances match expert ids index by index, which means "
            "something only if both name the same experts")
    d = compare_traces(a, b)["distances"]
    assert d["comparable"] and d["notes"] == [said] and d["popularity_js"]["by_layer"] == [0.0, 0.0]
    assert main(["trace", "compare", str(a), str(b)]) == 0
    assert f"note: {said}" in " ".join(capsys.readouterr().out.split())
    assert compare_traces(a, a)["distances"]["notes"] == []
