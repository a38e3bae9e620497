"""Why two rows of a comparison are identical, computed from the runs themselves.

Two systems whose latency and traffic metrics agree to the printed digits are
either the same schedule in disguise or differ only in something this trace
and profile never exercise. :func:`explain_identical` says which, from what
the runs did: their decision logs (placements, loads, prefetches, evictions),
the mechanisms each system has that the others lack and how often each acted
(and why it stayed idle where the runs show it: it acts only in a phase the trace
lacks, ``Component.phases``, or every routed expert was resident from the start; the
component's own notes are quoted as context), the settings that tell apart
systems built from the same components, their memory plans, and their time
breakdowns category by category. A portfolio bound is explained by the schedule
its metrics came from when they all came from one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from moesim.policy.systems import COMPONENTS, ROLES, SYSTEMS, SystemSpec

#: metrics that make a row: latency, throughput, traffic, hits and utilisation
ROW_METRICS = ("ttft_ms", "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "makespan_s", "decode_tokens_per_s",
               "prefill_tokens_per_s", "gpu_hit_rate", "pcie_h2d_bytes", "demand_loads", "streamed_experts",
               "prefetches", "cpu_util", "gpu_util", "pcie_util")
#: significant digits two rows must share to count as identical (the table prints fewer)
DIGITS = 9
#: per role, the counter that says whether the component acted
ACTED = {"substitute": "substituted_experts", "defer": "deferred_experts", "prefetch": "prefetches"}


def _key(m: dict[str, Any]) -> tuple:
    out = []
    for name in ROW_METRICS:
        value = m.get(name)
        if isinstance(value, float):
            value = "nan" if value != value else float(f"{value:.{DIGITS}g}")
        out.append(value)
    return tuple(out)


def identical_groups(by_system: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Systems whose row metrics agree, in table order; only groups of two or more (entries of systems that
    were skipped, as ``replay --json`` lists them, are left out)."""
    groups: dict[tuple, list[str]] = {}
    for name, m in by_system.items():
        if "skipped" in m:
            continue
        groups.setdefault(_key(m), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


@dataclass
class Decisions:
    """One run's decision log, summarised for comparison."""

    log: list[tuple]

    def counts(self) -> Counter:
        return Counter(row[3] for row in self.log)

    def describe(self) -> str:
        counts = self.counts()
        if not counts:
            return "no logged decision"
        return ", ".join(f"{n:,} {action}" for action, n in sorted(counts.items()))


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i:,}: step {x[0]} layer {x[1]} expert {x[2]} {x[3]} vs step {y[0]} layer {y[1]} " \
                   f"expert {y[2]} {y[3]}"
    return f"one log has {abs(len(a) - len(b)):,} more entries"


def _placement(m: dict[str, Any]) -> str:
    share = m.get("gpu_share_of_activations")
    if share is None:
        return ""
    if share == 0:
        return "every routed expert ran on the CPU"
    if share == 1:
        return "every routed expert ran on the GPU"
    return f"{share:.1%} of expert activations ran on the GPU"


def _schedule(name: str, by_system: dict[str, dict[str, Any]]) -> str | None:
    """The system whose components made ``name``'s row: itself, or the one schedule a portfolio bound took
    every metric from (None when its metrics came from several)."""
    spec = SYSTEMS.get(name)
    if spec is None or not spec.portfolio:
        return name if spec is not None else None
    sources = {pair.split("=", 1)[1] for pair in by_system[name].get("portfolio_best", "").split("; ") if "=" in pair}
    return sources.pop() if len(sources) == 1 and next(iter(sources)) in SYSTEMS else None


