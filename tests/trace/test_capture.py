"""moesim capture on tiny randomly initialised models of every supported architecture.

The reference for each row is an independent recomputation: the model run
without cache or padding on the request's whole token sequence, with
``output_router_logits=True``, and top-k redone here from the router logits.

The prompts file and what needs no torch: test_capture_prompts.py; the
command's one-line errors, pipes and killed captures: test_capture_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moesim.cli import main


# ----------------------------------------------------------------------------- tiny models
try:
    import torch
    import transformers
except ImportError:  # the torch extra is optional; the tests below skip without it
    torch = transformers = None

import pyarrow.parquet as pq  # noqa: E402

from moesim.model.presets import load_preset  # noqa: E402
from moesim.trace import iter_steps, read_frame, read_meta, read_table, validate_trace  # noqa: E402
from moesim.trace.capture import CaptureConfig, capture, config_to_spec  # noqa: E402


needs_torch = pytest.mark.usefixtures("hf")

VOCAB = 48
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=0, bos_token_id=None,
              eos_token_id=None, tie_word_embeddings=False)
MLA = dict(COMMON, num_key_value_heads=4, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=8, n_group=4, topk_group=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=8),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=32, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=16, num_experts=8,
                                                     norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=32, moe_intermediate_size=16,
                                                     num_experts=8, norm_topk_prob=True, head_dim=8),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=16, num_experts=6),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(**MLA, q_lora_rank=None, routed_scaling_factor=1.5,
                                                         topk_method="group_limited_greedy"),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**MLA, q_lora_rank=16, routed_scaling_factor=2.5,
                                                         norm_topk_prob=True),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=8, head_dim=8,
                                                 sliding_window=4),
}
PROMPTS = [[5, 9, 11], [7, 3, 22, 40, 2, 8], [13, 14], [30, 31, 32, 33]]
CALIBRATION = [[6, 6, 17, 40], [21, 3, 9], [44, 12, 10, 2, 19], [8, 27]]
NEW_TOKENS = 4


def routers_of(model) -> list:
    return [getattr(layer.mlp, "router", None) or layer.mlp.gate
            for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def build_checkpoint(kind: str, directory: Path, **overrides) -> Path:
    torch.manual_seed(1)
    config = CONFIGS[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for router in routers_of(model):
            # Spread-out router logits: clear top-k margins, so padding-level float noise cannot flip a choice.
            router.weight.normal_(0.0, 1.0)
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.normal_(0.0, 0.3)
            if isinstance(getattr(router, "bias", None), torch.Tensor):
                router.bias.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    return path


def reference_route(kind: str, config, router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, weights), highest weight first, recomputed from router logits by each model's published rule:
    the ``forward`` of MixtralTopKRouter, Qwen2MoeTopKRouter, Qwen3MoeTopKRouter, OlmoeTopKRouter,
    DeepseekV2TopkRouter, DeepseekV3TopkRouter and GptOssTopKRouter in transformers 5's modeling_<type>.py."""
    logits = logits.double()
    k = config.num_experts_per_tok
    experts = logits.shape[-1]
    if kind == "gpt_oss":
        top, ids = logits.topk(k, dim=-1)
        weights = top.softmax(-1)
    elif kind == "deepseek_v3":
        scores = logits.sigmoid()
        choice = scores + router.e_score_correction_bias.double()
        grouped = choice.view(-1, config.n_group, experts // config.n_group)
        keep = grouped.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
        mask = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(experts // config.n_group, dim=1), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * config.routed_scaling_factor
    elif kind == "deepseek_v2":
        scores = logits.softmax(-1)
        if config.topk_method == "group_limited_greedy":
            grouped = scores.view(-1, config.n_group, experts // config.n_group)
            keep = grouped.max(-1).values.topk(config.topk_group, dim=-1).indices
            mask = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, keep, True)
            scores = scores.masked_fill(~mask.repeat_interleave(experts // config.n_group, dim=1), 0.0)
        weights, ids = scores.topk(k, dim=-1)
        weights = weights * config.routed_scaling_factor
    else:
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        if kind == "mixtral" or config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    order = weights.argsort(dim=-1, descending=True)
    return ids.gather(1, order), weights.gather(1, order)


def linear_route(kind: str, config, router, weight: torch.Tensor, bias, hidden: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    return reference_route(kind, config, router, logits)[0]


def full_forward(model, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Router logits (from output_router_logits) and gate inputs (hooked) of each MoE layer, no cache."""
    inputs: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, o: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
               for r in routers_of(model)]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), output_router_logits=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [logits.reshape(len(tokens), -1) for logits in out.router_logits], inputs


def request_tokens(table, request: int) -> list[int]:
    rows = table[(table.request == request) & (table.layer == 0)].sort_values("position")
    assert rows.position.tolist() == list(range(len(rows)))
    return rows.token_id.tolist()


def greedy_fed_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The tokens a capture feeds for one prompt: the prompt and the first ``new_tokens`` generated."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0].tolist()


@pytest.fixture(scope="module")
def captured(hf, tmp_path_factory) -> dict:
    """One capture per architecture, with calibration and batch 2 (left padding)."""
    results = {}
    base = tmp_path_factory.mktemp("capture")
    prompts = write_jsonl(base / "prompts.jsonl", PROMPTS)
    calibration = write_jsonl(base / "calibration.jsonl", CALIBRATION)
    for kind in CONFIGS:
        checkpoint = build_checkpoint(kind, base / kind)
        out = base / f"{kind}.parquet"
        report = capture(CaptureConfig(model=str(checkpoint), prompts=prompts, out=out, max_new_tokens=NEW_TOKENS,
                                       batch=2, calibration_prompts=calibration, dtype="float32", device="cpu"))
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        results[kind] = (report, model, out)
    return results


def assert_routing_matches(kind: str, model, table, prompts: list[list[int]], new_tokens: int) -> None:
    """Every request's tokens are greedy generation's, and every row's experts, weights and scores are the
    reference recomputation's on the request's unpadded, uncached forward pass."""
    config = model.config
    routers = routers_of(model)
    for request, prompt in enumerate(prompts):
        tokens = request_tokens(table, request)
        assert tokens[:len(prompt)] == prompt
        assert tokens == greedy_fed_tokens(model, prompt, new_tokens)
        logits, _ = full_forward(model, tokens)
        rows = table[table.request == request].sort_values(["layer", "position"])
        for layer in range(len(routers)):
            got = rows[rows.layer == layer]
            ids, weights = reference_route(kind, config, routers[layer], logits[layer])
            assert np.stack(got.experts.to_numpy()).tolist() == ids.tolist(), (kind, request, layer)
            np.testing.assert_allclose(np.stack(got.weights.to_numpy()), weights.numpy(), rtol=1e-4, atol=1e-5)
            probs = logits[layer].sigmoid() if kind == "deepseek_v3" else logits[layer].softmax(-1)
            np.testing.assert_allclose(np.stack(got.scores.to_numpy()).astype(np.float32), probs.numpy(),
                                       rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_trace_matches_model_router_token_by_token(captured, kind: str) -> None:
    report, model, out = captured[kind]
    validate_trace(out)
    table = read_frame(out)
    num_layers = len(routers_of(model))
    assert report.rows == len(table) == num_layers * (sum(map(len, PROMPTS)) + len(PROMPTS) * NEW_TOKENS)
    assert_routing_matches(kind, model, table, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_predictor_columns_are_what_the_gates_compute(captured, kind: str) -> None:
    report, model, out = captured[kind]
    table = read_frame(out)
    config = model.config
    routers = routers_of(model)
    num_layers = len(routers)
    state = report.state
    pred_weights, pred_biases = state.next_token_weights(), state.next_token_biases()
    for request in range(len(PROMPTS)):
        _, inputs = full_forward(model, request_tokens(table, request))
        rows = table[table.request == request].sort_values(["layer", "position"])
        for layer in range(num_layers):
            got = rows[rows.layer == layer]
            x = inputs[layer]
            if layer + 1 < num_layers:
                nxt = routers[layer + 1]
                bias = getattr(nxt, "bias", None) if kind == "gpt_oss" else None
                expected = linear_route(kind, config, nxt, nxt.weight, bias, x)
                assert [list(v) for v in got.pred_next_layer] == expected.tolist()
                corrected = x.double() + torch.as_tensor(state.residual[layer]).double()
                expected = linear_route(kind, config, nxt, nxt.weight, bias, corrected)
                assert [list(v) for v in got.pred_residual] == expected.tolist()
            else:
                assert all(len(v) == 0 for v in got.pred_next_layer)
                assert all(len(v) == 0 for v in got.pred_residual)
            bias = None if pred_biases[layer] is None else torch.as_tensor(pred_biases[layer])
            expected = linear_route(kind, config, routers[layer], torch.as_tensor(pred_weights[layer]), bias, x)
            assert [list(v) for v in got.pred_next_token] == expected.tolist()


def calibration_pairs(model, new_tokens: int):
    """Gate inputs of every calibration token, and (this token's input, next decode token's logits) pairs."""
    all_inputs, pair_x, pair_y = [], [], []
    for prompt in CALIBRATION:
        tokens = greedy_fed_tokens(model, prompt, new_tokens)
        logits, inputs = full_forward(model, tokens)
        all_inputs.append(torch.stack(inputs))  # (layers, tokens, hidden)
        sources = list(range(len(prompt) - 1, len(tokens) - 1))  # next token is a decode token
        pair_x.append(torch.stack(inputs)[:, sources])
        pair_y.append(torch.stack(logits)[:, [s + 1 for s in sources]])
    return torch.cat(all_inputs, 1), torch.cat(pair_x, 1), torch.cat(pair_y, 1)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_calibration_residual_and_next_token_fit(captured, kind: str) -> None:
    from moesim.trace.capture.predict import RIDGE
    report, model, _ = captured[kind]
    inputs, pair_x, pair_y = calibration_pairs(model, NEW_TOKENS)
    state = report.state
    assert state.calibration_tokens == inputs.shape[1] == sum(map(len, CALIBRATION)) + len(CALIBRATION) * NEW_TOKENS
    residual = (inputs[1:].double() - inputs[:-1].double()).mean(1)  # DALI Eq. 11
    np.testing.assert_allclose(state.residual.numpy(), residual.numpy(), rtol=1e-4, atol=1e-5)
    assert state.next_token_pairs == pair_x.shape[1] == len(CALIBRATION) * NEW_TOKENS
    intercept = kind == "gpt_oss"
    for layer, (weight, bias) in enumerate(zip(state.next_token_weights(), state.next_token_biases())):
        x, y = pair_x[layer].double().numpy(), pair_y[layer].double().numpy()
        if intercept:
            x_mean, y_mean = x.mean(0), y.mean(0)
            x, y = x - x_mean, y - y_mean
        lam = RIDGE * float((x * x).mean()) * len(x) + 1e-12
        coef = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y)
        np.testing.assert_allclose(weight, coef.T, rtol=1e-3, atol=1e-4)
        if intercept:
            np.testing.assert_allclose(bias, y_mean - x_mean @ coef, rtol=1e-3, atol=1e-4)
        else:
            assert bias is None


def test_step_structure_and_metadata(captured) -> None:
    report, model, out = captured["qwen2_moe"]
    steps = list(iter_steps(out))
    # batch 2: prefill, NEW_TOKENS decode steps; then the same for the second pair of prompts
    assert len(steps) == report.steps == 2 * (1 + NEW_TOKENS)
    assert [s.is_prefill for s in steps] == ([True] + [False] * NEW_TOKENS) * 2
    assert [s.tokens for s in steps] == [9] + [2] * NEW_TOKENS + [6] + [2] * NEW_TOKENS
    assert sorted(set(steps[0].request)) == [0, 1] and sorted(set(steps[5].request)) == [2, 3]
    # left padding produced no rows: prompt 0 (3 tokens, padded to 6) has positions 0..2 only
    first = steps[0]
    assert first.position[(first.request == 0) & (first.layer == 0)].tolist() == [0, 1, 2]
    assert steps[1].position[steps[1].layer == 0].tolist() == [3, 6]
    meta = read_meta(out)
    assert meta.model.num_layers == 2 and meta.model.num_dense_layers == 1  # mlp_only_layers=[1]
    assert meta.model.num_experts == 8 and meta.model.top_k == 2 and meta.model.num_shared_experts == 1
    assert meta.weights_renormalized is False  # norm_topk_prob=False
    assert meta.source["scores"] == "softmax" and meta.source["kind"] == "captured"
    assert meta.source["moe_decoder_layers"] == [0, 2]
    assert meta.source["predictors"]["pred_residual"].startswith("written")
    v3 = read_meta(captured["deepseek_v3"][2])
    assert v3.source["scores"] == "sigmoid" and v3.weights_renormalized is True
    assert v3.source["routed_scaling_factor"] == 2.5 and v3.model.attention == "mla"
    assert v3.model.num_dense_layers == 1 and v3.model.num_layers == 2


@needs_torch
def test_without_calibration_predictors_are_omitted_and_reported(tmp_path: Path) -> None:
    checkpoint = build_checkpoint("olmoe", tmp_path / "ckpt")
    out = tmp_path / "t.parquet"
    report = capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1]),
                                   out=out, max_new_tokens=2))
    names = pq.read_schema(out).names
    assert "pred_next_layer" in names and "pred_residual" not in names and "pred_next_token" not in names
    assert report.predictors["pred_residual"] == "omitted: no --calibration-prompts"
    assert any("pred_next_token: omitted: no --calibration-prompts" in line for line in report.summary_lines())
    assert validate_trace(out).rows == 3 * (3 + 2)


@needs_torch
def test_end_of_sequence_ends_a_request(tmp_path: Path) -> None:
    checkpoint = build_checkpoint("mixtral", tmp_path / "probe")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    first = greedy_fed_tokens(model, PROMPTS[1], 1)[-1]  # request 1's first generated token
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt", eos_token_id=first)
    out = tmp_path / "t.parquet"
    capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2]), out=out,
                          max_new_tokens=3, batch=2))
    table = read_frame(out)
    table = table[table.layer == 0]
    assert table[table.request == 1].phase.astype(str).tolist() == ["prefill"] * len(PROMPTS[1])
    decode0 = table[(table.request == 0) & (table.phase == "decode")].token_id.tolist()
    assert first not in decode0 and len(decode0) == (decode0 + [first]).index(first)
    validate_trace(out)


@needs_torch
def test_text_prompts_use_the_checkpoint_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["[PAD]", "[UNK]"] + "the cat sat on a mat while dog ran far away".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    checkpoint = build_checkpoint("qwen3_moe", tmp_path / "ckpt")
    tokenizer.save_pretrained(checkpoint)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat sat on a mat\na dog ran far\n")
    out = tmp_path / "t.parquet"
    assert main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "2",
                 "--batch", "2", "--out", str(out)]) == 0
    table = read_frame(out)
    assert request_tokens(table, 0)[:6] == [2, 3, 4, 5, 6, 7]
    assert request_tokens(table, 1)[:4] == [6, 9, 10, 11]
    assert read_meta(out).source["prompts_sha256"]


@needs_torch
def test_interrupt_leaves_nothing_and_keeps_old_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moesim.trace.capture import predict
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    out = tmp_path / "traces" / "t.parquet"
    out.parent.mkdir()
    out.write_bytes(b"previous trace")
    calls = {"n": 0}
    real_build = predict.TraceRows.build

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_build(self, *args, **kwargs)

    monkeypatch.setattr(predict.TraceRows, "build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS),
                              out=out, max_new_tokens=3))
    assert sorted(p.name for p in out.parent.iterdir()) == ["t.parquet"]
    assert out.read_bytes() == b"previous trace"


# ----------------------------------------------------------------------------- config_to_spec on real shapes
@needs_torch
def test_config_to_spec_matches_presets_for_published_configs() -> None:
    # transformers' default MixtralConfig and DeepseekV3Config are Mixtral-8x7B's and DeepSeek-V3's config.json.
    for config, preset in [(transformers.MixtralConfig(), "mixtral-8x7b"),
                           (transformers.DeepseekV3Config(), "deepseek-v3")]:
        spec, ref = config_to_spec(config), load_preset(preset)
        for key in ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size",
                    "num_shared_experts", "shared_intermediate_size", "num_dense_layers", "attention",
                    "kv_lora_rank", "qk_rope_head_dim", "num_attention_heads", "num_kv_heads", "head_dim",
                    "vocab_size"):
            assert getattr(spec, key) == getattr(ref, key), (preset, key)
    qwen15 = transformers.Qwen2MoeConfig()  # defaults: Qwen1.5-MoE-A2.7B
    spec, ref = config_to_spec(qwen15), load_preset("qwen1.5-moe-a2.7b")
    assert (spec.num_shared_experts, spec.shared_intermediate_size) == (4, 5632) == \
        (ref.num_shared_experts, ref.shared_intermediate_size)


@needs_torch
def test_single_moe_layer_has_empty_next_layer_predictions(tmp_path: Path) -> None:
    checkpoint = build_checkpoint("deepseek_v3", tmp_path / "ckpt", num_hidden_layers=2)  # layer 0 dense
    out = tmp_path / "t.parquet"
    report = capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2]),
                                   out=out, max_new_tokens=2, calibration_prompts=write_jsonl(
                                       tmp_path / "c.jsonl", CALIBRATION[:2])))
    table = read_frame(out)
    assert set(table.layer) == {0} and len(table) == 3 + 6 + 2 * 2
    assert all(len(v) == 0 for v in table.pred_next_layer) and all(len(v) == 0 for v in table.pred_residual)
    assert all(len(v) == 2 for v in table.pred_next_token)
    assert report.predictors["pred_next_layer"] == "written, empty (the model has one MoE layer)"
    validate_trace(out)


@needs_torch
def test_greedy_ignores_sampling_settings_of_generation_config(tmp_path: Path) -> None:
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    transformers.GenerationConfig(do_sample=True, temperature=0.7, top_k=5, repetition_penalty=5.0,
                                  no_repeat_ngram_size=1, min_new_tokens=8).save_pretrained(checkpoint)
    prompt = [1, 2, 3, 1, 2, 3]
    out = tmp_path / "t.parquet"
    capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", [prompt]), out=out,
                          max_new_tokens=6))
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # argmax of the logits, nothing else
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    assert request_tokens(read_frame(out), 0) == tokens


@needs_torch
def test_trace_written_in_many_batches_equals_one_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moesim.trace.capture import run
    checkpoint = build_checkpoint("olmoe", tmp_path / "ckpt")
    config = dict(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS), max_new_tokens=3,
                  batch=3, calibration_prompts=write_jsonl(tmp_path / "c.jsonl", CALIBRATION))
    capture(CaptureConfig(out=tmp_path / "one.parquet", **config))
    monkeypatch.setattr(run, "FLUSH_ROWS", 7)
    # counted at the writer: it gathers batches into whole row groups, so the file's groups no longer show them
    from moesim.trace.writer import TraceWriter
    batches: list[int] = []
    write = TraceWriter.write
    monkeypatch.setattr(TraceWriter, "write", lambda self, data: (batches.append(len(data["step"])),
                                                                  write(self, data))[1])
    capture(CaptureConfig(out=tmp_path / "many.parquet", **config))
    assert len(batches) > 5
    one, many = read_table(tmp_path / "one.parquet"), read_table(tmp_path / "many.parquet")
    assert many.to_pylist() == one.to_pylist()
    validate_trace(tmp_path / "many.parquet")
