"""Replay every catalogue system and check, row by row, what must hold whatever the policy.

Runs ``moesim replay TRACE --hw HW --system all --json -`` (each in a fresh process, twice, to check
determinism) for every trace and profile given (by default both bundled traces on ``rtx4090``,
``a100-40g`` and ``h100-pcie``) and checks every result row against the invariants below, derived from
the metric definitions (moesim/analysis/metrics.py, moesim/sim/bookkeeping.py, ``moesim replay
--help-metrics``), docs/engine.md and docs/memory-and-bounds.md. Prints a table of checks passed and
failed per system and each failure with its trace, profile, system, metric, value and invariant; exits 1
if any check fails (2 on bad input, as moesim does).

    .venv/bin/python benchmarks/replay_invariants.py
    .venv/bin/python benchmarks/replay_invariants.py --trace T.parquet --hw rtx4090 --system cpu-only,oracle \
        --set cache.slots=16 --json -      # the report as JSON on stdout, the table on stderr

Checked, per row (a system on one trace and profile):

* ranges: ``gpu_util``, ``cpu_util``, ``pcie_util`` (busy time over the makespan: each resource does one
  thing at a time and nothing runs past a step's end), ``gpu_hit_rate``, ``gpu_share_of_activations``,
  ``prefetch_precision`` and the two weight masses in [0, 1] (1e-9 of slack); a metric is null only
  where the docs leave it undefined (TTFT without prefill, TPOT and decode throughput without decode,
  precision without a prefetch that ran, weight masses without gate weights in the trace);
* counts are non-negative integers; cancelled and late prefetches at most the prefetches; evictions at
  most what was ever resident (the slots preloaded plus loads and prefetches); substituted experts only for
  a system with a substitution component, deferred ones only with a deferral component (the ``oracle``:
  any of its members);
* PCIe bytes: every copy moves one whole expert and a cancelled prefetch moves nothing, so
  ``pcie_h2d_bytes = (demand_loads + streamed_experts + prefetches - cancelled_prefetches) x expert bytes``
  (write-backs are device-to-host, not counted), in the system's own expert dtype; ``pcie_util`` is 0
  when nothing was copied. Not checked with ``engine.copy_chunk_bytes`` > 0: a prefetch cut at a chunk
  boundary when the run ends has moved part of an expert;
* the lower bound: ``ttft_ms``, ``tpot_ms_mean`` and ``makespan_s`` at least their ``lower_bound``
  fields, ``gap_to_lower_bound`` = makespan over its floor and >= 1; the floor assumed the run's slots;
* time: makespan >= TTFT; ``tpot_ms_p50`` <= ``tpot_ms_p99``; the steps run back to back from 0, so
  prefill tokens / prefill throughput + decode tokens / decode throughput = makespan, the breakdown adds
  up to the makespan (docs/engine.md: "the categories add up to the step"), the p99 TPOT is at most the
  makespan, and the TTFT spans cover every prefill step (mean TTFT x requests prefilled >= prefill time);
  TPOT x decode throughput lies between the fewest and the most requests of a decode step (times tokens
  per request), exactly 1 for one request decoding one token a step;
* tokens: ``decode_tokens`` and ``prefill_tokens`` are the trace's (tokens of each step's first logged
  layer, a step with any prefill row counting as prefill, as the engine counts them);
* memory: the planned GPU memory fits the profile's (``hw.*`` settings applied) unless the system ignores
  memory (``all-in-gpu``); ``expert_cache_gib`` = ``expert_slots`` x expert bytes.

Across the rows of one replay: the oracle is at most every member's TPOT, TTFT and makespan (members:
``moesim.sim.run.members('oracle', settings)``, mixtral-offloading only when both dtypes are int4);
``portfolio_best`` names members, and where a named member is a row, the oracle's value and floor are
that row's; the physical lower bound is monotone in slots (docs/memory-and-bounds.md), so among systems
whose floors share their settings and workload (no substitution), more slots never give a higher floor,
and a floor without a capacity term (``all-in-gpu``) is at most any of them. Per replay: the same
command twice, in two processes, gives byte-identical JSON apart from ``sim_wall_s`` (wall-clock time).

Not checked, because not guaranteed:

* ``all-in-gpu`` <= other systems: docs/memory-and-bounds.md says it is a reference, not a bound
  (CPU-assisted schedules within the budget can beat it); only its floor is a bound on theirs;
* the oracle monotone in memory: documented as not monotone (more slots can make it worse);
* a metric monotone in slots across runs, for any system (a prefetch backlog can make a bigger cache
  slower, docs/engine.md "Copies");
* for the ``oracle``, relations between metrics that come from different members: its TTFT, TPOT and
  makespan are each the best member's, the other metrics its best member on TPOT's. Its breakdown and its
  steps add up to that member's makespan, which is at least the oracle's, so those are checked as >=, and
  the p99 TPOT and TTFT-cover relations are left out;
* ``gpu_activations + cpu_activations = activations``: deferred experts are in neither (and the JSON has
  no activation counts);
* TPOT at least its floor per percentile: the floor is of the mean only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TRACES = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "traces").glob("*.parquet"))]
DEFAULT_HW = ["rtx4090", "a100-40g", "h100-pcie"]
#: slack on a [0, 1] range and on inequalities between floats computed in different orders
REL = 1e-9
RATES = ("gpu_util", "cpu_util", "pcie_util", "gpu_hit_rate", "gpu_share_of_activations")
RATES_OR_NULL = ("prefetch_precision", "substituted_weight_mass", "deferred_weight_mass")
COUNTS = ("decode_tokens", "prefill_tokens", "late_prefetches", "prefetches", "cancelled_prefetches",
          "demand_loads", "streamed_experts", "evictions", "pcie_h2d_bytes", "substituted_experts",
          "deferred_experts", "expert_slots")
#: the metrics a portfolio takes from its best member, and their floors' keys
PORTFOLIO_METRICS = ("tpot_ms_mean", "ttft_ms", "makespan_s")
WALL_CLOCK_LINE = re.compile(rb'^\s*"sim_wall_s": [^\n]*\n', re.MULTILINE)


@dataclass(frozen=True)
class Check:
    """One invariant on one row (or on one replay, ``system`` "*")."""

    trace: str
    hw: str
    system: str
    invariant: str
    metric: str
    value: Any
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class TraceFacts:
    """What the trace itself says about the token counts and batching, counted as the engine counts."""

    decode_tokens: int
    prefill_tokens: int
    #: requests in some prefill step: each has a TTFT span
    prefill_requests: int
    #: fewest and most requests in a decode step, and decode tokens over the (step, request) pairs
    decode_batch_min: int
    decode_batch_max: int
    tokens_per_request: float
    has_weights: bool


@dataclass(frozen=True)
class SystemFacts:
    """What a system's settings say: its expert bytes and the mechanisms it has."""

    expert_bytes: int
    may_substitute: bool
    may_defer: bool
    ignores_memory: bool
    portfolio: bool
    #: the settings its lower bound depends on (moesim.sim.run.bound_settings of its own defaults)
    bound_key: tuple


