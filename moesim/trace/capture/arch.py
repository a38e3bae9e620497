"""What capture knows about each MoE architecture, from its Hugging Face config alone.

For every supported ``model_type``: where the router sits in a decoder layer,
which decoder layers are MoE layers, the router's scoring function and whether
the gate weights the model applies are renormalised over the selected experts.
:func:`config_to_spec` turns a config into the :class:`ModelSpec` a trace
carries. No torch here: a config object only needs attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Callable

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.trace.capture.errors import NoMoELayersError, UnsupportedRouterError


def _all_layers(config: Any) -> list[int]:
    return list(range(config.num_hidden_layers))


def _qwen_moe_layers(config: Any) -> list[int]:
    # Qwen2/Qwen3-MoE decoder layer rule: MoE unless listed in mlp_only_layers or off the sparse step.
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    if _get(config, "num_experts") <= 0:
        return []
    return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def _deepseek_moe_layers(config: Any) -> list[int]:
    first = getattr(config, "first_k_dense_replace", 0) or 0
    return list(range(first, config.num_hidden_layers))


def _get(config: Any, *names: str, default: Any = 0) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class ArchInfo:
    """How one architecture routes."""

    model_type: str
    #: attribute of the decoder layer's ``mlp`` that holds the router module
    router_attr: str
    #: the router's own scoring function over all experts ("softmax" or "sigmoid")
    scores_function: str
    moe_layers: Callable[[Any], list[int]]
    #: whether the applied weights are divided by their sum over the selected experts
    renormalized: Callable[[Any], bool]
    #: how the applied weights come from the scores, for the trace metadata
    weights_rule: Callable[[Any], str]

    def routed_scaling_factor(self, config: Any) -> float:
        return float(getattr(config, "routed_scaling_factor", 1.0) or 1.0) \
            if self.model_type.startswith("deepseek") else 1.0


def _norm_flag(config: Any) -> bool:
    return bool(getattr(config, "norm_topk_prob", False))


def _softmax_topk_rule(config: Any) -> str:
    renorm = " renormalised to sum 1" if _norm_flag(config) else ""
    return f"softmax over all experts, top-k probabilities{renorm} (norm_topk_prob={_norm_flag(config)})"


ARCHITECTURES: dict[str, ArchInfo] = {
    "mixtral": ArchInfo("mixtral", "gate", "softmax", _all_layers, lambda c: True,
                        lambda c: "softmax over all experts, top-k probabilities renormalised to sum 1"),
    "qwen2_moe": ArchInfo("qwen2_moe", "gate", "softmax", _qwen_moe_layers, _norm_flag, _softmax_topk_rule),
    "qwen3_moe": ArchInfo("qwen3_moe", "gate", "softmax", _qwen_moe_layers, _norm_flag, _softmax_topk_rule),
    "olmoe": ArchInfo("olmoe", "gate", "softmax", _all_layers, _norm_flag, _softmax_topk_rule),
    "deepseek_v2": ArchInfo(
        "deepseek_v2", "gate", "softmax", _deepseek_moe_layers, lambda c: False,
        lambda c: (f"softmax over all experts ({getattr(c, 'topk_method', 'greedy')} top-k), top-k probabilities "
                   f"times routed_scaling_factor={getattr(c, 'routed_scaling_factor', 1.0)}, not renormalised")),
    "deepseek_v3": ArchInfo(
        "deepseek_v3", "gate", "sigmoid", _deepseek_moe_layers, _norm_flag,
        lambda c: (f"sigmoid per expert; selection adds e_score_correction_bias and keeps the best "
                   f"topk_group={getattr(c, 'topk_group', None)} of n_group={getattr(c, 'n_group', None)} groups; "
                   f"weights are the selected sigmoid scores{' renormalised to sum 1' if _norm_flag(c) else ''} "
                   f"times routed_scaling_factor={getattr(c, 'routed_scaling_factor', 1.0)}")),
    "gpt_oss": ArchInfo("gpt_oss", "router", "softmax", _all_layers, lambda c: True,
                        lambda c: "top-k by logit, weights = softmax over the k selected logits "
                                  "(scores column: softmax over all experts)"),
}

EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


#: where composite and older configs keep their text model's expert count: Llama 4, Qwen3-VL-MoE and GLM-4.5V
#: in text_config, DBRX in ffn_config (moe_num_experts)
NESTED_CONFIGS = ("text_config", "language_config", "llm_config", "ffn_config")


def _expert_count(config: Any) -> int:
    """Routed experts per layer as any config field says (nested text or FFN configs included), 0 if none does."""
    for part in (config, *(getattr(config, name, None) for name in NESTED_CONFIGS)):
        if part is None:
            continue
        for name in (*EXPERT_COUNT_FIELDS, "moe_num_experts"):
            value = part.get(name) if isinstance(part, dict) else getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def arch_for(config: Any, origin: str) -> ArchInfo:
    """The :class:`ArchInfo` of a config, or the error that says why capture cannot trace it."""
    model_type = getattr(config, "model_type", None)
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    experts = _expert_count(config)
    supported = ", ".join(sorted(ARCHITECTURES))
    if experts > 0:
        raise UnsupportedRouterError(f"model_type '{model_type}' has {experts} expert{'s' if experts != 1 else ''} "
                                     "per layer but its router is not one capture can read", source=origin,
                                     field="model_type", fix=f"capture supports {supported}")
    raise NoMoELayersError(f"model_type '{model_type}' has no mixture-of-experts layers", source=origin,
                           field="model_type", fix=f"capture an MoE model ({supported})")


def _expert_dtype(config: Any) -> tuple[str, int, str]:
    """(expert_dtype, quant_group_size, source note) from the config's dtype or quantization_config."""
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        method = (quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None))
        method = str(method or "").lower()
        if method == "mxfp4":
            # MXFP4: 4-bit values with one shared 8-bit scale per 32 (OCP microscaling format).
            return "int4", 32, "quantization_config quant_method=mxfp4: 4-bit weights, one scale per 32"
        if method == "fp8":
            return "fp8", 128, "quantization_config quant_method=fp8"
    dtype = str(_get(config, "dtype", "torch_dtype", default="")).replace("torch.", "")
    mapping = {"bfloat16": "bf16", "float16": "fp16"}
    if dtype in mapping:
        return mapping[dtype], 128, f"config dtype={dtype}"
    return "bf16", 128, (f"config dtype={dtype or 'unset'}; bf16 assumed for expert bytes "
                         "(offloaded experts are normally kept in bf16)")


