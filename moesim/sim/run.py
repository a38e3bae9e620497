"""Setting up one replay from user-level inputs: trace, profile, system name and ``--set`` settings."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from moesim.errors import ConfigError, MoesimError, ProfileError, did_you_mean
from moesim.hw.cost import CostModel
from moesim.hw.profile import HardwareProfile, load_profile
from moesim.model.presets import load_preset
from moesim.model.spec import DTYPE_BITS
from moesim.policy.base import coerce
from moesim.policy.systems import SYSTEMS, ComposedSystem, build_system, check_system_name, portfolio_members
from moesim.sim.config import SimConfig
from moesim.sim.engine import Simulator
from moesim.sim.result import SimResult
from moesim.sim.memory import CacheRequest, peak_kv_tokens, plan_memory
from moesim.sim.portfolio import (METRICS, Pruned, TraceShape, best_of, branch_and_bound, racing_members,
                                  summary)
from moesim.trace.io import keeping_decoded, read_meta, trace_columns
from moesim.trace.validate import checked_meta, settle
from moesim.util import listed


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
    cache: CacheRequest = field(default_factory=CacheRequest)
    system: dict[str, str] = field(default_factory=dict)
    #: ``--set runtime=NAME``: the system's runtime swapped for another of the profile's
    runtime: str | None = None


def _set_field(obj: Any, section: str, key: str, raw: str) -> None:
    names = {f.name: f.default for f in dataclasses.fields(obj)}
    if key not in names:
        valid = [f"{section}.{n}" for n in names]
        raise ConfigError(f"unknown parameter '{section}.{key}'", field="--set",
                          fix=f"{did_you_mean(f'{section}.{key}', valid)}valid: {', '.join(valid)}")
    setattr(obj, key, coerce(raw, names[key], f"{section}.{key}"))


def parse_slot_list(raw: Any, key: str) -> list[int]:
    """``2``, ``[2,1,2]`` or ``2,1,2`` as a list of ints (one number applies to every layer)."""
    bad = ConfigError(f"'{raw}' is not a valid int or a list of ints", field=key,
                      fix="write one whole number for every layer or a list of one per layer, e.g. 2 or [2,1,2,...]")
    if isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        text = str(raw).strip()
        if text[:1] in ("[", "(") or text[-1:] in ("]", ")"):  # brackets only as a matching pair
            if len(text) < 2 or {"[": "]", "(": ")"}.get(text[0]) != text[-1]:
                raise bad
            text = text[1:-1].strip()
        items = [x.strip() for x in text.split(",")] if text else []
        if "" in items:  # "2,,1" or "2,": a number left out
            raise bad
    try:
        return [int(x) for x in items]
    except ValueError:
        raise bad from None


def parse_settings(settings: dict[str, str]) -> ReplaySettings:
    out = ReplaySettings()
    slots: int | None = None
    per_layer: list[int] | None = None
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
            per_layer = parse_slot_list(raw, key)
        elif key == "cache.slots":
            slots = _cache_slots(raw)
        else:
            out.system[key] = raw
    out.cache = CacheRequest(slots=slots, slots_per_layer=per_layer)
    if out.memory.non_expert_dtype not in DTYPE_BITS:
        raise ConfigError(f"unknown dtype '{out.memory.non_expert_dtype}'", field="memory.non_expert_dtype",
                          fix=f"{did_you_mean(out.memory.non_expert_dtype, DTYPE_BITS)}use one of "
                              f"{', '.join(DTYPE_BITS)}")
    if out.engine.staging_slots < 1:
        raise ConfigError("at least one staging buffer is needed", field="engine.staging_slots", fix="use >= 1")
    return out


#: ``cache.slots=max``: as many slots as fit, as when it is not given (the top of a sweep's grid, which differs
#: by trace and system)
SLOTS_THAT_FIT = "max"


def _cache_slots(raw: str | int) -> int | None:
    """``cache.slots`` as a number of slots, or None for :data:`SLOTS_THAT_FIT`."""
    if isinstance(raw, str):
        if raw.strip().lower() == SLOTS_THAT_FIT:
            return None
        if not raw.strip().lstrip("+-").isdigit():
            raise ConfigError(f"'{raw}' is not a number of slots", field="cache.slots",
                              fix=f"give a whole number, e.g. 960, or {SLOTS_THAT_FIT} for as many as fit")
    return int(coerce(raw, 0, "cache.slots"))


def common_parameters() -> list[str]:
    """``--set`` keys every system accepts."""
    keys = [f"engine.{f.name}" for f in dataclasses.fields(SimConfig)]
    keys += [f"memory.{f.name}" for f in dataclasses.fields(MemoryConfig)]
    return keys + ["cache.slots (total expert slots; default, or max: all that fit)",
                   "cache.slots_per_layer (N per layer, or one per layer: 2,1,2,...)",
                   "runtime=<generic|a key of the profile's runtimes>",
                   "hw.<profile field, e.g. hw.pcie.bandwidth_scale or hw.cpu.cores>"]


def prepare(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None = None,
            *, model_preset: str | None = None, seed: int = 0,
            progress: Callable[[int], None] | None = None, timeline: bool | None = None,
            decisions: bool | None = None, kv_tokens: int | None = None) -> Simulator:
    """Build a ready-to-run :class:`Simulator`, checking everything a user can get wrong.

    ``kv_tokens``: the trace's :func:`peak_kv_tokens`, when the caller has it (a portfolio's members share it).
    """
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
    parsed = parse_settings(with_system_defaults(system, settings))
    if timeline is not None:
        parsed.engine.timeline = timeline
    if decisions is not None:
        parsed.engine.decisions = decisions
    profile = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
    profile = profile.with_overrides(parsed.hw)
    built = build_system(system, parsed.system)
    built.for_model(model)
    checked_meta(trace, built.needed_columns())  # the validation pass, once per file and process
    check_runtime(profile, parsed.runtime)
    costs = CostModel(profile, model, parsed.memory.expert_dtype or None, parsed.memory.non_expert_dtype,
                      parsed.runtime or SYSTEMS[system].runtime)
    kv_tokens = peak_kv_tokens(trace) if kv_tokens is None else kv_tokens
    memory = plan_memory(model, profile, built, expert_bytes=costs.expert_bytes, kv_tokens=kv_tokens,
                         workspace_gib=parsed.memory.workspace_gib, staging_slots=parsed.engine.staging_slots,
                         non_expert_dtype=parsed.memory.non_expert_dtype, request=parsed.cache,
                         given=parsed.system)
    sim = Simulator(trace, model, profile, built, costs, memory, parsed.engine,
                    columns=tuple(trace_columns(trace)), seed=seed, progress=progress)
    sim.ctx.notes.extend(memory.notes)
    note = partial_layers_note(meta.source, model.num_layers)
    if note:
        sim.ctx.notes.append(note)
    return sim


def check_runtime(profile: HardwareProfile, runtime: str | None) -> None:
    """``--set runtime=NAME`` (``runtime``; None when not given) names a runtime of ``profile``: one it lacks is
    refused as that parameter, with the runtimes the profile has (it blamed the profile's field 'runtimes.NAME')."""
    if runtime is None:
        return
    try:
        profile.runtime(runtime)
    except ProfileError as err:
        named = f"{profile.name} ({profile.path})" if profile.path else profile.name
        raise ConfigError(f"parameter 'runtime'={runtime}: no runtime '{runtime}' in the profile {named}",
                          field="--set",
                          fix=did_you_mean(runtime, ["generic", "ideal", *profile.runtimes]) + (err.fix or "")) from None


def partial_layers_note(source: dict, num_layers: int) -> str:
    """A note when an imported trace logged only some of the model's MoE layers ('' when it logged all):
    only those are replayed, so a step's time leaves the others out."""
    present = source.get("layers_present") if isinstance(source, dict) else None
    if not isinstance(present, list) or not present or len(present) >= num_layers:
        return ""
    shown = listed(present)
    return (f"the trace logs {len(present)} of the model's {num_layers} MoE layers ({shown}): only those are "
            "replayed, so times leave the other layers out (the memory plan still spreads slots over all)")


def with_system_defaults(system: str, settings: dict[str, str] | None) -> dict[str, str]:
    """``settings`` over the system's own engine/memory/hw defaults (mixtral-offloading's int4 experts, say)."""
    spec = SYSTEMS.get(system)
    own = {k: v for k, v in spec.defaults if k.partition(".")[0] in ("engine", "memory", "hw")} if spec else {}
    return {**own, **(settings or {})}


def check_settings(system: str, settings: dict[str, str] | None) -> ComposedSystem:
    """The checks of :func:`prepare` that need neither trace nor profile: every parameter known to ``system``
    and a value it takes (``moesim validate`` runs them before it measures a profile); the system so built."""
    parsed = parse_settings(with_system_defaults(system, settings))
    return build_system(system, parsed.system)


def checked_seed(seed: Any) -> int:
    """``seed`` as an int, refused in one line unless a whole number in [0, 2**63) (numpy's generators and the
    command line's --seed take no other)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be a whole number in [0, 2**63), got {seed!r}", field="seed", fix="e.g. seed=0")
    return int(seed)


def members(system: str, settings: dict[str, str] | None = None) -> tuple[str, ...]:
    """The single systems a replay of ``system`` with ``settings`` runs (a portfolio bound runs several)."""
    check_system_name(system)
    return portfolio_members(system, settings)


#: metrics a portfolio takes, each from its best member (lower is better)
PORTFOLIO_METRICS = METRICS


@dataclass
class PortfolioResult(SimResult):
    """A portfolio bound's result: the replay of its best member on TPOT (whose timeline and counters it
    carries) and, per metric of ``PORTFOLIO_METRICS``, the best value over every member and who gave it."""

    #: metric -> (member, value)
    best: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: member -> its metrics of ``PORTFOLIO_METRICS``
    members: dict[str, dict[str, float]] = field(default_factory=dict)
    #: member -> what its lower bound depends on (:func:`floor_inputs`); complete members only
    inputs: dict[str, tuple[int | None, dict]] = field(default_factory=dict)
    #: member -> where it was stopped and why: it provably was best on no metric (``engine.prune``,
    #: moesim.sim.portfolio); its row of ``members`` holds its lower bounds there, not metrics
    pruned: dict[str, Pruned] = field(default_factory=dict)


def portfolio_result(system: str, runs: list[SimResult], skipped: dict[str, str] | None = None,
                     pruned: dict[str, Pruned] | None = None, order: list[str] | None = None) -> PortfolioResult:
    """Combine the members' replays of a portfolio bound: each metric the minimum over its members.

    ``pruned``: members stopped early, provably best on no metric; ``order``: every member in portfolio
    order (the tie-break, and the order of the members table; default: ``runs``'s).
    """
    pruned = pruned or {}
    complete = {r.system: summary(r) for r in runs}
    order = order or [r.system for r in runs]
    runs = sorted(runs, key=lambda r: order.index(r.system))
    pruned = {name: pruned[name] for name in order if name in pruned}
    table: dict[str, dict[str, float]] = {}
    for name in order:
        if name in complete:
            table[name] = complete[name]
        elif name in pruned:
            table[name] = {"pruned_after_step": float(pruned[name].step),
                           **{f"{m}_at_least": v for m, v in pruned[name].lower.items()}}
    best: dict[str, tuple[str, float]] = {}
    names = list(table)
    for metric in PORTFOLIO_METRICS:
        values = [(v[metric], names.index(name)) for name, v in complete.items() if not math.isnan(v[metric])]
        if values:  # values equal but for the last bits tie: the member order breaks the tie
            value, place = best_of(values)
            best[metric] = (names[place], value)
    lead_name = best.get("tpot_ms_mean", best.get("makespan_s", (runs[0].system, 0.0)))[0]
    lead = next(r for r in runs if r.system == lead_name)
    fields = {f.name: getattr(lead, f.name) for f in dataclasses.fields(SimResult)}
    out = PortfolioResult(**fields, best=best, members=table, inputs={r.system: floor_inputs(r) for r in runs})
    out.system = system
    out.pruned = dict(pruned)
    out.sim_wall_s = sum(r.sim_wall_s for r in runs) + sum(p.wall_s for p in pruned.values())
    out.notes = list(lead.notes)
    said = ", ".join(f"{metric.split('_')[0].upper()} {value * (1 if metric != 'makespan_s' else 1e3):.3f} ms "
                     f"from {name}" for metric, (name, value) in best.items())
    out.notes.append(f"{system}: best of {len(runs) + len(pruned)} schedules per metric: {said}")
    if pruned:
        out.notes.append(f"{system}: schedules stopped once provably best on no metric (engine.prune=false runs "
                         "them to the end): " + "; ".join(f"{k} {v.reason}" for k, v in pruned.items()))
    if skipped:
        out.notes.append(f"{system}: schedules that could not run here: "
                         + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    return out


def columns_read(system: str, settings: dict[str, str] | None = None) -> set[str]:
    """The optional trace columns a replay of ``system`` with ``settings`` reads (a portfolio: its members');
    none for settings that do not build (the replay itself then says what is wrong)."""
    columns: set[str] = set()
    try:
        for member in members(system, settings):
            columns.update(build_system(member, parse_settings(with_system_defaults(member, settings)).system)
                           .needed_columns())
    except MoesimError:
        pass
    return columns


def simulate(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None = None,
             reuse: dict[str, SimResult] | None = None, **kwargs: Any) -> SimResult:
    """Replay ``trace``; for a portfolio bound every member runs and each metric keeps its best member.

    ``reuse``: replays of members already run with the same inputs (``--system all`` runs them anyway).
    """
    result = _simulate(trace, hw, system, settings, reuse, **kwargs)
    settle(trace)  # the columns the run did not read, checked beside it: a fault there refuses the result
    return result


def _simulate(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None,
              reuse: dict[str, SimResult] | None, **kwargs: Any) -> SimResult:
    names = members(system)
    if names == (system,):
        return prepare(trace, hw, system, settings, **kwargs).run()
    with keeping_decoded():  # the members replay the same trace: decoded once
        sims, runs, skipped = prepare_members(trace, hw, system, settings, reuse, **kwargs)
        return run_members(trace, system, sims, runs, skipped, kwargs.get("progress"), settings)


def prepare_members(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None,
                    reuse: dict[str, SimResult] | None = None, **kwargs: Any
                    ) -> tuple[dict[str, Simulator], dict[str, SimResult], dict[str, str]]:
    """A portfolio's members set up to run: (their simulators, replays reused, members that cannot run here)."""
    own = SYSTEMS[system].portfolio
    sims: dict[str, Simulator] = {}
    runs: dict[str, SimResult] = {}
    skipped: dict[str, str] = {}
    # what every member's set-up reads alike, read once: the profile file and the trace's peak context
    profile = hw if isinstance(hw, HardwareProfile) else None
    kv_tokens = kwargs.pop("kv_tokens", None)
    for member in members(system, settings):
        if reuse and member in reuse:
            runs[member] = reuse[member]
            continue
        try:
            sim = prepare(trace, profile or hw, member, settings, kv_tokens=kv_tokens, **kwargs)
            # now, not at its first step: a member stopped before one would be said to be stopped, not unable
            sim.system.check_columns(sim.ctx)
            sims[member] = sim
            # read after a member's set-up has checked the trace and found the profile
            profile = profile or load_profile(hw)  # type: ignore[arg-type]
            kv_tokens = peak_kv_tokens(trace) if kv_tokens is None else kv_tokens
        except ConfigError as err:
            if member in own:
                raise  # the bound's own schedules must run
            skipped[member] = str(err)  # a listed system that cannot run this trace or setting
    return sims, runs, skipped


def run_members(trace: str, system: str, sims: dict[str, Simulator], runs: dict[str, SimResult],
                skipped: dict[str, str], progress: Callable[[int], None] | None = None,
                settings: dict[str, str] | None = None) -> PortfolioResult:
    """Run a portfolio's prepared members, each to its end or (``engine.prune``) until it provably is best
    on no metric (moesim.sim.portfolio), and combine them."""
    # one decode of the trace, with the optional columns of every member, each member seeing its own
    with keeping_decoded(columns={c for sim in sims.values() for c in sim.system.needed_columns()}):
        return _run_members(trace, system, sims, runs, skipped, progress, settings)


def _run_members(trace: str, system: str, sims: dict[str, Simulator], runs: dict[str, SimResult],
                 skipped: dict[str, str], progress: Callable[[int], None] | None,
                 settings: dict[str, str] | None = None) -> PortfolioResult:
    names = list(members(system, settings))  # the settings' members: a system on their weights is one (own_weights)
    # members prepared with settings this call was not given (a caller that left them out) still run, last
    names += [name for name in (*sims, *runs) if name not in names]
    own = SYSTEMS[system].portfolio
    runs = dict(runs)
    pruned: dict[str, Pruned] = {}
    if sims and not next(iter(sims.values())).config.prune:
        for name, sim in sims.items():
            try:
                runs[name] = sim.run()
            except ConfigError as err:
                if name in own:
                    raise
                skipped[name] = str(err)
    elif sims:
        shape = TraceShape.of(trace, next(iter(sims.values())).model.num_experts)
        racing = racing_members(sims, shape, own, skipped)
        done, pruned = branch_and_bound(racing, {name: summary(r) for name, r in runs.items()}, list(names),
                                        shape, own, skipped, progress)
        runs.update(done)
    order = [name for name in names if name in runs or name in pruned]
    return portfolio_result(system, list(runs.values()), skipped, pruned, order)


#: what :func:`lower_bound` gives (a portfolio's adds ``slots_by_metric``)
LOWER_BOUND_KEYS = ("makespan_s", "ttft_ms", "tpot_ms_mean", "slots")


def lower_bound(trace: str, hw: str | HardwareProfile, settings: dict[str, str] | None = None, *,
                slots: int | None = None, rewrites: dict | None = None, terms: list | None = None) -> dict[str, Any]:
    """The physical lower bound of ``trace`` on ``hw`` (policy/catalog/bounds.py): TTFT, TPOT and makespan
    floors for a system holding at most ``slots`` experts on the GPU (None: no capacity term) whose
    substitutions were ``rewrites``. ``terms``: the steps' terms kept between calls with the same trace, profile
    and settings (``bounds.physical_lower_bound``)."""
    from moesim.policy.catalog.bounds import physical_lower_bound
    meta = read_meta(trace)
    parsed = parse_settings(bound_settings(settings))
    profile = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
    profile = profile.with_overrides(parsed.hw)
    costs = CostModel(profile, meta.model, parsed.memory.expert_dtype or None, parsed.memory.non_expert_dtype)
    bound = physical_lower_bound(trace, meta.model, costs, slots=slots, rewrites=rewrites, terms=terms)
    return {k: bound[k] for k in LOWER_BOUND_KEYS}


def bound_settings(settings: dict[str, str] | None) -> dict[str, str]:
    """The settings a lower bound depends on: ``engine.*``, ``memory.*`` and ``hw.*`` (the system's own
    parameters and the cache's slot counts enter it through the replay's memory plan and rewrites)."""
    return {k: v for k, v in (settings or {}).items() if k.partition(".")[0] in ("engine", "memory", "hw")}


def floor_inputs(result: SimResult) -> tuple[int | None, dict]:
    """What the lower bound of ``result`` depends on: the experts its memory plan holds, its rewrites."""
    return (None if result.memory.ignores_memory else result.memory.slots), result.rewrites


def result_lower_bound(trace: str, hw: str | HardwareProfile, settings: dict[str, str] | None,
                       result: SimResult, memo: dict | None = None) -> dict[str, Any]:
    """The lower bound a replay is measured against: its own memory and workload; for a portfolio, each
    metric's floor is that of the schedule that gave the metric. ``memo`` shares floors between calls."""
    memo = {} if memo is None else memo

    def floor(slots: int | None, rewrites: dict) -> dict[str, Any]:
        key = (slots, tuple(sorted((k, tuple(v)) for k, v in rewrites.items())) if rewrites else ())
        if key not in memo:
            # the steps' terms that hold for any slot count, kept beside the floors (a memo of one settings)
            memo[key] = lower_bound(trace, hw, settings, slots=slots, rewrites=rewrites or None,
                                    terms=memo.setdefault("terms", []))
        return memo[key]

    if isinstance(result, PortfolioResult):
        out: dict[str, Any] = {}
        for metric in PORTFOLIO_METRICS:
            member = result.best.get(metric, (None, 0.0))[0]
            out[metric] = floor(*result.inputs[member])[metric] if member else float("nan")
        # ``slots`` an int (or None) as for any system: the most any metric's floor holds; each metric's apart
        by_metric = {m: result.inputs[name][0] for m, (name, _) in result.best.items()}
        held = [s for s in by_metric.values() if s is not None]
        out["slots"] = max(held) if held else None
        out["slots_by_metric"] = by_metric
        return out
    return floor(*floor_inputs(result))


def add_lower_bound(metrics: dict[str, Any], result: SimResult, trace: str, hw: str | HardwareProfile,
                    system: str, settings: dict[str, str] | None, memos: dict | None = None) -> dict[str, Any]:
    """Add ``lower_bound`` and ``gap_to_lower_bound`` to ``metrics``, the metrics of ``result`` (a replay of
    ``system`` on ``trace`` and ``hw`` with ``settings``), as ``moesim replay --json``, ``moesim.replay`` and
    a sweep's rows give them: the physical lower bound of the system's own memory plan, workload and defaults
    (mixtral-offloading's int4 experts), by :func:`result_lower_bound`, and the makespan over that bound's
    (NaN for a bound of no time). Returns ``metrics``.

    ``memos``: floors shared between calls with the same trace and profile, by the settings they depend on
    (:func:`bound_settings`); several systems of one replay, or points of one sweep, then share them.
    """
    own = with_system_defaults(system, settings)
    memo = None if memos is None else memos.setdefault(tuple(sorted(bound_settings(own).items())), {})
    bound = result_lower_bound(trace, hw, own, result, memo)
    metrics["lower_bound"] = bound
    metrics["gap_to_lower_bound"] = metrics["makespan_s"] / bound["makespan_s"] if bound["makespan_s"] \
        else float("nan")
    return metrics
