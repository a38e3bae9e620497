"""engine.check refuses a plan whose streamed experts are not its GPU experts in the GPU's order: the engine
passes each staging buffer on to the streamed expert ``engine.staging_slots`` later once the GPU has run the
one before, and such a plan stopped the replay with a KeyError from deep in the GPU track."""

from __future__ import annotations

import pytest

from moesim.policy.base import LayerPlan, PolicyError
from moesim.sim.run import prepare
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


@pytest.mark.parametrize("streamed", [[10, 11, 12], [12, 10, 11, 13], [12, 12, 10, 11]])
def test_check_refuses_streamed_experts_out_of_the_gpus_order(tmp_path, streamed):
    """One layer, 0-7 resident; step 1 computes 12, 10, 11 on the GPU, all three streamed through one staging
    buffer. Streamed in another order (12 would take the buffer 11 frees, and 11 runs after it), with an expert
    the GPU does not compute (its copy made for nothing), or one twice: refused by the check, naming the rule;
    the first stopped the replay with a KeyError, the others ran it."""
    model = tiny_model(layers=1, experts=16, top_k=3)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[10, 11, 12]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    sim = prepare(str(path), tiny_profile(), "gpu-only-lru",
                  {"cache.slots_per_layer": "8", "engine.staging_slots": "1", "engine.check": "true"})
    plans = {0: LayerPlan(gpu=[0, 1, 2]), 1: LayerPlan(gpu=[12, 10, 11], streamed=streamed)}
    sim.system.plan = lambda view: plans[view.step]
    with pytest.raises(PolicyError, match="at step 1, layer 0, streams experts that are not its GPU experts, "
                                          "once each, in the GPU's order"):
        sim.run()


def test_without_the_check_streamed_experts_out_of_order_stop_with_one_line(tmp_path):
    """The same plan (12, 10, 11 on the GPU, streamed 10, 11, 12 through one buffer) with engine.check off:
    the replay stopped with a KeyError from the GPU track (an internal error); it stops with a PolicyError
    that names the plan's field and the fix."""
    model = tiny_model(layers=1, experts=16, top_k=3)
    steps = [{"phase": "decode", "tokens": {0: (5, [[[0, 1, 2]]])}},
             {"phase": "decode", "tokens": {0: (6, [[[10, 11, 12]]])}}]
    path = write_tiny_trace(tmp_path / "t.parquet", model, steps)
    sim = prepare(str(path), tiny_profile(), "gpu-only-lru", {"cache.slots_per_layer": "8",
                                                              "engine.staging_slots": "1"})
    plans = {0: LayerPlan(gpu=[0, 1, 2]), 1: LayerPlan(gpu=[12, 10, 11], streamed=[10, 11, 12])}
    sim.system.plan = lambda view: plans[view.step]
    with pytest.raises(PolicyError, match=r"at step 1, layer 0, plan\.streamed \[10, 11, 12\] is not in the "
                                          r"order of plan\.gpu") as caught:
        sim.run()
    assert caught.value.field == "plan.streamed" and "\n" not in str(caught.value)
