"""Plan bookkeeping: the gate-weight mass a plan's substitutions and deferrals touch."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policy.base import LayerPlan, LayerView, Substitutions
from moesim.sim.bookkeeping import substitution_mass, weight_mass


def _view(weights: np.ndarray) -> LayerView:
    experts = np.zeros(weights.shape, dtype=np.int16)
    return LayerView(0, 0, "decode", experts, [0], [weights.size], None, None, weights=weights)


def test_substitution_mass_adds_the_rewritten_entries():
    weights = np.array([[0.5, 0.25], [0.125, 0.0625]], dtype=np.float32)
    plan = LayerPlan(substitutions=[(0, 1, 3), (1, 0, 2), (1, 1, 4)])
    assert substitution_mass(_view(weights), plan) == 0.25 + 0.125 + 0.0625
    assert substitution_mass(_view(weights), LayerPlan()) == 0.0
    assert substitution_mass(LayerView(0, 0, "decode", np.zeros((1, 2)), [], [], None, None), plan) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([np.float16, np.float32, np.float64]), st.integers(1, 40), st.data())
def test_substitution_mass_is_the_entry_by_entry_sum_in_the_weights_dtype(dtype, tokens, data):
    """The mass is a running sum in the weights' dtype, entry by entry in plan order (a prefill rewrites
    thousands of entries at once): the very number a Python sum over the entries gives."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    weights = rng.random((tokens, 4)).astype(dtype)
    entries = data.draw(st.lists(st.tuples(st.integers(0, tokens - 1), st.integers(0, 3)), min_size=1,
                                 max_size=200))
    plan = LayerPlan(substitutions=[(row, slot, 0) for row, slot in entries])
    expected = float(sum(weights[row, slot] for row, slot in entries))
    assert substitution_mass(_view(weights), plan) == expected


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([np.float16, np.float32, np.float64]), st.integers(1, 300), st.data())
def test_substitution_mass_of_rewrites_held_as_arrays_is_the_same_running_sum(dtype, tokens, data):
    """A prefill's thousands of rewrites come as :class:`Substitutions` (arrays): their mass, summed by the
    ufunc's accumulation, is the entry-by-entry number of the same rewrites as a list."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    weights = rng.random((tokens, 4)).astype(dtype)
    chosen = np.flatnonzero(rng.random(tokens * 4) < data.draw(st.floats(0.01, 1.0)))
    if not chosen.size:
        chosen = np.array([0])
    rows, slots = np.divmod(chosen, 4)
    as_arrays = LayerPlan(substitutions=Substitutions(rows, slots, np.zeros_like(rows)))
    as_list = LayerPlan(substitutions=list(as_arrays.substitutions))
    assert substitution_mass(_view(weights), as_arrays) == substitution_mass(_view(weights), as_list)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([np.float16, np.float32]), st.integers(1, 12), st.integers(1, 3), st.data())
def test_weight_mass_is_the_sum_of_the_masked_entries_whatever_the_path(dtype, top_k, tokens, data):
    """One token (read from its row) and a few tokens (a broadcast mask) give the very number np.isin's
    mask selects and sums: the same entries, in row order, summed by numpy in the weights' dtype."""
    experts = np.array([data.draw(st.permutations(range(16)))[:top_k] for _ in range(tokens)], dtype=np.int16)
    weights = np.array(data.draw(st.lists(st.floats(0, 1, width=16), min_size=experts.size, max_size=experts.size)),
                       dtype=dtype).reshape(experts.shape)
    chosen = data.draw(st.lists(st.integers(0, 15), unique=True, max_size=16))
    view = LayerView(0, 0, "decode", experts, [], [], None, None, weights=weights)
    expected = float(weights[np.isin(experts, chosen)].sum()) if chosen else 0.0
    assert weight_mass(view, chosen) == expected
