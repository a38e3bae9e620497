"""Expert Deferral (001 Sec. 4.1) on a trace that logs some of the model's MoE layers only.

001 defers at every MoE layer but the model's last. A step of such a trace ends at a layer the real model follows
with others, so ``ktrans-deferral`` defers there too (and a trace with ``weights`` counts their mass); the layers
those experts would overlap are not replayed, so the step waits for them (the engine since 0f4259f) and the
deferral gains no time there, which a note says. Hand-worked on the tiny profile (tests/factories.py): attention
50 us, sync 20 us, a CPU expert 1000 us, embedding, LM head and sampling 0.0235467 us together; every token routed
to experts 0 and 1, one deferred (slot 1: expert 1).
"""

from __future__ import annotations

import pytest

from moesim.sim.run import simulate
from tests.factories import tiny_profile, write_partial_trace

US = 1e-6
#: embedding 0.2133 ns, LM head 21.333 ns, sampling 2 ns (docs/engine.md, worked example)
FIXED_US = 0.0235467


def _replay(tmp_path, layers: list[int], system: str = "ktransformers-ed"):
    path = str(write_partial_trace(tmp_path / "partial.parquet", layers, num_layers=3, steps=2))
    return simulate(path, tiny_profile(), system, {"defer.deferred": "1"} if system.endswith("-ed") else {})


def test_the_last_logged_layer_defers_and_the_step_waits_for_it(tmp_path):
    """Layer 0 of 3: attention 0-50, sync 50-70, expert 0 70-1070, deferred expert 1 1070-2070, which the step
    waits for: 2070.0235 us, as without deferral (ktransformers), one deferred expert a step."""
    result = _replay(tmp_path, [0])
    assert result.counters.deferred == 2
    for step in result.steps:
        assert (step.end - step.start) / US == pytest.approx(2070 + FIXED_US, abs=1e-6)
    plain = _replay(tmp_path, [0], "ktransformers")
    assert [s.end for s in plain.steps] == [s.end for s in result.steps]
    assert any(note.startswith("ktrans-deferral: the trace logs 1 of the model's 3 MoE layers; at its last logged "
                               "layer (0) experts are deferred") for note in result.notes), result.notes


def test_a_deferral_before_the_last_logged_layer_overlaps_the_next_one(tmp_path):
    """Layers 0 and 1 of 3: layer 0 as above ends at 1070 with expert 1 deferred to 2070; layer 1's attention
    1070-1120 and sync (to 1140) run beside it, its expert 0 2070-3070 and deferred expert 1 3070-4070, which the
    step waits for: 4070.0235 us, 70 us less than without deferral (4140.0235)."""
    result = _replay(tmp_path, [0, 1])
    assert result.counters.deferred == 4
    assert [(s.end - s.start) / US for s in result.steps] == pytest.approx([4070 + FIXED_US] * 2, abs=1e-6)
    plain = _replay(tmp_path, [0, 1], "ktransformers")
    assert [(s.end - s.start) / US for s in plain.steps] == pytest.approx([4140 + FIXED_US] * 2, abs=1e-6)


def test_the_models_last_layer_defers_nothing_and_needs_no_note(tmp_path):
    """Layer 2 of 3 is the model's last: nothing deferred (001 Sec. 4.1), so no note about deferral."""
    result = _replay(tmp_path, [2])
    assert result.counters.deferred == 0
    assert not any("last logged layer" in note for note in result.notes)
    whole = _replay(tmp_path, [0, 1, 2])
    assert not any("last logged layer" in note for note in whole.notes)
