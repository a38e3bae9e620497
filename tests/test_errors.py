"""One-line errors: the fix starts with the choice a slip most likely meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from moesim.cli import main
from moesim.errors import did_you_mean
from moesim.policy.systems import SYSTEMS

TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "mixtral-8x7b-humaneval.parquet")
METRICS = ["tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms"]


@pytest.mark.parametrize("name, choices, expected", [
    ("tpot", METRICS, "did you mean tpot_ms_mean or tpot_ms_p50 or tpot_ms_p99? "),  # a prefix: up to three
    ("hybridmoe", SYSTEMS, "did you mean hybrimoe? "),  # a close spelling: the closest
    ("gpu-lru", SYSTEMS, "did you mean gpu-only-lru? "),
    ("Fiddler", SYSTEMS, "did you mean fiddler? "),  # letters alike, case aside
    ("cache_slots", ["cache.slots_per_layer", "cache.calibration"], "did you mean cache.slots_per_layer? "),
    ("prefetch.nn", ["prefetch.n", "prefetch.eviction"], "did you mean prefetch.n? "),
    ("int5", ["bf16", "int8", "int4"], "did you mean int8 or int4? "),  # equally close: both
    ("xyz", METRICS, ""),  # nothing alike: no guess
    ("tp", METRICS, ""),  # too short a prefix to mean anything
])
def test_did_you_mean(name, choices, expected):
    assert did_you_mean(name, choices) == expected


@pytest.mark.parametrize("args, words", [
    (["replay", TRACE, "--system", "hybridmoe"],
     "unknown system 'hybridmoe' (fix: did you mean hybrimoe? use one of: cpu-only"),
    (["replay", TRACE, "--set", "cache_slots=3"],
     "unknown parameter 'cache_slots' for system 'gpu-only-lru' (fix: did you mean cache.slots or "
     "cache.slots_per_layer? valid:"),
    (["replay", TRACE, "--set", "cache.slotz=3"], "(fix: did you mean cache.slots? valid:"),
    (["replay", TRACE, "--set", "memory.workspace=1"],
     "unknown parameter 'memory.workspace' (fix: did you mean memory.workspace_gib? valid:"),
    (["replay", TRACE, "--set", "cache=lr"],
     "unknown cache component 'lr' (fix: did you mean lru? use one of:"),
    (["systems", "fidler"], "unknown system 'fidler' (fix: did you mean fiddler?"),
    (["replay", TRACE, "--hw", "rtx490"], "(fix: did you mean rtx4090? use a path"),
    (["trace", "synth", "--model", "qwen3-30b", "--out", "{tmp}/never.parquet"], "did you mean qwen3-30b-a3b?"),
    (["trace", "synth", "--model", "qwen3-30b-a3b", "--set", "skew_frist=0.2", "--out", "{tmp}/never.parquet"],
     "did you mean skew_first?"),
    (["serve-sim", TRACE, "--scheduler", "vlm"], "did you mean vllm?"),
    (["serve-sim", TRACE, "--set", "workload.arrival=poison"],
     "did you mean poisson?"),
])
def test_a_slip_on_the_command_line_gets_its_likely_meaning(args, words, capsys, tmp_path):
    assert main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
