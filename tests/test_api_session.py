"""The Python API as a notebook session uses it: paths relative to the kernel's folder, cells run again."""

from __future__ import annotations

from pathlib import Path

import pytest

import moesim
from moesim.errors import TraceFormatError


@pytest.mark.parametrize("call, field", [
    (lambda trace: moesim.replay(trace), "trace"),
    (lambda trace: moesim.replay(Path(trace)), "trace"),
    (lambda trace: moesim.serve(trace, requests=2), "traces"),
    (lambda trace: moesim.serve([trace], requests=2), "traces"),
    # a dict spec's traces: the sweep's line said to give a path relative to the spec file's folder (it has none)
    (lambda trace: moesim.sweep({"traces": [trace], "hw": ["rtx4090"], "systems": ["smoe"]}), "traces"),
    (lambda trace: moesim.sweep({"trace": trace, "hw": ["rtx4090"], "systems": ["smoe"]}), "trace"),
])
def test_a_bundled_trace_named_from_another_folder_points_to_bundled_trace(tmp_path, monkeypatch, call, field):
    """A kernel runs in the notebook's folder: 'traces/...' written as from the repository's root was
    'file not found (fix: check the path)', naming neither the folder looked in nor moesim.bundled_trace."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TraceFormatError) as err:
        call("traces/mixtral-8x7b-humaneval.parquet")
    text = str(err.value)
    assert err.value.field == field
    assert f"looked at {tmp_path / 'traces' / 'mixtral-8x7b-humaneval.parquet'}" in text
    assert "moesim.bundled_trace('mixtral-8x7b-humaneval')" in text


def test_a_missing_trace_of_ones_own_names_the_folder_it_was_looked_for_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TraceFormatError, match="working folder") as err:
        moesim.replay("runs/mine.parquet")
    assert str(tmp_path / "runs" / "mine.parquet") in str(err.value) and "bundled_trace" not in str(err.value)
    with pytest.raises(TraceFormatError) as err:
        moesim.slice_trace("runs/mine.parquet", tmp_path / "slice.parquet", steps=2)
    assert str(tmp_path / "runs" / "mine.parquet") in str(err.value)


def test_metrics_of_several_systems_concatenate_into_numeric_columns(tmp_path):
    """all-in-gpu's lower_bound_slots (memory not enforced: no slot count) was None, which made that column
    object-typed in its own row and in any table concatenated from several systems' ``.metrics``."""
    import pandas as pd

    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)
    runs = [moesim.replay(trace, hw=hw, system=name, timeline=False, decisions=False)
            for name in ("all-in-gpu", "gpu-only-lru")]
    assert pd.isna(runs[0].metrics["lower_bound_slots"].item())
    table = pd.concat([run.metrics for run in runs], ignore_index=True)
    numeric = [name for name in table.columns if name.startswith(("lower_bound", "breakdown_")) or name.endswith("_ms")]
    assert all(pd.api.types.is_numeric_dtype(table[name]) for name in numeric), table.dtypes[numeric]


def test_an_invalid_plan_in_a_notebook_shows_the_callers_line_and_one_line(tmp_path):
    """A policy's invalid plan found while the SimPy loop runs showed SimPy's frames (core.py, 'raise
    event._value') between the caller's line and the message."""
    from moesim.policy.base import PolicyError
    from moesim.policy.systems import SYSTEMS, ComposedSystem, SystemSpec, register_system
    from tests.factories import write_trace_and_profile

    class PlansTwice(ComposedSystem):
        def plan(self, view):
            plan = super().plan(view)
            plan.gpu = plan.gpu + plan.gpu[:1]
            return plan

    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)
    register_system("test-plans-twice", SystemSpec("plans an expert twice", cache="lru", assign="gpu",
                                                   system_class=PlansTwice))
    try:
        with pytest.raises(PolicyError, match="layer 0, plans expert .* twice") as err:
            moesim.replay(trace, hw=hw, system="test-plans-twice")
    finally:
        del SYSTEMS["test-plans-twice"]
    shown = err.value._render_traceback_()
    assert [line for line in shown if line.lstrip().startswith("File ")] == \
        [next(line for line in shown if __file__ in line)], shown
    assert shown[-1].startswith("PolicyError: system 'test-plans-twice'") and "\n" not in shown[-1]


