"""`moesim sweep`: running the points, results on disk, resuming, the local pool (spec expansion and point ids:
test_sweep_spec.py; kill -9, Ctrl-C and dying workers: test_sweep_interrupts.py; the Ray engine: test_ray_engine.py)."""

from __future__ import annotations

import os
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
from moesim.sweep import ResultStore, input_fingerprint, load_spec, run_sweep
from tests.factories import TIGHT_GPU, with_scores, write_spec
from tests.policy.test_imports import _policy_file, forget  # noqa: F401 (a fixture)


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


def test_a_failing_point_is_recorded_and_the_rest_run(files, capsys):
    path = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [1, 6, 2]}, set=TIGHT_GPU)
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "2"]) == 1
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
    assert err.count("(fix: ") == 1 and err.rstrip().endswith("(fix: set cache.slots=7 or fewer (or "
                                                              "cache.slots_per_layer=3 or fewer, the same count "
                                                              "on every layer))")
    assert not out.exists() and not (files / "r.parquet.parts").exists()
    # one point: said of one point, its reason as "why"
    one = write_spec(files, systems=["gpu-only-lru"], grid={"cache.slots_per_layer": [5]}, set=TIGHT_GPU)
    assert main(["sweep", str(one), "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: error: {one}: the one point failed on bad input, nothing written; why: ")
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


def test_a_trace_written_two_ways_runs_once(files):
    """traces: [t.parquet, ./t.parquet] ran the same replay twice and wrote two rows; one now, also on resume."""
    out = files / "r.parquet"
    spec = load_spec(write_spec(files, traces=["t.parquet", "./t.parquet", str(files / "t.parquet")],
                                hw=["hw.yaml", "./hw.yaml"], systems=["gpu-only-lru"]))
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.points, summary.ran, len(frame), len(pd.read_parquet(out))) == (1, 1, 1, 1)
    assert (frame["trace"].iloc[0], frame["hw"].iloc[0]) == ("t.parquet", "hw.yaml")
    assert run_sweep(load_spec(write_spec(files, systems=["gpu-only-lru"])), out, workers=1)[1].ran == 0


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
    assert capsys.readouterr().out.startswith("2 points: 2 run (2 because their trace, profile or policy module "
                                              "changed), 0 already")
    assert run_sweep(spec, out, workers=1)[1].ran == 0


def test_a_point_of_ones_own_runs_again_once_its_policy_module_changed(files, forget):
    """A policy edited and its sweep rerun into the same file kept the old code's results ("2 already in"): the
    fingerprint held the trace and profile only. Now its points run again; gpu-only-lru's stay."""
    policy = _policy_file(files, "rerun_policies")
    path = write_spec(files, systems=["rerun_policies-sys", "gpu-only-lru"], grid={"cache.slots_per_layer": [1]},
                      **{"import": ["rerun_policies.py"]})
    out = files / "r.parquet"
    assert run_sweep(load_spec(path), out, workers=1)[1].ran == 2
    assert run_sweep(load_spec(path), out, workers=1)[1].ran == 0
    policy.write_text(policy.read_text() + "\n# tuned: another eviction order\n")
    frame, summary = run_sweep(load_spec(path), out, workers=1)
    assert (summary.ran, summary.changed, summary.skipped) == (1, 1, 1)
    assert frame["input_fingerprint"].nunique() == 2  # the catalogue point's own, unchanged
    assert run_sweep(load_spec(path), out, workers=1)[1].ran == 0