@dataclass
class Context:
    """Everything the checks of one replay (a trace, a profile, settings) compare the rows with."""

    trace: str
    hw: str
    settings: dict[str, str]
    facts: TraceFacts
    gpu_memory_gib: float
    oracle_members: tuple[str, ...]
    chunked_copies: bool
    systems: dict[str, SystemFacts] = field(default_factory=dict)


class Checker:
    """Collects the checks of one replay."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.checks: list[Check] = []

    def expect(self, ok: bool, system: str, invariant: str, metric: str, value: Any, detail: str = "") -> None:
        self.checks.append(Check(Path(self.ctx.trace).name, self.ctx.hw, system, invariant, metric, value,
                                 bool(ok), "" if ok else detail))


# ----------------------------------------------------------------------------------------- facts


def trace_facts(trace: str) -> TraceFacts:
    """Token counts per step as the engine records them (moesim.sim.engine: a step's tokens are the rows of its
    first logged layer, its phase prefill if any row is)."""
    from moesim.trace.io import read_table, trace_columns
    frame = read_table(trace, ["step", "layer", "request", "phase"]).to_pandas()
    frame["prefill"] = frame["phase"].astype(str) == "prefill"
    first = frame[frame["layer"] == frame.groupby("step")["layer"].transform("min")]
    steps = first.groupby("step").agg(tokens=("request", "size"), requests=("request", "nunique"))
    steps["prefill"] = frame.groupby("step")["prefill"].any()
    prefill, decode = steps[steps["prefill"]], steps[~steps["prefill"]]
    prefilled = first[first["step"].isin(prefill.index)]["request"].nunique()
    pairs = int(decode["requests"].sum())
    return TraceFacts(decode_tokens=int(decode["tokens"].sum()), prefill_tokens=int(prefill["tokens"].sum()),
                      prefill_requests=int(prefilled),
                      decode_batch_min=int(decode["requests"].min()) if pairs else 0,
                      decode_batch_max=int(decode["requests"].max()) if pairs else 0,
                      tokens_per_request=int(decode["tokens"].sum()) / pairs if pairs else 0.0,
                      has_weights="weights" in trace_columns(trace))


def system_facts(system: str, trace: str, settings: dict[str, str]) -> SystemFacts:
    from moesim.policy.systems import ROLES, SYSTEMS
    from moesim.sim.run import bound_settings, members, parse_settings, with_system_defaults
    from moesim.trace.io import read_meta
    own = with_system_defaults(system, settings)
    dtype = parse_settings(own).memory.expert_dtype or None
    # a --set role=component swaps a component in every system that runs
    roles = [{**SYSTEMS[m].roles(), **{k: v for k, v in settings.items() if k in ROLES}}
             for m in members(system, settings)]
    spec = SYSTEMS[system]
    return SystemFacts(expert_bytes=read_meta(trace).model.expert_bytes(dtype),
                       may_substitute=any(r["substitute"] != "none" for r in roles),
                       may_defer=any(r["defer"] != "none" for r in roles),
                       ignores_memory=spec.ignores_memory, portfolio=bool(spec.portfolio),
                       bound_key=tuple(sorted(bound_settings(own).items())))


def make_context(trace: str, hw: str, settings: dict[str, str], systems: Iterable[str],
                 facts: TraceFacts | None = None) -> Context:
    from moesim.hw.profile import load_profile
    from moesim.sim.run import members, parse_settings
    parsed = parse_settings(settings)
    profile = load_profile(hw).with_overrides(parsed.hw)
    ctx = Context(trace=trace, hw=hw, settings=settings,
                  facts=facts or trace_facts(trace), gpu_memory_gib=profile.gpu.memory_gib,
                  oracle_members=members("oracle", settings), chunked_copies=parsed.engine.copy_chunk_bytes > 0)
    ctx.systems = {name: system_facts(name, trace, settings) for name in systems}
    return ctx


# ----------------------------------------------------------------------------------------- one row


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def at_least(value: float | None, floor: float | None) -> bool:
    return value is not None and floor is not None and value >= floor - REL * abs(floor)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


def check_ranges(ck: Checker, name: str, row: dict) -> None:
    for key in RATES + RATES_OR_NULL:
        value = row.get(key)
        in_range = value is not None and -REL <= value <= 1 + REL
        ck.expect(in_range or (value is None and key in RATES_OR_NULL), name, "in [0, 1]", key, value,
                  "a fraction outside [0, 1]" if value is not None else "null where a fraction is defined")


def check_nulls(ck: Checker, name: str, row: dict) -> None:
    """Null (NaN in Python) exactly where the metric's definition leaves it undefined."""
    facts = ck.ctx.facts
    ran = row["prefetches"] - row["cancelled_prefetches"]
    undefined = {"ttft_ms": row["prefill_tokens"] == 0, "prefill_tokens_per_s": row["prefill_tokens"] == 0,
                 "tpot_ms_mean": row["decode_tokens"] == 0, "tpot_ms_p50": row["decode_tokens"] == 0,
                 "tpot_ms_p99": row["decode_tokens"] == 0, "decode_tokens_per_s": row["decode_tokens"] == 0,
                 "prefetch_precision": ran <= 0}
    for key, expected_null in undefined.items():
        ck.expect((row.get(key) is None) == expected_null, name, "null only where undefined", key, row.get(key),
                  f"{'a value' if row.get(key) is not None else 'null'} where it should "
                  f"{'be null' if expected_null else 'have a value'}")
    for key in ("substituted_weight_mass", "deferred_weight_mass"):  # NaN: mass touched, weights unknown
        ck.expect(row.get(key) is not None or not facts.has_weights, name, "null only where undefined", key,
                  row.get(key), "null although the trace has gate weights")


