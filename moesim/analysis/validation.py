"""``moesim validate --real``: the simulator against real kernels on the same trace and systems.

For each system the real backend (:mod:`backends.torch_backend`) and the
simulator (:func:`moesim.sim.run.simulate`) run the same trace on the same
hardware profile (measured on this machine, or given). The report gives,
per system, real and simulated TTFT and TPOT with the simulator's error in
percent, the share of identical rows in the two decision logs, and whether
the systems rank the same way in both. Systems whose decisions do not depend
on timing (no prefetch, no cost-based split) must log identical decisions;
every (step, layer) where the logs differ is listed. Per system it also gives the host time the real
run measured on each MoE layer's critical path, from the end of its attention and gate to the launch of its
first expert (``plan()`` among it), which the simulator does not charge (:class:`backends.recording.HostTime`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moesim.analysis.report import number_text
from moesim.errors import ConfigError
from moesim.sim.result import SimResult
from moesim.util import atomic_write_text, is_missing, listed, output_file, tmp_path_for

#: a measured profile's expert and attention curves include kernel launches (backends.profiler)
MEASURED_PROFILE_SETTINGS = {"engine.kernels_per_expert": "0", "engine.kernels_per_shared": "0"}
#: differing (step, layer) groups listed in full
MAX_LISTED = 20


@dataclass
class DecisionComparison:
    identical: bool
    #: matching rows (per step and layer, as multisets) over the longer log's rows
    share: float
    real_rows: int
    sim_rows: int
    #: "step S layer L: simulator [...] / real [...]" for the first differing groups
    differences: list[str] = field(default_factory=list)
    differing_groups: int = 0


@dataclass
class SystemComparison:
    system: str
    real: dict[str, Any]
    sim: dict[str, Any]
    decisions: DecisionComparison
    #: the real run's host time on the MoE layers' critical path (HostTime.summary(): µs per MoE layer);
    #: None where the real result has none
    host_time: dict[str, Any] | None = None

    @property
    def ttft_error_pct(self) -> float:
        return error_pct(self.sim["ttft_ms"], self.real["ttft_ms"])

    @property
    def tpot_error_pct(self) -> float:
        return error_pct(self.sim["tpot_ms_mean"], self.real["tpot_ms_mean"])

    @property
    def host_ms_per_decode_step(self) -> float | None:
        """The measured host time per MoE layer of decode steps times the MoE layers of a step, in ms."""
        host = self.host_time or {}
        per_layer = host.get("decode_host_us_per_layer")
        return None if per_layer is None else per_layer * host["moe_layers_per_step"] / 1e3

    @property
    def host_share_of_tpot(self) -> float | None:
        """:attr:`host_ms_per_decode_step` over the measured mean TPOT (a fraction; None without either)."""
        step, tpot = self.host_ms_per_decode_step, self.real.get("tpot_ms_mean")
        return None if step is None or is_missing(tpot) or not tpot else step / tpot

    def host_time_dict(self) -> dict[str, Any] | None:
        if self.host_time is None:
            return None
        return {**self.host_time, "decode_host_ms_per_step": self.host_ms_per_decode_step,
                "decode_host_share_of_tpot": self.host_share_of_tpot}


@dataclass
class ValidationReport:
    trace: str
    profile: str
    device: str
    command: str
    systems: list[SystemComparison]
    settings: dict[str, str] = field(default_factory=dict)

    def ranking(self, source: str, key: str) -> list[str]:
        return rank({c.system: getattr(c, source)[key] for c in self.systems})

    def same_ranking(self, key: str) -> bool:
        """Every pair of systems in the same order in both, a tie in one only where the other ties too (the
        rankings' tie order by name decides nothing); with a value missing, the two rankings alike."""
        real = {c.system: c.real[key] for c in self.systems}
        sim = {c.system: c.sim[key] for c in self.systems}
        if any(is_missing(real[s]) or is_missing(sim[s]) for s in real):
            return self.ranking("real", key) == self.ranking("sim", key)
        return all(_sign(real[a] - real[b]) == _sign(sim[a] - sim[b]) for i, a in enumerate(real)
                   for b in list(real)[i + 1:])

    def swapped_pairs(self, key: str) -> list[SwappedPair]:
        """Pairs of systems the simulator orders differently from the measurement, by ``key``."""
        real = {c.system: c.real[key] for c in self.systems}
        sim = {c.system: c.sim[key] for c in self.systems}
        return swapped_pairs(real, sim)

    def ranking_text(self, key: str) -> str:
        """"same", or "DIFFERENT" with each swapped pair and how far apart it is in each source: a swap of
        two systems the simulator puts 0.3% apart is a near tie, one it puts 30% apart is a wrong answer."""
        if self.same_ranking(key):
            return "same"
        swapped = self.swapped_pairs(key)
        pairs = len(self.systems) * (len(self.systems) - 1) // 2
        listed_pairs = "; ".join(
            f"{p.real_faster} vs {p.sim_faster}: {p.real_faster} {gap_text(p.real_gap_pct)} faster measured, "
            f"{gap_text(p.sim_gap_pct)} slower simulated" for p in swapped)
        if swapped:
            return f"DIFFERENT, {len(swapped)} of {pairs} pairs swapped: {listed_pairs}"
        real = {c.system: c.real[key] for c in self.systems}
        sim = {c.system: c.sim[key] for c in self.systems}
        missing = [s for s in real if is_missing(real[s]) or is_missing(sim[s])]
        if missing:
            return f"DIFFERENT ({listed(missing)} without a value in one of them)"
        ties = []
        for tied, other, where, there in ((sim, real, "simulated", "measured"), (real, sim, "measured", "simulated")):
            for i, a in enumerate(self.systems):
                for b in self.systems[i + 1:]:
                    x, y = a.system, b.system
                    if tied[x] == tied[y] and other[x] != other[y]:
                        fast, slow = (x, y) if other[x] < other[y] else (y, x)
                        ties.append(f"{x} and {y} tie {where}, {fast} {gap_text(error_pct(other[slow], other[fast]))} "
                                    f"faster {there}")
        return "DIFFERENT, no pair swapped but " + "; ".join(ties)

    def to_dict(self) -> dict[str, Any]:
        keys = ("ttft_ms", "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "decode_tokens_per_s", "gpu_hit_rate",
                "demand_loads", "prefetches", "evictions", "streamed_experts", "makespan_s", "cpu_util", "gpu_util",
                "pcie_util", "breakdown_ms", "notes")
        return {
            "trace": self.trace, "profile": self.profile, "device": self.device, "command": self.command,
            "settings": self.settings,
            "systems": {c.system: {
                "real": {k: c.real[k] for k in keys}, "sim": {k: c.sim[k] for k in keys},
                "ttft_error_pct": c.ttft_error_pct, "tpot_error_pct": c.tpot_error_pct,
                "decisions": dataclasses.asdict(c.decisions), "host_time": c.host_time_dict()}
                for c in self.systems},
            "ranking": {"tpot_real": self.ranking("real", "tpot_ms_mean"),
                        "tpot_sim": self.ranking("sim", "tpot_ms_mean"),
                        "ttft_real": self.ranking("real", "ttft_ms"), "ttft_sim": self.ranking("sim", "ttft_ms"),
                        "same_tpot": self.same_ranking("tpot_ms_mean"), "same_ttft": self.same_ranking("ttft_ms"),
                        "swapped_tpot": [dataclasses.asdict(p) for p in self.swapped_pairs("tpot_ms_mean")],
                        "swapped_ttft": [dataclasses.asdict(p) for p in self.swapped_pairs("ttft_ms")],
                        "text_tpot": self.ranking_text("tpot_ms_mean"), "text_ttft": self.ranking_text("ttft_ms")},
        }


@dataclass(frozen=True)
class SwappedPair:
    """Two systems in opposite order: ``real_faster`` is faster when measured, ``sim_faster`` when simulated."""
    real_faster: str
    sim_faster: str
    #: how much slower the measured loser is than the measured winner, in percent (and likewise simulated)
    real_gap_pct: float
    sim_gap_pct: float


def swapped_pairs(real: dict[str, float], sim: dict[str, float]) -> list[SwappedPair]:
    """Every pair of systems (lower is faster) that ``real`` and ``sim`` order oppositely, widest
    simulated gap first; a tie or a missing value in either orders nothing."""
    systems = [s for s in real if s in sim and not (math.isnan(real[s]) or math.isnan(sim[s]))]
    out = []
    for i, a in enumerate(systems):
        for b in systems[i + 1:]:
            if (real[a] - real[b]) * (sim[a] - sim[b]) < 0:
                fast, slow = (a, b) if real[a] < real[b] else (b, a)
                out.append(SwappedPair(fast, slow, error_pct(real[slow], real[fast]), error_pct(sim[fast], sim[slow])))
    return sorted(out, key=lambda p: (-p.sim_gap_pct, p.real_faster, p.sim_faster))


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def gap_text(pct: float) -> str:
    return f"{pct:.1f}%" if pct >= 0.1 else f"{pct:.2g}%"


def error_pct(simulated: float, measured: float) -> float:
    """Simulated minus measured, in percent of measured (NaN when either is missing)."""
    if measured is None or simulated is None or math.isnan(measured) or math.isnan(simulated) or measured == 0:
        return float("nan")
    return (simulated - measured) / measured * 100.0


def rank(values: dict[str, float]) -> list[str]:
    """Systems fastest first (missing values last, ties by name)."""
    return sorted(values, key=lambda s: (math.isnan(values[s]), values[s] if not math.isnan(values[s]) else 0, s))


def compare_decisions(real: list[tuple], sim: list[tuple], limit: int = MAX_LISTED) -> DecisionComparison:
    """Row-by-row comparison of two decision logs, grouped by (step, layer)."""
    def groups(rows: list[tuple]) -> dict[tuple[int, int], list[tuple]]:
        out: dict[tuple[int, int], list[tuple]] = {}
        for row in rows:
            out.setdefault((int(row[0]), int(row[1])), []).append(tuple(row))
        return out
    by_real, by_sim = groups(real), groups(sim)
    matched, differences, differing = 0, [], 0
    for key in sorted(set(by_real) | set(by_sim)):
        r, s = by_real.get(key, []), by_sim.get(key, [])
        matched += sum((Counter(r) & Counter(s)).values())
        if r != s:
            differing += 1
            if len(differences) < limit:
                differences.append(f"step {key[0]} layer {key[1]}: simulator {_short(s)} / real {_short(r)}")
    longest = max(len(real), len(sim))
    return DecisionComparison(identical=list(map(tuple, real)) == list(map(tuple, sim)),
                              share=matched / longest if longest else 1.0, real_rows=len(real), sim_rows=len(sim),
                              differences=differences, differing_groups=differing)


def _short(rows: list[tuple]) -> str:
    return "[" + ", ".join(f"{r[3]} {r[2]}" + (f"->L{r[4]}" if r[4] != r[1] else "") for r in rows) + "]"


# ----------------------------------------------------------------------------- running
def truncate_trace(trace: str, layers: int, out: Path) -> Path:
    """The first ``layers`` MoE layers of ``trace`` as a trace of its own (for models too big for host memory)."""
    from moesim.trace.io import parquet_options, read_meta, read_table
    from moesim.trace.schema import META_KEY
    meta = read_meta(trace)
    if not 1 <= layers <= meta.model.num_layers:
        raise ConfigError(f"--layers {layers} outside 1..{meta.model.num_layers}", source=trace, field="--layers",
                          fix=f"use 1..{meta.model.num_layers}")
    whole = read_table(trace)
    table = whole.filter(pc.less(whole["layer"], layers))
    if table.num_rows == 0:  # a trace that logged only later layers (an importer's per-layer log)
        logged = sorted(pc.unique(whole["layer"]).to_pylist())
        raise ConfigError(f"the trace logs MoE layers {listed(logged)}, none of the first {layers}",
                          source=trace, field="--layers",
                          fix=f"use --layers {logged[0] + 1} or more (it keeps layers 0 to N-1)")
    model = meta.model.truncated(layers)
    meta = dataclasses.replace(meta, model=model, source={**meta.source, "truncated_to_layers": layers})
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), _as_bytes(META_KEY): meta.to_json()})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(out)
    try:
        pq.write_table(table, tmp, **parquet_options(table.column_names))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _as_bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


