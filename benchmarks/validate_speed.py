"""Cost of the trace validation pass relative to a replay (target: under 5%).

Every entry point validates a trace before work starts. The columns a replay
reads are checked before it; an optional column it does not read (``scores``,
``weights``, predictions, token ids, for most systems) is checked on a thread
beside it, and the results are refused if that check fails
(``moesim.trace.validate.settle``). For each system this prints, on
the bundled Mixtral trace and a DeepSeek-V3 synthetic trace (one request,
64-token prompt, 2,000 decode tokens, with scores):

* ``full``: the whole pass in the foreground, every column (``trace validate``);
* ``before``: the part a replay waits for (required columns and the system's own);
* ``beside``: the part on the thread (the columns the system does not read);
* ``replay``: one replay with validation already memoised (timeline off);
* ``cold``: the same replay as a user runs it, validation included (fresh state, thread and all);
* ``full %``: full / replay, the cost of checking everything before the replay;
* ``cost %``: (cold - replay) / replay, the wall-clock cost of validation as it is done.

Times are the best of ``--repeat`` runs, warm and cold runs interleaved.

    .venv/bin/python benchmarks/validate_speed.py --system cpu-only --system gpu-only-lru
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}


def timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def measure(trace: Path, system: str, settings: dict[str, str], repeat: int) -> dict[str, float]:
    import moesim.trace.validate as validate
    from moesim.policy.systems import build_system
    from moesim.sim.run import simulate
    columns = build_system(system, {}).needed_columns()
    names = validate._open(trace).schema_arrow.names
    meta = validate.read_meta(trace)
    lazy = sorted(c for c in validate.LAZY_COLUMNS if c in names and c not in columns)
    out = {"rows": validate.validate_trace(trace).rows}
    times: dict[str, list[float]] = {k: [] for k in ("full", "before", "beside", "replay", "cold")}

    def replay() -> None:
        simulate(str(trace), "rtx4090", system, settings, timeline=False, decisions=False)
    for _ in range(repeat):
        times["full"].append(timed(lambda: validate.validate_trace(trace)))
        times["before"].append(timed(lambda: validate.validate_trace(trace, columns)))
        times["beside"].append(timed(lambda: validate._check_lazy(trace, lazy, meta)) if lazy else 0.0)
        validate._CHECKED.clear()
        times["cold"].append(timed(replay))
        times["replay"].append(timed(replay))  # memoised: validation already done
    out.update({k: min(v) for k, v in times.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=2000, help="decode tokens of the DeepSeek-V3 trace")
    parser.add_argument("--system", action="append", help="system replayed (repeatable) [cpu-only, gpu-only-lru]")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best counts")
    args = parser.parse_args()
    from moesim.trace.synth import SynthConfig, synthesize
    print(f"cores: {len(os.sched_getaffinity(0))}; load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder:
        dsv3 = Path(folder) / "dsv3.parquet"
        synthesize(SynthConfig.from_settings(model="deepseek-v3", requests=1, prompt_len=64, decode_len=args.decode,
                                             batch=1, seed=0, settings={}, scores=True), dsv3)
        cases = [("mixtral-8x7b-humaneval (bundled)", REPO / "traces" / "mixtral-8x7b-humaneval.parquet", {}),
                 (f"deepseek-v3 synth 64+{args.decode}", dsv3, SETTINGS)]
        print(f"{'trace':34} {'system':13} {'rows':>8} {'full s':>7} {'before s':>8} {'beside s':>8} "
              f"{'replay s':>8} {'cold s':>7} {'full %':>7} {'cost %':>7}")
        for label, path, settings in cases:
            for system in args.system or ["cpu-only", "gpu-only-lru"]:
                m = measure(path, system, settings, args.repeat)
                print(f"{label:34} {system:13} {m['rows']:>8,} {m['full']:>7.3f} {m['before']:>8.3f} "
                      f"{m['beside']:>8.3f} {m['replay']:>8.3f} {m['cold']:>7.3f} {m['full'] / m['replay']:>7.1%} "
                      f"{(m['cold'] - m['replay']) / m['replay']:>7.1%}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
