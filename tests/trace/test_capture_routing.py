"""Capture records the routing the model ran, observed where the model uses it.

test_capture.py checks the trace against the router recomputed on an unpadded,
uncached forward pass. Here the observation point is the experts module's own
input (the expert ids and the weights it multiplies expert outputs by) during
a plain ``generate`` of the same left-padded bf16 batch, with no capture hooks:
so the trace must hold exactly what the model computed with, prefill and
decode, padding rows left out, each request at its own positions, and
capturing must not change the generated tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moesim.trace import read_frame, read_meta, validate_trace
from moesim.trace.capture import CaptureConfig, capture
from tests.trace.test_capture import (CONFIGS, PROMPTS, assert_routing_matches, build_checkpoint, needs_torch,
                                      request_tokens, torch, transformers, write_jsonl)

NEW_TOKENS = 3


def moe_blocks(model) -> list:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def left_padded(prompts: list[list[int]]) -> tuple:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def experts_inputs_during_generate(model, prompts: list[list[int]], passes: int) -> tuple[list, list[int]]:
    """Per forward pass and MoE layer, the (ids, weights) the experts module was called with; and the tokens."""
    calls: list = []
    handles = [b.experts.register_forward_pre_hook(lambda m, args: calls.append(args[1:3]))
               for b in moe_blocks(model)]
    ids, mask = left_padded(prompts)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=passes, do_sample=False,
                                 pad_token_id=0)
    finally:
        for handle in handles:
            handle.remove()
    layers = len(handles)
    assert len(calls) == passes * layers
    return [calls[p * layers:(p + 1) * layers] for p in range(passes)], out[:, ids.shape[1]:].tolist()


def real_rows(prompts: list[list[int]], step: int) -> list[tuple[int, int, int]]:
    """(flat row, request, position) of the real tokens of a left-padded batch's forward pass ``step``."""
    width = max(map(len, prompts))
    if step == 0:
        return [(r * width + width - len(p) + pos, r, pos) for r, p in enumerate(prompts) for pos in range(len(p))]
    return [(r, r, len(p) + step - 1) for r, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def bf16_batch(hf, tmp_path_factory) -> dict:
    """Every architecture captured in bfloat16, all prompts in one left-padded batch."""
    base = tmp_path_factory.mktemp("routing")
    prompts = write_jsonl(base / "prompts.jsonl", PROMPTS)
    results = {}
    for kind in CONFIGS:
        checkpoint = build_checkpoint(kind, base / kind)
        out = base / f"{kind}.parquet"
        capture(CaptureConfig(model=str(checkpoint), prompts=prompts, out=out, max_new_tokens=NEW_TOKENS,
                              batch=len(PROMPTS), dtype="bfloat16", device="cpu"))
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
        results[kind] = (model, out)
    return results


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_trace_is_what_the_experts_computed_with(bf16_batch, kind: str) -> None:
    model, out = bf16_batch[kind]
    validate_trace(out)
    table = read_frame(out)
    # capture runs one pass per fed token: the prefill and NEW_TOKENS decode passes
    calls, generated = experts_inputs_during_generate(model, PROMPTS, NEW_TOKENS + 1)
    for request, prompt in enumerate(PROMPTS):  # capturing changed no generated token
        assert request_tokens(table, request) == prompt + generated[request][:NEW_TOKENS]
    rows = table.set_index(["step", "layer", "request", "position"]).sort_index()
    expected_rows = 0
    for step, layers in enumerate(calls):
        for layer, (ids, weights) in enumerate(layers):
            for flat, request, position in real_rows(PROMPTS, step):
                row = rows.loc[(step, layer, request, position)]
                assert row.phase == ("prefill" if step == 0 else "decode")
                used = dict(zip(ids[flat].tolist(), weights[flat].float().tolist()))
                assert dict(zip(row.experts.tolist(), row.weights.tolist())) == used, (step, layer, request)
                assert list(row.weights) == sorted(row.weights, reverse=True)  # highest weight first
                expected_rows += 1
    assert len(table) == expected_rows  # padding rows were left out


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_source_dtype_is_the_dtype_the_model_ran_in(bf16_batch, kind: str) -> None:
    # DeepSeek keeps its router weight in float32 inside a bfloat16 model; the run was bfloat16 all the same
    assert read_meta(bf16_batch[kind][1]).source["dtype"] == "bfloat16"


def shared_output(block, x):
    """What a MoE block adds beyond its routed experts: Qwen2-MoE's gated shared expert, DeepSeek's shared
    experts (Qwen2MoeSparseMoeBlock.forward, DeepseekV3MoE.forward in transformers' modeling files)."""
    if hasattr(block, "shared_expert_gate"):
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    if hasattr(block, "shared_experts"):
        return block.shared_experts(x)
    return torch.zeros_like(x)


@needs_torch
@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_trace_weights_times_expert_outputs_give_the_moe_output(tmp_path: Path, kind: str) -> None:
    """Routed scaling, renormalisation and shared experts: sum_k weight_k * expert_k(x) + shared(x) is the MoE
    block's output for every token of the trace (float32, one unpadded request)."""
    checkpoint = build_checkpoint(kind, tmp_path / "ckpt")
    out = tmp_path / "t.parquet"
    capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[1:2]), out=out,
                          max_new_tokens=NEW_TOKENS, dtype="float32", device="cpu"))
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    table = read_frame(out)
    seen: list = []
    handles = [b.register_forward_hook(lambda m, a, o: seen.append((a[0][0], (o[0] if isinstance(o, tuple) else o)[0])))
               for b in moe_blocks(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([request_tokens(table, 0)]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    for layer, (block, (x, y)) in enumerate(zip(moe_blocks(model), seen)):
        rows = table[table.layer == layer].sort_values("position")
        ids = torch.as_tensor(np.stack(rows.experts.to_numpy()).astype(np.int64))
        weights = torch.as_tensor(np.stack(rows.weights.to_numpy()))
        with torch.no_grad():
            rebuilt = block.experts(x, ids, weights) + shared_output(block, x)
        np.testing.assert_allclose(rebuilt.numpy(), y.numpy(), rtol=1e-4, atol=1e-4 * float(y.abs().max()))


@needs_torch
@pytest.mark.parametrize(("kind", "overrides"), [
    ("deepseek_v3", {"norm_topk_prob": False, "routed_scaling_factor": 1.5}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3, "first_k_dense_replace": 0}),
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                   "num_hidden_layers": 4}),
])
def test_routing_variants_match_the_published_rule(tmp_path: Path, kind: str, overrides: dict) -> None:
    checkpoint = build_checkpoint(kind, tmp_path / "ckpt", **overrides)
    out = tmp_path / "t.parquet"
    capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2]), out=out,
                          max_new_tokens=NEW_TOKENS, batch=2, dtype="float32", device="cpu"))
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert_routing_matches(kind, model, read_frame(out), PROMPTS[:2], NEW_TOKENS)
    meta = read_meta(out)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert meta.source["moe_decoder_layers"] == moe
    assert (meta.model.num_layers, meta.model.num_dense_layers) == (len(moe), model.config.num_hidden_layers - len(moe))
    assert meta.model.top_k == model.config.num_experts_per_tok
    # transformers' DeepseekV2TopkRouter.forward never renormalises; the others follow norm_topk_prob
    assert meta.weights_renormalized == (kind != "deepseek_v2" and model.config.norm_topk_prob)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_model_metadata_matches_the_loaded_modules(bf16_batch, kind: str) -> None:
    """The spec's shapes, read from the config, are those of the modules that ran."""
    model, out = bf16_batch[kind]
    spec = read_meta(out).model
    blocks = moe_blocks(model)
    router = getattr(blocks[0], "router", None) or blocks[0].gate
    assert (spec.num_experts, spec.hidden_size) == tuple(router.weight.shape) and spec.top_k == router.top_k
    assert spec.num_layers == len(blocks) and spec.num_dense_layers == len(model.model.layers) - len(blocks)
    down = blocks[0].experts.down_proj  # (experts, hidden, inter) or, in gpt-oss, (experts, inter, hidden)
    assert spec.moe_intermediate_size == down.numel() // (spec.num_experts * spec.hidden_size)
    shared = getattr(blocks[0], "shared_expert", None) or getattr(blocks[0], "shared_experts", None)
    assert spec.shared_intermediate_size == (shared.down_proj.in_features if shared is not None else 0)
    dense = [layer.mlp for layer in model.model.layers if not hasattr(layer.mlp, "experts")]
    assert spec.dense_intermediate_size == (dense[0].down_proj.in_features if dense else 0)
    assert spec.total_params == sum(p.numel() for p in model.parameters())


@needs_torch
def test_equal_weights_keep_the_routers_slot_order() -> None:
    from moesim.trace.capture.predict import rank_by_weight
    # bf16 weights of distinct probabilities can round equal; the router's order (by the unrounded value) stays
    weights = torch.tensor([[0.25, 0.5, 0.25, 0.125]], dtype=torch.bfloat16)
    ordered, ids = rank_by_weight(weights, torch.tensor([[7, 2, 5, 1]]))
    assert ids.tolist() == [[2, 7, 5, 1]] and ordered.tolist() == [[0.5, 0.25, 0.25, 0.125]]
