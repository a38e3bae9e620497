"""Fit the scorecard's free numbers to the catalogue's calibration rows and write them to calibration.yaml.

Each testbed profile may fit at most two numbers, each to one row of the claims catalogue marked
``calibration`` (a named table or figure of its paper); those rows are excluded from the strict count
and every other row stays held out (docs/reproduction.md, "Calibration"). The fits, in order:

1. ``001-s64-decode-cuda-graph`` (001 Sec. 6.4, Fig. 14b: one CUDA Graph over the decode step gives up to
   1.23x) fits KTransformers' non-expert GPU kernels per layer (``runtimes.ktransformers.kernels_per_layer``
   and its graph-less twin ``ktransformers-eager``): a count of the software's kernels, set on every
   profile that runs it (a100-40g, rtx4080, rtx4090, rtx3090);
2. ``001-s42-cpu-util-no-ed`` (001 Sec. 4.2, Fig. 10: CPU utilisation 74% in a DS-3 BF16 decode layer)
   fits the A100's achievable memory-bandwidth fraction (``a100-40g gpu.bandwidth_efficiency``): the CPU
   side is already Intel MLC's measured bandwidth, so the share is set by how long the GPU's attention
   and shared expert take;
3. ``000-t1-ds3-mean-ktransformers-tps`` and ``000-t1-qwen3-mean-ktransformers-tps`` (000 Table I, the
   means of KTransformers' decode tokens/s) fit, together, the 10 EPYC cores' achievable share of their
   DRAM bandwidth for expert weights (``rtx4090 cpu.bandwidth_efficiency``) and the fixed cost of a layer
   that hands experts to the CPU (``rtx4090 sync.per_layer_us``): KTransformers computes every routed
   expert on the CPU, and DeepSeek-V3's large experts weigh the first, Qwen3's 94 layers the second.

Each fit replays exactly the setting its row's seed script replays (``calibration_figures`` of
seed_000.py and seed_001.py, through ``common.TRIAL``) and solves moesim's figure = the paper's by
Newton's method on the logarithms (a finite-difference Jacobian; an integer number by rounding and
checking its neighbours). Fits that share no number are solved in turn, the earlier ones held fixed;
the loop repeats until no number moves.

    .venv/bin/python benchmarks/reproduce/calibrate.py            # fit, print, write calibration.yaml
    .venv/bin/python benchmarks/reproduce/calibrate.py --check    # print the residuals of the file's numbers

A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
from catalogue import load_catalogue  # noqa: E402

KTRANSFORMERS_PROFILES = ("a100-40g", "rtx4080", "rtx4090", "rtx3090")


@dataclass(frozen=True)
class FreeNumber:
    """One fitted number: the profile fields it sets, the calibration row it is fitted to, its search range."""

    claim: str
    profiles: tuple[str, ...]
    fields: tuple[str, ...]
    start: float
    low: float
    high: float
    source: str
    integer: bool = False


#: the fits, in the order they are solved; numbers sharing a ``group`` are solved together
FITS: tuple[tuple[FreeNumber, ...], ...] = (
    (FreeNumber("001-s64-decode-cuda-graph", KTRANSFORMERS_PROFILES,
                ("runtimes.ktransformers.kernels_per_layer", "runtimes.ktransformers-eager.kernels_per_layer"),
                24, 1, 400, "fitted to 001_66a328d79a3cae8d.txt Sec. 6.4 (Fig. 14b): one CUDA Graph over the decode "
                "step gives up to 1.23x on DS-3, DS-2, QW-2 BF16 (benchmarks/reproduce/calibrate.py)", integer=True),),
    (FreeNumber("001-s42-cpu-util-no-ed", ("a100-40g",), ("gpu.bandwidth_efficiency",), 0.871, 0.05, 1.0,
                "fitted to 001_66a328d79a3cae8d.txt Sec. 4.2 (Fig. 10): CPU utilisation 74% of a DS-3 BF16 decode "
                "layer without Expert Deferral (benchmarks/reproduce/calibrate.py)"),),
    (FreeNumber("000-t1-ds3-mean-ktransformers-tps", ("rtx4090",), ("cpu.bandwidth_efficiency",), 0.716, 0.05, 1.0,
                "fitted to 000_dba2fecbbc66318b.txt Table I: KTransformers' mean decode rate on DeepSeek-V3, "
                "3.163 tokens/s, with sync.per_layer_us (benchmarks/reproduce/calibrate.py)"),
     FreeNumber("000-t1-qwen3-mean-ktransformers-tps", ("rtx4090",), ("sync.per_layer_us",), 12.0, 0.1, 20000.0,
                "fitted to 000_dba2fecbbc66318b.txt Table I: KTransformers' mean decode rate on Qwen3-235B-A22B, "
                "2.916 tokens/s, with cpu.bandwidth_efficiency (benchmarks/reproduce/calibrate.py)")),
)


_SEEDS: dict[str, object] = {}


def load_seed(number: str):
    if number in _SEEDS:
        return _SEEDS[number]
    path = HERE / f"seed_{number}.py"
    spec = importlib.util.spec_from_file_location(f"calibrate_seed_{number}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _SEEDS[number] = module
    return module


def figures(claim_ids: list[str]) -> dict[str, float]:
    """moesim's figures for calibration rows under the numbers ``common.TRIAL`` holds now."""
    out: dict[str, float] = {}
    for number in sorted({c.split("-")[0] for c in claim_ids}):
        out.update(load_seed(number).calibration_figures(claim_ids))
    return out