def test_a_point_of_ones_own_runs_again_once_a_default_or_its_composition_changed(files, forget):
    """Edited in a notebook cell and rerun into the same file, a policy's parameter default (decay: float = 0.9 to
    0.1) and a system registered again with another assign= both kept the old results: the fingerprint hashed the
    methods' bytecode only, and a system of one's own built of catalogue components not at all."""
    from dataclasses import dataclass

    from moesim.policy.cache import LRUCache
    from moesim.policy.systems import SystemSpec, register_component, register_system

    def define(default: int) -> None:  # a notebook cell, run again with another default
        @register_component
        @dataclass
        class EditedDefault(LRUCache):
            name = "edited-default"
            keep: int = default

    define(0)
    register_system("edited-sys", SystemSpec("x", cache="edited-default", assign="gpu"))
    register_system("edited-plain", SystemSpec("y", cache="lru", assign="gpu"))
    spec = load_spec(write_spec(files, systems=["edited-sys", "edited-plain"]))
    out = files / "r.parquet"
    assert run_sweep(spec, out, workers=1)[1].ran == 2
    assert run_sweep(spec, out, workers=1)[1].ran == 0
    define(1)
    assert run_sweep(spec, out, workers=1)[1].changed == 1
    register_system("edited-plain", SystemSpec("y", cache="lru", assign="cpu"))
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.changed) == (1, 1)
    assert frame.set_index("system").loc["edited-plain", "gpu_share_of_activations"] == 0.0
    assert run_sweep(spec, out, workers=1)[1].ran == 0


#: a notebook cell defining a cache policy that reads module-level constants (exec'd into a namespace of its
#: own, as a notebook's: the class has no module file to hash)
_TUNED_CELL = """
from dataclasses import dataclass

from moesim.policy.cache import LRUCache
from moesim.policy.systems import register_component

THRESHOLD = 3
FAVOURITES = {"layers": (0, 1), "experts": frozenset({"e1", "e2"})}
UNREAD = 1.5


def helper():
    return THRESHOLD


@register_component
@dataclass
class Tuned(LRUCache):
    name = "tuned-globals"

    def victims(self, view, layer, n, protected, incoming=None):
        chosen = LRUCache.victims(self, view, layer, n, protected, incoming)
        if n < THRESHOLD or layer not in FAVOURITES["layers"]:
            return chosen
        return sorted(chosen, key=lambda e: f"e{e}" in FAVOURITES["experts"])  # read in a nested code object
"""


def test_a_point_of_ones_own_runs_again_once_a_module_constant_its_code_reads_changed(files, forget):
    """THRESHOLD = 3 at a notebook's top level, read in the policy's victims(), edited to 4 and the sweep rerun
    into the same file: the old value's results were kept ("1 already in"), since only the methods' code was
    hashed. Now a changed value of simple data any of its methods reads (through a lambda too) runs its points
    again; an unread global, or a function, does not."""
    from moesim.policy.systems import SystemSpec, register_system

    cell = {"__name__": "notebook_cell_tuned"}
    exec(_TUNED_CELL, cell)  # noqa: S102 - a notebook cell
    register_system("tuned-globals-sys", SystemSpec("x", cache="tuned-globals", assign="gpu"))
    spec = load_spec(write_spec(files, systems=["tuned-globals-sys", "gpu-only-lru"]))
    out = files / "r.parquet"
    assert run_sweep(spec, out, workers=1)[1].ran == 2
    assert run_sweep(spec, out, workers=1)[1].ran == 0
    cell["THRESHOLD"] = 4
    frame, summary = run_sweep(spec, out, workers=1)
    assert (summary.ran, summary.changed, summary.skipped) == (1, 1, 1)
    assert frame.set_index("system").loc["gpu-only-lru", "input_fingerprint"] == \
        input_fingerprint(str(files / "t.parquet"), str(files / "hw.yaml"))  # the catalogue's: not hashed
    cell["FAVOURITES"] = {"layers": (0, 1), "experts": frozenset({"e1", "e3"})}  # read only inside the lambda
    assert run_sweep(spec, out, workers=1)[1].changed == 1
    cell["UNREAD"] = 2.5
    cell["helper"] = lambda: 4
    frame, summary = run_sweep(spec, out, workers=1)
    assert summary.ran == 0 and (frame["status"] == "ok").all()


