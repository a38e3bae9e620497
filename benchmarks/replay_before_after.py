"""Replay speed of this checkout against an older one, in the same run (alternating, one core).

Each round times every system once with the old code and once with this
checkout, each replay in a fresh process pinned to core 0 (``taskset``), on one
trace written by the old code (so both can read it). Prints the best time of
each side and their ratio; a ratio over 1.2 is a slowdown of more than 20%.

    git worktree add /tmp/before 9be5d90
    .venv/bin/python benchmarks/replay_before_after.py --before /tmp/before --systems cpu-only,smoe --rounds 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SETTINGS = {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}

#: one timed run, in whichever moesim PYTHONPATH provides; the check of unread columns settled as
#: ``simulate`` settles it (code without it skips that step)
ONE = """
import sys, time
from moesim.sim.run import members, prepare
trace, system = sys.argv[1], sys.argv[2]
sims = [prepare(trace, "rtx4090", m, %r) for m in members(system)]
start = time.perf_counter()
for sim in sims:
    sim.run()
seconds = time.perf_counter() - start
try:
    from moesim.trace.validate import settle
    settle(trace)
except ImportError:
    pass
print(seconds)
""" % SETTINGS


def timed(root: Path, trace: Path, system: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(root)}
    pin = ["taskset", "-c", "0"] if sys.platform.startswith("linux") else []
    done = subprocess.run(pin + [sys.executable, "-c", ONE, str(trace), system], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="a checkout of the older code")
    parser.add_argument("--systems", required=True, help="comma-separated systems both checkouts have")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2000, help="decode tokens after a 64-token prompt")
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
        timed(args.before, trace, "cpu-only")
        timed(HERE, trace, "cpu-only")
        for system in args.systems.split(","):
            before = after = float("inf")
            try:
                for _ in range(args.rounds):
                    before = min(before, timed(args.before, trace, system))
                    after = min(after, timed(HERE, trace, system))
            except subprocess.CalledProcessError as err:
                lines = (err.stderr or "").strip().splitlines()
                print(f"{system:<20} FAILED: {lines[-1] if lines else err}", flush=True)
                continue
            print(f"{system:<20} before {before:7.2f} s  after {after:7.2f} s  ratio {after / before:5.2f}"
                  f"{'  (over +20%)' if after > 1.2 * before else ''}", flush=True)


if __name__ == "__main__":
    main()
