"""A system whose defaults set its weights (mixtral-offloading's int4) runs the replay's weights once the
replay's own settings set the same keys: it is then compared with the oracle and is one of its members."""

from __future__ import annotations

from moesim.policy.systems import own_weights, portfolio_members
from moesim.sim.run import simulate
from tests.factories import write_trace_and_profile

BOTH = {"memory.expert_dtype": "int8", "memory.non_expert_dtype": "int8"}


def test_a_weight_default_the_settings_set_too_is_the_replays():
    assert own_weights("mixtral-offloading") == "memory.expert_dtype=int4, memory.non_expert_dtype=int4"
    assert own_weights("mixtral-offloading", BOTH) == ""
    # one key set: the other default still differs from what every other system runs
    assert own_weights("mixtral-offloading", {"memory.expert_dtype": "int8"}) == "memory.non_expert_dtype=int4"
    assert own_weights("gpu-only-lru", BOTH) == own_weights("gpu-only-lru") == ""


def test_the_oracle_takes_a_system_on_the_replays_weights_as_a_member(tmp_path):
    assert "mixtral-offloading" not in portfolio_members("oracle")
    assert "mixtral-offloading" in portfolio_members("oracle", BOTH)
    trace, hw = write_trace_and_profile(tmp_path, seed=1)
    result = simulate(trace, hw, "oracle", {**BOTH, "engine.prune": "false"})
    assert "mixtral-offloading" in result.members
    alone = simulate(trace, hw, "mixtral-offloading", BOTH)
    assert alone.makespan_s >= result.best["makespan_s"][1]
