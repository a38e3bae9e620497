"""Small models, profiles and traces for tests, built in memory (no shipped files needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moesim.hw.profile import HardwareProfile, parse_profile
from moesim.model.spec import ModelSpec
from moesim.trace import TraceMeta, write_trace

HIDDEN, INTERMEDIATE = 64, 128


def tiny_model(layers: int = 2, experts: int = 4, top_k: int = 2, shared: bool = False) -> ModelSpec:
    return ModelSpec(name="tiny", num_layers=layers, num_experts=experts, top_k=top_k, hidden_size=HIDDEN,
                     moe_intermediate_size=INTERMEDIATE, num_shared_experts=1 if shared else 0,
                     shared_intermediate_size=INTERMEDIATE if shared else 0, num_attention_heads=2,
                     num_kv_heads=2, head_dim=32, vocab_size=100, total_params=10_000_000)


def profile_dict(*, gpu_us: tuple[float, float] = (100.0, 1000.0), cpu_us: tuple[float, float] = (1000.0, 10000.0),
                 attention_us: float = 50.0, pcie_gbps: float = 0.0001, launch_us: float = 5.0,
                 sync_us: float = 20.0, latency_us: float = 10.0, copy_engines: int = 1) -> dict[str, Any]:
    """A profile whose curves make hand computation easy: expert time is tabulated at 1 and 100 tokens.

    The default PCIe bandwidth (0.0001 GB/s = 100 kB/s) puts one tiny expert
    (3*64*128 bf16 = 49,152 bytes) at 491.52 ms + latency, so loads dominate.
    """
    # one curve: a shared expert of tiny_model(shared=True) has the routed shape, and runs at these times too
    gpu_curves = [{"hidden": HIDDEN, "intermediate": INTERMEDIATE, "dtype": "bf16", "tokens": [1, 100],
                   "time_us": list(gpu_us), "source": "test"}]
    return {
        "schema_version": 1,
        "name": "test",
        "gpu": {"name": "test gpu", "memory_gib": 24, "reserved_gib": 1, "launch_us": launch_us,
                "graph_launch_us": 1, "cuda_graph": False, "peak_tflops": {"bf16": 100},
                "mem_bandwidth_gbps": 1000, "expert_ffn": gpu_curves,
                "attention": [{"tokens": 1, "context": [1, 100000], "time_us": [attention_us, attention_us],
                               "source": "test"}]},
        "cpu": {"name": "test cpu", "cores": 8, "dram_bandwidth_gbps": 100, "peak_tflops": {"avx512": 1},
                "amx_switch_tokens": None,
                "expert_ffn": [{"hidden": HIDDEN, "intermediate": INTERMEDIATE, "dtype": "bf16", "kernel": "avx512",
                                "tokens": [1, 100], "time_us": list(cpu_us), "source": "test"}]},
        "pcie": {"generation": 4, "h2d": {"size_bytes": [1, 1e9], "gbps": [pcie_gbps, pcie_gbps], "source": "test"},
                 "d2h": {"size_bytes": [1, 1e9], "gbps": [pcie_gbps, pcie_gbps], "source": "test"},
                 "latency_us": latency_us, "copy_engines": copy_engines, "duplex_slowdown": 0.8},
        "sync": {"per_layer_us": sync_us},
        "sources": {"gpu": "test", "cpu": "test", "pcie": "test", "sync": "test"},
    }


def tiny_profile(**kwargs: Any) -> HardwareProfile:
    return parse_profile(profile_dict(**kwargs), origin="test-profile")


def write_tiny_trace(path: Path, model: ModelSpec, routing: list[dict[str, Any]]) -> Path:
    """Write a trace from a list of steps, one forward pass each.

    Each step entry: ``{"phase": "decode", "tokens": {request: (position, experts_by_layer)}}`` where
    ``experts_by_layer[layer]`` is a list of expert-id lists, one per token of that request.
    """
    cols: dict[str, list] = {k: [] for k in ("step", "layer", "request", "position", "phase", "experts")}
    for step, entry in enumerate(routing):
        for layer in range(model.num_layers):
            for request in sorted(entry["tokens"]):
                first_position, by_layer = entry["tokens"][request]
                for i, experts in enumerate(by_layer[layer]):
                    cols["step"].append(step)
                    cols["layer"].append(layer)
                    cols["request"].append(request)
                    cols["position"].append(first_position + i)
                    cols["phase"].append(entry["phase"])
                    cols["experts"].append(list(experts))
    data = {k: np.array(v) if k != "phase" else v for k, v in cols.items()}
    data["experts"] = np.array(cols["experts"], dtype=np.int16).reshape(-1, model.top_k)
    return write_trace(path, data, TraceMeta(model=model, source={"kind": "test"}))


def random_routing(rng: np.random.Generator, model: ModelSpec, requests: int, prompt: int,
                   decode: int) -> list[dict[str, Any]]:
    """Prefill of every request, then decode steps batching all requests."""
    def pick(n: int) -> list[list[list[int]]]:
        return [[sorted(rng.choice(model.num_experts, model.top_k, replace=False).tolist()) for _ in range(n)]
                for _ in range(model.num_layers)]
    steps = [{"phase": "prefill", "tokens": {r: (0, pick(prompt))}} for r in range(requests)]
    for d in range(decode):
        steps.append({"phase": "decode", "tokens": {r: (prompt + d, pick(1)) for r in range(requests)}})
    return steps


def write_trace_and_profile(folder: Path, seed: int, requests: int = 1, prompt: int = 4,
                            decode: int = 8) -> tuple[str, str]:
    """``folder/t.parquet``, random routing on a 2-layer, 6-expert, top-2 model (``requests`` decoded together,
    ``prompt`` + ``decode`` tokens each), and ``folder/hw.yaml``, the tiny profile with a 1 GB/s link."""
    import yaml
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(folder / "t.parquet", model, random_routing(
        np.random.default_rng(seed), model, requests=requests, prompt=prompt, decode=decode))
    hw = folder / "hw.yaml"
    hw.write_text(yaml.safe_dump(profile_dict(pcie_gbps=1.0)))
    return str(trace), str(hw)


def write_sweep_files(folder: Path, seed: int) -> Path:
    """A tiny trace ``t.parquet`` (one request, 4 + 8 tokens) and profile ``hw.yaml`` in ``folder``, for sweep
    specs that name them relative to their own folder."""
    write_trace_and_profile(folder, seed)
    return folder


def with_scores(path: Path, out: Path, bad: dict[int, float] | None = None) -> Path:
    """``path`` with a ``scores`` column (uniform probabilities) added, row ``r``'s first score set to
    ``bad[r]``: a trace whose only fault, if any, lies in a column most systems never read."""
    import pyarrow.parquet as pq
    from moesim.trace.io import read_meta
    from moesim.trace.schema import scores_to_arrow
    table = pq.read_table(path)
    experts = read_meta(path).model.num_experts
    scores = np.full((table.num_rows, experts), 1.0 / experts, dtype=np.float16)
    for row, value in (bad or {}).items():
        scores[row, 0] = value
    pq.write_table(table.append_column("scores", scores_to_arrow(scores, experts)), out)
    return out


#: sweep settings of a 0.5 GiB GPU whose workspace leaves room for about six of the tiny model's experts:
#: 6 slots per layer (12 experts) do not fit, 1 or 2 do; the way a point fails on its own while the spec is valid
TIGHT_GPU = {"hw.gpu.memory_gib": 0.5, "hw.gpu.reserved_gib": 0.01, "memory.workspace_gib": 0.4715}


def write_spec(folder: Path, **spec) -> Path:
    """``folder/spec.yaml``: a sweep spec over ``t.parquet`` and ``hw.yaml`` (:func:`write_sweep_files`) with ``spec``."""
    import yaml
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], **spec}))
    return path


def spec_for_kill(folder: Path) -> Path:
    """A sweep of 16 points of about 0.3-0.6 s each on the bundled Mixtral trace, long enough to interrupt."""
    import shutil
    shutil.copy(Path(__file__).resolve().parents[1] / "traces" / "mixtral-8x7b-humaneval.parquet",
                folder / "mix.parquet")
    # rtx4090 holds 60 of Mixtral's 256 experts: every point streams experts over PCIe
    return write_spec(folder, traces=["mix.parquet"], hw=["rtx4090"], systems=["gpu-only-lru", "static-hot"],
                      grid={"cache.slots": [16, 32, 48, 60], "hw.pcie.bandwidth_scale": [0.5, 1.0]})


def write_partial_trace(path: Path, layers: list[int], num_layers: int = 3, steps: int = 4,
                        requests: int = 1) -> Path:
    """A decode trace that logged only ``layers`` of a ``num_layers``-layer model (as an importer's per-layer
    logs are), ``requests`` requests batched in every step, each routed to experts 0 and 1."""
    model = tiny_model(layers=num_layers, experts=6, top_k=2)
    per_step = len(layers) * requests
    data = {"step": np.repeat(np.arange(steps), per_step), "layer": np.tile(np.repeat(layers, requests), steps),
            "request": np.tile(np.arange(requests), steps * len(layers)),
            "position": np.repeat(np.arange(steps), per_step), "phase": ["decode"] * (steps * per_step),
            "experts": np.tile(np.array([[0, 1]], dtype=np.int16), (steps * per_step, 1))}
    source = {"kind": "imported", "layers_present": layers}
    return write_trace(path, data, TraceMeta(model=model, source=source))


def routing_rows(model: ModelSpec, routing: list[dict[str, Any]]) -> list[tuple]:
    """``routing`` (:func:`random_routing`) as trace rows (step, layer, request, position, phase, experts), in
    the order a trace keeps them."""
    rows = []
    for step, entry in enumerate(routing):
        for request in sorted(entry["tokens"]):
            first, by_layer = entry["tokens"][request]
            for i in range(len(by_layer[0])):
                for layer in range(model.num_layers):
                    rows.append((step, layer, request, first + i, entry["phase"], list(by_layer[layer][i])))
    rows.sort(key=lambda r: r[:4])
    return rows


def write_scored_trace(path: Path, model: ModelSpec, routing: list[dict[str, Any]],
                       rng: np.random.Generator) -> str:
    """``routing`` (tests.factories) with router scores (routed experts above the rest) and each token's
    next-layer prediction (its real next-layer experts, one of them sometimes swapped for another)."""
    rows = routing_rows(model, routing)
    used = {(r[2], r[3], r[1]): r[5] for r in rows}  # a token's experts by (request, position, layer)
    rows = [(*r, list(used[(r[2], r[3], r[1] + 1)]) if r[1] + 1 < model.num_layers else []) for r in rows]
    n = len(rows)
    scores = rng.random((n, model.num_experts)) * 0.3
    for i, row in enumerate(rows):
        scores[i, row[5]] = 0.3 + 0.6 * rng.random(len(row[5]))
        if row[6] and rng.random() < 0.3:
            row[6][-1] = int(rng.integers(model.num_experts))
            row[6][:] = list(dict.fromkeys(row[6]))
    data = {name: np.array([r[i] for r in rows]) for i, name in enumerate(("step", "layer", "request", "position"))}
    data["phase"] = [r[4] for r in rows]
    data["experts"] = np.array([r[5] for r in rows], dtype=np.int16).reshape(n, model.top_k)
    data["pred_next_layer"] = [r[6] for r in rows]
    data["scores"] = scores.astype(np.float16)
    return str(write_trace(path, data, TraceMeta(model=model, source={"kind": "test"})))


def draw_profile(draw: Any) -> dict[str, Any]:
    """tiny_profile settings drawn by a hypothesis ``draw``: expert, attention and sync times, link speeds
    from loads that dominate to loads that do not, one or two copy engines."""
    from hypothesis import strategies as st
    return dict(
        gpu_us=(draw(st.floats(10, 500)), draw(st.floats(500, 5000))),
        cpu_us=(draw(st.floats(10, 5000)), draw(st.floats(5000, 50000))),
        attention_us=draw(st.floats(1, 200)),
        pcie_gbps=draw(st.sampled_from([0.0001, 0.001, 0.01, 1.0])),
        sync_us=draw(st.floats(0, 50)),
        copy_engines=draw(st.integers(1, 2)),
    )


def preempted_prefetch(engine, elements: int):
    """A prefetch of ``elements`` floats running on the copy ``engine`` when a small demand load is queued behind
    it (chunked copies: the demand overtakes it at a chunk boundary); returns (prefetch, demand, their
    destinations, the source)."""
    import time

    import torch
    src = torch.arange(elements, dtype=torch.float32)
    a, b = torch.zeros_like(src), torch.zeros(1000)
    prefetch = engine.submit(a, src, priority=1, kind="prefetch", layer=1, expert=0, step=0)
    while engine.running is not prefetch:
        time.sleep(1e-4)
    demand = engine.submit(b, src[:1000], priority=0, kind="load", layer=0, expert=0, step=0)
    return prefetch, demand, a, b, src
