"""Identical rows of `replay --system all` come with a reason computed from the runs (moesim/analysis/identical.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moesim.analysis.identical import ROW_METRICS, explain_identical, identical_groups, identical_lines
from moesim.cli import main

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = str(ROOT / "traces" / "mixtral-8x7b-humaneval.parquet")


def row(**changes):
    m = {name: 1.0 for name in ROW_METRICS}
    m.update({"demand_loads": 0, "streamed_experts": 0, "prefetches": 0, "pcie_h2d_bytes": 0,
              "gpu_share_of_activations": 0.0, "expert_slots": 0, "deferred_experts": 0, "substituted_experts": 0,
              "breakdown_ms": {"attention": 5.0, "cpu_other": 90.0, "sync": 1.0}, "notes": []})
    m.update(changes)
    return m


def test_groups_are_rows_whose_metrics_agree():
    by_system = {"cpu-only": row(), "ktransformers": row(expert_slots=60), "gpu-only-lru": row(tpot_ms_mean=2.0),
                 "dali": row(tpot_ms_mean=2.0 + 1e-12), "smoe": row(tpot_ms_mean=2.1)}
    # digits beyond the ninth are noise of the float sums, not a different schedule
    assert identical_groups(by_system) == [["cpu-only", "ktransformers"], ["gpu-only-lru", "dali"]]


def test_reason_names_the_idle_mechanism_and_its_own_note():
    note = "ktrans-deferral: 0 deferred expert(s) per token: top-2 keeps at least 2 immediate"
    by_system = {"ktransformers": row(expert_slots=60), "ktransformers-ed": row(expert_slots=60, notes=[note])}
    logs = {"ktransformers": [(0, 0, 1, "cpu", 0), (0, 0, 2, "cpu", 0)],
            "ktransformers-ed": [(0, 0, 1, "cpu", 0), (0, 0, 2, "cpu", 0)]}
    reason = explain_identical(["ktransformers", "ktransformers-ed"], by_system, logs.get)
    assert "same placement and transfer decisions on this trace (2 cpu)" in reason
    assert "every routed expert ran on the CPU" in reason
    assert "ktransformers-ed: defer 'ktrans-deferral' never acted (0 deferred experts) because 0 deferred " \
           "expert(s) per token: top-2 keeps at least 2 immediate" in reason
    assert "time breakdowns agree in every category (attention 5.0 ms, cpu_other 90.0 ms, sync 1.0 ms)" in reason


def test_equal_breakdowns_name_the_runtimes():
    same = {"cpu-only": row(runtime="generic"), "static-hot": row(runtime="generic")}
    assert explain_identical(["cpu-only", "static-hot"], same).endswith("they run on the same runtime (generic).")
    differ = {"cpu-only": row(runtime="generic"), "ktransformers": row(runtime="ktransformers"),
              "llamacpp-experts": row(runtime="llamacpp")}
    assert explain_identical(list(differ), differ).endswith(
        "their runtimes, generic (cpu-only) and ktransformers (ktransformers) and llamacpp (llamacpp-experts), "
        "come out equal on this profile.")


def test_reason_says_where_decision_logs_differ():
    by_system = {"cpu-only": row(), "ktransformers": row(expert_slots=60)}
    logs = {"cpu-only": [(0, 0, 1, "cpu", 0), (0, 1, 3, "cpu", 1)],
            "ktransformers": [(0, 0, 1, "cpu", 0), (0, 1, 4, "cpu", 1)]}
    reason = explain_identical(["cpu-only", "ktransformers"], by_system, logs.get)
    assert "decision logs differ" in reason and "first difference at entry 1: step 0 layer 1 expert 3 cpu vs " \
                                                "step 0 layer 1 expert 4 cpu" in reason
    assert "placed experts differently to the same effect" in reason
    assert "expert slots differ (cpu-only 0, ktransformers 60)" in reason
    # different breakdowns: no claim that the costs agree
    by_system["ktransformers"]["breakdown_ms"] = {"attention": 5.0, "cpu_other": 89.0, "sync": 2.0}
    assert "breakdowns agree" not in explain_identical(["cpu-only", "ktransformers"], by_system, logs.get)


def test_no_line_without_identical_rows():
    assert identical_lines({"cpu-only": row(), "dali": row(ttft_ms=3.0)}) == []


@pytest.mark.slow
def test_bundled_trace_has_no_identical_rows_without_a_reason(tmp_path, capsys):
    """Issue acceptance: `replay <bundled trace> --hw rtx4090 --system all` explains every identical pair."""
    out_json = tmp_path / "all.json"
    assert main(["replay", BUNDLED, "--hw", "rtx4090", "--system", "all", "--json", str(out_json)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    by_system = json.loads(out_json.read_text())
    for group in identical_groups(by_system):
        line = f"identical rows {', '.join(group)}: "
        assert line in out, group
        reason = out.split(line, 1)[1]
        assert "decision" in reason.split(".")[0] or "best of its schedules" in reason
    assert out.count("identical rows ") == len(identical_groups(by_system))
