"""Does a policy comparison on a synthetic trace agree with the same comparison on a real one?

For each (calibration C, validation V) pair of real traces of one model:

1. fit the generator to C (``moesim trace synth --fit C`` semantics: :func:`moesim.trace.synth.fit_params`);
2. synthesize ``fitted``: V's request lengths and decode batch (workload shape, not a fitted parameter: they
   are what a user would ask for, and a policy's TPOT depends on them) with C's fitted routing statistics;
3. synthesize ``default``: the same lengths with the generator's defaults for the model (no fit);
4. replay every system on V, on both synthetic traces (``--seeds`` draws each, averaged) and on C itself
   (a control: another real workload of the same model, with its own lengths), on each ``--hw`` profile;
5. report per system TPOT mean, GPU hit rate and PCIe GiB, each stand-in's relative error against V, and per
   profile the Spearman and Kendall (tau-b) rank correlations of the systems' latency order with V's and the
   pairs of systems whose order flips, with the size of both gaps.

The synthetic traces carry the optional columns V has and no others (a real router log has no predictor
columns and often no ``scores``): a system then falls back on the same stand-ins on all of them. A request
V logged without a prompt gets a 1-token prompt (the generator's shortest; ``filled_prompts``). The latency
ranked is ``tpot_ms_mean``, or ``ttft_ms`` for a prefill-only V (``--metric`` chooses).

``--vary PARAM=V1,V2,...`` instead replays ``--systems`` on fitted traces with one generator parameter set to
each value in turn (nothing else changes), to find which statistic drives a disagreement; it reports each
value's trace statistics beside V's, the systems' latency and the rank correlation with V.
Nothing here fits or chooses anything on V: V is only replayed and compared against.

    .venv/bin/python benchmarks/synth_fidelity.py --out fid.json --markdown fid.md
    .venv/bin/python benchmarks/synth_fidelity.py --systems gpu-only-lru,static-hot --vary token_corr=0.1,0.5,0.9
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "real-traces"
DEFAULT_PAIRS = [
    (REPO / "traces" / "mixtral-8x7b-humaneval.parquet", REAL / "speculative-moe" / "gsm8k_2_routing.jsonl"),
    (REPO / "traces" / "qwen3-30b-a3b-prefill.parquet",
     REAL / "soryxie-vllm-qwen3-30b-a3b" / "token_distri_16.jsonl"),
]
DEFAULT_HW = ["hwprofiles/rtx4090.yaml", "hwprofiles/a100-40g.yaml"]
#: as benchmarks/replay_speed.py: int4 weights, used only for a model whose bf16 weights leave no expert slot
INT4_SETTINGS = {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}
#: stand-ins for V, in table order
KINDS = ("fitted", "default", "calibration")
FIGURES = ("tpot_ms_mean", "ttft_ms", "gpu_hit_rate", "pcie_gib")
#: trace statistics shown beside each trace (those the fit targets, and the trace's size)
STATS = ("top10_share", "reuse_prev_token", "coactivation_top4_share", "weight_top1_share", "prefill_coverage")
#: the same, and the distinct experts a prefill step routes to per layer (its batch union), in the tables
SHOWN = STATS + ("distinct_prefill",)
#: a gap smaller than this (relative) counts as a tie when looking for flipped pairs
TIE = 1e-6
#: pairs of systems whose latencies on V differ by at most this (relative) are "close"
CLOSE = 0.10
#: a system whose latency spreads less than this (relative) over every synthetic draw, fitted and default,
#: is taken as insensitive to routing (a fixed placement: cpu-only, llama.cpp's layers, every expert resident);
#: judged on the synthetic traces only, never on V
SENSITIVE_SPREAD = 0.005


# ----------------------------------------------------------------------------- rank statistics
def average_ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (as scipy.stats.rankdata's default)."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    sorted_x = x[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + end + 1) / 2  # mean of ranks start+1 .. end
            start = end
    return ranks


def spearman_numpy(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson correlation of the average ranks."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denom) if denom else float("nan")


def kendall_numpy(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either list left out of the numerator and corrected for in the denominator)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    i, j = np.triu_indices(len(x), 1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    concordance = float((dx * dy).sum())
    denom = float(np.sqrt(np.count_nonzero(dx) * np.count_nonzero(dy)))
    return concordance / denom if denom else float("nan")


def rank_method() -> str:
    try:
        import scipy.stats  # noqa: F401
        return "scipy"
    except ImportError:
        return "numpy"


def rank_correlations(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Spearman and Kendall tau-b of two lists of one metric over the same systems (scipy when installed)."""
    if len(a) < 2:
        return {"spearman": float("nan"), "kendall": float("nan")}
    if rank_method() == "scipy":
        from scipy.stats import kendalltau, spearmanr
        return {"spearman": float(spearmanr(a, b)[0]), "kendall": float(kendalltau(a, b)[0])}
    return {"spearman": spearman_numpy(a, b), "kendall": kendall_numpy(a, b)}


