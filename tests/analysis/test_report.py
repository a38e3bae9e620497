"""The terminal tables' notes: each once, with the systems that gave it."""

from __future__ import annotations

import io

from rich.console import Console

from moesim.analysis.report import _print_notes, number_text, shared_notes

HOT = "static-hot: hot experts counted on the replayed trace itself"


def test_a_note_names_its_systems_unless_every_system_gave_it():
    runs = [("fiddler", {"notes": [HOT, "shared"], "cost_fallbacks": ["gpu expert"]}),
            ("cpu-only", {"notes": ["shared"]}),
            ("static-hot", {"notes": [HOT, "shared"], "cost_fallbacks": ["gpu expert", "attention"]}),
            ("fiddler", {"notes": [HOT, "shared"]})]  # serving: one system at several rates
    assert shared_notes(runs) == ["shared", f"{HOT} [fiddler, static-hot]",
                                  "roofline estimate used (no profile curve) for: attention; gpu expert"]
    assert shared_notes([("fiddler", {"notes": [HOT]})]) == [HOT]


def test_brackets_in_a_note_reach_the_terminal():
    """rich reads "[fiddler]" as markup and would drop it."""
    out = io.StringIO()
    _print_notes({"notes": [f"{HOT} [fiddler, static-hot]"]}, Console(file=out, width=200))
    assert out.getvalue() == f"note: {HOT} [fiddler, static-hot]\n"


def test_tables_name_each_systems_runtime(tmp_path):
    """Every expert resident in both, yet gpu-only-lru pays kernel launches that all-in-gpu (ideal) does not:
    the tables say which runtime each ran on."""
    import numpy as np

    from moesim.analysis.metrics import metrics
    from moesim.analysis.report import render_comparison_table, render_metrics
    from moesim.sim.run import simulate
    from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace

    model = tiny_model(layers=2, experts=4, top_k=2)
    trace = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                 random_routing(np.random.default_rng(0), model, requests=1, prompt=3, decode=3)))
    by_system = {name: metrics(simulate(trace, tiny_profile(), name))
                 for name in ("gpu-only-lru", "static-hot", "all-in-gpu")}
    assert {name: m["runtime"] for name, m in by_system.items()} == {
        "gpu-only-lru": "generic", "static-hot": "generic", "all-in-gpu": "ideal"}
    lru, ideal = by_system["gpu-only-lru"], by_system["all-in-gpu"]
    assert lru["gpu_hit_rate"] == ideal["gpu_hit_rate"] == 1.0
    # each GPU expert's kernels are launched (engine.kernels_per_expert x launch_us) on the generic runtime only
    assert lru["breakdown_ms"]["gpu_compute"] > ideal["breakdown_ms"]["gpu_compute"]
    out = io.StringIO()
    render_comparison_table(by_system, Console(file=out, width=400))
    text = out.getvalue()
    assert "runtimes (launch costs, CPU kernel efficiency; --set runtime=NAME): generic (gpu-only-lru, " \
           "static-hot); ideal (all-in-gpu)\n" in text
    assert "all-in-gpu: a reference, not a bound: it holds every expert whatever the GPU memory and runs on the " \
           "ideal runtime (no kernel launches, no host work;" in text
    out = io.StringIO()
    render_metrics(by_system["gpu-only-lru"], Console(file=out, width=200))
    assert [line for line in out.getvalue().splitlines() if "runtime" in line and "generic" in line]


def test_small_figures_keep_two_significant_digits():
    """A tiny model's TPOT is microseconds: 0.00 ms would hide it and the ratios computed from it."""
    assert [number_text(v) for v in (0.0023, 0.056, 0.56, 12.345, 0.0, 1234.5)] == \
        ["0.0023", "0.056", "0.56", "12.35", "0.00", "1,234.50"]
    assert number_text(0.0004, 3) == "0.00040" and number_text(float("nan")) == "-" and number_text(7) == "7"


def test_pcie_bytes_of_a_tiny_model_are_not_shown_as_nothing():
    """147,456 bytes of copies read '0.00 GiB' in the metrics table."""
    from moesim.analysis.report import bytes_text
    assert [bytes_text(n) for n in (0, 3 * 49_152, 5 * 2**20, 4_466.77 * 2**30, 1_000)] == \
        ["0.00 GiB", "0.14 MiB", "5.00 MiB", "4,466.77 GiB", "0.98 KiB"]
