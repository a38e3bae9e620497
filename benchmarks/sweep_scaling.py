"""Sweep scaling: the same 200-point sweep with 1 and 2 local workers, then on a local Ray instance.

Points replay the bundled Mixtral-8x7B HumanEval trace (339 forward passes)
on the H100-PCIe profile: 4 systems (cpu-only, gpu-only-lru, static-hot and
Belady's bound) x 5 cache sizes x 10 PCIe bandwidth scales, each about 0.2 to
0.8 s. Every run writes a fresh results file. Prints the wall time of each
run, the speed-up of 2 workers over 1, the 2-worker run again with the trace
decoded for every point (as before each worker kept it decoded), and whether the
Ray results equal the local ones in every column except the wall-clock ones
(``sim_wall_s``, ``point_wall_s``, ``finished_at``, ``worker``); then Ray's
own costs: start-up, and the sweep on a running instance with fresh and with
warm workers. The load average is printed before and after: the machine should
be otherwise idle for the speed-up to mean anything.

    .venv/bin/python benchmarks/sweep_scaling.py              # 200 points, 1 and 2 workers, then ray
    .venv/bin/python benchmarks/sweep_scaling.py --no-ray --points 40
    .venv/bin/python benchmarks/sweep_scaling.py --points 40 --trace dsv3.parquet   # a bigger trace
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "traces" / "mixtral-8x7b-humaneval.parquet"
SYSTEMS = ["cpu-only", "gpu-only-lru", "static-hot", "belady"]
SLOTS = [1, 2, 3, 4, 5]


def spec(points: int, trace: Path = TRACE) -> dict:
    """``points`` points: systems x slots x as many bandwidth scales as needed (10 for 200)."""
    scales = max(1, points // (len(SYSTEMS) * len(SLOTS)))
    return {"traces": [str(trace)], "hw": ["h100-pcie"], "systems": SYSTEMS,
            "grid": {"cache.slots_per_layer": SLOTS,
                     "hw.pcie.bandwidth_scale": [round(float(x), 3) for x in np.linspace(0.25, 2.5, scales)]}}


def timed_sweep(folder: Path, name: str, points: int, trace: Path, **kwargs) -> tuple[object, float]:
    import moesim.trace.io as trace_io
    from moesim.sweep import load_spec, run_sweep
    trace_io._DECODED.clear()  # each run decodes afresh (forked workers would inherit this process's copy)
    start = time.perf_counter()
    frame, summary = run_sweep(load_spec(spec(points, trace)), folder / f"{name}.parquet", **kwargs)
    wall = time.perf_counter() - start
    assert summary.failed == 0, frame.loc[frame["status"] != "ok", "error"].tolist()
    return frame, wall


def ray_parts(folder: Path, points: int, trace: Path) -> tuple[float, float, float]:
    """Ray's start-up alone, then the sweep on the running instance twice (fresh workers, then warm ones)."""
    import logging

    import ray
    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    up = time.perf_counter() - start
    try:
        _, cold = timed_sweep(folder, "ray-cold", points, trace, workers=2, engine="ray")
        _, warm = timed_sweep(folder, "ray-warm", points, trace, workers=2, engine="ray")
    finally:
        ray.shutdown()
    return up, cold, warm


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=200)
    parser.add_argument("--no-ray", action="store_true", help="Skip the Ray run.")
    parser.add_argument("--trace", type=Path, default=TRACE, help="trace replayed [the bundled Mixtral trace]")
    args = parser.parse_args()
    from moesim.sweep import WALL_CLOCK_COLUMNS, default_workers
    print(f"cores available: {default_workers()}; load average before: {load()}")
    trace = args.trace.resolve()
    with tempfile.TemporaryDirectory(prefix="moesim-sweep-scaling-") as tmp:
        folder = Path(tmp)
        serial, t1 = timed_sweep(folder, "w1", args.points, trace, workers=1)
        print(f"{len(serial)} points, 1 worker : {t1:7.1f} s ({t1 / len(serial):.2f} s per point)")
        parallel, t2 = timed_sweep(folder, "w2", args.points, trace, workers=2)
        print(f"{len(parallel)} points, 2 workers: {t2:7.1f} s   speed-up {t1 / t2:.2f}x")
        compared = [c for c in serial.columns if c not in WALL_CLOCK_COLUMNS]
        same = serial[compared].equals(parallel[compared])
        print(f"1 and 2 workers give identical results: {same}")
        ok = same
        import moesim.trace.io as trace_io
        kept = trace_io.DECODED_CACHE_BYTES
        trace_io.DECODED_CACHE_BYTES = 0  # (forked workers inherit it)
        try:
            uncached, t4 = timed_sweep(folder, "w2-decode-per-point", args.points, trace, workers=2)
        finally:
            trace_io.DECODED_CACHE_BYTES = kept
        print(f"{len(uncached)} points, 2 workers, trace decoded for every point instead of once per worker: "
              f"{t4:7.1f} s; identical: {uncached[compared].equals(parallel[compared])}")
        if not args.no_ray:
            ray_frame, t3 = timed_sweep(folder, "ray", args.points, trace, workers=2, engine="ray")
            ray_same = serial[compared].equals(ray_frame[compared])
            print(f"{len(ray_frame)} points, ray (local instance, 2 CPUs, start-up included): {t3:7.1f} s; "
                  f"identical to local: {ray_same}")
            ok = ok and ray_same
            up, cold, warm = ray_parts(folder, args.points, trace)
            print(f"  of which: Ray start-up {up:.1f} s; the sweep on a running instance {cold:.1f} s with new "
                  f"workers (each imports moesim and decodes the trace once), {warm:.1f} s with the same workers "
                  f"again")
    print(f"load average after: {load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
