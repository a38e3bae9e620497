"""`moesim sweep` specs: grid, zip and axes expansion, point ids, and spec mistakes in one line naming where the spec
gives them."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.sweep import Point, load_spec, parse_spec


# ----------------------------------------------------------------------------- spec
def test_grid_zip_and_axes_expand_to_their_product(tmp_path):
    spec = parse_spec({"traces": ["a.parquet", "b.parquet"], "hw": "rtx4090", "systems": ["cpu-only", "gpu-only-lru"],
                       "seeds": [0, 1], "set": {"engine__staging_slots": 3},
                       "grid": {"cache__slots_per_layer": [1, 2, 4]},
                       "zip": [{"hw.pcie.bandwidth_scale": [0.5, 1.0], "engine.kernels_per_expert": [3, 1]}]},
                      source="s", base_dir=tmp_path)
    points = spec.points()
    assert len(points) == 2 * 1 * 2 * 2 * 3 * 2 == 48
    assert len({p.point_id for p in points}) == 48
    first = points[0]
    assert (first.trace, first.hw, first.system, first.seed) == ("a.parquet", "rtx4090", "cpu-only", 0)
    assert dict(first.settings) == {"engine.staging_slots": 3, "cache.slots_per_layer": 1,
                                    "hw.pcie.bandwidth_scale": 0.5, "engine.kernels_per_expert": 3}
    zipped = {(dict(p.settings)["hw.pcie.bandwidth_scale"], dict(p.settings)["engine.kernels_per_expert"])
              for p in points}
    assert zipped == {(0.5, 3), (1.0, 1)}  # zipped, not crossed
    assert spec.parameter_keys() == ["engine.staging_slots", "cache.slots_per_layer", "hw.pcie.bandwidth_scale",
                                     "engine.kernels_per_expert"]


def test_a_spec_file_reads_exponent_notation_as_numbers(tmp_path):
    """A grid of ``2.5e-1`` and ``1e-1`` is a grid of numbers (YAML 1.1 would keep them as text and a plot
    would order them as text)."""
    path = tmp_path / "spec.yaml"
    path.write_text("trace: t.parquet\nsystem: cpu-only\ngrid: {hw.pcie.bandwidth_scale: [2.5e-1, 1e-1, 0.75]}\n")
    values = [dict(p.settings)["hw.pcie.bandwidth_scale"] for p in load_spec(path).points()]
    assert values == [0.25, 0.1, 0.75] and all(isinstance(v, float) for v in values)


def test_a_grid_value_written_twice_in_two_spellings_is_one_point(tmp_path):
    """[1, 1.0] ran the same replay twice, as two rows with two point ids; the first spelling stays, so the
    point keeps the id it had."""
    base = {"trace": "t.parquet", "system": "gpu-only-lru",
            "per_system": {"gpu-only-lru": {"grid": {"prefetch.n": [2, 2.0]}}}}
    spec = parse_spec({**base, "grid": {"hw.pcie.bandwidth_scale": [1, 1.0, "1.0", 0.5]}}, source="s",
                      base_dir=tmp_path)
    assert [dict(p.settings) for p in spec.points()] == [{"hw.pcie.bandwidth_scale": b, "prefetch.n": 2}
                                                         for b in (1, 0.5)]
    once = parse_spec({**base, "grid": {"hw.pcie.bandwidth_scale": [1, 0.5]}}, source="s", base_dir=tmp_path)
    assert [p.point_id for p in spec.points()] == [p.point_id for p in once.points()]
    names = parse_spec({"trace": "t.parquet", "system": "gpu-only-lru", "grid": {"cache": ["lru", "belady", "lru"]}},
                       source="s", base_dir=tmp_path)
    assert [dict(p.settings)["cache"] for p in names.points()] == ["lru", "belady"]


def test_a_trace_or_profile_written_two_ways_is_one_point(files):
    """The same trace as t.parquet, ./t.parquet, its absolute path and a symlink ran the same replay four times,
    four rows under four point ids (so did a profile as hw.yaml and ./hw.yaml, or rtx4090 and the path of its
    bundled file). Each file is one point now, under the id of its first spelling, so it keeps the id it had."""
    from moesim.hw.profile import PROFILE_DIR
    (files / "link.parquet").symlink_to(files / "t.parquet")
    twice = parse_spec({"traces": ["t.parquet", "./t.parquet", str(files / "t.parquet"), "link.parquet"],
                        "hw": ["hw.yaml", "./hw.yaml", "rtx4090", str(PROFILE_DIR / "rtx4090.yaml")],
                        "system": "gpu-only-lru"}, source="s", base_dir=files)
    once = parse_spec({"trace": "t.parquet", "hw": ["hw.yaml", "rtx4090"], "system": "gpu-only-lru"}, source="s",
                      base_dir=files)
    assert [(p.trace, p.hw, p.point_id) for p in twice.points()] == [(p.trace, p.hw, p.point_id)
                                                                     for p in once.points()]
    assert [p.hw for p in once.points()] == ["hw.yaml", "rtx4090"]
    # two files are two points, whatever their names
    (files / "u.parquet").write_bytes((files / "t.parquet").read_bytes())
    other = parse_spec({"traces": ["t.parquet", "u.parquet"], "system": "gpu-only-lru"}, source="s", base_dir=files)
    assert [p.trace for p in other.points()] == ["t.parquet", "u.parquet"]


def test_point_id_is_a_hash_of_the_parameters_only(tmp_path):
    point = Point("t.parquet", "rtx4090", "gpu-only-lru", 0, None, (("cache.slots_per_layer", 2),))
    canonical = json.dumps({"trace": "t.parquet", "hw": "rtx4090", "system": "gpu-only-lru", "seed": 0,
                            "model": None, "settings": {"cache.slots_per_layer": "2"}}, sort_keys=True)
    assert point.point_id == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # the same point from specs in other folders, with the key spelled either way
    a = parse_spec({"trace": "t.parquet", "system": "gpu-only-lru", "grid": {"cache.slots_per_layer": [2]}},
                   source="a", base_dir=tmp_path)
    b = parse_spec({"traces": ["t.parquet"], "systems": "gpu-only-lru", "hw": ["rtx4090"],
                    "set": {"cache__slots_per_layer": 2}}, source="b", base_dir=tmp_path / "elsewhere")
    assert a.points()[0].point_id == b.points()[0].point_id == point.point_id
    assert Point("t.parquet", "rtx4090", "gpu-only-lru", 1, None, point.settings).point_id != point.point_id


def test_per_system_parameters_vary_that_systems_points_only(tmp_path):
    base = {"trace": "t.parquet", "systems": ["gpu-only-lru", "smoe"], "grid": {"cache.slots": [16, 32]}}
    own = {"smoe": {"grid": {"prefetch__n": [1, 2]}, "set": {"assign.queue_aware": True}}}
    spec = parse_spec({**base, "per_system": own}, source="s", base_dir=tmp_path)
    points = spec.points()
    lru = [p for p in points if p.system == "gpu-only-lru"]
    smoe = [dict(p.settings) for p in points if p.system == "smoe"]
    assert [dict(p.settings) for p in lru] == [{"cache.slots": 16}, {"cache.slots": 32}]
    assert smoe == [{"cache.slots": c, "assign.queue_aware": True, "prefetch.n": n} for c in (16, 32) for n in (1, 2)]
    # the other systems' points are those of the spec without the entry: same ids, so their results are reused
    plain = parse_spec(base, source="s", base_dir=tmp_path).points()
    assert [p.point_id for p in lru] == [p.point_id for p in plain if p.system == "gpu-only-lru"]
    assert spec.parameter_keys() == ["cache.slots", "assign.queue_aware", "prefetch.n"]


def test_all_means_every_listed_system():
    from moesim.policy.systems import system_names
    spec = parse_spec({"trace": "t.parquet", "systems": "all"}, source="s", base_dir=Path("."))
    assert spec.systems == system_names()


@pytest.mark.parametrize("spec, words", [
    ({"trace": "t.parquet", "system": "cpu-only", "colour": 1}, "unknown key 'colour' (fix: valid keys:"),
    ({"trace": "t.parquet", "systms": ["cpu-only"]}, "unknown key 'systms' (fix: did you mean systems? valid keys:"),
    ({"trace": "t.parquet", "system": "gpu-only-lur"}, "did you mean gpu-only-lru?"),
    ({"trace": "t.parquet"}, "'systems' is missing"),
    ({"trace": "t.parquet", "system": "cpu-only", "systems": ["cpu-only"]}, "both 'system' and 'systems'"),
    ({"trace": "t.parquet", "system": "gpu-only-lur"}, "unknown system 'gpu-only-lur'"),
    # the command line's --system a,b was 'unknown system' with "did you mean gpu-only-lru?"
    ({"trace": "t.parquet", "systems": "cpu-only,gpu-only-lru"},
     "field 'systems': 'cpu-only,gpu-only-lru' names several systems in one item (fix: list them, one system per "
     "item: systems: [cpu-only, gpu-only-lru]"),
    ({"trace": "t.parquet", "system": "cpu-only", "zip": {"a.b": [1, 2], "c.d": [1]}}, "differ in length"),
    ({"trace": "t.parquet", "system": "cpu-only", "grid": {"a.b": []}}, "empty list"),
    ({"trace": "t.parquet", "system": "cpu-only", "grid": {"a.b": [1]}, "set": {"a__b": 2}}, "in both set and grid"),
    ({"trace": "t.parquet", "system": "cpu-only", "seeds": [0.5]}, "not an integer"),
    ({"trace": "t.parquet", "systems": ["smoe"], "per_system": ["smoe"]}, "'per_system' must map system names"),
    ({"trace": "t.parquet", "systems": ["smoe"], "per_system": {"smoe-flex": {"set": {"a.b": 1}}}},
     "field 'per_system.smoe-flex': 'smoe-flex' is not one of the spec's systems"),
    ({"trace": "t.parquet", "systems": ["smoe"], "per_system": {"smoe": {"grd": {"a.b": [1]}}}},
     "unknown key 'grd' (fix: did you mean grid?"),
    ({"trace": "t.parquet", "systems": ["smoe"], "per_system": {"smoe": None}}, "is not a mapping of set: and grid:"),
    ({"trace": "t.parquet", "systems": ["smoe"], "grid": {"prefetch.n": [1]},
      "per_system": {"smoe": {"set": {"prefetch__n": 2}}}}, "'prefetch.n' appears in both grid and per_system.smoe.set"),
    # one key in two spellings in one section: the later value silently won (one point of prefetch.n=2)
    ({"trace": "t.parquet", "systems": ["smoe"], "grid": {"prefetch__n": [1], "prefetch.n": [2]}},
     "field 'grid.prefetch.n': 'prefetch.n' is given twice in grid (as 'prefetch__n' and 'prefetch.n') "
     "(fix: keep one of them)"),
    ({"trace": "t.parquet", "systems": ["smoe"], "set": {"prefetch.n": 1, "prefetch__n": 2}},
     "'prefetch.n' is given twice in set"),
    ({"trace": "t.parquet", "systems": ["smoe"],
      "per_system": {"smoe": {"grid": {"prefetch.n": [1], "prefetch__n": [2]}}}},
     "'prefetch.n' is given twice in per_system.smoe.grid"),
    ({"trace": "t.parquet", "systems": ["smoe"], "zip": {"prefetch.n": [1], "prefetch__n": [2]}},
     "'prefetch.n' is given twice in zip[0]"),
])
def test_spec_mistakes_are_one_line(spec, words):
    with pytest.raises(ConfigError) as err:
        parse_spec(spec, source="spec.yaml", base_dir=Path("."))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("spec.yaml")


@pytest.mark.parametrize("spec, words", [
    ({"traces": ["missing.parquet"], "systems": ["cpu-only"]}, "trace 'missing.parquet' not found"),
    ({"systems": ["cpu-only"], "grid": {"cache.slot": [1]}}, "unknown parameter 'cache.slot'"),
    ({"systems": ["gpu-only-lru"], "grid": {"cache.slots_per_layer": ["a"]}}, "'a' is not a valid int"),
    ({"systems": ["cpu-only"], "hw": ["rtx9090"]}, "hardware profile not found"),
    ({"systems": ["cpu-only"], "grid": {"hw.pcie.bandwith_scale": [1.0]}}, "no such profile field"),
    # a folder was 'not found'; a mapping was taken for one trace named "{'a': 1}", a list for one named '[...]'
    ({"traces": ["."], "systems": ["cpu-only"]}, "is a folder, not a trace file"),
    ({"traces": {"a": "t.parquet"}, "systems": ["cpu-only"]}, "field 'traces': a mapping is not a list of paths"),
    ({"traces": [["t.parquet"]], "systems": ["cpu-only"]}, "field 'traces', row 0: ['t.parquet'] is not a path"),
    ({"systems": {"cpu-only": 1}}, "field 'systems': a mapping is not a list of names"),
    ({"systems": ["cpu-only"], "hw": [{"gpu": 1}]}, "field 'hw', row 0: {'gpu': 1} is not a profile name or path"),
    # an empty item (a templated spec's unset variable) was read as the spec's folder: 'is a folder'
    ({"traces": ["t.parquet", ""], "systems": ["cpu-only"]}, "field 'traces', row 1: the path is empty"),
    ({"systems": ["cpu-only"], "hw": [""]}, "field 'hw', row 0: the profile name or path is empty"),
    # what only the trace's model decides: refused before any point runs (each point failed on its own)
    ({"systems": ["buddymoe"], "grid": {"substitute.alpha": [0.95, "[0.9,0.8,0.7]"]}},
     "substitute.alpha lists 3 values, the model has 2 MoE layers"),
])
def test_cli_spec_errors_exit_2_with_one_line(files, capsys, spec, words):
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], **spec}))
    code = main(["sweep", str(path), "--out", str(files / "r.parquet")])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.count("\n") == 1 and str(path) in err
    assert not (files / "r.parquet").exists()


@pytest.mark.parametrize("sections, field, fix", [
    ({"grid": {"cache.slot": [1]}}, "field 'grid.cache.slot'", "valid:"),
    ({"set": {"cache.slot": 1}}, "field 'set.cache.slot'", "valid:"),
    ({"zip": [{"engine.staging_slots": [1, 2]}, {"cache.slot": [1, 2]}]}, "field 'zip[1].cache.slot'", "valid:"),
    ({"grid": {"seed": [0, 1]}}, "field 'grid.seed'", "list them at the top level, e.g. seeds: [0, 1]"),
    ({"grid": {"hw.pcie.bandwith_scale": [1.0]}}, "field 'grid.hw.pcie.bandwith_scale'",
     "did you mean hw.pcie.bandwidth_scale?"),
    ({"set": {"hw.pcie.bandwidth_scale": "fast"}}, "field 'set.hw.pcie.bandwidth_scale'", "write a number"),
    # a value of the wrong type: named where the spec gives it too (it said field 'cache.slots_per_layer')
    ({"grid": {"cache.slots_per_layer": [1, "two"]}}, "field 'grid.cache.slots_per_layer': 'two' is not",
     "write one whole number for every layer or a list of one per layer, e.g. 2 or [2,1,2,...]"),
    ({"zip": [{"cache.slots_per_layer": [1, 2.5], "engine.staging_slots": [1, 2]}]},
     "field 'zip[0].cache.slots_per_layer': '2.5' is not", "e.g. 2 or [2,1,2,...]"),
])
def test_an_unknown_parameter_is_named_where_the_spec_gives_it(files, capsys, sections, field, fix):
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only"], **sections}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet")]) == 2
    err = capsys.readouterr().err
    assert field in err and fix in err and err.count("\n") == 1


def test_a_parameter_one_system_takes_runs_under_per_system_and_stops_the_sweep_in_the_shared_grid(files, capsys):
    import pandas as pd
    path = files / "spec.yaml"
    shared = {"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["gpu-only-lru", "smoe"]}
    path.write_text(yaml.safe_dump({**shared, "grid": {"prefetch.n": [1, 2]}}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "field 'grid.prefetch.n'" in err  # gpu-only-lru prefetches nothing: no n
    assert err.rstrip().endswith("or give it only to the systems that take it, under per_system.NAME.grid, "
                                 "not to gpu-only-lru)")
    path.write_text(yaml.safe_dump({**shared, "per_system": {"smoe": {"grid": {"prefetch.n": [1, 2]}}}}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet"), "--workers", "1"]) == 0
    frame = pd.read_parquet(files / "r.parquet")
    assert sorted(zip(frame["system"], frame["prefetch.n"].fillna(-9))) == [("gpu-only-lru", -9), ("smoe", 1),
                                                                           ("smoe", 2)]
    assert (frame["status"] == "ok").all()
    # a mistake there is named there
    path.write_text(yaml.safe_dump({**shared, "per_system": {"smoe": {"grid": {"prefetch.m": [1]}}}}))
    assert main(["sweep", str(path), "--out", str(files / "s.parquet")]) == 2
    err = capsys.readouterr().err
    assert "field 'per_system.smoe.grid.prefetch.m'" in err and err.count("\n") == 1


def test_a_spec_read_from_a_pipe_resolves_its_paths_in_the_current_folder(files, monkeypatch):
    """`moesim sweep <(printf ...)`: the spec is /dev/fd/N, a pipe with no folder of its own."""
    monkeypatch.chdir(files)
    read, write = os.pipe()
    os.write(write, yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only"]}).encode())
    os.close(write)
    try:
        spec = load_spec(f"/dev/fd/{read}")
    finally:
        os.close(read)
    assert spec.resolve("t.parquet") == str(files / "t.parquet") and spec.systems == ["cpu-only"]


def test_a_spec_over_the_yaml_limit_is_refused_unread(tmp_path):
    from moesim.util import YAML_MAX_BYTES
    path = tmp_path / "big.yaml"
    path.write_text("systems: [cpu-only]\n" + "#" * YAML_MAX_BYTES)
    with pytest.raises(ConfigError, match="over 4,194,304 bytes, the limit of a YAML input"):
        load_spec(path)


def test_the_spec_check_takes_each_value_once_not_every_combination(files, monkeypatch):
    """check_spec profiled and built a system for every distinct combination: a grid of six 10-value axes
    spent an hour checking before its first point ran. Each value of each parameter is checked once (per trace,
    profile and system), so three 5-value profile axes take 15 profile checks, not 125; a bad value in the
    last combination is still refused before anything runs."""
    from moesim.hw.profile import HardwareProfile
    from moesim.sweep import check_spec
    calls = []
    real = HardwareProfile.with_overrides
    monkeypatch.setattr(HardwareProfile, "with_overrides", lambda self, o, *a, **k: (calls.append(dict(o)),
                                                                                        real(self, o, *a, **k))[1])
    grid = {"hw.pcie.bandwidth_scale": [0.5, 1, 2, 3, 4], "hw.sync.per_layer_us": [1, 2, 3, 4, 5],
            "hw.pcie.latency_us": [1, 2, 3, 4, 5]}
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only"],
                                    "grid": grid}))
    spec = load_spec(path)
    points = spec.points()
    check_spec(spec, points)
    assert len(points) == 125 and len(calls) <= 15
    checked = {(f"hw.{k}", str(v)) for o in calls for k, v in o.items()}
    assert checked == {(k, str(v)) for k, values in grid.items() for v in values}
    grid["hw.pcie.latency_us"][-1] = "slow"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only"],
                                    "grid": grid}))
    spec = load_spec(path)
    with pytest.raises(ConfigError, match="'slow' is not a number"):
        check_spec(spec, spec.points())


def test_the_spec_moesim_sweep_help_shows_is_a_valid_spec(tmp_path):
    """The example in `moesim sweep --help` named smoe under per_system without listing it under systems, so a
    user who saved it got "'smoe' is not one of the spec's systems"; it also imported a module no one has."""
    import textwrap

    from moesim.cli.results_cmd import sweep_cmd
    from moesim.sweep import check_spec
    doc = sweep_cmd.callback.__doc__ if sweep_cmd.callback is not None else ""
    start = doc.index("SPEC.yaml")
    example = textwrap.dedent(doc[doc.index("\n", start) + 1:doc.index("\n\n", start)])
    repo = Path(__file__).resolve().parents[2]
    path = tmp_path / "spec.yaml"
    path.write_text(example.replace("traces/", f"{repo}/traces/"))
    spec = load_spec(path)
    assert set(spec.systems) == {"gpu-only-lru", "static-hot", "smoe"}
    check_spec(spec, spec.points())  # every trace, profile, system and parameter the example names is valid


@pytest.mark.parametrize("given", ["trace", "results"])
def test_a_parquet_file_given_as_the_spec_is_named_as_such(tmp_path, capsys, given):
    """`moesim sweep TRACE.parquet --out r.parquet` (the trace where the spec goes) said "not UTF-8 text (byte 19)
    (fix: save the file as UTF-8)"; the line now says it is a Parquet file, not a spec, and nothing is written."""
    import pandas as pd

    from tests.factories import write_sweep_files
    write_sweep_files(tmp_path, seed=5)
    path = tmp_path / "t.parquet"
    if given == "results":
        path = tmp_path / "old.parquet"
        pd.DataFrame({"point_id": ["a"], "status": ["ok"]}).to_parquet(path)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert str(err.value) == (f"{path}: a Parquet file (a trace or sweep results), not a sweep spec (fix: give a "
                              "YAML spec (see `moesim sweep --help`) that lists it under traces:)")
    out = tmp_path / "r.parquet"
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("a Parquet file (a trace or sweep results), not a sweep spec") == 1
    assert not out.exists() and not (tmp_path / "r.parquet.parts").exists()
