"""moesim capture on tiny randomly initialised models of every supported architecture.

The reference for each row is an independent recomputation: the model run
without cache or padding on the request's whole token sequence, with
``output_router_logits=True``, and top-k redone here from the router logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from moesim.cli import main
from moesim.trace.capture.errors import (ModelNotFoundError, NoMoELayersError, PromptsError, TorchMissingError,
                                         UnsupportedRouterError)
from moesim.trace.capture.prompts import load_prompts


# ----------------------------------------------------------------------------- no torch needed
def test_prompts_jsonl_text_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"text": "world"}\n{"token_ids": [3, 4]}\n')
    prompts = load_prompts(path)
    assert [(p.line, p.text, p.token_ids) for p in prompts] == [(1, "hello", None), (3, "world", None),
                                                                (4, None, (3, 4))]


def test_prompts_plain_text_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second one\n")
    assert [p.text for p in load_prompts(path)] == ["first prompt", "  second one"]


@pytest.mark.parametrize("content, expected", [
    ("", "prompts file is empty"),
    ("\n  \n", "prompts file is empty"),
    ('{"prompt": "a"}\n{"prompt": \n', "row 2: not valid JSON"),
    ('{"prompt": "a"}\n{"question": "b"}\n', "row 2: row has none of the fields prompt, text"),
    ('{"prompt": ""}\n', "field 'prompt', row 1: must be a non-empty string"),
    ('{"token_ids": [1, -2]}\n', "field 'token_ids', row 1"),
    ('["a"]\n', "row 1: JSONL row is not an object"),
])
def test_prompts_errors_name_file_row_and_fix(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PromptsError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(str(path)) and expected in message and "\n" not in message


def test_missing_torch_gives_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    from moesim.trace.capture.model import require_torch
    with pytest.raises(TorchMissingError):
        require_torch()
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    code = main(["capture", "--model", str(tmp_path), "--prompts", str(prompts), "--max-new-tokens", "2",
                 "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "moesim: error: install the torch extra: pip install -e '.[torch]'"


def test_trace_package_imports_without_torch() -> None:
    import subprocess
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import moesim.trace, moesim.trace.capture, moesim.cli; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


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


@pytest.fixture(scope="module")
def hf():
    """Skip cleanly without the torch extra; run tiny models on one thread (no contention on 2 cores)."""
    torch_ = pytest.importorskip("torch")
    transformers_ = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    before = torch_.get_num_threads()
    torch_.set_num_threads(1)
    transformers_.logging.set_verbosity_error()
    transformers_.logging.disable_progress_bar()
    yield
    torch_.set_num_threads(before)


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
    """(expert ids, weights), highest weight first, recomputed from router logits by each model's published rule."""
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
        weights = weights / weights.sum(-1, keepdim=True) * config.routed_scaling_factor
    elif kind == "deepseek_v2":
        scores = logits.softmax(-1)
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


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_trace_matches_model_router_token_by_token(captured, kind: str) -> None:
    report, model, out = captured[kind]
    validate_trace(out)
    table = read_frame(out)
    config = model.config
    routers = routers_of(model)
    num_layers = len(routers)
    assert report.rows == len(table) == num_layers * (sum(map(len, PROMPTS)) + len(PROMPTS) * NEW_TOKENS)
    for request, prompt in enumerate(PROMPTS):
        tokens = request_tokens(table, request)
        assert tokens[:len(prompt)] == prompt
        assert tokens == greedy_fed_tokens(model, prompt, NEW_TOKENS)
        logits, _ = full_forward(model, tokens)
        rows = table[table.request == request].sort_values(["layer", "position"])
        for layer in range(num_layers):
            got = rows[rows.layer == layer]
            ids, weights = reference_route(kind, config, routers[layer], logits[layer])
            assert np.stack(got.experts.to_numpy()).tolist() == ids.tolist(), (kind, request, layer)
            np.testing.assert_allclose(np.stack(got.weights.to_numpy()), weights.numpy(), rtol=1e-4, atol=1e-5)
            probs = logits[layer].sigmoid() if kind == "deepseek_v3" else logits[layer].softmax(-1)
            np.testing.assert_allclose(np.stack(got.scores.to_numpy()).astype(np.float32), probs.numpy(),
                                       rtol=2e-3, atol=1e-3)


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


# ----------------------------------------------------------------------------- errors
def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err.strip()


