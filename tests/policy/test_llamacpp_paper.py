"""llama.cpp's own options, as its public source defines them (ggml-org/llama.cpp ``common/arg.cpp``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moesim.errors import ConfigError
from moesim.sim.run import simulate
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


def dense_first(tmp_path):
    """One dense block, then 3 MoE layers of 4 experts (llama.cpp blocks blk.0 .. blk.3)."""
    model = dataclasses.replace(tiny_model(layers=3, experts=4, top_k=2), num_dense_layers=1,
                                dense_intermediate_size=64)
    routing = random_routing(np.random.default_rng(0), model, requests=1, prompt=4, decode=3)
    return write_tiny_trace(tmp_path / "t.parquet", model, routing)


def test_n_cpu_moe_counts_transformer_blocks_dense_ones_included(tmp_path):
    """--n-cpu-moe 2 overrides blk.0 (dense: no experts) and blk.1 (MoE layer 0): one MoE layer on the CPU."""
    path = dense_first(tmp_path)
    run = simulate(str(path), tiny_profile(), "llamacpp", {"engine.check": "true", "cache.n_cpu_moe": "2"})
    assert [len(r) for r in run.initial_resident] == [0, 4, 4]
    assert "llamacpp: experts of MoE layer 0 on the CPU, layers 1..2 all on the GPU (--n-cpu-moe 2)" in run.notes
    one = simulate(str(path), tiny_profile(), "llamacpp", {"engine.check": "true", "cache.n_cpu_moe": "1"})
    assert [len(r) for r in one.initial_resident] == [4, 4, 4]  # blk.0 alone: nothing to move
    assert "llamacpp: experts of all 3 MoE layers on the GPU (--n-cpu-moe 0)" in one.notes
    every = simulate(str(path), tiny_profile(), "llamacpp-experts", {"engine.check": "true"})
    assert "llamacpp: experts of all 3 MoE layers on the CPU (--cpu-moe)" in every.notes


def test_too_small_n_cpu_moe_names_the_block_count(tmp_path):
    """8 slots hold 2 whole MoE layers: at least 1 on the CPU, which is --n-cpu-moe 2 with the dense block."""
    path = dense_first(tmp_path)
    auto = simulate(str(path), tiny_profile(), "llamacpp", {"cache.slots": "8"})
    assert [len(r) for r in auto.initial_resident] == [0, 4, 4]
    assert any(note.endswith("(--n-cpu-moe 2)") for note in auto.notes)
    with pytest.raises(ConfigError, match=r"cache.n_cpu_moe >= 2 \(or -1\)"):
        simulate(str(path), tiny_profile(), "llamacpp", {"cache.slots": "8", "cache.n_cpu_moe": "1"})