@pytest.mark.parametrize("call", [
    lambda trace, hw: moesim.replay(trace, hw=hw),
    lambda trace, hw: moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"]}, workers=1),
])
def test_an_interrupt_in_a_notebook_shows_the_callers_line(tmp_path, monkeypatch, call):
    """Kernel > Interrupt during a replay or sweep showed two screens of SimPy, the pool and moesim frames above
    'KeyboardInterrupt'; the cell's own line is what tells where it stopped."""
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("moesim.sim.run.simulate", interrupted)
    with pytest.raises(KeyboardInterrupt) as err:
        call(trace, hw)
    shown = err.value._render_traceback_()
    frames = [line for line in shown if line.lstrip().startswith("File ")]
    assert frames and all(__file__ in line for line in frames), shown
    assert shown[-1] == "KeyboardInterrupt"


def test_a_slice_written_again_leaves_the_file_and_a_resumable_sweep_over_it_alone(tmp_path):
    """A notebook run again from the top slices its trace again: the rewritten file's new modification time made a
    sweep with out= run every finished point again, its trace having 'changed'."""
    import os

    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)
    piece = moesim.slice_trace(trace, tmp_path / "piece.parquet", steps=3)
    os.utime(piece, ns=(1_000_000_000, 1_000_000_000))
    spec = {"traces": [piece], "hw": [hw], "systems": ["gpu-only-lru"]}
    first = moesim.sweep(spec, out=tmp_path / "results.parquet", workers=1)
    assert moesim.slice_trace(trace, tmp_path / "piece.parquet", steps=3) == piece
    assert os.stat(piece).st_mtime_ns == 1_000_000_000
    again = moesim.sweep(spec, out=tmp_path / "results.parquet", workers=1)
    assert again["finished_at"].tolist() == first["finished_at"].tolist()
    moesim.slice_trace(trace, tmp_path / "piece.parquet", steps=4)  # another slice does replace it
    assert os.stat(piece).st_mtime_ns != 1_000_000_000


def test_a_dict_spec_takes_a_path_object_as_a_parameters_value(tmp_path):
    """settings of a sweep given as pathlib.Path (smoe-flex's calibration trace) ran every point, then failed
    writing the results with pyarrow's ArrowInvalid ("Could not convert PosixPath(...)"); replay took it."""
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)
    for where in ("set", "grid"):
        value = Path(trace) if where == "set" else [Path(trace)]
        table = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["smoe-flex"],
                              where: {"prefetch.calibration": value}}, workers=1)
        assert table["status"].tolist() == ["ok"], table["error"].tolist()
        assert table["prefetch.calibration"].tolist() == [str(trace)]


def test_a_resumed_sweep_gives_the_columns_a_fresh_one_gives(tmp_path):
    """Points read back from the results file held None where a fresh sweep held NaN: prefetch_precision (nan
    for a system that never prefetches) was float64 in a fresh sweep and an object column of None resumed."""
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)
    spec = {"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru", "cpu-only"]}
    fresh = moesim.sweep(spec, out=tmp_path / "results.parquet", workers=1)
    resumed = moesim.sweep(spec, out=tmp_path / "results.parquet", workers=1)
    assert fresh["prefetch_precision"].isna().all() and fresh["prefetch_precision"].dtype == "float64"
    differ = {name: (fresh[name].dtype, resumed[name].dtype) for name in fresh.columns
              if fresh[name].dtype != resumed[name].dtype}
    assert not differ


def test_a_whole_number_given_as_a_float_is_that_count(tmp_path):
    """A count read from a results table (a column with gaps is float) or from np.linspace was refused:
    "'2.0' is not a valid int"."""
    import numpy as np

    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)
    expected = moesim.replay(trace, hw=hw, cache__slots_per_layer=1, timeline=False).metrics["tpot_ms_mean"].item()
    for slots in (1.0, np.float64(1.0), [1.0, 1.0]):
        run = moesim.replay(trace, hw=hw, cache__slots_per_layer=slots, timeline=False)
        assert run.metrics["tpot_ms_mean"].item() == expected
    run = moesim.replay(trace, hw=hw, settings={"cache.slots_per_layer": np.float64(1.0)}, timeline=False)
    assert run.metrics["tpot_ms_mean"].item() == expected
    with pytest.raises(moesim.api.ConfigError, match="'1.5' is not a valid int"):
        moesim.replay(trace, hw=hw, cache__slots_per_layer=1.5)
