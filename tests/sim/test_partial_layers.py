"""A trace that logged only some MoE layers (an importer's ``layers_present``) is replayed with a note."""

from __future__ import annotations

import pytest

from moesim.errors import ConfigError
from moesim.policy.systems import SYSTEMS
from moesim.sim.run import simulate
from tests.factories import tiny_model, tiny_profile, write_partial_trace


def _write(path, layers: list[int], num_layers: int = 3) -> str:
    return str(write_partial_trace(path, layers, num_layers))


def test_a_trace_of_some_layers_is_replayed_with_a_note_naming_them(tmp_path):
    result = simulate(_write(tmp_path / "l1.parquet", [1]), tiny_profile(), "cpu-only")
    assert any("logs 1 of the model's 3 MoE layers (1): only those are replayed" in n for n in result.notes)
    every = simulate(_write(tmp_path / "all.parquet", [0, 1, 2]), tiny_profile(), "cpu-only")
    assert not any("MoE layers" in n for n in every.notes)
    # one layer of three: a third of the expert activations
    assert result.counters.activations * 3 == every.counters.activations


def test_the_next_position_of_a_trace_of_some_layers_is_its_next_logged_layer(tmp_path):
    """A bound that looks one layer ahead (perfect prefetch) steps from the last logged layer of a step to the
    first logged layer of the next, not to layer 0, which such a trace never runs."""
    from moesim.policy.future import FutureRouting
    path = _write(tmp_path / "l12.parquet", [1, 2])
    future = FutureRouting.load(path, tiny_model(layers=3, experts=6, top_k=2))
    assert future.layers_of == {step: [1, 2] for step in range(4)}
    assert future.next_position(0, 1) == (0, 2)
    assert future.next_position(0, 2) == (1, 1)
    assert future.next_position(3, 2) is None


@pytest.mark.parametrize("system", sorted(SYSTEMS))  # the unlisted bounds (oracle-prefetch) too
def test_every_system_replays_a_trace_of_one_middle_layer(tmp_path, system):
    """The vLLM MoE logger's per-layer logs (layer 12 of 24, say) once crashed the oracle's perfect prefetch."""
    path = _write(tmp_path / "l1.parquet", [1])
    try:
        result = simulate(path, tiny_profile(), system)
    except ConfigError as err:  # a column the trace lacks (scores): refused in one line, as for any trace
        assert "scores" in str(err)
        return
    assert result.counters.activations == 4 * 2 and len(result.steps) == 4
