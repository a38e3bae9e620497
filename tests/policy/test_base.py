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


def test_a_parameter_is_read_by_its_annotation_where_the_default_says_less():
    """A component of one's own with an optional, a list and a float parameter written whole: ``--set`` values
    take the annotated type (before, ``limit=x`` was kept as the string 'x' and ``sizes`` stayed a string)."""
    from dataclasses import dataclass, field

    from moesim.policy.cache import CachePolicy

    @dataclass
    class Annotated(CachePolicy):
        name = "annotated"
        limit: int | None = None
        sizes: tuple[int, ...] = (1, 2)
        names: list[str] = field(default_factory=list)
        alpha: float = 1

    cache = Annotated()
    assert cache.parameters()["names"] == []  # the factory's value, not dataclasses.MISSING
    for raw, value in (("5", 5), ("none", None), ("null", None)):
        cache.set_param("limit", raw)
        assert cache.limit == value and type(cache.limit) is type(value)
    with pytest.raises(ConfigError, match="'x' is not a valid int") as refused:
        cache.set_param("limit", "x")
    assert refused.value.field == "cache.limit"
    with pytest.raises(ConfigError, match="is negative"):
        cache.set_param("limit", "-3")
    for raw in ("3,4", "[3, 4]", "(3,4)"):
        cache.set_param("sizes", raw)
        assert cache.sizes == (3, 4)
    cache.set_param("sizes", "[]")
    assert cache.sizes == ()
    with pytest.raises(ConfigError, match="'x' is not a valid int") as refused:
        cache.set_param("sizes", "3,x")
    assert refused.value.field == "cache.sizes[1]"
    cache.set_param("names", "a, b")
    assert cache.names == ["a", "b"]
    cache.set_param("alpha", "0.5")
    assert cache.alpha == 0.5


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


def test_a_plan_of_numpy_arrays_runs_as_the_same_plan_of_lists(tmp_path, own_systems):
    """A system class of one's own whose plan holds numpy arrays passed the plan checks (numpy integers are ints)
    and then failed deep in the engine: 'The truth value of an array with more than one element is ambiguous'."""
    from dataclasses import dataclass

    import numpy as np

    import moesim
    from moesim.policy.systems import ComposedSystem, SystemSpec, register_system
    from tests.factories import write_trace_and_profile

    @dataclass
    class ArrayPlans(ComposedSystem):
        def plan(self, view):
            plan = super().plan(view)
            plan.gpu, plan.loads = np.array(plan.gpu, dtype=np.int64), np.array(plan.loads, dtype=np.int16)
            plan.evictions = np.array(plan.evictions, dtype=np.int64).reshape(-1, 2)
            return plan

    register_system("array-plans", SystemSpec("", cache="lru", assign="gpu", system_class=ArrayPlans))
    trace, hw = write_trace_and_profile(tmp_path, 3, requests=2, prompt=3, decode=5)
    mine = moesim.replay(trace, hw=hw, system="array-plans", cache__slots_per_layer=2)
    twin = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    assert mine.decisions.equals(twin.decisions) and mine.timeline.equals(twin.timeline)


@pytest.mark.parametrize("rewrites, words", [
    (5, r"plan.substitutions \(5\) are not a list of \(token row, top-k slot, new expert\)"),
    ([(0, 0)], r"plan.substitutions hold \(0, 0\), not a \(row, slot, expert\) of ints"),
    ([(99, 0, 1)], r"plan.substitutions hold \(99, 0, 1\), outside the layer's routing"),
])
def test_a_plans_bad_substitutions_are_named_with_the_system_step_and_layer(tmp_path, own_systems, rewrites, words):
    """Substitutions of the wrong shape failed inside the view's rewrite with a bare TypeError or IndexError."""
    from dataclasses import dataclass

    import moesim
    from moesim.policy.base import PolicyError
    from moesim.policy.systems import ComposedSystem, SystemSpec, register_system
    from tests.factories import write_trace_and_profile

    @dataclass
    class Rewrites(ComposedSystem):
        def plan(self, view):
            plan = super().plan(view)
            plan.substitutions = rewrites
            return plan

    register_system("bad-rewrites", SystemSpec("", cache="lru", assign="gpu", system_class=Rewrites))
    trace, hw = write_trace_and_profile(tmp_path, 3)
    with pytest.raises(PolicyError, match=r"system 'bad-rewrites' \(Rewrites.plan\): at step 0, layer 0, " + words):
        moesim.replay(trace, hw=hw, system="bad-rewrites")


def test_reading_a_column_the_policy_did_not_list_says_how_to_get_it(tmp_path):
    """A cache that read view.weights without listing the column got "raised AttributeError: 'NoneType' object
    has no attribute ..." and "the fault is in the policy's own code", though the trace has weights."""
    from dataclasses import dataclass

    import moesim
    from moesim.policy.base import PolicyError
    from moesim.policy.cache import CachePolicy
    from moesim.policy.systems import COMPONENTS, SystemSpec, register_component, register_system

    @dataclass
    class ByWeight(CachePolicy):
        name = "by-weight-unlisted"

        def victims(self, view, layer, n, protected, incoming=None):
            return [e for e in view.cache.resident[layer] if e not in protected][:n]

        def touch(self, view, used):
            view.weights.sum()

    register_component(ByWeight)
    register_system("by-weight-unlisted", SystemSpec("", cache="by-weight-unlisted", assign="gpu"))
    trace = moesim.slice_trace(moesim.bundled_trace("mixtral-8x7b-humaneval"), tmp_path / "t.parquet", steps=2)
    hw = "rtx4090"
    try:
        with pytest.raises(PolicyError, match=r"cache 'by-weight-unlisted' \(ByWeight.touch\): at step 0, layer 0, raised "
                                              r"AttributeError.*view.weights and view.scores are None here: .*"
                                              r"add columns = \('weights', 'scores'\) to the class, for a trace"):
            moesim.replay(trace, hw=hw, system="by-weight-unlisted")
        ByWeight.columns = ("weights",)  # listed: the view carries them
        assert moesim.replay(trace, hw=hw, system="by-weight-unlisted").metrics.decode_tokens[0] == 1
    finally:
        from moesim.policy.systems import SYSTEMS
        SYSTEMS.pop("by-weight-unlisted", None)
        COMPONENTS["cache"].pop("by-weight-unlisted", None)


def test_a_bad_switch_is_told_the_words_a_command_line_takes():
    """It said 'e.g. True', Python's spelling, which --set does not need."""
    with pytest.raises(ConfigError) as refused:
        coerce("maybe", True, "engine.prune")
    assert refused.value.fix == "give true or false (or 1/0, yes/no, on/off)"
    assert [coerce(word, True, "engine.prune") for word in ("true", "0", "yes", "off")] == [True, False, True, False]