def gap(a: float, b: float) -> float:
    """How much slower ``b`` is than ``a``, relative to the faster of the two (negative: ``b`` is faster)."""
    low = min(abs(a), abs(b))
    return (b - a) / low if low else float("inf") if b != a else 0.0


def order_flips(names: Sequence[str], real: Sequence[float], other: Sequence[float]) -> list[dict[str, Any]]:
    """Pairs of systems that ``other`` orders the opposite way from ``real`` (a tie on either side is no
    flip), each with its gap on both sides, the pair with the largest real gap first. ``first`` is the faster
    system on the real trace; ``real_gap`` how much slower ``second`` is there, ``other_gap`` on ``other``."""
    flips = []
    for i, j in itertools.combinations(range(len(names)), 2):
        fast, slow = (i, j) if real[i] <= real[j] else (j, i)
        real_gap, other_gap = gap(real[fast], real[slow]), gap(other[fast], other[slow])
        if real_gap > TIE and other_gap < -TIE:
            flips.append({"first": names[fast], "second": names[slow], "real_gap": real_gap,
                          "other_gap": other_gap})
    return sorted(flips, key=lambda f: -f["real_gap"])


def relative_error(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / abs(reference)


# ----------------------------------------------------------------------------- traces
def load_validation(path: Path, folder: Path) -> Path:
    """V as a trace: a Parquet file as it is; another tool's log imported into ``folder`` first."""
    if path.suffix == ".parquet":
        return path
    from moesim.trace.importers import import_trace
    out = folder / (path.stem + ".parquet")
    import_trace(None, [path], out)
    return out


def trace_columns(path: Path) -> set[str]:
    from moesim.trace.io import _open
    return set(_open(path).schema_arrow.names)


@dataclasses.dataclass
class Shape:
    """The workload shape of V that a synthetic stand-in copies: model, per-request lengths, decode batch."""

    model: Any
    prompt_lens: list[int]
    decode_lens: list[int]
    batch: int
    scores: bool
    predictors: bool

    @classmethod
    def of(cls, path: Path) -> "Shape":
        from moesim.trace.io import read_meta
        from moesim.trace.stats import trace_stats
        from moesim.trace.synth import filled_prompts, request_lengths, trace_shape
        prompts, decodes = request_lengths(path)
        columns = trace_columns(path)
        return cls(model=read_meta(path).model, prompt_lens=filled_prompts(prompts), decode_lens=decodes,
                   batch=trace_shape(trace_stats(path, validate=False))["batch"], scores="scores" in columns,
                   predictors=bool(columns & {"pred_next_layer", "pred_residual", "pred_next_token"}))

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.name, "prompt_lens": self.prompt_lens, "decode_lens": self.decode_lens,
                "batch": self.batch, "scores": self.scores, "predictors": self.predictors}


