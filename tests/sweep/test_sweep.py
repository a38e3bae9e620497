"""`moesim sweep`: spec expansion, point ids, results on disk, resuming (also after kill -9), the local pool
(the Ray engine: test_ray_engine.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from moesim.analysis.metrics import metrics
from moesim.cli import main
from moesim.errors import ConfigError
from moesim.sim.run import simulate
from moesim.sweep import Point, ResultStore, load_spec, parse_spec, run_sweep
from tests.factories import TIGHT_GPU, spec_for_kill, with_scores, write_spec

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- spec
def test_grid_zip_and_axes_expand_to_their_product(tmp_path):
    spec = parse_spec({"traces": ["a.parquet", "b.parquet"], "hw": "rtx4090", "systems": ["cpu-only", "gpu-only-lru"],
                       "seeds": [0, 1], "set": {"engine__staging_slots": 3},
                       "grid": {"cache__slots_per_layer": [1, 2, 4]},
                       "zip": [{"hw.pcie.bandwidth_scale": [0.5, 1.0], "engine.kernels_per_expert": [3, 1]}]},
                      source="s", base_dir=tmp_path)
    points = spec.points()
    assert len(points) == 2 * 1 * 2 * 2 * 3 * 2 == 48
    assert len({p.point_id for p in points}) == 48
    first = points[0]
    assert (first.trace, first.hw, first.system, first.seed) == ("a.parquet", "rtx4090", "cpu-only", 0)
    assert dict(first.settings) == {"engine.staging_slots": 3, "cache.slots_per_layer": 1,
                                    "hw.pcie.bandwidth_scale": 0.5, "engine.kernels_per_expert": 3}
    zipped = {(dict(p.settings)["hw.pcie.bandwidth_scale"], dict(p.settings)["engine.kernels_per_expert"])
              for p in points}
    assert zipped == {(0.5, 3), (1.0, 1)}  # zipped, not crossed
    assert spec.parameter_keys() == ["engine.staging_slots", "cache.slots_per_layer", "hw.pcie.bandwidth_scale",
                                     "engine.kernels_per_expert"]


def test_a_spec_file_reads_exponent_notation_as_numbers(tmp_path):
    """A grid of ``2.5e-1`` and ``1e-1`` is a grid of numbers (YAML 1.1 would keep them as text and a plot
    would order them as text)."""
    path = tmp_path / "spec.yaml"
    path.write_text("trace: t.parquet\nsystem: cpu-only\ngrid: {hw.pcie.bandwidth_scale: [2.5e-1, 1e-1, 0.75]}\n")
    values = [dict(p.settings)["hw.pcie.bandwidth_scale"] for p in load_spec(path).points()]
    assert values == [0.25, 0.1, 0.75] and all(isinstance(v, float) for v in values)


def test_point_id_is_a_hash_of_the_parameters_only(tmp_path):
    point = Point("t.parquet", "rtx4090", "gpu-only-lru", 0, None, (("cache.slots_per_layer", 2),))
    canonical = json.dumps({"trace": "t.parquet", "hw": "rtx4090", "system": "gpu-only-lru", "seed": 0,
                            "model": None, "settings": {"cache.slots_per_layer": "2"}}, sort_keys=True)
    assert point.point_id == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # the same point from specs in other folders, with the key spelled either way
    a = parse_spec({"trace": "t.parquet", "system": "gpu-only-lru", "grid": {"cache.slots_per_layer": [2]}},
                   source="a", base_dir=tmp_path)
    b = parse_spec({"traces": ["t.parquet"], "systems": "gpu-only-lru", "hw": ["rtx4090"],
                    "set": {"cache__slots_per_layer": 2}}, source="b", base_dir=tmp_path / "elsewhere")
    assert a.points()[0].point_id == b.points()[0].point_id == point.point_id
    assert Point("t.parquet", "rtx4090", "gpu-only-lru", 1, None, point.settings).point_id != point.point_id


def test_all_means_every_listed_system():
    from moesim.policy.systems import system_names
    spec = parse_spec({"trace": "t.parquet", "systems": "all"}, source="s", base_dir=Path("."))
    assert spec.systems == system_names()


@pytest.mark.parametrize("spec, words", [
    ({"trace": "t.parquet", "system": "cpu-only", "colour": 1}, "unknown key 'colour' (fix: valid keys:"),
    ({"trace": "t.parquet", "systms": ["cpu-only"]}, "unknown key 'systms' (fix: did you mean systems? valid keys:"),
    ({"trace": "t.parquet", "system": "gpu-only-lur"}, "did you mean gpu-only-lru?"),
    ({"trace": "t.parquet"}, "'systems' is missing"),
    ({"trace": "t.parquet", "system": "cpu-only", "systems": ["cpu-only"]}, "both 'system' and 'systems'"),
    ({"trace": "t.parquet", "system": "gpu-only-lur"}, "unknown system 'gpu-only-lur'"),
    ({"trace": "t.parquet", "system": "cpu-only", "zip": {"a.b": [1, 2], "c.d": [1]}}, "differ in length"),
    ({"trace": "t.parquet", "system": "cpu-only", "grid": {"a.b": []}}, "empty list"),
    ({"trace": "t.parquet", "system": "cpu-only", "grid": {"a.b": [1]}, "set": {"a__b": 2}}, "in both set and grid"),
    ({"trace": "t.parquet", "system": "cpu-only", "seeds": [0.5]}, "not an integer"),
])
def test_spec_mistakes_are_one_line(spec, words):
    with pytest.raises(ConfigError) as err:
        parse_spec(spec, source="spec.yaml", base_dir=Path("."))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("spec.yaml")


@pytest.mark.parametrize("spec, words", [
    ({"traces": ["missing.parquet"], "systems": ["cpu-only"]}, "trace 'missing.parquet' not found"),
    ({"systems": ["cpu-only"], "grid": {"cache.slot": [1]}}, "unknown parameter 'cache.slot'"),
    ({"systems": ["gpu-only-lru"], "grid": {"cache.slots_per_layer": ["a"]}}, "'a' is not a valid int"),
    ({"systems": ["cpu-only"], "hw": ["rtx9090"]}, "hardware profile not found"),
    ({"systems": ["cpu-only"], "grid": {"hw.pcie.bandwith_scale": [1.0]}}, "no such profile field"),
    # a folder was 'not found'; a mapping was taken for one trace named "{'a': 1}", a list for one named '[...]'
    ({"traces": ["."], "systems": ["cpu-only"]}, "is a folder, not a trace file"),
    ({"traces": {"a": "t.parquet"}, "systems": ["cpu-only"]}, "field 'traces': a mapping is not a list of paths"),
    ({"traces": [["t.parquet"]], "systems": ["cpu-only"]}, "field 'traces', row 0: ['t.parquet'] is not a path"),
    ({"systems": {"cpu-only": 1}}, "field 'systems': a mapping is not a list of names"),
    ({"systems": ["cpu-only"], "hw": [{"gpu": 1}]}, "field 'hw', row 0: {'gpu': 1} is not a profile name or path"),
])
def test_cli_spec_errors_exit_2_with_one_line(files, capsys, spec, words):
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], **spec}))
    code = main(["sweep", str(path), "--out", str(files / "r.parquet")])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.count("\n") == 1 and str(path) in err
    assert not (files / "r.parquet").exists()


@pytest.mark.parametrize("sections, field, fix", [
    ({"grid": {"cache.slot": [1]}}, "field 'grid.cache.slot'", "valid:"),
    ({"set": {"cache.slot": 1}}, "field 'set.cache.slot'", "valid:"),
    ({"zip": [{"engine.staging_slots": [1, 2]}, {"cache.slot": [1, 2]}]}, "field 'zip[1].cache.slot'", "valid:"),
    ({"grid": {"seed": [0, 1]}}, "field 'grid.seed'", "list them at the top level, e.g. seeds: [0, 1]"),
    ({"grid": {"hw.pcie.bandwith_scale": [1.0]}}, "field 'grid.hw.pcie.bandwith_scale'",
     "did you mean hw.pcie.bandwidth_scale?"),
    ({"set": {"hw.pcie.bandwidth_scale": "fast"}}, "field 'set.hw.pcie.bandwidth_scale'", "write a number"),
    # a value of the wrong type: named where the spec gives it too (it said field 'cache.slots_per_layer')
    ({"grid": {"cache.slots_per_layer": [1, "two"]}}, "field 'grid.cache.slots_per_layer': 'two' is not",
     "write e.g. cache.slots_per_layer=2"),
    ({"zip": [{"cache.slots_per_layer": [1, 2.5], "engine.staging_slots": [1, 2]}]},
     "field 'zip[0].cache.slots_per_layer': '2.5' is not", "write e.g."),
])
def test_an_unknown_parameter_is_named_where_the_spec_gives_it(files, capsys, sections, field, fix):
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only"], **sections}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet")]) == 2
    err = capsys.readouterr().err
    assert field in err and fix in err and err.count("\n") == 1


def test_a_spec_read_from_a_pipe_resolves_its_paths_in_the_current_folder(files, monkeypatch):
    """`moesim sweep <(printf ...)`: the spec is /dev/fd/N, a pipe with no folder of its own."""
    monkeypatch.chdir(files)
    read, write = os.pipe()
    os.write(write, yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only"]}).encode())
    os.close(write)
    try:
        spec = load_spec(f"/dev/fd/{read}")
    finally:
        os.close(read)
    assert spec.resolve("t.parquet") == str(files / "t.parquet") and spec.systems == ["cpu-only"]


def test_a_spec_over_the_yaml_limit_is_refused_unread(tmp_path):
    from moesim.util import YAML_MAX_BYTES
    path = tmp_path / "big.yaml"
    path.write_text("systems: [cpu-only]\n" + "#" * YAML_MAX_BYTES)
    with pytest.raises(ConfigError, match="over 4,194,304 bytes, the limit of a YAML input"):
        load_spec(path)


# ----------------------------------------------------------------------------- running
def test_rows_hold_parameters_and_the_metrics_of_a_direct_replay(files):
    spec = load_spec(write_spec(files, systems=["cpu-only", "gpu-only-lru"],
                                grid={"cache.slots_per_layer": [1, 3]}))
    frame, summary = run_sweep(spec, workers=1)
    assert (summary.points, summary.ran, summary.skipped, summary.failed) == (4, 4, 0, 0)
    assert list(frame.columns[:7]) == ["point_id", "trace", "hw", "system", "seed", "cache.slots_per_layer", "status"]
    assert frame["system"].tolist() == ["cpu-only", "cpu-only", "gpu-only-lru", "gpu-only-lru"]
    assert frame["cache.slots_per_layer"].tolist() == [1, 3, 1, 3]
    assert {"breakdown_wait_cache_ms", "tpot_ms_mean", "gpu_hit_rate", "trace_path", "finished_at"} <= set(frame)
    direct = metrics(simulate(str(files / "t.parquet"), str(files / "hw.yaml"), "gpu-only-lru",
                              {"cache.slots_per_layer": "3"}))
    row = frame.iloc[3]
    assert row["tpot_ms_mean"] == direct["tpot_ms_mean"]
    assert row["demand_loads"] == direct["demand_loads"]
    assert row["breakdown_wait_cache_ms"] == direct["breakdown_ms"]["wait_cache"]
    assert row["trace_path"] == str(files / "t.parquet")
    # more slots, more hits; the CPU-only system loads nothing
    assert frame.iloc[2]["gpu_hit_rate"] < frame.iloc[3]["gpu_hit_rate"]
    assert frame.iloc[0]["demand_loads"] == frame.iloc[0]["pcie_h2d_bytes"] == 0


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("systems, decoded", [
    (["cpu-only", "gpu-only-lru", "static-hot"], "[]"),  # these systems read no optional column
    # gpu-only-lru reads none, hybrimoe three (the trace has one of them): one decode with the three
    (["gpu-only-lru", "hybrimoe", "cpu-only"], "['pred_next_layer', 'scores', 'weights']")])
def test_each_worker_decodes_the_trace_once_for_all_its_points_and_systems(files, monkeypatch, workers, systems,
                                                                          decoded):
    """Issue 13: the trace is read-only; a worker (this process, or each forked pool worker) decodes it
    once, with every optional column its points' systems read, whatever the number of points."""
    import moesim.trace.io as io
    with_scores(files / "t.parquet", files / "t.parquet")
    log = files / "decodes.log"
    real = io._decode_steps

    def logged(path, columns, batch_rows):
        with open(log, "a") as fh:  # forked workers inherit the patch; the file collects every process
            fh.write(f"{os.getpid()} {Path(path).name} {sorted(columns) if columns is not None else None}\n")
        yield from real(path, columns, batch_rows)
    monkeypatch.setattr(io, "_decode_steps", logged)
    monkeypatch.setattr(io, "_DECODED", type(io._DECODED)())
    spec = load_spec(write_spec(files, systems=systems, grid={"cache.slots_per_layer": [1, 2, 3, 4]}))
    frame, summary = run_sweep(spec, workers=workers)
    assert summary.failed == 0 and summary.ran == 12
    lines = log.read_text().splitlines()
    assert len(lines) == len(set(lines)) and 1 <= len({line.split()[0] for line in lines}) <= workers
    assert {line.split(" ", 1)[1] for line in lines} == {f"t.parquet {decoded}"}
    for system in systems:  # each point as its replay alone, which decodes only what it reads
        alone = metrics(simulate(str(files / "t.parquet"), str(files / "hw.yaml"), system,
                                 {"cache.slots_per_layer": "2"}))
        assert frame.loc[(frame.system == system) & (frame["cache.slots_per_layer"] == 2),
                         "tpot_ms_mean"].item() == alone["tpot_ms_mean"]


