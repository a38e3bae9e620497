"""`moesim sweep --engine ray`: the local results, resuming after kill -9, retries, and one-line failures."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.sweep import WALL_CLOCK_COLUMNS, ShippedFile, load_spec, local_copy, require_ray, run_sweep
from tests.factories import TIGHT_GPU, spec_for_kill, write_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kill_9_of_a_ray_sweep_then_resume_loses_nothing(tmp_path):
    """kill -9 of a Ray sweep midway: the resume starts Ray again (or says in one line why not) and every
    point ends up in the results exactly once, the finished ones not recomputed."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")
    spec = spec_for_kill(tmp_path)
    out = tmp_path / "r.parquet"
    parts = tmp_path / "r.parquet.parts"
    cmd = [sys.executable, "-m", "moesim.cli", "sweep", str(spec), "--out", str(out), "--workers", "2",
           "--engine", "ray"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(parts.glob("*.parquet"))) < 3 and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    finished = {p.stem: pq.read_table(p).column("finished_at")[0].as_py() for p in parts.glob("*.parquet")}
    assert 3 <= len(finished) < 16, "the kill should land midway"
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # nothing but progress lines (one every 10 s when stderr is not a terminal: a slow machine prints more)
    assert [line for line in done.stderr.splitlines() if not line.startswith("sweep: ")] == []
    frame = pd.read_parquet(out)
    assert len(frame) == 16 and frame["point_id"].is_unique and (frame["status"] == "ok").all()
    by_id = frame.set_index("point_id")["finished_at"]
    assert {pid: by_id[pid] for pid in finished} == finished


