"""The claims catalogue (``benchmarks/reproduce/claims/*.yaml``) and the strict scorecard counted on it.

Every number the seed papers print in their evaluation sections is one catalogue row: what it compares,
the setup the paper states for it, the paper's value and where it is printed. The seed scripts
(``seed_*.py``) emit rows that name a row of the catalogue by ``claim_id``; ``score`` joins the two and
counts, for the rows held out from calibration and whose setup the paper states:

* a ratio claim agrees when moesim's ratio lies on the same side of 1 as the paper's AND
  ``|log(moesim / paper)| <= log 1.25``; being on the same side only is "direction only", reported
  apart and never counted as agreement;
* an absolute figure agrees when ``|log(moesim / paper)| <= log 1.25`` (within 25%, symmetric in ratio);
* a counted row no script produces yet is "not yet simulated" and counts as not agreeing.

Ratios are compared in the paper's "A over B" form, A being the system the paper speaks for (a
speedup, a gain, a time B / time A): ``Claim.ratio`` turns the printed value into it (``form``:
``speedup`` as printed, ``gain-pct`` 1 + p/100, ``reduction-pct`` 1 / (1 - p/100)), and the seed
scripts emit moesim's figure in the same form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = Path(__file__).resolve().parent / "claims"
SEEDS = ROOT.parent / "shared" / "seeds"
SETUP_FIELDS = ("model", "dtype", "batch", "prompt", "decode", "testbed")
KINDS = ("ratio", "absolute")
FORMS = ("speedup", "gain-pct", "reduction-pct")
QUALIFIERS = ("exact", "about", "up-to", "at-least", "at-most", "average", "range-min", "range-max")
#: how several script rows for one claim (one per setting) combine into the figure the paper states
AGGREGATE = {"up-to": max, "range-max": max, "range-min": min, "at-most": max, "at-least": min,
             "average": lambda values: sum(values) / len(values)}
TOLERANCE = 1.25
TARGETS = {"ratio": 0.80, "absolute": 0.60}
REQUIRED = ("id", "where", "quantity", "kind", "value", "qualifier", "setup", "countable")
OPTIONAL = ("form", "unit", "printed", "over", "reason", "calibration", "derived_from", "note")


class CatalogueError(ValueError):
    """A catalogue file that cannot be used; the message names the file, the row, the field and the fix."""


@dataclass(frozen=True)
class Claim:
    """One number printed in a seed paper's evaluation (see the module docstring for the fields' meaning)."""

    id: str
    paper: str
    where: str
    quantity: str
    kind: str
    value: float
    qualifier: str
    setup: dict
    countable: bool
    form: str | None = None
    unit: str | None = None
    printed: str | None = None
    over: str | None = None
    reason: str | None = None
    calibration: str | None = None
    derived_from: tuple[str, ...] = field(default_factory=tuple)
    note: str | None = None

    @property
    def ratio(self) -> float | None:
        """The paper's figure in "A over B" form (ratio claims only)."""
        if self.kind != "ratio":
            return None
        if self.form == "gain-pct":
            return 1 + self.value / 100
        if self.form == "reduction-pct":
            return 1 / (1 - self.value / 100)
        return self.value

    @property
    def paper_figure(self) -> float:
        """What moesim's figure is compared with: the ratio for a ratio claim, the value otherwise."""
        return self.ratio if self.kind == "ratio" else self.value  # type: ignore[return-value]

    @property
    def held_out(self) -> bool:
        """Counted in the scorecard: the paper states its setup and no profile was fitted to it."""
        return self.countable and not self.calibration


def unstated_fields(setup: dict) -> list[str]:
    """Setup fields the paper does not state ("unstated ...") or moesim lacks ("missing: ...")."""
    return [name for name in SETUP_FIELDS
            if str(setup.get(name, "unstated")).startswith(("unstated", "missing"))]


def _fail(path: Path, row: str, name: str, message: str) -> CatalogueError:
    return CatalogueError(f"{path}: claim {row}: field '{name}': {message}")


