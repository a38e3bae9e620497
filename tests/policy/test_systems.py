"""Systems and the registries: a user's own components and systems beside the catalogue."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moesim.errors import ConfigError
from moesim.policy.assign import Assignment
from moesim.policy.cache import CachePolicy, LRUCache
from moesim.policy.prefetch import Prefetch
from moesim.policy.systems import COMPONENTS, SYSTEMS, SystemSpec, build_system, register_component, register_system


@pytest.fixture(autouse=True)
def registries():
    """Every test leaves the registries as it found them."""
    components = {role: dict(d) for role, d in COMPONENTS.items()}
    systems = dict(SYSTEMS)
    yield
    COMPONENTS.clear()
    COMPONENTS.update(components)
    SYSTEMS.clear()
    SYSTEMS.update(systems)


def test_a_subclass_that_keeps_its_parents_name_does_not_replace_the_catalogue_component():
    """A subclass of LRUCache without a name of its own was registered as 'lru': gpu-only-lru and every
    other system with an LRU cache silently ran the user's class."""
    lru = COMPONENTS["cache"]["lru"]

    @dataclass
    class MyLRU(LRUCache):
        pass

    with pytest.raises(ConfigError, match=r"MyLRU.*no name of its own.*'lru'.*name = "):
        register_component(MyLRU)
    assert COMPONENTS["cache"]["lru"] is lru
    assert type(build_system("gpu-only-lru").cache) is lru


def test_a_component_named_as_a_catalogue_one_is_refused():
    @dataclass
    class Mine(CachePolicy):
        name = "belady"

    with pytest.raises(ConfigError, match=r"cache 'belady' is a catalogue component.*another name"):
        register_component(Mine)
    assert COMPONENTS["cache"]["belady"].__module__ == "moesim.policy.cache"


def test_a_component_with_no_name_or_no_role_is_refused():
    @dataclass
    class Nameless(CachePolicy):
        name = ""

    with pytest.raises(ConfigError, match="Nameless has no name"):
        register_component(Nameless)
    assert "" not in COMPONENTS["cache"]

    @dataclass
    class Roleless:
        name = "x"

    with pytest.raises(ConfigError, match=r"Roleless is no component.*CachePolicy, Assignment, Prefetch"):
        register_component(Roleless)


def test_defining_a_component_again_replaces_it():
    """A notebook cell run twice defines the class twice: the second definition is the one used."""
    def define(victims):
        @dataclass
        class Again(CachePolicy):
            name = "again-cache"
        Again.victims = victims
        return register_component(Again)

    define(lambda *a, **k: [])
    second = define(lambda *a, **k: [])
    assert COMPONENTS["cache"]["again-cache"] is second


def test_a_system_named_as_a_catalogue_one_is_refused():
    """register_system('gpu-only-lru', ...) silently replaced the catalogue system for the whole process."""
    spec = SYSTEMS["gpu-only-lru"]
    with pytest.raises(ConfigError, match=r"'gpu-only-lru' is a catalogue system.*another name"):
        register_system("gpu-only-lru", SystemSpec("mine", cache="static-hot", assign="resident"))
    assert SYSTEMS["gpu-only-lru"] is spec


@pytest.mark.parametrize("name", ["all", "a,b", "", " x", 3])
def test_a_system_name_the_command_line_cannot_name_is_refused(name):
    with pytest.raises(ConfigError, match="system name"):
        register_system(name, SystemSpec("mine", cache="lru", assign="gpu"))
    assert name not in SYSTEMS


def test_a_system_is_registered_with_a_system_spec():
    with pytest.raises(ConfigError, match=r"SystemSpec\(.*cache="):
        register_system("mine", {"cache": "lru", "assign": "gpu"})
    assert "mine" not in SYSTEMS


def test_a_users_system_may_be_registered_again():
    register_system("my-own", SystemSpec("first", cache="lru", assign="gpu"))
    register_system("my-own", SystemSpec("second", cache="lru", assign="cpu"))
    assert SYSTEMS["my-own"].description == "second"