@needs_torch
def test_missing_model_path_and_offline_hub_id(tmp_path: Path, monkeypatch, capsys) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    base = ["capture", "--prompts", str(prompts), "--max-new-tokens", "1", "--out", str(tmp_path / "t.parquet")]
    code, err = run_cli(base + ["--model", str(tmp_path / "no" / "such")], capsys)
    assert code == 2 and "model path does not exist" in err and "--model /path/to/checkpoint" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = run_cli(base + ["--model", "nonexistent-org/nonexistent-moe"], capsys)
    assert code == 2 and err.count("\n") == 0
    assert "HF_HUB_OFFLINE is set, so no download was attempted" in err and "config.json and *.safetensors" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors weights"):
        capture(CaptureConfig(model=str(empty), prompts=prompts, out=tmp_path / "t.parquet", max_new_tokens=1))
    assert not (tmp_path / "t.parquet").exists()


@needs_torch
def test_dense_model_and_unknown_moe_router_are_refused(tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(NoMoELayersError, match="model_type 'qwen2' has no mixture-of-experts layers"):
        capture(CaptureConfig(model=str(tmp_path / "dense"), prompts=prompts, out=tmp_path / "t.parquet",
                              max_new_tokens=1))
    no_moe = build_checkpoint("qwen3_moe", tmp_path / "allmlp", mlp_only_layers=[0, 1, 2])
    with pytest.raises(NoMoELayersError, match="no MoE decoder layer"):
        capture(CaptureConfig(model=str(no_moe), prompts=prompts, out=tmp_path / "t.parquet", max_new_tokens=1))
    granite = transformers.AutoModelForCausalLM.from_config(transformers.GraniteMoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    granite.save_pretrained(tmp_path / "granite")
    with pytest.raises(UnsupportedRouterError, match="capture supports deepseek_v2, deepseek_v3, gpt_oss"):
        capture(CaptureConfig(model=str(tmp_path / "granite"), prompts=prompts, out=tmp_path / "t.parquet",
                              max_new_tokens=1))


@needs_torch
def test_token_id_outside_vocabulary(tmp_path: Path) -> None:
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_jsonl(tmp_path / "p.jsonl", [[1, 2], [3, VOCAB + 5]])
    with pytest.raises(PromptsError, match=r"field 'token_ids', row 2: token id 53 is outside the vocabulary"):
        capture(CaptureConfig(model=str(checkpoint), prompts=prompts, out=tmp_path / "t.parquet", max_new_tokens=1))


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
    capture(CaptureConfig(out=tmp_path / "many.parquet", **config))
    assert pq.ParquetFile(tmp_path / "many.parquet").num_row_groups > 5
    one, many = read_table(tmp_path / "one.parquet"), read_table(tmp_path / "many.parquet")
    assert many.to_pylist() == one.to_pylist()
    validate_trace(tmp_path / "many.parquet")


@pytest.mark.parametrize("device, words", [
    ("tpu", "field '--device': unknown device 'tpu' (fix: use auto, cpu, cuda or cuda:N)"),
    ("cuda:x", "unknown device 'cuda:x'"),
])
def test_a_device_that_is_no_device_is_one_line_before_the_model_loads(hf, tmp_path: Path, capsys, device,
                                                                        words) -> None:
    """`--device tpu` was an internal error from inside torch, after the model had loaded."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [1, 2]}\n')
    code = main(["capture", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts),
                 "--max-new-tokens", "1", "--device", device, "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1


@pytest.mark.skipif(torch is not None and torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it_is_one_line(hf, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [1, 2]}\n')
    for device in ("cuda", "cuda:1"):
        code = main(["capture", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts),
                     "--max-new-tokens", "1", "--device", device, "--out", str(tmp_path / "t.parquet")])
        err = capsys.readouterr().err
        assert code == 2 and "field '--device': no CUDA device is visible to torch" in err, err


def test_generation_past_the_models_context_is_one_line(hf, tmp_path: Path, capsys) -> None:
    """The tiny checkpoints hold 64 positions: a 10-token prompt with 60 new tokens would reach 70, and ran on
    silently (--max-new-tokens 100000 ran for minutes); 54 new tokens fit exactly."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_jsonl(tmp_path / "p.jsonl", [[1, 2, 3], list(range(1, 11))])
    out = tmp_path / "t.parquet"
    args = ["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--device", "cpu", "--out", str(out)]
    assert main([*args, "--max-new-tokens", "60"]) == 2
    err = capsys.readouterr().err
    assert (f"{prompts}, field '--max-new-tokens': the prompt of line 2 has 10 tokens: with --max-new-tokens 60 it "
            "reaches 70 positions, past the model's 64 (max_position_embeddings) (fix: use --max-new-tokens 54 or "
            "less, or shorter prompts)") in err and err.count("\n") == 1
    assert not out.exists()
    assert main([*args, "--max-new-tokens", "54"]) == 0
    assert int(read_frame(str(out))["position"].max()) == 63


def test_plain_progress_lines_count_the_tokens_run(hf, tmp_path: Path, capsys, monkeypatch) -> None:
    """Piped stderr gets plain lines: they said "capture: 0, ... elapsed" to the end, as the tokens went to the
    disabled rich bar only. Calibration runs the same 4 prompts (3 + 6 + 2 + 4 = 15 prompt tokens and 4 x 2 fed
    tokens), so 23 tokens are calibrating, then 23 more capturing."""
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")  # a line per pass
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "t.parquet"
    assert main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--calibration-prompts",
                 str(prompts), "--max-new-tokens", "2", "--device", "cpu", "--out", str(out)]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("capture: done, 46 tokens in ")
    counts = [(int(line.split()[1]), line.rsplit(", ", 1)[-1]) for line in lines[1:-1]]
    assert counts[-1] == (46, "capturing)") and max(n for n, phase in counts if phase == "calibrating)") == 23
    assert [n for n, _ in counts] == sorted(n for n, _ in counts)  # counted up pass by pass
    table = read_frame(out)
    assert table.drop_duplicates(["request", "position"]).shape[0] == 23


def test_out_to_a_pipe_writes_the_trace_into_it_and_keeps_the_pipe(hf, tmp_path: Path) -> None:
    """`--out /dev/stdout` renamed the finished trace over the device node (as root, /dev/stdout became a
    regular file holding the trace); a special file now receives the trace's bytes and stays what it was."""
    import fcntl
    import io
    import os
    import stat
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    pipe = tmp_path / "pipe.parquet"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # a reader is there, so the writer's open returns
    try:
        fcntl.fcntl(reader, 1031, 1 << 20)  # F_SETPIPE_SZ: room for the whole tiny trace
        assert main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "1",
                     "--device", "cpu", "--out", str(pipe)]) == 0
        assert stat.S_ISFIFO(os.stat(pipe).st_mode)
        data = os.read(reader, 1 << 20)
    finally:
        os.close(reader)
    table = pq.read_table(io.BytesIO(data))
    assert table.num_rows == 3 * (len(PROMPTS[0]) + 1)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, where no file can be created")
