"""benchmarks/replay_invariants.py: its checks pass on a real replay and name a corrupted row's fault."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import replay_invariants as ri  # noqa: E402

from tests.factories import write_trace_and_profile  # noqa: E402

SYSTEMS = "cpu-only,gpu-only-lru,static-hot,all-in-gpu,oracle"
SETTINGS = ["cache.slots_per_layer=2"]


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> tuple[ri.Context, dict[str, dict], bytes]:
    """Two requests decoded together (4 + 6 tokens each) on a 2-layer, 6-expert model: the context, the rows
    and the JSON of one replay of a few fast systems."""
    trace, hw = write_trace_and_profile(tmp_path_factory.mktemp("inv"), seed=5, requests=2, prompt=4, decode=6)
    raw = ri.replay_json(trace, hw, SYSTEMS, SETTINGS)
    rows = ri.by_system(json.loads(raw))
    ctx = ri.make_context(trace, hw, {"cache.slots_per_layer": "2"}, rows)
    return ctx, rows, raw


def failures(checks: list[ri.Check]) -> list[ri.Check]:
    return [c for c in checks if not c.ok]


def test_trace_facts_count_as_the_engine(replay):
    ctx, _, _ = replay
    facts = ctx.facts
    assert (facts.prefill_tokens, facts.decode_tokens, facts.prefill_requests) == (8, 12, 2)
    assert (facts.decode_batch_min, facts.decode_batch_max, facts.tokens_per_request) == (2, 2, 1.0)


def test_every_check_passes_on_a_real_replay(replay):
    ctx, rows, _ = replay
    checks = ri.check_replay(ctx, rows)
    assert set(rows) == set(SYSTEMS.split(","))
    assert len(checks) > 50 * len(rows)  # every row went through every family of checks
    assert not failures(checks), [f"{c.system} {c.metric}={c.value}: {c.invariant} ({c.detail})"
                                  for c in failures(checks)]
    assert {c.invariant for c in checks} >= {"oracle <= every member", "floor monotone in slots",
                                             "bytes = copies x expert bytes", "TPOT x throughput"}


def test_the_same_replay_twice_is_deterministic(replay):
    ctx, _, raw = replay
    again = ri.replay_json(ctx.trace, ctx.hw, SYSTEMS, SETTINGS)
    assert not failures(ri.check_determinism(ctx, raw, again))


@pytest.mark.parametrize("system, metric, value, invariant", [
    ("cpu-only", "cpu_util", 1.2, "in [0, 1]"),
    ("gpu-only-lru", "pcie_h2d_bytes", 7, "bytes = copies x expert bytes"),
    ("static-hot", "decode_tokens", 11, "tokens as in the trace"),
    ("gpu-only-lru", "substituted_experts", 1, "substitutes only with a substitution"),
    ("all-in-gpu", "ttft_ms", 1e-9, ">= lower bound"),
])
def test_a_corrupted_row_is_named(replay, system, metric, value, invariant):
    ctx, rows, _ = replay
    bad = copy.deepcopy(rows)
    bad[system][metric] = value
    found = failures(ri.check_replay(ctx, bad))
    assert any(c.system == system and c.metric == metric and c.value == value and c.invariant == invariant
               for c in found), found


def test_an_oracle_above_a_member_fails(replay):
    ctx, rows, _ = replay
    bad = copy.deepcopy(rows)
    bad["oracle"]["tpot_ms_mean"] = bad["cpu-only"]["tpot_ms_mean"] * 1.01
    found = failures(ri.check_replay(ctx, bad))
    assert any(c.system == "oracle" and c.invariant == "oracle <= every member" and "cpu-only" in c.detail
               for c in found)


def test_a_changed_value_breaks_determinism(replay):
    ctx, rows, raw = replay
    changed = raw.replace(b'"evictions": ', b'"evictions": 1', 1)
    found = failures(ri.check_determinism(ctx, raw, changed))
    assert found and found[0].invariant == "deterministic" and "evictions" in found[0].metric


def test_the_report_names_trace_profile_system_metric_and_invariant(replay, capsys):
    from rich.console import Console
    ctx, rows, _ = replay
    bad = copy.deepcopy(rows)
    bad["cpu-only"]["cpu_util"] = 1.2
    checks = ri.check_replay(ctx, bad)
    ri.print_report(checks, {}, len(bad), 0.1, Console(width=200))
    out = capsys.readouterr().out
    assert f"FAILED t.parquet {ctx.hw} cpu-only: cpu_util = 1.2 breaks 'in [0, 1]'" in out


def test_paths_given_from_another_folder_are_the_callers(tmp_path, monkeypatch):
    """The replays run from the repository root; a trace named relative to the caller's folder is still found."""
    (tmp_path / "here.parquet").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert ri.from_here("here.parquet") == str(tmp_path / "here.parquet")
    assert ri.from_here("rtx4090") == "rtx4090"  # a profile's name stays a name
