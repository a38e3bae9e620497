"""`moesim capture` as a new user meets it: what is checked before the weights load, the errors' names for the
model folder, what generate prints from Python, and the model metadata's sources in the trace."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from pathlib import Path

import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.trace import read_meta
from moesim.trace.capture import CaptureConfig, PromptsError, capture
from tests.trace.test_capture import PROMPTS, VOCAB, build_checkpoint, needs_torch, write_jsonl

try:
    import transformers
except ImportError:  # the torch extra is optional; the tests that need it skip without it
    transformers = None


def _weights_must_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import moesim.trace.capture.model as model_module

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the prompts were checked")
    monkeypatch.setattr(model_module, "load_model", refuse)


@needs_torch
def test_prompt_problems_are_refused_before_the_weights_load(tmp_path: Path, monkeypatch) -> None:
    """A token id outside the vocabulary, or a prompt past the model's context, needs only config.json to be
    found; they were found after the weights had loaded (minutes for a real checkpoint)."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    _weights_must_not_load(monkeypatch)
    out = tmp_path / "t.parquet"
    outside = write_jsonl(tmp_path / "outside.jsonl", [[1, 2], [3, VOCAB + 5]])
    with pytest.raises(PromptsError, match=r"row 2: token id 53 is outside the vocabulary"):
        capture(CaptureConfig(model=str(checkpoint), prompts=outside, out=out, max_new_tokens=1))
    long = write_jsonl(tmp_path / "long.jsonl", [list(range(1, 40))])
    with pytest.raises(ConfigError, match=r"the prompt of line 1 has 39 tokens: with --max-new-tokens 30"):
        capture(CaptureConfig(model=str(checkpoint), prompts=long, out=out, max_new_tokens=30))
    calibration = write_jsonl(tmp_path / "calibration.jsonl", [[2, VOCAB]])
    with pytest.raises(PromptsError, match=r"calibration.jsonl, field 'token_ids', row 1: token id 48"):
        capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS), out=out,
                              max_new_tokens=1, calibration_prompts=calibration))
    assert not out.exists()


@pytest.mark.parametrize("setting, words", [
    ({"max_new_tokens": -1}, "field 'max_new_tokens': must be a whole number 0 or above, got -1"),
    ({"max_new_tokens": "4"}, "field 'max_new_tokens': must be a whole number 0 or above, got '4'"),
    ({"max_new_tokens": 2, "batch": 0}, "field 'batch': must be a whole number 1 or above, got 0"),
    ({"max_new_tokens": 2, "dtype": "fp8"}, "field 'dtype': unknown dtype 'fp8' (fix: use one of auto, float32"),
])
def test_a_capture_config_the_command_line_would_refuse_is_one_line(tmp_path: Path, setting: dict,
                                                                      words: str) -> None:
    """From Python these reached the model load and then failed as ValueError (inside generate, or range()
    with step 0) or AttributeError (torch.fp8); no torch is needed to refuse them."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    with pytest.raises(ConfigError) as caught:
        capture(CaptureConfig(model=str(tmp_path / "no-model"), prompts=prompts, out=tmp_path / "t.parquet",
                              **setting))
    assert words in str(caught.value) and "\n" not in str(caught.value)


@needs_torch
def test_generate_prints_nothing_about_settings_the_caller_never_made(tmp_path: Path) -> None:
    """From Python (the command line quiets transformers), every batch printed "Both `min_new_tokens` (=0) and
    `min_length`(=0) seem to have been set", capture's own neutral settings; a checkpoint's max_length and
    min_length in generation_config.json added the same about max_length."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    generation = transformers.GenerationConfig(max_length=50, min_length=2, pad_token_id=0)
    generation.save_pretrained(checkpoint)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
    heard: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())
    handler = Collect()
    library = logging.getLogger("transformers")  # what transformers prints goes through its own root logger
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    library.addHandler(handler)
    try:
        capture(CaptureConfig(model=str(checkpoint), prompts=prompts, out=tmp_path / "t.parquet", max_new_tokens=2,
                              device="cpu"))
    finally:
        library.removeHandler(handler)
        transformers.logging.set_verbosity(before)
    assert not [line for line in heard if "seem to have been set" in line], heard
    assert logging.getLogger("transformers.generation.utils").level == logging.NOTSET  # left as it was