@pytest.mark.parametrize("value, words", [(-1, "is negative"), (9, "outside [0, 6]")])
def test_slots_wrong_for_every_gpu_fail_the_spec_before_any_point(files, capsys, value, words):
    path = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, value]})
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err and "cache.slots_per_layer" in err
    assert not (files / "r.parquet").exists() and not (files / "r.parquet.parts").exists()


@pytest.mark.parametrize("system, words", [("oracle", "'oracle' is a portfolio of schedules"),
                                           ("belady", "'belady' plans with the trace's future routing")])
def test_a_system_named_for_serving_that_cannot_serve_fails_the_spec(files, capsys, system, words):
    path = write_spec(files, systems=["cpu-only", system], grid={"workload.qps": [1, 4], "workload.requests": [2]})
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "field 'systems'" in err and words in err
    assert not (files / "r.parquet").exists()


def test_systems_all_in_a_serving_sweep_runs_and_records_those_that_cannot_serve(files, capsys):
    """`all` is every listed system: the oracle cannot serve, which fails its points only."""
    path = write_spec(files, systems="all", grid={"workload.qps": [4], "workload.requests": [2]})
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"])
    assert exit_.value.code == 1
    frame = pd.read_parquet(files / "r.parquet")
    failed = frame[frame["status"] == "error"]
    assert "oracle" in set(failed["system"]) and (frame["status"] == "ok").sum() >= 10