def test_module_data_is_written_the_same_way_in_every_process():
    """A set's order changes with the process's string hashing: written sorted, a resume in a new Python
    process finds the fingerprint the last one stored."""
    import subprocess
    import sys
    code = ("from moesim.sweep.point import _data_text; "
            "print(_data_text({'experts': frozenset(f'e{i}' for i in range(12)), 'n': (1, 2.5, True, None)}))")
    texts = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                            capture_output=True, text=True, check=True).stdout for seed in range(3)}
    assert len(texts) == 1
    assert texts.pop().strip() == ("{'experts': frozenset(" + ", ".join(sorted(f"'e{i}'" for i in range(12)))
                                   + "), 'n': (1, 2.5, True, None)}")


def _policy_code(body: str) -> bytes:
    """:func:`moesim.sweep.point._bytecode` of a class defined, as in a notebook cell, with ``body``."""
    from moesim.sweep.point import _bytecode
    cell: dict = {"__name__": "notebook_cell_code"}
    exec("class Policy:\n" + body, cell)  # noqa: S102 - a notebook cell
    return _bytecode(cell["Policy"])


def test_a_lambdas_body_a_propertys_code_and_a_static_methods_code_enter_the_fingerprint():
    """Editing ``key=lambda e: e * 2`` to ``* 3`` inside a method, a property's getter, or a static or class
    method kept the old code's results: only a method's own instructions were hashed, not the code nested in it,
    and a property or static method has no ``__code__`` of its own."""
    def method(inner: str) -> str:
        return f"    def victims(self, xs):\n        return sorted(xs, key=lambda e: {inner})\n"

    assert _policy_code(method("e * 2")) != _policy_code(method("e * 3"))
    assert _policy_code(method("[x for x in (e, 2)]")) != _policy_code(method("[x for x in (e, 3)]"))
    for decorator in ("@property", "@staticmethod", "@classmethod"):
        first, second = (f"    {decorator}\n    def size(x):\n        return {n}\n" for n in ("'a'", "'b'"))
        assert _policy_code(first) != _policy_code(second), decorator
    # a method with nothing nested is hashed as before: its stored results stay
    plain = "    def victims(self, xs):\n        return xs[:2]\n"
    from moesim.sweep.point import _nested_code
    cell: dict = {}
    exec("class Policy:\n" + plain, cell)  # noqa: S102
    assert _nested_code(cell["Policy"].victims.__code__) == b""
    assert _policy_code(plain) == _policy_code(plain)


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


def test_an_empty_output_path_from_python_is_said_to_be_empty(files, monkeypatch):
    """`moesim.sweep(spec, out="")` (an unset variable) said "., field 'out': the sweep output is a folder": Path('')
    is the current folder. Now it says the path is empty, as the command line does, and writes nothing."""
    import moesim
    monkeypatch.chdir(files)
    with pytest.raises(ConfigError) as err:
        moesim.sweep(str(write_spec(files, systems=["cpu-only"])), out="")
    assert str(err.value) == "field 'out': the output path is empty (fix: give a file name)"
    assert sorted(p.name for p in files.iterdir()) == ["hw.yaml", "spec.yaml", "t.parquet"]