@needs_torch
def test_the_trace_says_where_its_model_numbers_came_from(tmp_path: Path) -> None:
    """docs/capture.md: a float32 config's experts are recorded as bf16 "and say so in the spec's sources"; the
    sources never reached the trace (the trace's model metadata keeps none), so nothing said it."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    out = tmp_path / "t.parquet"
    capture(CaptureConfig(model=str(checkpoint), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1]), out=out,
                          max_new_tokens=1, device="cpu"))
    meta = read_meta(str(out))
    assert meta.model.expert_dtype == "bf16"
    sources = meta.source["model_sources"]
    assert "bf16 assumed" in sources["expert_dtype"] and "float32" in sources["expert_dtype"]
    assert "model_type=mixtral" in sources["*"]


@needs_torch
def test_errors_about_the_model_name_its_folder_and_config(tmp_path: Path, capsys) -> None:
    """A dense model was named by its folder's lower-cased base name ('qwen2: ...'), not the config.json the
    model_type is in; a folder without config.json did not say the option (--model) to change."""
    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    dense.save_pretrained(tmp_path / "Dense-Model")
    (tmp_path / "not-a-model").mkdir()
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    base = ["capture", "--prompts", str(prompts), "--max-new-tokens", "1", "--out", str(tmp_path / "t.parquet")]
    assert main(base + ["--model", str(tmp_path / "Dense-Model")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moesim: error: {tmp_path / 'Dense-Model' / 'config.json'}, field 'model_type': "
                          "model_type 'qwen2' has no mixture-of-experts layers"), err
    assert "\n" not in err
    assert main(base + ["--model", str(tmp_path / "not-a-model")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path / 'not-a-model'}, field '--model': checkpoint directory has no config.json" in err, err
    assert not (tmp_path / "t.parquet").exists()


@needs_torch
def test_a_model_given_as_dot_is_named_by_its_folder(tmp_path: Path, monkeypatch) -> None:
    """`cd /data/models/Qwen3-30B-A3B && moesim capture --model . ...` named the trace's model '.' (inspect and
    replay tables said "model ."); the folder's own name is what --model /data/models/Qwen3-30B-A3B gives."""
    checkpoint = build_checkpoint("olmoe", tmp_path / "OLMoE-Tiny")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    monkeypatch.chdir(checkpoint)
    for given in (".", "./", "../OLMoE-Tiny/"):
        out = tmp_path / "t.parquet"
        capture(CaptureConfig(model=given, prompts=prompts, out=out, max_new_tokens=1, device="cpu"))
        meta = read_meta(str(out))
        assert meta.model.name == "olmoe-tiny" and meta.source["model"] == given


@pytest.mark.parametrize("config, words", [
    ({"model_type": "llama4", "text_config": SimpleNamespace(num_local_experts=16, num_experts_per_tok=1)},
     "model_type 'llama4' has 16 experts per layer but its router is not one capture can read"),
    ({"model_type": "qwen3_vl_moe", "text_config": SimpleNamespace(num_experts=60)},
     "model_type 'qwen3_vl_moe' has 60 experts per layer"),
    ({"model_type": "dbrx", "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}},
     "model_type 'dbrx' has 16 experts per layer"),
    ({"model_type": "hunyuan_v1_moe", "num_experts": 1}, "model_type 'hunyuan_v1_moe' has 1 expert per layer"),
])
def test_an_moe_family_capture_does_not_read_is_not_called_dense(config: dict, words: str) -> None:
    """Llama 4, Qwen3-VL-MoE, GLM-4.5V (text_config) and DBRX (ffn_config) keep their expert count off the top
    level: capture said "model_type 'llama4' has no mixture-of-experts layers (fix: capture an MoE model ...)"."""
    from moesim.trace.capture import UnsupportedRouterError
    from moesim.trace.capture.arch import arch_for
    with pytest.raises(UnsupportedRouterError) as caught:
        arch_for(SimpleNamespace(**config), "ckpt/config.json")
    message = str(caught.value)
    assert message.startswith("ckpt/config.json, field 'model_type': ") and words in message
    assert "(fix: capture supports deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe)" in message


@needs_torch
def test_an_empty_model_is_one_line_saying_so(tmp_path: Path, capsys, monkeypatch) -> None:
    """`--model "$MODEL"` with MODEL unset: the empty path was the working folder, and the error named '.' and
    its missing config.json."""
    monkeypatch.chdir(tmp_path)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    assert main(["capture", "--model", "", "--prompts", str(prompts), "--max-new-tokens", "1",
                 "--out", str(tmp_path / "t.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moesim: error: field '--model': the model is empty (an unset shell variable gives an "
                          "empty one) (fix: point at a local checkpoint"), err


@needs_torch
@pytest.mark.parametrize("text, words", [
    ('{"model_type": "mixtral",\n', "config.json: config.json is not valid JSON (Expecting property name"),
    ('{"hidden_size": 64}', "config.json, field 'model_type': config.json has no model_type (fix: use the "
                            "checkpoint's own config.json (capture supports model_type deepseek_v2"),
    ('{"model_type": "mixtral_x"}', "config.json, field 'model_type': model_type 'mixtral_x' is not one "
                                    "transformers"),
    ('{"model_type": "mixtral", "hidden_size": "x"}', "config.json, field 'hidden_size': config.json has a value "
                                                      "transformers refuses (Field 'hidden_size' expected int, got "
                                                      "str (value: 'x'))"),
])
def test_a_config_json_transformers_will_not_read_is_one_line_about_it(tmp_path: Path, capsys, text: str,
                                                                       words: str) -> None:
    """A config.json that is no JSON, lacks model_type or names one transformers does not know was 'cannot read
    config.json (...)' with the fix 'point at a local checkpoint', which it was; a value of the wrong type
    (transformers 5 checks them) was an internal error asking for a report."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    (checkpoint / "config.json").write_text(text)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    code = main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "1",
                 "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"moesim: error: {checkpoint / 'config.json'}") and words in err, err
    assert "\n" not in err and "point at a local checkpoint" not in err


@needs_torch
def test_prompts_dash_reads_standard_input(tmp_path: Path, monkeypatch) -> None:
    """`jq ... | moesim capture --prompts -` ('-' is standard output for --json) was '-: prompts file not found'."""
    import hashlib
    import io
    import json
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    text = "".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS[:2])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    out = tmp_path / "t.parquet"
    assert main(["capture", "--model", str(checkpoint), "--prompts", "-", "--max-new-tokens", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    meta = read_meta(str(out))
    assert meta.source["prompts"] == "-" and meta.source["prompts_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    from moesim.trace import read_frame
    from tests.trace.test_capture import request_tokens
    assert request_tokens(read_frame(str(out)), 1)[:len(PROMPTS[1])] == PROMPTS[1]


def test_capture_help_says_dash_is_standard_input(capsys) -> None:
    assert main(["capture", "--help"]) == 0
    assert "- reads standard input" in " ".join(capsys.readouterr().out.split())


def test_a_shape_error_names_the_config_json_key() -> None:
    """config.json says num_experts_per_tok; the error named the spec's field, 'top_k', which no config has."""
    from moesim.trace.capture import config_to_spec
    mixtral = dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=10,
                   vocab_size=100)
    with pytest.raises(ConfigError) as caught:
        config_to_spec(SimpleNamespace(**mixtral), name="ckpt/config.json")
    assert str(caught.value).startswith("ckpt/config.json, field 'num_experts_per_tok': top_k 10 exceeds")


@needs_torch
def test_a_hub_cache_snapshot_is_named_by_its_repository(tmp_path: Path) -> None:
    """--model ~/.cache/huggingface/hub/models--Org--Tiny-MoE/snapshots/<commit> named the trace's model by the
    commit hash."""
    snapshot = tmp_path / "hub" / "models--Org--Tiny-MoE" / "snapshots" / "0123abcd4567"
    build_checkpoint("mixtral", snapshot)
    out = tmp_path / "t.parquet"
    capture(CaptureConfig(model=str(snapshot), prompts=write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1]), out=out,
                          max_new_tokens=1, device="cpu"))
    assert read_meta(str(out)).model.name == "tiny-moe"


