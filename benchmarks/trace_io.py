"""Trace I/O throughput and memory on a DeepSeek-V3-shaped synthetic trace.

Writes ``--rows`` rows (default 10 million) of a 58-MoE-layer, 256-expert, top-8
trace (random experts and weights, no scores) with TraceWriter in chunks, then
streams it back with iter_steps. Write and read each run in their own process,
so the write's peak memory does not count towards the read's. Prints rows/s and
peak RSS (ru_maxrss) of each; exits non-zero if reading peaks at 1 GiB or more.

``--prefill`` instead times the first decode of a process (the one every replay
pays) of a 4,096-token DeepSeek-V3 prefill with router ``scores``, in fresh
processes alternating between the allocator moesim decodes into (the C
library's) and pyarrow's default (mimalloc), five each, with peak RSS.
``--scores`` times reading that prefill's ``scores`` column in each form it can
be stored in (docs/trace-format.md).

    .venv/bin/python benchmarks/trace_io.py --rows 10000000 --tokens 64
    .venv/bin/python benchmarks/trace_io.py --prefill
    .venv/bin/python benchmarks/trace_io.py --scores
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moesim.model.presets import load_preset
from moesim.trace.io import TraceWriter, iter_steps
from moesim.trace.schema import TraceMeta


def peak_rss_mib() -> float:
    """Peak resident set of this process (ru_maxrss; Linux reports KiB).

    A child inherits its parent's peak through fork and exec, so each phase runs
    in its own process started by a small parent that has done no work.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def distinct_experts(rng: np.random.Generator, n: int, experts: int, top_k: int) -> np.ndarray:
    """``(n, top_k)`` random expert ids, distinct within each row (rows with a repeat are redrawn)."""
    ids = rng.integers(0, experts, size=(n, top_k), dtype=np.int16)
    while True:
        ordered = np.sort(ids, axis=1)
        dup = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if not dup.any():
            return ids
        ids[dup] = rng.integers(0, experts, size=(int(dup.sum()), top_k), dtype=np.int16)