def test_an_out_folder_no_file_can_be_created_in_is_one_line_before_the_model_runs(hf, tmp_path: Path,
                                                                                    capsys) -> None:
    """As root, os.access said /proc was writable: the capture ran, then failed as an internal error (exit 1)."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    assert main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "1",
                 "--device", "cpu", "--out", "/proc/t.parquet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moesim: error: /proc/t.parquet, field '--out': ") and err.count("\n") == 1
    assert "cannot create a file in /proc" in err or "folder /proc is not writable" in err


def test_an_unreachable_hub_is_one_line_that_says_so(hf, tmp_path: Path, capfd, monkeypatch) -> None:
    """A hub id with no network and no HF_HUB_OFFLINE printed a line per retry of huggingface_hub and then
    'the hub did not provide it'; it is now one line that says the hub could not be reached."""
    import huggingface_hub
    from huggingface_hub.utils import logging as hub_logging
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "3600")
    import logging
    before = hub_logging.get_verbosity()
    huggingface_hub.logging.set_verbosity_warning()
    shown = logging.StreamHandler(sys.stderr)  # huggingface_hub's own handler writes where stderr was at import
    hub_logging.get_logger("huggingface_hub").addHandler(shown)

    def unreachable(*args, **kwargs):
        hub_logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.\nCheck your internet connection.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    try:
        code = main(["capture", "--model", "some-org-moe", "--prompts", str(prompts), "--max-new-tokens", "1",
                     "--device", "cpu", "--out", str(tmp_path / "t.parquet")])
    finally:
        huggingface_hub.logging.set_verbosity(before)
        hub_logging.get_logger("huggingface_hub").removeHandler(shown)
    err = capfd.readouterr().err
    assert code == 2 and err == (
        "moesim: error: some-org-moe, field '--model': model 'some-org-moe' is not a local directory or in the "
        "Hugging Face cache, and the hub could not be reached (fix: point at a local checkpoint: --model "
        "/path/to/checkpoint (a directory with config.json and *.safetensors))\n")


@pytest.mark.parametrize("damage, words", [
    ("cut", "cannot read the weights (Error while deserializing header"),
    ("config", "the weights do not fit config.json (a tensor's shape differs from what the config gives) (fix: "
               "use the config.json that came with these *.safetensors)"),
])
def test_weights_that_do_not_load_are_one_line(hf, tmp_path: Path, capsys, damage: str, words: str) -> None:
    """A safetensors file cut short, or a config.json whose shapes are not the weights', was an internal error
    (exit 1) from inside safetensors or transformers."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    if damage == "cut":
        (checkpoint / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes()[:1000])
    else:
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "intermediate_size": 24}))
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    assert main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "1",
                 "--device", "cpu", "--out", str(tmp_path / "t.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: error: {checkpoint}, field '--model': ") and words in err, err
    assert err.count("\n") == 1 and not (tmp_path / "t.parquet").exists()


