"""Every kind of timeline row and every decision action a replay writes is documented in analysis.timeline."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.analysis.timeline import DECISION_ACTIONS, TIMELINE_KINDS
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_scored_trace, write_tiny_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model = tiny_model(layers=2, experts=6, top_k=2, shared=True)
    routing = random_routing(np.random.default_rng(5), model, requests=2, prompt=4, decode=6)
    return str(write_tiny_trace(tmp_path_factory.mktemp("t") / "t.parquet", model, routing))


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """The same shape with router scores and next-layer predictions: ``importance`` runs on it."""
    model = tiny_model(layers=2, experts=6, top_k=2, shared=True)
    rng = np.random.default_rng(5)
    routing = random_routing(rng, model, requests=2, prompt=4, decode=6)
    return write_scored_trace(tmp_path_factory.mktemp("s") / "s.parquet", model, routing, rng)


@pytest.mark.parametrize("system, settings", [
    ("gpu-only-lru", {}), ("smoe", {"engine.copy_chunk_bytes": "4096"}), ("mixtral-offloading", {}),
    ("ktransformers-ed", {"defer.deferred": "1"}), ("dali", {}), ("static-hot", {}), ("importance", {}),
    ("hybrimoe", {}),
])
def test_every_kind_and_action_written_is_documented(trace, scored, system, settings):
    result = simulate(scored if system == "importance" else trace, tiny_profile(pcie_gbps=1.0), system,
                      {"cache.slots_per_layer": "1", **settings}, timeline=True, decisions=True)
    frames = result_to_frames(result)
    written = set(zip(frames["timeline"]["resource"], frames["timeline"]["kind"]))
    documented = {(resource, kind) for resource, kinds in TIMELINE_KINDS.items() for kind in kinds}
    assert written - documented == set()
    assert set(frames["decisions"]["action"]) - set(DECISION_ACTIONS) == set()


def test_the_documented_kinds_are_all_written_somewhere(trace, scored):
    """The list holds no kind the engine never writes (a stale name would mislead a reader)."""
    written = set()
    for system, settings in [("gpu-only-lru", {}), ("smoe", {"engine.copy_chunk_bytes": "4096"}),
                             ("mixtral-offloading", {}), ("ktransformers-ed", {"defer.deferred": "1"}),
                             ("importance", {})]:
        frame = result_to_frames(simulate(scored if system == "importance" else trace, tiny_profile(pcie_gbps=1.0), system,
                                          {"cache.slots_per_layer": "1", **settings}, timeline=True))["timeline"]
        written |= set(zip(frame["resource"], frame["kind"]))
    documented = {(resource, kind) for resource, kinds in TIMELINE_KINDS.items() for kind in kinds}
    assert documented - written <= {("gpu", "dense_ffn")}  # the tiny model has no dense layers
