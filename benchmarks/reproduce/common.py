"""What the seed reproduction scripts share: the testbed profiles with their fitted numbers, cached
synthetic traces, result rows and their table."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

from moesim.hw.profile import HardwareProfile, load_profile
from moesim.trace.synth import SynthConfig, synthesize

ROOT = Path(__file__).resolve().parents[2]
#: the numbers benchmarks/reproduce/calibrate.py fitted, each to a named figure (docs/reproduction.md)
CALIBRATION = Path(__file__).resolve().parent / "calibration.yaml"
#: fitted numbers under trial while calibrate.py solves for them ({profile: {field: value}}); None: the file's
TRIAL: dict[str, dict[str, float]] | None = None


def fitted_numbers(path: Path = CALIBRATION) -> list[dict]:
    """The fits recorded in ``calibration.yaml``: claim, profiles, fields, value, source (empty without the file)."""
    if not path.exists():
        return []
    return list((yaml.safe_load(path.read_text()) or {}).get("fits") or [])


def fitted_overrides(profile: str, fits: list[dict] | None = None) -> dict[str, tuple[float, str]]:
    """Field -> (value, source) of every fitted number set on ``profile``."""
    out: dict[str, tuple[float, str]] = {}
    for fit in fitted_numbers() if fits is None else fits:
        if profile in fit["profiles"]:
            for name in fit["fields"]:
                out[name] = (fit["value"], fit["source"])
    return out


def testbed(name: str) -> HardwareProfile:
    """The shipped profile ``name`` with the scorecard's fitted numbers set, each recording what it was fitted to."""
    profile = load_profile(ROOT / "hwprofiles" / f"{name}.yaml")
    if TRIAL is not None:
        trial = TRIAL.get(name, {})
        return profile.with_overrides(trial, source="trial value of benchmarks/reproduce/calibrate.py")
    by_source: dict[str, dict[str, float]] = {}
    for field, (value, source) in fitted_overrides(name).items():
        by_source.setdefault(source, {})[field] = value
    for source, overrides in by_source.items():
        profile = profile.with_overrides(overrides, source=source)
    return profile


def synthetic_trace(model: str, prompt: int, decode: int, scores: bool = False, tag: str = "") -> str:
    """A synthetic trace, cached in the temporary directory between runs (same parameters, same bytes)."""
    folder = Path(tempfile.gettempdir()) / "moesim-reproduce"
    path = folder / f"{model}-p{prompt}-d{decode}-{'s' if scores else 'n'}{tag}.parquet"
    if not path.exists():
        config = SynthConfig.from_settings(model=model, prompt_len=prompt, decode_len=decode, seed=0, scores=scores)
        synthesize(config, path)
    return str(path)


def magnitude_row(paper: str, claim: str, paper_value: float, moesim_value: float,
                  low: float = 0.8, high: float = 1.25) -> dict:
    """An absolute figure: agrees when moesim's lies within [low, high] times the paper's."""
    ratio = moesim_value / paper_value if paper_value else float("nan")
    return {"paper": paper, "claim": claim, "paper_value": paper_value, "moesim_value": moesim_value,
            "ratio": ratio, "agrees": bool(low <= ratio <= high), "kind": "magnitude"}


def print_table(rows: Callable[[], list[dict]]) -> int:
    """Run ``rows`` and print claim, paper figure, moesim figure, ratio and agreement."""
    start = time.perf_counter()
    table = rows()
    width = max(len(r["claim"]) for r in table)
    print(f"{'claim':<{width}}  {'paper':>9}  {'moesim':>9}  {'ratio':>6}  agrees")
    for r in table:
        agrees = "-" if r["agrees"] is None else "yes" if r["agrees"] else "no"
        print(f"{r['claim']:<{width}}  {r['paper_value']:>9.3f}  {r['moesim_value']:>9.3f}  "
              f"{r['ratio']:>6.2f}  {agrees}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0
