"""Setting up one replay from user-level inputs: trace, profile, system name and ``--set`` settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.hw.profile import HardwareProfile, load_profile
from moesim.model.presets import load_preset
from moesim.model.spec import DTYPE_BITS
from moesim.policy.base import coerce
from moesim.policy.systems import SYSTEMS, build_system
from moesim.sim.engine import SimConfig, SimResult, Simulator
from moesim.sim.memory import peak_kv_tokens, plan_memory
from moesim.trace.io import read_meta, trace_columns


@dataclass
class MemoryConfig:
    """GPU memory parameters, reachable as ``--set memory.<name>=value``."""

    #: activations and temporary buffers kept free on the GPU
    workspace_gib: float = 0.5
    #: dtype of attention, embeddings, dense and shared FFN weights on the GPU
    non_expert_dtype: str = "bf16"
    #: dtype of routed experts (default: the trace's model metadata)
    expert_dtype: str = ""


@dataclass
class ReplaySettings:
    engine: SimConfig = field(default_factory=SimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    hw: dict[str, Any] = field(default_factory=dict)
    slots_per_layer: int | None = None
    system: dict[str, str] = field(default_factory=dict)
    #: ``--set runtime=NAME``: the system's runtime swapped for another of the profile's
    runtime: str | None = None


def _set_field(obj: Any, section: str, key: str, raw: str) -> None:
    names = {f.name: f.default for f in dataclasses.fields(obj)}
    if key not in names:
        raise ConfigError(f"unknown parameter '{section}.{key}'", field="--set",
                          fix=f"valid: {', '.join(f'{section}.{n}' for n in names)}")
    setattr(obj, key, coerce(raw, names[key], f"{section}.{key}"))


def parse_settings(settings: dict[str, str]) -> ReplaySettings:
    out = ReplaySettings()
    for key, raw in settings.items():
        section, _, rest = key.partition(".")
        if section == "engine" and rest:
            _set_field(out.engine, "engine", rest, raw)
        elif section == "memory" and rest:
            _set_field(out.memory, "memory", rest, raw)
        elif section == "hw" and rest:
            out.hw[rest] = coerce(raw, None, key)
        elif key == "runtime":
            out.runtime = str(raw)
        elif key == "cache.slots_per_layer":
            out.slots_per_layer = int(coerce(raw, 0, key))
        else:
            out.system[key] = raw
    if out.memory.non_expert_dtype not in DTYPE_BITS:
        raise ConfigError(f"unknown dtype '{out.memory.non_expert_dtype}'", field="memory.non_expert_dtype",
                          fix=f"use one of {', '.join(DTYPE_BITS)}")
    if out.engine.staging_slots < 1:
        raise ConfigError("at least one staging buffer is needed", field="engine.staging_slots", fix="use >= 1")
    return out


def common_parameters() -> list[str]:
    """``--set`` keys every system accepts."""
    keys = [f"engine.{f.name}" for f in dataclasses.fields(SimConfig)]
    keys += [f"memory.{f.name}" for f in dataclasses.fields(MemoryConfig)]
    return keys + ["cache.slots_per_layer", "runtime=<generic|a key of the profile's runtimes>",
                   "hw.<profile field, e.g. hw.pcie.bandwidth_scale or hw.cpu.cores>"]


def prepare(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None = None,
            *, model_preset: str | None = None, seed: int = 0,
            progress: Callable[[int], None] | None = None, timeline: bool | None = None,
            decisions: bool | None = None) -> Simulator:
    """Build a ready-to-run :class:`Simulator`, checking everything a user can get wrong."""
    meta = read_meta(trace)
    model = meta.model
    if model_preset:
        preset = load_preset(model_preset)
        mismatch = preset.routing_mismatch(model)
        if mismatch:
            raise ConfigError(f"trace model '{model.name}' does not match preset '{preset.name}' ({mismatch})",
                              source=trace, field="--model", fix="pick the preset the trace was recorded with")
        model = dataclasses.replace(preset)
    members(system)
    spec_defaults = {k: v for k, v in SYSTEMS[system].defaults if k.partition(".")[0] in ("engine", "memory", "hw")}
    parsed = parse_settings({**spec_defaults, **(settings or {})})
    if timeline is not None:
        parsed.engine.timeline = timeline
    if decisions is not None:
        parsed.engine.decisions = decisions
    profile = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
    profile = profile.with_overrides(parsed.hw)
    built = build_system(system, parsed.system)
    costs = CostModel(profile, model, parsed.memory.expert_dtype or None, parsed.memory.non_expert_dtype,
                      parsed.runtime or SYSTEMS[system].runtime)
    memory = plan_memory(model, profile, expert_bytes=costs.expert_bytes, kv_tokens=peak_kv_tokens(trace),
                         workspace_gib=parsed.memory.workspace_gib, staging_slots=parsed.engine.staging_slots,
                         non_expert_dtype=parsed.memory.non_expert_dtype,
                         slots_per_layer=None if built.ignores_memory else
                         parsed.slots_per_layer if built.uses_cache else 0,
                         ignore_memory=built.ignores_memory)
    return Simulator(trace, model, profile, built, costs, memory, parsed.engine,
                     columns=tuple(trace_columns(trace)), seed=seed, progress=progress)


def members(system: str) -> tuple[str, ...]:
    """The single systems a replay of ``system`` runs (a portfolio bound runs several)."""
    if system not in SYSTEMS:
        raise ConfigError(f"unknown system '{system}'", field="--system", fix=f"use one of: {', '.join(SYSTEMS)}, all")
    return SYSTEMS[system].portfolio or (system,)


def simulate(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None = None,
             **kwargs: Any) -> SimResult:
    """Replay ``trace``; for a portfolio bound, every member runs and the fastest result is kept."""
    if SYSTEMS[system].portfolio and "runtime" not in (settings or {}):
        settings = {**(settings or {}), "runtime": SYSTEMS[system].runtime}  # members run on the bound's runtime
    runs = [prepare(trace, hw, member, settings, **kwargs).run() for member in members(system)]
    if len(runs) == 1:
        return runs[0]
    best = min(runs, key=lambda r: r.makespan_s)
    summary = ", ".join(f"{r.system} {r.makespan_s * 1e3:.3f} ms" for r in runs)
    best.notes.append(f"{system}: fastest of its schedules was {best.system} ({summary})")
    best.system = system
    best.sim_wall_s = sum(r.sim_wall_s for r in runs)
    return best


def lower_bound(trace: str, hw: str | HardwareProfile, settings: dict[str, str] | None = None) -> dict[str, Any]:
    """The physical lower bound of ``trace`` on ``hw`` (policy/catalog/bounds.py): TTFT, TPOT and makespan floors."""
    from moesim.policy.catalog.bounds import physical_lower_bound
    meta = read_meta(trace)
    parsed = parse_settings({k: v for k, v in (settings or {}).items()
                             if k.partition(".")[0] in ("engine", "memory", "hw")})
    profile = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
    profile = profile.with_overrides(parsed.hw)
    costs = CostModel(profile, meta.model, parsed.memory.expert_dtype or None, parsed.memory.non_expert_dtype)
    bound = physical_lower_bound(trace, meta.model, costs)
    return {k: bound[k] for k in ("makespan_s", "ttft_ms", "tpot_ms_mean")}

