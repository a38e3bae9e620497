"""The Python API: moesim.replay, moesim.sweep, settings from keyword arguments, trace slices."""

from __future__ import annotations

import functools
import importlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from matplotlib.figure import Figure

import moesim
from moesim.analysis.metrics import metrics
from moesim.api import slice_trace
from moesim.api_args import settings_from
from moesim.errors import ConfigError
from moesim.sim.result import DECISION_COLUMNS, TIMELINE_COLUMNS
from moesim.sim.run import simulate
from moesim.trace.validate import validate_trace
from tests.factories import random_routing, tiny_model, write_tiny_trace, write_trace_and_profile


@pytest.fixture
def files(tmp_path):
    return write_trace_and_profile(tmp_path, 7, requests=2, prompt=3, decode=5)


def test_keyword_arguments_become_set_keys():
    assert settings_from({"cache": "lru"}, cache__slots_per_layer=4, engine__timeline=True,
                         hw__pcie__bandwidth_scale=0.5) == {
        "cache": "lru", "cache.slots_per_layer": "4", "engine.timeline": "true", "hw.pcie.bandwidth_scale": "0.5"}
    with pytest.raises(ConfigError, match=r"settings=\{'cache.slots_per_layer': 2\} and cache__slots_per_layer=4 "
                                          "both set parameter 'cache.slots_per_layer'"):
        settings_from({"cache.slots_per_layer": 2}, cache__slots_per_layer=4)



def test_a_numpy_array_is_a_list_parameter(files):
    """cache__slots_per_layer=np.array([2, 1]) became '[2 1]' and was refused as 'not a valid int or a list of
    ints'."""
    trace, hw = files
    assert settings_from(cache__slots_per_layer=np.array([2, 1]))["cache.slots_per_layer"] == "[2, 1]"
    run = moesim.replay(trace, hw=hw, cache__slots_per_layer=np.array([2, 1]), timeline=False)
    assert run.metrics["tpot_ms_mean"].item() == \
        moesim.replay(trace, hw=hw, cache__slots_per_layer=[2, 1], timeline=False).metrics["tpot_ms_mean"].item()


def test_replay_gives_the_engines_metrics_timeline_and_decisions(files):
    trace, hw = files
    result = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    direct = metrics(simulate(trace, hw, "gpu-only-lru", {"cache.slots_per_layer": "2"}))
    assert isinstance(result.metrics, pd.DataFrame) and len(result.metrics) == 1
    row = result.metrics.iloc[0]
    assert (row["system"], row["hw"], row["seed"]) == ("gpu-only-lru", hw, 0)
    for key in ("tpot_ms_mean", "ttft_ms", "gpu_hit_rate", "demand_loads", "pcie_h2d_bytes", "slots_per_layer"):
        assert row[key] == direct[key], key
    assert row["breakdown_wait_cache_ms"] == direct["breakdown_ms"]["wait_cache"]
    assert list(result.timeline.columns) == list(TIMELINE_COLUMNS)
    assert list(result.decisions.columns) == list(DECISION_COLUMNS)
    loads = result.timeline[(result.timeline["resource"] == "pcie") & (result.timeline["kind"] == "load")]
    assert len(loads) == direct["demand_loads"]


def test_a_result_prints_as_one_line_of_its_headline_figures(files):
    trace, hw = files
    result = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    row = result.metrics.iloc[0]
    text = repr(result)
    assert "\n" not in text and text.startswith("ReplayResult(system='gpu-only-lru', trace='t.parquet', ")
    assert f"tpot_ms_mean={row['tpot_ms_mean']:.6g}" in text and f"ttft_ms={row['ttft_ms']:.6g}" in text
    assert f"timeline=<{len(result.timeline):,} rows>" in text
    assert f"decisions=<{len(result.decisions):,} rows>" in text
    bare = repr(moesim.replay(trace, hw=hw, system="gpu-only-lru", timeline=False, decisions=False))
    assert "timeline=" not in bare and "decisions=" not in bare
    run = moesim.serve(trace, hw=hw, system="cpu-only", qps=20, requests=3)
    served = repr(run)
    assert "\n" not in served and served.startswith("ServeRun(system='cpu-only', requests=3, qps=20, ")
    assert f"tpot_ms_p99={run.metrics['tpot_ms_p99']:.6g}" in served
    assert type(run.metrics["offered_qps"]) is float  # a plain float, as json and repr expect


def test_a_result_shows_in_a_notebook_as_its_headline_figures(files):
    """Jupyter showed the whole metrics row, some 60 lines, as a replay's output: now a short table of the
    headline figures, the slot spread, and where the rest is."""
    trace, hw = files
    result = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    row = result.metrics.iloc[0]
    html = result._repr_html_()
    assert html.startswith("<b>gpu-only-lru</b> on t.parquet<table>")
    assert f"<tr><td>tpot_ms_mean</td><td>{row['tpot_ms_mean']:.6g}</td></tr>" in html
    assert f"<tr><td>slot_spread</td><td>{row['slot_spread']}</td></tr>" in html
    assert html.count("<tr>") <= 14 and "breakdown_" not in html and "notes" not in html
    assert html.endswith(f"{len(result.metrics.columns)} figures in <code>.metrics</code>, one row a step in "
                         "<code>.steps</code>, <code>.timeline</code>, <code>.decisions</code>")



def test_a_prefill_only_result_prints_no_nan(tmp_path, files):
    """A trace without decode steps printed tpot_ms_mean=nan, decode_tokens_per_s=nan: the line leaves out the
    figures the run has not defined and says it decoded no token."""
    _, hw = files
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "prefill.parquet", model,
                             random_routing(np.random.default_rng(7), model, requests=2, prompt=3, decode=0))
    result = moesim.replay(str(trace), hw=hw, system="gpu-only-lru", timeline=False, decisions=False)
    assert np.isnan(result.metrics["tpot_ms_mean"].item())  # the frame keeps it: undefined, not zero
    text = repr(result)
    assert "nan" not in text and text.endswith(", decode_tokens=0)")
    assert f"ttft_ms={result.metrics['ttft_ms'].item():.6g}" in text


