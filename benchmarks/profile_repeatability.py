"""Does `moesim profile` repeat? Measure N profiles in a row and print each curve point's spread.

    python benchmarks/profile_repeatability.py --device cpu --model flame-moe-290m [--runs 3] [--threads N] [--nice N]

Each run is a separate `python -m moesim profile` process (as a user would run it), timed. For every
curve point and scalar of the profiles, the spread is (max - min) / median over the runs; the target is
at most 15% everywhere. Prints the per-point table (worst first), the worst spread per curve and the
wall time of each run; exit status 1 when a point misses the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.15


def points(profile: dict) -> dict[str, float]:
    """Every measured number of a profile by a readable key."""
    out: dict[str, float] = {}
    gpu, cpu, pcie = profile["gpu"], profile["cpu"], profile["pcie"]
    for section, curves in (("gpu", gpu["expert_ffn"]), ("cpu", cpu["expert_ffn"])):
        for c in curves:
            for t, us in zip(c["tokens"], c["time_us"]):
                out[f"{section}.expert {c['hidden']}x{c['intermediate']} @{t} tok"] = us
    for c in gpu["attention"]:
        for ctx, us in zip(c["context"], c["time_us"]):
            out[f"gpu.attention {c['model']} {c['tokens']} tok @{ctx}"] = us
    for direction in ("h2d", "d2h"):
        for size, gbps in zip(pcie[direction]["size_bytes"], pcie[direction]["gbps"]):
            out[f"pcie.{direction} @{size} B"] = gbps
    for key, value in (("gpu.launch_us", gpu["launch_us"]), ("gpu.peak_tflops", gpu["peak_tflops"]["bf16"]),
                       ("gpu.mem_bandwidth_gbps", gpu["mem_bandwidth_gbps"]),
                       ("cpu.dram_bandwidth_gbps", cpu["dram_bandwidth_gbps"]),
                       ("cpu.peak_tflops", next(iter(cpu["peak_tflops"].values()))),
                       ("pcie.latency_us", pcie["latency_us"]), ("pcie.duplex_slowdown", pcie["duplex_slowdown"]),
                       ("sync.per_layer_us", profile["sync"]["per_layer_us"])):
        out[key] = value
    return out


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", action="append", default=None, help="preset(s) to profile")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for the profiles (default: a temporary one)")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the profile processes (negative: as root)")
    args = parser.parse_args()
    models = args.model or ["flame-moe-290m"]
    out = Path(args.out or tempfile.mkdtemp(prefix="moesim-repeat-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    profiles, walls, loads = [], [], []
    for i in range(args.runs):
        path = out / f"profile-{i + 1}.yaml"
        cmd = [sys.executable, "-m", "moesim", "profile", "--device", args.device, "--threads", str(args.threads),
               "--out", str(path)] + [a for m in models for a in ("--model", m)]
        print(f"run {i + 1}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env,
                       preexec_fn=(lambda: os.nice(args.nice)) if args.nice else None)
        walls.append(time.perf_counter() - t0)
        loads.append((load0, os.getloadavg()[0]))
        profiles.append(points(yaml.safe_load(path.read_text())))
    keys = list(profiles[0])
    rows = sorted(((spread([p[k] for p in profiles]), k) for k in keys), reverse=True)
    print(f"\nper-point spread (max - min) / median over {args.runs} profiles, worst first (target <= 15%):")
    for s, k in rows:
        values = "  ".join(f"{p[k]:>10.4g}" for p in profiles)
        print(f"{s:7.1%}  {'MISS' if s > TARGET else 'ok  '}  {k:<48} {values}")
    curves: dict[str, float] = {}
    for s, k in rows:
        curve = k.split(" @")[0]
        curves[curve] = max(curves.get(curve, 0.0), s)
    print("\nworst spread per curve:")
    for curve, s in curves.items():
        print(f"{s:7.1%}  {curve}")
    misses = sum(s > TARGET for s, _ in rows)
    print(f"\nwall time per profile: {', '.join(f'{w:.1f} s' for w in walls)}; "
          f"{misses} of {len(rows)} points above 15%; profiles in {out}")
    print(f"load average (1 min) before / after each run on {os.cpu_count()} CPUs: "
          f"{', '.join(f'{a:.1f} / {b:.1f}' for a, b in loads)}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
