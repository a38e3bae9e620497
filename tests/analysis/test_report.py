"""The terminal tables' notes: each once, with the systems that gave it."""

from __future__ import annotations

import io

from rich.console import Console

from moesim.analysis.report import _print_notes, shared_notes

HOT = "static-hot: hot experts counted on the replayed trace itself"


def test_a_note_names_its_systems_unless_every_system_gave_it():
    runs = [("fiddler", {"notes": [HOT, "shared"], "cost_fallbacks": ["gpu expert"]}),
            ("cpu-only", {"notes": ["shared"]}),
            ("static-hot", {"notes": [HOT, "shared"], "cost_fallbacks": ["gpu expert", "attention"]}),
            ("fiddler", {"notes": [HOT, "shared"]})]  # serving: one system at several rates
    assert shared_notes(runs) == ["shared", f"{HOT} [fiddler, static-hot]",
                                  "roofline estimate used (no profile curve) for: attention; gpu expert"]
    assert shared_notes([("fiddler", {"notes": [HOT]})]) == [HOT]


def test_brackets_in_a_note_reach_the_terminal():
    """rich reads "[fiddler]" as markup and would drop it."""
    out = io.StringIO()
    _print_notes({"notes": [f"{HOT} [fiddler, static-hot]"]}, Console(file=out, width=200))
    assert out.getvalue() == f"note: {HOT} [fiddler, static-hot]\n"