def test_a_serve_run_without_a_rate_prints_what_set_its_arrivals(files, tmp_path):
    """A closed loop and an arrival log have no rate (their qps is nan): the line names the clients or the
    file where an open loop's qps stands (it said qps=nan)."""
    trace, hw = files
    closed = moesim.serve(trace, hw=hw, system="cpu-only", requests=4, workload__arrival="closed",
                          workload__concurrency=2)
    assert np.isnan(closed.metrics["qps"])
    text = repr(closed)
    assert "\n" not in text
    assert "nan" not in text
    assert text.startswith("ServeRun(system='cpu-only', requests=4, arrivals='from 2 closed-loop clients', "
                           f"ttft_ms_p50={closed.metrics['ttft_ms_p50']:.6g}, ")
    assert text.endswith(f"throughput_rps={closed.metrics['throughput_rps']:.6g})")
    one = moesim.serve(trace, hw=hw, system="cpu-only", requests=2, workload__arrival="closed",
                       workload__concurrency=1)
    assert repr(one).startswith("ServeRun(system='cpu-only', requests=2, arrivals='from 1 closed-loop client', ")
    (tmp_path / "arrivals.csv").write_text("arrival_s\n0\n0.01\n0.5\n")
    logged = moesim.serve(trace, hw=hw, system="cpu-only", requests=3, workload__arrival="trace",
                          workload__arrival_file=str(tmp_path / "arrivals.csv"))
    assert repr(logged).startswith(
        "ServeRun(system='cpu-only', requests=3, arrivals='arriving at the times of arrivals.csv', ttft_ms_p50=")



@pytest.mark.parametrize("kwargs, field", [
    ({"workload__cv": 4}, "workload__cv"),  # Poisson arrivals: no cv
    ({"qps": 5, "workload__arrival": "closed"}, "qps"),
    ({"settings": {"workload.concurrency": 3}}, "workload.concurrency"),
    ({"workload__arrival_file": "a.csv"}, "workload__arrival_file")])
def test_serve_refuses_a_workload_setting_its_arrivals_do_not_read(files, kwargs, field):
    """`moesim.serve(T, workload__cv=4)` ran Poisson arrivals as if cv were unset; `moesim serve-sim` refuses it."""
    trace, hw = files
    with pytest.raises(ConfigError, match=rf"^field '{field}': workload.arrival=\w+ does not read {field}, so it "
                                          "would change nothing"):
        moesim.serve(trace, hw=hw, system="cpu-only", requests=2, **kwargs)
    run = moesim.serve(trace, hw=hw, system="cpu-only", requests=2, qps=3, workload__arrival="gamma", workload__cv=2)
    assert run.metrics["qps"] == 3


def test_a_serve_run_shows_in_a_notebook_as_its_repr_says(files):
    """The HTML table of a closed loop showed qps nan and offered_qps nan, and every figure with 17 digits
    (219.85028148320959): it names the arrivals instead and gives six significant digits, like the repr."""
    trace, hw = files
    closed = moesim.serve(trace, hw=hw, system="cpu-only", requests=4, workload__arrival="closed",
                          workload__concurrency=2)
    html = closed._repr_html_()
    assert "nan" not in html and "<td>qps</td>" not in html and "<td>offered_qps</td>" not in html
    assert "<tr><td>arrivals</td><td>from 2 closed-loop clients</td></tr>" in html
    assert f"<tr><td>ttft_ms_p50</td><td>{closed.metrics['ttft_ms_p50']:.6g}</td></tr>" in html
    rated = moesim.serve(trace, hw=hw, system="cpu-only", requests=2, qps=0.5)
    assert "<tr><td>qps</td><td>0.5</td></tr>" in rated._repr_html_()


def test_settings_dict_and_keywords_are_the_same_replay(files):
    trace, hw = files
    by_kwargs = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=1, timeline=False)
    by_dict = moesim.replay(trace, hw=hw, system="gpu-only-lru", settings={"cache.slots_per_layer": 1},
                            timeline=False)
    bigger = moesim.replay(trace, hw=hw, system="gpu-only-lru", settings={"cache.slots_per_layer": "4"},
                           timeline=False)
    cols = ["tpot_ms_mean", "gpu_hit_rate", "demand_loads", "slots_per_layer"]
    assert by_kwargs.metrics[cols].equals(by_dict.metrics[cols])
    assert (by_kwargs.metrics["slots_per_layer"].item(), bigger.metrics["slots_per_layer"].item()) == (1, 4)
    assert bigger.metrics["gpu_hit_rate"].item() > by_dict.metrics["gpu_hit_rate"].item()


def test_plot_timeline_draws_and_saves(files, tmp_path):
    trace, hw = files
    result = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    fig = result.plot_timeline(path=tmp_path / "g.png")
    assert isinstance(fig, Figure)
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.axes[0].get_xlabel() == "time (ms)"
    no_timeline = moesim.replay(trace, hw=hw, system="gpu-only-lru", timeline=False)
    with pytest.raises(ConfigError, match="kept no timeline"):
        no_timeline.plot_timeline()


def test_bad_parameter_is_the_usual_one_line_error(files):
    trace, hw = files
    with pytest.raises(ConfigError, match="unknown parameter 'cache.slot'"):
        moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slot=2)


