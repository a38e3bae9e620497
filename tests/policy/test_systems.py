"""Systems and the registries: a user's own components and systems beside the catalogue."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moesim.errors import ConfigError
from moesim.policy.assign import Assignment
from moesim.policy.cache import CachePolicy, LRUCache
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
