"""Expert Deferral on a trace that logged only some MoE layers: the step waits for its last layer's deferred
experts (docs/memory-and-bounds.md: nothing of a step runs after it ends), as it does at the model's last layer."""

from __future__ import annotations

import pytest

from moesim.sim.run import simulate
from tests.factories import tiny_profile, write_partial_trace


@pytest.mark.parametrize("layers", [[0], [0, 1]])
def test_deferred_experts_of_the_steps_last_logged_layer_end_within_the_step(tmp_path, layers):
    # layer 1 of 3 is not the model's last, so ktransformers-ed defers there (once its step's last layer ran past
    # the step's end, into the next step; the last step's deferred work fell outside the makespan)
    path = str(write_partial_trace(tmp_path / "partial.parquet", layers, num_layers=3))
    result = simulate(path, tiny_profile(), "ktransformers-ed", {"defer.deferred": "1"}, timeline=True)
    assert result.counters.deferred > 0
    ends = {record.step: record.end for record in result.steps}
    deferred = [span for span in result.timeline if span[0] == "cpu" and span[4] == "deferred"]
    assert deferred
    for span in deferred:
        assert span[3] <= ends[span[5]] + 1e-12, span
    assert result.counters.cpu_busy_s <= result.makespan_s
