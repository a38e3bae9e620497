"""A sweep's rows carry each point's physical lower bound and its gap to it, as `moesim replay --json` and
``moesim.replay`` give them, from the one function all three call."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

import moesim
from moesim.cli import main
from tests.factories import write_spec

BOUND_KEYS = ("makespan_s", "ttft_ms", "tpot_ms_mean", "slots")


def _same(a, b) -> bool:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
        return (a is None or math.isnan(a)) and (b is None or (isinstance(b, float) and math.isnan(b)))
    return a == b


@pytest.mark.parametrize("system", ["gpu-only-lru", "mixtral-offloading", "oracle"])
def test_a_sweep_row_holds_the_lower_bound_and_gap_the_replay_gives(files, system):
    """Sweep rows had no lower_bound_* and no gap_to_lower_bound: a sweep could not show how far each point
    is from its bound (mixtral-offloading: its own int4 defaults; oracle: each metric's floor from its
    schedule)."""
    trace, hw = str(files / "t.parquet"), str(files / "hw.yaml")
    path = write_spec(files, systems=[system], grid={"cache.slots_per_layer": [1, 2]})
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"]) == 0
    frame = pd.read_parquet(files / "r.parquet")
    assert len(frame) == 2
    for _, row in frame.iterrows():
        slots = int(row["cache.slots_per_layer"])
        out = files / f"m{slots}.json"
        assert main(["replay", trace, "--hw", hw, "--system", system, "--set", f"cache.slots_per_layer={slots}",
                     "--json", str(out)]) == 0
        given = json.loads(out.read_text())
        assert row["gap_to_lower_bound"] == given["gap_to_lower_bound"] >= 1.0
        for key in BOUND_KEYS:
            assert _same(row[f"lower_bound_{key}"], given["lower_bound"][key]), key
        if system == "oracle":
            for metric, slots_of in given["lower_bound"]["slots_by_metric"].items():
                assert _same(row[f"lower_bound_slots_by_metric_{metric}"], slots_of), metric
        api = moesim.replay(trace, hw=hw, system=system, cache__slots_per_layer=slots, timeline=False,
                            decisions=False).metrics.iloc[0]
        for column in [c for c in api.index if "lower_bound" in c]:
            assert _same(row[column], api[column]), column


def test_the_api_sweep_has_the_same_columns(files):
    trace, hw = str(files / "t.parquet"), str(files / "hw.yaml")
    frame = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["cpu-only", "gpu-only-lru"]}, workers=1)
    assert {f"lower_bound_{k}" for k in BOUND_KEYS} | {"gap_to_lower_bound"} <= set(frame.columns)
    assert (frame["gap_to_lower_bound"] >= 1.0).all()


def test_serving_points_leave_the_bound_empty(files):
    """A serving point (workload.*) has no replay bound: its columns are there, and NaN."""
    path = write_spec(files, systems=["gpu-only-lru"], grid={"workload.qps": [4], "workload.requests": [2]})
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"]) == 0
    row = pd.read_parquet(files / "r.parquet").iloc[0]
    assert row["status"] == "ok"
    for column in [f"lower_bound_{k}" for k in BOUND_KEYS] + ["gap_to_lower_bound"]:
        assert pd.isna(row[column]), column


def test_replay_api_and_sweep_share_one_bound_function(files, tmp_path, monkeypatch):
    """The gap was computed twice (the command line's and the API's); the sweep now needs it too: one
    function, moesim.sim.run.add_lower_bound, gives it to all three."""
    from moesim.sim import run
    calls: list[str] = []
    shared = run.add_lower_bound

    def spy(metrics, result, *args, **kwargs):
        calls.append(result.system)
        return shared(metrics, result, *args, **kwargs)

    monkeypatch.setattr(run, "add_lower_bound", spy)
    trace, hw = str(files / "t.parquet"), str(files / "hw.yaml")
    assert main(["replay", trace, "--hw", hw, "--system", "cpu-only", "--json", str(tmp_path / "m.json")]) == 0
    assert calls == ["cpu-only"]
    moesim.replay(trace, hw=hw, system="static-hot", timeline=False, decisions=False)
    assert calls[-1] == "static-hot"
    moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"]}, workers=1)
    assert calls[-1] == "gpu-only-lru" and len(calls) == 3
