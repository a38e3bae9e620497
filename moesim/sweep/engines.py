"""Running a sweep: the points not yet done, on a local process pool (or Ray), with a progress bar."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from moesim.errors import ConfigError
from moesim.sweep.point import Finished, columns_of, describe_error, error_row, run_point
from moesim.sweep.ray_engine import _run_ray, require_ray
from moesim.sweep.spec import Point, SweepSpec, check_spec
from moesim.sweep.store import _INHERITED_FDS, ResultStore

ENGINES = ("local", "ray")
#: columns that depend on when and where a point ran, not on its parameters
WALL_CLOCK_COLUMNS = ("sim_wall_s", "point_wall_s", "finished_at", "worker")
#: where the trace and profile were found when the point ran (for replaying a point again, e.g. a Gantt chart)
LOCATION_COLUMNS = ("trace_path", "hw_path")


@dataclass
class SweepSummary:
    points: int
    skipped: int
    ran: int
    failed: int
    wall_s: float


def run_sweep(spec: SweepSpec, out: str | os.PathLike | None = None, *, workers: int | None = None,
              engine: str = "local", address: str | None = None, progress: bool = False,
              console: Any = None) -> tuple[Any, SweepSummary]:
    """Run every point of ``spec`` not yet finished in ``out``; return (frame of the spec's points, summary)."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine '{engine}'", field="--engine", fix=f"use one of: {', '.join(ENGINES)}")
    if address and engine != "ray":
        raise ConfigError("--address needs --engine ray", field="--address", fix="add --engine ray")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers={workers}", field="--workers", fix="use 1 or more")
    if engine == "ray":
        require_ray()
    points = spec.points()
    check_spec(spec, points)
    started = time.perf_counter()
    store = ResultStore(out)
    bar = ProgressBar(progress, console)
    complete = False
    failed = 0
    try:
        done = store.done_ids()
        todo = [p for p in points if p.point_id not in done]

        by_id = {p.point_id: p for p in todo}

        def finished(row: dict[str, Any]) -> None:
            nonlocal failed
            point = by_id[row["point_id"]]
            row.update(trace_path=spec.resolve(point.trace), hw_path=spec.resolve_hw(point.hw))
            store.add(row)
            failed += row["status"] != "ok"
            bar.advance(failed)

        if todo:
            runner = _run_ray if engine == "ray" else _run_local
            runner(spec, todo, workers or default_workers(), address,
                   lambda: bar.start(len(points), len(points) - len(todo)), finished)
        complete = True
    finally:
        bar.stop()
        store.close(complete=complete)
    frame = _ordered(store.frame([p.point_id for p in points]), spec)
    summary = SweepSummary(points=len(points), skipped=len(points) - len(todo), ran=len(todo), failed=failed,
                           wall_s=time.perf_counter() - started)
    return frame, summary


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ordered(frame: Any, spec: SweepSpec) -> Any:
    """Parameters first, then status, metrics, and the wall-clock and location columns last."""
    if frame.empty:
        return frame
    head = ["point_id", "trace", "hw", "system", "seed", "model", *dict.fromkeys(spec.parameter_keys()),
            "status", "error"]
    head = [c for c in head if c in frame.columns]
    tail = [c for c in WALL_CLOCK_COLUMNS + LOCATION_COLUMNS if c in frame.columns]
    middle = [c for c in frame.columns if c not in head and c not in tail]
    return frame[head + middle + tail].reset_index(drop=True)


class ProgressBar:
    """Sweep progress on stderr with the count of failed points (:class:`moesim.progress.Progress`:
    a rich bar on a terminal, plain lines otherwise; off when ``enabled`` is false)."""

    def __init__(self, enabled: bool, console: Any = None) -> None:
        self.enabled = enabled
        self.console = console
        self._bar: Any = None

    def start(self, total: int, already: int) -> None:
        if not self.enabled:
            return
        from moesim.progress import Progress
        stream = getattr(self.console, "file", None)
        self._bar = Progress("sweep", total=total, unit="points", stream=stream, console=self.console)
        self._bar.start()
        self._bar.advance(already, extra="0 failed")

    def advance(self, failed: int) -> None:
        if self._bar is not None:
            self._bar.advance(1, extra=f"{failed} failed")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _run_local(spec: SweepSpec, points: list[Point], workers: int, address: str | None,
               started: Callable[[], None], finished: Finished) -> None:
    """Points in a process pool; one worker: in this process. Each worker decodes a trace once for all its
    points and systems (``moesim.trace.io.iter_steps`` keeps it per process, with every column they read)."""
    from moesim.trace.io import keeping_decoded
    jobs = [(p, spec.resolve(p.trace), spec.resolve_hw(p.hw)) for p in points]
    columns = columns_of(points)
    if workers == 1 or len(jobs) == 1:
        started()
        with keeping_decoded(columns):
            for job in jobs:
                finished(run_point(*job))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import moesim.analysis.metrics  # noqa: F401 - imported once here, not in every forked worker
    import pandas  # noqa: F401
    from moesim.trace.validate import wait_for_checks
    wait_for_checks()  # no validation thread may be running when the workers fork
    # fork (on Linux) lets workers see systems registered at run time, e.g. in a notebook; the pool
    # forks all its workers at the first submit, before the progress bar starts its thread
    context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context,
                             initializer=_worker_init, initargs=(os.getpid(), _INHERITED_FDS[:], columns)) as pool:
        futures = {pool.submit(run_point, *job): job[0] for job in jobs}
        started()
        try:
            for future in as_completed(futures):
                try:
                    row = future.result()
                except Exception as err:  # noqa: BLE001 - e.g. a worker killed by the OS
                    row = error_row(futures[future], describe_error(err))
                finished(row)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _worker_init(parent: int, close_fds: list[int], columns: list[str]) -> None:
    """In each pool worker: die with the sweep process, drop its lock, keep traces decoded (with
    ``columns``)."""
    from moesim.trace.io import keep_decoded
    keep_decoded(columns)
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); elsewhere, a
    watchdog thread polls the parent pid. Either way no worker outlives a ``kill -9`` of the sweep."""
    import signal
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the call
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    import threading

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=watch, name="moesim-parent-watch", daemon=True).start()