def test_a_failing_point_is_recorded_and_the_rest_run(files, capsys):
    path = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 6, 2]}, set=TIGHT_GPU)
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "2"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    assert "3 points: 3 run, 0 already" in out and "1 failed" in out
    assert "does not fit" in err
    frame = pd.read_parquet(files / "r.parquet")
    assert sorted(frame["status"]) == ["error", "ok", "ok"]
    failed = frame[frame["status"] == "error"].iloc[0]
    assert failed["cache.slots_per_layer"] == 6 and np.isnan(failed["tpot_ms_mean"])
    assert not (files / "r.parquet.parts").exists()  # complete: parts merged and removed


def test_a_sweep_whose_every_point_fails_on_its_input_writes_nothing_and_says_so_once(files, capsys):
    out = files / "r.parquet"
    path = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [5, 6]}, set=TIGHT_GPU)
    assert main(["sweep", str(path), "--out", str(out), "--workers", "1"]) == 2
    stdout, err = capsys.readouterr()
    assert stdout == ""  # no summary line naming an output that is not there
    assert err.count("\n") == 1 and err.startswith(f"moesim: error: {path}: all 2 points failed on bad input")
    assert "nothing written" in err and "does not fit" in err
    assert err.count("(fix: ") == 1 and err.rstrip().endswith("(fix: use at most 7 slots in all "
                                                              "(cache.slots_per_layer <= 3))")
    assert not out.exists() and not (files / "r.parquet.parts").exists()
    # into an existing results file: the failed rows are kept there, and the line says where
    good = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1]}, set=TIGHT_GPU)
    assert main(["sweep", str(good), "--out", str(out), "--workers", "1"]) == 0
    assert " ".join(capsys.readouterr().out.split()).startswith("1 point: 1 run, 0 already")  # not "1 points"
    bad = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [5, 6]}, set=TIGHT_GPU)
    capsys.readouterr()
    assert main(["sweep", str(bad), "--out", str(out), "--workers", "1"]) == 2
    stdout, err = capsys.readouterr()
    line = " ".join(stdout.split())  # rich wraps long lines
    assert line.startswith("2 points: 2 run, 0 already")
    assert line.endswith(f"-> {out}; it also holds 1 row of points outside this spec, which `moesim plot` and "
                         "`moesim report` show too (another file keeps sweeps apart)")
    assert err.count("\n") == 1 and err.count("(fix: ") == 1 and f"column 'error' of {out}" in err
    assert sorted(pd.read_parquet(out)["status"]) == ["error", "error", "ok"]


