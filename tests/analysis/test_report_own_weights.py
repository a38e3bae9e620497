"""The comparison table marks a system 'other weights' only when it really runs weights other than the
replay's: with the replay's settings setting the same dtypes, it gets its TPOT over the oracle's."""

from __future__ import annotations

import io

from rich.console import Console

from moesim.analysis.metrics import metrics
from moesim.analysis.report import render_comparison_table
from moesim.sim.run import simulate
from tests.factories import write_trace_and_profile


def _table(tmp_path, settings: dict[str, str]) -> str:
    trace, hw = write_trace_and_profile(tmp_path, seed=2)
    by_system = {}
    for name in ("mixtral-offloading", "oracle"):
        by_system[name] = metrics(simulate(trace, hw, name, settings))
        by_system[name]["inputs"] = {"settings": settings}
    out = io.StringIO()
    render_comparison_table(by_system, Console(file=out, width=400))
    return out.getvalue()


def test_a_system_on_the_replays_weights_is_compared_with_the_oracle(tmp_path):
    text = _table(tmp_path, {"memory.expert_dtype": "int8", "memory.non_expert_dtype": "int8"})
    row = next(line for line in text.splitlines() if "mixtral-offloading" in line and "│" in line)
    assert "other weights" not in row
    assert "runs its own weights" not in text


def test_a_system_on_its_own_weights_is_marked(tmp_path):
    text = _table(tmp_path, {"memory.expert_dtype": "int8"})
    assert "mixtral-offloading: runs its own weights by default (memory.non_expert_dtype=int4)" in text