def trial(values: dict[FreeNumber, float]) -> dict[str, dict[str, float]]:
    """``common.TRIAL`` for ``values``: each profile's fields set to its numbers."""
    out: dict[str, dict[str, float]] = {}
    for number, value in values.items():
        for profile in number.profiles:
            for name in number.fields:
                out.setdefault(profile, {})[name] = int(round(value)) if number.integer else float(value)
    return out


def newton(residual: Callable[[np.ndarray], np.ndarray], start: np.ndarray, low: np.ndarray, high: np.ndarray,
           *, tolerance: float = 2e-3, steps: int = 12, probe: float = 0.05) -> np.ndarray:
    """Solve ``residual(x) = 0`` for x within [low, high], Newton's method on log x with a finite-difference
    Jacobian (``probe``: relative step); a step that does not reduce the residual is halved."""
    y = np.log(start)
    lo, hi = np.log(low), np.log(high)
    r = residual(np.exp(y))
    for _ in range(steps):
        if np.max(np.abs(r)) <= tolerance:
            break
        jacobian = np.empty((len(y), len(y)))
        for j in range(len(y)):
            shifted = y.copy()
            shifted[j] += math.log1p(probe)
            jacobian[:, j] = (residual(np.exp(shifted)) - r) / math.log1p(probe)
        step = np.linalg.lstsq(jacobian, -r, rcond=None)[0]
        for _ in range(6):
            candidate = np.clip(y + step, lo, hi)
            r_new = residual(np.exp(candidate))
            if np.linalg.norm(r_new) < np.linalg.norm(r):
                break
            step /= 2
        else:
            break
        y, r = candidate, r_new
    return np.exp(y)


def solve_integer(residual: Callable[[float], float], start: float, low: float, high: float) -> int:
    """The integer in [low, high] whose residual is smallest in size: Newton on the continuous value (the
    residual read at the rounded one, so a probe of at least one unit), then the neighbours checked."""
    x = float(start)
    for _ in range(8):
        r = residual(x)
        slope = (residual(x + max(1.0, 0.1 * x)) - r) / max(1.0, 0.1 * x)
        if slope == 0 or abs(r) < 1e-9:
            break
        new = min(max(x - r / slope, low), high)
        if round(new) == round(x):
            break
        x = new
    best = int(round(x))
    candidates = [k for k in (best - 1, best, best + 1) if low <= k <= high]
    return min(candidates, key=lambda k: abs(residual(k)))


