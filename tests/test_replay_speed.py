"""benchmarks/replay_speed.py's rounds: every system and the naive baseline take turns, each keeps its
fastest round, and a system that failed in every round is reported as failed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def replay_speed():
    spec = importlib.util.spec_from_file_location("replay_speed", REPO / "benchmarks" / "replay_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(system: str, seconds: float, rss: float, setup: float = 0.1) -> dict:
    return {"system": system, "seconds": seconds, "setup_s": setup, "activations": 100, "per_s": 100 / seconds,
            "peak_rss_mib": rss}


def test_best_round_keeps_the_fastest_and_the_highest_peak(replay_speed):
    best = replay_speed.best_round([row("smoe", 2.0, 150, 0.3), {"system": "smoe", "error": "killed"},
                                    row("smoe", 1.5, 120, 0.2), row("smoe", 1.7, 180, 0.4)])
    assert best["seconds"] == 1.5 and best["per_s"] == pytest.approx(100 / 1.5)
    assert best["peak_rss_mib"] == 180 and best["setup_s"] == 0.2
    assert replay_speed.best_round([{"system": "x", "error": "boom"}] * 2) == {"system": "x", "error": "boom"}


def test_rounds_take_turns(replay_speed, monkeypatch):
    calls = []
    clock = iter(range(1, 100))

    def measure(trace, name, hw):
        calls.append(name)
        return row(name, float(next(clock)), 100)

    monkeypatch.setattr(replay_speed, "measure", measure)
    rows = replay_speed.measure_rounds(Path("t.parquet"), ["naive-simpy", "a", "b"], "rtx4090", 2, "decode")
    assert calls == ["naive-simpy", "a", "b"] * 2, "one replay each per round, in turn"
    assert [(r["system"], r["seconds"]) for r in rows] == [("naive-simpy", 1.0), ("a", 2.0), ("b", 3.0)]
