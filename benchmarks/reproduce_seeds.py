"""The seed papers' claims, reproduced in moesim, counted strictly against the claims catalogue.

Imports ``rows()`` from each ``benchmarks/reproduce/seed_*.py``; each row names the catalogue claim it
reproduces (``claim_id``, benchmarks/reproduce/claims/*.yaml). Prints every simulated claim (paper
figure, moesim figure, status), the counted claims no script produces yet ("not yet simulated"), the
script rows that match no claim, and the strict counts (benchmarks/reproduce/catalogue.py):

* held-out ratio claims agreeing strictly (same side of 1 and within x1.25), target 80%;
* held-out absolute figures within 25%, target 60%;
* ratio claims that agree in direction only (never counted as agreement);
* how many counted catalogue claims are simulated (the others count as not agreeing);
* calibration rows and rows the paper gives no setup for, excluded and shown as such.

    .venv/bin/python benchmarks/reproduce_seeds.py
    .venv/bin/python benchmarks/reproduce_seeds.py --seeds 003,004 --out rows.json   # or rows.csv

About half a minute on 2 cores (24 s on 2026-11-29, 32 s on 2026-11-24; the load average is printed at the
end: other work on the machine slows it down).
docs/reproduction.md explains the method and the disagreements.
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
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmarks" / "reproduce"
sys.path.insert(0, str(SCRIPTS))
from catalogue import (CatalogueError, Claim, combine, load_catalogue, status,  # noqa: E402
                       summary_lines)

COLUMNS = ["paper", "claim", "paper_value", "moesim_value", "ratio", "agrees", "kind", "claim_id"]
SCORE_COLUMNS = ["claim_id", "paper", "where", "quantity", "kind", "qualifier", "paper_figure", "moesim_value",
                 "moesim_over_paper", "status", "reason", "calibration"]


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
        try:
            produced = load(path).rows()
        except Exception as error:  # one failing script must not lose the others' rows
            console.print(f"[red]{path.stem} failed ({type(error).__name__}: {escape(str(error))}); "
                          "its claims stay not yet simulated[/red]")
            produced = []
        for row in produced:
            rows.append({"kind": "direction", "claim_id": None, **row})
        seconds[path.stem] = time.perf_counter() - start
        console.print(f"[dim]{path.stem}: {seconds[path.stem]:.0f} s[/dim]")
    return pd.DataFrame(rows, columns=COLUMNS), seconds


def moesim_figures(claims: list[Claim], frame: pd.DataFrame) -> dict[str, float]:
    """moesim's figure per claim id: its script rows (finite values) combined as the claim's qualifier says."""
    by_id = {c.id: c for c in claims}
    out = {}
    for claim_id, part in frame[frame.claim_id.notna()].groupby("claim_id", sort=False):
        values = [float(v) for v in part.moesim_value if v is not None and math.isfinite(float(v))]
        if claim_id in by_id and values:
            out[claim_id] = combine(by_id[claim_id], values)
    return out


def scorecard(claims: list[Claim], figures: dict[str, float]) -> pd.DataFrame:
    """One row per catalogue claim: paper figure, moesim figure, status."""
    rows = []
    for claim in claims:
        moesim = figures.get(claim.id)
        rows.append({"claim_id": claim.id, "paper": claim.paper, "where": claim.where, "quantity": claim.quantity,
                     "kind": claim.kind, "qualifier": claim.qualifier, "paper_figure": claim.paper_figure,
                     "moesim_value": moesim, "moesim_over_paper": moesim / claim.paper_figure
                     if moesim is not None and claim.paper_figure else None,
                     "status": status(claim, moesim), "reason": claim.reason, "calibration": claim.calibration})
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


def number(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


STYLE = {"agrees": "green", "direction only": "yellow", "disagrees": "red", "not yet simulated": "red",
         "calibration": "cyan", "not countable": "dim"}


def render(score: pd.DataFrame, frame: pd.DataFrame, console: Console) -> None:
    table = Table(title="catalogue claims simulated", show_lines=False)
    for name, justify in (("claim", "left"), ("quantity", "left"), ("qualifier", "left"), ("paper", "right"),
                          ("moesim", "right"), ("moesim/paper", "right"), ("status", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in score[score.moesim_value.notna()].itertuples(index=False):
        style = STYLE.get(row.status, "")
        table.add_row(row.claim_id, escape(row.quantity), row.qualifier, number(row.paper_figure),
                      number(row.moesim_value), number(row.moesim_over_paper), f"[{style}]{row.status}[/{style}]")
    console.print(table)
    missing = score[score.status == "not yet simulated"]
    if len(missing):
        console.print(f"[bold]counted claims not yet simulated ({len(missing)}), counted as not agreeing:[/bold]")
        for paper, part in missing.groupby("paper", sort=False):
            console.print(f"  {paper}: " + ", ".join(part.claim_id), soft_wrap=False)
    orphans = frame[frame.claim_id.isna() | ~frame.claim_id.isin(score.claim_id)]
    if len(orphans):
        console.print("[bold]script rows naming no catalogue claim (shown, not counted):[/bold]")
        for row in orphans.itertuples(index=False):
            known = row.claim_id is None or row.claim_id != row.claim_id
            note = "" if known else f" [red](unknown id {row.claim_id})[/red]"
            console.print(f"  {row.paper}: {escape(str(row.claim))}: moesim {number(row.moesim_value)}{note}")


def write(score: pd.DataFrame, frame: pd.DataFrame, out: Path) -> None:
    """The scorecard (one row per claim) plus unmatched script rows, JSON (records) or CSV, written atomically."""
    orphans = frame[frame.claim_id.isna() | ~frame.claim_id.isin(score.claim_id)]
    extra = pd.DataFrame({"claim_id": orphans.claim_id, "paper": orphans.paper, "quantity": orphans.claim,
                          "moesim_value": orphans.moesim_value, "status": "no catalogue claim"},
                         columns=SCORE_COLUMNS)
    table = pd.concat([score, extra], ignore_index=True) if len(extra) else score
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".json":
        table.to_json(tmp, orient="records", indent=1)
    else:
        table.to_csv(tmp, index=False)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", help="comma-separated seed numbers to run (default: all), e.g. 000,003")
    parser.add_argument("--out", type=Path, help="also write the scorecard to this .json or .csv file")
    args = parser.parse_args(argv)
    only = args.seeds.split(",") if args.seeds else None
    scripts = seed_scripts(only)
    if not scripts:
        parser.error(f"--seeds {args.seeds}: no such script in {SCRIPTS}")
    if args.out and args.out.suffix not in (".json", ".csv"):
        parser.error(f"--out {args.out}: use a .json or .csv file name")
    try:
        claims = load_catalogue()
    except CatalogueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    seeds = {p.stem.removeprefix("seed_") for p in scripts}
    claims = [c for c in claims if c.id.split("-")[0] in seeds]
    os.chdir(ROOT)
    console = Console(width=200)
    start = time.perf_counter()
    frame, _ = collect(scripts, console)
    try:
        figures = moesim_figures(claims, frame)
    except CatalogueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    score = scorecard(claims, figures)
    render(score, frame, console)
    for line in summary_lines(claims, figures):
        console.print(line)
    console.print(f"{time.perf_counter() - start:.0f} s wall, load average {os.getloadavg()[0]:.2f} "
                  f"on {os.cpu_count()} cores")
    if args.out:
        write(score, frame, args.out)
        console.print(f"wrote {len(score)} catalogue rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
