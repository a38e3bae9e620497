"""The steps every portfolio member replays and their decode windows (moesim.sim.shape), by hand."""

from __future__ import annotations

import moesim.sim.shape as shape_module
from moesim.sim.shape import TraceShape, Windows, decode_runs
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, write_tiny_trace


def test_windows_count_distinct_experts_per_layer(tmp_path):
    """A prefill then four decode steps of one token, two layers, four experts (top 1): layer 0 routes
    expert 0, 1, 0, 2 in the decode steps, layer 1 always 3. Windows of two decode steps: {0, 1} and {0, 2}
    in layer 0, {3} in layer 1; of four: {0, 1, 2} and {3}."""
    model = tiny_model(layers=2, experts=4, top_k=1)
    layer0 = [0, 1, 0, 2]
    steps = [{"phase": "prefill", "tokens": {0: (0, [[[1], [2]], [[0], [3]]])}}]
    steps += [{"phase": "decode", "tokens": {0: (2 + i, [[[e]], [[3]]])}} for i, e in enumerate(layer0)]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    shape = TraceShape.of(str(path), model.num_experts)
    assert decode_runs(shape.phases) == [(1, 5)]
    windows = Windows.of(shape)
    starts, ends, distinct = windows.by_length[2]
    assert starts.tolist() == [1, 3] and ends.tolist() == [3, 5]
    assert distinct.tolist() == [[2, 1], [2, 1]]
    starts, ends, distinct = windows.by_length[4]
    assert starts.tolist() == [1] and distinct.tolist() == [[3, 1]]


def test_window_floors_are_left_out_past_their_memory_limit(tmp_path, monkeypatch):
    """Past ``WINDOW_USES_MAX`` routed decode experts the trace keeps no pairs and the windows are empty."""
    model = tiny_model(layers=2, experts=6, top_k=2)
    path = tmp_path / "t.parquet"
    synthesize(SynthConfig.from_settings(model=model, requests=1, prompt_len=2, decode_len=6, seed=3), path)
    assert Windows.of(TraceShape.of(str(path), 6)).by_length
    monkeypatch.setattr(shape_module, "WINDOW_USES_MAX", 10)
    shape = TraceShape.of(str(path), 6)
    assert shape.decode_pairs is None and not Windows.of(shape).by_length
