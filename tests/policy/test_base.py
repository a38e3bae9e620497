"""``--set`` values become the type of the parameter's default (moesim.policy.base.coerce)."""

from __future__ import annotations

import pytest

from moesim.errors import ConfigError
from moesim.policy.base import coerce
from moesim.policy.systems import build_system


def test_numbers_take_the_defaults_type_and_range():
    assert coerce("3", 1, "cache.n") == 3 and coerce("0.5", 1.0, "substitute.alpha") == 0.5
    assert coerce("true", False, "x.flag") is True
    with pytest.raises(ConfigError, match="is negative"):
        coerce("-1", 4, "cache.w_size")
    with pytest.raises(ConfigError, match="not a valid int"):
        coerce("1.5", 4, "cache.w_size")


def test_a_negative_default_can_be_asked_for_again_and_no_other_negative():
    """-1 defaults mean "the paper's value for the model": naming -1 again (in a sweep, say) gives that."""
    assert coerce("-1", -1, "cache.u_size") == -1 and coerce("-1", -1.0, "substitute.alpha") == -1.0
    with pytest.raises(ConfigError, match="is negative"):
        coerce("-2", -1, "cache.u_size")
    system = build_system("dali", {"cache.u_size": "-1", "prefetch.size": "-1"})
    assert (system.cache.u_size, system.prefetch.size) == (-1, -1)


def _view_of(experts):
    import numpy as np

    from moesim.hw.cost import CostModel
    from moesim.policy.base import LayerView, active_experts
    from moesim.policy.state import CacheState
    from tests.factories import tiny_model, tiny_profile
    model = tiny_model(layers=1, experts=8, top_k=2)
    costs = CostModel(tiny_profile(), model)
    active, counts = active_experts(np.asarray(experts), model.num_experts)
    return LayerView(0, 0, "prefill", np.asarray(experts, dtype=np.int16), active, counts, CacheState([8]), costs)


def test_substitutions_held_as_arrays_read_as_the_list_of_tuples_and_rewrite_the_same_view():
    import numpy as np

    from moesim.policy.base import Substitutions
    rewrites = Substitutions(np.array([0, 0, 2]), np.array([0, 1, 1]), np.array([5, 6, 7]))
    as_list = [(0, 0, 5), (0, 1, 6), (2, 1, 7)]
    assert len(rewrites) == 3 and list(rewrites) == as_list and rewrites == as_list and as_list == rewrites
    assert rewrites[1] == (0, 1, 6) and rewrites[1:] == as_list[1:] and rewrites != as_list[:2]
    view = _view_of([[0, 1], [2, 3], [4, 1]])
    by_arrays, by_list = view.substituted(rewrites), _view_of([[0, 1], [2, 3], [4, 1]]).substituted(as_list)
    assert by_arrays.experts.tolist() == by_list.experts.tolist() == [[5, 6], [2, 3], [4, 7]]
    assert (by_arrays.active, by_arrays.counts) == (by_list.active, by_list.counts)
    assert view.substituted(rewrites) is by_arrays  # the executor asks again: the same view


@pytest.mark.parametrize("rows, slots", [([1, 0], [0, 0]), ([0, 0], [1, 1]), ([0, 0], [1, 0])])
def test_substitutions_out_of_order_or_twice_are_refused(rows, slots):
    import numpy as np

    from moesim.policy.base import Substitutions
    with pytest.raises(ValueError, match="ordered by row, then slot"):
        Substitutions(np.array(rows), np.array(slots), np.array([3, 4]))


def test_a_parameter_of_another_component_says_which_components_take_it():
    """`--set prefetch.n=3` on gpu-only-lru (no prefetcher) said 'did you mean prefetch?' with a list of every
    parameter; it names the components that take it and how to choose one. An empty key is its own line."""
    from moesim.errors import ConfigError
    from moesim.policy.systems import build_system
    with pytest.raises(ConfigError, match=r"prefetch 'none' of system 'gpu-only-lru' has no parameter 'prefetch.n'; "
                                          r"prefetch hybrimoe-layer, smoe-token have it \(fix: choose one with --set "
                                          r"prefetch=hybrimoe-layer as well"):
        build_system("gpu-only-lru", {"prefetch.n": "3"})
    assert build_system("gpu-only-lru", {"prefetch": "smoe-token", "prefetch.n": "3"}).prefetch.n == 3
    with pytest.raises(ConfigError, match="a setting with no parameter name"):
        build_system("gpu-only-lru", {"": "3"})
