"""benchmarks/synth_fidelity.py: its rank statistics by hand, and its JSON on tiny-model traces."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import profile_dict, random_routing, tiny_model, write_tiny_trace

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ["cpu-only", "gpu-only-lru", "static-hot"]


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("synth_fidelity", REPO / "benchmarks" / "synth_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["synth_fidelity"] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("synth_fidelity", None)


def test_rank_correlations_by_hand(fidelity):
    # one adjacent swap of four: Spearman 1 - 6 * (1 + 1) / (4 * 15) = 0.8; Kendall (5 - 1) / 6
    assert fidelity.spearman_numpy([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(0.8)
    assert fidelity.kendall_numpy([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(4 / 6)
    assert fidelity.spearman_numpy([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ties take the mean rank; tau-b leaves the tied pair out: (2 - 0) / sqrt(3 * 2)
    assert fidelity.average_ranks([3.0, 1.0, 3.0]).tolist() == [2.5, 1.0, 2.5]
    assert fidelity.kendall_numpy([1, 2, 3], [1, 2, 2]) == pytest.approx(2 / np.sqrt(6))
    got = fidelity.rank_correlations([1, 2, 3, 4], [10, 20, 40, 30])
    assert got == pytest.approx({"spearman": 0.8, "kendall": 4 / 6})


def test_flipped_pairs_carry_both_gaps(fidelity):
    flips = fidelity.order_flips(["a", "b", "c", "d"], [100, 200, 300, 400], [100, 200, 400, 300])
    assert flips == [{"first": "c", "second": "d", "real_gap": pytest.approx(1 / 3),
                      "other_gap": pytest.approx(-1 / 3)}]
    # a tie on either side is no flip
    assert fidelity.order_flips(["a", "b"], [1.0, 1.0], [2.0, 1.0]) == []
    assert fidelity.relative_error(90.0, 100.0) == pytest.approx(-0.1)
    assert fidelity.relative_error(1.0, 0.0) is None


def test_close_pairs_and_the_routing_sensitive_subset(fidelity):
    real = {"a": {"tpot_ms_mean": 100.0}, "b": {"tpot_ms_mean": 105.0}, "c": {"tpot_ms_mean": 300.0}}
    other = {"a": {"tpot_ms_mean": 110.0}, "b": {"tpot_ms_mean": 100.0}, "c": {"tpot_ms_mean": 290.0}}
    for table in (real, other):
        for row in table.values():
            row.update(ttft_ms=None, gpu_hit_rate=0.5, pcie_gib=0.0)
    got = fidelity.compare("tpot_ms_mean", real, other, sensitive=["a", "b"])
    # a and b lie 5% apart on V (one close pair) and swap; c is 3x away and stays last
    assert got["close_pairs"] == 1 and got["close_pairs_flipped"] == 1
    assert [(f["first"], f["second"]) for f in got["flips"]] == [("a", "b")]
    assert got["spearman"] == pytest.approx(0.5) and got["sensitive"]["spearman"] == pytest.approx(-1.0)
    assert got["median_abs_error"] == pytest.approx(5 / 105)  # of 10%, 4.8% (5 / 105) and 3.3%
    # a system whose latency no synthetic draw moves is insensitive to routing
    draws = [{"x": {"tpot_ms_mean": 50.0}, "y": {"tpot_ms_mean": 80.0}},
             {"x": {"tpot_ms_mean": 50.0}, "y": {"tpot_ms_mean": 90.0}}]
    assert fidelity.routing_sensitive("tpot_ms_mean", ["x", "y"], draws) == ["y"]


def _traces(folder: Path) -> tuple[Path, Path, list[str]]:
    """C: a synthetic tiny-model trace (weights, two requests); V: random routing without weights; two
    profiles whose PCIe links differ."""
    model = tiny_model(layers=2, experts=6, top_k=2)
    config = SynthConfig.from_settings(model=model, requests=2, prompt_len=4, decode_len=10, seed=5, scores=False,
                                       settings={"predictors": False})
    calibration = synthesize(config, folder / "c.parquet")
    validation = write_tiny_trace(folder / "v.parquet", model, random_routing(np.random.default_rng(1), model,
                                                                               requests=1, prompt=3, decode=12))
    profiles = []
    for name, gbps in (("fast", 1.0), ("slow", 0.01)):
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(profile_dict(pcie_gbps=gbps)))
        profiles.append(str(path))
    return calibration, validation, profiles


def test_script_on_tiny_traces(fidelity, tmp_path):
    calibration, validation, profiles = _traces(tmp_path)
    out, md = tmp_path / "fid.json", tmp_path / "fid.md"
    argv = ["--calibration", str(calibration), "--validation", str(validation), "--systems", ",".join(SYSTEMS),
            "--seeds", "0,1", "--out", str(out), "--markdown", str(md)]
    for hw in profiles:
        argv += ["--hw", hw]
    fidelity.main(argv)
    report = json.loads(out.read_text())
    assert report["rank_method"] in ("scipy", "numpy") and report["seeds"] == [0, 1]
    (pair,) = report["pairs"]
    # V's workload shape: one request, 3 prompt tokens, 12 decoded, batch 1; no optional columns
    assert pair["shape"] | {"model": "tiny"} == {"model": "tiny", "prompt_lens": [3], "decode_lens": [12],
                                                 "batch": 1, "scores": False, "predictors": False}
    assert set(pair["trace_stats"]) == {"validation", "calibration", "fitted", "default"}
    assert pair["trace_stats"]["fitted"]["tokens"] == 15  # V's lengths, not C's 2 x 14
    assert set(pair["profiles"]) == {"fast", "slow"}
    for profile in pair["profiles"].values():
        assert profile["metric"] == "tpot_ms_mean" and profile["settings"] == {}
        assert list(profile["systems"]) == SYSTEMS
        for kind in ("fitted", "default", "calibration"):
            compared = profile["compare"][kind]
            real = [profile["systems"][s]["validation"]["tpot_ms_mean"] for s in SYSTEMS]
            other = [profile["systems"][s][kind]["tpot_ms_mean"] for s in SYSTEMS]
            # the reported figures are those of the tables they come from
            assert compared["spearman"] == pytest.approx(fidelity.spearman_numpy(real, other))
            assert compared["kendall"] == pytest.approx(fidelity.kendall_numpy(real, other))
            for system, r, o in zip(SYSTEMS, real, other):
                assert compared["relative_error"][system]["tpot_ms_mean"] == pytest.approx((o - r) / r)
            assert len(compared.get("per_seed", [None, None])) == 2
        assert "cpu-only" not in profile["routing_sensitive"]  # its TPOT is the same on every draw
        # cpu-only never copies an expert, on any trace
        assert all(profile["systems"]["cpu-only"][k]["pcie_gib"] == 0 for k in ("validation", "fitted"))
    text = md.read_text()
    assert "v.parquet (validation) against c.parquet (calibration)" in text and "`gpu-only-lru`" in text


def test_the_control_of_a_trace_against_itself_agrees_exactly(fidelity, tmp_path):
    """With V as its own calibration trace the control replays V again: no error, Spearman 1, no flip."""
    _, validation, profiles = _traces(tmp_path)
    report = fidelity.main(["--calibration", str(validation), "--validation", str(validation), "--systems",
                            ",".join(SYSTEMS), "--seeds", "0", "--hw", profiles[1]])
    control = report["pairs"][0]["profiles"]["slow"]["compare"]["calibration"]
    assert control["median_abs_error"] == 0 and control["flips"] == []
    assert control["spearman"] == pytest.approx(1.0) and control["kendall"] == pytest.approx(1.0)