def test_user_components_register_and_build():
    @dataclass
    class Half(Assignment):
        name = "half-gpu"

        def split(self, view):
            return list(view.active[::2]), list(view.active[1::2])

    register_component(Half)
    register_system("half", SystemSpec("half on the GPU", cache="lru", assign="half-gpu"))
    assert isinstance(build_system("half").assign, Half)


# ---------------------------------------------------------------------------------------------------------------
# A user's policy that breaks the policy interface: one line naming the method, the step and layer, and the fix


@pytest.fixture
def files(tmp_path):
    from tests.factories import write_trace_and_profile
    return write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=8)


def replay_with(files, system="gpu-only-lru", **settings):
    import moesim
    trace, hw = files
    return moesim.replay(trace, hw=hw, system=system, settings=settings, cache__slots_per_layer=3,
                         timeline=False, decisions=False)


def user_component(base, name, **methods):
    """A user's component class named ``name`` (defined outside moesim), registered."""
    cls = dataclass(type(f"User_{name.replace('-', '_')}", (base,), {"name": name, "__module__": "user_policies",
                                                                    **methods}))
    return register_component(cls)


def _both(self, view):
    return list(view.active), list(view.active[:1])


def _leaves_one_out(self, view):
    return list(view.active[1:]), []


def _twice_on_gpu(self, view):
    return list(view.active) + list(view.active[:1]), []


def _not_routed(self, view):
    return list(view.active) + [99], []


def _one_list(self, view):
    return list(view.active)


def _no_return(self, view):
    gpu = list(view.active)  # noqa: F841 - the return forgotten


def _divides_by_zero(self, view):
    return 1 / 0


def _evicts_protected(self, view, layer, n, protected, incoming=None):
    return sorted(protected)[:n] if protected else []


def _evicts_too_many(self, view, layer, n, protected, incoming=None):
    return [e for e in sorted(view.cache.resident[layer]) if e not in protected]


def _evicts_absent(self, view, layer, n, protected, incoming=None):
    return [e for e in range(6) if e not in view.cache.resident[layer] and e not in protected][:n]


def _evicts_one_twice(self, view, layer, n, protected, incoming=None):
    free = [e for e in sorted(view.cache.resident[layer]) if e not in protected]
    return free[:1] * n if free and n > 1 else free[:n]


def _prefetch_layer_beyond(self, view):
    return [(view.layer + 40, 0)]


def _prefetch_expert_beyond(self, view):
    return [((view.layer + 1) % view.num_layers, 99)]


def _prefetch_ints(self, view):
    return [1, 2]


def _prefetch_twice(self, view):
    return [((view.layer + 1) % view.num_layers, 3)] * 2


def _prefetch_none(self, view):
    [((view.layer + 1) % view.num_layers, 3)]  # the return forgotten


def _clears_the_cache(self, view):
    view.cache.resident[view.layer].clear()
    return list(view.active), []


def _sorts_active(self, view):
    view.active.sort(reverse=True)
    return list(view.active), []


def _touch_adds(self, view, used):
    view.cache.resident[view.layer].add(5)


def _touch_pops(self, view, used):
    if len(used) > 1:
        used.pop()  # plan.gpu itself: the expert popped was never computed
    LRUCache.touch(self, view, used)


def _victims_sorts_protected(self, view, layer, n, protected, incoming=None):
    protected.clear()
    return []