def run_validation(trace: str, systems: list[str], profile: Any, *, device: str, settings: dict[str, str],
                   threads: int = 0, command: str = "moesim validate --real", profile_label: str = "",
                   progress: Callable[[str], None] | None = None
                   ) -> tuple[ValidationReport, dict[str, tuple[SimResult, SimResult]]]:
    """Run every system on real kernels and in the simulator; returns the report and the raw results."""
    from backends.torch_backend import RealConfig, run_real
    from moesim.analysis.metrics import metrics
    from moesim.sim.run import simulate
    say = progress or (lambda _text: None)
    config = RealConfig(device=device, cpu_threads=threads)
    comparisons, results = [], {}
    for name in systems:
        say(f"{name}: real run")
        real = run_real(trace, profile, name, settings, config)
        say(f"{name}: simulation")
        sim = simulate(trace, profile, name, settings, timeline=True, decisions=True)
        results[name] = (real, sim)
        host = getattr(real, "host_time", None)  # measured only: the simulator's results have none
        comparisons.append(SystemComparison(name, metrics(real), metrics(sim),
                                            compare_decisions(real.decisions or [], sim.decisions or []),
                                            None if host is None else host.summary()))
    report = ValidationReport(trace=trace, profile=profile_label or getattr(profile, "path", str(profile)),
                              device=device, command=command, systems=comparisons, settings=dict(settings))
    return report, results