@pytest.mark.parametrize("call, field", [
    (lambda trace, hw: moesim.replay(trace, hw=hw, system="nope"), "system"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, system="cpu-only", cache__alpha=0.3), "cache__alpha"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, engine__bogus=1), "engine__bogus"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, model="qwen3-30b-a3b"), "model"),
    (lambda trace, hw: moesim.serve(trace, hw=hw, system="oracle"), "system"),
    (lambda trace, hw: moesim.sweep({"traces": [trace], "systems": ["cpu-only"], "hw": [hw]}, workers=0),
     "workers"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, system=["cpu-only"]), "system"),  # was a bare TypeError
    (lambda trace, hw: moesim.serve(trace, hw=hw, system=["cpu-only"]), "system"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, system="all"), "system"),  # was "did you mean all-in-gpu?"
    (lambda trace, hw: moesim.serve(trace, hw=hw, qps=0), "qps"),  # the shorthand, not workload.qps
    (lambda trace, hw: moesim.serve(trace, hw=hw, requests=0), "requests"),
    (lambda trace, hw: moesim.replay(trace, hw=hw).plot_timeline(steps=(100, 200)), "steps"),
    # a bad value of a keyword parameter: the keyword, not the dotted key (they said 'prefetch.eviction')
    (lambda trace, hw: moesim.replay(trace, hw=hw, system="smoe", prefetch__eviction="x"), "prefetch__eviction"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, engine__staging_slots=0), "engine__staging_slots"),
    (lambda trace, hw: moesim.replay(trace, hw=hw, cache__slots_per_layer="x"), "cache__slots_per_layer"),
    (lambda trace, hw: moesim.serve(trace, hw=hw, requests=2, engine__staging_slots=0), "engine__staging_slots"),
    # given as a dict of dotted keys, it keeps the dotted key
    (lambda trace, hw: moesim.replay(trace, hw=hw, settings={"engine.staging_slots": 0}), "engine.staging_slots"),
    # an unknown key of the dict too (named as the keyword cache__slots_per_layr, which the caller never wrote)
    (lambda trace, hw: moesim.replay(trace, hw=hw, settings={"cache.slots_per_layr": 2}), "cache.slots_per_layr"),
    (lambda trace, hw: moesim.serve(trace, hw=hw, requests=2, settings={"cache.slots_per_layr": 2}),
     "cache.slots_per_layr"),
])
def test_api_errors_name_the_keyword_not_the_command_line_option(files, call, field):
    """The command line says --system and --set; a Python caller gave system= and cache__alpha=."""
    trace, hw = files
    with pytest.raises(ConfigError) as err:
        call(trace, hw)
    assert err.value.field == field
    assert f"field '{field}'" in str(err.value) and "--" not in str(err.value).split(":")[0]


def test_a_profile_field_set_by_a_keyword_is_named_by_that_keyword(files):
    """hw__gpu__nope=1 is no profile field: the error said field 'gpu.nope', a name the caller never wrote."""
    from moesim.errors import ProfileError
    trace, hw = files
    with pytest.raises(ProfileError) as err:
        moesim.replay(trace, hw=hw, hw__gpu__nope=1)
    assert err.value.field == "hw__gpu__nope"
    assert str(err.value).startswith(f"field 'hw__gpu__nope': parameter 'hw.gpu.nope'=1: no such profile field in {hw}")


@pytest.mark.parametrize("kwargs, words", [
    ({"seed": -1}, "seed must be a whole number in [0, 2**63), got -1"),
    ({"seed": "abc"}, "got 'abc'"),
    ({"seed": 3.7}, "got 3.7"),
    ({"seed": True}, "got True"),
    ({"hw": None}, "hw must be a profile name, a YAML path or a HardwareProfile, got None"),
])
def test_a_seed_or_hw_of_the_wrong_kind_is_refused_in_one_line(files, kwargs, words):
    trace, hw = files
    for call in (moesim.replay, moesim.serve):
        with pytest.raises(ConfigError) as err:
            call(trace, **{"hw": hw, "system": "cpu-only", **kwargs})
        assert words in str(err.value) and "\n" not in str(err.value)
    assert moesim.replay(trace, hw=hw, system="cpu-only", seed=np.int64(3)).metrics.seed.iloc[0] == 3



@pytest.mark.parametrize("call, kwargs, field, words", [
    # a list of traces was looked up as one file named "['t.parquet']"
    ("replay", {"trace": ["T"]}, "trace", "trace must be one trace file's path, got ['"),
    ("replay", {"trace": 5}, "trace", "trace must be one trace file's path, got 5"),
    # AttributeError: 'list' object has no attribute 'items'
    ("replay", {"settings": ["cache=lru"]}, "settings", "settings must be a dict of parameters"),
    ("serve", {"settings": ["cache=lru"]}, "settings", "settings must be a dict of parameters"),
    # "no" is truthy: the timeline was kept without a word
    ("replay", {"timeline": "no"}, "timeline", "timeline must be True or False, got 'no'"),
    ("replay", {"decisions": 0}, "decisions", "decisions must be True or False, got 0"),
    # TypeError: '<' not supported between instances of 'str' and 'int'
    ("sweep", {"workers": "2"}, "workers", "workers must be a whole number of processes, got '2'"),
    # TypeError: expected str, bytes or os.PathLike object, not list
    ("sweep", {"grid": ["T"]}, "grid", "the sweep spec must be a dict or a YAML file's path, got ['"),
    ("sweep", {"progress": "yes"}, "progress", "progress must be True or False, got 'yes'"),
    # TypeError: expected str, bytes or os.PathLike object, not int
    ("sweep", {"out": 5}, "out", "out must be a .parquet file's path, got 5"),
    # the command line's words: "--address needs --engine ray (fix: add --engine ray)"
    ("sweep", {"address": "ray://head:10001"}, "address", "fix: add engine='ray', or leave address out"),
])
def test_an_argument_of_the_wrong_kind_is_one_line_naming_it(files, call, kwargs, field, words):
    trace, hw = files
    kwargs = {k: ([trace] if v == ["T"] else v) for k, v in kwargs.items()}
    if call == "sweep":
        args = {"grid": {"traces": [trace], "hw": [hw], "systems": ["cpu-only"]}, **kwargs}
    else:
        args = {"hw": hw, "system": "cpu-only", **({"traces": trace} if call == "serve" else {"trace": trace}),
                **kwargs}
    with pytest.raises(ConfigError) as err:
        getattr(moesim, call)(**args)
    assert err.value.field == field and words in str(err.value) and "\n" not in str(err.value)
    assert "fix: " in str(err.value)



@pytest.mark.parametrize("call, keyword, meant", [
    ("replay", "sytem", "system"), ("replay", "timelines", "timeline"), ("replay", "seeds", "seed"),
    ("replay", "hardware", "hw"), ("serve", "request", "requests"), ("serve", "sytem", "system"),
    ("serve", "qsp", "qps"), ("serve", "qos", "qps"),  # a swap or a change in a short name: no guess before
])
def test_a_slip_of_an_argument_name_names_the_argument_meant(files, call, keyword, meant):
    """sytem='smoe' was read as a --set parameter: 'unknown parameter for system gpu-only-lru' and a list of
    every parameter, but no word of system=."""
    trace, hw = files
    with pytest.raises(ConfigError) as err:
        getattr(moesim, call)(trace, **{"hw": hw, keyword: 1})
    assert err.value.field == keyword
    assert str(err.value).startswith(f"field '{keyword}': {call}() has no argument '{keyword}'")
    assert f"did you mean {meant}?" in str(err.value)
    assert moesim.replay(trace, hw=hw, cache="lru", timeline=False).system == "gpu-only-lru"  # a role stays --set