def _claim(path: Path, paper: str, row: dict) -> Claim:
    ident = str(row.get("id", "?"))
    for name in REQUIRED:
        if name not in row:
            raise _fail(path, ident, name, "missing; add it (see benchmarks/reproduce/catalogue.py)")
    unknown = set(row) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        name = sorted(unknown)[0]
        raise _fail(path, ident, name, f"unknown field; use one of {', '.join(REQUIRED + OPTIONAL)}")
    if row["kind"] not in KINDS:
        raise _fail(path, ident, "kind", f"'{row['kind']}' is not one of {', '.join(KINDS)}")
    if row["kind"] == "ratio" and row.get("form") not in FORMS:
        raise _fail(path, ident, "form", f"a ratio claim needs one of {', '.join(FORMS)}")
    if row["kind"] == "absolute" and not row.get("unit"):
        raise _fail(path, ident, "unit", "an absolute figure needs its unit")
    if row["qualifier"] not in QUALIFIERS:
        raise _fail(path, ident, "qualifier", f"'{row['qualifier']}' is not one of {', '.join(QUALIFIERS)}")
    if not isinstance(row["value"], (int, float)) or isinstance(row["value"], bool):
        raise _fail(path, ident, "value", f"'{row['value']}' is not a number; write the figure as a number")
    missing = [name for name in SETUP_FIELDS if name not in (row["setup"] or {})]
    if missing:
        raise _fail(path, ident, "setup", f"lacks {', '.join(missing)}; write 'unstated' where the paper does not say")
    if not row["countable"] and not row.get("reason"):
        raise _fail(path, ident, "reason", "a row that is not counted must say why")
    if row["countable"] and unstated_fields(row["setup"]):
        raise _fail(path, ident, "countable", f"setup {', '.join(unstated_fields(row['setup']))} is not stated; "
                                              "set countable: false with a reason")
    if row.get("calibration") and not row["countable"]:
        raise _fail(path, ident, "calibration", "only a row whose setup the paper states may calibrate a profile")
    if not row.get("printed") and not row.get("derived_from"):
        raise _fail(path, ident, "printed", "give the text as printed in the paper, or derived_from for a derived row")
    return Claim(id=ident, paper=paper, where=row["where"], quantity=row["quantity"], kind=row["kind"],
                 value=float(row["value"]), qualifier=row["qualifier"], setup=dict(row["setup"]),
                 countable=bool(row["countable"]), form=row.get("form"), unit=row.get("unit"),
                 printed=row.get("printed"), over=row.get("over"), reason=row.get("reason"),
                 calibration=row.get("calibration"), derived_from=tuple(row.get("derived_from") or ()),
                 note=row.get("note"))


def load_catalogue(folder: Path | None = None) -> list[Claim]:
    """Every claim of every ``*.yaml`` in ``folder`` (default ``CLAIMS``), in order; CatalogueError on a bad file."""
    folder = folder or CLAIMS
    claims: list[Claim] = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            document = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise CatalogueError(f"{path}: not valid YAML ({str(error).splitlines()[0]}); fix the syntax") from error
        if not isinstance(document, dict) or not isinstance(document.get("claims"), list):
            raise CatalogueError(f"{path}: field 'claims': missing; a catalogue file holds a list under 'claims'")
        claims += [_claim(path, str(document.get("paper", path.stem)), row) for row in document["claims"]]
    seen: set[str] = set()
    for claim in claims:
        if claim.id in seen:
            raise CatalogueError(f"{folder}: claim {claim.id}: field 'id': used twice; ids must be unique")
        seen.add(claim.id)
    for claim in claims:
        for other in claim.derived_from:
            if other not in seen:
                raise CatalogueError(f"{folder}: claim {claim.id}: field 'derived_from': no claim '{other}'")
    return claims


def calibration_rows_per_profile(claims: list[Claim]) -> dict[str, list[str]]:
    """Calibration claim ids by testbed profile (at most two each, docs/reproduction.md)."""
    out: dict[str, list[str]] = {}
    for claim in claims:
        if claim.calibration:
            out.setdefault(str(claim.setup["testbed"]), []).append(claim.id)
    return out


def log_error(paper: float, moesim: float) -> float:
    """|log(moesim / paper)|; infinite when the two differ in sign or either is zero."""
    if paper * moesim <= 0:
        return math.inf
    return abs(math.log(moesim / paper))


