"""Capture throughput against plain greedy ``generate`` on a tiny random MoE model.

Both sides run the same model, prompts, batches and number of forward passes
(a prefill and ``--new-tokens`` decode passes per batch); capture also builds
every trace column, all three predictor columns included (calibration time
is not counted), and writes the Parquet file. Each side runs ``--repeats``
times and the best run counts. Prints tokens/s of both and the overhead;
exits non-zero if the overhead reaches ``--max-overhead`` (default 30%).

    .venv/bin/python benchmarks/capture_speed.py --arch mixtral --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def build_model(arch: str, hidden: int, layers: int, experts: int, vocab: int):
    import torch
    import transformers
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=1024, num_experts_per_tok=2, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None)
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(**common, intermediate_size=hidden * 2,
                                                     num_local_experts=experts),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, intermediate_size=hidden * 2,
                                                         moe_intermediate_size=hidden, num_experts=experts,
                                                         norm_topk_prob=True),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 8}, intermediate_size=hidden * 2, moe_intermediate_size=hidden,
            n_routed_experts=experts, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64,
            q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]()).eval()


def time_generate(model, batches, new_tokens: int) -> float:
    import torch
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=new_tokens + 1, do_sample=False, num_beams=1, pad_token_id=0,
                              use_cache=True)
    start = time.perf_counter()
    for ids, mask in batches:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mixtral", choices=["mixtral", "qwen3_moe", "deepseek_v3"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-overhead", type=float, default=0.30)
    args = parser.parse_args()

    import torch
    import transformers
    from moesim.trace.capture.model import inspect_model
    from moesim.trace.capture.run import capture_loaded
    from moesim.trace.capture.tap import BatchTracker

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.arch, args.hidden, args.layers, args.experts, args.vocab)
    moe = inspect_model(model, name=f"tiny-{args.arch}")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, args.vocab, (args.prompt_len - i % 4,), generator=gen).tolist()
               for i in range(args.requests)]
    calibration = [torch.randint(1, args.vocab, (16,), generator=gen).tolist() for _ in range(4)]
    batches = []
    for start in range(0, len(prompts), args.batch):
        group = prompts[start:start + args.batch]
        batches.append(BatchTracker(list(range(len(group))), group, set()).padded_inputs(0))
    tokens = sum(map(len, prompts)) + len(prompts) * args.new_tokens

    time_generate(model, batches[:1], 2)  # warm-up
    plain_times, capture_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.parquet"
        capture_loaded(moe, prompts[:1], out, 2, calibration=calibration[:1])  # warm-up
        for _ in range(args.repeats):  # interleaved, so load from other processes hits both sides alike
            plain_times.append(time_generate(model, batches, args.new_tokens))
            report = capture_loaded(moe, prompts, out, args.new_tokens, batch=args.batch, calibration=calibration)
            assert report.prefill_tokens + report.decode_tokens == tokens
            capture_times.append(report.seconds)
        rows = report.rows
    plain, captured = min(plain_times), min(capture_times)
    overhead = captured / plain - 1.0
    print(f"model: tiny {args.arch}, hidden {args.hidden}, {moe.spec.num_layers} MoE layers, "
          f"{args.experts} experts, top-2; {args.requests} requests x ({args.prompt_len} prompt + "
          f"{args.new_tokens} new) tokens, batch {args.batch}, torch threads {torch.get_num_threads()}")
    print(f"generate: {tokens / plain:10.1f} tokens/s ({plain:.3f} s)")
    print(f"capture:  {tokens / captured:10.1f} tokens/s ({captured:.3f} s, {rows:,} rows, "
          f"all predictor columns)")
    print(f"overhead: {overhead * 100:.1f}% (limit {args.max_overhead * 100:.0f}%)")
    return 0 if overhead < args.max_overhead else 1


if __name__ == "__main__":
    sys.exit(main())
