"""Serving speed: a 200-request Poisson workload on the bundled Mixtral trace, on one core.

Serves ``--requests`` requests drawn from ``traces/mixtral-8x7b-humaneval.parquet``
arriving as a Poisson process under each system and the default scheduler (vLLM),
at a high load (large batches, few steps) and a low one (about one request at a
time, the most steps), with the timeline off. Prints the wall time of each run
(set-up included: reading the traces' requests, planning memory) against the
30 s target, and the steps and tokens it simulated.

    .venv/bin/python benchmarks/serving_speed.py
    .venv/bin/python benchmarks/serving_speed.py --systems gpu-only-lru cpu-only --qps 0.5 0.005
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "traces" / "mixtral-8x7b-humaneval.parquet"
TARGET_S = 30.0


def run_one(system: str, hw: str, qps: float, requests: int) -> dict:
    from moesim.analysis.serving import serving_metrics
    from moesim.sim.serving import serve
    start = time.perf_counter()
    result = serve([str(TRACE)], hw, system, {"workload.qps": str(qps), "workload.requests": str(requests)})
    wall = time.perf_counter() - start
    m = serving_metrics(result)
    return {"system": system, "qps": qps, "requests": requests, "wall_s": wall, "steps": len(result.engine.steps),
            "tokens": int(sum(r.computed_tokens for r in result.requests)), "ttft_ms_p50": m["ttft_ms_p50"],
            "tpot_ms_p50": m["tpot_ms_p50"], "target_met": wall < TARGET_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=["gpu-only-lru"])
    parser.add_argument("--hw", default="rtx4090")
    parser.add_argument("--qps", nargs="+", type=float, default=[0.5, 0.005])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    rows = [run_one(system, args.hw, qps, args.requests) for system in args.systems for qps in args.qps]
    print(f"{'system':<16}{'qps':>8}{'requests':>10}{'steps':>8}{'tokens':>9}{'wall s':>9}  target < {TARGET_S:g} s")
    for r in rows:
        print(f"{r['system']:<16}{r['qps']:>8g}{r['requests']:>10}{r['steps']:>8}{r['tokens']:>9}"
              f"{r['wall_s']:>9.2f}  {'met' if r['target_met'] else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
