"""Serving metrics worked by hand on a tiny run: one CPU-only layer, three requests at known times."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.analysis.serving import request_frame, serving_metrics
from moesim.sim.serving import serve
from tests.factories import tiny_model, tiny_profile, write_tiny_trace
from tests.sim.test_serving import request_routing


@pytest.fixture
def static_run(tmp_path):
    """Requests of 2+3 and 1+2 tokens (prompt + decode) arriving at 0, 0.1 ms and 500 ms, served one at a
    time (the static scheduler): each step of the run and each request's times follow from the step times."""
    model = tiny_model(layers=1, experts=2, top_k=1)
    routing = request_routing(np.random.default_rng(0), model, [(2, 3), (1, 2)])
    trace = str(write_tiny_trace(tmp_path / "t.parquet", model, routing))
    (tmp_path / "a.csv").write_text("arrival_s\n0\n0.0001\n0.5\n")
    profile = tiny_profile(gpu_us=(100.0, 5000.0), cpu_us=(100.0, 50000.0), attention_us=10.0, pcie_gbps=1.0)
    return serve([trace], profile, "cpu-only", {"workload.arrival": "trace", "scheduler": "static",
                                                "workload.arrival_file": str(tmp_path / "a.csv"),
                                                "workload.requests": "3"})


def test_latencies_follow_from_the_steps(static_run):
    steps = [(s.start, s.end) for s in static_run.engine.steps]
    assert [b[0][0] for b in static_run.batches] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]  # one request at a time
    frame = request_frame(static_run).set_index("request")
    # request 0: prefill in step 0, its three decode tokens in steps 1-3
    assert frame.loc[0, "ttft_ms"] == pytest.approx(steps[0][1] * 1e3)
    assert frame.loc[0, "tpot_ms"] == pytest.approx((steps[3][1] - steps[0][1]) / 3 * 1e3)
    # request 1 waits for request 0 to finish (static batches), then runs steps 4-6
    assert frame.loc[1, "queue_ms"] == pytest.approx((steps[3][1] - 0.0001) * 1e3)
    assert frame.loc[1, "ttft_ms"] == pytest.approx((steps[4][1] - 0.0001) * 1e3)
    assert frame.loc[1, "e2e_ms"] == pytest.approx((steps[6][1] - 0.0001) * 1e3)
    # request 2 arrives to an idle engine: the same steps as request 0, shifted to 500 ms
    assert frame.loc[2, "queue_ms"] == 0.0
    assert frame.loc[2, ["ttft_ms", "tpot_ms", "e2e_ms"]].tolist() == \
        pytest.approx(frame.loc[0, ["ttft_ms", "tpot_ms", "e2e_ms"]].tolist())


def test_rates_and_percentiles_by_hand(static_run):
    m = serving_metrics(static_run)
    end = static_run.engine.steps[-1].end
    ttft = sorted(request_frame(static_run)["ttft_ms"])
    assert m["offered_qps"] == pytest.approx(3 / 0.5)  # three requests by the last arrival
    assert m["throughput_rps"] == pytest.approx(3 / end)
    assert m["ttft_ms_p50"] == pytest.approx(ttft[1])
    assert m["ttft_ms_p99"] == pytest.approx(ttft[1] + 0.98 * (ttft[2] - ttft[1]))  # linear between ranks
    assert m["ttft_ms_mean"] == pytest.approx(sum(ttft) / 3)


def test_output_tokens_count_the_token_each_prefill_ends_with(static_run):
    """Requests of 3, 2 and 3 decode tokens return 4, 3 and 4 tokens (the prefill's first token, then one per
    decode step, as TPOT counts them); the rate counted 8, not 11."""
    m = serving_metrics(static_run)
    assert m["output_tokens_per_s"] == pytest.approx(11 / static_run.engine.steps[-1].end)