def fit(paper: dict[str, float], values: dict[FreeNumber, float], group: tuple[FreeNumber, ...],
        log: Callable[[str], None]) -> None:
    """Solve ``group``'s numbers (the others held at ``values``) so that moesim's figures equal the paper's."""
    ids = [n.claim for n in group]

    def residual_of(x: np.ndarray) -> np.ndarray:
        common.TRIAL = trial({**values, **dict(zip(group, x))})
        got = figures(ids)
        log("  " + ", ".join(f"{n.fields[0]}={v:.6g}" for n, v in zip(group, x)) + " -> "
            + ", ".join(f"{i} {got[i]:.4g} (paper {paper[i]:.4g})" for i in ids))
        return np.array([math.log(got[i] / paper[i]) for i in ids])

    if len(group) == 1 and group[0].integer:
        number = group[0]
        values[number] = solve_integer(lambda k: float(residual_of(np.array([round(k)]))[0]), values[number],
                                       number.low, number.high)
        return
    x = newton(residual_of, np.array([values[n] for n in group]), np.array([n.low for n in group]),
               np.array([n.high for n in group]))
    values.update(dict(zip(group, x)))


def calibrate(log: Callable[[str], None] = print, rounds: int = 3) -> dict[FreeNumber, float]:
    """Every fit of ``FITS`` solved in turn, repeated until no number moves (at most ``rounds`` times)."""
    claims = {c.id: c for c in load_catalogue()}
    paper = {n.claim: claims[n.claim].paper_figure for group in FITS for n in group}
    values = {n: float(n.start) for group in FITS for n in group}
    for round_ in range(rounds):
        before = dict(values)
        for group in FITS:
            log(f"round {round_ + 1}: fitting {', '.join(n.claim for n in group)}")
            fit(paper, values, group, log)
        if all(math.isclose(values[n], before[n], rel_tol=5e-3) for n in values):
            break
    common.TRIAL = None
    return values


def record(values: dict[FreeNumber, float]) -> dict:
    """calibration.yaml's content for ``values``."""
    fits = []
    for group in FITS:
        for number in group:
            value = values[number]
            fits.append({"claim": number.claim, "profiles": list(number.profiles), "fields": list(number.fields),
                         "value": int(round(value)) if number.integer else float(f"{value:.4g}"),
                         "source": number.source})
    return {"fits": fits}


def check(log: Callable[[str], None] = print) -> int:
    """Print moesim's figure for every calibration row under the file's numbers; 1 when one is off by > 2%."""
    claims = {c.id: c for c in load_catalogue()}
    fits = common.fitted_numbers()
    got = figures([f["claim"] for f in fits])
    worst = 0.0
    for f in fits:
        paper = claims[f["claim"]].paper_figure
        worst = max(worst, abs(math.log(got[f["claim"]] / paper)))
        log(f"{f['claim']}: {', '.join(f['fields'])} = {f['value']} on {', '.join(f['profiles'])}: "
            f"moesim {got[f['claim']]:.4g}, paper {paper:.4g}")
    return 0 if worst <= math.log(1.02) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only print the residuals of calibration.yaml")
    parser.add_argument("--out", type=Path, default=common.CALIBRATION, help="where to write the fitted numbers")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    start = time.perf_counter()
    values = calibrate()
    content = record(values)
    header = ("# Written by benchmarks/reproduce/calibrate.py (do not edit by hand): the scorecard's fitted\n"
              "# numbers, each fitted to the catalogue row `claim` and set on `profiles` (docs/reproduction.md).\n")
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(header + yaml.safe_dump(content, sort_keys=False, width=120))
    tmp.replace(args.out)
    for f in content["fits"]:
        print(f"{f['claim']}: {', '.join(f['fields'])} = {f['value']} on {', '.join(f['profiles'])}")
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
