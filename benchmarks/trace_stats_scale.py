"""Trace statistics and synthesis at scale: rows, wall seconds and peak RSS of ``trace inspect``,
``trace compare`` and ``trace synth`` on traces of many short requests.

The traces for inspect and compare are DeepSeek-V3-shaped (58 MoE layers, 256 experts, top-8), written
fast with random routing (no scores): ``--requests`` requests of a 1-token prompt and a 1-token decode,
decoded in batches of ``--batch``, so the per-request state of the statistics, not the rows, dominates
memory. ``trace synth`` is timed at ``--synth-requests`` one-token requests (``--prompt-len 1
--decode-len 1``) of DeepSeek-V3 and of Mixtral-8x7B. Each command runs in its own process, measured with
``/usr/bin/time -v`` (peak RSS: "Maximum resident set size"); the validation cache is off
(``MOESIM_CACHE_DIR=off``), so inspect and compare include their validation pass.

    .venv/bin/python benchmarks/trace_stats_scale.py --requests 20000,200000 --synth-requests 2000,20000
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moesim.model.presets import load_preset
from moesim.trace.io import TraceWriter
from moesim.trace.schema import TraceMeta

sys.path.insert(0, str(Path(__file__).parent))
from trace_io import distinct_experts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MOESIM = str(ROOT / ".venv" / "bin" / "moesim")


def write_short_requests(path: Path, requests: int, batch: int, seed: int) -> int:
    """A DeepSeek-V3 trace of ``requests`` requests (1 prompt token, 1 decode token), ``batch`` per group:
    one prefill step per request, then one decode step of the group. Returns its rows."""
    model = load_preset("deepseek-v3")
    layers, experts, top_k = model.num_layers, model.num_experts, model.top_k
    rng = np.random.default_rng(seed)
    meta = TraceMeta(model=model, source={"kind": "synthetic", "generator": "benchmarks/trace_stats_scale.py"})
    rows = 0
    groups_per_write = max(1, 4096 // batch)
    with TraceWriter(path, meta, ["weights"]) as writer:
        for first_group in range(0, requests, batch * groups_per_write):
            last = min(requests, first_group + batch * groups_per_write)
            data = _group_rows(np.arange(first_group, last), batch, layers, first_group // batch * (batch + 1))
            n = len(data["step"])
            data["experts"] = distinct_experts(rng, n, experts, top_k)
            data["weights"] = -np.sort(-rng.random((n, top_k), dtype=np.float32), axis=1)  # highest first
            writer.write(data)
            rows += n
    return rows


def _group_rows(ids: np.ndarray, batch: int, layers: int, first_step: int) -> dict[str, np.ndarray]:
    """Rows (step, layer, request, position order) of the groups of ``ids``: a prefill step per request
    (position 0), then one decode step of the whole group (position 1)."""
    steps, requests, phases = [], [], []
    step = first_step
    for start in range(0, len(ids), batch):
        group = ids[start:start + batch]
        for request in group:
            steps.append(np.full(1, step)), requests.append(np.array([request])), phases.append(np.zeros(1, np.int8))
            step += 1
        steps.append(np.full(len(group), step)), requests.append(group), phases.append(np.ones(len(group), np.int8))
        step += 1
    out: dict[str, list[np.ndarray]] = {"step": [], "layer": [], "request": [], "phase": []}
    for s, r, p in zip(steps, requests, phases):  # layer-major within a step
        out["step"].append(np.repeat(s, layers))
        out["layer"].append(np.repeat(np.arange(layers), len(r)))
        out["request"].append(np.tile(r, layers))
        out["phase"].append(np.repeat(p, layers))
    data = {k: np.concatenate(v) for k, v in out.items()}
    data["position"] = data["phase"].astype(np.int32)
    return data


def timed(command: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS (MiB) of ``command`` in its own process (``/usr/bin/time -v``)."""
    env = {**os.environ, "MOESIM_CACHE_DIR": "off", "MOESIM_PROGRESS_INTERVAL": "3600"}
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return {"seconds": seconds, "peak_rss_mib": kib / 1024}


def report(name: str, rows: int, figures: dict[str, float]) -> None:
    print(f"{name:<44} {rows:>12,} rows {figures['seconds']:8.1f} s  peak RSS {figures['peak_rss_mib']:7.0f} MiB",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="20000,200000", help="request counts of the inspected traces")
    parser.add_argument("--batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--synth-requests", default="2000,20000", help="request counts of trace synth")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for count in [int(n) for n in args.requests.split(",") if n]:
            path = Path(tmp) / f"short-{count}.parquet"
            start = time.perf_counter()
            rows = write_short_requests(path, count, args.batch, args.seed)
            print(f"wrote {count:,} requests, {rows:,} rows in {time.perf_counter() - start:.1f} s", flush=True)
            report(f"trace inspect, {count:,} requests", rows,
                   timed([MOESIM, "trace", "inspect", str(path), "--json"]))
            report(f"trace compare, {count:,} requests (x2)", 2 * rows,
                   timed([MOESIM, "trace", "compare", str(path), str(path), "--json"]))
            path.unlink()
        for count in [int(n) for n in args.synth_requests.split(",") if n]:
            for model in ("deepseek-v3", "mixtral-8x7b"):
                out = Path(tmp) / f"synth-{model}-{count}.parquet"
                figures = timed([MOESIM, "trace", "synth", "--model", model, "--requests", str(count),
                                 "--prompt-len", "1", "--decode-len", "1", "--out", str(out)])
                rows = 2 * count * load_preset(model).num_layers
                report(f"trace synth {model}, {count:,} requests", rows, figures)
                print(f"{'':<44} {count / figures['seconds']:>12,.0f} requests/s", flush=True)
                out.unlink()


if __name__ == "__main__":
    main()