def test_rerun_skips_finished_points_and_retries_failed_ones(files):
    out = files / "r.parquet"
    spec = load_spec(write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2, 6]},
                                set=TIGHT_GPU))
    first, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.failed) == (3, 1)
    again, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.skipped, summary.failed) == (1, 2, 1)  # only the failed point again
    ok = first["status"] == "ok"
    assert again.loc[ok, "finished_at"].tolist() == first.loc[ok, "finished_at"].tolist()
    # a grown grid runs only its new points; rows of the old ones stay in the file
    grown = load_spec(write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [2, 3]},
                                 set=TIGHT_GPU))
    frame, summary = run_sweep(grown, out, workers=1)
    assert (summary.ran, summary.skipped) == (1, 1)
    assert frame["cache.slots_per_layer"].tolist() == [2, 3]
    assert sorted(pd.read_parquet(out)["cache.slots_per_layer"]) == [1, 2, 3, 6]


def test_the_results_file_is_in_spec_order_whichever_point_finished_first(files):
    """The file held rows in the order points finished (a resumed or parallel sweep shuffled them) and, when
    the first to finish had failed, its columns began with the wall-clock ones: the same sweep wrote
    different files, unlike the frame `moesim.sweep` returns."""
    out = files / "r.parquet"
    run_sweep(load_spec(write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [6, 2]},
                                   set=TIGHT_GPU)), out, workers=1)
    spec = load_spec(write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2, 3]},
                                set=TIGHT_GPU))
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.skipped) == (2, 1)
    stored = pd.read_parquet(out)
    # the spec's points in its order, then the row of the point outside it
    assert stored["cache.slots_per_layer"].tolist() == [1, 2, 3, 6]
    assert stored["status"].tolist() == ["ok", "ok", "ok", "error"]
    columns = stored.columns.tolist()
    assert columns[:9] == ["point_id", "trace", "hw", "system", "seed", *TIGHT_GPU, "cache.slots_per_layer"]
    assert columns.index("tpot_ms_mean") < columns.index("point_wall_s") < columns.index("input_fingerprint")
    assert columns == frame.columns.tolist()
    pd.testing.assert_frame_equal(stored.head(3), frame)


def test_the_summary_says_when_the_output_holds_rows_of_another_sweep(files, capsys):
    """Rows of points outside the spec stay in the output, and plot and report read them all: the summary
    said only '2 points: 2 run, 0 already in r.parquet', as if the file held this sweep alone."""
    out = files / "r.parquet"
    first = write_spec(files, systems=["gpu-only-lru", "cpu-only"], grid={"cache.slots_per_layer": [1, 2]})
    assert main(["sweep", str(first), "--out", str(out), "--workers", "1"]) == 0
    line = " ".join(capsys.readouterr().out.split())
    assert line.startswith("4 points: 4 run, 0 already") and "outside this spec" not in line
    other = write_spec(files, systems=["static-hot"], grid={"cache.slots_per_layer": [1, 2]})
    assert main(["sweep", str(other), "--out", str(out), "--workers", "1"]) == 0
    line = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert line.startswith("2 points: 2 run, 0 already in")
    assert line.endswith(f"-> {out}; it also holds 4 rows of points outside this spec, which `moesim plot` and "
                         "`moesim report` show too (another file keeps sweeps apart)")
    assert len(pd.read_parquet(out)) == 6
    assert main(["sweep", str(other), "--out", str(out), "--workers", "1"]) == 0  # a resume says it again
    assert "2 already in" in " ".join(capsys.readouterr().out.split())


