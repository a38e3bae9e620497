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
    assert "ktransformers-ed: defer 'ktrans-deferral' never acted (0 deferred experts) (its note: 0 deferred " \
           "expert(s) per token: top-2 keeps at least 2 immediate)" in reason
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


def test_a_decode_only_mechanism_on_a_prefill_only_trace_says_so():
    """Expert Deferral acts in decoding only (001 Sec. 4.1): on a trace of prefill steps that is why it idled."""
    by_system = {"ktransformers": row(prefill_tokens=512, decode_tokens=0),
                 "ktransformers-ed": row(prefill_tokens=512, decode_tokens=0)}
    reason = explain_identical(["ktransformers", "ktransformers-ed"], by_system)
    assert "defer 'ktrans-deferral' never acted (0 deferred experts) because it acts in decode steps only, of " \
           "which the trace has none" in reason
    with_decode = {n: row(prefill_tokens=512, decode_tokens=16) for n in by_system}
    assert "decode steps only" not in explain_identical(list(with_decode), with_decode)


def test_systems_with_the_same_components_name_the_settings_they_differ_in():
    by_system = {"smoe": row(prefill_tokens=64, decode_tokens=0), "smoe-flex": row(prefill_tokens=64, decode_tokens=0)}
    reason = explain_identical(["smoe", "smoe-flex"], by_system)
    # smoe leaves both settings at the smoe-token component's defaults
    assert "they share every component and differ in settings (smoe: prefetch.flex_off_fraction=0.0, " \
           "prefetch.n=-1; smoe-flex: prefetch.flex_off_fraction=0.5, prefetch.n=3); prefetch 'smoe-token' " \
           "reads them and acts in decode steps only, of which the trace has none" in reason
    decoding = {n: row(prefill_tokens=64, decode_tokens=8) for n in by_system}
    reason = explain_identical(["smoe", "smoe-flex"], decoding)
    assert "differ in settings" in reason and "decode steps only" not in reason


def test_a_portfolio_is_explained_by_the_schedule_its_metrics_came_from():
    best = "tpot_ms_mean=oracle-prefetch; makespan_s=oracle-prefetch"
    by_system = {"all-in-gpu": row(gpu_share_of_activations=1.0, gpu_hit_rate=1.0),
                 "oracle": row(gpu_share_of_activations=1.0, gpu_hit_rate=1.0, portfolio_best=best)}
    logs = {"all-in-gpu": [(0, 0, 1, "gpu_hit", 0)], "oracle-prefetch": [(0, 0, 1, "gpu_hit", 0)]}
    reason = explain_identical(["all-in-gpu", "oracle"], by_system, logs.get)
    assert "every one of its metrics came from oracle-prefetch;" in reason
    assert "they made the same placement and transfer decisions on this trace (1 gpu_hit)" in reason
    # the portfolio's own nominal components ('cpu' assign) are not the schedule that made the row
    assert "assign 'gpu' (all-in-gpu) and 'best' (oracle (oracle-prefetch)) put every expert on the same device" \
        in reason
    assert "'cpu' (oracle)" not in reason
    mixed = dict(by_system, oracle=row(portfolio_best="tpot_ms_mean=oracle-prefetch; makespan_s=oracle-pinned"))
    reason = explain_identical(["all-in-gpu", "oracle"], mixed, logs.get)
    assert "came from tpot_ms_mean=oracle-prefetch; makespan_s=oracle-pinned" in reason and "assign" not in reason


def test_decisions_in_another_order_within_a_layer_are_the_same_decisions():
    by_system = {"dali": row(), "hybrimoe": row()}
    logs = {"dali": [(0, 0, 1, "cpu", 0), (0, 0, 2, "gpu_hit", 0)],
            "hybrimoe": [(0, 0, 2, "gpu_hit", 0), (0, 0, 1, "cpu", 0)]}
    reason = explain_identical(["dali", "hybrimoe"], by_system, logs.get)
    assert "same placement and transfer decisions on this trace (1 cpu, 1 gpu_hit), in another order within " \
           "some layers" in reason


def test_rows_with_every_expert_resident_say_so_once_and_quote_notes_as_context():
    """A tiny captured model fits whole in the slots: prefetch and substitution had no miss to act on, and a
    note on where they were calibrated is context, not the cause."""
    resident = dict(gpu_share_of_activations=1.0, gpu_hit_rate=1.0, evictions=0)
    by_system = {"llamacpp": row(**resident),
                 "buddymoe": row(**resident, notes=["buddy: buddy lists calibrated on the replayed trace itself"])}
    reason = explain_identical(["buddymoe", "llamacpp"], by_system)
    assert "in all of them every routed expert ran on the GPU from slots that held it from the first step on " \
           "(nothing loaded or evicted), so no cache, prefetch or substitution had a miss to act on" in reason
    assert "buddymoe: substitute 'buddy' never acted (0 substituted experts) (its note: buddy lists calibrated " \
           "on the replayed trace itself)" in reason
    assert "because" not in reason
    # a run that loaded or evicted experts had misses: no such claim
    for changed in ({"demand_loads": 3, "pcie_h2d_bytes": 300}, {"evictions": 2}):
        busy = {n: dict(m, **changed) for n, m in by_system.items()}
        reason = explain_identical(["buddymoe", "llamacpp"], busy)
        assert "no cache, prefetch or substitution" not in reason
        assert "in all of them every routed expert ran on the GPU;" in reason


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
