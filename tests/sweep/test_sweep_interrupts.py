"""`moesim sweep` stopped part way: kill -9 and resume, the output's lock, Ctrl-C and SIGTERM, pool workers that
die, a full disk; the points finished are kept."""

from __future__ import annotations

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

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.sweep import ResultStore, load_spec, run_sweep
from tests.factories import spec_for_kill, write_spec

REPO = Path(__file__).resolve().parents[2]


def test_a_second_writer_is_refused(files):
    out = files / "r.parquet"
    store = ResultStore(out)
    try:
        with pytest.raises(ConfigError, match="another sweep is writing this output"):
            ResultStore(out)
    finally:
        store.close(complete=True)
    ResultStore(out).close(complete=True)  # free again


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
    assert main(["sweep", str(only), "--out", str(files / "only.parquet"), "--workers", "2"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("2 points: 2 run (2 retried after a worker process died), 0 already in")
    assert err.count("killed by SIGKILL") == 4 and len(list(marks.iterdir())) == 4
    assert pd.read_parquet(files / "only.parquet")["status"].tolist() == ["error", "error"]


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