def write(path: Path, rows: int, tokens: int, seed: int) -> dict:
    model = load_preset("deepseek-v3")
    layers, experts, top_k = model.num_layers, model.num_experts, model.top_k
    rng = np.random.default_rng(seed)
    meta = TraceMeta(model=model, source={"kind": "synthetic", "generator": "benchmarks/trace_io.py", "seed": seed})
    per_step = layers * tokens
    steps_per_chunk = max(1, 262_144 // per_step)
    start = time.perf_counter()
    written = 0
    with TraceWriter(path, meta, ["weights"]) as writer:
        step = 0
        while written < rows:
            n_steps = steps_per_chunk
            step_ids = np.arange(step, step + n_steps)
            s, l, t = np.meshgrid(step_ids, np.arange(layers), np.arange(tokens), indexing="ij")
            n = min(s.size, rows - written)
            ids = distinct_experts(rng, n, experts, top_k)
            weights = rng.random((n, top_k), dtype=np.float32)
            writer.write({"request": t.ravel()[:n], "step": s.ravel()[:n],
                          "phase": np.ones(n, np.int8), "position": s.ravel()[:n], "layer": l.ravel()[:n],
                          "experts": ids, "weights": weights})
            written += n
            step += n_steps
    seconds = time.perf_counter() - start
    return {"rows": written, "seconds": seconds, "rows_per_s": written / seconds, "peak_rss_mib": peak_rss_mib(),
            "file_mib": path.stat().st_size / 2**20}


def read(path: Path) -> dict:
    start = time.perf_counter()
    rows = steps = 0
    checksum = 0
    for step in iter_steps(path):
        rows += step.rows
        steps += 1
        checksum += int(step.experts[0, 0])
    seconds = time.perf_counter() - start
    return {"rows": rows, "steps": steps, "seconds": seconds, "rows_per_s": rows / seconds,
            "peak_rss_mib": peak_rss_mib(), "checksum": checksum}


def first_decode(path: Path) -> dict:
    import pyarrow as pa
    start = time.perf_counter()
    steps = list(iter_steps(path))
    return {"seconds": time.perf_counter() - start, "steps": len(steps), "peak_rss_mib": peak_rss_mib(),
            "pool": pa.default_memory_pool().backend_name}


def compare_pools(rounds: int = 5) -> None:
    import os
    import statistics
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prefill.parquet"
        # in its own process: a child inherits its parent's peak RSS
        subprocess.run([sys.executable, __file__, "--out", str(path), "--phase", "prefill"], check=True)
        runs: dict[str, list[dict]] = {"system": [], "mimalloc": []}
        for _ in range(rounds):
            for pool in runs:
                env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
                if pool != "system":  # moesim's own choice when none is set
                    env["ARROW_DEFAULT_MEMORY_POOL"] = pool
                done = subprocess.run([sys.executable, __file__, "--out", str(path), "--phase", "decode"],
                                      check=True, capture_output=True, text=True, env=env)
                runs[pool].append(json.loads(done.stdout))
        print("first decode of a 4,096-token DeepSeek-V3 prefill with scores, fresh process each:")
        for pool, rows in runs.items():
            seconds = [r["seconds"] for r in rows]
            print(f"  {rows[0]['pool']:<9} median {statistics.median(seconds):.2f} s "
                  f"(range {min(seconds):.2f}-{max(seconds):.2f}), peak RSS "
                  f"{statistics.median(r['peak_rss_mib'] for r in rows):.0f} MiB, {rows[0]['steps']} step")


def score_forms(rounds: int = 3) -> None:
    """Seconds to read the ``scores`` column of a 4,096-token DeepSeek-V3 prefill in each stored form: as
    written (format v2: fixed-size binary, uncompressed), the same with zstd, and format v1's fixed-size
    list of float16 with zstd; best of ``rounds`` reads, with the column's share of the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moesim.trace.schema import score_rows, scores_list_type
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "prefill.parquet"
        subprocess.run([sys.executable, __file__, "--out", str(written), "--phase", "prefill"], check=True)
        table = pq.read_table(written, columns=["scores"])
        rows = score_rows(table.column("scores"), table.column("scores").type.byte_width // 2)
        as_list = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
        forms = {"v2, fixed-size binary, uncompressed (as written)": (table, "none"),
                 "v2, fixed-size binary, zstd": (table, "zstd"),
                 "v1, fixed-size list of float16, zstd": (pa.table({"scores": as_list}), "zstd")}
        assert as_list.type == scores_list_type(rows.shape[1])
        print(f"reading the scores of a 4,096-token DeepSeek-V3 prefill ({len(rows):,} rows of {rows.shape[1]}), "
              f"best of {rounds}:")
        for name, (data, codec) in forms.items():
            path = Path(tmp) / "form.parquet"
            pq.write_table(data, path, compression=codec, use_dictionary=False)
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                for batch in pq.ParquetFile(path).iter_batches(batch_size=65_536):
                    score_rows(batch.column(0), rows.shape[1])
                best = min(best, time.perf_counter() - start)
            print(f"  {name:<52} {best:.2f} s, {path.stat().st_size / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per step (batch size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="trace path (default: a temporary file)")
    parser.add_argument("--prefill", action="store_true", help="time a prefill's first decode per allocator")
    parser.add_argument("--scores", action="store_true", help="time reading a prefill's scores in each stored form")
    parser.add_argument("--phase", choices=("write", "read", "prefill", "decode"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill:
        compare_pools()
        return
    if args.scores:
        score_forms()
        return
    if args.phase == "prefill":
        from moesim.trace.synth import SynthConfig, synthesize
        synthesize(SynthConfig.from_settings(model="deepseek-v3", requests=1, prompt_len=4096, decode_len=0,
                                             batch=1, seed=0, settings={}, scores=True), args.out)
        return
    if args.phase == "decode":
        print(json.dumps(first_decode(args.out)))
        return
    if args.phase == "write":
        print(json.dumps(write(args.out, args.rows, args.tokens, args.seed)))
        return
    if args.phase == "read":
        print(json.dumps(read(args.out)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp) / "deepseek-v3-synthetic.parquet"
        common = [sys.executable, __file__, "--out", str(path)]
        w = _run(common + ["--phase", "write", "--rows", str(args.rows), "--tokens", str(args.tokens),
                           "--seed", str(args.seed)])
        print(f"write: {w['rows']:,} rows in {w['seconds']:.1f} s = {w['rows_per_s']:,.0f} rows/s, "
              f"peak RSS {w['peak_rss_mib']:.0f} MiB, file {w['file_mib']:.0f} MiB")
        r = _run(common + ["--phase", "read"])
        print(f"read:  {r['rows']:,} rows, {r['steps']:,} steps in {r['seconds']:.1f} s = "
              f"{r['rows_per_s']:,.0f} rows/s, peak RSS {r['peak_rss_mib']:.0f} MiB")
        if r["rows"] != w["rows"]:
            sys.exit(f"read {r['rows']} rows, wrote {w['rows']}")
        if r["peak_rss_mib"] >= 1024:
            sys.exit(f"read peak RSS {r['peak_rss_mib']:.0f} MiB is over 1 GiB")


def _run(command: list[str]) -> dict:
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


if __name__ == "__main__":
    main()
