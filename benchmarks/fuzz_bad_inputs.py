"""Bad-input fuzzing at scale: every generated invalid input through every command that reads it.

Builds the corpus of tests/fuzz/corpus.py (traces, profiles, sweep specs,
``--set`` values, output paths, importer logs), runs each case's commands in
this process (``trace validate``, ``trace inspect``, ``replay``, ``replay
--system all``, ``sweep``, ``trace import``, ``trace synth``) with a time limit
per command, and prints counts by outcome. The target: every run ``clean``
(exit 2, one line naming the file or field, no output left behind).

    .venv/bin/python benchmarks/fuzz_bad_inputs.py --size 500
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz.corpus import OUTCOMES, build, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=500, help="bad inputs generated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=60.0, help="time limit per command")
    parser.add_argument("--show", type=int, default=20, help="failures printed")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        cases = build(Path(folder), seed=args.seed, size=args.size)
        by_outcome: Counter = Counter()
        by_family: dict[str, Counter] = {}
        commands: Counter = Counter()
        failures = []
        for case in cases:
            for command in case.commands:
                label = " ".join(command[:2]) if command[0] == "trace" else command[0]
                if command[0] == "replay" and "--system" not in command:
                    label = "replay --system all"
                commands[label] += 1
                outcome, err = run_case(case, command, args.limit_s)
                by_outcome[outcome] += 1
                by_family.setdefault(case.family, Counter())[outcome] += 1
                if outcome != "clean":
                    failures.append((case.family, case.name, label, outcome, err.strip()[:300]))
    runs = sum(by_outcome.values())
    print(f"{len(cases)} bad inputs, {runs} command runs ({time.perf_counter() - started:.0f} s)")
    print("commands: " + ", ".join(f"{k} {v}" for k, v in sorted(commands.items())))
    print("outcomes: " + ", ".join(f"{k} {by_outcome.get(k, 0)}" for k in OUTCOMES))
    for family, counts in sorted(by_family.items()):
        print(f"  {family:8} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for failure in failures[:args.show]:
        print("  FAIL", " | ".join(failure))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