def test_a_resume_runs_again_the_points_whose_profile_or_trace_changed(files, capsys):
    """Issue: a point's id holds the file names only; the files' fingerprint, stored with its row, tells
    a resume that an edited profile (its content) or a rewritten trace (its size and mtime) needs a rerun."""
    out = files / "r.parquet"
    path = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2]})
    spec = load_spec(path)
    first, _ = run_sweep(spec, out, workers=1)
    again, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.skipped, summary.changed) == (0, 2, 0)
    assert again["finished_at"].tolist() == first["finished_at"].tolist()

    profile = yaml.safe_load((files / "hw.yaml").read_text())
    profile["pcie"]["h2d"]["gbps"] = [g / 4 for g in profile["pcie"]["h2d"]["gbps"]]  # slower expert loads
    (files / "hw.yaml").write_text(yaml.safe_dump(profile))
    edited, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.skipped, summary.changed) == (2, 0, 2)
    direct = metrics(simulate(str(files / "t.parquet"), str(files / "hw.yaml"), "gpu-only-lru",
                              {"cache.slots_per_layer": "1"}))
    assert edited["tpot_ms_mean"].iloc[0] == direct["tpot_ms_mean"] > first["tpot_ms_mean"].iloc[0]
    assert edited["input_fingerprint"].nunique() == 1
    assert edited["input_fingerprint"].iloc[0] != first["input_fingerprint"].iloc[0]

    trace = files / "t.parquet"
    os.utime(trace, ns=(trace.stat().st_atime_ns, trace.stat().st_mtime_ns + 10**9))  # rewritten, same size
    code = main(["sweep", str(path), "--out", str(out), "--workers", "1"])
    assert code == 0
    assert capsys.readouterr().out.startswith("2 points: 2 run (2 because their trace or profile changed), 0 already")
    assert run_sweep(spec, out, workers=1)[1].ran == 0


def test_results_of_older_versions_without_fingerprints_are_run_again(files):
    """Rows written before fingerprints were recorded cannot tell whether their inputs changed: run again."""
    out = files / "r.parquet"
    spec = load_spec(write_spec(files, systems=["cpu-only", "gpu-only-lru"]))
    run_sweep(spec, out, workers=1)
    old = pq.read_table(out)
    pq.write_table(old.drop_columns(["input_fingerprint"]), out)
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.skipped, summary.changed) == (2, 0, 2)
    assert frame["input_fingerprint"].notna().all()
    assert run_sweep(spec, out, workers=1)[1].ran == 0


def test_parts_survive_an_interrupted_run(files):
    """Rows written as parts but never merged (the process died) are read back on the next run."""
    out = files / "r.parquet"
    spec = load_spec(write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2]}))
    points = spec.points()
    from moesim.sweep import input_fingerprint, run_point
    store = ResultStore(out)
    store.add({**run_point(points[0], str(files / "t.parquet"), str(files / "hw.yaml")), "trace_path": "x",
               "input_fingerprint": input_fingerprint(str(files / "t.parquet"), str(files / "hw.yaml"))})
    store._unlock(remove_dir=False)  # as if killed: no merge, lock released by the OS
    assert not out.exists() and (files / "r.parquet.parts" / f"{points[0].point_id}.parquet").exists()
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.skipped) == (1, 1)
    assert frame["status"].tolist() == ["ok", "ok"]


def test_a_second_writer_is_refused(files):
    out = files / "r.parquet"
    store = ResultStore(out)
    try:
        with pytest.raises(ConfigError, match="another sweep is writing this output"):
            ResultStore(out)
    finally:
        store.close(complete=True)
    ResultStore(out).close(complete=True)  # free again


@pytest.mark.parametrize("content, words", [("trace", "not a sweep result"), ("garbage", "not a readable Parquet")])
def test_output_that_is_not_a_sweep_result_is_refused_leaving_nothing_behind(files, content, words):
    other = files / "other.parquet"
    if content == "trace":
        pq.write_table(pq.read_table(files / "t.parquet"), other)
    else:
        other.write_text("not parquet\n")
    before = other.read_bytes()
    spec = load_spec(write_spec(files, systems=["cpu-only"]))
    with pytest.raises(ConfigError, match=words):
        run_sweep(spec, other)
    assert other.read_bytes() == before
    assert not (files / "other.parquet.parts").exists()  # no lock folder left behind
    assert sorted(p.name for p in files.iterdir()) == ["hw.yaml", "other.parquet", "spec.yaml", "t.parquet"]


def test_columns_mixing_numbers_and_strings_are_stored_as_strings(files):
    out = files / "r.parquet"
    spec = load_spec(write_spec(files, systems=["cpu-only"], grid={"memory.expert_dtype": ["bf16", ""]}))
    frame, _ = run_sweep(spec, out, workers=1)
    stored = pd.read_parquet(out)
    assert sorted(stored["memory.expert_dtype"]) == ["", "bf16"]
    mixed = pd.DataFrame([{"point_id": "a", "status": "ok", "k": 4}, {"point_id": "b", "status": "ok", "k": "auto"}])
    from moesim.sweep.store import _arrow_table
    assert _arrow_table(mixed).column("k").to_pylist() == ["4", "auto"]


