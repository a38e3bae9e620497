"""The first workflows of a new user: JSON on stdout, one default system, `systems`, the Gantt window,
`--list-formats`, `--help-params`, warnings of failed sweep points, metric-vs-metric plots."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import moesim
from moesim.api import DEFAULT_SYSTEM, warn_failed_points
from moesim.cli import json_safe, main
from tests.factories import profile_dict, random_routing, tiny_model, write_tiny_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def files(tmp_path):
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             random_routing(np.random.default_rng(3), model, requests=1, prompt=4, decode=6))
    prefill_only = write_tiny_trace(tmp_path / "p.parquet", model,
                                    random_routing(np.random.default_rng(4), model, requests=1, prompt=5, decode=0))
    profile = tmp_path / "hw.yaml"
    profile.write_text(yaml.safe_dump(profile_dict(pcie_gbps=1.0)))
    return str(trace), str(profile), str(prefill_only)


def moesim_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command line as a user runs it: a separate process, stdout and stderr pipes (not terminals)."""
    return subprocess.run([sys.executable, "-m", "moesim", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)


# ----------------------------------------------------------------------------- --json -
def test_json_dash_puts_only_json_on_stdout_and_nan_as_null(files):
    trace, hw, prefill_only = files
    done = moesim_cli("replay", prefill_only, "--hw", hw, "--system", "cpu-only", "--json", "-")
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)  # the whole of stdout parses: no table mixed in
    assert "NaN" not in done.stdout and "Infinity" not in done.stdout
    assert metrics["tpot_ms_mean"] is None and metrics["decode_tokens_per_s"] is None  # no decode step
    assert metrics["ttft_ms"] > 0
    assert "TTFT" in done.stderr  # the table went to stderr
    if shutil.which("jq"):
        jq = subprocess.run(["jq", "-e", ".tpot_ms_mean == null and .ttft_ms > 0"], input=done.stdout,
                            capture_output=True, text=True)
        assert jq.returncode == 0 and jq.stdout.strip() == "true", jq.stderr


def test_json_dash_with_all_systems(files):
    trace, hw, _ = files
    done = moesim_cli("replay", trace, "--hw", hw, "--system", "all", "--set", "cache.slots_per_layer=2",
                      "--json", "-")
    assert done.returncode == 0, done.stderr
    by_system = json.loads(done.stdout)
    assert {"cpu-only", "gpu-only-lru", "oracle"} <= set(by_system)
    assert "time vs lower bound" in done.stderr and "time vs lower bound" not in done.stdout


def test_json_safe_replaces_every_non_finite_number():
    data = {"a": float("nan"), "b": [1.0, float("inf"), np.float32("nan")], "c": {"d": -np.inf, "e": np.int64(3)},
            "f": np.array([1.5, np.nan]), "g": True}
    safe = json_safe(data)
    assert safe == {"a": None, "b": [1.0, None, None], "c": {"d": None, "e": 3}, "f": [1.5, None], "g": True}
    json.dumps(safe, allow_nan=False)


# ----------------------------------------------------------------------------- one default system
def test_api_and_cli_share_the_default_system(files, tmp_path, capsys):
    trace, hw, _ = files
    import inspect

    from moesim.cli import replay as replay_command
    assert inspect.signature(moesim.replay).parameters["system"].default == DEFAULT_SYSTEM
    option = next(p for p in replay_command.params if p.name == "system")
    assert list(option.default) == [DEFAULT_SYSTEM] and DEFAULT_SYSTEM == "gpu-only-lru"
    out_json = tmp_path / "m.json"
    assert main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2", "--json", str(out_json)]) == 0
    from_cli = json.loads(out_json.read_text())
    from_api = moesim.replay(trace, hw=hw, cache__slots_per_layer=2, timeline=False, decisions=False)
    assert from_cli["system"] == from_api.system == DEFAULT_SYSTEM
    assert from_cli["tpot_ms_mean"] == pytest.approx(from_api.metrics.iloc[0]["tpot_ms_mean"])