def check_counts(ck: Checker, name: str, row: dict) -> None:
    sysf = ck.ctx.systems[name]
    for key in COUNTS:
        ck.expect(is_count(row.get(key)), name, "non-negative integer", key, row.get(key), "not a count")
    if not all(is_count(row.get(k)) for k in COUNTS):
        return
    prefetches = row["prefetches"]
    ck.expect(row["cancelled_prefetches"] <= prefetches, name, "cancelled <= prefetches", "cancelled_prefetches",
              row["cancelled_prefetches"], f"more than the {prefetches} prefetches")
    ck.expect(row["late_prefetches"] <= prefetches, name, "late <= prefetches", "late_prefetches",
              row["late_prefetches"], f"more than the {prefetches} prefetches")
    ever = row["expert_slots"] + row["demand_loads"] + prefetches
    ck.expect(row["evictions"] <= ever, name, "evictions <= slots + loads + prefetches", "evictions",
              row["evictions"], f"more than ever resident ({row['expert_slots']} slots + {row['demand_loads']} "
                                f"loads + {prefetches} prefetches)")
    ck.expect(row["substituted_experts"] == 0 or sysf.may_substitute, name, "substitutes only with a substitution",
              "substituted_experts", row["substituted_experts"], "the system has no substitution component")
    ck.expect(row["deferred_experts"] == 0 or sysf.may_defer, name, "defers only with a deferral",
              "deferred_experts", row["deferred_experts"], "the system has no deferral component")
    check_copies(ck, name, row, sysf)


