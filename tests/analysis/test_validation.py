"""moesim validate --real: decision-log comparison, errors, ranking, and the CPU-only run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moesim.analysis.validation import (DecisionComparison, SwappedPair, SystemComparison, ValidationReport,
                                        compare_decisions, error_pct, rank, swapped_pairs, truncate_trace)
from moesim.cli import main
from moesim.trace.io import iter_steps, read_meta
from tests.factories import random_routing, tiny_model, write_tiny_trace

ROWS = [(0, 0, 3, "gpu_hit", 0), (0, 0, 1, "cpu", 0), (0, 1, 2, "evict", 1), (0, 1, 5, "gpu_load", 1)]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model = tiny_model(layers=3, experts=8, top_k=2, shared=True)
    path = tmp_path_factory.mktemp("validate") / "tiny.parquet"
    return str(write_tiny_trace(path, model, random_routing(np.random.default_rng(2), model, 2, 8, 4)))


def test_identical_logs():
    result = compare_decisions(ROWS, list(ROWS))
    assert result.identical and result.share == 1.0 and result.differences == []


def test_differing_logs_are_listed_by_step_and_layer():
    real = ROWS[:3] + [(0, 1, 5, "gpu_inflight", 1)]
    result = compare_decisions(real, ROWS)
    assert not result.identical
    assert result.share == 0.75
    assert result.differing_groups == 1
    assert result.differences == ["step 0 layer 1: simulator [evict 2, gpu_load 5] / real [evict 2, gpu_inflight 5]"]
    prefetch = compare_decisions([(3, 0, 7, "prefetch", 1)], [])
    assert prefetch.differences == ["step 3 layer 0: simulator [] / real [prefetch 7->L1]"]


def test_order_matters_for_identity_but_not_for_the_share():
    swapped = [ROWS[1], ROWS[0]] + ROWS[2:]
    result = compare_decisions(swapped, ROWS)
    assert not result.identical and result.share == 1.0


def test_missing_rows_lower_the_share():
    assert compare_decisions(ROWS[:2], ROWS).share == 0.5
    assert compare_decisions([], []).share == 1.0


def test_error_and_ranking():
    assert error_pct(11.0, 10.0) == pytest.approx(10.0)
    assert error_pct(9.0, 10.0) == pytest.approx(-10.0)
    assert np.isnan(error_pct(float("nan"), 10.0))
    assert rank({"b": 2.0, "a": 2.0, "c": 1.0, "d": float("nan")}) == ["c", "a", "b", "d"]


def test_swapped_pairs_say_how_far_apart_each_source_puts_them():
    real = {"a": 10.0, "b": 12.0, "c": 20.0, "d": float("nan")}
    sim = {"a": 10.03, "b": 10.0, "c": 9.0, "d": 1.0}  # a/b: a near tie when simulated; c: wrong by far
    pairs = swapped_pairs(real, sim)
    assert [(p.real_faster, p.sim_faster) for p in pairs] == [("a", "c"), ("b", "c"), ("a", "b")]
    assert pairs[0].real_gap_pct == pytest.approx(100.0) and pairs[0].sim_gap_pct == pytest.approx(103 / 9)
    assert pairs[2].real_gap_pct == pytest.approx(20.0) and pairs[2].sim_gap_pct == pytest.approx(0.3)
    assert swapped_pairs({"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0}) == []  # a measured tie orders nothing


def test_ranking_text_names_each_swap_with_its_gaps():
    same = DecisionComparison(True, 1.0, 0, 0)

    def report(sim_a: float) -> ValidationReport:
        systems = [SystemComparison("a", {"tpot_ms_mean": 40.0}, {"tpot_ms_mean": sim_a}, same),
                   SystemComparison("b", {"tpot_ms_mean": 45.0}, {"tpot_ms_mean": 42.0}, same)]
        return ValidationReport("t", "p", "cpu", "c", systems)

    assert report(41.0).ranking_text("tpot_ms_mean") == "same"
    assert report(42.126).ranking_text("tpot_ms_mean") == \
        "DIFFERENT, 1 of 1 pairs swapped: a vs b: a 12.5% faster measured, 0.3% slower simulated"
    assert report(42.126).swapped_pairs("tpot_ms_mean") == [SwappedPair("a", "b", 12.5, pytest.approx(0.3))]


def test_ranking_text_names_a_tie_not_a_missing_system():
    """A tie in one source orders the two by name in its ranking: named as the tie it is (it said 'a system
    is missing from one of them' with every system there, as `moesim validate --real --device cpu` printed
    for gpu-only-lru and static-hot, simulated alike at 30.666 ms)."""
    same = DecisionComparison(True, 1.0, 0, 0)
    systems = [SystemComparison("cpu-only", {"tpot_ms_mean": 49.9}, {"tpot_ms_mean": 28.6}, same),
               SystemComparison("gpu-only-lru", {"tpot_ms_mean": 55.8}, {"tpot_ms_mean": 30.666}, same),
               SystemComparison("static-hot", {"tpot_ms_mean": 54.2}, {"tpot_ms_mean": 30.666}, same)]
    report = ValidationReport("t", "p", "cpu", "c", systems)
    assert report.ranking_text("tpot_ms_mean") == ("DIFFERENT, no pair swapped but gpu-only-lru and static-hot tie "
                                                   "simulated, static-hot 3.0% faster measured")
    keys = ("ttft_ms", "tpot_ms_p50", "tpot_ms_p99", "decode_tokens_per_s", "gpu_hit_rate", "demand_loads",
            "prefetches", "evictions", "streamed_experts", "makespan_s", "cpu_util", "gpu_util", "pcie_util",
            "breakdown_ms", "notes")
    for c in systems:
        for side in (c.real, c.sim):
            side.update({k: 0.0 for k in keys})
    ranking = report.to_dict()["ranking"]  # what the GPU validation report prints when no pair is swapped
    assert not ranking["same_tpot"] and ranking["text_tpot"] == report.ranking_text("tpot_ms_mean")
    # the names' order decides nothing: the same tie with the measured order as the names' is no ranking either
    systems[1].real["tpot_ms_mean"], systems[2].real["tpot_ms_mean"] = 54.2, 55.8
    assert not report.same_ranking("tpot_ms_mean") and "tie simulated" in report.ranking_text("tpot_ms_mean")
    systems[1].real["tpot_ms_mean"] = 55.8  # tied in both: the same ranking
    assert report.same_ranking("tpot_ms_mean") and report.ranking_text("tpot_ms_mean") == "same"
    systems[2] = SystemComparison("static-hot", {"tpot_ms_mean": 54.2}, {"tpot_ms_mean": float("nan")}, same)
    assert ValidationReport("t", "p", "cpu", "c", systems).ranking_text("tpot_ms_mean") == \
        "DIFFERENT (static-hot without a value in one of them)"


def test_the_host_time_is_reported_per_system_with_its_share_of_tpot():
    """The real run's host time between a layer's attention and its first expert: in the JSON per system, times
    the MoE layers of a decode step and over the measured TPOT, and in the markdown with the sentence that the
    simulator does not charge it. A system without a measured host time (a report of other results) shows none."""
    from moesim.analysis.validation import render_markdown
    same = compare_decisions(ROWS, ROWS)
    host = {"moe_layers_per_step": 26, "layers_timed": 26 * 40, "host_us_per_layer": 300.0,
            "plan_us_per_layer": 80.0, "decode_layers_timed": 26 * 32, "decode_host_us_per_layer": 250.0,
            "decode_plan_us_per_layer": 60.0}
    keys = ("ttft_ms", "tpot_ms_p50", "tpot_ms_p99", "decode_tokens_per_s", "gpu_hit_rate", "demand_loads",
            "prefetches", "evictions", "streamed_experts", "makespan_s", "cpu_util", "gpu_util", "pcie_util")

    def figures(tpot):
        return {**dict.fromkeys(keys, 1.0), "tpot_ms_mean": tpot, "breakdown_ms": {}, "notes": []}
    no_decode = {**host, "decode_host_us_per_layer": None, "decode_plan_us_per_layer": None}
    systems = [SystemComparison("smoe", figures(65.0), figures(60.0), same, host),
               SystemComparison("cpu-only", figures(float("nan")), figures(60.0), same, no_decode),
               SystemComparison("static-hot", figures(50.0), figures(50.0), same)]
    assert systems[0].host_ms_per_decode_step == pytest.approx(6.5)
    assert systems[0].host_share_of_tpot == pytest.approx(0.1)
    assert systems[1].host_ms_per_decode_step is None and systems[1].host_share_of_tpot is None
    assert systems[2].host_share_of_tpot is None
    report = ValidationReport("t", "p", "cpu", "c", systems)
    entries = json.loads(json.dumps(report.to_dict()))["systems"]
    assert entries["smoe"]["host_time"] == {**host, "decode_host_ms_per_step": pytest.approx(6.5),
                                            "decode_host_share_of_tpot": pytest.approx(0.1)}
    assert entries["static-hot"]["host_time"] is None
    markdown = render_markdown(report, "v.png")
    assert "| system | host µs per MoE layer | plan() µs per MoE layer | host ms per decode step (x 26 MoE layers) " \
           "| share of measured TPOT |" in markdown
    assert "| smoe | 250 | 60 | 6.500 | 10.0% |" in markdown
    assert "| cpu-only | - | - | - | - |" in markdown
    assert "| static-hot | 250" not in markdown and "The simulator does not charge this time" in markdown


def test_truncated_trace_keeps_the_first_layers(trace, tmp_path):
    out = truncate_trace(trace, 2, tmp_path / "two.parquet")
    assert read_meta(out).model.num_layers == 2
    full = list(iter_steps(trace))
    short = list(iter_steps(out))
    assert len(short) == len(full)
    for a, b in zip(full, short):
        assert sorted({layer for layer, _ in b.layers()}) == [0, 1]
        assert np.array_equal(b.experts, a.experts[a.layer < 2])


def test_a_trace_whose_name_is_not_utf8_is_truncated(trace, tmp_path):
    """pyarrow cannot encode such a name (bytes a shell passes through): it ended in a UnicodeEncodeError."""
    import os
    import shutil
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/t\xff.parquet")
    shutil.copy(trace, odd)
    out = truncate_trace(odd, 2, tmp_path / "two.parquet")
    assert [np.array_equal(b.experts, a.experts[a.layer < 2]) for a, b in zip(iter_steps(trace), iter_steps(out))] \
        == [True] * len(list(iter_steps(trace)))


def test_truncating_to_too_many_layers_is_one_line(trace, tmp_path, capsys):
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only",
                 "--layers", "7", "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert code == 2 and "--layers 7 outside 1..3" in err and len(err.strip().splitlines()) == 1


def test_experts_too_big_for_host_memory_are_refused_before_the_profile_is_measured(trace, tmp_path, capsys,
                                                                                   monkeypatch):
    """Measuring a profile takes minutes; the memory check that follows it can be made first."""
    pytest.importorskip("torch")
    import backends.weights
    monkeypatch.setattr(backends.weights, "host_bytes_available", lambda: 1000)
    out = tmp_path / "v"
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "routed experts need" in err and "(moesim validate --layers N)" in err
    assert not (out / "profile.yaml").exists()


@pytest.mark.parametrize("args, words", [
    (["--systems", "all"], "field '--systems': validate runs the systems it is given by name, not 'all'"),
    (["--systems", "cpu-only,oracle"], "field '--systems': 'oracle' is a bound over several schedules"),
    (["--systems", "nope"], "field '--systems': unknown system 'nope'"),
    (["--systems", "cpu-only", "--set", "cache.alpha=1"], "cache 'none' of system 'cpu-only' has no parameter 'cache.alpha'"),
    (["--systems", "cpu-only", "--set", "engine.staging_slots=0"], "at least one staging buffer is needed"),
])
def test_wrong_systems_and_settings_fail_before_the_profile_is_measured(trace, tmp_path, capsys, args, words):
    out = tmp_path / "v"
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1
    assert not (out / "profile.yaml").exists()


def test_cutting_a_trace_of_later_layers_to_none_of_them_is_refused_naming_its_layers(tmp_path, capsys):
    """An importer's per-layer log (layer 2 of 3 here) holds nothing in the first layer: no empty trace is written."""
    from tests.factories import write_partial_trace
    trace = str(write_partial_trace(tmp_path / "l2.parquet", [2], num_layers=3))
    out = tmp_path / "v"
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only",
                 "--layers", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "the trace logs MoE layers 2, none of the first 1 (fix: use --layers 3 or more" in err
    assert not (out / "trace-1-layers.parquet").exists()


