"""Replay speed of this checkout against an older one, in the same run (alternating, one core).

Each round times every system once with the old code and once with this
checkout, each replay in a fresh process pinned to core 0 (``taskset``), on one
trace written by the old code (so both can read it). Prints the best time of
each side and their ratio; a ratio over 1.2 is a slowdown of more than 20%.

    git worktree add /tmp/before 9be5d90
    .venv/bin/python benchmarks/replay_before_after.py --before /tmp/before --systems cpu-only,smoe --rounds 2

A replay is ``moesim.sim.run.simulate`` as the API and CLI call it (a portfolio
bound's members with whatever each checkout does to run them), set-up
included. On a busy machine wall-clock ratios swing by 20-40%; ``--count
instructions`` counts the instructions of each replay under valgrind's
callgrind instead (from the ``simulate`` call to its return; the interpreter's
start-up and imports before it are not counted), which repeats to within 0.1%
whatever else runs, so that a ratio is the code's own. Counting runs ~50x
slower than the replay: use a shorter trace (``--decode 300``).

    .venv/bin/python benchmarks/replay_before_after.py --before /tmp/before --systems cpu-only \\
        --count instructions --rounds 1 --decode 300
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SETTINGS = {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}

#: one replay in whichever moesim PYTHONPATH provides, timed or (with valgrind) counted; the check of
#: unread columns settled as ``simulate`` settles it
ONE = """
import os, subprocess, sys, time
from moesim.sim.run import simulate
trace, system, counted = sys.argv[1], sys.argv[2], sys.argv[3] == "count"
if counted:
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=True)
start = time.perf_counter()
simulate(trace, "rtx4090", system, %r)
seconds = time.perf_counter() - start
if counted:
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True, check=True)
print(seconds)
""" % SETTINGS


def timed(root: Path, trace: Path, system: str, count: bool = False, core: int = 0) -> float:
    """Seconds of one replay, or with ``count`` its instructions (callgrind's ``Collected`` figure)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    pin = ["taskset", "-c", str(core)] if sys.platform.startswith("linux") and shutil.which("taskset") else []
    grind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null"] if count else []
    done = subprocess.run(pin + grind + [sys.executable, "-c", ONE, str(trace), system, "count" if count else "time"],
                          env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    if count:
        collected = [line for line in done.stderr.splitlines() if "Collected" in line]
        return float(collected[-1].split()[-1].replace(",", ""))
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="a checkout of the older code")
    parser.add_argument("--systems", required=True, help="comma-separated systems both checkouts have")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2000, help="decode tokens after a 64-token prompt")
    parser.add_argument("--core", type=int, default=0, help="the core every replay is pinned to")
    parser.add_argument("--count", choices=["seconds", "instructions"], default="seconds",
                        help="time each replay (best of --rounds) or count its instructions (one round suffices)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "ds.parquet"
        synth = ("from moesim.trace.synth import SynthConfig, synthesize; synthesize(SynthConfig.from_settings("
                 f"model='deepseek-v3', requests=1, prompt_len=64, decode_len={args.decode}, batch=1, seed=0, "
                 f"settings={{}}), {str(trace)!r})")
        subprocess.run([sys.executable, "-c", synth], env={**os.environ, "PYTHONPATH": str(args.before)},
                       cwd=folder, check=True)
        # untimed: the first replay of a new file validates it and records that it did
        # (moesim.trace.validated); a user's repeated replays of one trace pay that once
        timed(args.before, trace, "cpu-only", core=args.core)
        timed(HERE, trace, "cpu-only", core=args.core)
        count = args.count == "instructions"
        if count and not shutil.which("valgrind"):
            sys.exit("--count instructions needs valgrind (callgrind) on PATH")
        unit = "G instr" if count else "s"
        for system in args.systems.split(","):
            before = after = float("inf")
            try:
                for _ in range(args.rounds):
                    before = min(before, timed(args.before, trace, system, count, args.core))
                    after = min(after, timed(HERE, trace, system, count, args.core))
            except subprocess.CalledProcessError as err:
                lines = (err.stderr or "").strip().splitlines()
                print(f"{system:<20} FAILED: {lines[-1] if lines else err}", flush=True)
                continue
            scale = 1e-9 if count else 1.0
            print(f"{system:<20} before {before * scale:7.2f} {unit}  after {after * scale:7.2f} {unit}  "
                  f"ratio {after / before:5.2f}"
                  f"{'  (over +20%)' if after > 1.2 * before else ''}", flush=True)


if __name__ == "__main__":
    main()