def check_copies(ck: Checker, name: str, row: dict, sysf: SystemFacts) -> None:
    copies = row["demand_loads"] + row["streamed_experts"] + prefetches_run(row)
    if not ck.ctx.chunked_copies:
        expected = copies * sysf.expert_bytes
        ck.expect(row["pcie_h2d_bytes"] == expected, name, "bytes = copies x expert bytes", "pcie_h2d_bytes",
                  row["pcie_h2d_bytes"], f"{copies} copies (loads + streamed + prefetches - cancelled) of "
                                         f"{sysf.expert_bytes} B are {expected} B "
                                         f"({row['pcie_h2d_bytes'] / sysf.expert_bytes:.3f} experts moved)")
    if copies == 0:
        ck.expect(row["pcie_util"] == 0, name, "no copies, no PCIe time", "pcie_util", row["pcie_util"],
                  "copy engines busy although nothing was copied")


def prefetches_run(row: dict) -> int:
    return row["prefetches"] - row["cancelled_prefetches"]


def check_floor(ck: Checker, name: str, row: dict) -> None:
    bound = row.get("lower_bound") or {}
    for key in PORTFOLIO_METRICS:
        value, floor = row.get(key), bound.get(key)
        if value is None and floor is None:
            continue  # no prefill (or decode) steps: neither is defined
        ck.expect(at_least(value, floor), name, ">= lower bound", key, value, f"below its lower bound {floor}")
    floor = bound.get("makespan_s")
    gap = row.get("gap_to_lower_bound")
    if floor:
        ck.expect(gap is not None and close(gap, row["makespan_s"] / floor), name, "gap = makespan / floor",
                  "gap_to_lower_bound", gap, f"makespan / floor is {row['makespan_s'] / floor}")
        ck.expect(gap is not None and gap >= 1 - REL, name, "gap >= 1", "gap_to_lower_bound", gap, "below 1")
    sysf = ck.ctx.systems[name]
    if not sysf.portfolio:
        expected = None if sysf.ignores_memory else row["expert_slots"]
        ck.expect(bound.get("slots") == expected, name, "floor assumes the run's slots", "lower_bound.slots",
                  bound.get("slots"), f"the run held {expected}")


