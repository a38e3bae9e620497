"""One-line errors: the fix starts with the choice a slip most likely meant."""

from __future__ import annotations

import pytest

from moesim.cli import main
from moesim.errors import did_you_mean
from moesim.policy.systems import SYSTEMS

METRICS = ["tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms"]


@pytest.mark.parametrize("name, choices, expected", [
    ("tpot", METRICS, "did you mean tpot_ms_mean or tpot_ms_p50 or tpot_ms_p99? "),  # a prefix: up to three
    ("hybridmoe", SYSTEMS, "did you mean hybrimoe? "),  # a close spelling: the closest
    ("gpu-lru", SYSTEMS, "did you mean gpu-only-lru? "),
    ("Fiddler", SYSTEMS, "did you mean fiddler? "),  # letters alike, case aside
    ("cache_slots", ["cache.slots_per_layer", "cache.calibration"], "did you mean cache.slots_per_layer? "),
    ("prefetch.nn", ["prefetch.n", "prefetch.eviction"], "did you mean prefetch.n? "),
    ("xyz", METRICS, ""),  # nothing alike: no guess
    ("tp", METRICS, ""),  # too short a prefix to mean anything
])
def test_did_you_mean(name, choices, expected):
    assert did_you_mean(name, choices) == expected


@pytest.mark.parametrize("args, words", [
    (["replay", "traces/mixtral-8x7b-humaneval.parquet", "--system", "hybridmoe"],
     "unknown system 'hybridmoe' (fix: did you mean hybrimoe? use one of: cpu-only"),
    (["replay", "traces/mixtral-8x7b-humaneval.parquet", "--set", "cache_slots=3"],
     "unknown parameter 'cache_slots' for system 'gpu-only-lru' (fix: did you mean cache.slots_per_layer? valid:"),
    (["replay", "traces/mixtral-8x7b-humaneval.parquet", "--set", "memory.workspace=1"],
     "unknown parameter 'memory.workspace' (fix: did you mean memory.workspace_gib? valid:"),
    (["replay", "traces/mixtral-8x7b-humaneval.parquet", "--set", "cache=lr"],
     "unknown cache component 'lr' (fix: did you mean lru? use one of:"),
    (["systems", "fidler"], "unknown system 'fidler' (fix: did you mean fiddler?"),
])
def test_a_slip_on_the_command_line_gets_its_likely_meaning(args, words, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
