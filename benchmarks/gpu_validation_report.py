"""Turn the output folder of benchmarks/gpu_validation.py into the validation document (docs/validation/GPU.md,
e.g. h200.md, after the GPU the profile is named for).

    python benchmarks/gpu_validation_report.py OUT_DIR [--out docs/validation/h100.md]

OUT_DIR holds profile/, v2lite/ and qwen3/ (or their .tar.gz archives, unpacked here). The document gives,
per model shape and cache size, measured and simulated TTFT and TPOT, the error, the share of identical
decisions and each system's rank by TPOT and TTFT in both executors, and the host time the real run measured
per MoE layer between the end of the attention and the first expert (plan() among it), which the simulator does
not charge; then the targets reached and the time breakdown of the largest error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tarfile
from pathlib import Path

import yaml

#: systems whose decisions do not read the clock: their decision logs must be identical
TIMING_INDEPENDENT = ("cpu-only", "gpu-only-lru", "static-hot")
TARGET_PCT = 10.0


def unpack(out: Path) -> None:
    for archive in sorted(out.glob("*.tar.gz")):  # a step split over calls comes as several archives
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")


def runs(out: Path) -> list[tuple[str, dict, Path]]:
    """(shape step, shape.json, validate folder) of every validate run, in order."""
    found = []
    order = {"v2lite": 0, "qwen3": 1}
    for shape_file in sorted(out.glob("*/shape.json"), key=lambda p: (order.get(p.parent.name, 2), p.parent.name)):
        shape = json.loads(shape_file.read_text())
        for folder in sorted(shape_file.parent.glob("slots-*"), key=lambda p: int(p.name.split("-")[1])):
            if (folder / "validation.json").exists():
                found.append((shape_file.parent.name, shape, folder))
    return found


def missing_runs(out: Path) -> list[str]:
    """"STEP at K slots" for each cache size of a shape that has no results (a deadline left it out)."""
    missing = []
    for shape_file in sorted(out.glob("*/shape.json")):
        shape = json.loads(shape_file.read_text())
        for slots in shape["slots"]:
            if not (shape_file.parent / f"slots-{slots}" / "validation.json").exists():
                missing.append(f"{shape_file.parent.name} at {slots} slots")
    return missing


def _ranking(rank: dict, metric: str) -> str:
    """"same", or "DIFFERENT" with each swapped pair's gap measured and simulated (a near tie or a wrong answer)."""
    if rank[f"same_{metric}"]:
        return "same"
    swaps = rank.get(f"swapped_{metric}", [])
    if not swaps and rank.get(f"text_{metric}"):  # no pair swapped: a tie in one of them, named there
        return rank[f"text_{metric}"]
    return "DIFFERENT" + "".join(
        f"; {p['real_faster']} vs {p['sim_faster']}: {p['real_gap_pct']:.1f}% faster measured, "
        f"{p['sim_gap_pct']:.1f}% slower simulated" for p in swaps)


def _ms(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.2f}"


def _pct(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.1f}%"


HOST_TIME_TEXT = ("Host time, measured only: per MoE layer of the decode steps, from the end of its attention and "
                  "gate to the launch of its first expert, the host retires landed copies, builds the layer view, "
                  "plans (plan(), its own column) and launches the copies the plan queues (host clock, mean over "
                  "the layers, a plan's declared overhead left out); per decode step, that time times the MoE "
                  "layers run, and its share of the measured TPOT. The simulator does not charge this time: it "
                  "plans in zero time.")


def _us(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f}"


def host_time_table(report: dict) -> list[str]:
    """Per system, the real run's host time between a layer's attention and its first expert (none in a
    report written before the backend measured it)."""
    measured = {name: entry["host_time"] for name, entry in report["systems"].items() if entry.get("host_time")}
    if not measured:
        return []
    layers = sorted({h["moe_layers_per_step"] for h in measured.values()})
    header = (f"| system | host µs per MoE layer | plan() µs per MoE layer | host ms per decode step "
              f"(x {', '.join(map(str, layers))} MoE layers) | share of measured TPOT |")
    lines = [HOST_TIME_TEXT, "", header, "|---|---:|---:|---:|---:|"]
    for name, host in measured.items():
        share = host.get("decode_host_share_of_tpot")
        lines.append(f"| {name} | {_us(host['decode_host_us_per_layer'])} | {_us(host['decode_plan_us_per_layer'])} "
                     f"| {_ms(host.get('decode_host_ms_per_step'))} | {'-' if share is None else f'{share:.1%}'} |")
    return lines + [""]