# ----------------------------------------------------------------------------- writing
def write_report(report: ValidationReport, results: dict[str, tuple[SimResult, SimResult]], out_dir: Path) -> dict:
    """validation.md, validation.json, validation.png, and per system the real and simulated logs. Each file
    goes through :func:`moesim.util.output_file`: in a command they land together when it ends, or none does
    (an interrupted or failed write leaves the earlier report whole, not half of it replaced)."""
    from moesim.analysis.timeline import write_decisions, write_timeline
    from moesim.sim.result import result_to_frames
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "validation.json", "markdown": out_dir / "validation.md",
             "plot": out_dir / "validation.png"}
    for name, (real, sim) in results.items():
        (out_dir / name).mkdir(exist_ok=True)
        for label, result in (("real", real), ("sim", sim)):
            frames = result_to_frames(result)
            with output_file(out_dir / name / f"{label}-decisions.parquet") as path:
                write_decisions(frames["decisions"], path)
            with output_file(out_dir / name / f"{label}-timeline.parquet") as path:
                write_timeline(frames["timeline"], path)
    with output_file(files["plot"]) as path:
        plot_validation(report, path)
    with output_file(files["json"]) as path:
        atomic_write_text(path, json.dumps(report.to_dict(), indent=2, default=float) + "\n")
    with output_file(files["markdown"]) as path:
        atomic_write_text(path, render_markdown(report, files["plot"].name))
    return files