@pytest.mark.parametrize("call, keyword, meant", [
    ("slice_trace", "step", "steps"), ("sweep", "worker", "workers"), ("bundled_trace", "nam", "name"),
    ("load_replay", "fodler", "folder"), ("plot_requests", "titel", "title"), ("sweep", "cache__slots", None),
])
def test_a_keyword_a_function_does_not_take_is_one_line_naming_the_argument_meant(files, tmp_path, call, keyword,
                                                                                   meant):
    """Python's "got an unexpected keyword argument" TypeError before, where replay and serve named the argument."""
    trace, _ = files
    function, args = {"slice_trace": (moesim.slice_trace, (trace, str(tmp_path / "s.parquet"))),
                      "sweep": (moesim.sweep, ({"traces": [trace], "hw": ["rtx4090"], "systems": ["cpu-only"]},)),
                      "bundled_trace": (moesim.bundled_trace, ()), "load_replay": (moesim.load_replay, ()),
                      "plot_requests": (moesim.api.ServeRun(requests=pd.DataFrame(), metrics={}, system="cpu-only",
                                                            traces=[trace]).plot_requests, ())}[call]
    with pytest.raises(ConfigError) as err:
        function(*args, **{keyword: 1})
    message = str(err.value)
    assert err.value.field == keyword and "\n" not in message and hasattr(err.value, "_render_traceback_")
    assert f"{call}() has no argument '{keyword}' (fix: " in message
    if meant:
        assert f"did you mean {meant}? " in message
    else:  # nothing it is a slip of: every argument listed
        assert "did you mean" not in message and message.endswith("sweep() takes grid, out, workers, engine, "
                                                                  "address, progress)")
    assert not (tmp_path / "s.parquet").exists()


def test_a_fault_in_a_column_the_system_does_not_read_still_refuses_the_replay(files, tmp_path):
    """gpu-only-lru never reads scores; a NaN there is checked beside the run and refuses its result."""
    from moesim.errors import TraceFormatError
    from tests.factories import with_scores
    trace, hw = files
    good = with_scores(trace, tmp_path / "good.parquet")
    assert moesim.replay(str(good), hw=hw, system="gpu-only-lru", timeline=False).metrics.iloc[0]["tpot_ms_mean"] > 0
    bad = with_scores(trace, tmp_path / "bad.parquet", bad={9: float("nan")})
    with pytest.raises(TraceFormatError, match=r"bad.parquet, field 'scores', row 9: score nan"):
        moesim.replay(str(bad), hw=hw, system="gpu-only-lru", timeline=False)


def test_sweep_returns_one_tidy_row_per_point(files):
    trace, hw = files
    frame = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["cpu-only", "gpu-only-lru"],
                          "grid": {"cache__slots_per_layer": [1, 2, 4]}}, workers=1)
    assert len(frame) == 6 and frame["point_id"].is_unique
    assert {"trace", "hw", "system", "seed", "cache.slots_per_layer", "status", "tpot_ms_mean",
            "breakdown_gpu_compute_ms", "sim_wall_s"} <= set(frame.columns)
    assert (frame["status"] == "ok").all()
    lru = frame[frame["system"] == "gpu-only-lru"].set_index("cache.slots_per_layer")
    single = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=4, timeline=False)
    assert lru.loc[4, "tpot_ms_mean"] == single.metrics["tpot_ms_mean"].item()
    assert lru["slots_per_layer"].tolist() == [1, 2, 4]



def test_a_dict_spec_takes_numpy_arrays_ranges_and_tuples_as_lists_of_values(files):
    """grid={'cache.slots_per_layer': np.arange(1, 3)} was one value ('[1 2]' is not a valid int), a range or a
    tuple too, systems=('cpu-only',) was one unknown system "('cpu-only',)", and seeds=np.array([0]) was refused
    as no integer."""
    trace, hw = files
    expected = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["cpu-only", "gpu-only-lru"], "seeds": [0, 1],
                             "grid": {"cache.slots_per_layer": [1, 2]}}, workers=1)
    for slots in (np.arange(1, 3), range(1, 3), (1, 2), pd.Series([1, 2])):
        frame = moesim.sweep({"traces": (trace,), "hw": np.array([hw]), "systems": ("cpu-only", "gpu-only-lru"),
                              "seeds": np.arange(2), "grid": {"cache.slots_per_layer": slots}}, workers=1)
        assert (frame["status"] == "ok").all(), frame["error"].tolist()
        assert frame["point_id"].tolist() == expected["point_id"].tolist()
        assert frame["cache.slots_per_layer"].tolist() == [1, 2] * 4
    zipped = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"],
                           "zip": {"cache.slots_per_layer": np.array([1, 2]), "engine.timeline": (False, True)}},
                          workers=1)
    assert zipped["cache.slots_per_layer"].tolist() == [1, 2] and (zipped["status"] == "ok").all()
    own = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["cpu-only", "gpu-only-lru"],
                        "per_system": {"gpu-only-lru": {"grid": {"cache__slots_per_layer": np.arange(1, 3)}}}},
                       workers=1)
    assert own["cache.slots_per_layer"].fillna(0).tolist() == [0, 1, 2] and (own["status"] == "ok").all()