def check_time(ck: Checker, name: str, row: dict) -> None:
    """The latency metrics against each other and the step times they come from."""
    facts, single = ck.ctx.facts, not ck.ctx.systems[name].portfolio
    makespan_ms = row["makespan_s"] * 1e3
    if row.get("ttft_ms") is not None:
        ck.expect(makespan_ms >= row["ttft_ms"] * (1 - REL), name, "makespan >= TTFT", "makespan_s",
                  row["makespan_s"], f"shorter than the TTFT {row['ttft_ms']} ms")
    p50, p99 = row.get("tpot_ms_p50"), row.get("tpot_ms_p99")
    if p50 is not None and p99 is not None:
        ck.expect(p50 <= p99 * (1 + REL), name, "p50 <= p99", "tpot_ms_p50", p50, f"above the p99 {p99}")
        if single:
            ck.expect(p99 <= makespan_ms * (1 + REL), name, "p99 TPOT <= makespan", "tpot_ms_p99", p99,
                      f"longer than the makespan {makespan_ms} ms")
    breakdown = row.get("breakdown_ms") or {}
    for key, value in breakdown.items():
        ck.expect(value >= 0, name, "breakdown >= 0", f"breakdown_ms.{key}", value, "negative time")
    total = sum(breakdown.values())
    ck.expect(close(total, makespan_ms) if single else total >= makespan_ms * (1 - REL), name,
              "breakdown adds up to makespan", "breakdown_ms", total,
              f"{'!=' if single else '<'} makespan {makespan_ms} ms")
    steps_s = phase_time(row, "prefill") + phase_time(row, "decode")
    ck.expect(close(steps_s, row["makespan_s"]) if single else steps_s >= row["makespan_s"] * (1 - REL), name,
              "steps fill the makespan", "makespan_s", row["makespan_s"],
              f"prefill + decode steps take {steps_s} s (tokens over throughput)")
    if single and row.get("ttft_ms") is not None and facts.prefill_requests:
        covered = row["ttft_ms"] / 1e3 * facts.prefill_requests
        ck.expect(covered >= phase_time(row, "prefill") * (1 - REL), name, "TTFT spans cover prefill", "ttft_ms",
                  row["ttft_ms"], f"x {facts.prefill_requests} requests is less than the "
                                  f"{phase_time(row, 'prefill')} s of prefill steps")
    if row.get("tpot_ms_mean") is not None and row.get("decode_tokens_per_s"):
        check_throughput(ck, name, row)


def phase_time(row: dict, phase: str) -> float:
    """Seconds of a phase's steps, from its tokens over its throughput (0 without such steps)."""
    tokens, rate = row[f"{phase}_tokens"], row.get(f"{phase}_tokens_per_s")
    return tokens / rate if tokens and rate else 0.0


def check_throughput(ck: Checker, name: str, row: dict) -> None:
    """TPOT weights each decode step by its requests, throughput counts its tokens over its time, so their
    product is between the fewest and the most requests of a step, times the tokens per (step, request)."""
    facts = ck.ctx.facts
    product = row["tpot_ms_mean"] / 1e3 * row["decode_tokens_per_s"]
    low = facts.decode_batch_min * facts.tokens_per_request
    high = facts.decode_batch_max * facts.tokens_per_request
    ck.expect(low * (1 - REL) <= product <= high * (1 + REL), name, "TPOT x throughput", "decode_tokens_per_s",
              row["decode_tokens_per_s"], f"x TPOT {row['tpot_ms_mean']} ms is {product}, outside [{low}, {high}]")


def check_tokens(ck: Checker, name: str, row: dict) -> None:
    facts = ck.ctx.facts
    for key in ("decode_tokens", "prefill_tokens"):
        ck.expect(row.get(key) == getattr(facts, key), name, "tokens as in the trace", key, row.get(key),
                  f"the trace has {getattr(facts, key)}")