def same_side(paper: float, moesim: float) -> bool:
    """Whether both ratios lie on the same side of 1 (both equal to 1 counts as the same side)."""
    return (paper > 1 and moesim > 1) or (paper < 1 and moesim < 1) or (paper == 1 and moesim == 1)


def within(paper: float, moesim: float, tolerance: float = TOLERANCE) -> bool:
    """``|log(moesim / paper)| <= log tolerance`` (a rounding margin of 1e-9 keeps the exact edge in)."""
    return log_error(paper, moesim) <= math.log(tolerance) + 1e-9


def verdict(claim: Claim, moesim: float | None) -> str:
    """``agrees``, ``direction only``, ``disagrees`` or ``not yet simulated`` for one claim."""
    if moesim is None or (isinstance(moesim, float) and math.isnan(moesim)):
        return "not yet simulated"
    paper = claim.paper_figure
    if claim.kind == "ratio":
        if not same_side(paper, moesim):
            return "disagrees"
        return "agrees" if within(paper, moesim) else "direction only"
    return "agrees" if within(paper, moesim) else "disagrees"


def combine(claim: Claim, values: list[float]) -> float:
    """One figure from the script rows naming ``claim`` (one per setting), as its qualifier says."""
    if len(values) == 1:
        return values[0]
    if claim.qualifier not in AGGREGATE:
        raise CatalogueError(f"claim {claim.id}: {len(values)} script rows for a claim qualified "
                             f"'{claim.qualifier}'; emit one row, or qualify it (average, up-to, range-min, ...)")
    return AGGREGATE[claim.qualifier](values)


def status(claim: Claim, moesim: float | None) -> str:
    """Where a claim stands on the scorecard: excluded (calibration, not countable) or its verdict."""
    if claim.calibration:
        return "calibration"
    if not claim.countable:
        return "not countable"
    return verdict(claim, moesim)


@dataclass
class Count:
    """Held-out claims of one kind: how many agree strictly, agree in direction only, are simulated."""

    kind: str
    total: int = 0
    agree: int = 0
    direction_only: int = 0
    simulated: int = 0

    @property
    def share(self) -> float:
        return self.agree / self.total if self.total else float("nan")


def count(claims: list[Claim], moesim: dict[str, float]) -> dict[str, Count]:
    """Strict counts over held-out claims (calibration and non-countable rows excluded)."""
    counts = {kind: Count(kind) for kind in KINDS}
    for claim in claims:
        if not claim.held_out:
            continue
        part = counts[claim.kind]
        part.total += 1
        result = verdict(claim, moesim.get(claim.id))
        part.simulated += result != "not yet simulated"
        part.agree += result == "agrees"
        part.direction_only += result == "direction only"
    return counts


def summary_lines(claims: list[Claim], moesim: dict[str, float]) -> list[str]:
    """The scorecard's summary: strict counts with their targets, direction-only, coverage, exclusions."""
    counts = count(claims, moesim)
    ratio, absolute = counts["ratio"], counts["absolute"]
    held = ratio.total + absolute.total
    simulated = ratio.simulated + absolute.simulated
    calibration = sum(1 for c in claims if c.calibration)
    not_countable = sum(1 for c in claims if not c.countable)
    excluded_simulated = sum(1 for c in claims if not c.held_out and c.id in moesim)

    def share(part: Count) -> str:  # none held out (a subset of seeds whose rows are all excluded): no share
        return f"{part.share:.0%}" if part.total else "none held out"

    return [
        f"strict: {ratio.agree} of {ratio.total} held-out ratio claims agree ({share(ratio)}; target "
        f"{TARGETS['ratio']:.0%}): same side of 1 and within x{TOLERANCE} of the paper",
        f"strict: {absolute.agree} of {absolute.total} held-out absolute figures within 25% ({share(absolute)}; "
        f"target {TARGETS['absolute']:.0%})",
        f"direction only (not counted as agreement): {ratio.direction_only} of {ratio.total} held-out ratio claims",
        f"{simulated} of {held} catalogue claims simulated ({held - simulated} not yet simulated, counted as not "
        f"agreeing above)",
        f"excluded from the count: {calibration} calibration rows, {not_countable} rows not countable "
        f"(setup not stated, testbed or model missing, accuracy, derived); {excluded_simulated} of them simulated "
        f"and shown",
    ]
