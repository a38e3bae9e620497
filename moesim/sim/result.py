"""What a replay returns: its step records, counters and plan, and the timeline and decision log columns.

The simulator and the real backend both return a :class:`SimResult`; analysis reads it without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moesim.sim.bookkeeping import Counters
from moesim.sim.memory import MemoryPlan


@dataclass
class StepRecord:
    step: int
    phase: str
    start: float
    end: float
    tokens: int
    requests: list[int]


@dataclass
class SimResult:
    system: str
    steps: list[StepRecord]
    counters: Counters
    pcie_busy_s: float
    pcie_bytes: int
    makespan_s: float
    memory: MemoryPlan
    notes: list[str]
    timeline: list[tuple] | None
    decisions: list[tuple] | None
    sim_wall_s: float
    cost_fallbacks: list[str]
    initial_resident: list[list[int]] = field(default_factory=list)
    pcie_engines: int = 1
    #: the runtime the replay charged launches and CPU kernel efficiency by (a key of the profile's runtimes)
    runtime: str = "generic"
    #: (step, layer) -> routing rewrites the system made (substitution); the bound replays them
    rewrites: dict[tuple[int, int], list[tuple[int, int, int]]] = field(default_factory=dict)


TIMELINE_COLUMNS = ("resource", "lane", "start_s", "end_s", "kind", "step", "layer", "expert", "tokens")
DECISION_COLUMNS = ("step", "layer", "expert", "action", "target_layer")


def result_to_frames(result: SimResult) -> dict[str, Any]:
    """Timeline and decision log as pandas DataFrames (None when not recorded)."""
    import pandas as pd
    out: dict[str, Any] = {"timeline": None, "decisions": None}
    if result.timeline is not None:
        frame = pd.DataFrame(result.timeline, columns=list(TIMELINE_COLUMNS))
        out["timeline"] = frame.sort_values(["start_s", "resource", "lane"], kind="stable").reset_index(drop=True)
    if result.decisions is not None:
        out["decisions"] = pd.DataFrame(result.decisions, columns=list(DECISION_COLUMNS))
    return out
