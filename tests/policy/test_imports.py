"""Policies of one's own from the command line and sweep specs: ``--import`` and ``import:``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.policy import systems as registry
from moesim.policy.imports import import_policies
from tests.factories import random_routing, tiny_model, write_tiny_trace

POLICY = textwrap.dedent('''
    from dataclasses import dataclass

    from moesim.policy.cache import LRUCache
    from moesim.policy.systems import SystemSpec, register_component, register_system


    @register_component
    @dataclass
    class {cls}(LRUCache):
        """LRU under a name of its own."""

        name = "{component}"


    register_system("{system}", SystemSpec("LRU of one's own on the GPU", cache="{component}", assign="gpu"))
''')


def _policy_file(folder: Path, stem: str) -> Path:
    """A module registering a system ``{stem}-sys`` that is gpu-only-lru under other names."""
    path = folder / f"{stem}.py"
    path.write_text(POLICY.format(cls=f"Cache_{stem}", component=f"{stem}-lru", system=f"{stem}-sys"))
    return path


@pytest.fixture
def forget(tmp_path):
    """Leave the registries, sys.path and the test's own modules as they were (each test registers under
    names of its own; modules the run imported lazily, pandas' say, stay)."""
    systems, modules, path = dict(registry.SYSTEMS), set(sys.modules), list(sys.path)
    components = {role: dict(names) for role, names in registry.COMPONENTS.items()}
    yield
    registry.SYSTEMS.clear()
    registry.SYSTEMS.update(systems)
    for role, names in components.items():
        registry.COMPONENTS[role].clear()
        registry.COMPONENTS[role].update(names)
    for name in set(sys.modules) - modules:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    sys.path[:] = path


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    import numpy as np
    model = tiny_model(layers=3, experts=8, top_k=2)
    path = tmp_path_factory.mktemp("imports") / "t.parquet"
    return str(write_tiny_trace(path, model, random_routing(np.random.default_rng(3), model, 2, 6, 8)))


def _metrics(path: Path) -> dict:
    got = json.loads(path.read_text())
    return {k: v for k, v in got.items() if k not in {"system", "sim_wall_s", "sim_rows_per_s", "wall_s",
                                                      "description", "components"}}


@pytest.mark.parametrize("where", ["before", "after", "equals"])
def test_a_system_of_ones_own_replays_from_the_command_line(tmp_path, trace, forget, where, capsys):
    """It was 'unknown system': nothing on the command line could register one."""
    module = _policy_file(tmp_path, f"mine_{where}")
    out, reference = tmp_path / "m.json", tmp_path / "ref.json"
    command = ["replay", trace, "--system", f"mine_{where}-sys", "--set", "cache.slots_per_layer=3",
               "--json", str(out)]
    args = {"before": ["--import", str(module), *command], "after": [*command, "--import", str(module)],
            "equals": [f"--import={module}", *command]}[where]
    assert main(args) == 0, capsys.readouterr().err
    assert main(["replay", trace, "--system", "gpu-only-lru", "--set", "cache.slots_per_layer=3",
                 "--json", str(reference)]) == 0
    assert _metrics(out) == _metrics(reference)  # LRU under another name: the same run
    assert json.loads(out.read_text())["system"] == f"mine_{where}-sys"


def test_an_unknown_system_says_how_to_bring_ones_own(trace, capsys):
    assert main(["replay", trace, "--system", "my-own"]) == 2
    err = capsys.readouterr().err
    assert "unknown system 'my-own'" in err and "--import my_policies.py" in err and err.count("\n") == 1