def synthesize_like(shape: Shape, params: Any, seed: int, out: Path) -> Path:
    """A synthetic trace of ``shape`` with routing parameters ``params`` and V's optional columns."""
    from moesim.trace.synth import SynthConfig, synthesize
    params = dataclasses.replace(params, predictors=shape.predictors)
    config = SynthConfig(model=shape.model, requests=len(shape.prompt_lens), batch=shape.batch, seed=seed,
                         scores=shape.scores, params=params, prompt_lens=shape.prompt_lens,
                         decode_lens=shape.decode_lens)
    return synthesize(config, out)


def statistics(path: Path) -> dict[str, Any]:
    from moesim.trace.stats import trace_stats
    stats = trace_stats(path, validate=False)
    distinct = stats.get("unique_experts_per_layer_step") or {}
    return {key: stats.get(key) for key in STATS} | {"tokens": stats["tokens"],
                                                     "distinct_prefill": distinct.get("prefill"),
                                                     "distinct_decode": distinct.get("decode")}


# ----------------------------------------------------------------------------- replays
def memory_settings(trace: Path, hw: str) -> dict[str, str]:
    """No settings when the model's bf16 weights leave expert slots on ``hw``; else int4 weights."""
    from moesim.errors import MoesimError
    from moesim.sim.run import prepare
    try:
        prepare(str(trace), hw, "gpu-only-lru", {})
        return {}
    except MoesimError:
        return dict(INT4_SETTINGS)


def _finite(value: Any) -> float | None:
    """A metric as a float, None where it does not apply (a TPOT without decode steps comes back as nan)."""
    return None if value is None or not np.isfinite(value) else float(value)


def figures(m: dict[str, Any]) -> dict[str, Any]:
    return {"tpot_ms_mean": _finite(m.get("tpot_ms_mean")), "ttft_ms": _finite(m.get("ttft_ms")),
            "gpu_hit_rate": _finite(m.get("gpu_hit_rate")), "pcie_gib": (m.get("pcie_h2d_bytes") or 0) / 2**30}


def replay_systems(trace: Path, hw: str, systems: Sequence[str], settings: dict[str, str],
                   progress: Any = None) -> dict[str, dict[str, Any]]:
    """Each system's figures on ``trace`` (a portfolio bound last, reusing the others' runs, as ``moesim
    replay --system all``); a system that cannot run on the trace (a column it lacks) gets ``skipped``."""
    from moesim.analysis.metrics import metrics
    from moesim.errors import ConfigError
    from moesim.policy.systems import SYSTEMS
    from moesim.sim.run import columns_read, simulate
    from moesim.trace.io import keeping_decoded
    runs: dict = {}
    out: dict[str, dict[str, Any]] = {}
    columns = set().union(*(columns_read(name, settings) for name in systems))
    with keeping_decoded(columns):  # the trace decoded once for every system
        for name in sorted(systems, key=lambda n: bool(n in SYSTEMS and SYSTEMS[n].portfolio)):
            if progress is not None:
                progress(name)
            try:
                result = simulate(str(trace), hw, name, settings, reuse=runs, timeline=False, decisions=False)
            except ConfigError as err:
                if err.field in ("--system", "--set", "--model"):
                    raise
                out[name] = {"skipped": str(err)}
                continue
            runs[name] = result
            out[name] = figures(metrics(result))
    return {name: out[name] for name in systems}