def test_validate_needs_real_and_known_systems(trace, tmp_path, capsys):
    assert main(["validate", "--trace", trace, "--systems", "cpu-only", "--out", str(tmp_path)]) == 2
    assert "pass --real" in capsys.readouterr().err
    assert main(["validate", "--real", "--trace", trace, "--systems", "cpu-only,nope", "--out", str(tmp_path)]) == 2
    assert "unknown system 'nope'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cpu_only_validation_end_to_end(trace, tmp_path, capsys):
    """Acceptance: timing-independent systems log identical decisions in the real run and the simulator."""
    pytest.importorskip("torch")
    out = tmp_path / "report"
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems",
                 "cpu-only,gpu-only-lru,static-hot", "--set", "cache.slots_per_layer=3", "--threads", "1",
                 "--quick-profile", "--out", str(out), "--json"])
    assert code == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "validation.json").read_text())
    assert printed == written
    assert set(written["systems"]) == {"cpu-only", "gpu-only-lru", "static-hot"}
    for name, entry in written["systems"].items():
        assert entry["decisions"]["identical"], (name, entry["decisions"]["differences"])
        assert entry["decisions"]["share"] == 1.0
        assert entry["decisions"]["real_rows"] == entry["decisions"]["sim_rows"] > 0
        for source in ("real", "sim"):
            assert entry[source]["ttft_ms"] > 0 and entry[source]["tpot_ms_mean"] > 0
        expected = (entry["sim"]["tpot_ms_mean"] - entry["real"]["tpot_ms_mean"]) / entry["real"]["tpot_ms_mean"]
        assert entry["tpot_error_pct"] == pytest.approx(100 * expected)
    assert written["settings"]["engine.kernels_per_expert"] == "0"
    assert sorted(written["ranking"]["tpot_real"]) == sorted(written["ranking"]["tpot_sim"])
    for name, entry in written["systems"].items():  # the host time the real run measured (the simulator's: none)
        host = entry["host_time"]
        assert host["moe_layers_per_step"] == 3 and host["decode_layers_timed"] == 4 * 3, name
        assert 0 < host["decode_plan_us_per_layer"] <= host["decode_host_us_per_layer"], name
        assert host["decode_host_ms_per_step"] == pytest.approx(host["decode_host_us_per_layer"] * 3 / 1e3)
        assert host["decode_host_share_of_tpot"] == pytest.approx(host["decode_host_ms_per_step"]
                                                                  / entry["real"]["tpot_ms_mean"])
    markdown = (out / "validation.md").read_text()
    assert "| gpu-only-lru |" in markdown and "100.0% (all)" in markdown and "![real vs simulated]" in markdown
    assert "## Host time on the critical path (measured only)" in markdown
    assert "The simulator does not charge this time" in markdown
    assert (out / "validation.png").stat().st_size > 10_000
    assert (out / "profile.yaml").exists()
    for name in written["systems"]:
        for part in ("real-decisions", "sim-decisions", "real-timeline", "sim-timeline"):
            assert (out / name / f"{part}.parquet").exists()