def check_memory(ck: Checker, name: str, row: dict) -> None:
    sysf = ck.ctx.systems[name]
    if not sysf.ignores_memory:
        ck.expect(row["gpu_memory_gib"] <= ck.ctx.gpu_memory_gib * (1 + REL), name, "fits GPU memory",
                  "gpu_memory_gib", row["gpu_memory_gib"], f"more than the GPU's {ck.ctx.gpu_memory_gib} GiB")
    if is_count(row.get("expert_slots")) and not sysf.portfolio:
        expected = row["expert_slots"] * sysf.expert_bytes / 2**30
        ck.expect(close(row["expert_cache_gib"], expected), name, "cache = slots x expert bytes",
                  "expert_cache_gib", row["expert_cache_gib"],
                  f"{row['expert_slots']} slots of {sysf.expert_bytes} B are {expected} GiB")


ROW_CHECKS: tuple[Callable[[Checker, str, dict], None], ...] = (
    check_ranges, check_nulls, check_counts, check_floor, check_time, check_tokens, check_memory)


def check_row(ck: Checker, name: str, row: dict) -> None:
    for check in ROW_CHECKS:
        try:
            check(ck, name, row)
        except (KeyError, TypeError) as err:  # a missing or mistyped key is itself a failure, not a crash
            ck.expect(False, name, f"{check.__name__}: well-formed row", str(err), None,
                      f"{type(err).__name__}: {err}")


# ----------------------------------------------------------------------------------------- across rows


def check_oracle(ck: Checker, rows: dict[str, dict]) -> None:
    oracle = rows.get("oracle")
    if oracle is None:
        return
    for name, row in rows.items():
        if name not in ck.ctx.oracle_members:
            continue
        for key in PORTFOLIO_METRICS:
            if oracle.get(key) is not None and row.get(key) is not None:
                ck.expect(oracle[key] <= row[key] * (1 + REL), "oracle", "oracle <= every member", key,
                          oracle[key], f"above {name}'s {row[key]}")
    for part in filter(None, (p.strip() for p in oracle.get("portfolio_best", "").split(";"))):
        key, _, member = part.partition("=")
        ck.expect(member in ck.ctx.oracle_members, "oracle", "portfolio_best names a member", key, member,
                  "not a member of the oracle")
        if member in rows and oracle.get(key) is not None:
            ck.expect(close(oracle[key], rows[member][key]), "oracle", "value of the member named", key,
                      oracle[key], f"{member}, named for it, has {rows[member][key]}")
            ours, theirs = oracle["lower_bound"].get(key), rows[member]["lower_bound"].get(key)
            ck.expect(ours == theirs, "oracle", "floor of the member named", f"lower_bound.{key}", ours,
                      f"{member}, named for it, has the floor {theirs}")


def check_floor_monotone(ck: Checker, rows: dict[str, dict]) -> None:
    """Among rows whose floors share settings and workload, more slots (None: no capacity term, as many as
    wanted) never give a higher floor."""
    groups: dict[tuple, list[tuple[float, str]]] = {}
    for name, row in rows.items():
        sysf = ck.ctx.systems[name]
        if sysf.portfolio or row.get("substituted_experts"):  # a portfolio's floors are per metric; a rewrite
            continue                                          # changes the workload the floor is of
        slots = row["lower_bound"].get("slots")
        groups.setdefault(sysf.bound_key, []).append((math.inf if slots is None else slots, name))
    for members in groups.values():
        members.sort()
        for (slots_a, a), (slots_b, b) in zip(members, members[1:]):
            for key in PORTFOLIO_METRICS:
                fewer, more = rows[a]["lower_bound"].get(key), rows[b]["lower_bound"].get(key)
                if fewer is None or more is None:
                    continue
                ck.expect(more <= fewer * (1 + REL) + 1e-15, b, "floor monotone in slots", f"lower_bound.{key}",
                          more, f"{b} ({slots_b} slots) has a higher floor than {a} ({slots_a} slots): {fewer}")


def check_replay(ctx: Context, rows: dict[str, dict]) -> list[Check]:
    """Every check of one replay's rows (the systems that ran; skipped ones are not rows)."""
    ck = Checker(ctx)
    for name, row in rows.items():
        check_row(ck, name, row)
    check_oracle(ck, rows)
    check_floor_monotone(ck, rows)
    return ck.checks


