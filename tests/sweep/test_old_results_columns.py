"""A results file an older moesim wrote for a sweep whose every point failed has no metric columns (since 0c38e6f
a new one has them all, NaN): loading it gives the columns a new file has, so that a notebook's
``frame["tpot_ms_mean"]`` reads NaN on old and new files alike instead of raising KeyError on the old."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest

import moesim
from moesim.analysis.sweep_results import load_results
from moesim.analysis.serving import serving_columns
from moesim.sweep.point import no_lower_bound, replay_columns
from tests.factories import TIGHT_GPU, write_spec

#: a cache that does not fit on TIGHT_GPU: every point fails
TOO_BIG = 6
SERVING = {"workload.qps": [1.0], "workload.requests": [3]}


def _failed_sweep(files, grid: dict, out) -> pd.DataFrame:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SweepPointsFailed: expected here
        return moesim.sweep(write_spec(files, systems=["gpu-only-lru"], grid=grid, set=TIGHT_GPU), workers=1,
                            out=out)


@pytest.mark.parametrize("serving", [False, True], ids=["replay", "serving"])
def test_an_old_file_of_a_sweep_whose_every_point_failed_loads_with_every_metric_column(files, serving):
    new = files / "new.parquet"
    frame = _failed_sweep(files, {"cache.slots_per_layer": [TOO_BIG, TOO_BIG - 1], **(SERVING if serving else {})},
                          new)
    assert (frame["status"] == "error").all()
    stored = pd.read_parquet(new)
    metrics = [*serving_columns(), *no_lower_bound()] if serving else replay_columns()
    old = stored.drop(columns=[c for c in metrics if c in stored.columns])  # as moesim wrote it before 0c38e6f
    assert "tpot_ms_mean" not in old.columns and "ttft_ms_p90" not in old.columns
    old.to_parquet(files / "old.parquet")
    loaded = load_results(files / "old.parquet")
    assert list(loaded.columns) == list(stored.columns) == list(load_results(new).columns)
    headline = "ttft_ms_p90" if serving else "tpot_ms_mean"
    assert loaded[headline].isna().all() and loaded["error"].str.contains("does not fit").all()
    pd.testing.assert_frame_equal(loaded[list(old.columns)], old)  # what the file holds, unchanged


def test_only_a_kind_of_point_none_of_which_ran_gets_its_columns():
    """Where points of a kind ran, the file's columns are what they measured: none is added. In an old mixed
    sweep whose serving points all failed, the serving columns are added and the replayed ones kept."""
    from moesim.analysis.serving import serving_columns
    from moesim.analysis.sweep_results import with_metric_columns
    ran = pd.DataFrame({"point_id": ["a"], "system": ["cpu-only"], "status": ["ok"], "error": [""],
                        "tpot_ms_mean": [5.0], "point_wall_s": [0.1]})
    assert with_metric_columns(ran).equals(ran)
    mixed = pd.DataFrame({"point_id": ["a", "b"], "system": ["cpu-only"] * 2, "workload.qps": [None, 1.0],
                          "status": ["ok", "error"], "error": ["", "no"], "tpot_ms_mean": [5.0, None],
                          "point_wall_s": [0.1, 0.2]})
    loaded = with_metric_columns(mixed)
    assert set(serving_columns()) <= set(loaded.columns) and loaded["ttft_ms_p90"].isna().all()
    assert "gpu_hit_rate" not in loaded.columns and list(loaded.columns)[-1] == "point_wall_s"
    assert loaded["tpot_ms_mean"].tolist()[0] == 5.0
