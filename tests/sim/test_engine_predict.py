"""Engine invariants of the prediction-timed prefetch (``LayerPlan.prefetch_after_predict``, 004 Sec. 4.2) over
random small traces with router scores and next-layer predictions, under the ``importance`` system (hypothesis).

The hand-worked cases are in tests/policy/test_importance_paper.py; here: time never goes backwards, no
expert runs on the GPU before its weights arrive, no prefetch copy starts before its layer's prediction has
ended, the ``predict`` breakdown is the prediction spans' sum, and the closed-form paths (no timeline) give
the schedule the timeline's paths give.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moesim.analysis.metrics import metrics
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import draw_profile, random_routing, tiny_model, tiny_profile, write_scored_trace

EPS = 1e-12
#: the full system, and variants that take the engine's other paths (no router, every expert on the GPU,
#: whole predictions, a free prediction, chunked copies, LRU)
VARIANTS = [{}, {"substitute": "none"}, {"assign": "gpu"}, {"prefetch.per_token": "0"},
            {"prefetch.predict_cost": "false"}, {"engine.copy_chunk_bytes": "4096"}, {"cache": "lru"}]
WALL = ("sim_wall_s", "sim_rows_per_s", "wall_s")


@st.composite
def scenarios(draw):
    experts = draw(st.integers(3, 8))
    model = tiny_model(layers=draw(st.integers(2, 3)), experts=experts, top_k=draw(st.integers(1, min(3, experts - 1))),
                       shared=draw(st.booleans()))
    seed = draw(st.integers(0, 2**16))
    routing = random_routing(np.random.default_rng(seed), model, requests=draw(st.integers(1, 2)),
                             prompt=draw(st.integers(1, 4)), decode=draw(st.integers(1, 6)))
    profile = draw_profile(draw)
    slots = draw(st.integers(model.top_k, experts))
    return model, routing, seed, profile, slots, draw(st.sampled_from(VARIANTS))


def run(scenario, timeline: bool):
    model, routing, seed, profile, slots, variant = scenario
    with tempfile.TemporaryDirectory() as tmp:
        path = write_scored_trace(Path(tmp) / "t.parquet", model, routing, np.random.default_rng(seed))
        return simulate(path, tiny_profile(**profile), "importance",
                        {"cache.slots_per_layer": str(slots), "engine.check": "true", **variant},
                        timeline=timeline, decisions=timeline)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_prediction_timed_prefetch_invariants(scenario):
    result = run(scenario, timeline=True)
    frames = result_to_frames(result)
    timeline, decisions = frames["timeline"], frames["decisions"]

    # time never goes backwards: no lane overlaps itself, steps follow each other
    assert (timeline.end_s >= timeline.start_s).all()
    for (resource, _), spans in timeline.groupby(["resource", "lane"]):
        spans = spans.sort_values(["start_s", "end_s"])
        assert (spans.start_s.values[1:] >= spans.end_s.values[:-1]).all(), resource
    ends = [s.end for s in result.steps]
    assert all(b >= a for a, b in zip(ends, [s.start for s in result.steps][1:]))

    # no expert runs on the GPU before its weights arrive
    pcie = timeline[timeline.resource == "pcie"]
    gpu = timeline[(timeline.resource == "gpu") & (timeline.kind == "expert")]
    actions = decisions.set_index(["step", "layer", "expert", "action"]).index
    for row in gpu.itertuples():
        copies = pcie[(pcie.layer == row.layer) & (pcie.expert == row.expert) & (pcie.start_s <= row.start_s + EPS)]
        if (row.step, row.layer, row.expert, "gpu_hit") not in actions:
            assert len(copies), f"expert {row.expert} of layer {row.layer} computed without a copy"
        if len(copies):
            assert copies.end_s.max() <= row.start_s + EPS

    # a decode layer's prediction is one span after its own attention; its prefetches' copies start after it
    gpu = timeline[timeline.resource == "gpu"]
    attention = gpu[(gpu.kind == "attention") & (gpu.layer >= 0)].set_index(["step", "layer"])
    predictions = {}  # (step, layer) -> (start, end) of the prediction
    for key, spans in gpu[gpu.kind == "predict"].groupby(["step", "layer"]):
        assert len(spans) == 1 and spans.start_s.iloc[0] >= attention.loc[key, "end_s"] - EPS
        predictions[key] = (spans.start_s.iloc[0], spans.end_s.iloc[0])
    assert abs(result.counters.breakdown["predict"] - sum(e - s for s, e in predictions.values())) <= 1e-12
    # every decode layer but the last predicts (with a cost); no prefill layer does
    if scenario[-1].get("prefetch.predict_cost") != "false":
        layers = scenario[0].num_layers
        assert set(predictions) == {(s.step, layer) for s in result.steps if s.phase == "decode"
                                    for layer in range(layers - 1)}
    prefetched = decisions[decisions.action == "prefetch"]
    for row in prefetched.itertuples():
        if (row.step, row.layer) not in predictions:  # the prefill, or a free prediction: no span to compare
            continue
        decided = predictions[(row.step, row.layer)][1]
        copies = pcie[(pcie.step == row.step) & (pcie.layer == row.target_layer) & (pcie.expert == row.expert)
                      & pcie.kind.isin(["prefetch", "chunk"])]
        assert (copies.start_s >= decided - EPS).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_closed_form_paths_give_the_timeline_schedule(scenario):
    """Without a timeline a decode layer's demand loads are laid out at once (``_load_at_once``) and its
    one-token experts summed in closed form; the split around the prediction must keep them equal."""
    fast, slow = ({k: v for k, v in metrics(run(scenario, timeline=t)).items() if k not in WALL} for t in (False, True))
    assert fast.keys() == slow.keys()
    for key in fast:  # busy times are summed span by span with a timeline: equal to rounding
        a, b = fast[key], slow[key]
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(x == pytest.approx(b[k], rel=1e-9, abs=1e-15) for k, x in a.items())
        elif isinstance(a, float):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-15, nan_ok=True), key
        else:
            assert json.dumps(a, default=str) == json.dumps(b, default=str), key
