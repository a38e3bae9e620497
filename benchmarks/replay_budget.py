"""Where a replay's time goes per MoE layer: inside the system's ``plan()`` or in the engine around it.

Replays the decode trace of ``replay_speed.py`` (DeepSeek-V3 int4, a 64-token
prompt + 2,000 decode tokens: 116,058 MoE layers, 957,696 activations) under
each system on one core, best of three, with ``plan()`` wrapped in a clock
(two ``perf_counter`` calls per layer, well under a microsecond). Prints
microseconds per MoE layer: the whole replay, the policy's ``plan()``, and the
rest (the layer view, retiring copies, laying out transfers, the CPU and GPU
tracks, the bookkeeping). Next to them, the per-layer budget of the speed
target: a system at ``R`` times the naive SimPy model's speed (measured in the
same run) has ``activations / (R x naive) / layers`` seconds per layer.

A system whose ``plan()`` alone exceeds its budget cannot meet the target
whatever the engine does (and one whose engine part alone exceeds it, whatever
its policy does); the script names both cases.

    .venv/bin/python benchmarks/replay_budget.py
    .venv/bin/python benchmarks/replay_budget.py --systems dali,smoe --naive-per-s 66000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from replay_speed import SETTINGS, _has, catalogue, run_naive, synth, target_ratio  # noqa: E402


def plan_share(trace: str, system: str, hw: str, repeats: int = 3) -> tuple[float, float, int]:
    """(replay seconds, seconds inside plan(), MoE layers planned) of the fastest of ``repeats`` replays."""
    from moesim.sim.run import prepare
    best: tuple[float, float, int] | None = None
    for _ in range(repeats):
        sim = prepare(trace, hw, system, SETTINGS)
        inner, clock, spent = sim.system.plan, time.perf_counter, [0.0, 0]

        def timed(view, inner=inner, clock=clock, spent=spent):
            start = clock()
            plan = inner(view)
            spent[0] += clock() - start
            spent[1] += 1
            return plan

        sim.system.plan = timed  # an instance attribute: the engine looks plan() up on the instance
        start = time.perf_counter()
        sim.run()
        total = time.perf_counter() - start
        if best is None or total < best[0]:
            best = (total, spent[0], spent[1])
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="", help="comma-separated systems (default: the whole catalogue "
                        "but the oracle portfolio, whose members are systems of their own)")
    parser.add_argument("--hw", default="rtx4090")
    parser.add_argument("--naive-per-s", type=float, default=0.0,
                        help="the naive model's activations/s (default: measure it, best of three)")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "run":
        total, in_plan, layers = plan_share(args.trace, args.systems, args.hw)
        print(f"{total} {in_plan} {layers}")
        return
    systems = args.systems.split(",") if args.systems else [s for s in catalogue() if s != "oracle"]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "decode.parquet"
        synth(trace, 64, 2000)
        naive = run_naive(str(trace), args.hw) if not args.naive_per_s else \
            {"per_s": args.naive_per_s, "activations": 957_696}
        print(f"naive SimPy model: {naive['per_s']:,.0f} activations/s"
              f"{' (given)' if args.naive_per_s else ' (measured, best of three)'}")
        print(f"{'system':<20} {'replay':>8} {'plan()':>8} {'engine':>8} {'budget':>8}  (microseconds per MoE layer)")
        for system in systems:
            command = [sys.executable, __file__, "--phase", "run", "--trace", str(trace), "--systems", system,
                       "--hw", args.hw]
            taskset = ["taskset", "-c", "0"] if sys.platform.startswith("linux") and _has("taskset") else []
            done = subprocess.run(taskset + command, capture_output=True, text=True)
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines()
                print(f"{system:<20} FAILED: {lines[-1] if lines else done.returncode}")
                continue
            total, in_plan, layers = (float(x) for x in done.stdout.split())
            budget = naive["activations"] / (target_ratio(system) * naive["per_s"]) / layers
            over = [part for part, seconds in (("plan()", in_plan), ("the engine's part", total - in_plan))
                    if seconds / layers > budget]
            note = f"  {' and '.join(over)} alone over the budget" if over else ""
            print(f"{system:<20} {total / layers * 1e6:8.1f} {in_plan / layers * 1e6:8.1f} "
                  f"{(total - in_plan) / layers * 1e6:8.1f} {budget * 1e6:8.1f}{note}")


if __name__ == "__main__":
    main()