def test_ray_start_up_failure_is_one_line(monkeypatch, files, capsys):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")

    def fail(**kwargs):
        raise RuntimeError("The current node timed out during startup.\nmore lines")
    monkeypatch.setattr(ray, "init", fail)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    code = main(["sweep", str(write_spec(files, systems=["gpu-only-lru"])), "--out", str(files / "r.parquet"),
                 "--engine", "ray"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Ray did not start: The current node timed out" in err
    assert "ray stop --force" in err


def test_shipped_files_are_fetched_once_per_process(tmp_path):
    data = os.urandom(64)
    fetched = []
    shipped = ShippedFile("trace.parquet", hashlib.sha256(data).hexdigest(), ["ref"])

    def fetch(ref):
        fetched.append(ref)
        return data

    first = local_copy(shipped, fetch)
    assert local_copy(shipped, fetch) == first
    assert Path(first).read_bytes() == data and Path(first).name == "trace.parquet"
    assert len(fetched) <= 1  # 0 when an earlier process of this machine left the same content


def test_ray_missing_is_one_clear_line(monkeypatch, files, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match="needs Ray"):
        require_ray()
    code = main(["sweep", str(write_spec(files, systems=["cpu-only"])), "--out", str(files / "r.parquet"),
                 "--engine", "ray"])
    assert code == 2 and "pip install 'moesim[sweep]'" in capsys.readouterr().err


def test_address_needs_the_ray_engine(files, capsys):
    code = main(["sweep", str(write_spec(files, systems=["cpu-only"])), "--out", str(files / "r.parquet"),
                 "--address", "auto"])
    assert code == 2 and "--address needs --engine ray" in capsys.readouterr().err


def _closed_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("address, said", [("127.0.0.1:{port}", "no Ray cluster answers at 127.0.0.1:"),
                                           ("ray://127.0.0.1:{port}", "no Ray cluster answers at ray://127.0.0.1:"),
                                           ("headnode", "'headnode' is not a Ray cluster address")])
def test_a_cluster_address_nothing_answers_at_is_one_line_at_once(files, capsys, address, said):
    """Issue: `moesim sweep SPEC --engine ray --address HOST:PORT` with no cluster there printed Ray's
    'Failed to connect to GCS' lines for minutes (over 2 minutes in a try) before any line of moesim's.
    The address is now tried first: one line naming it, exit 2, before any work."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")
    out = files / "r.parquet"
    start = time.monotonic()
    code = main(["sweep", str(write_spec(files, systems=["cpu-only"])), "--out", str(out), "--engine", "ray",
                 "--address", address.format(port=_closed_port())])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - start < 30
    assert err.splitlines() == [err] and err.startswith("moesim: error: field '--address': ") and said in err
    assert not out.exists() and not Path(f"{out}.parts").exists()


@pytest.mark.slow
def test_ray_engine_gives_the_local_results(files):
    pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")
    spec = load_spec(write_spec(files, systems=["cpu-only", "gpu-only-lru", "static-hot"],
                                grid={"cache.slots_per_layer": [1, 2, 6]}, set=TIGHT_GPU))
    local, _ = run_sweep(spec, files / "local.parquet", workers=2)
    ray_frame, summary = run_sweep(spec, files / "ray.parquet", workers=2, engine="ray")
    assert summary.ran == 9
    compared = [c for c in local.columns if c not in WALL_CLOCK_COLUMNS]
    pd.testing.assert_frame_equal(local[compared], ray_frame[compared])
    assert (local["status"] == "error").sum() == 2  # 6 slots per layer do not fit (cpu-only caches nothing)
    assert ray_frame["worker"].nunique() >= 1


@pytest.mark.slow
def test_ray_reports_the_points_it_ran_again_after_their_worker_died(files, monkeypatch):
    """As the local pool does: a point whose Ray worker died is run again once and counted in the summary."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")
    from moesim.sweep import ray_engine
    marks = files / "marks"
    marks.mkdir()
    real = ray_engine._ray_point

    def dies_once_on_two_slots(point, trace, profile, columns, attempts, policies):  # a closure: Ray ships it whole
        mark = marks / point.point_id
        if dict(point.settings)["cache.slots_per_layer"] == 2 and not mark.exists():
            mark.touch()
            import ray
            ray.get(attempts.start.remote(point.point_id))  # started, as the real one notes first
            os.kill(os.getpid(), signal.SIGKILL)
        return real(point, trace, profile, columns, attempts, policies)

    monkeypatch.setattr(ray_engine, "_ray_point", dies_once_on_two_slots)
    spec = load_spec(write_spec(files, systems=["gpu-only-lru", "static-hot"], grid={"cache.slots_per_layer": [1, 2]}))
    frame, summary = run_sweep(spec, files / "r.parquet", workers=2, engine="ray")
    assert (summary.ran, summary.retried, summary.failed) == (4, 2, 0)
    assert (frame["status"] == "ok").all() and len(list(marks.iterdir())) == 2


@pytest.mark.slow
def test_ray_workers_import_the_policies_the_spec_imports(files):
    """Ray's workers are not forked from the driver: without importing the spec's modules themselves, every
    point of a system of one's own failed there as 'unknown system'."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")
    (files / "lab_policies.py").write_text(
        "from moesim.policy.systems import SystemSpec, register_system\n"
        "register_system('lab-lru', SystemSpec('LRU under a name of its own', cache='lru', assign='gpu'))\n")
    spec = write_spec(files, systems=["lab-lru", "gpu-only-lru"], grid={"cache.slots_per_layer": [1, 2]})
    spec.write_text("import: [lab_policies.py]\n" + spec.read_text())
    out = files / "r.parquet"
    done = subprocess.run([sys.executable, "-m", "moesim", "sweep", str(spec), "--out", str(out), "--workers", "2",
                           "--engine", "ray"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pd.read_parquet(out)
    assert (rows.status == "ok").all() and len(rows) == 4, rows[["system", "status", "error"]]
    by = rows.set_index(["system", "cache.slots_per_layer"]).tpot_ms_mean
    assert [by["lab-lru", s] for s in (1, 2)] == [by["gpu-only-lru", s] for s in (1, 2)]


@pytest.mark.slow
def test_ray_workers_register_the_systems_a_notebook_and_a_plain_import_registered(tmp_path):
    """A system registered in a notebook's cell (``__main__``) and one from a module brought in with a plain
    ``import``: both failed in Ray's workers as 'unknown system', which are not forked from the driver."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'moesim[sweep]')")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "their_policies.py").write_text(
        "from dataclasses import dataclass\n"
        "from moesim.policy.cache import LRUCache\n"
        "from moesim.policy.systems import SystemSpec, register_component, register_system\n"
        "@register_component\n@dataclass\nclass TheirLRU(LRUCache):\n    name = 'their-lru'\n"
        "register_system('theirs', SystemSpec('LRU of a module', cache='their-lru', assign='gpu'))\n")
    script = tmp_path / "cells.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(lib)!r})\n"
        "import their_policies\n"
        "from dataclasses import dataclass\n"
        "import moesim\n"
        "from moesim.policy.cache import LRUCache\n"
        "from moesim.policy.systems import SystemSpec, register_component, register_system\n"
        "@register_component\n@dataclass\nclass CellLRU(LRUCache):\n    name = 'cell-lru'\n"
        "register_system('cell', SystemSpec('LRU of a cell', cache='cell-lru', assign='gpu'))\n"
        "table = moesim.sweep({'traces': [str(moesim.bundled_trace('mixtral-8x7b-humaneval'))], 'hw': ['rtx4090'],\n"
        "                      'systems': ['cell', 'theirs', 'gpu-only-lru'], 'grid': {'cache.slots': [32]}},\n"
        "                     engine='ray', workers=2)\n"
        "print(table[['system', 'status', 'tpot_ms_mean']].to_json(orient='records'))\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    rows = {r["system"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert {s: r["status"] for s, r in rows.items()} == {"cell": "ok", "theirs": "ok", "gpu-only-lru": "ok"}
    assert rows["cell"]["tpot_ms_mean"] == rows["theirs"]["tpot_ms_mean"] == rows["gpu-only-lru"]["tpot_ms_mean"]
