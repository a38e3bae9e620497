"""Errors of the Python API in a Python caller's words: an argument (``system=``, ``settings={...}``), never a
command-line option (``--set``, ``--system``), while the command line keeps its own; a short or misspelt
parameter gets the full key it looks like; a parameter given twice is named both ways it was written."""

from __future__ import annotations

import re

import pytest
import yaml

import moesim
from moesim.api import SweepPointsFailed
from moesim.api_args import python_wording
from moesim.cli import main
from moesim.errors import ConfigError
from tests.factories import write_trace_and_profile


@pytest.fixture
def files(tmp_path):
    return write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)


@pytest.mark.parametrize("cli, python", [
    ("use --set substitute.k_max=16", "use settings={'substitute.k_max': 16}"),
    ("--set cache.w_size=4 --set cache.u_size=8 (-1: default)", "settings={'cache.w_size': 4, 'cache.u_size': 8} "
                                                               "(-1: default)"),
    ("choose one with --set cache=score-history as well", "choose one with settings={'cache': 'score-history'} as well"),
    ("write --set KEY=VALUE, e.g. --set cache.slots_per_layer=[2,1]",
     "write settings={KEY: VALUE}, e.g. settings={'cache.slots_per_layer': [2,1]}"),
    ("--set engine.timeline=false", "settings={'engine.timeline': False}"),
    ("serve at most 9 requests per run (--requests)", "serve at most 9 requests per run (requests=)"),
    ("pass --system NAME", "pass system=NAME"),
    ("or use --engine local", "or use engine='local'"),
    ("start it (ray start --head on HEAD_IP)", "start it (ray start --head on HEAD_IP)"),  # no API argument: kept
    ("registered by importing its module: moesim --import my_policies.py ..., or",
     "registered by importing its module: import my_policies, or"),
    ("seeds are not a --set parameter", "seeds are not a parameter"),
])
def test_python_wording_says_a_command_line_fix_as_arguments(cli, python):
    assert python_wording(cli) == python


def test_a_sweep_spec_takes_settings_under_set():
    assert python_wording("use --set cache.n=8", settings="'set': ") == "use 'set': {'cache.n': 8}"


def no_option(text: str) -> bool:
    """Whether ``text`` names no command-line option (a ``--`` word)."""
    return re.search(r"(^|[\s(])--[a-z]", text) is None


@pytest.mark.parametrize("call, words", [
    # a component's fix: --set cache=score-history, `moesim systems NAME` aside
    (lambda t, hw: moesim.replay(t, hw=hw, system="smoe", cache__n=3),
     "choose one with settings={'cache': 'score-history'} as well"),
    (lambda t, hw: moesim.replay(t, hw=hw, system="buddymoe", substitute__k_max=0),
     "fix: settings={'substitute.k_max': 16}"),
    # the command line's --import
    (lambda t, hw: moesim.replay(t, hw=hw, system="nosuch"), "registered by importing its module: import my_policies"),
    (lambda t, hw: moesim.serve(t, hw=hw, system="nosuch"), "registered by importing its module: import my_policies"),
    # --requests
    (lambda t, hw: moesim.serve(t, hw=hw, requests=10**12), "requests per run (requests=), or split"),
    # a sweep's own line and a parameter's fix there
    (lambda t, hw: moesim.sweep({"traces": [t], "hw": [hw], "systems": ["cpu-only"], "set": {"seed": 1}}),
     "seeds are not a parameter"),
    (lambda t, hw: moesim.sweep({"traces": [t], "hw": [hw], "systems": ["nosuch"]}), "import my_policies"),
    # an unknown parameter: where to list a system's parameters
    (lambda t, hw: moesim.replay(t, hw=hw, system="smoe", nonsense__x=1),
     "cache.slots_per_layer (moesim.systems('smoe') lists them all)"),
    # a slot list's fix, written by the engine's settings parser: the value alone, right in every front end
    (lambda t, hw: moesim.replay(t, hw=hw, settings={"cache.slots_per_layer": "2,,1"}),
     "fix: write one whole number for every layer or a list of one per layer, e.g. 2 or [2,1,2,...]"),
])
def test_api_errors_give_their_fix_as_python_arguments(files, call, words):
    trace, hw = files
    with pytest.raises(ConfigError) as err:
        call(trace, hw)
    assert words in str(err.value) and no_option(str(err.value)), str(err.value)


def test_the_command_line_keeps_its_options(files, capsys):
    trace, hw = files
    assert main(["replay", trace, "--hw", hw, "--system", "buddymoe", "--set", "substitute.k_max=0"]) == 2
    assert "fix: --set substitute.k_max=16" in capsys.readouterr().err
    assert main(["replay", trace, "--hw", hw, "--system", "nosuch"]) == 2
    assert "moesim --import my_policies.py ..." in capsys.readouterr().err
    assert main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2,,1"]) == 2
    assert "fix: write one whole number for every layer or a list of one per layer, e.g. 2 or [2,1,2,...]" in \
        capsys.readouterr().err