def mean_figures(draws: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system, each figure's mean over the seeds' draws (skipped if skipped on any draw)."""
    out: dict[str, dict[str, Any]] = {}
    for name in draws[0]:
        rows = [d[name] for d in draws]
        if any("skipped" in r for r in rows):
            out[name] = next(r for r in rows if "skipped" in r)
            continue
        out[name] = {key: (float(np.mean([r[key] for r in rows])) if all(r[key] is not None for r in rows) else None)
                     for key in FIGURES}
    return out


# ----------------------------------------------------------------------------- comparison
def choose_metric(requested: str, validation: dict[str, dict[str, Any]]) -> str:
    if requested != "auto":
        return requested
    ran = [r for r in validation.values() if "skipped" not in r]
    return "tpot_ms_mean" if ran and all(r["tpot_ms_mean"] is not None for r in ran) else "ttft_ms"


def compare(metric: str, validation: dict, stand_in: dict, per_seed: list[dict] | None = None,
            sensitive: Iterable[str] | None = None) -> dict[str, Any]:
    """A stand-in's agreement with V: relative errors per system and figure, rank correlations of ``metric``
    over the systems both ran (per seed too, when given; and over the ``sensitive`` ones alone), the flipped
    pairs, and how many pairs V separates by at most :data:`CLOSE` (ties left out) and how many of those flip."""
    names = [n for n in validation if "skipped" not in validation[n] and "skipped" not in stand_in.get(n, {"skipped": 1})
             and validation[n][metric] is not None and stand_in[n][metric] is not None]
    real = [validation[n][metric] for n in names]
    other = [stand_in[n][metric] for n in names]
    errors = {n: {key: relative_error(stand_in[n][key], validation[n][key]) for key in FIGURES} for n in names}
    out = {"systems": names, "relative_error": errors, **rank_correlations(real, other),
           "flips": order_flips(names, real, other)}
    if sensitive is not None:  # the same over the systems whose latency the routing moves
        picked = [i for i, n in enumerate(names) if n in sensitive]
        out["sensitive"] = rank_correlations([real[i] for i in picked], [other[i] for i in picked])
    close = [(i, j) for i, j in itertools.combinations(range(len(names)), 2)
             if TIE < abs(gap(real[i], real[j])) <= CLOSE]  # a tie on V cannot flip
    flipped = {(f["first"], f["second"]) for f in out["flips"]} | {(f["second"], f["first"]) for f in out["flips"]}
    out["close_pairs"] = len(close)
    out["close_pairs_flipped"] = sum((names[i], names[j]) in flipped for i, j in close)
    errs = [abs(e[metric]) for e in errors.values() if e[metric] is not None]
    out["median_abs_error"] = float(np.median(errs)) if errs else None
    if per_seed:
        seeds = [rank_correlations(real, [d[n][metric] for n in names]) for d in per_seed]
        out["per_seed"] = seeds
    return out


def fit_calibration(calibration: Path) -> Any:
    from moesim.trace.synth import fit_params
    return fit_params(calibration)


def run_pair(calibration: Path, validation: Path, hws: Sequence[str], systems: Sequence[str] | None,
             seeds: Sequence[int], metric: str, folder: Path, bar: Any) -> dict[str, Any]:
    """Every replay of one (C, V) pair and its comparison."""
    from moesim.trace.synth import SynthParams
    shape = Shape.of(validation)
    bar.advance(0, label=f"fitting to {calibration.name}")
    fit = fit_calibration(calibration)
    defaults = SynthParams.for_model(shape.model)
    traces: dict[str, list[Path]] = {"fitted": [], "default": []}
    for seed in seeds:
        traces["fitted"].append(synthesize_like(shape, fit.params, seed, folder / f"fitted-{seed}.parquet"))
        traces["default"].append(synthesize_like(shape, defaults, seed, folder / f"default-{seed}.parquet"))
    names = list(systems) if systems else catalogue()
    pair: dict[str, Any] = {
        "calibration": str(calibration), "validation": str(validation), "shape": shape.describe(),
        "fit": {"params": dataclasses.asdict(fit.params), "target": fit.target, "fitted": fit.fitted,
                "notes": fit.notes},
        "default_params": dataclasses.asdict(defaults),
        "trace_stats": {"validation": statistics(validation), "calibration": statistics(calibration),
                        "fitted": statistics(traces["fitted"][0]), "default": statistics(traces["default"][0])},
        "profiles": {}}
    for hw in hws:
        settings = memory_settings(validation, hw)

        def replay(trace: Path, label: str) -> dict[str, dict[str, Any]]:
            return replay_systems(trace, hw, names, settings,
                                  lambda s: bar.advance(1, label=f"{Path(hw).stem} {label} {s}"))

        real = replay(validation, "validation")
        draws = {kind: [replay(t, f"{kind}-{i}") for i, t in enumerate(traces[kind])] for kind in traces}
        control = replay(calibration, "calibration")
        chosen = choose_metric(metric, real)
        # a system skipped on any trace is left out everywhere: the orders compare the same systems
        ran = [n for n in names if all("skipped" not in r.get(n, {}) for r in [real, control, *draws["fitted"],
                                                                                 *draws["default"]])]
        stand_ins = {"fitted": mean_figures(draws["fitted"]), "default": mean_figures(draws["default"]),
                     "calibration": control}
        keep = lambda table: {n: table[n] for n in ran}  # noqa: E731
        sensitive = routing_sensitive(chosen, ran, draws["fitted"] + draws["default"])
        pair["profiles"][Path(hw).stem] = {
            "hw": hw, "settings": settings, "metric": chosen,
            "skipped": {n: real[n].get("skipped") or "skipped on a stand-in" for n in names if n not in ran},
            "systems": {n: {"validation": real[n], **{k: stand_ins[k][n] for k in KINDS}} for n in ran},
            "routing_sensitive": sensitive,
            "compare": {k: compare(chosen, keep(real), keep(stand_ins[k]),
                                   [keep(d) for d in draws[k]] if k in draws else None, sensitive) for k in KINDS}}
    return pair


def routing_sensitive(metric: str, names: Sequence[str], draws: list[dict[str, dict[str, Any]]]) -> list[str]:
    """The systems whose ``metric`` moves with the routing: spread over the synthetic draws above
    :data:`SENSITIVE_SPREAD` of its smallest value."""
    out = []
    for name in names:
        values = [d[name][metric] for d in draws if d[name].get(metric) is not None]
        if values and (max(values) - min(values)) > SENSITIVE_SPREAD * min(values):
            out.append(name)
    return out


def catalogue() -> list[str]:
    from moesim.policy.systems import system_names
    return system_names()


def replays_of(pairs: int, hws: int, systems: int, seeds: int) -> int:
    return pairs * hws * systems * (2 + 2 * seeds)


# ----------------------------------------------------------------------------- one-parameter study
def vary_study(calibration: Path, validation: Path, hw: str, systems: Sequence[str], param: str,
               values: Sequence[float], seeds: Sequence[int], metric: str, folder: Path, bar: Any) -> dict:
    """Fitted traces with ``param`` set to each of ``values`` (the rest as fitted to C): statistics, latency
    per system and agreement with V."""
    from moesim.trace.synth import _with  # the fit's own way of setting "skew" (both ends, in proportion)
    shape = Shape.of(validation)
    fit = fit_calibration(calibration)
    settings = memory_settings(validation, hw)
    progress = lambda s: bar.advance(1, label=f"{param} {s}")  # noqa: E731
    real = replay_systems(validation, hw, systems, settings, progress)
    chosen = choose_metric(metric, real)
    rows = []
    for value in values:
        params = _with(fit.params, param, value, fit.params) if param == "skew" else \
            dataclasses.replace(fit.params, **{param: type(getattr(fit.params, param))(value)})
        paths = [synthesize_like(shape, params, seed, folder / f"vary-{value}-{seed}.parquet") for seed in seeds]
        draws = [replay_systems(p, hw, systems, settings, progress) for p in paths]
        mean = mean_figures(draws)
        rows.append({"value": value, "stats": statistics(paths[0]), "figures": mean,
                     "compare": compare(chosen, real, mean, draws)})
    return {"calibration": str(calibration), "validation": str(validation), "hw": hw, "param": param,
            "fitted_value": getattr(fit.params, param, None) if param != "skew" else fit.params.skew_last,
            "metric": chosen, "validation_figures": real, "validation_stats": statistics(validation), "rows": rows}


# ----------------------------------------------------------------------------- output
def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _rho(c: dict[str, Any]) -> str:
    text = f"{c['spearman']:.2f} / {c['kendall']:.2f}"
    if c.get("per_seed"):
        lows = [min(s[k] for s in c["per_seed"]) for k in ("spearman", "kendall")]
        highs = [max(s[k] for s in c["per_seed"]) for k in ("spearman", "kendall")]
        text += f" (seeds {lows[0]:.2f}-{highs[0]:.2f} / {lows[1]:.2f}-{highs[1]:.2f})"
    return text


def markdown_pair(pair: dict[str, Any]) -> list[str]:
    lines = [f"### {Path(pair['validation']).name} (validation) against {Path(pair['calibration']).name} "
             "(calibration)", ""]
    lines.append("| trace | " + " | ".join(SHOWN) + " |")
    lines.append("|---|" + "---:|" * len(SHOWN))
    for kind, stats in pair["trace_stats"].items():
        lines.append(f"| {kind} | " + " | ".join(_num(stats[k], 3) for k in SHOWN) + " |")
    lines.append("")
    for profile, p in pair["profiles"].items():
        metric, name = p["metric"], "TPOT" if p["metric"] == "tpot_ms_mean" else "TTFT"
        lines += [f"**{profile}**{' (' + ', '.join(f'{k}={v}' for k, v in p['settings'].items()) + ')' if p['settings'] else ''}: "
                  f"{name} ms, GPU hit rate, PCIe GiB on V; each stand-in's {name} and its error against V", "",
                  f"| system | V {name} | V hit | V PCIe | fitted {name} | err | default {name} | err | "
                  f"calibration {name} | err | fitted hit | fitted PCIe |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for system, row in p["systems"].items():
            v, cells = row["validation"], []
            for kind in KINDS:
                cells += [_num(row[kind][metric]), _pct(p["compare"][kind]["relative_error"][system][metric])]
            lines.append(f"| `{system}` | {_num(v[metric])} | {_num(v['gpu_hit_rate'], 3)} | {_num(v['pcie_gib'], 2)} | "
                         + " | ".join(cells) + f" | {_num(row['fitted']['gpu_hit_rate'], 3)} | "
                         f"{_num(row['fitted']['pcie_gib'], 2)} |")
        lines += ["", f"| stand-in | Spearman / Kendall of the {name} order, all | routing-sensitive only "
                      f"({len(p['routing_sensitive'])}) | median abs. error | pairs within {CLOSE:.0%} on V: flipped "
                      "| flipped pairs (faster on V, V gap, stand-in gap) |", "|---|---|---|---:|---:|---|"]
        for kind in KINDS:
            c = p["compare"][kind]
            flips = "; ".join(f"{f['first']} < {f['second']} ({f['real_gap']:+.0%}, {f['other_gap']:+.0%})"
                              for f in c["flips"]) or "none"
            sens = c.get("sensitive", {})
            lines.append(f"| {kind} | {_rho(c)} | {sens.get('spearman', float('nan')):.2f} / "
                         f"{sens.get('kendall', float('nan')):.2f} | "
                         f"{_num(c['median_abs_error'] and 100 * c['median_abs_error'])}% | "
                         f"{c['close_pairs_flipped']} of {c['close_pairs']} | {len(c['flips'])}: {flips} |")
        if p["skipped"]:
            lines.append("")
            lines.append("Left out: " + "; ".join(f"`{n}` ({why.split(':')[-1].strip()[:80]})"
                                                    for n, why in p["skipped"].items()))
        lines.append("")
    return lines


def markdown_vary(study: dict[str, Any]) -> list[str]:
    metric = study["metric"]
    systems = list(study["validation_figures"])
    lines = [f"### {study['param']} varied (fitted: {study['fitted_value']}), {Path(study['validation']).name}, "
             f"{Path(study['hw']).stem}", "",
             "| value | " + " | ".join(SHOWN) + " | " + " | ".join(f"`{s}`" for s in systems) + " | Spearman |",
             "|---|" + "---:|" * (len(SHOWN) + len(systems) + 1)]
    v = study["validation_figures"]
    lines.append("| V (real) | " + " | ".join(_num(study["validation_stats"][k], 3) for k in SHOWN) + " | "
                 + " | ".join(_num(v[s].get(metric)) for s in systems) + " | |")
    for row in study["rows"]:
        lines.append(f"| {row['value']} | " + " | ".join(_num(row['stats'][k], 3) for k in SHOWN) + " | "
                     + " | ".join(_num(row["figures"][s].get(metric)) for s in systems)
                     + f" | {row['compare']['spearman']:.2f} |")
    return lines + [""]


def parse_vary(text: str) -> tuple[str, list[float]]:
    name, _, values = text.partition("=")
    if not values:
        raise SystemExit(f"--vary {text}: give PARAM=V1,V2,...")
    return name.strip(), [float(v) for v in values.split(",")]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", action="append", type=Path, default=None,
                        help="calibration trace (Parquet), the one the generator is fitted to; repeat for several "
                             "pairs, in the order of --validation (default: the Mixtral and Qwen3 pairs)")
    parser.add_argument("--validation", action="append", type=Path, default=None,
                        help="validation trace: Parquet, or a log `moesim trace import` reads (imported to a "
                             "temporary file); only replayed and compared against")
    parser.add_argument("--hw", action="append", default=None,
                        help=f"hardware profile; repeat for several (default: {', '.join(DEFAULT_HW)})")
    parser.add_argument("--systems", default="",
                        help="comma-separated systems (default: every catalogue system that runs on the traces)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the synthetic draws, averaged (default 0,1,2)")
    parser.add_argument("--metric", default="auto", choices=["auto", "tpot_ms_mean", "ttft_ms"],
                        help="latency whose system order is compared (auto: TPOT, or TTFT for a prefill-only V)")
    parser.add_argument("--vary", default=None, metavar="PARAM=V1,V2,...",
                        help="one-parameter study on the first pair and profile instead of the comparison")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown to this file")
    args = parser.parse_args(argv)
    pairs = list(zip(args.calibration, args.validation)) if args.calibration or args.validation else DEFAULT_PAIRS
    if args.calibration and args.validation and len(args.calibration) != len(args.validation):
        parser.error("give one --calibration per --validation")
    hws = args.hw or DEFAULT_HW
    systems = [s for s in args.systems.split(",") if s] or None
    seeds = [int(s) for s in args.seeds.split(",")]
    from moesim.progress import Progress
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "commit": commit(),
                              "rank_method": rank_method(), "seeds": seeds, "hw": hws}
    with tempfile.TemporaryDirectory(prefix="synth-fidelity-") as tmp:
        folder = Path(tmp)
        loaded = [(c, load_validation(v, folder)) for c, v in pairs]
        count = len(systems) if systems else len(catalogue())
        if args.vary:
            param, values = parse_vary(args.vary)
            total = count * (1 + len(values) * len(seeds))
            with Progress("synth fidelity", total=total, unit="replays") as bar:
                report["vary"] = vary_study(*loaded[0], hws[0], systems or catalogue(), param, values, seeds,
                                            args.metric, folder, bar)
            lines = markdown_vary(report["vary"])
        else:
            with Progress("synth fidelity", total=replays_of(len(loaded), len(hws), count, len(seeds)),
                          unit="replays") as bar:
                report["pairs"] = []
                for index, (calibration, validation) in enumerate(loaded):
                    sub = folder / f"pair-{index}"
                    sub.mkdir()
                    report["pairs"].append(run_pair(calibration, validation, hws, systems, seeds, args.metric,
                                                    sub, bar))
            lines = [line for pair in report["pairs"] for line in markdown_pair(pair)]
    text = "\n".join(lines)
    print(text)
    print(f"ranks by {report['rank_method']}; {report['date']} at {report['commit']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
