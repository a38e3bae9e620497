"""What the seed reproduction scripts share: cached synthetic traces, result rows and their table."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from moesim.trace.synth import SynthConfig, synthesize


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