def test_kill_9_midway_then_rerun_completes_only_the_missing_points(tmp_path):
    spec = spec_for_kill(tmp_path)
    out = tmp_path / "r.parquet"
    parts = tmp_path / "r.parquet.parts"
    cmd = [sys.executable, "-m", "moesim.cli", "sweep", str(spec), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(parts.glob("*.parquet"))) < 4 and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its workers, as kill -9 would
    proc.wait()
    finished = {p.stem: pq.read_table(p).column("finished_at")[0].as_py() for p in parts.glob("*.parquet")}
    assert 4 <= len(finished) < 16, "the kill should land midway"

    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"16 points: {16 - len(finished)} run, {len(finished)} already" in done.stdout
    frame = pd.read_parquet(out)
    assert len(frame) == 16 and frame["point_id"].is_unique and (frame["status"] == "ok").all()
    assert set(frame["point_id"]) == {p.point_id for p in load_spec(spec).points()}
    by_id = frame.set_index("point_id")["finished_at"]
    assert {pid: by_id[pid] for pid in finished} == finished  # finished points were not recomputed
    assert not parts.exists()


def test_a_lock_whose_owner_is_gone_is_taken_over(files):
    """Processes left behind by a killed sweep may still hold the lock file; its recorded owner is dead,
    so the next sweep takes over (and a live owner is still refused, named)."""
    import fcntl
    import socket
    out = files / "r.parquet"
    parts = files / "r.parquet.parts"
    parts.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    held = os.open(parts / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as an orphaned worker would
        os.write(held, f"{socket.gethostname()} {int(dead.stdout)}\n".encode())
        store = ResultStore(out)  # takes over
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
            ResultStore(out)  # now the owner (this process) is alive
        store.close(complete=True)
    finally:
        os.close(held)


def _workers_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in children.read_text().split()] if children.exists() else []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_kill_9_of_the_sweep_alone_leaves_no_worker_and_resume_loses_nothing(tmp_path):
    """kill -9 of the sweep process only (not its group), at random moments: its pool workers die with it,
    the next run is not blocked by the lock, and every point ends up in the results exactly once."""
    spec = spec_for_kill(tmp_path)
    out = tmp_path / "r.parquet"
    parts = tmp_path / "r.parquet.parts"
    cmd = [sys.executable, "-m", "moesim.cli", "sweep", str(spec), "--out", str(out), "--workers", "2"]
    rng = np.random.default_rng(14)
    for delay in rng.uniform(0.0, 0.5, size=2):
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_workers_of(proc.pid)) < 2 and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(delay)  # a random moment while the pool runs
        workers = _workers_of(proc.pid)
        assert workers and proc.poll() is None, "the kill should land while the pool runs"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
            time.sleep(0.05)
        alive = [w for w in workers if Path(f"/proc/{w}/status").exists()
                 and "zombie" not in Path(f"/proc/{w}/status").read_text()]
        assert not alive, f"pool workers {alive} outlived the sweep"
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    frame = pd.read_parquet(out)
    assert len(frame) == 16 and frame["point_id"].is_unique and (frame["status"] == "ok").all()
    assert set(frame["point_id"]) == {p.point_id for p in load_spec(spec).points()}
    assert not parts.exists()