@needs_torch
def test_weights_that_need_a_missing_package_are_one_line_naming_it(tmp_path: Path, capsys, monkeypatch) -> None:
    """DeepSeek-V3's FP8 and gpt-oss's MXFP4 checkpoints need accelerate, which the torch extra does not
    install: loading them was an internal error asking for a report."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")

    def needs_accelerate(*args, **kwargs):
        raise ImportError("Loading an FP8 quantized model requires accelerate (`pip install accelerate`)")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", needs_accelerate)
    code = main(["capture", "--model", str(checkpoint), "--prompts", str(write_jsonl(tmp_path / "p.jsonl", PROMPTS)),
                 "--max-new-tokens", "1", "--device", "cpu", "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"moesim: error: {checkpoint}, field '--model': loading these weights needs a package "
                          "that is not installed (Loading an FP8 quantized model requires accelerate"), err
    assert err.endswith("(fix: pip install accelerate, or capture the checkpoint's unquantised (bf16) release)")


@needs_torch
@pytest.mark.parametrize("option", ["--prompts", "--calibration-prompts"])
def test_a_prompts_file_fault_names_the_option(tmp_path: Path, capsys, option: str) -> None:
    """A missing or empty calibration file said '<file>: prompts file not found', as the prompts' own did: which
    of the two options to fix was left to guess."""
    good = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    for bad, words in ((tmp_path / "none.txt", "prompts file not found"), (empty, "prompts file is empty")):
        files = {"--prompts": good, "--calibration-prompts": good, option: bad}
        code = main(["capture", "--model", str(tmp_path / "no-model"), "--prompts", str(files["--prompts"]),
                     "--calibration-prompts", str(files["--calibration-prompts"]), "--max-new-tokens", "1",
                     "--out", str(tmp_path / "t.parquet")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith(f"moesim: error: {bad}, field '{option}': {words}"), err


@needs_torch
def test_tokenizer_files_that_do_not_load_are_not_called_missing(tmp_path: Path, capsys) -> None:
    """A tokenizer.json cut short (or one needing a package not installed) was 'text prompt but the checkpoint
    has no tokenizer (fix: add the tokenizer files ...)', with the files right there."""
    checkpoint = build_checkpoint("mixtral", tmp_path / "ckpt")
    (checkpoint / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n")
    code = main(["capture", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "1",
                 "--out", str(tmp_path / "t.parquet")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"moesim: error: {checkpoint}, field '--model': the checkpoint's tokenizer (tokenizer.json) "
                          "did not load ("), err