@pytest.mark.parametrize("in_the_way", ["file", "lock folder"])
def test_a_parts_folder_that_cannot_be_made_is_one_line_exit_2(files, capsys, in_the_way):
    """OUT.parts a file (or OUT.parts/.lock a folder) was an internal error with a traceback's last line."""
    parts = files / "r.parquet.parts"
    if in_the_way == "file":
        parts.write_text("mine\n")
    else:
        (parts / ".lock").mkdir(parents=True)
    write_spec(files, systems=["cpu-only"])
    assert main(["sweep", str(files / "spec.yaml"), "--out", str(files / "r.parquet"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err
    assert "field '--out'" in err and "cannot create" in err and str(parts) in err
    assert not (files / "r.parquet").exists()
    if in_the_way == "file":
        assert parts.read_text() == "mine\n"  # left as it was


def test_a_parts_folder_the_os_refuses_is_not_said_to_be_in_the_way(files, capsys, monkeypatch):
    """`--out /sys/r.parquet` (as root: no folder is too read-only for os.access) said "fix: move
    /sys/r.parquet.parts out of the way", a folder that is not there; the fix now only says where to write."""
    from pathlib import Path
    parts = files / "r.parquet.parts"
    real_mkdir = Path.mkdir

    def refused(self, *args, **kwargs):
        if self == parts:
            raise PermissionError(1, "Operation not permitted")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    write_spec(files, systems=["cpu-only"])
    assert main(["sweep", str(files / "spec.yaml"), "--out", str(files / "r.parquet"), "--workers", "1"]) == 2
    assert capsys.readouterr().err == (f"moesim: error: {files / 'r.parquet'}, field '--out': cannot create {parts}: "
                                       "Operation not permitted (fix: write the sweep to a folder you may write "
                                       "to)\n")
    assert not parts.exists() and not (files / "r.parquet").exists()


def test_columns_mixing_numbers_and_strings_are_stored_as_strings(files):
    out = files / "r.parquet"
    spec = load_spec(write_spec(files, systems=["cpu-only"], grid={"memory.expert_dtype": ["bf16", ""]}))
    frame, _ = run_sweep(spec, out, workers=1)
    stored = pd.read_parquet(out)
    assert sorted(stored["memory.expert_dtype"]) == ["", "bf16"]
    mixed = pd.DataFrame([{"point_id": "a", "status": "ok", "k": 4}, {"point_id": "b", "status": "ok", "k": "auto"}])
    from moesim.sweep.store import _arrow_table
    assert _arrow_table(mixed).column("k").to_pylist() == ["4", "auto"]


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


def test_a_serving_sweep_over_all_leaves_out_the_systems_that_cannot_serve(files, capsys):
    """`systems: all` with workload.* settings: the oracle portfolio (and belady, oracle-prefetch, which plan
    with the trace's future) cannot serve. `serve-sim --system all` skips them; the sweep recorded the oracle
    as a failed point and exited 1. It is left out, with the reason, as a system that lacks a trace column is;
    the others serve."""
    spec = write_spec(files, systems="all", set={"workload.qps": 2, "workload.requests": 2})
    assert main(["sweep", str(spec), "--out", str(files / "r.parquet"), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert "0 failed" in captured.out
    left = [line for line in captured.err.splitlines() if line.startswith("left out ")]
    assert any(line.startswith("left out oracle: ") and "portfolio of schedules" in line for line in left), left
    frame = pd.read_parquet(files / "r.parquet")
    assert "oracle" not in set(frame["system"]) and (frame["status"] == "ok").all() and len(frame) >= 10


def test_the_time_left_of_a_resumed_sweep_counts_only_the_points_run_now(monkeypatch):
    """The points an earlier run finished took no time in this one: counted in the rate, they made 40
    points left at one point a second read as 7 s."""
    import io
    from types import SimpleNamespace

    from moesim.sweep import ProgressBar

    class Pipe(io.StringIO):
        def isatty(self) -> bool:
            return False

    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")
    stream = Pipe()
    bar = ProgressBar(True, SimpleNamespace(file=stream))
    bar.start(100, 50)
    bar._bar._start -= 10  # ten points in ten seconds
    for _ in range(10):
        bar.advance(0)
    bar.stop()
    assert stream.getvalue().splitlines()[-2] == \
        "sweep: 60/100 points (60%), 10s elapsed, about 40s left (0 failed)"


def test_the_progress_count_leaves_out_what_the_summary_leaves_out(files, capsys, monkeypatch):
    """With `systems: all` on a trace without scores, the progress lines counted importance's points (they ended
    "done, 72/72 points" above "68 points: 68 run"); they now count the points the summary counts."""
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0.000001")  # a line at every point, and the closing one
    spec = write_spec(files, systems="all")
    points = len(load_spec(spec).points())
    assert main(["sweep", str(spec), "--out", str(files / "r.parquet"), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{points - 1} points: {points - 1} run, 0 already in")
    done = [line for line in captured.err.splitlines() if line.startswith("sweep: done")]
    assert len(done) == 1 and done[0].startswith(f"sweep: done, {points - 1}/{points - 1} points (100%)"), done