def ms_text(value: float) -> str:
    """Milliseconds as the report prints them; '-' where undefined (TTFT of a trace without a prefill)."""
    return "-" if value is None else number_text(float(value), 3)


def pct_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.1f}%"


def render_markdown(report: ValidationReport, plot_name: str) -> str:
    lines = ["# Validation: simulator vs real kernels", "",
             f"- trace: `{report.trace}`", f"- profile: `{report.profile}`", f"- device: {report.device}",
             f"- command: `{report.command}`"]
    if report.settings:
        lines.append("- settings: " + ", ".join(f"`{k}={v}`" for k, v in report.settings.items()))
    lines += ["", "| system | TTFT real ms | TTFT sim ms | TTFT error | TPOT real ms | TPOT sim ms | TPOT error | "
              "identical decisions |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in report.systems:
        d = c.decisions
        lines.append(f"| {c.system} | {ms_text(c.real['ttft_ms'])} | {ms_text(c.sim['ttft_ms'])} "
                     f"| {pct_text(c.ttft_error_pct)} | {ms_text(c.real['tpot_ms_mean'])} "
                     f"| {ms_text(c.sim['tpot_ms_mean'])} | {pct_text(c.tpot_error_pct)} "
                     f"| {d.share:.1%}{' (all)' if d.identical else ''} |")
    lines += ["", "Error: (simulated - measured) / measured. Identical decisions: rows of the two decision logs "
              "that match within each (step, layer), over the longer log.", ""]
    for key, label in (("tpot_ms_mean", "TPOT"), ("ttft_ms", "TTFT")):
        lines.append(f"- ranking by {label}: {report.ranking_text(key)} (real: "
                     f"{', '.join(report.ranking('real', key))}; simulated: {', '.join(report.ranking('sim', key))})")
    lines += ["", f"![real vs simulated]({plot_name})", ""]
    lines += host_time_lines(report.systems)
    for c in report.systems:
        if c.decisions.identical:
            continue
        d = c.decisions
        lines += [f"## {c.system}: decision logs differ in {d.differing_groups} (step, layer) groups", ""]
        lines += [f"- {text}" for text in d.differences]
        if d.differing_groups > len(d.differences):
            lines.append(f"- ... and {d.differing_groups - len(d.differences)} more")
        lines.append("")
    notes = sorted({n for c in report.systems for n in c.real.get("notes", []) + c.sim.get("notes", [])})
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


#: the sentence every rendering of the host time carries
HOST_TIME_TEXT = ("Host time: per MoE layer, from the end of its attention and gate to the launch of its first "
                  "expert, the host retires landed copies, builds the layer view, plans (plan(), its own column) "
                  "and launches the copies the plan queues, while the GPU stream has nothing of the layer to run; "
                  "measured with the host clock, mean over the MoE layers of decode steps, a plan's declared "
                  "overhead left out. The simulator does not charge this time: it plans in zero time.")


def host_time_lines(systems: list[SystemComparison]) -> list[str]:
    """The markdown section of the measured host time per system (none when no system has one)."""
    measured = [c for c in systems if c.host_time is not None]
    if not measured:
        return []
    layers = sorted({c.host_time["moe_layers_per_step"] for c in measured})
    lines = ["## Host time on the critical path (measured only)", "", HOST_TIME_TEXT, "",
             f"| system | host µs per MoE layer | plan() µs per MoE layer | host ms per decode step "
             f"(x {listed([str(n) for n in layers])} MoE layers) | share of measured TPOT |",
             "|---|---:|---:|---:|---:|"]
    for c in measured:
        host = c.host_time
        share = c.host_share_of_tpot
        lines.append(f"| {c.system} | {us_text(host['decode_host_us_per_layer'])} "
                     f"| {us_text(host['decode_plan_us_per_layer'])} | {ms_text(c.host_ms_per_decode_step)} "
                     f"| {'-' if share is None else f'{share:.1%}'} |")
    return lines + [""]


def us_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def plot_validation(report: ValidationReport, path: Path) -> Path:
    """Grouped bars: measured and simulated TTFT and TPOT per system."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from moesim.analysis.plots import save_figure
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    names = [c.system for c in report.systems]
    x = np.arange(len(names))
    for i, (key, label) in enumerate((("ttft_ms", "TTFT (ms)"), ("tpot_ms_mean", "TPOT mean (ms)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        real = [c.real[key] for c in report.systems]
        sim = [c.sim[key] for c in report.systems]
        ax.bar(x - 0.2, real, 0.4, label="measured", color="#0072B2")
        ax.bar(x + 0.2, sim, 0.4, label="simulated", color="#E69F00")
        ax.set_xticks(x, names, rotation=20, ha="right")
        ax.set_title(label)
        ax.legend()
    fig.suptitle(f"{Path(report.trace).name} on {report.device}")
    fig.tight_layout()
    return save_figure(fig, path)
