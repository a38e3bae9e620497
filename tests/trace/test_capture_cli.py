"""`moesim capture` as a command on tiny models: one-line errors (model path, hub, router, vocabulary, device,
context, weights, output folder), progress lines, pipes, and captures killed part way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moesim.cli import main
from moesim.trace import read_frame, read_meta
from moesim.trace.capture import CaptureConfig, capture
from moesim.trace.capture.errors import ModelNotFoundError, NoMoELayersError, PromptsError, UnsupportedRouterError
from tests.trace.test_capture import PROMPTS, VOCAB, build_checkpoint, needs_torch, request_tokens, write_jsonl

try:
    import torch
    import transformers
except ImportError:  # the torch extra is optional; the tests below skip without it
    torch = transformers = None


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