def check_determinism(ctx: Context, first: bytes, second: bytes) -> list[Check]:
    """The same replay twice: the same bytes, but for the wall-clock ``sim_wall_s``."""
    ck = Checker(ctx)
    a, b = WALL_CLOCK_LINE.sub(b"", first), WALL_CLOCK_LINE.sub(b"", second)
    if a == b:
        ck.expect(True, "*", "deterministic", "json", len(a))
        return ck.checks
    rows_a, rows_b = by_system(json.loads(a)), by_system(json.loads(b))
    for name in sorted(set(rows_a) | set(rows_b)):
        row_a, row_b = rows_a.get(name, {}), rows_b.get(name, {})
        differ = sorted(k for k in set(row_a) | set(row_b) if row_a.get(k) != row_b.get(k))
        ck.expect(not differ, name, "deterministic", ",".join(differ) or "json", None,
                  "; ".join(f"{k}: {row_a.get(k)!r} then {row_b.get(k)!r}" for k in differ[:3]))
    return ck.checks


# ----------------------------------------------------------------------------------------- running


def by_system(data: dict) -> dict[str, dict]:
    """``--json`` of one system is its row; of several, one row per system."""
    return {data["system"]: data} if "system" in data else data


def replay_json(trace: str, hw: str, systems: str, settings: list[str]) -> bytes:
    """``moesim replay --json -`` in a fresh process (its own hash seed): the JSON's bytes."""
    command = [sys.executable, "-m", "moesim", "replay", trace, "--hw", hw, "--system", systems, "--json", "-"]
    command += [arg for item in settings for arg in ("--set", item)]
    done = subprocess.run(command, capture_output=True, cwd=ROOT)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no message)"]
        raise RuntimeError(f"{' '.join(command[2:])} exited {done.returncode}: {tail[0]}")
    return done.stdout


def run_case(trace: str, hw: str, systems: str, settings: list[str], repeat: bool,
             facts: TraceFacts) -> tuple[list[Check], dict[str, str], int]:
    """Checks of one trace on one profile; the systems skipped, with why; the rows checked."""
    from moesim.cli.app import parse_settings
    first = replay_json(trace, hw, systems, settings)
    data = by_system(json.loads(first))
    rows = {name: row for name, row in data.items() if "skipped" not in row}
    skipped = {name: row["skipped"] for name, row in data.items() if "skipped" in row}
    ctx = make_context(trace, hw, parse_settings(tuple(settings)), rows, facts)
    checks = check_replay(ctx, rows)
    if repeat:
        checks += check_determinism(ctx, first, replay_json(trace, hw, systems, settings))
    return checks, skipped, len(rows)


# ----------------------------------------------------------------------------------------- report


def summary(checks: list[Check]) -> dict[str, dict[str, int]]:
    per_system: dict[str, dict[str, int]] = {}
    for c in checks:
        counts = per_system.setdefault(c.system, {"passed": 0, "failed": 0})
        counts["passed" if c.ok else "failed"] += 1
    return per_system