def _specs(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> dict[str, tuple[str, SystemSpec]]:
    """Each member's label (a portfolio's 'bound (schedule)'), its run's name and the composition that ran."""
    out = {}
    for name in names:
        schedule = _schedule(name, by_system)
        if schedule is not None:
            out[name if schedule == name else f"{name} ({schedule})"] = (name, SYSTEMS[schedule])
    return out


def _missing_phases(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> set[str]:
    """The step phases this trace has none of (read off the runs' token counts)."""
    counted = {"prefill": "prefill_tokens", "decode": "decode_tokens"}
    return {phase for phase, key in counted.items() if all(by_system[n].get(key) == 0 for n in names)}


def _idle_phase(role: str, component: str, missing: set[str]) -> str:
    """Why a component had nothing to do: it acts only in phases the trace lacks ('' if not so)."""
    cls = COMPONENTS.get(role, {}).get(component)
    if cls is None or not set(cls.phases) <= missing:
        return ""
    return f"acts in {' and '.join(cls.phases)} steps only, of which the trace has none"


def _mechanisms(names: Sequence[str], by_system: dict[str, dict[str, Any]], same_decisions: bool) -> list[str]:
    """Per role whose component differs among the members: what each component did (and why not, if noted)."""
    specs = _specs(names, by_system)
    missing = _missing_phases(names, by_system)
    out = []
    for role in ROLES:
        users: dict[str, list[str]] = {}
        for label, (_, spec) in specs.items():
            users.setdefault(spec.roles()[role], []).append(label)
        if len(users) < 2:
            continue
        if role == "assign":
            listed = " and ".join(f"'{c}' ({', '.join(u)})" for c, u in users.items())
            out.append(f"assign {listed} " + ("put every expert on the same device" if same_decisions
                                              else "placed experts differently to the same effect"))
            continue
        for component, members in users.items():
            if component != "none":
                runs = [specs[label][0] for label in members]
                out.append(_acted(role, component, members, runs, by_system, _idle_phase(role, component, missing)))
    return out


def _acted(role: str, component: str, members: list[str], runs: list[str], by_system: dict[str, dict[str, Any]],
           idle: str = "") -> str:
    m = by_system[runs[0]]
    who = f"{', '.join(members)}: {role} '{component}'"
    counter = ACTED.get(role)
    if counter is not None and counter in m:
        counts = {by_system[n][counter] for n in runs}
        text = f"{who} never acted (0 {counter.replace('_', ' ')})" if counts == {0} else \
            f"{who} acted ({', '.join(f'{c:,}' for c in sorted(counts))} {counter.replace('_', ' ')})"
    elif role == "cache":
        text = f"{who} {_cache_use(m)}"
    else:
        text = f"{who} made no difference"
    # a component's notes give context (calibration source, defaults taken), not necessarily the cause
    notes = sorted({note.split(": ", 1)[1] for n in runs for note in by_system[n].get("notes", [])
                    if note.startswith(f"{component}: ")})
    return text + (f" because it {idle}" if idle else "") + (f" (its note: {'; '.join(notes)})" if notes else "")


def _all_resident(m: dict[str, Any]) -> bool:
    """Every routed expert ran on the GPU from slots that held it from the start: no loads, streams, evictions
    or CPU runs."""
    return m.get("gpu_share_of_activations") == 1 and m.get("gpu_hit_rate") == 1 and \
        not any(m.get(key) for key in ("demand_loads", "streamed_experts", "pcie_h2d_bytes", "evictions"))


def _settings(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> str:
    """Members with the same components that differ in their systems' default settings: which settings, and
    which of the components they configure act only in phases the trace lacks."""
    specs = _specs(names, by_system)
    if len(specs) < 2 or len({tuple(spec.roles().items()) for _, spec in specs.values()}) > 1:
        return ""
    defaults = {label: dict(spec.defaults) for label, (_, spec) in specs.items()}
    keys = sorted({key for values in defaults.values() for key in values})
    differing = [key for key in keys if len({values.get(key) for values in defaults.values()}) > 1]
    if not differing:
        return ""
    roles = next(iter(specs.values()))[1].roles()
    listed = "; ".join(f"{label}: " + ", ".join(f"{key}={values.get(key, _default(roles, key))}"
                                                  for key in differing)
                       for label, values in defaults.items())
    text = f"they share every component and differ in settings ({listed})"
    missing = _missing_phases(names, by_system)
    for role in sorted({key.split(".")[0] for key in differing if key.split(".")[0] in roles}):
        idle = _idle_phase(role, roles[role], missing)
        if idle:
            text += f"; {role} '{roles[role]}' reads them and {idle}"
    return text


def _default(roles: dict[str, str], key: str) -> str:
    """A setting's value where a system leaves it alone: its component's field default."""
    role, _, field_name = key.partition(".")
    cls = COMPONENTS.get(role, {}).get(roles.get(role, ""))
    value = cls.parameters().get(field_name, "default") if cls is not None else "default"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cache_use(m: dict[str, Any]) -> str:
    if not m.get("gpu_share_of_activations"):
        return f"held {m.get('expert_slots', 0):,} expert slots that no expert ran from"
    return f"served {m.get('gpu_hit_rate', 0.0):.1%} of GPU experts from its slots"


def _memory(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> str:
    slots = {n: by_system[n].get("expert_slots") for n in names}
    if len(set(slots.values())) <= 1:
        return ""
    listed = ", ".join(f"{n} {s:,}" for n, s in slots.items() if isinstance(s, int))
    return f"expert slots differ ({listed})"


def _costs(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> str:
    breakdowns = [by_system[n].get("breakdown_ms", {}) for n in names]
    first = breakdowns[0]
    if all(b.keys() == first.keys() and all(abs(b[k] - first[k]) <= 1e-9 * max(abs(first[k]), 1.0) for k in b)
           for b in breakdowns[1:]):
        busy = ", ".join(f"{k} {v:,.1f} ms" for k, v in first.items() if v > 0)
        return f"their time breakdowns agree in every category ({busy}): {_runtimes(names, by_system)}"
    return ""


def _runtimes(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> str:
    """Why equal breakdowns need no runtime to explain them: one runtime, or runtimes costing the same here."""
    runtimes: dict[str, list[str]] = {}
    for name in names:
        runtimes.setdefault(str(by_system[name].get("runtime", "?")), []).append(name)
    if len(runtimes) == 1:
        return f"they run on the same runtime ({next(iter(runtimes))})"
    listed = " and ".join(f"{runtime} ({', '.join(group)})" for runtime, group in runtimes.items())
    return f"their runtimes, {listed}, come out equal on this profile"


def _portfolio(names: Sequence[str], by_system: dict[str, dict[str, Any]]) -> str:
    for name in names:
        best = by_system[name].get("portfolio_best")
        if best:
            schedule = _schedule(name, by_system)
            return f"{name} is, per metric, the best of its schedules, and every one of its metrics came from " + \
                (schedule if schedule and schedule != name else best)
    return ""


def explain_identical(names: Sequence[str], by_system: dict[str, dict[str, Any]],
                      decisions: Callable[[str], list[tuple] | None] | None = None) -> str:
    """One sentence on why the rows of ``names`` agree; ``decisions(name)`` gives a run's decision log."""
    parts = []
    portfolio = _portfolio(names, by_system)
    if portfolio:
        parts.append(portfolio)
    logs = {n: decisions(_schedule(n, by_system) or n) for n in names} if decisions else {}
    logs = {n: log for n, log in logs.items() if log is not None}
    same = False
    if len(logs) == len(names) and len(names) > 1:
        first_name, first = next(iter(logs.items()))
        differing = [n for n, log in logs.items() if log != first]
        reordered = bool(differing) and all(sorted(logs[n]) == sorted(first) for n in differing)
        same = not differing or reordered
        if same:
            parts.append(f"they made the same placement and transfer decisions on this trace "
                         f"({Decisions(first).describe()})" + (", in another order within some layers"
                                                               if reordered else ""))
        else:
            other = differing[0]
            parts.append(f"their decision logs differ ({first_name}: {Decisions(first).describe()}; {other}: "
                         f"{Decisions(logs[other]).describe()}; first difference at "
                         f"{_first_difference(first, logs[other])}) yet every timing agrees")
    placements = {_placement(by_system[n]) for n in names}
    if all(_all_resident(by_system[n]) for n in names):
        parts.append("in all of them every routed expert ran on the GPU from slots that held it from the first "
                     "step on (nothing loaded or evicted), so no cache, prefetch or substitution had a miss to act on")
    elif len(placements) == 1 and placements != {""}:
        parts.append(f"in all of them {placements.pop()}")
    parts += _mechanisms(names, by_system, same)
    for part in (_settings(names, by_system), _memory(names, by_system), _costs(names, by_system)):
        if part:
            parts.append(part)
    return "; ".join(parts) + "."


def identical_lines(by_system: dict[str, dict[str, Any]],
                    decisions: Callable[[str], list[tuple] | None] | None = None) -> list[str]:
    """A line per group of identical rows: the names and the computed reason."""
    return [f"identical rows {', '.join(names)}: {explain_identical(names, by_system, decisions)}"
            for names in identical_groups(by_system)]


def decision_logs(trace: str, hw: str, settings: dict[str, str], **kwargs: Any) -> Callable[[str], list[tuple] | None]:
    """A function that replays one system again with its decision log on (None for a portfolio bound)."""
    from moesim.sim.run import simulate

    def log(name: str) -> list[tuple] | None:
        if name not in SYSTEMS or SYSTEMS[name].portfolio:
            return None
        return simulate(trace, hw, name, settings, decisions=True, **kwargs).decisions
    return log
