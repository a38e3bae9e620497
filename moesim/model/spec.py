"""Model shape: what the simulator needs to know about an MoE model.

Only shapes and byte counts live here; no weights. ``num_layers`` counts MoE
layers (the range of a trace's ``layer`` column); dense layers before them
(DeepSeek's first three, for instance) are ``num_dense_layers``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moesim.errors import ConfigError, did_you_mean

#: Bits per weight of each expert dtype.
DTYPE_BITS: dict[str, int] = {"bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}


def scale_bytes_per_param(dtype: str, group_size: int) -> float:
    """Bytes of quantisation scales per weight.

    int8/int4 keep one fp16 scale per ``group_size`` weights (GPTQ/AWQ/llama.cpp
    style group quantisation); fp8 keeps one fp32 scale per 128x128 block, as
    DeepSeek-V3's released fp8 checkpoint does; bf16/fp16 need none.
    """
    if dtype in ("int8", "int4"):
        return 2.0 / group_size
    if dtype == "fp8":
        return 4.0 / (128 * 128)
    return 0.0


#: largest shapes accepted (expert ids are int16 in traces; beyond these a typo is far likelier than a model)
SHAPE_LIMITS: dict[str, int] = {"num_layers": 4096, "num_experts": 32767, "top_k": 1024, "hidden_size": 1 << 20,
                                "moe_intermediate_size": 1 << 20, "quant_group_size": 1 << 20,
                                "expert_matrices": 8}


#: what a string field of a preset looks like, for the fix of an error that finds another type there
_STRING_EXAMPLES = {"name": "my-model", "expert_dtype": "bf16", "attention": "gqa"}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of an MoE model as the cost model sees it."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    #: intermediate size of all shared experts together (0 = none)
    shared_intermediate_size: int = 0
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    #: "gqa" (standard multi/grouped-query) or "mla" (DeepSeek multi-head latent attention)
    attention: str = "gqa"
    kv_lora_rank: int = 0
    #: MLA query compression rank (0: queries projected straight from the hidden state, as DeepSeek-V2-Lite)
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    vocab_size: int = 0
    expert_dtype: str = "bf16"
    #: total parameters of the released model, used for non-expert memory
    total_params: int = 0
    quant_group_size: int = 128
    #: gate/up/down projections (SwiGLU) = 3 matrices; a plain MLP has 2
    expert_matrices: int = 3
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    # -- sizes -----------------------------------------------------------------
    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.hidden_size * self.moe_intermediate_size

    def expert_bytes(self, dtype: str | None = None) -> int:
        """Bytes of one routed expert's weights in ``dtype`` (default: the model's), scales included."""
        dtype = dtype or self.expert_dtype
        if dtype not in DTYPE_BITS:
            raise ConfigError(f"unknown expert dtype '{dtype}'", field="expert_dtype",
                              fix=f"{did_you_mean(str(dtype), DTYPE_BITS)}use one of {', '.join(DTYPE_BITS)}")
        per_param = DTYPE_BITS[dtype] / 8 + scale_bytes_per_param(dtype, self.quant_group_size)
        return int(round(self.expert_params * per_param))

    @property
    def routed_expert_params(self) -> int:
        return self.expert_params * self.num_experts * self.num_layers

    def truncated(self, layers: int) -> "ModelSpec":
        """The model cut to its first ``layers`` MoE layers (``moesim validate --layers``): the dropped
        layers' routed experts, attention, gate and shared experts leave ``total_params`` with them, so that
        the non-expert weights are those of the layers kept (plus embeddings, LM head and dense layers)."""
        routed_per_layer = self.expert_params * self.num_experts
        per_layer = routed_per_layer + self.attention_params_per_layer() + self.gate_params + self.shared_params
        dropped = self.num_layers - layers
        total = max(self.total_params - dropped * per_layer, routed_per_layer * layers) if self.total_params else 0
        return dataclasses.replace(self, num_layers=layers, total_params=total)

    def counted_non_expert_params(self) -> int:
        """Everything but routed experts, counted from the shapes: embeddings and LM head (untied), every
        layer's attention, the MoE layers' gates and shared experts, the dense layers' FFNs. The bundled
        presets' ``total_params`` agree with it within 2.5% (tests/model/test_presets.py)."""
        return (2 * self.vocab_size * self.hidden_size
                + (self.num_layers + self.num_dense_layers) * self.attention_params_per_layer()
                + self.num_layers * (self.gate_params + self.shared_params)
                + self.num_dense_layers * self.dense_ffn_params)

    def check_total_params(self, origin: str = "model") -> None:
        """Refuse a ``total_params`` that the shapes contradict (an edited preset that kept the released
        model's total): the non-expert weights it implies would fill GPU memory with nothing."""
        if not self.total_params:
            return
        implied = self.total_params - self.routed_expert_params
        counted = self.counted_non_expert_params()
        plausible = implied >= 0 if not self.vocab_size else counted / 2 <= implied <= 2 * counted
        if not plausible:
            raise ConfigError(
                f"total_params {self.total_params:,} leaves {implied:,} parameters besides the routed experts "
                f"({self.routed_expert_params:,}), where the shapes count {counted:,} (embeddings, LM head, "
                f"attention, gates, shared and dense FFNs)", source=origin, field="total_params",
                fix=f"give the released model's total; these shapes come to about "
                    f"{self.routed_expert_params + counted:,}")

    def non_expert_bytes(self, dtype: str = "bf16") -> int:
        """Bytes of everything but routed experts (attention, embeddings, dense and shared FFNs)."""
        params = max(self.total_params - self.routed_expert_params, 0)
        return int(params * DTYPE_BITS[dtype] / 8)

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """KV-cache bytes one token adds over all layers (MLA keeps the compressed latent)."""
        layers = self.num_layers + self.num_dense_layers
        if self.attention == "mla":
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_kv_heads * self.head_dim
        return layers * per_layer * DTYPE_BITS[dtype] // 8

    # -- flops -----------------------------------------------------------------
    def expert_flops(self, tokens: int) -> float:
        """Multiply-add flops (2 per MAC) of one routed expert on ``tokens`` tokens."""
        return 2.0 * tokens * self.expert_params

    def shared_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.expert_matrices * self.hidden_size * self.shared_intermediate_size

    @property
    def shared_params(self) -> int:
        return self.expert_matrices * self.hidden_size * self.shared_intermediate_size

    def attention_params_per_layer(self) -> int:
        """Projection weights of one attention block (q, k, v, o; MLA: its low-rank factors).

        MLA after DeepSeek-V3's modelling code (arXiv 2412.19437 Sec. 2.1.1): queries
        through ``q_lora_rank`` (or straight from the hidden state when it is 0), keys and
        values through the ``kv_lora_rank`` latent plus a shared rope key; ``head_dim`` is
        the no-rope query/key head and the value head. DeepSeek-V3: 187.1M per layer.
        """
        h, heads, d = self.hidden_size, self.num_attention_heads, self.head_dim
        if self.attention == "mla":
            q_head = d + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * heads * q_head if self.q_lora_rank else h * heads * q_head
            kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_up = self.kv_lora_rank * heads * 2 * d
            return q + kv_down + kv_up + heads * d * h
        q = h * heads * d
        kv = 2 * h * self.num_kv_heads * d
        o = heads * d * h
        return q + kv + o

    @property
    def gate_params(self) -> int:
        """Router weights of one MoE layer."""
        return self.hidden_size * self.num_experts

    @property
    def dense_ffn_params(self) -> int:
        """Weights of the FFN of one dense layer (0 when the model has none)."""
        return self.expert_matrices * self.hidden_size * self.dense_intermediate_size if self.num_dense_layers else 0

    @property
    def lm_head_params(self) -> int:
        """Output projection to the vocabulary (vocab x hidden)."""
        return self.vocab_size * self.hidden_size

    # -- (de)serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("sources")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "model metadata") -> "ModelSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {', '.join(unknown)}", source=origin,
                              fix=f"{did_you_mean(unknown[0], known)}valid fields: {', '.join(sorted(known))}")
        required = ["name", "num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size"]
        for key in required:
            if key not in data:
                raise ConfigError("missing required model field", source=origin, field=key,
                                  fix=f"add '{key}'")
        if not isinstance(data.get("sources", {}), dict):
            raise ConfigError("'sources' must be a mapping", source=origin, field="sources",
                              fix="map each field (or '*') to the document its number comes from")
        spec = cls(**data)
        spec.check(origin)
        return spec

    def check(self, origin: str = "model") -> None:
        for key in ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size",
                    "quant_group_size", "expert_matrices"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"must be a positive integer, got {value!r}", source=origin, field=key,
                                  fix=f"write '{key}' as a whole number above 0 (the model's config.json)")
            if value > SHAPE_LIMITS[key]:
                raise ConfigError(f"{value:,} is beyond the limit of {SHAPE_LIMITS[key]:,}", source=origin,
                                  field=key, fix="check the model shape (config.json)")
        for key in ("name", "expert_dtype", "attention"):
            value = getattr(self, key)
            if not isinstance(value, str):
                raise ConfigError(f"must be a string, got {value!r}", source=origin, field=key,
                                  fix=f"write '{key}' as one word, e.g. {key}: {_STRING_EXAMPLES[key]}")
        for key in self._count_fields():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"must be a non-negative integer, got {value!r}", source=origin, field=key,
                                  fix=f"write '{key}' as a whole number, 0 or more (0: none)")
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ConfigError(
                f"num_shared_experts {self.num_shared_experts} and shared_intermediate_size "
                f"{self.shared_intermediate_size} disagree", source=origin, field="shared_intermediate_size",
                fix="set both (size = all shared experts together) or neither")
        if self.attention == "mla" and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0):
            # Without them the MLA KV cache would silently count as zero bytes.
            raise ConfigError("MLA needs kv_lora_rank and qk_rope_head_dim", source=origin,
                              field="kv_lora_rank", fix="copy both from the model's config.json")
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}",
                              source=origin, field="top_k",
                              fix=f"top_k counts the experts each token picks: at most {self.num_experts}")
        if self.expert_dtype not in DTYPE_BITS:
            raise ConfigError(f"unknown dtype '{self.expert_dtype}'", source=origin, field="expert_dtype",
                              fix=f"{did_you_mean(str(self.expert_dtype), DTYPE_BITS)}use one of "
                                  f"{', '.join(DTYPE_BITS)}")
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"unknown attention kind '{self.attention}'", source=origin,
                              field="attention", fix="use 'gqa' or 'mla'")

    @staticmethod
    def _count_fields() -> tuple[str, ...]:
        return ("num_shared_experts", "shared_intermediate_size", "num_dense_layers",
                "dense_intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim",
                "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "vocab_size", "total_params")

    def routing_mismatch(self, other: "ModelSpec") -> str | None:
        """Name the first routing-shape field where ``other`` differs, or None if they agree."""
        for key in ("num_layers", "num_experts", "top_k"):
            if getattr(self, key) != getattr(other, key):
                return f"{key}: {getattr(self, key)} vs {getattr(other, key)}"
        return None