def test_a_gpu_profile_on_the_cpu_stand_in_is_warned_of_in_one_line(trace, tmp_path, capsys, monkeypatch):
    """`--device cpu --hw hwprofiles/rtx4090.yaml` ran silently: the simulated side timed an RTX 4090, the
    measured side the CPU stand-in. One warning line says so and what to pass; the run goes on (exit 0). A
    profile of the stand-in (its gpu.name, as `moesim profile --device cpu` writes it) gets none."""
    pytest.importorskip("torch")
    import yaml
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "3600")  # stderr holds the warning alone, however slow the run
    root = Path(__file__).resolve().parents[2]
    gpu = str(root / "hwprofiles" / "rtx4090.yaml")
    args = ["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only", "--threads", "1"]
    assert main([*args, "--hw", gpu, "--out", str(tmp_path / "gpu"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["systems"]["cpu-only"]["decisions"]["identical"]
    assert captured.err == (f"moesim: warning: --device cpu with {gpu}, a profile of NVIDIA GeForce RTX 4090: the "
                            "simulated side uses that GPU profile while the measured side runs on the CPU stand-in, "
                            "so the errors compare different hardware (leave out --profile to measure the stand-in "
                            f"into {tmp_path / 'gpu' / 'profile.yaml'}, with --quick-profile for a quick one, or pass "
                            "a profile from `moesim profile --device cpu`)\n")
    from backends.measurements import STAND_IN_GPU_NAME
    stand_in = yaml.safe_load(Path(gpu).read_text())
    stand_in["gpu"]["name"] = STAND_IN_GPU_NAME
    (tmp_path / "stand-in.yaml").write_text(yaml.safe_dump(stand_in))
    assert main([*args, "--profile", str(tmp_path / "stand-in.yaml"), "--out", str(tmp_path / "cpu"), "--json"]) == 0
    assert "a profile of" not in capsys.readouterr().err


def test_a_profile_without_the_models_curves_is_warned_of_in_one_line(trace, tmp_path, capsys, monkeypatch):
    """A stand-in profile measured for another model shape: the simulated side estimated the tiny model's
    expert and attention times from the roofline, and validate said nothing. A profile measured for this
    trace's model (the one validate measures itself) gets no warning."""
    pytest.importorskip("torch")
    import yaml
    from backends.measurements import STAND_IN_GPU_NAME
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "3600")  # stderr holds the warnings alone
    root = Path(__file__).resolve().parents[2]
    other_shapes = yaml.safe_load((root / "hwprofiles" / "rtx4090.yaml").read_text())
    other_shapes["gpu"]["name"] = STAND_IN_GPU_NAME
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other_shapes))
    args = ["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only", "--threads", "1"]
    assert main([*args, "--profile", str(tmp_path / "other.yaml"), "--out", str(tmp_path / "a"), "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: warning: {tmp_path / 'other.yaml'} has no curve for cpu expert FFN ")
    assert "; gpu attention tiny" in err and "from the roofline" in err and err.count("\n") == 1, err
    assert main([*args, "--quick-profile", "--out", str(tmp_path / "b"), "--json"]) == 0
    assert capsys.readouterr().err == ""
    measured = str(tmp_path / "b" / "profile.yaml")
    assert main([*args, "--profile", measured, "--out", str(tmp_path / "c"), "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_a_report_interrupted_while_written_leaves_the_earlier_one_whole(trace, tmp_path, monkeypatch):
    """Ctrl-C while the plot was drawn had already replaced the per-system logs beside the earlier
    validation.json; now every file of the report lands when the command ends, or none does."""
    pytest.importorskip("torch")
    import moesim.analysis.validation as validation
    out = tmp_path / "report"
    (out / "cpu-only").mkdir(parents=True)
    earlier = {out / "validation.json": "earlier report\n", out / "cpu-only" / "real-decisions.parquet": "earlier log\n"}
    for path, text in earlier.items():
        path.write_text(text)

    def interrupted(report, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(validation, "plot_validation", interrupted)
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only",
                 "--threads", "1", "--quick-profile", "--out", str(out)])
    assert code == 130
    assert {path: path.read_text() for path in earlier} == earlier
    assert sorted(p.name for p in (out / "cpu-only").iterdir()) == ["real-decisions.parquet"]
    assert not [p for p in out.rglob(".*")]  # no staged file left behind


def test_the_console_table_shows_the_measured_host_time_per_decode_step(trace, tmp_path, capsys, monkeypatch):
    """`moesim validate --real` without --json printed TTFT, TPOT and decisions only: the host time between each
    MoE layer's attention and its first expert, measured by the real run and in validation.json, was not on
    screen. It is a column (ms per decode step, share of the measured TPOT) with one line saying what it is."""
    pytest.importorskip("torch")
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "3600")
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps a narrow table's cells
    out = tmp_path / "v"
    args = ["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only", "--threads", "1",
            "--quick-profile", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    entry = json.loads((out / "validation.json").read_text())["systems"]["cpu-only"]["host_time"]
    step, share = entry["decode_host_ms_per_step"], entry["decode_host_share_of_tpot"]
    assert "host ms/step (of TPOT)" in printed
    assert f"{step:.2f} ({share:.0%})" in printed
    assert "the simulator does not charge it" in printed
