"""ModelSpec byte counts, KV-cache sizes and validation, checked against hand-computed numbers."""

from __future__ import annotations

import dataclasses

import pytest

from moesim.errors import ConfigError
from moesim.model.presets import load_preset
from moesim.model.spec import ModelSpec

# One routed expert = gate + up + down (SwiGLU) = 3 x hidden x moe_intermediate weights.
DSV3_EXPERT_PARAMS = 3 * 7168 * 2048  # 44,040,192
MIXTRAL_EXPERT_PARAMS = 3 * 4096 * 14336  # 176,160,768


def _spec(**overrides) -> ModelSpec:
    base = dict(name="toy", num_layers=4, num_experts=8, top_k=2, hidden_size=64, moe_intermediate_size=32)
    base.update(overrides)
    return ModelSpec(**base)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("bf16", 88_080_384),  # 2 bytes per weight
        ("fp16", 88_080_384),
        # 1 byte per weight + one fp32 scale per 128x128 block: 2688 blocks x 4 bytes
        ("fp8", 44_040_192 + 10_752),
        # 1 byte per weight + one fp16 scale per 128 weights
        ("int8", 44_040_192 + 44_040_192 // 128 * 2),
        # half a byte per weight + one fp16 scale per 128 weights
        ("int4", 22_020_096 + 688_128),
    ],
)
def test_deepseek_v3_expert_bytes(dtype: str, expected: int) -> None:
    spec = load_preset("deepseek-v3")
    assert spec.expert_params == DSV3_EXPERT_PARAMS
    assert spec.expert_bytes(dtype) == expected


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("bf16", 352_321_536),
        ("fp8", 176_160_768 + 43_008),
        ("int8", 176_160_768 + 2_752_512),
        ("int4", 88_080_384 + 2_752_512),
    ],
)
def test_mixtral_expert_bytes(dtype: str, expected: int) -> None:
    spec = load_preset("mixtral-8x7b")
    assert spec.expert_params == MIXTRAL_EXPERT_PARAMS
    assert spec.expert_bytes(dtype) == expected


def test_expert_bytes_default_is_the_model_dtype_and_group_size_changes_scales() -> None:
    spec = load_preset("deepseek-v3")
    assert spec.expert_bytes() == spec.expert_bytes("bf16")
    grouped_64 = dataclasses.replace(spec, quant_group_size=64)
    assert grouped_64.expert_bytes("int4") == 22_020_096 + DSV3_EXPERT_PARAMS // 64 * 2


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown expert dtype 'int3'"):
        load_preset("mixtral-8x7b").expert_bytes("int3")


def test_kv_bytes_per_token_mla_counts_latent_and_rope_key_over_all_layers() -> None:
    # DeepSeek-V3: 61 layers (58 MoE + 3 dense) x (kv_lora_rank 512 + rope key 64) x 2 bytes.
    assert load_preset("deepseek-v3").kv_bytes_per_token() == 61 * (512 + 64) * 2 == 70_272
    # DeepSeek-V2-Lite: 27 layers x 576 x 2 bytes.
    assert load_preset("deepseek-v2-lite").kv_bytes_per_token() == 31_104


def test_kv_bytes_per_token_gqa_counts_k_and_v_of_each_kv_head() -> None:
    # Mixtral: 32 layers x (K + V) x 8 KV heads x 128 dims x 2 bytes.
    assert load_preset("mixtral-8x7b").kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131_072
    # Qwen3-30B-A3B: 48 layers x 2 x 4 KV heads x 128 x 2 bytes; fp8 cache halves it.
    spec = load_preset("qwen3-30b-a3b")
    assert spec.kv_bytes_per_token() == 98_304
    assert spec.kv_bytes_per_token("fp8") == 49_152


def test_non_expert_bytes_is_total_minus_routed_experts() -> None:
    spec = load_preset("mixtral-8x7b")
    assert spec.routed_expert_params == 32 * 8 * MIXTRAL_EXPERT_PARAMS == 45_097_156_608
    assert spec.non_expert_bytes() == (46_702_792_704 - 45_097_156_608) * 2


def test_a_model_cut_to_its_first_layers_keeps_their_non_expert_weights_only() -> None:
    """Mixtral cut to 2 of 32 layers (moesim validate --layers 2): the 30 dropped layers take their experts,
    attention (q, k, v, o: 41.9M) and gate (32.8K) with them; embeddings and LM head stay."""
    mixtral = load_preset("mixtral-8x7b")
    two = mixtral.truncated(2)
    assert two.num_layers == 2 and two.routed_expert_params == 2 * 8 * 3 * 4096 * 14336
    per_layer = (4096 * 32 * 128) * 2 + 2 * 4096 * 8 * 128 + 4096 * 8
    assert two.total_params == mixtral.total_params - 30 * (8 * 3 * 4096 * 14336 + per_layer)
    assert mixtral.non_expert_bytes() - two.non_expert_bytes() == 30 * per_layer * 2
    assert two.non_expert_bytes() < 0.7 * 2**30  # not the dropped layers' 81 GiB of experts
    assert mixtral.truncated(32) == mixtral
    deepseek = load_preset("deepseek-v3").truncated(1)  # shared experts leave with their layer too
    assert deepseek.non_expert_bytes() < load_preset("deepseek-v3").non_expert_bytes() / 4


def test_shared_params_and_flops_use_the_merged_shared_width() -> None:
    spec = load_preset("qwen2-57b-a14b")
    assert spec.shared_params == 3 * 3584 * 20480
    assert spec.shared_flops(4) == 2.0 * 4 * 3 * 3584 * 20480
    assert spec.expert_flops(4) == 2.0 * 4 * 3 * 3584 * 2560


def test_from_dict_rejects_unknown_field_naming_it() -> None:
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_dict({"name": "x", "num_layers": 1, "num_experts": 2, "top_k": 1, "hidden_size": 8,
                             "moe_intermediate_size": 8, "n_routed_experts": 2}, origin="m.yaml")
    assert "n_routed_experts" in str(err.value) and "m.yaml" in str(err.value)


def test_from_dict_requires_routing_fields() -> None:
    with pytest.raises(ConfigError, match="field 'top_k'"):
        ModelSpec.from_dict({"name": "x", "num_layers": 1, "num_experts": 2, "hidden_size": 8,
                             "moe_intermediate_size": 8}, origin="m.yaml")


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"top_k": 9}, "top_k"),
        ({"num_layers": 0}, "num_layers"),
        ({"total_params": -1}, "total_params"),
        ({"total_params": 6.9e9}, "total_params"),
        ({"vocab_size": "50304"}, "vocab_size"),
        ({"num_shared_experts": 2}, "shared_intermediate_size"),
        ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
        ({"attention": "mla", "qk_rope_head_dim": 64}, "kv_lora_rank"),
        ({"attention": "mha"}, "attention"),
        ({"expert_dtype": "fp4"}, "expert_dtype"),
    ],
)
def test_check_names_the_bad_field(overrides: dict, field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        _spec(**overrides).check("toy.yaml")
    assert err.value.field == field_name
    assert str(err.value).startswith("toy.yaml, field ")


def test_check_accepts_a_consistent_mla_spec_with_shared_experts() -> None:
    spec = _spec(attention="mla", kv_lora_rank=16, qk_rope_head_dim=8, num_shared_experts=2,
                 shared_intermediate_size=64, num_dense_layers=1)
    spec.check("toy.yaml")
    assert spec.kv_bytes_per_token() == 5 * (16 + 8) * 2