def test_a_sweep_takes_per_layer_slots_as_a_list_as_replay_does(files):
    """replay(cache__slots_per_layer=[2, 1]) runs; the same list in a sweep's grid was refused as 'not a number
    or string'."""
    trace, hw = files
    frame = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"],
                          "grid": {"cache.slots_per_layer": [[2, 1], np.array([1, 2]), 2]}}, workers=1)
    assert (frame["status"] == "ok").all(), frame["error"].tolist()
    assert frame["cache.slots_per_layer"].tolist() == ["[2,1]", "[1,2]", "2"]
    single = moesim.replay(trace, hw=hw, cache__slots_per_layer=[2, 1], timeline=False)
    assert frame["tpot_ms_mean"].iloc[0] == single.metrics["tpot_ms_mean"].item()
    fixed = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"],  # '[2 1]' before
                          "set": {"cache.slots_per_layer": np.array([2, 1])}}, workers=1)
    assert fixed["tpot_ms_mean"].tolist() == [single.metrics["tpot_ms_mean"].item()]


def test_sweep_with_out_is_resumable(files, tmp_path):
    trace, hw = files
    spec = {"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"], "grid": {"cache.slots_per_layer": [1, 2]}}
    first = moesim.sweep(spec, out=tmp_path / "r.parquet", workers=2)
    again = moesim.sweep(spec, out=tmp_path / "r.parquet", workers=2)
    assert again["finished_at"].tolist() == first["finished_at"].tolist()


def test_every_warning_of_the_api_points_at_the_callers_line(files, tmp_path):
    """A sweep with a failed point warned from contextlib.py:81 (a stacklevel that missed the decorator
    around moesim.sweep): every warning the API gives names this file and the line of the call."""
    import inspect
    import warnings
    trace, hw = files
    # 6 slots per layer do not fit in this GPU: one of the two points fails
    spec = {"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"], "grid": {"cache.slots_per_layer": [2, 6]},
            "set": {"hw.gpu.memory_gib": 0.5, "hw.gpu.reserved_gib": 0.01, "memory.workspace_gib": 0.4715}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        table = moesim.sweep(spec, workers=1)
        run = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
        run.plot_timeline(), run.plot_breakdown()
        moesim.serve(trace, hw=hw, system="cpu-only", requests=2, workload__arrival="closed",
                     workload__concurrency=1)
        slice_trace(trace, tmp_path / "s.parquet", steps=2)
    assert table["status"].tolist().count("error") == 1
    failed = [w for w in caught if issubclass(w.category, moesim.api.SweepPointsFailed)]
    assert len(failed) == 1 and str(failed[0].message).startswith("1 of 2 sweep points failed")
    assert (failed[0].filename, failed[0].lineno) == (__file__, line)
    assert [w.filename for w in caught] == [__file__] * len(caught), [(w.filename, w.lineno) for w in caught]
    # called by a function of moesim itself, the warning still names the first line outside moesim
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        moesim.api.warn_failed_points(pd.DataFrame({"status": ["error"], "error": ["x"]}))
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_a_system_all_brings_in_that_cannot_run_on_the_trace_is_left_out_with_a_warning(files):
    """The fixture's trace has no scores: importance cannot run on it. Through systems='all' its point is
    left out, with one warning at the caller's line saying why, instead of an error row."""
    import inspect
    import warnings
    from moesim.policy.systems import system_names
    trace, hw = files
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        table = moesim.sweep({"traces": [trace], "hw": [hw], "systems": "all"}, workers=1)
    assert "importance" not in set(table["system"]) and (table["status"] == "ok").all()
    assert len(table) == len(system_names()) - 1
    left_out = [w for w in caught if issubclass(w.category, moesim.api.SweepSystemsLeftOut)]
    assert len(left_out) == 1 and (left_out[0].filename, left_out[0].lineno) == (__file__, line)
    assert "importance: " in str(left_out[0].message) and "needs the trace column 'scores'" in str(left_out[0].message)
    assert not [w for w in caught if issubclass(w.category, moesim.api.SweepPointsFailed)]


def test_sweep_is_the_function_and_the_module_stays_importable():
    from moesim.sweep import run_sweep  # noqa: F401
    assert callable(moesim.sweep) and moesim.sweep.__module__ == "moesim.api"


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, "3"])
def test_slice_refuses_steps_that_are_not_a_count_of_forward_passes(files, tmp_path, steps):
    trace, _ = files
    with pytest.raises(ConfigError, match="steps must be a whole number of forward passes") as err:
        slice_trace(trace, tmp_path / "s.parquet", steps=steps)
    assert err.value.field == "steps" and not (tmp_path / "s.parquet").exists()



@pytest.mark.parametrize("requests, words", [
    (0, "requests must be a list of request ids, got 0 (fix: e.g. requests=[0] for that one request)"),
    (["a"], "requests must be a list of request ids, got ['a']"),  # ValueError: invalid literal for int()
    ("0,1", "requests must be a list of request ids, got '0,1'"),
])
def test_slice_refuses_requests_that_are_not_a_list_of_ids(files, tmp_path, requests, words):
    trace, _ = files
    with pytest.raises(ConfigError) as err:  # requests=0: TypeError: 'int' object is not iterable
        slice_trace(trace, tmp_path / "s.parquet", requests=requests)
    assert err.value.field == "requests" and words in str(err.value)
    assert not (tmp_path / "s.parquet").exists()
    one = slice_trace(trace, tmp_path / "s.parquet", requests=np.array([1]))
    assert set(pq.read_table(one)["request"].to_pylist()) == {1}


def test_slice_never_overwrites_the_trace_it_slices(files, tmp_path):
    trace, _ = files
    before = Path(trace).read_bytes()
    with pytest.raises(ConfigError, match="would overwrite the trace it slices") as err:
        slice_trace(trace, Path(trace).parent / "." / Path(trace).name, steps=2)
    assert err.value.field == "out" and Path(trace).read_bytes() == before
    assert validate_trace(slice_trace(trace, tmp_path / "n.parquet", steps=np.int64(2))).steps == 2


def test_slice_keeps_the_first_steps_and_the_metadata(files, tmp_path):
    trace, _ = files
    out = slice_trace(trace, tmp_path / "s.parquet", steps=3)
    table = pq.read_table(out)
    assert sorted(set(table.column("step").to_pylist())) == [0, 1, 2]
    assert table.schema.metadata == pq.read_table(trace).schema.metadata
    assert validate_trace(out).steps == 3
    only = pq.read_table(slice_trace(trace, tmp_path / "r.parquet", requests=[1]))
    assert set(only.column("request").to_pylist()) == {1}
    with pytest.raises(ConfigError, match="the slice is empty"):
        slice_trace(trace, tmp_path / "e.parquet", requests=[7])
    with pytest.raises(ConfigError, match=r"written as Parquet, but its name has '\.csv' \(fix: name it e\.g\. s\.parquet"):
        slice_trace(trace, tmp_path / "s.csv", steps=3)
    assert not (tmp_path / "s.csv").exists()


