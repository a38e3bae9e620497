"""The model's kernels in torch: expert FFN, attention over a KV cache, gate, RMSNorm, dense layers, LM head.

Weights hold random values: routing comes from the trace, so values do not
change what runs or how long it takes. They are drawn small and every block
starts with an RMSNorm, as the real models do, so activations stay finite
over many layers (NaNs or denormals would change CPU kernel times).

The profiler (:mod:`backends.profiler`, :mod:`backends.measurements`) times these very functions, so a
measured profile describes exactly what ``moesim validate --real`` runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: spread of the random weights (a typical initialisation scale)
WEIGHT_STD = 0.02


def torch_dtype(dtype: str, field: str = "memory.expert_dtype") -> torch.dtype:
    """The torch dtype the backend runs ``dtype`` weights in; ``field`` names the setting that chose it."""
    if dtype not in TORCH_DTYPES:
        what = "experts" if field == "memory.expert_dtype" else "attention, dense and shared weights"
        raise ConfigError(f"the real backend runs bf16 or fp16 {what}, not {dtype}", field=field,
                          fix=f"pass --set {field}=bf16 (the simulator then models bf16 too; mixtral-offloading "
                              "defaults both memory.expert_dtype and memory.non_expert_dtype to int4)")
    return TORCH_DTYPES[dtype]


def random_fill(tensor: torch.Tensor, generator: torch.Generator, pool_elems: int = 1 << 22) -> torch.Tensor:
    """Fill ``tensor`` with small random values by tiling one random pool (fast for tens of GiB)."""
    flat = tensor.view(-1)
    pool = (torch.randn(min(pool_elems, flat.numel()) + 1, generator=generator) * WEIGHT_STD).to(tensor.dtype)
    pool = pool.to(tensor.device)
    n, p = flat.numel(), pool.numel() - 1
    offset = 0
    shift = 0
    while offset < n:
        take = min(p - shift, n - offset)
        flat[offset:offset + take].copy_(pool[shift:shift + take])
        offset += take
        shift = (shift + 7) % max(p // 2, 1)  # neighbouring blocks differ
    return tensor


def expert_params(model: ModelSpec, intermediate: int) -> int:
    return model.expert_matrices * model.hidden_size * intermediate


def ffn(weights: torch.Tensor, x: torch.Tensor, hidden: int, intermediate: int, matrices: int = 3) -> torch.Tensor:
    """One expert FFN from its flat weight buffer: SwiGLU (3 matrices) or a GELU MLP (2)."""
    if matrices == 3:
        w13 = weights[:2 * intermediate * hidden].view(2 * intermediate, hidden)
        w2 = weights[2 * intermediate * hidden:3 * intermediate * hidden].view(hidden, intermediate)
        gate_up = x @ w13.t()
        h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    else:
        w1 = weights[:intermediate * hidden].view(intermediate, hidden)
        w2 = weights[intermediate * hidden:2 * intermediate * hidden].view(hidden, intermediate)
        h = F.gelu(x @ w1.t())
    return h @ w2.t()


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def attention_heads(model: ModelSpec) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim), with a fallback for presets that leave them out."""
    heads = model.num_attention_heads or max(model.hidden_size // 128, 1)
    head_dim = model.head_dim or max(model.hidden_size // heads, 1)
    return heads, model.num_kv_heads or heads, head_dim


@dataclass
class Batch:
    """How one layer's token rows form an attention batch: ``requests`` rows of ``tokens`` each at ``context``."""

    requests: int
    tokens: int
    context: int


class Attention:
    """One attention block (norm, projections, KV-cache append, SDPA, output) plus the router gate.

    GQA: fused q/k/v projection, SDPA over a (batch, kv heads, context, head dim)
    cache. MLA (DeepSeek): the absorbed form used for decoding, attention over
    the compressed latent cache (kv_lora_rank + rope dims per token, one
    "head" shared by all query heads), which is what the KV bytes of
    :meth:`ModelSpec.kv_bytes_per_token` count.
    """

    def __init__(self, model: ModelSpec, dtype: torch.dtype, device: torch.device, max_batch: int,
                 max_context: int, generator: torch.Generator, gate: bool = True) -> None:
        self.model = model
        h = model.hidden_size
        self.heads, self.kv_heads, self.head_dim = attention_heads(model)
        self.mla = model.attention == "mla"

        def weight(*shape: int) -> torch.Tensor:
            return random_fill(torch.empty(*shape, dtype=dtype, device=device), generator)

        if self.mla:
            self.rope, self.lora = model.qk_rope_head_dim, model.kv_lora_rank
            self.w_q = weight(self.heads * (self.head_dim + self.rope), h)
            self.w_kv = weight(self.lora + self.rope, h)
            self.w_uk = weight(self.heads, self.head_dim, self.lora)
            self.w_uv = weight(self.heads, self.lora, self.head_dim)
            self.cache = weight(max_batch, 1, max_context, self.lora + self.rope)
        else:
            self.w_qkv = weight((self.heads + 2 * self.kv_heads) * self.head_dim, h)
            self.k_cache = weight(max_batch, self.kv_heads, max_context, self.head_dim)
            self.v_cache = weight(max_batch, self.kv_heads, max_context, self.head_dim)
        self.w_o = weight(h, self.heads * self.head_dim)
        self.w_gate = weight(model.num_experts, h) if gate else None
        self.scale = 1.0 / math.sqrt(self.head_dim + (self.rope if self.mla else 0))

    @property
    def nbytes(self) -> int:
        """Bytes of the block's weights and KV cache."""
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Attention output plus residual for ``x`` (rows = requests x tokens); runs the gate too."""
        b, t, ctx = batch.requests, batch.tokens, batch.context
        normed = rms_norm(x)
        mask = None
        if t > 1:  # causal, aligned to the end of the context (chunked prefill)
            q_pos = torch.arange(ctx - t, ctx, device=x.device)[:, None]
            mask = torch.arange(ctx, device=x.device)[None, :] <= q_pos
        out = self._mla(normed, b, t, ctx, mask) if self.mla else self._gqa(normed, b, t, ctx, mask)
        y = x + out @ self.w_o.t()
        if self.w_gate is not None:
            torch.softmax((rms_norm(y) @ self.w_gate.t()).float(), dim=-1).topk(self.model.top_k, dim=-1)
        return y

    def _gqa(self, x: torch.Tensor, b: int, t: int, ctx: int, mask: torch.Tensor | None) -> torch.Tensor:
        qkv = (x @ self.w_qkv.t()).view(b, t, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        q = qkv[:, :self.heads]
        self.k_cache[:b, :, ctx - t:ctx] = qkv[:, self.heads:self.heads + self.kv_heads]
        self.v_cache[:b, :, ctx - t:ctx] = qkv[:, self.heads + self.kv_heads:]
        out = F.scaled_dot_product_attention(q, self.k_cache[:b, :, :ctx], self.v_cache[:b, :, :ctx],
                                             attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).reshape(b * t, self.heads * self.head_dim)

    def _mla(self, x: torch.Tensor, b: int, t: int, ctx: int, mask: torch.Tensor | None) -> torch.Tensor:
        q = (x @ self.w_q.t()).view(b, t, self.heads, self.head_dim + self.rope).transpose(1, 2)
        q_latent = torch.einsum("bhtd,hdc->bhtc", q[..., :self.head_dim], self.w_uk)
        q_full = torch.cat([q_latent, q[..., self.head_dim:]], dim=-1)
        self.cache[:b, 0, ctx - t:ctx] = (x @ self.w_kv.t()).view(b, t, self.lora + self.rope)
        keys = self.cache[:b, :, :ctx]
        out = F.scaled_dot_product_attention(q_full, keys, keys[..., :self.lora], attn_mask=mask,
                                             scale=self.scale, enable_gqa=True)
        out = torch.einsum("bhtc,hcd->bthd", out, self.w_uv)
        return out.reshape(b * t, self.heads * self.head_dim)


class DenseLayer:
    """A dense decoder layer (DeepSeek's first ones): attention without a router, then one SwiGLU FFN of
    ``dense_intermediate_size``; the simulator counts these as the step's ``attention`` and ``dense_ffn``."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype, device: torch.device, max_batch: int,
                 max_context: int, generator: torch.Generator) -> None:
        self.model = model
        self.attention = Attention(model, dtype, device, max_batch, max_context, generator, gate=False)
        self.weights = random_fill(torch.empty(expert_params(model, model.dense_intermediate_size), dtype=dtype,
                                               device=device), generator)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        return x + ffn(self.weights, rms_norm(x), m.hidden_size, m.dense_intermediate_size, m.expert_matrices)


class LMHead:
    """Final norm and output projection for the last token of each sequence, then the token choice over
    fp32 logits (softmax and argmax), as the simulator's ``lm_head`` and ``sampling`` count them."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator) -> None:
        self.weight = random_fill(torch.empty(model.vocab_size, model.hidden_size, dtype=dtype, device=device),
                                  generator)

    def logits(self, h: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
        return (rms_norm(h.index_select(0, last_rows)) @ self.weight.t()).float()

    @staticmethod
    def sample(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1).argmax(dim=-1)