#: `python -c` running the CLI with every point but those of 1 slot per layer slow (60 s) in the pool workers
#: (forked: they inherit the patch), so that a Ctrl-C lands while workers are busy
SLOW_POINTS = """
import signal, sys, time
# Ctrl-C as a terminal gives it: a test runner started in the background (nohup, `cmd &` in a script)
# hands its children SIGINT ignored, and the sweep would rightly ignore it too
signal.signal(signal.SIGINT, signal.default_int_handler)
from moesim.sweep import engines
from moesim.cli import main
real = engines.run_point
def slow(point, trace, hw):
    if dict(point.settings)["cache.slots_per_layer"] != 1:
        time.sleep(60)
    return real(point, trace, hw)
engines.run_point = slow
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the workers from /proc")
@pytest.mark.parametrize("to", ["group", "sweep", "kill"])
def test_ctrl_c_stops_a_pool_sweep_at_once_keeping_the_finished_points(files, to):
    """Issue: Ctrl-C (SIGINT to the process group, as a terminal sends it, or to the sweep process
    only) cancels the pool's pending points and ends its workers at once, without their tracebacks;
    the points finished are kept for the resume. `kill PID` (SIGTERM to the sweep) does the same, with
    the status a shell shows for it (143)."""
    path = write_spec(files, systems=["gpu-only-lru", "cpu-only"], grid={"cache.slots_per_layer": [1, 2, 3]})
    out, parts = files / "r.parquet", files / "r.parquet.parts"
    args = ["sweep", str(path), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_POINTS, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(parts.glob("*.parquet")) and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(0.2)  # the first point's worker has taken up a slow one
    workers = _workers_of(proc.pid)
    assert len(workers) == 2 and proc.poll() is None
    sent = time.monotonic()
    if to == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM if to == "kill" else signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the sweep still ran 10 s after SIGINT")
    assert proc.returncode == (143 if to == "kill" else 130) and time.monotonic() - sent < 5
    lines = [line for line in stderr.splitlines() if line.strip()]  # no worker traceback
    assert lines[-1] == ("moesim: terminated" if to == "kill" else "moesim: interrupted") and stdout == "", stderr
    assert lines[:-1] == [f"sweep: every finished point is kept in {out}.parts/; the same command resumes"], stderr
    assert not [w for w in workers if Path(f"/proc/{w}").exists()], "a worker outlived the sweep"
    finished = {p.stem for p in parts.glob("*.parquet")}
    assert len(finished) == 1  # the one quick point of gpu-only-lru; cpu-only's was not started
    done = subprocess.run([sys.executable, "-m", "moesim.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "6 points: 5 run, 1 already" in done.stdout
    assert set(pd.read_parquet(out)["point_id"]) == {p.point_id for p in load_spec(path).points()}


#: SLOW_POINTS with the Ctrl-C taken by another thread of the sweep process: a thread that does not block
#: SIGINT sends it to itself once the first point is saved (the kernel may hand a process-wide signal to any
#: such thread; the main thread must still see it while it waits for points that run a minute)
SIGINT_IN_ANOTHER_THREAD = SLOW_POINTS.replace("engines.run_point = slow\n", """engines.run_point = slow
import threading
from pathlib import Path
parts = Path(sys.argv[sys.argv.index("--out") + 1] + ".parts")
def interrupt():
    while not list(parts.glob("*.parquet")):
        time.sleep(0.02)
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
""")


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_ctrl_c_taken_by_another_thread_still_stops_the_sweep_at_once(files):
    path = write_spec(files, systems=["gpu-only-lru", "cpu-only"], grid={"cache.slots_per_layer": [1, 2, 3]})
    out = files / "r.parquet"
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", SIGINT_IN_ANOTHER_THREAD, "sweep", str(path), "--out", str(out),
                               "--workers", "2"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the sweep still ran 30 s after a Ctrl-C taken by a thread other than the main one")
    assert done.returncode == 130 and done.stderr.strip().endswith("moesim: interrupted"), done.stderr
    assert time.monotonic() - started < 20  # its slow points sleep a minute: they were stopped, not waited for


def _dies_on(slots: int, times: int, marks: Path):
    """A run_point that SIGKILLs its own worker process on the points of ``slots`` slots per layer, the
    first ``times`` times (counted in files under ``marks``: the workers are separate processes)."""
    from moesim.sweep import run_point

    def dying(point, trace, hw):
        if dict(point.settings)["cache.slots_per_layer"] == slots:
            deaths = len(list(marks.glob(f"{point.point_id}.*")))
            if deaths < times:
                (marks / f"{point.point_id}.{deaths}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return run_point(point, trace, hw)
    return dying


def test_a_sigterm_handler_of_the_sweep_process_does_not_reach_its_workers(files):
    """`ray.init` in a notebook leaves a SIGTERM handler that exits with status 15: pool workers forked with
    it would not die of the SIGTERM the pool ends them with, and a worker stopped beside a killed one would
    be blamed (and its point retried) as if it had died."""
    marks = files / "marks"
    marks.mkdir()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init installs
    try:
        from moesim.sweep import engines
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engines, "run_point", _dies_on(2, 1, marks))
            path = write_spec(files, systems=["gpu-only-lru", "static-hot"], grid={"cache.slots_per_layer": [1, 2, 3]})
            _, summary = run_sweep(load_spec(path), files / "r.parquet", workers=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (summary.ran, summary.retried, summary.failed) == (6, 2, 0)


@pytest.mark.parametrize("times", [1, 2])
def test_a_worker_killed_mid_sweep_costs_only_its_own_point(files, monkeypatch, capsys, times):
    """Issue: a pool worker killed (kill -9, the OOM killer) broke the pool and failed every point left.
    The pool is rebuilt for the points not finished; the dead worker's point is retried once, and recorded
    as failed, naming the worker and the signal, when its worker dies again."""
    from moesim.sweep import engines
    marks = files / "marks"
    marks.mkdir()
    monkeypatch.setattr(engines, "run_point", _dies_on(2, times, marks))
    path = write_spec(files, systems=["gpu-only-lru", "static-hot"], grid={"cache.slots_per_layer": [1, 2, 3]})
    spec = load_spec(path)
    frame, summary = run_sweep(spec, files / "r.parquet", workers=2)
    assert (summary.ran, summary.retried, summary.failed) == (6, 2, 2 if times == 2 else 0)
    assert len(list(marks.iterdir())) == 2 * times  # no point was charged with another's death
    dying = frame["cache.slots_per_layer"] == 2
    assert (frame.loc[~dying, "status"] == "ok").all()  # the points beside them did not suffer
    if times == 1:
        assert (frame.loc[dying, "status"] == "ok").all()
        alone, _ = run_sweep(spec, workers=1)
        assert frame["tpot_ms_mean"].tolist() == alone["tpot_ms_mean"].tolist()
        return
    for error in frame.loc[dying, "error"]:
        assert error.startswith("its worker process died while running it, on every try: pid ")
        assert error.count("killed by SIGKILL") == 2
    # the CLI, on a sweep of the dying points only: exit 1 (a dead worker is no bad input, exit 2), the results
    # kept, the reasons shown
    for mark in marks.iterdir():
        mark.unlink()
    only = write_spec(files, systems=["gpu-only-lru", "static-hot"], grid={"cache.slots_per_layer": [2]})
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(only), "--out", str(files / "only.parquet"), "--workers", "2"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    assert out.startswith("2 points: 2 run (2 retried after a worker process died), 0 already in")
    assert err.count("killed by SIGKILL") == 4 and len(list(marks.iterdir())) == 4
    assert pd.read_parquet(files / "only.parquet")["status"].tolist() == ["error", "error"]


def test_a_fault_in_a_listed_profile_names_its_file_and_field_then_the_spec(files, capsys):
    """As `moesim replay --hw` names it: the profile and its field (not the spec's 'hw'), then the spec."""
    bad = yaml.safe_load((files / "hw.yaml").read_text())
    del bad["gpu"]["memory_gib"]
    (files / "bad.yaml").write_text(yaml.safe_dump(bad))
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["bad.yaml"], "systems": ["cpu-only"]}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet")]) == 2
    err = capsys.readouterr().err
    assert f"bad.yaml, field 'gpu.memory_gib': missing field (listed in {path} under 'hw')" in err
    assert err.count("\n") == 1 and not (files / "r.parquet").exists()


