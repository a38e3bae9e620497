"""Preemptible copies (engine.copy_chunk_bytes): demand loads overtake a running prefetch at a chunk boundary."""

from __future__ import annotations

import pytest

from moesim.errors import ConfigError
from moesim.sim.copies import CopyEngines, Transfer
from moesim.sim.run import parse_settings


def _engines(chunk: int) -> CopyEngines:
    return CopyEngines(lambda n: n * 1e-6, 1, chunk_bytes=chunk)  # 1 us per byte


def test_demand_overtakes_prefetch_at_chunk_boundary():
    engines = _engines(10)
    prefetch = Transfer(0, 1, 100, 1, "prefetch", 1, 0.0)
    engines.submit(prefetch)
    assert (prefetch.start, prefetch.end) == (0.0, pytest.approx(100e-6))
    demand = Transfer(0, 2, 100, 0, "load", 2, 25e-6)
    engines.submit_demands([demand], 25e-6)
    # the prefetch's third chunk ends at 30 us; the demand runs 30-130 us; 70 bytes of prefetch follow
    assert (demand.start, demand.end) == (pytest.approx(30e-6), pytest.approx(130e-6))
    assert engines.finish(prefetch) == pytest.approx(200e-6)
    assert prefetch.nbytes == 70 and engines.preemptions == 1
    assert engines.bytes == 200 and engines.busy_s == pytest.approx(200e-6)


def test_without_chunks_the_demand_waits():
    engines = _engines(0)
    prefetch = Transfer(0, 1, 100, 1, "prefetch", 1, 0.0)
    engines.submit(prefetch)
    demand = Transfer(0, 2, 100, 0, "load", 2, 25e-6)
    engines.submit_demands([demand], 25e-6)
    assert (demand.start, demand.end) == (pytest.approx(100e-6), pytest.approx(200e-6))
    assert prefetch.end == pytest.approx(100e-6)


def test_demand_after_a_demand_is_not_preempting():
    engines = _engines(10)
    first = Transfer(0, 1, 100, 0, "load", 1, 0.0)
    engines.submit_demands([first], 0.0)
    second = Transfer(0, 2, 100, 0, "load", 2, 25e-6)
    engines.submit_demands([second], 25e-6)
    assert second.start == pytest.approx(100e-6)


def test_setting_is_an_engine_key():
    assert parse_settings({"engine.copy_chunk_bytes": "1048576"}).engine.copy_chunk_bytes == 1048576
    with pytest.raises(ConfigError):
        parse_settings({"engine.copy_chunk": "1"})
