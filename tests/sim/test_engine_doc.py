"""The worked example of docs/engine.md: one decode step of cpu-only on the toy profile, by hand."""

from __future__ import annotations

import pytest

from moesim.sim.run import simulate
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


def test_worked_example(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=2)
    path = write_tiny_trace(tmp_path / "w.parquet", model, [{"phase": "decode", "tokens": {0: (5, [[[0, 1]]])}}])
    result = simulate(str(path), tiny_profile(), "cpu-only", {"hw.gpu.kernels_per_layer": "4"})
    us, ns = 1e-6, 1e-9
    embedding = 64 * 2 / 600e9              # 0.2133 ns
    launches = 4 * 5 * us                   # 20 us
    attention = 50 * us
    cpu = 20 * us + 2 * 1000 * us           # sync, then two experts one after another
    lm_head = 100 * 64 * 2 / 600e9          # 21.333 ns (bandwidth-bound)
    sampling = 3 * 4 * 100 / 600e9          # 2 ns
    total = embedding + launches + attention + cpu + lm_head + sampling
    assert total == pytest.approx(2090.02355 * us, abs=0.00001 * us)
    assert result.makespan_s == pytest.approx(total, rel=1e-12)
    b = result.counters.breakdown
    assert b["launch"] == pytest.approx(launches) and b["attention"] == pytest.approx(attention)
    assert b["sync"] == pytest.approx(20 * us) and b["cpu_other"] == pytest.approx(cpu - 20 * us)
    assert sum(b.values()) == pytest.approx(total, rel=1e-12)  # the categories add up to the step
    assert b["embedding"] == pytest.approx(0.21333 * ns, rel=1e-4)
    assert b["lm_head"] == pytest.approx(21.333 * ns, rel=1e-4) and b["sampling"] == pytest.approx(2 * ns)