BROKEN = {
    "gpu-and-cpu": (Assignment, "split", _both, r"expert \d+ twice \(on the GPU and on the CPU\)"),
    "leaves-one-out": (Assignment, "split", _leaves_one_out, r"leaves out routed expert"),
    "twice-on-gpu": (Assignment, "split", _twice_on_gpu, r"expert \d+ twice on the GPU"),
    "not-routed": (Assignment, "split", _not_routed, r"expert 99 not routed at this layer"),
    "one-list": (Assignment, "split", _one_list, r"returned \[.*\], not a pair \(gpu, cpu\)"),
    "no-return": (Assignment, "split", _no_return, r"returned None.*forget .return"),
    "raises": (Assignment, "split", _divides_by_zero, r"raised ZeroDivisionError: division by zero.*test_systems.py"),
    "mutates-cache": (Assignment, "split", _clears_the_cache, r"changed view.cache.resident\[\d\]"),
    "mutates-active": (Assignment, "split", _sorts_active, r"changed view.active"),
    "evicts-in-use": (CachePolicy, "victims", _evicts_protected, r"expert \d+, which is protected"),
    "evicts-too-many": (CachePolicy, "victims", _evicts_too_many, r"returned \d+ experts for n=\d"),
    "evicts-absent": (CachePolicy, "victims", _evicts_absent, r"expert \d+, which is not resident in layer \d"),
    "evicts-twice": (CachePolicy, "victims", _evicts_one_twice, r"expert \d+ twice"),
    "touch-mutates": (LRUCache, "touch", _touch_adds, r"changed view.cache.resident\[\d\]"),
    "touch-pops": (LRUCache, "touch", _touch_pops, r"changed its argument used"),
    "victims-clears": (CachePolicy, "victims", _victims_sorts_protected, r"changed its argument protected"),
    "prefetch-layer": (Prefetch, "candidates", _prefetch_layer_beyond, r"layer 4\d outside 0\.\.1"),
    "prefetch-expert": (Prefetch, "candidates", _prefetch_expert_beyond, r"expert 99 outside 0\.\.5"),
    "prefetch-ints": (Prefetch, "candidates", _prefetch_ints, r"returned 1 in its list, not a \(layer, expert\)"),
    "prefetch-twice": (Prefetch, "candidates", _prefetch_twice, r"\(\d, 3\) twice"),
    "prefetch-none": (Prefetch, "candidates", _prefetch_none, r"returned None.*forget .return"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_user_component_that_breaks_the_interface_is_one_line_naming_it(files, case):
    """Each gave a silent wrong result (an expert computed twice or never, one evicted while in use, the
    view changed under the engine, a forgotten return taken as nothing to prefetch) or a bare error from
    deep inside the engine (AssertionError, IndexError, KeyError, 'too many values to unpack')."""
    from moesim.policy.base import PolicyError
    base, method, body, words = BROKEN[case]
    role = base.role
    cls = user_component(base, f"broken-{case}", **{method: body})
    with pytest.raises(PolicyError, match=words) as caught:
        replay_with(files, **{role: f"broken-{case}"})
    text = str(caught.value)
    assert "\n" not in text
    assert f"{role} 'broken-{case}' ({cls.__name__}.{method})" in text  # who
    assert "at step " in text and ", layer " in text  # where
    assert "(fix: " in text  # how


def test_a_plan_of_a_users_own_system_class_is_checked(files):
    """A system class of one's own whose plan loaded into a full layer failed with an AssertionError deep in
    the engine; one that computed experts on the GPU that were never loaded ran, far too fast."""
    from moesim.policy.base import LayerPlan, PolicyError
    from moesim.policy.systems import ComposedSystem

    @dataclass
    class LoadsWithoutRoom(ComposedSystem):
        def plan(self, view):
            return LayerPlan(gpu=list(view.active),
                             loads=[e for e in view.active if e not in view.cache.resident[view.layer]])

    @dataclass
    class NeverLoads(ComposedSystem):
        def plan(self, view):
            return LayerPlan(gpu=list(view.active))

    @dataclass
    class NoPlan(ComposedSystem):
        def plan(self, view):
            return {"gpu": list(view.active)}

    register_system("loads-without-room", SystemSpec("", cache="lru", assign="gpu", system_class=LoadsWithoutRoom))
    register_system("never-loads", SystemSpec("", cache="lru", assign="gpu", system_class=NeverLoads))
    register_system("no-plan", SystemSpec("", cache="lru", assign="gpu", system_class=NoPlan))
    with pytest.raises(PolicyError, match=r"system 'loads-without-room' \(LoadsWithoutRoom.plan\).*loads \d+ "
                                          r"experts? into layer \d, which has \d free slots?"):
        replay_with(files, "loads-without-room")
    with pytest.raises(PolicyError, match=r"NeverLoads.plan.*GPU expert \d+ is neither resident"):
        replay_with(files, "never-loads")
    with pytest.raises(PolicyError, match=r"NoPlan.plan.*returned \{'gpu'.*not a LayerPlan"):
        replay_with(files, "no-plan")


def test_a_correct_user_component_runs_as_its_catalogue_twin(files):
    """A user's LRU (written as the notebook writes policies) and the catalogue's gpu-only-lru: the same
    metrics, decisions and timeline, the checks of a user's policy changing nothing."""
    from dataclasses import field

    import moesim

    @dataclass
    class MyLRU(CachePolicy):
        name = "my-lru"
        _last: list = field(default_factory=list)
        _clock: int = 0

        def configure(self, ctx):
            n = ctx.model.num_experts
            self._last = [{e: e - n for e in range(n)} for _ in ctx.capacity]
            self._clock = 0

        def victims(self, view, layer, n, protected, incoming=None):
            free = [e for e in view.cache.resident[layer] if e not in protected]
            return sorted(free, key=self._last[layer].__getitem__)[:n]

        def touch(self, view, used):
            for e in used:
                self._clock += 1
                self._last[view.layer][e] = self._clock

    register_component(MyLRU)
    register_system("my-gpu-lru", SystemSpec("mine", cache="my-lru", assign="gpu"))
    trace, hw = files
    for slots in (2, 3, 5):
        ours, theirs = (moesim.replay(trace, hw=hw, system=s, cache__slots_per_layer=slots)
                        for s in ("my-gpu-lru", "gpu-only-lru"))
        a, b = (r.metrics.drop(columns=["system", "sim_wall_s"]) for r in (ours, theirs))
        pd_testing = pytest.importorskip("pandas").testing
        pd_testing.assert_frame_equal(a, b)
        pd_testing.assert_frame_equal(ours.decisions, theirs.decisions)
        pd_testing.assert_frame_equal(ours.timeline, theirs.timeline)


@pytest.mark.parametrize("base, missing", [(Assignment, "split"), (Prefetch, "candidates"),
                                           (CachePolicy, "victims or initial")])
def test_a_user_component_without_its_roles_method_is_refused_before_the_run(files, base, missing):
    """An assignment without split failed at the first layer with a bare NotImplementedError from moesim's own
    assign.py; a prefetcher without candidates prefetched nothing and a cache with neither victims nor initial
    never evicted, both silently."""
    from moesim.policy.base import PolicyError
    name = f"without-{base.role}"
    cls = user_component(base, name)
    with pytest.raises(PolicyError, match=rf"{base.role} '{name}' \({cls.__name__}\): has no {missing} of its own"
                                          r".*fix: define "):
        replay_with(files, **{base.role: name})


def test_a_parameter_of_a_component_that_is_no_dataclass_is_named_with_the_fix(files):
    """Without @dataclass a component's annotated parameter is no parameter: setting it was refused as unknown
    to the component, offering another component that has a parameter of that name; unset, it was silently
    never a parameter."""
    class Forgotten(LRUCache):
        name = "forgot-dataclass"
        #: the user's parameter
        decay: float = 0.9

    register_component(Forgotten)
    with pytest.raises(ConfigError, match=r"Forgotten is no dataclass: its field decay is no parameter.*"
                                          r"fix: decorate the class with @dataclass"):
        replay_with(files, cache="forgot-dataclass")


def test_a_parameter_without_a_default_is_named_with_the_fix(files):
    """A parameter field without a default failed with "TypeError: __init__() missing 1 required positional
    argument" from moesim's build_system."""
    @dataclass
    class NoDefault(CachePolicy):
        name = "no-default"
        k: int

        def victims(self, view, layer, n, protected, incoming=None):
            return []

    register_component(NoDefault)
    with pytest.raises(ConfigError, match=r"cache 'no-default' \(NoDefault\) cannot be made with no arguments.*"
                                          r"'k'.*fix: give every field a default"):
        replay_with(files, cache="no-default")


def test_a_users_system_leaves_the_oracle_as_it_is():
    """The oracle ran every listed system, a user's own too: registering one changed the bound the user's
    system is measured against (and a fault in it stopped the oracle)."""
    from moesim.policy.systems import portfolio_members, system_names
    before = portfolio_members("oracle")
    register_system("my-listed", SystemSpec("mine", cache="lru", assign="gpu"))
    assert "my-listed" in system_names()  # moesim.sweep's systems: all runs it beside the catalogue
    assert portfolio_members("oracle") == before


@pytest.mark.parametrize("system, swap", [("smoe-flex", {"prefetch": "none"}), ("llamacpp-experts", {"assign": "gpu"}),
                                          ("smoe-flex", {"prefetch": "user-prefetch"})])
def test_a_component_swapped_for_one_without_the_systems_own_parameters_builds(system, swap):
    """smoe-flex sets prefetch.n and prefetch.flex_off_fraction of its smoe-token prefetcher, llamacpp-experts
    assign.op_offload_min_batch: swapping that component (`--set prefetch=none`, or a prefetcher of one's own)
    was refused as if the user had given those parameters ("field 'prefetch__n': prefetch 'none' of system
    'smoe-flex' has no parameter 'prefetch.n'")."""
    @dataclass
    class UserPrefetch(Prefetch):
        name = "user-prefetch"

        def candidates(self, view):
            return []

    register_component(UserPrefetch)
    (role, name), = swap.items()
    built = build_system(system, dict(swap))
    assert getattr(built, role).name == name
    with pytest.raises(ConfigError, match=r"has no parameter 'prefetch.n'"):  # one the user gives still counts
        build_system("smoe-flex", {"prefetch": "none", "prefetch.n": "2"})


def test_a_systems_own_parameters_still_apply_to_its_own_component():
    assert build_system("smoe-flex").prefetch.n == 3
    assert build_system("smoe-flex", {"prefetch.n": "5"}).prefetch.n == 5


def test_a_system_class_that_is_no_composed_system_is_refused_at_registration():
    """system_class=SomethingElse failed at the first replay with a TypeError from build_system."""
    class Planner:
        def plan(self, view):
            return None

    with pytest.raises(ConfigError, match=r"system_class.*Planner.*subclass ComposedSystem"):
        register_system("my-planner", SystemSpec("mine", cache="lru", assign="gpu", system_class=Planner))
    assert "my-planner" not in SYSTEMS


def test_a_system_naming_an_unknown_component_is_refused_when_registered():
    """register_system accepted any name; the error came at the first run, as field 'cache' of a call that
    never named a cache."""
    with pytest.raises(ConfigError) as caught:
        register_system("mine-unknown", SystemSpec("mine", cache="lur", assign="gpu"))
    assert caught.value.field == "SystemSpec.cache" and "no cache component is registered as 'lur'" in str(caught.value)
    assert "lru" in caught.value.fix and "mine-unknown" not in SYSTEMS


@pytest.mark.parametrize("defaults, words", [
    ({"cache.decay": "0.5"}, "defaults {'cache.decay': '0.5'} are not (key, value) pairs"),
    (("cache.decay", "0.5"), "are not (key, value) pairs"),
    ((("cache.dacay", "0.5"),), "its defaults cache.dacay=0.5: unknown parameter 'cache.dacay' for system "
                                "'mine-defaults'"),
    ((("cache.decay", "abc"),), "its defaults cache.decay=abc: 'abc' is not a valid float"),
    ((("cache", "lur"),), "its defaults cache=lur: unknown cache component 'lur'"),
])
def test_a_systems_defaults_that_cannot_apply_are_refused_when_registered(defaults, words):
    """A dict of defaults failed at the first run as an internal error (ValueError: too many values to unpack,
    exit 1); a slip in a key or a value was refused then as field '--set', a setting the user never gave."""
    @register_component
    @dataclass
    class DecayCache(LRUCache):
        name = "decay-for-defaults"
        decay: float = 0.9

    with pytest.raises(ConfigError) as caught:
        register_system("mine-defaults", SystemSpec("mine", cache="decay-for-defaults", assign="gpu",
                                                    defaults=defaults))
    assert caught.value.field == "SystemSpec.defaults" and words in str(caught.value), str(caught.value)
    assert "mine-defaults" not in SYSTEMS


def test_a_systems_defaults_that_apply_are_registered_and_set():
    """Defaults of the components, of a swapped component and of the run's set-up are taken as before; a
    system registered again keeps its earlier spec when the new one is refused."""
    @register_component
    @dataclass
    class DecayCache(LRUCache):
        name = "decay-for-defaults"
        decay: float = 0.9

    spec = SystemSpec("mine", cache="decay-for-defaults", assign="gpu",
                      defaults=(("cache.decay", "0.5"), ("engine.staging_slots", "1"), ("memory.workspace_gib", "1")))
    register_system("mine-defaults", spec)
    assert build_system("mine-defaults").cache.decay == 0.5
    with pytest.raises(ConfigError):
        register_system("mine-defaults", SystemSpec("mine", cache="decay-for-defaults", assign="gpu",
                                                    defaults=(("cache.decay", "x"),)))
    assert SYSTEMS["mine-defaults"] is spec
    register_system("mine-swapped", SystemSpec("mine", cache="lru", assign="gpu",
                                               defaults=(("cache", "decay-for-defaults"), ("cache.decay", "0.25"))))
    assert build_system("mine-swapped").cache.decay == 0.25


def test_a_system_name_another_module_registered_is_refused():
    """Two modules of one's own that both registered 'mine' (moesim --import a.py --import b.py) ran the second's
    system under the name without a word; the same module registering it again still replaces it."""
    register_system("mine-taken", SystemSpec("first", cache="lru", assign="gpu"))
    code = "register_system('mine-taken', SystemSpec('second', cache='lru', assign='cpu'))"
    with pytest.raises(ConfigError) as caught:
        exec(code, {"__name__": "other_policies", "register_system": register_system, "SystemSpec": SystemSpec})
    assert str(caught.value) == (
        f"field 'name': system 'mine-taken' is already registered by module {__name__} ('first'); "
        "module other_policies cannot take its name (fix: register one of them under another name, e.g. "
        "'mine-taken-2')")
    assert SYSTEMS["mine-taken"].description == "first"
    register_system("mine-taken", SystemSpec("again", cache="lru", assign="cpu"))
    assert SYSTEMS["mine-taken"].description == "again"


def test_a_frozen_dataclass_component_is_refused_when_registered():
    """A component decorated @dataclass(frozen=True) registered, then failed as an internal error at its first
    --set (FrozenInstanceError), or at configure when it kept state; and its methods could not be checked."""
    from moesim.policy.cache import CachePolicy

    with pytest.raises(ConfigError) as caught:
        @register_component
        @dataclass(frozen=True)
        class FrozenCache(CachePolicy):
            name = "frozen-cache"
            k: int = 1

            def victims(self, view, layer, n, protected, incoming=None):
                return []

    assert str(caught.value) == ("field 'name': FrozenCache is a frozen dataclass: its parameters cannot be set, nor "
                                 "its state kept (fix: decorate it with @dataclass, not @dataclass(frozen=True))")
    assert "frozen-cache" not in COMPONENTS["cache"]


@pytest.mark.parametrize("key, option", [("seed", "--seed 3"), ("hw", "--hw rtx4090"), ("system", "--system smoe")])
def test_a_command_option_given_as_a_setting_is_told_its_option(key, option):
    """--set seed=3 listed every parameter of the system, none of them the seed."""
    with pytest.raises(ConfigError, match=f"unknown parameter '{key}' for system 'gpu-only-lru': {key} is an "
                                          "option of its own") as refused:
        build_system("gpu-only-lru", {key: "3"})
    assert refused.value.fix == f"give it as {option}"