def render(out: Path) -> str:
    unpack(out)
    # measured-<GPU>.yaml, named after the GPU the driver ran on (measured-h100.yaml before there was a choice)
    measured = sorted((out / "profile").glob("measured-*.yaml"))
    profile_path = measured[0] if measured else out / "profile" / "measured-h100.yaml"
    profile = yaml.safe_load(profile_path.read_text()) if profile_path.exists() else {}
    found = runs(out)
    if not found:
        raise SystemExit(f"no validate results under {out} (expected */shape.json and */slots-N/validation.json)")
    lines = ["# Validation on a real GPU: simulator vs measured", "",
             f"- machine and profile: {profile.get('description', '(profile not found)')}",
             f"- profile: `hwprofiles/{profile_path.name}` (copied from `{profile_path.relative_to(out)}`)",
             "- the simulator is not tuned to these runs: every number of the profile comes from micro-measurements "
             "(`moesim profile`, taken before the runs); the end-to-end runs below only read it.",
             "- error: (simulated - measured) / measured; identical decisions: rows of the two decision logs that "
             "match within each (step, layer), over the longer log; rank: 1 = fastest.", ""]
    worst: tuple[float, str, str, dict] | None = None
    errors, identical, rankings = [], [], []
    for step, shape, folder in found:
        report = json.loads((folder / "validation.json").read_text())
        slots = folder.name.split("-")[1]
        title = f"{shape['preset']}, {shape['layers_run']} MoE layers, {slots} cache slots per layer"
        lines += [f"## {title}", "", f"- command: `{report['command']}`", ""]
        rank = report["ranking"]
        pos = {k: {s: i + 1 for i, s in enumerate(rank[k])} for k in ("tpot_real", "tpot_sim", "ttft_real",
                                                                       "ttft_sim")}
        lines += ["| system | TTFT measured ms | TTFT simulated ms | TTFT error | TPOT measured ms | "
                  "TPOT simulated ms | TPOT error | identical decisions | TPOT rank measured / simulated | "
                  "TTFT rank measured / simulated |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, entry in report["systems"].items():
            real, sim, dec = entry["real"], entry["sim"], entry["decisions"]
            lines.append(f"| {name} | {_ms(real['ttft_ms'])} | {_ms(sim['ttft_ms'])} | {_pct(entry['ttft_error_pct'])} "
                         f"| {_ms(real['tpot_ms_mean'])} | {_ms(sim['tpot_ms_mean'])} | "
                         f"{_pct(entry['tpot_error_pct'])} | {dec['share']:.1%}{' (all)' if dec['identical'] else ''} "
                         f"| {pos['tpot_real'][name]} / {pos['tpot_sim'][name]} | "
                         f"{pos['ttft_real'][name]} / {pos['ttft_sim'][name]} |")
            for metric in ("ttft_error_pct", "tpot_error_pct"):
                value = entry[metric]
                if value is not None and not math.isnan(value):
                    errors.append(abs(value))
                    if worst is None or abs(value) > abs(worst[0]):
                        worst = (value, f"{name} on {title}", metric.split("_")[0].upper(), entry)
            if name in TIMING_INDEPENDENT:
                identical.append(dec["identical"])
        rankings += [rank["same_tpot"], rank["same_ttft"]]
        lines += ["", f"- ranking by TPOT: {_ranking(rank, 'tpot')}", f"- ranking by TTFT: {_ranking(rank, 'ttft')}",
                  ""]
        lines += host_time_table(report)
    within = sum(e <= TARGET_PCT for e in errors)
    lines += ["## Targets", "",
              f"- |error| <= {TARGET_PCT:.0f}%: {within} of {len(errors)} TTFT and TPOT figures "
              f"(largest {max(errors):.1f}%)" if errors else "- no errors computed",
              f"- identical decision logs for timing-independent systems ({', '.join(TIMING_INDEPENDENT)}): "
              f"{sum(identical)} of {len(identical)} runs",
              f"- same ranking in both executors: {sum(rankings)} of {len(rankings)} (TPOT and TTFT per run)"]
    missing = missing_runs(out)
    if missing:
        lines.append(f"- not run (left out for the time limit): {', '.join(missing)}")
    lines.append("")
    if worst is not None:
        value, where, metric, entry = worst
        lines += [f"## Where the largest error comes from: {metric} of {where} ({value:+.1f}%)", "",
                  "Time per category over the whole run (ms, summed over steps and layers), measured vs simulated:",
                  "", "| category | measured ms | simulated ms | simulated - measured |", "|---|---:|---:|---:|"]
        real_b, sim_b = entry["real"].get("breakdown_ms", {}), entry["sim"].get("breakdown_ms", {})
        for key in sorted(set(real_b) | set(sim_b), key=lambda k: -abs(sim_b.get(k, 0) - real_b.get(k, 0))):
            r, s = real_b.get(key, 0.0), sim_b.get(key, 0.0)
            lines.append(f"| {key} | {r:,.2f} | {s:,.2f} | {s - r:+,.2f} |")
        lines += ["", "| counter | measured | simulated |", "|---|---:|---:|"]
        for key in ("gpu_hit_rate", "demand_loads", "prefetches", "evictions", "streamed_experts", "cpu_util",
                    "gpu_util", "pcie_util", "makespan_s"):
            r, s = entry["real"].get(key), entry["sim"].get(key)
            lines.append(f"| {key} | {_ms(r) if isinstance(r, float) else r} | "
                         f"{_ms(s) if isinstance(s, float) else s} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default: print)")
    args = parser.parse_args(argv)
    text = render(args.out_dir)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
