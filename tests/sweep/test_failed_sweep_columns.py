"""A sweep whose every point failed has the columns of one whose points ran: its metric columns empty (NaN), so
``frame["tpot_ms_mean"]`` reads NaN instead of raising KeyError, from Python, in the results file and in
``moesim sweep --json``."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest

import moesim
from moesim.cli import main
from moesim.sim import run
from moesim.sweep.point import replay_columns
from tests.factories import TIGHT_GPU, write_spec

#: a point that runs, and one that does not fit on the GPU (cache.slots_per_layer=6 of TIGHT_GPU)
FITS, TOO_BIG = 1, 6
SERVING = {"workload.qps": [1.0], "workload.requests": [3]}


def _sweep(files, slots: int, serving: bool, **kwargs) -> pd.DataFrame:
    grid = {"cache.slots_per_layer": [slots], **(SERVING if serving else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SweepPointsFailed: expected here
        return moesim.sweep(write_spec(files, systems=["gpu-only-lru"], grid=grid, set=TIGHT_GPU), workers=1,
                            **kwargs)


@pytest.mark.parametrize("serving", [False, True], ids=["replay", "serving"])
def test_a_sweep_whose_every_point_failed_has_the_columns_of_one_that_ran(files, serving):
    ran = _sweep(files, FITS, serving)
    failed = _sweep(files, TOO_BIG, serving, out=files / "failed.parquet")
    assert ran["status"].tolist() == ["ok"] and failed["status"].tolist() == ["error"]
    assert list(failed.columns) == list(ran.columns)
    headline = "ttft_ms_p90" if serving else "tpot_ms_mean"
    assert failed[headline].isna().all() and failed["error"].str.contains("does not fit").all()
    stored = pd.read_parquet(files / "failed.parquet")
    assert list(stored.columns) == list(ran.columns) and stored[headline].isna().all()


def test_moesim_sweep_json_of_a_sweep_whose_every_point_failed_has_every_metric_key(files, capsys, monkeypatch):
    """Points that fail on a bug (not their input) keep their rows, in the file and the JSON (exit 1)."""
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(run, "simulate", broken)
    spec = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2]}, set=TIGHT_GPU)
    out = files / "r.parquet"
    assert main(["sweep", str(spec), "--out", str(out), "--workers", "1", "--json", "-"]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["status"] for r in rows] == ["error", "error"]
    for row in rows:
        assert {"tpot_ms_mean", "ttft_ms", "gpu_hit_rate", "breakdown_attention_ms", "lower_bound_slots"} <= set(row)
        assert row["tpot_ms_mean"] is None and "a bug" in row["error"]
    stored = pd.read_parquet(out)
    assert set(replay_columns()) <= set(stored.columns) and stored["tpot_ms_mean"].isna().all()
