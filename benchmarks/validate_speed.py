"""Cost of the trace validation pass relative to a replay (target: under 5%).

Every entry point validates a trace once before work starts; this prints the
validation time (required columns plus those the system reads, as before a
replay), one replay's time (``gpu-only-lru``, timeline off, validation
excluded) and their ratio, for the bundled Mixtral trace and a DeepSeek-V3
synthetic trace (one request, 64-token prompt, 2,000 decode tokens, with scores).

    .venv/bin/python benchmarks/validate_speed.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}


def best_of(n: int, call) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(trace: Path, system: str, settings: dict[str, str]) -> tuple[float, float, int]:
    import moesim.trace.validate as validate
    from moesim.policy.systems import build_system
    from moesim.sim.run import simulate
    columns = build_system(system, {}).needed_columns()
    rows = validate.validate_trace(trace, columns).rows
    t_validate = best_of(3, lambda: validate.validate_trace(trace, columns))
    validate.checked_meta(trace, columns)  # memoised: the replay below pays nothing for it
    t_replay = best_of(2, lambda: simulate(str(trace), "rtx4090", system, settings, timeline=False,
                                           decisions=False))
    return t_validate, t_replay, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=2000, help="decode tokens of the DeepSeek-V3 trace")
    parser.add_argument("--system", default="gpu-only-lru",
                        help="system replayed (the pass checks the optional columns it reads)")
    args = parser.parse_args()
    from moesim.trace.synth import SynthConfig, synthesize
    with tempfile.TemporaryDirectory() as folder:
        dsv3 = Path(folder) / "dsv3.parquet"
        synthesize(SynthConfig.from_settings(model="deepseek-v3", requests=1, prompt_len=64, decode_len=args.decode,
                                             batch=1, seed=0, settings={}, scores=True), dsv3)
        cases = [("mixtral-8x7b-humaneval (bundled)", REPO / "traces" / "mixtral-8x7b-humaneval.parquet", {}),
                 (f"deepseek-v3 synth 64+{args.decode}", dsv3, SETTINGS)]
        print(f"{'trace':36} {'rows':>10} {'validate s':>11} {'replay s':>9} {'ratio':>7}")
        for label, path, settings in cases:
            t_val, t_rep, rows = measure(path, args.system, settings)
            print(f"{label:36} {rows:>10,} {t_val:>11.4f} {t_rep:>9.3f} {t_val / t_rep:>7.2%}")


if __name__ == "__main__":
    main()
