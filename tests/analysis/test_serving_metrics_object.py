"""``moesim.serve(...).metrics``: a dict as before (indexing, ``**``, JSON, pickling), whose keys are attributes too
and whose ``frame()`` is a one-row DataFrame, as ``moesim.replay(...).metrics`` is."""

from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pandas as pd
import pytest

import moesim
from moesim.analysis.serving import ServingMetrics, serving_columns
from tests.factories import profile_dict, tiny_model, write_tiny_trace
from tests.sim.test_serving import request_routing


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import yaml
    folder = tmp_path_factory.mktemp("serving-metrics")
    model = tiny_model(layers=2, experts=4, top_k=2)
    trace = write_tiny_trace(folder / "t.parquet", model, request_routing(np.random.default_rng(3), model, [(4, 3), (2, 5)]))
    hw = folder / "hw.yaml"
    hw.write_text(yaml.safe_dump(profile_dict()))
    return moesim.serve(str(trace), hw=str(hw), system="cpu-only", qps=20, requests=4, slo={"ttft_ms": 1e6})


def test_the_metrics_are_a_dict_whose_keys_are_attributes(run):
    m = run.metrics
    assert isinstance(m, ServingMetrics) and isinstance(m, dict)
    assert m.ttft_ms_p90 == m["ttft_ms_p90"] and m.engine["makespan_s"] == m["engine"]["makespan_s"]
    assert m.goodput_rps == m["goodput_rps"] and "tpot_ms_p50" in dir(m)
    assert json.loads(json.dumps(m))["requests"] == 4  # what --json writes, and what users saved
    assert pickle.loads(pickle.dumps(m)) == m and copy.deepcopy(m) == m and {**m} == dict(m)
    with pytest.raises(AttributeError, match="did you mean .*ttft_ms_p90"):
        m.ttft_ms_p09
    with pytest.raises(AttributeError, match="it needs an SLO"):
        moesim.api.ServeRun(requests=run.requests, metrics=ServingMetrics({"system": "x"}), system="x",
                            traces=[]).metrics.goodput_rps


def test_frame_is_one_row_with_the_columns_of_a_sweeps_serving_row(run):
    frame = run.metrics.frame()
    assert isinstance(frame, pd.DataFrame) and len(frame) == 1
    assert set(frame.columns) == {"system", *serving_columns(), "slo_attainment", "goodput_rps", "slo_ttft_ms"}
    assert frame["ttft_ms_p90"].iloc[0] == run.metrics.ttft_ms_p90
    assert frame["engine_makespan_s"].iloc[0] == run.metrics.engine["makespan_s"]
