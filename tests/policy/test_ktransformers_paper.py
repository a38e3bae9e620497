"""KTransformers (001_66a328d79a3cae8d.txt) against the paper, mechanism by mechanism: each test works a tiny
case by hand in its comments and asserts the number or plan 001's rule gives."""

from __future__ import annotations

from moesim.hw.cost import CostModel
from moesim.policy.base import RunContext
from moesim.policy.catalog.ktransformers import ExpertDeferral
from tests.factories import tiny_model, tiny_profile


# ----------------------------------------------------------------------------- 001 Sec. 4.2, 6.3
def test_an_explicit_count_leaving_fewer_than_two_immediate_experts_is_noted():
    """Sec. 4.2 and 6.3 keep at least 2 immediate experts per layer. Top-4 with 3 deferred leaves one: it
    runs (an ablation beyond the paper) with a note saying so; 2 deferred leaves 2 and needs no note."""
    model = tiny_model(layers=2, experts=8, top_k=4)
    noted = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[0, 0])
    ExpertDeferral(deferred=3).configure(noted)
    assert any("1 immediate" in n and "001 Sec. 4.2" in n for n in noted.notes)
    quiet = RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[0, 0])
    ExpertDeferral(deferred=2).configure(quiet)
    assert not quiet.notes
