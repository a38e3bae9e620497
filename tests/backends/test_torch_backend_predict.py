"""Real backend: the prediction-timed prefetch (``LayerPlan.prefetch_after_predict``, 004 Sec. 4.2) on the CPU
stand-in: the resident experts, then the next layer's attention and gate for real, then the prefetch's copy,
then the loaded experts."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.torch_backend import RealConfig, prepare_real  # noqa: E402
from moesim.sim.result import result_to_frames  # noqa: E402
from moesim.trace import TraceMeta, write_trace  # noqa: E402
from tests.factories import tiny_model, tiny_profile  # noqa: E402

#: the case of tests/policy/test_importance_paper.py's Sec. 4.2 tests: layer 0 routes 0 (resident) and 6 (a
#: demand load) and predicts 7 for layer 1, which routes 7 and 3
SETTINGS = {"cache": "lru", "substitute": "none", "cache.slots_per_layer": "4"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model = tiny_model(layers=2, experts=8, top_k=2)
    data = {"step": np.array([0, 0]), "layer": np.array([0, 1]), "request": np.array([0, 0]),
            "position": np.array([0, 0]), "phase": ["decode", "decode"],
            "experts": np.array([[0, 6], [7, 3]], dtype=np.int16), "pred_next_layer": [[7], [0, 1]]}
    path = tmp_path_factory.mktemp("predict") / "t.parquet"
    return str(write_trace(path, data, TraceMeta(model=model, source={"kind": "test"})))


def _run(trace, **settings):
    config = RealConfig(device="cpu", cpu_threads=1, warmup_steps=0)
    result = prepare_real(trace, tiny_profile(pcie_gbps=0.49152), "importance", {**SETTINGS, **settings}, config).run()
    frame = result_to_frames(result)["timeline"]
    return result, frame


def test_the_prefetch_copy_follows_the_resident_experts_and_the_prediction(trace):
    result, frame = _run(trace)
    layer0 = frame[(frame.step == 0) & (frame.layer == 0) & (frame.resource == "gpu")].sort_values("start_s")
    assert list(layer0.kind) == ["attention", "expert", "predict", "expert"]  # 0, the prediction, then 6
    assert list(layer0.expert) == [-1, 0, -1, 6]
    prediction = layer0.iloc[2]
    prefetch = frame[(frame.resource == "pcie") & (frame.kind == "prefetch")]
    assert list(prefetch.expert) == [7] and (prefetch.start_s >= prediction.end_s).all()
    assert result.counters.breakdown["predict"] == pytest.approx(prediction.end_s - prediction.start_s)
    # layer 1 is the last: no prediction there
    assert (frame[(frame.layer == 1) & (frame.kind == "predict")].shape[0]) == 0


def test_ablations_run_no_prediction(trace):
    for settings in ({"prefetch.after_resident": "false"}, {"prefetch.predict_cost": "false"}):
        result, frame = _run(trace, **settings)
        assert result.counters.breakdown["predict"] == 0.0
        assert (frame[(frame.layer == 0) & (frame.kind == "attention")].shape[0]) == 1
        assert not (frame.kind == "predict").any()
        assert list(frame[(frame.resource == "pcie") & (frame.kind == "prefetch")].expert) == [7]