def config_to_spec(config: Any, *, name: str | None = None, total_params: int = 0) -> ModelSpec:
    """The trace's :class:`ModelSpec` from a Hugging Face config (layer = MoE-layer index).

    Dense decoder layers (DeepSeek's first ``first_k_dense_replace``, Qwen's
    ``mlp_only_layers``) are counted in ``num_dense_layers``.
    """
    origin = name or getattr(config, "name_or_path", "") or "config.json"
    arch = arch_for(config, origin)
    moe = arch.moe_layers(config)
    if not moe:
        raise NoMoELayersError("config has no MoE decoder layer", source=origin,
                               field="num_experts / mlp_only_layers / first_k_dense_replace",
                               fix="capture a checkpoint whose config enables experts")
    model_type = arch.model_type
    hidden = int(config.hidden_size)
    heads = int(_get(config, "num_attention_heads"))
    num_experts = int(_get(config, *EXPERT_COUNT_FIELDS))
    if model_type in ("mixtral", "olmoe", "gpt_oss"):
        moe_inter = int(config.intermediate_size)
    else:
        moe_inter = int(config.moe_intermediate_size)
    shared, shared_inter = 0, 0
    if model_type == "qwen2_moe":
        shared_inter = int(_get(config, "shared_expert_intermediate_size"))
        # Qwen1.5-MoE's one wide shared MLP stands for shared_inter / moe_inter fine-grained experts.
        shared = shared_inter // moe_inter if shared_inter and shared_inter % moe_inter == 0 else int(shared_inter > 0)
    elif model_type.startswith("deepseek"):
        shared = int(_get(config, "n_shared_experts"))
        shared_inter = shared * moe_inter
    dense_layers = int(config.num_hidden_layers) - len(moe)
    attention = {"attention": "gqa", "kv_lora_rank": 0, "qk_rope_head_dim": 0,
                 "head_dim": int(_get(config, "head_dim", default=0) or hidden // max(heads, 1))}
    if model_type.startswith("deepseek"):
        attention = {"attention": "mla", "kv_lora_rank": int(config.kv_lora_rank),
                     "qk_rope_head_dim": int(config.qk_rope_head_dim), "head_dim": int(config.qk_nope_head_dim)}
    dtype, group, dtype_note = _expert_dtype(config)
    display = name or PurePath(str(getattr(config, "name_or_path", "") or model_type)).name.lower() or model_type
    spec = ModelSpec(
        name=display, num_layers=len(moe), num_experts=num_experts, top_k=int(config.num_experts_per_tok),
        hidden_size=hidden, moe_intermediate_size=moe_inter, num_shared_experts=shared,
        shared_intermediate_size=shared_inter, num_dense_layers=dense_layers,
        dense_intermediate_size=int(_get(config, "intermediate_size")) if dense_layers else 0,
        num_attention_heads=heads, num_kv_heads=int(_get(config, "num_key_value_heads", default=heads)),
        vocab_size=int(_get(config, "vocab_size")), expert_dtype=dtype, quant_group_size=group,
        total_params=int(total_params), **attention,
        sources={"*": f"{origin} config.json (model_type={model_type})",
                 "num_layers": f"MoE decoder layers {moe[0]}..{moe[-1]} of {config.num_hidden_layers}",
                 "expert_dtype": dtype_note,
                 "total_params": "parameter count of the loaded model" if total_params else "unknown"})
    try:
        spec.check(origin)
    except ConfigError as err:  # name the config.json key the number came from, not the spec's field
        expert_key = next((key for key in EXPERT_COUNT_FIELDS if getattr(config, key, None) is not None),
                          "num_experts")
        keys = {"top_k": "num_experts_per_tok", "num_experts": expert_key, "num_layers": "num_hidden_layers",
                "moe_intermediate_size": ("intermediate_size" if model_type in ("mixtral", "olmoe", "gpt_oss")
                                          else "moe_intermediate_size")}
        if err.field in keys:
            err.rename_field(keys[err.field])
        raise
    return spec
