"""llama.cpp ``--n-cpu-moe N``: layer placement, the memory check, op offload of large batches."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.hw.profile import parse_profile
from moesim.policy.base import RunContext
from moesim.policy.catalog.llamacpp import LlamaCppLayers, placement
from moesim.sim.result import result_to_frames
from moesim.sim.run import simulate
from tests.factories import profile_dict, random_routing, tiny_model, tiny_profile, write_tiny_trace

GIB = 2**30


def small_gpu(model, layers_that_fit: float, kv_tokens: int):
    """A profile whose GPU holds non-expert weights, KV, 2 staging buffers and ``layers_that_fit`` expert layers."""
    costs = CostModel(tiny_profile(), model)
    need = (model.non_expert_bytes(costs.dtype) + kv_tokens * model.kv_bytes_per_token() + 2 * costs.expert_bytes
            + layers_that_fit * model.num_experts * costs.expert_bytes)
    raw = profile_dict()
    raw["gpu"]["memory_gib"], raw["gpu"]["reserved_gib"] = need / GIB, 0
    return parse_profile(raw, origin="small-gpu")


def trace(tmp_path, model, prompt=4, decode=3):
    routing = random_routing(np.random.default_rng(0), model, requests=1, prompt=prompt, decode=decode)
    return write_tiny_trace(tmp_path / "t.parquet", model, routing)


def test_first_n_layers_on_cpu_the_rest_resident(tmp_path):
    model = tiny_model(layers=3, experts=4, top_k=2)
    placement = LlamaCppLayers(n_cpu_moe=2)
    spread = placement.spread(12, 3, 4)  # memory for all 12 experts, but N=2 asked for
    assert spread.capacity == [0, 0, 4] and spread.pool is None
    ctx = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=spread.capacity,
                     trace_path=str(trace(tmp_path, model)))
    placement.configure(ctx)
    assert [placement.initial(layer, 4) for layer in range(3)] == [[], [], [0, 1, 2, 3]]
    assert ctx.notes[-1] == "llamacpp: experts of MoE layers 0..1 on the CPU, layer 2 all on the GPU (--n-cpu-moe 2)"


def test_placement_note_names_every_layer_range():
    assert placement(0, 3) == "experts of all 3 MoE layers on the GPU"
    assert placement(3, 3) == "experts of all 3 MoE layers on the CPU"
    assert placement(1, 3) == "experts of MoE layer 0 on the CPU, layers 1..2 all on the GPU"


def test_memory_decides_the_smallest_n(tmp_path):
    model = tiny_model(layers=3, experts=4, top_k=2)
    path = trace(tmp_path, model)
    profile = small_gpu(model, layers_that_fit=1.5, kv_tokens=7)  # prompt 4 + decode 3
    settings = {"memory.workspace_gib": "0", "engine.check": "true"}
    auto = simulate(str(path), profile, "llamacpp", settings)
    assert [len(r) for r in auto.initial_resident] == [0, 0, 4]  # only one whole layer fits
    with pytest.raises(ConfigError, match=r"cache.n_cpu_moe >= 2"):
        simulate(str(path), profile, "llamacpp", {**settings, "cache.n_cpu_moe": "1"})


def test_cpu_layers_compute_on_cpu_in_decode_and_offload_large_prefills(tmp_path):
    model = tiny_model(layers=2, experts=4, top_k=2)
    path = trace(tmp_path, model, prompt=40, decode=3)
    profile = tiny_profile(pcie_gbps=0.49152)
    result = simulate(str(path), profile, "llamacpp", {"cache.n_cpu_moe": "1", "engine.check": "true"},
                      decisions=True)
    log = result_to_frames(result)["decisions"]
    decode = log[log.step > 0]
    assert set(decode[decode.layer == 0].action) == {"cpu"}
    assert set(decode[decode.layer == 1].action) == {"gpu_hit"}
    prefill = log[log.step == 0]
    # 40 tokens >= 32: the CPU layer's activated experts are copied to the GPU for this batch only
    assert set(prefill[prefill.layer == 0].action) == {"gpu_stream"}
    m = metrics(result)
    assert m["demand_loads"] == 0 and m["evictions"] == 0 and m["streamed_experts"] == 4
    no_offload = simulate(str(path), profile, "llamacpp",
                          {"cache.n_cpu_moe": "1", "assign.op_offload_min_batch": "0"}, decisions=True)
    log = result_to_frames(no_offload)["decisions"]
    assert set(log[(log.step == 0) & (log.layer == 0)].action) == {"cpu"}


def test_001s_extension_keeps_every_expert_on_the_cpu_where_stock_llamacpp_holds_layers(tmp_path):
    """llamacpp-experts (001 Sec. 6.1): with memory for every layer, stock llama.cpp holds them all on the GPU
    and decodes on it; the extension computes every decode expert on the CPU (1 token: cpu(1) = 1000 us each)."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    path = trace(tmp_path, model, prompt=4, decode=3)
    profile = tiny_profile()
    stock = simulate(str(path), profile, "llamacpp", {"engine.check": "true"}, decisions=True)
    extended = simulate(str(path), profile, "llamacpp-experts", {"engine.check": "true"}, decisions=True)
    assert [len(r) for r in stock.initial_resident] == [4, 4]
    assert [len(r) for r in extended.initial_resident] == [0, 0]
    log = result_to_frames(extended)["decisions"]
    assert set(log.action) == {"cpu"}
    assert set(result_to_frames(stock)["decisions"].action) == {"gpu_hit"}
    # each decode layer: two experts of one token on the CPU, one after another
    breakdown = metrics(extended)["breakdown_ms"]
    decode_experts = 3 * 2 * 2  # decode steps x layers x top_k
    assert breakdown["cpu_other"] >= decode_experts * 1.0 - 1e-9