@pytest.mark.parametrize("system, fix", [
    ("all", "moesim.sweep({'traces': [TRACE], 'hw': [HW], 'systems': 'all'}) gives one row per system"),
    ("cpu-only,fiddler", "'systems': ['cpu-only', 'fiddler']})"),
])
def test_several_systems_in_one_call_point_to_sweep(files, system, fix):
    """The command line's --system all and --system a,b compare systems; in Python that is a sweep."""
    trace, hw = files
    with pytest.raises(ConfigError, match=f"system='{system}' names several systems; a call replays one") as err:
        moesim.replay(trace, hw=hw, system=system)
    assert fix in str(err.value)


def test_several_systems_in_one_serve_call_point_to_a_serving_sweep(files):
    """serve(system='all') pointed to the replay's sweep, whose points replay the trace: a sweep serves only
    when it sets workload.*."""
    trace, hw = files
    with pytest.raises(ConfigError, match="system='all' names several systems; a call serves one") as err:
        moesim.serve(trace, hw=hw, system="all", requests=2)
    assert "'systems': 'all', 'set': {'workload.qps': QPS, 'workload.requests': N}})" in str(err.value)


def test_a_sweep_stopped_by_ctrl_c_keeps_its_finished_points_for_the_same_call(files, monkeypatch, capsys):
    """A KeyboardInterrupt in a notebook lost every point a sweep without out= had finished: the rerun of the
    cell started again from nothing. The same call now runs only the points not finished."""
    engines = importlib.import_module("moesim.sweep.engines")  # moesim.sweep is the function
    trace, hw = files
    spec = {"traces": [trace], "hw": [hw], "systems": ["cpu-only", "gpu-only-lru"],
            "grid": {"cache.slots_per_layer": [1, 2]}}
    real_run_point, ran = engines.run_point, []

    def interrupted_at_the_third(*job):
        if len(ran) == 2:
            raise KeyboardInterrupt
        ran.append(job[0].point_id)
        return real_run_point(*job)

    monkeypatch.setattr(engines, "run_point", interrupted_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        moesim.sweep(spec, workers=1)
    assert "the 2 of 4 points it finished are kept" in capsys.readouterr().err
    monkeypatch.setattr(engines, "run_point", lambda *job: ran.append(job[0].point_id) or real_run_point(*job))
    frame = moesim.sweep(spec, workers=1)
    assert len(ran) == 4 and len(set(ran)) == 4  # the two finished points did not run again
    assert len(frame) == 4 and (frame["status"] == "ok").all()
    again = moesim.sweep(spec, workers=1)  # a finished sweep keeps nothing: the same call runs every point
    assert len(ran) == 8 and again["tpot_ms_mean"].tolist() == frame["tpot_ms_mean"].tolist()


def test_a_sweep_over_values_of_several_kinds_saves_as_parquet(files, tmp_path):
    """cache.slots_per_layer swept over 2 and a per-layer list: the frame mixed an int and a str in one column
    and frame.to_parquet() failed (ArrowInvalid: Could not convert '[2,1]' with type str)."""
    trace, hw = files
    frame = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"],
                          "grid": {"cache.slots_per_layer": [2, "[2,1]"]}}, workers=1)
    assert frame["cache.slots_per_layer"].tolist() == ["2", "[2,1]"] and (frame["status"] == "ok").all()
    frame.to_parquet(tmp_path / "saved.parquet")
    back = pd.read_parquet(tmp_path / "saved.parquet")
    assert back["cache.slots_per_layer"].tolist() == ["2", "[2,1]"]
    assert back["tpot_ms_mean"].tolist() == frame["tpot_ms_mean"].tolist()
    resumed = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"],
                            "grid": {"cache.slots_per_layer": [2, "[2,1]"]}}, out=tmp_path / "r.parquet", workers=1)
    assert resumed["cache.slots_per_layer"].tolist() == frame["cache.slots_per_layer"].tolist()


def test_a_profile_object_is_named_in_the_results_by_its_name(files):
    """hw=load_profile(...): the metrics' hw column held the profile's whole repr (thousands of characters)."""
    from moesim.hw.profile import load_profile
    trace, hw = files
    profile = load_profile(hw)
    run = moesim.replay(trace, hw=profile, system="cpu-only", timeline=False, decisions=False)
    assert run.metrics["hw"].iloc[0] == profile.name
    assert moesim.replay(trace, hw=Path(hw), system="cpu-only", timeline=False).metrics["hw"].iloc[0] == hw


def test_a_model_or_figure_path_of_the_wrong_type_is_one_line(files):
    """`moesim.replay(T, model=3)` and `run.plot_breakdown(path=3)` raised a bare TypeError from os.fspath."""
    trace, hw = files
    with pytest.raises(ConfigError, match=r"^field 'model': model must be a preset name or a preset YAML path, "
                                          "got 3"):
        moesim.replay(trace, hw=hw, model=3)
    run = moesim.replay(trace, hw=hw, system="cpu-only")
    for plot in (run.plot_breakdown, run.plot_timeline):
        with pytest.raises(ConfigError, match=r"^field 'path': path must be a file name, got 3"):
            plot(path=3)