def test_an_interrupted_sweep_says_stopped_not_done(files, monkeypatch):
    """The closing progress line of a sweep stopped by Ctrl-C says so, with the points it had finished."""
    import io

    from moesim.sweep import engines
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")
    spec = load_spec(write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2, 3]}))
    run_point = engines.run_point
    ran = []

    def second_is_interrupted(*job):
        ran.append(job)
        if len(ran) == 2:
            raise KeyboardInterrupt
        return run_point(*job)

    monkeypatch.setattr(engines, "run_point", second_is_interrupted)
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, files / "r.parquet", workers=1, progress=True, console=_PlainConsole(stream))
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("sweep: stopped, 1/3 points"), stream.getvalue()
    stream = io.StringIO()
    run_sweep(spec, files / "r.parquet", workers=1, progress=True, console=_PlainConsole(stream))
    assert stream.getvalue().splitlines()[-1].startswith("sweep: done, 3/3 points"), stream.getvalue()


class _PlainConsole:
    """What the sweep's progress needs of a console: the stream it writes to (not a terminal)."""

    def __init__(self, stream):
        self.file = stream


def test_systems_all_leaves_out_a_system_that_cannot_run_on_a_trace_and_a_named_one_fails(files):
    """`systems: all` over a trace without scores: importance (whose cache ranks by scores) was a failed point
    and the sweep exited 1; now it is left out of that trace, with the reason, while on a trace with scores it
    runs. Named in the spec, it is the user's request: its point fails, with the same reason."""
    from moesim.trace.synth import SynthConfig, synthesize
    from tests.factories import tiny_model
    for name, scores in (("s.parquet", True), ("n.parquet", False)):  # every column, or every one but scores
        synthesize(SynthConfig.from_settings(model=tiny_model(layers=2, experts=6, top_k=2), prompt_len=4,
                                             decode_len=8, scores=scores), files / name)
    spec = load_spec(write_spec(files, traces=["n.parquet", "s.parquet"], systems="all"))
    out = files / "r.parquet"
    frame, summary = run_sweep(spec, out, workers=1)
    every = len(spec.points())
    assert summary.failed == 0 and summary.points == summary.ran == every - 1
    assert len(summary.left_out) == 1 and summary.left_out[0].startswith("importance: ")
    assert "needs the trace column 'scores'" in summary.left_out[0]
    assert set(frame.loc[frame["system"] == "importance", "trace"]) == {"s.parquet"}
    assert (frame["status"] == "ok").all() and len(pd.read_parquet(out)) == every - 1
    again = run_sweep(spec, out, workers=1)[1]
    assert (again.ran, again.skipped, again.left_out) == (0, every - 1, summary.left_out)
    named = load_spec(write_spec(files, traces=["n.parquet"], systems=["importance", "cpu-only"]))
    frame, summary = run_sweep(named, files / "named.parquet", workers=1)
    assert summary.failed == 1 and summary.left_out == ()
    assert "needs the trace column 'scores'" in frame.set_index("system").loc["importance", "error"]


def test_moesim_sweep_over_all_exits_0_and_says_what_it_left_out(files, capsys):
    """`moesim sweep` with `systems: all` over a trace without scores exited 1 with importance 'failed'."""
    spec = write_spec(files, systems="all")
    assert main(["sweep", str(spec), "--out", str(files / "r.parquet"), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert "0 failed" in captured.out
    left = [line for line in captured.err.splitlines() if line.startswith("left out ")]
    assert len(left) == 1 and left[0].startswith("left out importance: ") and "'scores'" in left[0], captured.err


@pytest.mark.parametrize("failing_write", [2, 4])  # a point's part, or the merge into OUT at the end
def test_a_full_disk_mid_sweep_is_one_line_and_the_finished_points_are_kept(files, capsys, monkeypatch, failing_write):
    """A disk that filled up while a sweep wrote its parts or its output ended in an internal error."""
    import pyarrow.parquet as pq
    out = files / "r.parquet"
    spec = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2, 3]})
    real, calls = pq.write_table, []

    def full(table, where, *args, **kwargs):
        calls.append(where)
        if len(calls) >= failing_write:
            raise OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        return real(table, where, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", full)
    assert main(["sweep", str(spec), "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "internal error" not in err and "No space left on device" in err, err
    assert err.startswith("moesim: error: ") and "the same command resumes" in err, err
    kept = sorted(p.name for p in (files / "r.parquet.parts").glob("*.parquet"))
    assert len(kept) == min(failing_write - 1, 3)
    assert not [p for p in files.rglob("*.tmp")]  # no temporary file left on the full disk
    monkeypatch.setattr(pq, "write_table", real)
    assert main(["sweep", str(spec), "--out", str(out), "--workers", "1"]) == 0
    assert f"3 points: {3 - len(kept)} run, {len(kept)} already in" in capsys.readouterr().out