def test_prompts_through_a_pipe_are_read_once_and_hashed(hf, tmp_path: Path) -> None:
    """`--prompts /dev/stdin` fed by a pipe (or `<(jq ...)`) was refused as 'prompts file not found'; it is
    read once, and the trace records the SHA-256 of the bytes read (a second reading of a pipe gets none)."""
    import hashlib
    import os
    import subprocess
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    text = "".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS[:2])
    out = tmp_path / "t.parquet"
    moesim = Path(sys.executable).with_name("moesim")
    command = [str(moesim) if moesim.exists() else sys.executable, *([] if moesim.exists() else ["-m", "moesim"]),
               "capture", "--model", str(checkpoint), "--prompts", "/dev/stdin", "--max-new-tokens", "1",
               "--device", "cpu", "--out", str(out)]
    run = subprocess.run(command, input=text, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    assert read_meta(out).source["prompts_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert request_tokens(read_frame(out), 1)[:len(PROMPTS[1])] == PROMPTS[1]


def test_a_capture_killed_midway_leaves_nothing_after_the_next_one(hf, tmp_path: Path) -> None:
    """kill -9 part-way: the next capture to the same --out removes what the killed one left (its temporary
    trace was named so that no later run recognised it, and stayed beside the trace for good)."""
    import os
    import signal
    import subprocess
    import time
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_jsonl(tmp_path / "p.jsonl", [[i % 40 + 1, 5, 9] for i in range(400)])
    folder = tmp_path / "traces"
    folder.mkdir()
    out = folder / "t.parquet"
    args = ["capture", "--model", str(checkpoint), "--device", "cpu", "--out", str(out), "--max-new-tokens"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "killed.log"  # what the capture said, should it end before writing anything
    with open(log, "w") as stderr:
        killed = subprocess.Popen([sys.executable, "-m", "moesim", *args, "40", "--prompts", str(prompts)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        # torch's and transformers' imports alone can take a minute on a loaded 2-core CI machine
        started, deadline = time.monotonic(), time.monotonic() + 600
        while not any(folder.iterdir()) and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the trace writer has opened its temporary file: the capture is under way
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    waited = time.monotonic() - started
    assert [p.name for p in folder.iterdir()] and not out.exists(), \
        (killed.returncode, f"killed after {waited:.0f} s", log.read_text()[-2000:])
    assert main([*args, "1", "--prompts", str(write_jsonl(tmp_path / "q.jsonl", PROMPTS[:1]))]) == 0
    assert [p.name for p in folder.iterdir()] == ["t.parquet"]


def test_a_text_file_whose_first_prompt_starts_with_a_brace_is_text(tmp_path: Path) -> None:
    """prompts.txt beginning '{x} is a set' was taken for JSONL and refused as 'row 1: not valid JSON'."""
    path = tmp_path / "prompts.txt"
    path.write_text("{x} is a set\nsecond\n")
    assert [p.text for p in load_prompts(path)] == ["{x} is a set", "second"]
    path.write_text('{"prompt": "a"}\n')  # JSONL in a .txt file is still JSONL
    assert [p.text for p in load_prompts(path)] == ["a"]
    broken = tmp_path / "prompts.json"
    broken.write_text('{"prompt": "a"\n')
    with pytest.raises(PromptsError, match="row 1: not valid JSON"):
        load_prompts(broken)
