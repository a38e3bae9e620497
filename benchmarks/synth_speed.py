"""Speed of the synthetic trace generator and of fitting it to a real trace.

Times ``trace synth`` of a DeepSeek-V3 decode (58 MoE layers, 256 experts, top-8; 1-token prompt,
``--decode-len`` tokens, default 2,000; target under 15 s) and ``fit_params`` on the bundled
Mixtral-8x7B HumanEval trace. Best of ``--repeat`` runs each; exits non-zero past the target.

    .venv/bin/python benchmarks/synth_speed.py --decode-len 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from moesim.trace.synth import SynthConfig, fit_params, synthesize

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 15.0


def best_of(repeat: int, work) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-len", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = SynthConfig.from_settings(model="deepseek-v3", requests=1, prompt_len=1, decode_len=args.decode_len)
        synth_s = best_of(args.repeat, lambda: synthesize(config, Path(folder) / "ds.parquet"))
    fit_s = best_of(args.repeat, lambda: fit_params(ROOT / "traces" / "mixtral-8x7b-humaneval.parquet"))
    print(f"synth deepseek-v3, {args.decode_len} decode tokens: {synth_s:.2f} s (target < {TARGET_S:.0f} s)")
    print(f"fit to mixtral-8x7b-humaneval: {fit_s:.2f} s")
    return 0 if synth_s < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
