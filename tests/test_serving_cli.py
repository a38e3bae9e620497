"""`moesim serve-sim`, `moesim.serve` and sweeps over workload.*: outputs, figures and one-line errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import yaml

import moesim
from moesim.analysis.serving import REQUEST_COLUMNS, max_qps_under_slo, parse_slo
from moesim.cli import main
from moesim.errors import ConfigError
from tests.factories import profile_dict, tiny_model, write_tiny_trace
from tests.sim.test_serving import request_routing


@pytest.fixture
def files(tmp_path):
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             request_routing(np.random.default_rng(3), model, [(4, 6), (2, 3)]))
    profile = tmp_path / "hw.yaml"
    profile.write_text(yaml.safe_dump(profile_dict(pcie_gbps=1.0)))
    return str(trace), str(profile)


def test_serve_sim_writes_metrics_requests_and_figure(files, tmp_path, capsys):
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "gpu-only-lru", "--qps", "50", "--requests", "6",
                 "--slo", "ttft_ms=1000,tpot_ms=1000", "--json", str(tmp_path / "m.json"),
                 "--requests-out", str(tmp_path / "r.parquet"), "--plot", str(tmp_path / "f.png")])
    assert code == 0, capsys.readouterr().err
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["requests"] == 6 and m["qps"] == 50 and m["scheduler"] == "vllm"
    for key in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p99", "e2e_ms_p99", "queue_ms_p50",
                "goodput_rps", "slo_attainment", "throughput_rps", "offered_qps", "preemptions"):
        assert key in m
    assert m["goodput_rps"] <= m["throughput_rps"] <= m["offered_qps"]
    frame = pd.read_parquet(tmp_path / "r.parquet")
    assert list(frame.columns) == list(REQUEST_COLUMNS) and len(frame) == 6
    assert (tmp_path / "f.png").stat().st_size > 0


def test_serve_sim_refuses_two_outputs_to_stdout(files, capsys):
    """`serve-sim --json - --requests-out /dev/stdout` would mix Parquet into the JSON: one line naming both."""
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--qps", "50", "--requests", "6", "--json", "-",
                 "--requests-out", "/dev/stdout"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.strip().count("\n") == 0, err
    assert "--json - and --requests-out /dev/stdout both write to standard output" in err


def test_serve_sim_draws_each_request(files, tmp_path, capsys):
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--qps", "50", "--requests", "6", "--requests-plot",
                 str(tmp_path / "q.svg")])
    assert code == 0, capsys.readouterr().err
    svg = (tmp_path / "q.svg").read_text()
    assert "6 requests at 50 req/s" in svg and "prefill to first token" in svg


def test_serve_sim_grid_over_systems_and_qps(files, tmp_path, capsys):
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "gpu-only-lru,cpu-only", "--qps", "1,100",
                 "--requests", "4", "--json", str(tmp_path / "m.json")])
    assert code == 0
    runs = json.loads((tmp_path / "m.json").read_text())  # per system, a list in --qps order
    assert {name: [(r["system"], r["qps"]) for r in rows] for name, rows in runs.items()} == \
        {"gpu-only-lru": [("gpu-only-lru", 1), ("gpu-only-lru", 100)], "cpu-only": [("cpu-only", 1), ("cpu-only", 100)]}
    # a higher load queues more
    assert runs["gpu-only-lru"][1]["e2e_ms_mean"] >= runs["gpu-only-lru"][0]["e2e_ms_mean"]


def test_serve_sim_prints_a_dash_for_the_tpot_of_prompts_alone(tmp_path, capsys):
    """Requests of a prefill-only trace emit one token each: TPOT is undefined, and the table says "-"."""
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "p.parquet", model,
                             request_routing(np.random.default_rng(5), model, [(12, 0), (9, 0)]))
    profile = tmp_path / "hw.yaml"
    profile.write_text(yaml.safe_dump(profile_dict(pcie_gbps=1.0)))
    assert main(["serve-sim", str(trace), "--hw", str(profile), "--qps", "2", "--requests", "3",
                 "--json", str(tmp_path / "m.json")]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if "gpu-only-lru" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[3] == "- / -" and "nan" not in table
    assert cells[1] == "2" and cells[2].count("/") == 1 and "-" not in cells[2]
    assert json.loads((tmp_path / "m.json").read_text())["tpot_ms_p50"] is None  # JSON has no NaN


def test_serve_sim_says_why_runs_preempted(files, capsys):
    """A KV cache too small for the load preempts; the note names the budget (in the scheduler's blocks) and
    each run's count."""
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "cpu-only,gpu-only-lru", "--qps", "100",
                 "--requests", "6", "--set", "workload.kv_tokens=12", "--set", "scheduler.kv_block_tokens=4",
                 "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = list(json.loads(captured.out).values())  # one rate: each system's run under its name
    assert all(r["preemptions"] > 0 for r in rows)
    listed = "; ".join(f"{r['system']} {r['preemptions']} preemption{'s' if r['preemptions'] > 1 else ''}, "
                       f"{r['recomputed_tokens']} tokens prefilled again" for r in rows)
    assert f"note: KV entries for 12 tokens in 3 blocks of 4 at 100 req/s (workload.kv_tokens): {listed}" in " ".join(
        captured.err.split())


def test_serve_sim_prints_the_runs_notes_and_names_identical_rows(files, tmp_path, capsys):
    """ktransformers-ed defers nothing on a top-2 model (001 Sec. 4.2 keeps 2 immediate): its rows equal
    ktransformers', and the note saying why is printed, as replay prints it."""
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "ktransformers,ktransformers-ed,gpu-only-lru",
                 "--qps", "1,100", "--requests", "4", "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "note: ktrans-deferral: 001 Sec. 6.3 gives no deferral count for tiny" in out
    assert out.count("note: ktrans-deferral") == 1  # once, not once per run
    for rate in ("1", "100"):
        assert f"identical rows ktransformers, ktransformers-ed at {rate} req/s (" in " ".join(out.split())
    runs = json.loads((tmp_path / "m.json").read_text())
    assert all("cost_fallbacks" in r["engine"] for rows in runs.values() for r in rows)


@pytest.mark.parametrize("args, words", [
    (["--slo", "ttft=5"], "--slo"),
    (["--set", "workload.arrival=bursty"], "workload.arrival"),
    (["--scheduler", "fifo"], "scheduler"),
    (["--system", "cpu-only,gpu-only-lru", "--requests-out", "x.parquet"], "--requests-out"),
    (["--qps", "1,2", "--requests-plot", "x.png"], "--requests-plot needs one system and one QPS"),
    (["--requests-plot", "x.txt"], "written as a figure"),
    (["--seed", "-1"], "--seed"),
    (["--qps", "-1"], "--qps"),
    (["--qps", "0"], "--qps"),
    (["--qps", "1,,2"], "empty rate"),
    (["--qps", ""], "empty rate"),
    (["--qps", "1,2", "--set", "workload.arrival=closed"], "would run alike"),
    (["--qps", "1,2,1.0"], "the rate 1.0 is given twice"),  # ran twice, its rows "identical" to each other
])
def test_bad_input_is_one_line_and_exit_2(files, capsys, args, words):
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_a_rate_too_low_for_its_requests_is_refused_in_its_own_words(files, capsys):
    """A positive rate refused for spanning too much simulated time was reworded "'1e-9' is not a rate"."""
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--qps", "1,1e-9", "--requests", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'--qps'" in err and "step times keep their digits" in err and "not a rate" not in err


@pytest.mark.parametrize("option, name", [("--requests-out", "arrivals.parquet"), ("--json", "arrivals.json")])
def test_serve_sim_never_writes_over_its_arrival_file(files, tmp_path, capsys, option, name):
    """--requests-out onto workload.arrival_file replaced the arrival times with the request table."""
    trace, hw = files
    arrivals = tmp_path / name
    if name.endswith(".parquet"):
        pd.DataFrame({"arrival_s": [0.0, 1.0]}).to_parquet(arrivals)
    else:
        arrivals.write_text("arrival_s\n0\n1\n")
    before = arrivals.read_bytes()
    code = main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--set", "workload.arrival=trace",
                 "--set", f"workload.arrival_file={arrivals}", option, str(arrivals)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "would overwrite an input (--set workload.arrival_file" in err
    assert arrivals.read_bytes() == before


def test_every_rate_is_checked_before_the_first_run(files, capsys, monkeypatch):
    import moesim.sim.serving
    runs = []
    monkeypatch.setattr(moesim.sim.serving, "serve", lambda *args, **kwargs: runs.append(args))
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--qps", "1,2,fast"])
    err = capsys.readouterr().err
    assert code == 2 and runs == []
    assert "'--qps'" in err and "'fast'" in err and len(err.strip().splitlines()) == 1


def test_api_serve_and_sweep_over_workload(files, tmp_path):
    trace, hw = files
    run = moesim.serve(trace, hw=hw, system="cpu-only", qps=20, requests=5, slo={"ttft_ms": 1e6},
                       scheduler="sarathi", workload__arrival="gamma", workload__cv=2)
    assert len(run.requests) == 5 and run.metrics["slo_attainment"] == 1.0 and run.metrics["arrival"] == "gamma"
    figure = run.plot_requests(tmp_path / "requests.png")
    assert figure.axes[0].get_title(loc="left") == \
        "cpu-only on hw.yaml (test gpu + test cpu, 8 cores, 100 GB/s DRAM): 5 requests at 20 req/s"
    assert (tmp_path / "requests.png").read_bytes()[:4] == b"\x89PNG" and figure._repr_png_()[:4] == b"\x89PNG"
    frame = moesim.sweep({"traces": [trace], "systems": ["cpu-only"], "hw": [hw],
                          "grid": {"workload__qps": [1, 50], "workload__requests": [4]}}, workers=1, progress=False)
    assert frame.status.tolist() == ["ok", "ok"]
    assert frame.qps.tolist() == [1.0, 50.0] and (frame.throughput_rps <= frame.offered_qps).all()
    assert "engine_gpu_hit_rate" in frame
    from moesim.analysis.html_report import render_report
    page = render_report(frame, gantt=False)
    assert page.count("data:image/png") == 3 and "Time to first token per request against the arrival rate" in page


def test_max_qps_under_slo_and_slo_parsing():
    rows = [{"system": "a", "qps": q, "ttft_ms_p90": t} for q, t in ((1, 10), (2, 40), (4, 90), (8, 30))] + \
           [{"system": "b", "qps": 1, "ttft_ms_p90": 200}]
    best = max_qps_under_slo(rows, {"ttft_ms": 50})
    assert best["a"] == 2 and np.isnan(best["b"])  # 8 passes by chance above a failing 4: not counted
    assert parse_slo("ttft_ms=500, tpot_ms=80") == {"ttft_ms": 500.0, "tpot_ms": 80.0}
    with pytest.raises(ConfigError, match="not a number"):
        parse_slo("ttft_ms=fast")


def test_serve_sim_all_runs_every_system_that_can_serve(files, tmp_path, capsys):
    from moesim.policy.systems import system_names
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "all", "--qps", "20", "--requests", "3",
                 "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert code == 0
    runs = json.loads((tmp_path / "m.json").read_text())
    assert sorted(runs) == sorted(system_names())  # every system under its name, skipped ones too (as replay)
    served = {name for name, run in runs.items() if "skipped" not in run}
    skipped = {name for name in system_names() if f"skipped {name}:" in out}
    assert served | skipped == set(system_names()) and not served & skipped
    assert {"cpu-only", "gpu-only-lru", "static-hot", "fiddler", "llamacpp"} <= served and "oracle" in skipped
    reason = runs["oracle"]["skipped"]
    assert runs["oracle"] == {"system": "oracle", "qps": 20, "skipped": reason}
    assert "'oracle' is a portfolio of schedules" in reason and f"skipped oracle: {reason}" in " ".join(out.split())
    assert all(runs[name]["system"] == name and runs[name]["requests"] == 3 for name in served)
    assert f"{len(skipped)} of {len(system_names())} systems skipped" in out


def test_serve_sim_json_to_stdout_is_json_only(files, capsys):
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "gpu-only-lru", "--qps", "50", "--requests", "4",
                 "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["requests"] == 4  # the table went to stderr
    assert "serving on" in err


def test_serve_sim_reports_finished_requests_on_a_piped_stderr(files, capsys, monkeypatch):
    trace, hw = files
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")  # a line per advance
    code = main(["serve-sim", trace, "--hw", hw, "--system", "cpu-only,static-hot", "--qps", "50,100",
                 "--requests", "3"])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("serve-sim: ")]
    counts = [int(line.split()[1].split("/")[0]) for line in lines[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12 and all("/12 requests" in line for line in lines)
    assert any("(cpu-only at 50 req/s)" in line for line in lines)
    assert any("(static-hot at 100 req/s)" in line for line in lines)
    assert lines[-1].startswith("serve-sim: done, 12/12 requests (100%)")


def test_serve_sim_counts_a_skipped_systems_requests_as_done(files, capsys, monkeypatch):
    """--system all: belady cannot serve, so its 2 rates x 2 requests count as done when it is skipped; the bar
    ends at 3 systems x 2 rates x 2 requests = 12 of 12 (it ended at 8/12, 67%)."""
    import moesim.policy.systems
    monkeypatch.setattr(moesim.policy.systems, "system_names", lambda: ["cpu-only", "belady", "static-hot"])
    monkeypatch.setenv("MOESIM_PROGRESS_INTERVAL", "0")  # a line per advance
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "all", "--qps", "50,100", "--requests", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "skipped belady:" in out and "1 of 3 systems skipped" in out
    lines = [line for line in err.splitlines() if line.startswith("serve-sim: ")]
    counts = [int(line.split()[1].split("/")[0]) for line in lines[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12 and all("/12 requests" in line for line in lines)
    assert any(line.startswith("serve-sim: 8/12 requests") and "(static-hot at 50 req/s)" in line for line in lines)
    assert lines[-1].startswith("serve-sim: done, 12/12 requests (100%)")


def test_serve_sim_refuses_a_workload_beyond_host_memory_in_one_line(files, tmp_path, capsys):
    trace, hw = files
    out = tmp_path / "m.json"
    code = main(["serve-sim", trace, "--hw", hw, "--system", "cpu-only", "--requests", str(10**12),
                 "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "workload.requests" in err and "GiB of host memory" in err and "serve at most" in err
    assert not out.exists()


@pytest.mark.parametrize("slo, text, words", [
    ({"ttft": 5}, "ttft=5", "unknown SLO 'ttft' (fix: did you mean ttft_ms? the SLOs are ttft_ms, tpot_ms, e2e_ms)"),
    ({"ttft_ms": -5}, "ttft_ms=-5", "SLO 'ttft_ms=-5' must be a positive, finite number of milliseconds"),
    ({"ttft_ms": float("nan")}, "ttft_ms=nan", "must be a positive, finite number"),
    ({"tpot_ms": "fast"}, "tpot_ms=fast", "SLO 'tpot_ms=fast' is not a number"),
])
def test_api_serve_checks_slo_as_serve_sim_does(files, capsys, slo, text, words):
    trace, hw = files
    with pytest.raises(ConfigError) as api:
        moesim.serve(trace, hw=hw, requests=2, slo=slo)
    code = main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--slo", text])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err
    # one check for both: the same line, the field named as each caller spells it
    assert str(api.value) == err.removeprefix("moesim: error: ").replace("field '--slo'", "field 'slo'")


@pytest.mark.parametrize("slo, words", [
    ({"ttft_ms": None}, "SLO 'ttft_ms=None' is not a number"),
    ({"ttft_ms": True}, "SLO 'ttft_ms=True' is not a number"),
    (500, "an SLO is a dict or a string, got 500"),
])
def test_api_serve_refuses_slo_values_of_the_wrong_kind(files, slo, words):
    trace, hw = files
    with pytest.raises(ConfigError, match=r"^field 'slo': ") as api:
        moesim.serve(trace, hw=hw, requests=2, slo=slo)
    assert words in str(api.value) and "\n" not in str(api.value)


@pytest.mark.parametrize("text, words", [
    ("", "field '--slo': no SLO given (fix: write e.g. ttft_ms=500,tpot_ms=100 (leave the SLO out for no goodput))"),
    (" ", "field '--slo': no SLO given"),
    ("ttft_ms=1,,tpot_ms=2", "field '--slo': an empty SLO in 'ttft_ms=1,,tpot_ms=2'"),
    ("ttft_ms=1,", "an empty SLO in 'ttft_ms=1,'"),
    ("ttft_ms=1,ttft_ms=2", "field '--slo': SLO 'ttft_ms' given twice (fix: give each SLO once)"),
    ("ttft_ms=1, tpot_ms=3,ttft_ms =1", "SLO 'ttft_ms' given twice"),
])
def test_serve_sim_refuses_an_empty_slo_and_a_key_given_twice(files, capsys, monkeypatch, text, words):
    import moesim.sim.serving
    runs = []
    monkeypatch.setattr(moesim.sim.serving, "serve", lambda *args, **kwargs: runs.append(args))
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--slo", text])
    err = capsys.readouterr().err.strip()
    assert code == 2 and runs == [] and len(err.splitlines()) == 1 and words in err
    with pytest.raises(ConfigError, match=r"^field 'slo': "):  # the API's string form, the same check
        moesim.serve(trace, hw=hw, requests=2, slo=text)


@pytest.mark.parametrize("args, words", [
    (["--requests", "3", "--set", "workload.requests=5"],
     "field '--requests': workload.requests is given twice: --requests 3 and --set workload.requests=5"),
    (["--scheduler", "static", "--set", "scheduler=sarathi"],
     "field '--scheduler': scheduler is given twice: --scheduler static and --set scheduler=sarathi"),
])
def test_serve_sim_refuses_a_shorthand_and_its_setting_together(files, capsys, monkeypatch, args, words):
    """The option won and the --set value was dropped unseen (the JSON said scheduler static); moesim.serve
    refuses the same pair."""
    import moesim.sim.serving
    runs = []
    monkeypatch.setattr(moesim.sim.serving, "serve", lambda *args, **kwargs: runs.append(args))
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and runs == [] and len(err.splitlines()) == 1 and words in err


def test_api_serve_refuses_an_empty_slo_dict(files):
    trace, hw = files
    with pytest.raises(ConfigError, match=r"^field 'slo': no SLO given \(fix: .*leave the SLO out"):
        moesim.serve(trace, hw=hw, requests=2, slo={})


@pytest.mark.parametrize("traces, words", [
    ([], "field 'traces': no trace given (fix: give a trace path, or a list of one or more"),
    ((), "field 'traces': no trace given"),
    (None, "field 'traces': traces must be a trace path or a list of them, got None"),
    ([None], "got [None]"),
])
def test_api_serve_refuses_no_traces_in_one_line(files, traces, words):
    _, hw = files
    with pytest.raises(ConfigError) as err:
        moesim.serve(traces, hw=hw, requests=2)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_serve_sim_suggests_only_the_oracle_members_it_serves(files, capsys):
    from moesim.sim.run import members
    from moesim.sim.serving import check_servable
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "oracle", "--requests", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "'oracle' is a portfolio of schedules" in err
    listed = re.search(r"members[^:]*: (.*)\)$", err).group(1).split(", ")
    assert listed == [m for m in members("oracle") if m not in ("belady", "oracle-prefetch")]
    for name in listed:  # every one suggested is taken
        check_servable(name, {})
    assert main(["serve-sim", trace, "--hw", hw, "--system", "oracle-pinned", "--requests", "2"]) == 0
    for name in ("belady", "oracle-prefetch"):
        with pytest.raises(ConfigError, match="plans with the trace's future routing"):
            check_servable(name, {})


def test_serve_sim_suggests_no_member_of_oracle_when_none_takes_the_settings(files, capsys):
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "oracle", "--set", "cache=belady"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("serving runs single systems (fix: serve an online system (see `moesim "
                                      "systems`))")


def test_request_plots_of_runs_without_a_rate_say_what_set_their_arrivals(files, tmp_path, capsys):
    trace, hw = files
    closed = moesim.serve(trace, hw=hw, system="cpu-only", requests=4, workload__arrival="closed",
                          workload__concurrency=2)
    assert np.isnan(closed.metrics["qps"])  # a closed loop has no arrival rate ...
    title = closed.plot_requests().axes[0].get_title(loc="left")
    machine = "hw.yaml (test gpu + test cpu, 8 cores, 100 GB/s DRAM)"  # the profile with its GPU and CPU
    assert title == f"cpu-only on {machine}: 4 requests from 2 closed-loop clients"  # ... its clients define it
    (tmp_path / "arrivals.csv").write_text("arrival_s\n0\n0.01\n0.5\n")
    logged = moesim.serve(trace, hw=hw, system="cpu-only", requests=3, workload__arrival="trace",
                          workload__arrival_file=str(tmp_path / "arrivals.csv"))
    assert logged.plot_requests().axes[0].get_title(loc="left") == \
        f"cpu-only on {machine}: 3 requests arriving at the times of arrivals.csv"
    code = main(["serve-sim", trace, "--hw", hw, "--system", "cpu-only", "--requests", "4", "--set",
                 "workload.arrival=closed", "--set", "workload.concurrency=1", "--requests-plot",
                 str(tmp_path / "closed.svg")])
    assert code == 0, capsys.readouterr().err
    svg = (tmp_path / "closed.svg").read_text()
    assert "4 requests from 1 closed-loop client" in svg and "req/s" not in svg  # not --qps's default of 1
    assert "test gpu + test cpu" in svg


def test_serve_sim_json_is_shaped_by_the_command_line(files, tmp_path, capsys):
    trace, hw = files

    def runs(*args):
        out = tmp_path / "m.json"
        assert main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--json", str(out), *args]) == 0
        return json.loads(out.read_text())

    one = runs("--system", "cpu-only", "--qps", "50")
    assert one["system"] == "cpu-only" and one["qps"] == 50  # a run: its metrics, as replay's one system
    rates = runs("--system", "cpu-only", "--qps", "50,100")
    assert [r["qps"] for r in rates] == [50, 100]
    systems = runs("--system", "cpu-only,static-hot", "--qps", "50")  # several systems: keyed by name
    assert sorted(systems) == ["cpu-only", "static-hot"]
    assert systems["cpu-only"]["qps"] == 50 and systems["static-hot"]["requests"] == 2
    grid = runs("--system", "cpu-only,static-hot", "--qps", "50,100")
    assert {name: [r["qps"] for r in rows] for name, rows in grid.items()} == \
        {"cpu-only": [50, 100], "static-hot": [50, 100]}


def test_serve_sim_json_keeps_a_skipped_system_at_every_rate(files, tmp_path, capsys, monkeypatch):
    import moesim.policy.systems
    monkeypatch.setattr(moesim.policy.systems, "system_names", lambda: ["cpu-only", "belady"])
    trace, hw = files
    code = main(["serve-sim", trace, "--hw", hw, "--system", "all", "--qps", "50,100", "--requests", "2",
                 "--json", str(tmp_path / "m.json")])
    assert code == 0, capsys.readouterr().err
    runs = json.loads((tmp_path / "m.json").read_text())
    assert [r["qps"] for r in runs["cpu-only"]] == [50, 100]
    reason = runs["belady"][0]["skipped"]
    assert "'belady' plans with the trace's future routing" in reason
    assert runs["belady"] == [{"system": "belady", "qps": 50, "skipped": reason},
                              {"system": "belady", "qps": 100, "skipped": reason}]


def test_serve_sim_all_skipped_is_the_first_reason(files, tmp_path, capsys, monkeypatch):
    import moesim.policy.systems
    monkeypatch.setattr(moesim.policy.systems, "system_names", lambda: ["belady", "oracle"])
    trace, hw = files
    out = tmp_path / "m.json"
    code = main(["serve-sim", trace, "--hw", hw, "--system", "all", "--requests", "2", "--json", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "'belady' plans with the trace's future routing" in err
    assert not out.exists()


@pytest.mark.parametrize("qps", [[0.5, 1], "0.5,1", np.array([0.5, 1.0])], ids=["list", "text", "array"])
def test_moesim_serve_given_several_rates_says_a_call_serves_one(files, qps):
    """`moesim.serve(T, qps=[0.5, 1])`, as `--qps 0.5,1` takes rates, was "'[0.5, 1]' is not a valid float" with
    the fix "give a float": it now says a call serves one rate, and how to serve several."""
    trace, hw = files
    with pytest.raises(ConfigError, match=r"is a list of rates; a call serves one") as caught:
        moesim.serve(trace, hw=hw, system="cpu-only", qps=qps, requests=2)
    assert caught.value.field == "qps" and "'workload.qps': [0.5, 1" in caught.value.fix
    assert "\n" not in str(caught.value)
    assert moesim.serve(trace, hw=hw, system="cpu-only", qps=np.float64(2.0), requests=2).metrics.qps == 2.0