def print_report(checks: list[Check], skipped: dict[str, dict[str, str]], rows: int, wall_s: float,
                 console: Any) -> None:
    from rich.table import Table
    failed = sum(not c.ok for c in checks)
    table = Table(title="replay invariants: checks per system", title_justify="left",
                  caption=f"{rows} rows, {len(checks)} checks, {failed} failed, {wall_s:.1f} s",
                  caption_justify="left")
    for column in ("system", "passed", "failed"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for name, counts in sorted(summary(checks).items()):
        failed = counts["failed"]
        table.add_row(name if name != "*" else "* (whole replay)", str(counts["passed"]),
                      f"[bold red]{failed}[/]" if failed else "0")
    console.print(table)
    for name, (replays, reason) in skipped_by_system(skipped).items():
        console.print(f"skipped {name} in {replays} replay{'s' if replays > 1 else ''} (first: {reason})",
                      markup=False, highlight=False)
    for c in (c for c in checks if not c.ok):
        console.print(f"FAILED {c.trace} {c.hw} {c.system}: {c.metric} = {c.value!r} breaks '{c.invariant}': "
                      f"{c.detail}", markup=False, highlight=False)


def skipped_by_system(skipped: dict[str, dict[str, str]]) -> dict[str, tuple[int, str]]:
    """Per system skipped, in how many replays and the first reason (the same one, trace by trace)."""
    out: dict[str, tuple[int, str]] = {}
    for reasons in skipped.values():
        for name, reason in reasons.items():
            count, first = out.get(name, (0, reason))
            out[name] = (count + 1, first)
    return out


def json_report(checks: list[Check], skipped: dict[str, dict[str, str]], rows: int, wall_s: float,
                args: argparse.Namespace) -> dict:
    failures = [asdict(c) for c in checks if not c.ok]
    return {"traces": args.trace, "hw": args.hw, "system": args.system, "settings": args.set, "rows": rows,
            "checks": len(checks), "failed": len(failures), "wall_s": wall_s, "per_system": summary(checks),
            "skipped": skipped, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="append", help=f"trace to replay (repeatable) [default: {DEFAULT_TRACES}]")
    parser.add_argument("--hw", action="append", help=f"hardware profile (repeatable) [default: {DEFAULT_HW}]")
    parser.add_argument("--system", default="all", help="systems, as moesim replay --system takes them [all]")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to moesim replay")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON ('-': stdout, table on stderr)")
    parser.add_argument("--synth", action="store_true",
                        help="also a synthetic Mixtral trace with router scores (which importance needs, and the "
                             "bundled traces lack), two requests decoding together")
    parser.add_argument("--no-repeat", action="store_true", help="replay once: skip the determinism check")
    args = parser.parse_args(argv)
    # the replays run from the repository root (where the defaults are); paths given here are the caller's
    args.trace = [from_here(t) for t in args.trace] if args.trace else list(DEFAULT_TRACES)
    args.hw = [from_here(h) for h in args.hw] if args.hw else DEFAULT_HW
    with tempfile.TemporaryDirectory() as folder:
        if args.synth:
            args.trace.append(synth_trace(Path(folder)))
        return run(args)


def from_here(path: str) -> str:
    """``path`` made absolute when it names a file from the caller's working directory; else as given (a
    profile's name, or a path the replay then reports as missing)."""
    return str(Path(path).resolve()) if Path(path).is_file() else path


def synth_trace(folder: Path) -> str:
    """A small Mixtral-8x7B trace with scores and gate weights: 2 requests, 32-token prompts, 64 decode
    tokens each, batched (so TPOT and throughput part ways)."""
    from moesim.trace.synth import SynthConfig, synthesize
    path = folder / "mixtral-synth-scores.parquet"
    synthesize(SynthConfig.from_settings(model="mixtral-8x7b", requests=2, prompt_len=32, decode_len=64,
                                         batch=2, seed=0, scores=True), path)
    return str(path)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from moesim.errors import MoesimError
    from moesim.progress import Progress
    console = Console(stderr=args.json == "-")
    start = time.perf_counter()
    checks: list[Check] = []
    skipped: dict[str, dict[str, str]] = {}
    rows = 0
    cases = [(trace, hw) for trace in args.trace for hw in args.hw]
    with Progress("replay invariants", total=len(cases), unit="replays") as bar:
        for trace, hw in cases:
            bar.advance(0, label=f"{Path(trace).name} on {hw}")
            try:
                found, missed, n = run_case(trace, hw, args.system, args.set, not args.no_repeat,
                                            trace_facts(trace))
            except (RuntimeError, MoesimError) as err:  # bad input or a replay that failed: its one line
                print(f"error: {err}", file=sys.stderr)
                return 2
            checks += found
            rows += n
            if missed:
                skipped[f"{Path(trace).name} on {hw}"] = missed
            bar.advance(1)
    wall_s = time.perf_counter() - start
    print_report(checks, skipped, rows, wall_s, console)
    if args.json:
        text = json.dumps(json_report(checks, skipped, rows, wall_s, args), indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 1 if any(not c.ok for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
