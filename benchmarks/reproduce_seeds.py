"""Every seed paper's headline claims, reproduced in moesim, in one table.

Imports ``rows()`` from each ``benchmarks/reproduce/seed_*.py`` and prints one
table (paper, claim, paper value, moesim value, ratio, agrees) with two summary
lines: how many relative claims (speedups, gains, reductions, orderings) agree
in direction, and how many absolute figures (tokens/s) fall within their
script's tolerance. Rows without a paper figure (``agrees`` None) are shown and
not counted. docs/reproduction.md explains every disagreement.

    .venv/bin/python benchmarks/reproduce_seeds.py
    .venv/bin/python benchmarks/reproduce_seeds.py --seeds 003,004 --out rows.json   # or rows.csv

About 2 minutes on 2 cores (load average printed at the end: other work on the
machine slows it down).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pandas as pd
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmarks" / "reproduce"
COLUMNS = ["paper", "claim", "paper_value", "moesim_value", "ratio", "agrees", "kind"]


def seed_scripts(only: list[str] | None = None) -> list[Path]:
    scripts = sorted(SCRIPTS.glob("seed_*.py"))
    if only:
        scripts = [p for p in scripts if p.stem.removeprefix("seed_") in only]
    return scripts


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"reproduce_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collect(scripts: list[Path], console: Console) -> tuple[pd.DataFrame, dict[str, float]]:
    """All rows of ``scripts`` in order, and the wall seconds each script took."""
    rows, seconds = [], {}
    for path in scripts:
        start = time.perf_counter()
        for row in load(path).rows():
            rows.append({"kind": "direction", **row})
        seconds[path.stem] = time.perf_counter() - start
        console.print(f"[dim]{path.stem}: {seconds[path.stem]:.0f} s[/dim]")
    return pd.DataFrame(rows, columns=COLUMNS), seconds


def summary(frame: pd.DataFrame) -> list[str]:
    counted = frame[frame.agrees.notna()]
    lines = []
    for kind, text in (("direction", "claims agree in direction"),
                       ("magnitude", "absolute figures within their tolerance")):
        part = counted[counted.kind == kind]
        if len(part):
            lines.append(f"{int(part.agrees.astype(bool).sum())} of {len(part)} {text}")
    return lines


def number(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def render(frame: pd.DataFrame, console: Console) -> None:
    table = Table(show_lines=False)
    for name, justify in (("paper", "left"), ("claim", "left"), ("paper value", "right"),
                          ("moesim value", "right"), ("ratio", "right"), ("agrees", "center")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in frame.itertuples(index=False):
        agrees = "-" if row.agrees is None or row.agrees != row.agrees else "yes" if row.agrees else "[red]no[/red]"
        table.add_row(row.paper, row.claim, number(row.paper_value), number(row.moesim_value), number(row.ratio),
                      agrees)
    console.print(table)


def write(frame: pd.DataFrame, out: Path) -> None:
    """JSON (records) or CSV by suffix, written to a temporary file and renamed."""
    if out.suffix not in (".json", ".csv"):
        raise SystemExit(f"--out {out}: unknown format '{out.suffix}'; use a .json or .csv file name")
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".json":
        frame.to_json(tmp, orient="records", indent=1)
    else:
        frame.to_csv(tmp, index=False)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", help="comma-separated seed numbers to run (default: all), e.g. 000,003")
    parser.add_argument("--out", type=Path, help="also write the rows to this .json or .csv file")
    args = parser.parse_args(argv)
    scripts = seed_scripts(args.seeds.split(",") if args.seeds else None)
    if not scripts:
        parser.error(f"--seeds {args.seeds}: no such script in {SCRIPTS}")
    if args.out and args.out.suffix not in (".json", ".csv"):
        parser.error(f"--out {args.out}: use a .json or .csv file name")
    os.chdir(ROOT)
    console = Console(width=160)
    start = time.perf_counter()
    frame, _ = collect(scripts, console)
    render(frame, console)
    for line in summary(frame):
        console.print(line)
    console.print(f"{time.perf_counter() - start:.0f} s wall, load average {os.getloadavg()[0]:.2f} "
                  f"on {os.cpu_count()} cores")
    if args.out:
        write(frame, args.out)
        console.print(f"wrote {len(frame)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
