"""How close every system comes to the oracle and to the physical lower bound (docs/memory-and-bounds.md).

One replay per schedule: every listed system and the oracle's own clairvoyant
schedules run once, the oracle is combined from those same replays
(:func:`moesim.sim.run.portfolio_result`, as ``simulate(..., "oracle")`` does),
and each replay is set against the oracle and against its own lower bound
(its memory plan's slots, its own substitutions). A ratio below 1 would be a
bound that does not hold; property tests and ``benchmarks/bound_margins.py``
look for one.
"""

from __future__ import annotations

import math
from typing import Any

from moesim.analysis.metrics import latency_metrics
from moesim.errors import ConfigError
from moesim.hw.profile import HardwareProfile
from moesim.policy.systems import SYSTEMS, portfolio_members, system_names
from moesim.sim.run import PORTFOLIO_METRICS, SimResult, portfolio_result, result_lower_bound, simulate


def replay_all(trace: str, hw: str | HardwareProfile, settings: dict[str, str] | None = None
               ) -> tuple[dict[str, SimResult], dict[str, str]]:
    """Every listed system and the oracle's schedules, replayed once; (runs, skipped with the reason)."""
    runs: dict[str, SimResult] = {}
    skipped: dict[str, str] = {}
    own = SYSTEMS["oracle"].portfolio
    names = list(portfolio_members("oracle", settings)) + [n for n in system_names() if SYSTEMS[n].ignores_memory]
    for name in names:
        try:
            runs[name] = simulate(trace, hw, name, settings)
        except ConfigError as err:
            if name in own:
                raise
            skipped[name] = str(err)
    members = [r for name, r in runs.items() if not SYSTEMS[name].ignores_memory]
    runs["oracle"] = portfolio_result("oracle", members, {k: v for k, v in skipped.items()})
    return runs, skipped


def margins(trace: str, hw: str | HardwareProfile, settings: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per (system, metric): its value, the oracle's, its lower bound, and the two ratios (>= 1 when bounds hold)."""
    runs, _ = replay_all(trace, hw, settings)
    oracle = runs["oracle"]
    memo: dict = {}
    rows = []
    for name, result in runs.items():
        values = latency_metrics(result.steps)
        values["makespan_s"] = result.makespan_s
        if name == "oracle":
            values.update({k: v for k, (_, v) in oracle.best.items()})
        floor = result_lower_bound(trace, hw, settings, result, memo)
        for metric in PORTFOLIO_METRICS:
            value = values[metric]
            best = oracle.best.get(metric, (None, math.nan))[1]
            rows.append({"system": name, "metric": metric, "value": value, "oracle": best, "floor": floor[metric],
                         "vs_oracle": _ratio(value, best), "vs_floor": _ratio(value, floor[metric]),
                         "reference": SYSTEMS[name].ignores_memory if name in SYSTEMS else False})
    return rows


def _ratio(value: float, bound: float) -> float:
    if math.isnan(value) or math.isnan(bound) or bound <= 0:
        return math.nan
    return value / bound