@pytest.mark.parametrize("system", ["gpu-only-lru", "mixtral-offloading", "oracle"])
def test_replay_gives_the_lower_bound_and_gap_the_command_line_gives(files, tmp_path, system):
    """moesim.replay had no lower_bound or gap_to_lower_bound, which `moesim replay --json` gives every system
    (mixtral-offloading: its own int4 defaults; oracle: each metric's floor from the schedule behind it)."""
    import json

    from moesim.cli import main
    trace, hw = files
    out = tmp_path / "m.json"
    assert main(["replay", trace, "--hw", hw, "--system", system, "--set", "cache.slots_per_layer=2",
                 "--json", str(out)]) == 0
    given = json.loads(out.read_text())
    run = moesim.replay(trace, hw=hw, system=system, cache__slots_per_layer=2, timeline=False, decisions=False)
    assert run.raw_metrics["lower_bound"] == given["lower_bound"]
    assert run.raw_metrics["gap_to_lower_bound"] == given["gap_to_lower_bound"] >= 1.0
    row = run.metrics.iloc[0]
    assert row["gap_to_lower_bound"] == given["gap_to_lower_bound"]
    for key in ("makespan_s", "ttft_ms", "tpot_ms_mean", "slots"):
        assert row[f"lower_bound_{key}"] == given["lower_bound"][key], key


def test_a_bundled_trace_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    """Notebooks found traces/ only when Jupyter ran in the repository or notebooks/; elsewhere the first cell
    failed with 'file not found'."""
    monkeypatch.chdir(tmp_path)
    path = moesim.bundled_trace("mixtral-8x7b-humaneval")
    assert path.is_absolute() and path.is_file() and path == moesim.bundled_trace("mixtral-8x7b-humaneval.parquet")
    assert moesim.replay(slice_trace(path, tmp_path / "s.parquet", steps=2)).metrics.prefill_tokens[0] == 135
    with pytest.raises(ConfigError, match=r"no bundled trace named 'mixtral'.*did you mean mixtral-8x7b-humaneval\?"):
        moesim.bundled_trace("mixtral")


def test_a_replay_has_one_row_per_step_and_saves_and_loads_whole(files, tmp_path):
    """A replay gave no per-step figures (each step's latency had to be rebuilt from the timeline) and had no way
    to be saved and read back beside the frames one by one."""
    trace, hw = files
    run = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    steps = run.steps
    assert list(steps.step) == sorted(set(run.timeline.step)) and set(steps.phase) == {"prefill", "decode"}
    assert steps.latency_ms.sum() / 1e3 == pytest.approx(run.metrics.makespan_s[0])
    decode = steps[steps.phase == "decode"]
    assert decode.latency_ms.mean() == pytest.approx(run.metrics.tpot_ms_mean[0])
    hits = run.decisions.groupby("step").action.apply(lambda a: (a == "gpu_hit").sum())
    assert list(steps.gpu_hit) == list(hits.reindex(steps.step, fill_value=0))
    assert list(steps.tokens[:3]) == [3, 3, 2] and steps.requests[2] == [0, 1]  # two prompts, then both decode
    saved = run.save(tmp_path / "run")
    back = moesim.load_replay(saved)
    as_json = functools.partial(json.dumps, default=lambda v: v.item())  # NaN equals itself there
    assert repr(back) == repr(run) and as_json(back.raw_metrics) == as_json(run.raw_metrics)
    for name in ("metrics", "timeline", "decisions", "steps"):
        pd.testing.assert_frame_equal(getattr(back, name), getattr(run, name), check_dtype=False,
                                      check_categorical=False)
    assert isinstance(back.plot_timeline(steps=(2, 3)), Figure)
    bare = moesim.replay(trace, hw=hw, timeline=False, decisions=False)
    assert "gpu_hit" not in bare.steps and moesim.load_replay(bare.save(tmp_path / "run")).timeline is None
    with pytest.raises(ConfigError, match="holds no saved replay"):
        moesim.load_replay(tmp_path)


def test_a_saved_replay_of_the_wrong_kind_or_a_foreign_folder_is_one_line(files, tmp_path):
    """save(5) and load_replay(5) raised pathlib's TypeError; a folder whose result.json another tool wrote, or
    whose files were cut short, raised a JSONDecodeError, KeyError('system') or ArrowInvalid."""
    trace, hw = files
    run = moesim.replay(trace, hw=hw, timeline=False, decisions=False)
    for call in (run.save, moesim.load_replay):
        with pytest.raises(ConfigError, match="folder must be a folder's path, got 5") as err:
            call(5)
        assert err.value.field == "folder"
    folder = tmp_path / "other"
    folder.mkdir()
    for text, words in (("{not json", "Expecting property name"), ('{"accuracy": 0.9}', "no 'system'")):
        (folder / "result.json").write_text(text)
        with pytest.raises(ConfigError, match="holds no replay that ReplayResult.save wrote") as err:
            moesim.load_replay(folder)
        assert words in str(err.value) and err.value.field == "folder"
    run.save(folder)
    (folder / "metrics.parquet").write_bytes(b"cut")
    with pytest.raises(ConfigError, match="metrics.parquet"):
        moesim.load_replay(folder)


def test_a_save_that_fails_midway_leaves_the_earlier_result_whole_and_says_one_line(files, tmp_path, monkeypatch):
    """run.save(FOLDER) over an earlier result wrote frame after frame in place: one failing (a full disk) or
    interrupted (Kernel > Interrupt) part-way left the earlier result.json beside this run's first frames,
    which load_replay read back as one result; a folder it cannot make raised a bare FileNotFoundError."""
    import pandas as pd
    trace, hw = files
    earlier = moesim.replay(trace, hw=hw, system="cpu-only")
    later = moesim.replay(trace, hw=hw, system="gpu-only-lru")
    folder = earlier.save(tmp_path / "run")
    real = pd.DataFrame.to_parquet
    written: list[str] = []

    def full_disk(frame, path, *args, **kwargs):
        written.append(str(path))
        if len(written) == 2:  # the timeline, after the metrics
            raise OSError(28, "No space left on device")
        return real(frame, path, *args, **kwargs)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", full_disk)
    with pytest.raises(ConfigError) as err:
        later.save(folder)
    assert "No space left on device" in str(err.value) and err.value.field == "folder"
    monkeypatch.setattr(pd.DataFrame, "to_parquet", real)
    back = moesim.load_replay(folder)
    assert back.system == "cpu-only"
    pd.testing.assert_frame_equal(back.metrics, earlier.metrics, check_dtype=False)
    assert sorted(p.name for p in folder.iterdir()) == ["decisions.parquet", "metrics.parquet", "result.json",
                                                        "steps.parquet", "timeline.parquet"]
    assert moesim.load_replay(later.save(folder)).system == "gpu-only-lru"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the output") as err:
        later.save(blocker / "run")  # its parent is a file: mkdir fails
    assert err.value.field == "folder"


