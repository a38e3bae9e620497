"""benchmarks/oracle_pruning.py: every oracle member's floors against its steps, on any trace it is given."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace

BENCHMARKS = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def oracle_pruning(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports replay_speed beside it
    import oracle_pruning
    yield oracle_pruning
    sys.modules.pop("oracle_pruning", None)


def test_a_member_that_cannot_run_on_the_trace_is_left_out_with_its_reason(oracle_pruning, tmp_path):
    """A trace without `scores` (the bundled Mixtral one, `--trace traces/mixtral-8x7b-humaneval.parquet`)
    cannot run `importance`: the oracle leaves it out with a note, and so does the benchmark (it stopped
    with a ConfigError traceback)."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    routing = random_routing(np.random.default_rng(0), model, requests=1, prompt=4, decode=4)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, routing)
    full, skipped = oracle_pruning.floors_against_steps(str(trace), tiny_profile(), {})
    assert "importance" in skipped and "'scores'" in skipped["importance"]
    assert "importance" not in full and {"oracle-pinned", "cpu-only"} <= set(full)