def test_a_host_memory_refusal_names_requests_as_each_front_end_takes_it(files, tmp_path, capsys):
    """serve-sim takes --requests, moesim.serve requests=, a sweep spec workload.requests: a sweep point's
    refusal said "(--requests)", an option no spec has."""
    trace, hw = files
    fix = "requests per run ({}), or split the load into runs"
    assert main(["serve-sim", trace, "--hw", hw, "--system", "cpu-only", "--requests", str(10**12)]) == 2
    assert fix.format("--requests") in capsys.readouterr().err
    spec = {"traces": [trace], "hw": [hw], "systems": ["cpu-only"], "grid": {"workload.requests": [10**12]}}
    with pytest.warns(SweepPointsFailed) as warned:
        frame = moesim.sweep(spec)
    error = frame["error"].iloc[0]
    assert fix.format("workload.requests") in error and no_option(error), error
    assert fix.format("workload.requests") in str(warned[0].message) and no_option(str(warned[0].message))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "r.parquet"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert fix.format("workload.requests") in err and no_option(err) and err.count("\n") == 1, err
    # only serve-sim's options, whole: --requests-out is no --requests
    from moesim.sim.serving import spec_wording
    assert spec_wording("(--requests) at --qps 2 on --hw; --requests-out") == \
        "(workload.requests) at workload.qps 2 on hw; --requests-out"


@pytest.mark.parametrize("call, meant", [
    (lambda t, hw: moesim.serve(t, hw=hw, requests=2, settings={"qps": 1}), "workload.qps"),
    (lambda t, hw: moesim.serve(t, hw=hw, requests=2, settings={"qsp": 1}), "workload.qps"),
    (lambda t, hw: moesim.serve(t, hw=hw, requests=2, workoad__qps=1), "workload.qps"),
    (lambda t, hw: moesim.replay(t, hw=hw, settings={"timeline": False}), "engine.timeline"),
    (lambda t, hw: moesim.replay(t, hw=hw, settings={"slots_per_layer": 2}), "cache.slots_per_layer"),
    (lambda t, hw: moesim.sweep({"traces": [t], "hw": [hw], "systems": ["cpu-only"], "set": {"qps": 1}}),
     "workload.qps"),
])
def test_a_short_or_misspelt_key_gets_the_full_key(files, call, meant):
    """settings={'qps': 1} listed every parameter of the system and guessed none (the system's own check knows
    its components' keys, and those whole)."""
    trace, hw = files
    with pytest.raises(ConfigError) as err:
        call(trace, hw)
    assert f"fix: did you mean {meant}? " in str(err.value)


def test_the_command_line_guesses_the_full_key_too(files, capsys):
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--set", "qps=1"]) == 2
    assert "fix: did you mean workload.qps? " in capsys.readouterr().err
    assert main(["replay", trace, "--hw", hw, "--set", "qps=1"]) == 2  # a replay reads no workload
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, words, field", [
    ({"qps": 1, "workload__qps": 2}, "qps=1 and workload__qps=2 both set parameter 'workload.qps'", "qps"),
    ({"requests": 2, "settings": {"workload.requests": 3}},
     "requests=2 and settings={'workload.requests': 3} both set parameter 'workload.requests'", "requests"),
    ({"settings": {"cache.slots": 2}, "cache__slots": 3},
     "settings={'cache.slots': 2} and cache__slots=3 both set parameter 'cache.slots'", "cache.slots"),
])
def test_a_parameter_given_twice_names_both_spellings(files, kwargs, words, field):
    """serve(qps=1, workload__qps=2) said "parameter 'workload.qps' given twice", naming neither."""
    trace, hw = files
    with pytest.raises(ConfigError) as err:
        moesim.serve(trace, hw=hw, **kwargs)
    assert words in str(err.value) and err.value.field == field


@pytest.mark.parametrize("cli, python", [
    ("(`moesim systems NAME` lists a system's parameters)", "(moesim.systems(NAME) lists a system's parameters)"),
    ("serve an online system (see `moesim systems`)", "serve an online system (see moesim.systems())"),
    ("`moesim systems smoe-flex` lists them", "moesim.systems('smoe-flex') lists them"),
])
def test_the_systems_listing_is_named_as_the_api_call(cli, python):
    assert python_wording(cli) == python


def test_systems_lists_every_system_and_one_systems_parameters():
    from moesim.analysis.params import system_record
    from moesim.policy.systems import SYSTEMS
    listing = moesim.systems()
    assert list(listing["name"]) == list(SYSTEMS)
    assert listing.set_index("name").loc["smoe", ["cache", "assign", "prefetch"]].tolist() == \
        ["smoe-lfu", "smoe", "smoe-token"]
    assert list(listing.set_index("name").loc["oracle", "portfolio"]) == list(SYSTEMS["oracle"].portfolio)
    params = moesim.systems("smoe-flex")
    record = system_record("smoe-flex")
    assert params.to_dict("records") == record["parameters"]
    # a system's own default as a value of its type (smoe-flex prefetches 3 per layer; smoe reads -1)
    assert params.set_index("key").loc["prefetch.n", "default"] == 3
    assert params.attrs["components"][0] == {**record["components"][0]} and params.attrs["name"] == "smoe-flex"


def test_systems_of_an_unknown_name_is_an_api_error():
    with pytest.raises(ConfigError) as err:
        moesim.systems("smoee")
    assert err.value.field == "name" and "did you mean smoe?" in str(err.value)
    assert no_option(str(err.value)), str(err.value)