# ----------------------------------------------------------------------------- systems
def test_systems_overview_fits_100_columns_and_names_every_system():
    done = moesim_cli("systems", env={"COLUMNS": "250"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    from moesim.policy.systems import SYSTEMS
    text = done.stdout
    for name in SYSTEMS:
        assert name in text, name
    assert "lru / gpu / none" in " ".join(text.split())  # gpu-only-lru's components, not truncated


def test_systems_name_lists_each_parameter_with_default_unit_and_meaning(capsys):
    assert main(["systems", "smoe"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["prefetch.n"][0] == "-1" and "experts prefetched per layer" in rows["prefetch.n"][2]
    assert rows["prefetch.management_us"][:2] == ["10.0", "us"]
    assert rows["memory.workspace_gib"][:2] == ["0.5", "GiB"]
    assert rows["engine.kernels_per_expert"][0] == "3" and "kernel launches" in rows["engine.kernels_per_expert"][2]
    assert "cache = smoe-lfu" in rows and "prefetch = smoe-token" in rows
    assert main(["systems", "nope"]) == 2


def test_systems_name_shows_a_systems_own_defaults(capsys):
    from moesim.policy.systems import SYSTEMS
    name, (key, value) = next((n, d[0]) for n, s in SYSTEMS.items() for d in [s.defaults]
                              if d and d[0][0].partition(".")[0] in ("cache", "assign", "prefetch", "engine"))
    assert main(["systems", name]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("│") and line.split("│")[1].strip() == key)
    assert row.split("│")[2].strip() == str(value)


def test_replay_help_params_is_systems_name(capsys):
    assert main(["replay", "--system", "dali", "--help-params"]) == 0
    via_replay = capsys.readouterr().out
    assert main(["systems", "dali"]) == 0
    assert capsys.readouterr().out == via_replay


def test_replay_help_params_of_several_systems_lists_each(capsys):
    assert main(["replay", "--system", "smoe,dali", "--help-params"]) == 0
    via_replay = capsys.readouterr().out
    assert main(["systems", "smoe"]) == 0
    smoe = capsys.readouterr().out
    assert main(["systems", "dali"]) == 0
    assert via_replay == smoe + capsys.readouterr().out


# ----------------------------------------------------------------------------- Gantt window
def test_window_chooses_the_steps_of_the_gantt_and_the_title_says_so(files, tmp_path, capsys, monkeypatch):
    trace, hw, _ = files
    from moesim.analysis import plots
    drawn = {}
    original = plots.plot_gantt

    def spy(frame, path=None, **kwargs):
        fig = original(frame, path, **kwargs)
        drawn.update(frame=frame, fig=fig)
        return fig
    monkeypatch.setattr(plots, "plot_gantt", spy)
    out = tmp_path / "g.png"
    assert main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2", "--plot", str(out),
                 "--window", "3:4"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    frame, fig = drawn["frame"], drawn["fig"]
    steps = frame[frame["step"].isin([3, 4])]
    lo, hi = fig.axes[0].get_xlim()
    assert lo == pytest.approx(steps["start_s"].min() * 1e3) and hi == pytest.approx(steps["end_s"].max() * 1e3)
    title = " ".join(fig._suptitle.get_text().split())  # a long title wraps where its (tmp) paths put it
    assert f"steps 3-4 of {frame['step'].nunique()}" in title
    # the default says which steps it shows too
    assert main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2", "--plot", str(out)]) == 0
    assert f"steps 0-1 of {frame['step'].nunique()}" in " ".join(drawn["fig"]._suptitle.get_text().split())


def test_window_chooses_the_steps_of_the_chrome_trace_too(files, tmp_path):
    trace, hw, _ = files
    out = tmp_path / "t.json"
    assert main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2", "--chrome-trace", str(out),
                 "--window", "3:4"]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["args"]["step"] for e in events if e["ph"] in ("X", "i")} == {3, 4}
    assert main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2", "--chrome-trace", str(out)]) == 0
    assert {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"} == set(range(7))


def test_a_window_with_nothing_to_show_it_is_refused(files, tmp_path, capsys):
    trace, hw, _ = files
    assert main(["replay", trace, "--hw", hw, "--window", "3:4", "--json", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert "--window" in err and "add --plot OUT.png or --chrome-trace OUT.json" in err


@pytest.mark.parametrize("window, words", [("4:3", "not a range"), ("a:b", "not STEP:STEP"),
                                           ("90:99", "the trace has steps 0 to 6")])
def test_bad_window_is_one_line(files, tmp_path, capsys, window, words):
    trace, hw, _ = files
    code = main(["replay", trace, "--hw", hw, "--set", "cache.slots_per_layer=2", "--plot",
                 str(tmp_path / "g.png"), "--window", window])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "--window" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g.png").exists()


def test_api_plot_timeline_takes_steps(files):
    trace, hw, _ = files
    run = moesim.replay(trace, hw=hw, cache__slots_per_layer=2)
    fig = run.plot_timeline(steps=(2, 2))
    assert "step 2 of 7" in fig._suptitle.get_text()


# ----------------------------------------------------------------------------- --list-formats, --help-params
def test_every_advertised_option_exists():
    """Each `--option` a help text names is an option of some command."""
    import re

    import click

    from moesim.cli import cli
    options: set[str] = set()
    texts: list[str] = []

    def walk(command: click.Command) -> None:
        for param in command.params:
            options.update(getattr(param, "opts", []))
            options.update(getattr(param, "secondary_opts", []))
            texts.append(getattr(param, "help", "") or "")
        texts.append(command.help or "")
        for sub in getattr(command, "commands", {}).values():
            walk(sub)
    walk(cli)
    advertised = {m for text in texts for m in re.findall(r"--[a-z][a-z-]+", text)}
    assert {"--list-formats", "--help-params"} <= advertised
    # --debug and --import are read by the entry point before click parses (moesim.cli.main), for every command
    assert advertised <= options | {"--set", "--debug", "--import"}, advertised - options


def test_list_formats_names_every_importer(capsys):
    from moesim.trace.importers import available_formats
    assert main(["trace", "import", "--list-formats"]) == 0
    out = capsys.readouterr().out
    for name in available_formats():
        assert any(line.startswith(name + " ") and len(line.split()) > 2 for line in out.splitlines()), name
    assert "olmoe-routing-stats" in out and "refused" in out


def test_trace_import_without_format_is_one_line(capsys, tmp_path):
    log = tmp_path / "x.jsonl"
    log.write_text("{}\n")
    assert main(["trace", "import", str(log), "--out", str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err
    assert "--format" in err and "--list-formats" in err and len(err.strip().splitlines()) == 1


def test_synth_help_params_gives_the_models_defaults(capsys):
    from moesim.model.presets import load_preset
    from moesim.trace.synth import SynthParams
    assert main(["trace", "synth", "--help-params", "--model", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    expected = SynthParams.for_model(load_preset("qwen3-30b-a3b"))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["skew_last"] == str(expected.skew_last) and rows["cluster_size"] == str(expected.cluster_size)
    assert "AR(1) correlation" in out and "Zipf exponent" in out


# ----------------------------------------------------------------------------- sweep warnings
def test_sweep_warns_with_the_reasons_of_failed_points(files):
    trace, hw, _ = files
    spec = {"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru"], "grid": {"cache.slots_per_layer": [2, 6]},
            "set": {"hw.gpu.memory_gib": 0.5, "hw.gpu.reserved_gib": 0.01, "memory.workspace_gib": 0.4715}}
    with pytest.warns(moesim.api.SweepPointsFailed, match=r"1 of 2 sweep points failed") as caught:
        table = moesim.sweep(spec, workers=1)
    assert (table["status"] == "error").sum() == 1
    assert "does not fit" in str(caught[0].message)  # the reason, not only a count


def test_no_warning_when_every_point_ran(files):
    trace, hw, _ = files
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["cpu-only"]}, workers=1)
    assert (table["status"] == "ok").all()


def test_warning_groups_reasons():
    frame = pd.DataFrame({"status": ["ok", "error", "error", "error"],
                          "error": [None, "x does not fit", "x does not fit", "y missing"]})
    with pytest.warns(UserWarning) as caught:
        text = warn_failed_points(frame)
    assert text.splitlines() == ["3 of 4 sweep points failed (rows with status 'error'); reasons:",
                                 "  2 x x does not fit", "  1 x y missing"]
    assert str(caught[0].message) == text


# ----------------------------------------------------------------------------- metric vs metric
@pytest.fixture
def results(files, tmp_path):
    trace, hw, _ = files
    out = tmp_path / "r.parquet"
    moesim.sweep({"traces": [trace], "hw": [hw], "systems": ["gpu-only-lru", "static-hot", "cpu-only", "oracle"],
                  "grid": {"cache.slots_per_layer": [1, 2, 4]}}, out=out, workers=1)
    return out


def test_plot_scatter_from_the_cli(results, tmp_path, capsys):
    out = tmp_path / "pareto.png"
    assert main(["plot", str(results), "--x", "gpu_memory_gib", "--y", "tpot_ms_mean", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    # --kind line on a metric x averages, scatter never does: one marker per run
    from moesim.analysis.figures import load_results, plot_scatter
    frame = load_results(results)
    fig = plot_scatter(frame, x="gpu_memory_gib", y="tpot_ms_mean")
    ax = fig.axes[0]
    markers = sum(len(c.get_offsets()) for c in ax.collections) - _front_markers(ax)
    assert markers == (frame["status"] == "ok").sum()
    assert not [line for line in ax.get_lines() if len(line.get_xdata()) and line.get_label() != "_child"
                and line.get_color() != "#222222"]  # the only line is the front
    legend = fig.legends[0]
    assert "Pareto front" in [t.get_text() for t in legend.get_texts()]
    fig.canvas.draw()
    title_box = fig._suptitle.get_window_extent()
    assert not title_box.overlaps(legend.get_window_extent())


def _front_markers(ax) -> int:
    return sum(len(c.get_offsets()) for c in ax.collections if c.get_sizes().size and c.get_sizes()[0] == 70)


def test_memory_metrics_grow_with_the_cache(results):
    frame = pd.read_parquet(results)
    lru = frame[(frame["system"] == "gpu-only-lru") & (frame["status"] == "ok")].sort_values("cache.slots_per_layer")
    cache = lru["expert_cache_gib"].to_numpy()
    per_expert = cache[0] / (2 * 1)  # 2 layers x 1 slot
    assert cache == pytest.approx(per_expert * 2 * lru["cache.slots_per_layer"].to_numpy())
    fixed = lru["gpu_memory_gib"] - lru["expert_cache_gib"]
    assert fixed.nunique() == 1 and fixed.iloc[0] > 0 and math.isfinite(fixed.iloc[0])


# ----------------------------------------------------------------------------- invariants
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_leaves = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6), st.booleans(),
                    st.none(), st.text(max_size=5))
_nested = st.recursive(_leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                       max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(_nested)
def test_json_output_is_always_strict_json(data):
    text = json.dumps(json_safe(data), allow_nan=False)  # raises on any NaN or infinity left
    back = json.loads(text)

    def same(a, b):
        if isinstance(a, float) and not math.isfinite(a):
            return b is None
        if isinstance(a, dict):
            return set(map(str, a)) == set(b) and all(same(v, b[str(k)]) for k, v in a.items())
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b
    assert same(data, back)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.1, 5.0), min_size=1, max_size=12), st.data())
def test_step_window_covers_exactly_the_chosen_steps(durations, data):
    from moesim.analysis.plots import step_window, window_label
    starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
    frame = pd.DataFrame({"step": np.arange(len(durations)), "start_s": starts, "end_s": starts + durations,
                          "resource": "gpu", "lane": 0, "kind": "expert", "layer": 0})
    first = data.draw(st.integers(0, len(durations) - 1))
    last = data.draw(st.integers(first, len(durations) - 1))
    lo, hi = step_window(frame, first, last)
    assert lo == pytest.approx(starts[first]) and hi == pytest.approx(starts[last] + durations[last])
    label = window_label(frame, (lo, hi))
    shown = f"step {first}" if first == last else f"steps {first}-{last}"
    assert label.startswith(f"{shown} of {len(durations)},")


def test_python_dash_m_keeps_the_exit_status(tmp_path):
    done = moesim_cli("trace", "synth", "--model", "mixtral-8x7b")
    assert done.returncode == 2 and "--out" in done.stderr and done.stderr.count("\n") == 1
