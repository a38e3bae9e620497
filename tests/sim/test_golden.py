"""Every catalogue system's metrics on a fixed trace, compared with stored expectations.

Replay speed work must not change a single number: ``golden_metrics.json``
holds each system's ``moesim replay --json`` metrics (wall-clock fields
removed) on ``tests/data/golden-dsv2lite.parquet`` (DeepSeek-V2-Lite shape,
two requests decoded together, with scores and predictor columns) on
``rtx4090``. A change of engine semantics regenerates it deliberately:

    MOESIM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/sim/test_golden.py

and the commit says why the numbers moved. ``MOESIM_UPDATE_GOLDEN=dali,oracle``
rewrites those systems' entries only, leaving the others as stored.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from moesim.analysis.metrics import metrics
from moesim.policy.systems import system_names
from moesim.sim.run import simulate

HERE = Path(__file__).parent
TRACE = HERE.parent / "data" / "golden-dsv2lite.parquet"
EXPECTED = HERE / "golden_metrics.json"
#: fields that measure the host, not the simulation
WALL_CLOCK = {"sim_wall_s", "sim_rows_per_s", "wall_s"}


def _stable(value):
    """Metrics as JSON-comparable data: NaN as None, wall-clock fields dropped."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in sorted(value.items()) if k not in WALL_CLOCK}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def current() -> dict[str, dict]:
    return {name: _stable(metrics(simulate(str(TRACE), "rtx4090", name))) for name in system_names()}


@pytest.fixture(scope="module")
def observed() -> dict[str, dict]:
    got = current()
    update = os.environ.get("MOESIM_UPDATE_GOLDEN", "")
    if update:
        stored = json.loads(EXPECTED.read_text()) if update != "1" else {}
        chosen = set(got) if update == "1" else set(update.split(","))
        unknown = chosen - set(got)
        assert not unknown, f"MOESIM_UPDATE_GOLDEN names unknown systems {sorted(unknown)}"
        stored.update({name: got[name] for name in chosen})
        EXPECTED.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    return got


@pytest.mark.parametrize("system", system_names())
def test_metrics_unchanged(observed: dict[str, dict], system: str) -> None:
    expected = json.loads(EXPECTED.read_text())
    assert system in expected, f"no stored metrics for {system}: regenerate (see module docstring)"
    assert json.dumps(observed[system], sort_keys=True) == json.dumps(expected[system], sort_keys=True)
