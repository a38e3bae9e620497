"""What the CLI lists: `moesim systems` (as a table and as JSON), the systems `replay --system all` skipped, and the
bundled presets, profiles and option help of the commands."""

from __future__ import annotations

import json

import pytest

from moesim.cli import main
from tests.cli.test_replay_outputs import run


def test_systems_as_json_list_every_system_and_a_systems_parameters(capsys):
    from moesim.policy.systems import SYSTEMS
    code, out, _ = run(["systems", "--json", "-"], capsys)
    listed = json.loads(out)
    assert code == 0 and [s["name"] for s in listed] == list(SYSTEMS)
    smoe = next(s for s in listed if s["name"] == "smoe")
    assert (smoe["cache"], smoe["assign"], smoe["prefetch"], smoe["portfolio"]) == ("smoe-lfu", "smoe", "smoe-token", [])
    oracle = next(s for s in listed if s["name"] == "oracle")
    assert "oracle-pinned" in oracle["portfolio"] and "cache" not in oracle
    code, out, _ = run(["systems", "smoe", "--json", "-"], capsys)
    one = json.loads(out)
    assert code == 0 and {"role": "cache", "component": "smoe-lfu"}.items() <= one["components"][0].items()
    n = next(p for p in one["parameters"] if p["key"] == "prefetch.n")
    assert (n["default"], n["type"]) == (-1, "int") and "Table I" in n["meaning"]


@pytest.mark.parametrize("system, key, default", [("smoe-flex", "prefetch.n", 3),
                                                  ("smoe-flex", "prefetch.flex_off_fraction", 0.5),
                                                  ("fiddler", "engine.staging_slots", 1)])
def test_a_systems_own_default_is_a_json_value_of_its_type(capsys, system, key, default):
    """Issue: `moesim systems smoe-flex --json -` gave prefetch.n's default as "3" (the string of the system's
    own --set default) where smoe's reads -1, so `jq '.default > 2'` failed on a string; every default of an
    int, float or bool parameter is now a number or a boolean."""
    code, out, _ = run(["systems", system, "--json", "-"], capsys)
    parameters = json.loads(out)["parameters"]
    assert code == 0 and next(p["default"] for p in parameters if p["key"] == key) == default
    assert not [p for p in parameters if p["type"] in ("int", "float", "bool") and isinstance(p["default"], str)]


def test_replay_listings_with_json_to_stdout_print_json_only(capsys):
    """`replay --help-metrics --json -` and `--help-params --json -` printed their tables on stdout (jq failed)."""
    from moesim.analysis.metrics import METRIC_DOCS
    code, out, _ = run(["replay", "--help-metrics", "--json", "-"], capsys)
    assert code == 0 and json.loads(out).keys() == METRIC_DOCS.keys()
    assert json.loads(out)["ttft_ms"]["unit"] == "ms"
    code, out, _ = run(["replay", "--system", "smoe", "--help-params", "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["name"] == "smoe"
    code, out, _ = run(["replay", "--system", "smoe,dali", "--help-params", "--json", "-"], capsys)
    assert code == 0 and [s["name"] for s in json.loads(out)] == ["smoe", "dali"]


def test_systems_skipped_for_one_reason_are_one_line():
    """17 systems that do not fit one GPU read as one line, not 17 copies of the memory arithmetic."""
    import io

    from rich.console import Console

    from moesim.cli.app import print_skipped
    stream = io.StringIO()
    print_skipped(Console(file=stream, width=400), {"cpu-only": "does not fit [1]", "smoe": "does not fit [1]",
                                                     "importance": "needs scores"}, 18)
    assert stream.getvalue().splitlines() == ["skipped cpu-only, smoe: does not fit [1]",
                                              "skipped importance: needs scores",
                                              "3 of 18 systems skipped (reasons above; in --json, each under its name "
                                              "with its reason as 'skipped')"]


def _bundled(kind: str) -> list[str]:
    from moesim.hw.profile import available_profiles
    from moesim.model.presets import available_presets
    return available_presets() if kind == "Presets" else available_profiles()


@pytest.mark.parametrize("command, kind", [(["replay"], "Presets"), (["trace", "synth"], "Presets"),
                                           (["profile"], "Presets"), (["replay"], "Profiles"),
                                           (["serve-sim"], "Profiles")])
def test_model_and_hw_options_list_what_is_bundled_in_their_help(command, kind, capsys):
    assert main([*command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # click wraps the help: compare with spaces collapsed
    assert f"{kind}: " + ", ".join(_bundled(kind)) + "." in text


def test_systems_name_lists_cache_slots_runtime_and_the_dtypes(files, capsys):
    """`moesim systems NAME` lists every --set parameter: cache.slots and runtime were missing (the README
    documents both), and the dtype parameters did not say which dtypes they take."""
    code, out, _ = run(["systems", "smoe", "--json", "-"], capsys)
    params = {p["key"]: p for p in json.loads(out)["parameters"]}
    assert code == 0
    assert params["cache.slots"]["default"] is None and params["cache.slots"]["unit"] == "experts"
    assert "spread over the layers" in params["cache.slots"]["meaning"]
    assert params["runtime"]["default"] == "ktransformers-eager"  # smoe's own
    assert "generic" in params["runtime"]["meaning"] and "ideal" in params["runtime"]["meaning"]
    for key in ("memory.non_expert_dtype", "memory.expert_dtype"):
        assert params[key]["meaning"].endswith("; one of bf16, fp16, fp8, int8, int4")
    code, out, _ = run(["systems", "buddymoe", "--json", "-"], capsys)
    last = json.loads(out)["parameters"][-1]
    assert (last["key"], last["default"]) == ("runtime", "llamacpp")
    code, out, _ = run(["systems", "smoe"], capsys)
    flat = " ".join(out.split())
    assert "│ cache.slots │" in flat and "│ runtime │ ktransformers-eager │" in flat
    # each is a --set parameter replay takes
    trace, hw = files
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "smoe", "--set", "cache.slots=4",
                          "--set", "runtime=ideal"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("command", ["replay", "systems"])
def test_every_option_says_what_it_does(command):
    """--seed had no help: `moesim replay --help` showed its range and default only."""
    from moesim.cli.app import cli
    options = [p for p in cli.commands[command].params if p.param_type_name == "option"]
    assert [p.name for p in options if not (p.help or "").strip()] == []