def test_the_engine_timeline_setting_is_obeyed_or_refused_beside_the_argument(files):
    """settings={"engine.timeline": False} was overridden by timeline's default True: the timeline was kept (and
    the replay slowed) without a word. The setting now decides when the argument is not given; both: one line."""
    trace, hw = files
    run = moesim.replay(trace, hw=hw, settings={"engine.timeline": False}, engine__decisions="false")
    assert run.timeline is None and run.decisions is None
    assert moesim.replay(trace, hw=hw).timeline is not None
    with pytest.raises(ConfigError, match="timeline=True and the setting 'engine.timeline' both say") as err:
        moesim.replay(trace, hw=hw, timeline=True, engine__timeline=False)
    assert err.value.field == "timeline" and "fix: " in str(err.value)


@pytest.mark.parametrize("shorthand, setting", [({"qps": 1.0}, {"workload.qps": 2.0}),
                                                ({"requests": 2}, {"workload__requests": 3}),
                                                ({"scheduler": "vllm"}, {"scheduler": "static"})])
def test_a_serve_shorthand_and_the_same_setting_are_refused_together(files, shorthand, setting):
    """serve(qps=1, settings={'workload.qps': 2}) served at 2 req/s without a word (the settings' value won),
    where qps=1 with workload__qps=2 was refused as given twice."""
    trace, hw = files
    name = next(iter(shorthand))
    key, value = next(iter(setting.items()))
    with pytest.raises(ConfigError, match=re.escape(f"{name}={shorthand[name]!r} and settings={{{key!r}: {value!r}}} "
                                                    "both set parameter")) as err:
        moesim.serve(trace, hw=hw, **{"qps": 1.0, "requests": 2, **shorthand}, settings=setting)
    assert err.value.field == name and "fix: " in str(err.value)


def test_a_timeline_window_that_misses_the_run_is_one_line_on_its_unit(files):
    """plot_timeline(window=(100, 200)), milliseconds as the axis shows them, drew an empty figure without a word
    (steps past the end were refused): the window is in seconds and this run lasts well under 100 s."""
    trace, hw = files
    run = moesim.replay(trace, hw=hw, cache__slots_per_layer=2)
    end = run.timeline.end_s.max()
    lo, hi = end * 1e3 / 4, end * 1e3 / 2  # a stretch of the run, in milliseconds
    with pytest.raises(ConfigError, match=r"s holds nothing: the timeline runs from 0 s to") as err:
        run.plot_timeline(window=(lo, hi))
    assert err.value.field == "window" and f"e.g. window=({lo / 1e3:g}, {hi / 1e3:g}) for" in str(err.value)
    assert isinstance(run.plot_timeline(window=(lo / 1e3, hi / 1e3)), Figure)
    assert isinstance(run.plot_timeline(window=(end / 2, end * 10)), Figure)  # partly past the end: drawn


@pytest.mark.parametrize("call", ["replay", "serve"])
def test_a_system_given_where_the_profile_goes_names_system(files, call):
    """moesim.replay(trace, "smoe"), the system as the second argument, was 'smoe: hardware profile not found'
    with every profile listed and no word of system=."""
    trace, _ = files
    with pytest.raises(ConfigError, match=r"hw='smoe' is a system, not a hardware profile \(fix: system='smoe'") as err:
        getattr(moesim, call)(trace, "smoe")
    assert err.value.field == "hw"


def test_a_loaded_replays_steps_equal_the_saved_ones(files, tmp_path):
    """Read back from Parquet, each step's requests were numpy arrays where the replay gave lists: the loaded
    steps did not equal the saved ones (``steps.equals``) and ``requests[2] == [0, 1]`` compared element-wise."""
    trace, hw = files
    run = moesim.replay(trace, hw=hw, system="gpu-only-lru", cache__slots_per_layer=2)
    back = moesim.load_replay(run.save(tmp_path / "run"))
    assert back.steps.equals(run.steps)
    assert back.steps.requests[2] == [0, 1] and all(type(r) is int for r in back.steps.requests[2])


def test_the_failed_points_warning_counts_the_reasons_left_out_in_words():
    """Six reasons, five shown: the last line read '... and 1 more reasons'."""
    frame = pd.DataFrame({"status": ["error"] * 7 + ["ok"], "error": [f"reason {i % 6}" for i in range(7)] + [""]})
    with pytest.warns(moesim.api.SweepPointsFailed):
        text = moesim.api.warn_failed_points(frame)
    assert text.splitlines()[-1] == "  ... and 1 more reason (column 'error')"
    with pytest.warns(moesim.api.SweepPointsFailed):
        text = moesim.api.warn_failed_points(frame, shown=4)
    assert text.splitlines()[-1] == "  ... and 2 more reasons (column 'error')"


def test_sweep_out_in_a_folder_that_does_not_exist_is_refused_as_on_the_command_line(tmp_path, monkeypatch):
    """moesim.sweep(out='newdir/x.parquet') made newdir/ and ran, where `moesim sweep --out` refuses it: a typo in a
    folder name left a stray folder with the results in it."""
    import moesim
    from moesim.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    spec = {"traces": [str(moesim.bundled_trace("mixtral-8x7b-humaneval"))], "hw": ["rtx4090"],
            "systems": ["gpu-only-lru"]}
    with pytest.raises(ConfigError, match="folder newdir does not exist") as refused:
        moesim.sweep(spec, out="newdir/x.parquet")
    assert refused.value.field == "out" and "mkdir -p newdir" in refused.value.fix
    assert list(tmp_path.iterdir()) == []


def test_load_replay_of_a_folder_that_does_not_exist_says_so(tmp_path, monkeypatch):
    """It said 'nope holds no saved replay (no result.json)', as if the folder were there."""
    import moesim
    from moesim.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"nope: no such folder \(looked at .*nope\)") as refused:
        moesim.load_replay("nope")
    assert refused.value.field == "folder" and "relative one starts at the working folder" in refused.value.fix
    with pytest.raises(ConfigError, match="holds no saved replay"):
        moesim.load_replay(tmp_path)