@pytest.mark.parametrize("source, words", [
    ("def broken(:\n", "importing '{name}' failed at {stem}.py:1: SyntaxError"),
    ("x = 1\nraise ValueError('no slots here')\n", "importing '{name}' failed at {stem}.py:2: ValueError: no slots"),
    ("import not_a_module_anywhere\n", "failed at {stem}.py:1: ModuleNotFoundError"),
    ("from moesim.policy.systems import SystemSpec, register_system\n"
     "register_system('gpu-only-lru', SystemSpec('mine', cache='lru', assign='gpu'))\n",
     "{stem}.py:2, field 'name': 'gpu-only-lru' is a catalogue system"),  # the refusal named neither file nor line
    ("from dataclasses import dataclass\nfrom moesim.policy.cache import LRUCache\n"
     "from moesim.policy.systems import register_component\n"
     "@register_component\n@dataclass\nclass Mine(LRUCache):\n    name = 'lru'\n",
     "{stem}.py:4, field 'name': cache 'lru' is a catalogue component"),
])
def test_a_module_that_fails_to_import_is_one_line(tmp_path, trace, forget, capsys, source, words):
    stem = f"bad_{abs(hash(source)) % 10_000}"
    path = tmp_path / f"{stem}.py"
    path.write_text(source)
    assert main(["--import", str(path), "replay", trace]) == 2
    err = capsys.readouterr().err
    assert words.format(name=path, stem=stem) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("args, words", [
    (["--import", "missing_policies.py"], "'missing_policies.py': not found"),
    (["--import", "no_such_module_anywhere"], "no module named 'no_such_module_anywhere'"),
    (["--import", "random.py"], "a module named 'random' is imported already"),
    (["--import", "my-policies.py"], "'my-policies' is no Python module name"),
    (["--import"], "--import needs a value"),
])
def test_what_cannot_be_imported_is_one_line(tmp_path, monkeypatch, trace, forget, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    for name in ("random.py", "my-policies.py"):
        (tmp_path / name).write_text("x = 1\n")
    assert main([*args, "replay", trace] if len(args) > 1 else ["replay", trace, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_importing_the_same_file_twice_imports_it_once(tmp_path, forget):
    module = _policy_file(tmp_path, "twice")
    assert import_policies([str(module), str(module)]) == ["twice", "twice"]
    assert "twice-sys" in registry.SYSTEMS


def test_a_module_name_is_found_in_the_given_folder(tmp_path, forget):
    package = tmp_path / "labpolicies"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _policy_file(package, "caches")
    assert import_policies(["labpolicies.caches"], base_dir=tmp_path) == ["labpolicies.caches"]
    assert "caches-sys" in registry.SYSTEMS


def test_a_sweep_spec_imports_its_policies_relative_to_itself(tmp_path, trace, forget, capsys):
    """2 workers, forked after the import: each point of the user's system runs and matches LRU's."""
    import pandas as pd
    folder = tmp_path / "spec"
    folder.mkdir()
    _policy_file(folder, "spec_policies")
    spec = folder / "sweep.yaml"
    spec.write_text(f"import: [spec_policies.py]\ntraces: [{trace}]\nsystems: [spec_policies-sys, gpu-only-lru]\n"
                    "grid: {cache.slots_per_layer: [2, 3]}\n")
    out = tmp_path / "rows.parquet"
    assert main(["sweep", str(spec), "--out", str(out), "--workers", "2"]) == 0, capsys.readouterr().err
    rows = pd.read_parquet(out)
    assert (rows.status == "ok").all() and len(rows) == 4
    by = rows.set_index(["system", "cache.slots_per_layer"]).tpot_ms_mean
    for slots in (2, 3):
        assert by["spec_policies-sys", slots] == by["gpu-only-lru", slots]


def test_a_sweep_spec_import_that_is_no_name_is_one_line(tmp_path, trace):
    from moesim.sweep.spec import load_spec
    spec = tmp_path / "s.yaml"
    spec.write_text(f"import: [{{a: 1}}]\ntraces: [{trace}]\nsystems: [cpu-only]\n")
    with pytest.raises(ConfigError, match=r"field 'import'.*is not a module"):
        load_spec(spec)


def test_modules_of_names_each_class_module_with_the_folder_it_is_imported_from(tmp_path, monkeypatch):
    """A Ray worker imports these before it unpickles the classes: a module of its own folder, a package's
    module (its package's folder), a package's __init__; never __main__ or moesim's own."""
    import importlib
    import sys

    from moesim.policy.cache import LRUCache
    from moesim.policy.imports import modules_of
    (tmp_path / "solo_mod.py").write_text("class A: pass\n")
    (tmp_path / "lab_pkg" / "sub").mkdir(parents=True)
    (tmp_path / "lab_pkg" / "__init__.py").write_text("class B: pass\n")
    (tmp_path / "lab_pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "lab_pkg" / "sub" / "deep.py").write_text("class C: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    solo, pkg, deep = (importlib.import_module(m) for m in ("solo_mod", "lab_pkg", "lab_pkg.sub.deep"))
    main_class = type("D", (), {"__module__": "__main__"})
    try:
        entries = modules_of([solo.A, pkg.B, deep.C, deep.C, main_class, LRUCache])
    finally:
        for name in ("solo_mod", "lab_pkg", "lab_pkg.sub", "lab_pkg.sub.deep"):
            sys.modules.pop(name, None)
    root = str(tmp_path.resolve())
    assert entries == [("solo_mod", root), ("lab_pkg", root), ("lab_pkg.sub.deep", root)]


def test_own_registrations_register_again_in_a_fresh_registry(monkeypatch):
    """What a Ray worker registers: the components and systems beyond the catalogue, with the module that
    registered each system."""
    from dataclasses import dataclass

    from moesim.policy import systems
    from moesim.policy.cache import LRUCache

    monkeypatch.setattr(systems, "COMPONENTS", {role: dict(r) for role, r in systems.COMPONENTS.items()})
    monkeypatch.setattr(systems, "SYSTEMS", dict(systems.SYSTEMS))
    monkeypatch.setattr(systems, "REGISTERED_BY", dict(systems.REGISTERED_BY))
    catalogue = (len(systems.COMPONENTS["cache"]), len(systems.SYSTEMS))

    @dataclass
    class OwnLRU(LRUCache):
        name = "own-lru-again"

    systems.register_component(OwnLRU)
    systems.register_system("own-again", systems.SystemSpec("mine", cache="own-lru-again", assign="gpu"))
    entries = systems.own_registrations()
    assert [kind for kind, _ in entries] == ["component", "system"]
    assert entries[0][1] is OwnLRU and entries[1][1][0] == "own-again"
    assert entries[1][1][2] == __name__  # the module that registered it
    # a worker's registry: the catalogue alone
    systems.COMPONENTS["cache"].pop("own-lru-again")
    systems.SYSTEMS.pop("own-again")
    systems.REGISTERED_BY.pop("own-again")
    assert (len(systems.COMPONENTS["cache"]), len(systems.SYSTEMS)) == catalogue
    systems.register_again(entries)
    assert systems.COMPONENTS["cache"]["own-lru-again"] is OwnLRU
    assert systems.build_system("own-again").cache.name == "own-lru-again"
    assert systems.REGISTERED_BY["own-again"] == __name__
