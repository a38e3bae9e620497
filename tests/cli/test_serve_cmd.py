"""`moesim serve-sim` input checks made before any run: the rates of --qps and what --plot needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from moesim.analysis.serving import PERCENTILES, plot_latency_vs_qps, serving_figures
from moesim.cli import main
from moesim.errors import ConfigError
from tests.test_serving_cli import files  # noqa: F401 - the fixture: a tiny trace and profile


@pytest.fixture
def no_runs(monkeypatch):
    """The serving runs the command started (none, for input it refuses)."""
    import moesim.sim.serving
    runs = []
    monkeypatch.setattr(moesim.sim.serving, "serve", lambda *args, **kwargs: runs.append(args))
    return runs


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "abc", "1e308", "1e13"])
def test_a_rate_out_of_range_says_the_range(files, capsys, no_runs, rate):  # noqa: F811
    """'1e308' is positive and finite, yet was refused with "give positive finite rates", which it is."""
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--qps", rate]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"moesim: error: field '--qps': '{rate}' is not a rate in requests/s "
                   "(fix: give positive finite rates up to 1.09951e+12, e.g. 0.5,1,2)")
    assert no_runs == []


@pytest.mark.parametrize("settings", [["workload.arrival=closed"],
                                      ["workload.arrival=trace", "workload.arrival_file=a.csv"]])
def test_plot_without_an_arrival_rate_is_refused_before_any_run(files, tmp_path, capsys, no_runs,  # noqa: F811
                                                                settings):
    """A closed loop's --plot drew empty axes (every run's qps is nan) and exited 0."""
    trace, hw = files
    out = tmp_path / "p.png"
    args = ["serve-sim", trace, "--hw", hw, "--plot", str(out)] + [a for s in settings for a in ("--set", s)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "field '--plot'" in err and "sets none" in err
    assert "--requests-plot" in err and no_runs == [] and not out.exists()


def closed_rows() -> list[dict]:
    return [{"system": s, "qps": float("nan"), **{f"{m}_p{q}": 10.0 for m in ("ttft_ms", "tpot_ms", "e2e_ms")
                                                   for q in PERCENTILES}} for s in ("cpu-only", "static-hot")]


def test_latency_against_a_rate_no_run_has_is_one_line():
    with pytest.raises(ConfigError, match=r"^field 'rows': no run has an arrival rate to draw against"):
        plot_latency_vs_qps(closed_rows())


def test_a_report_of_closed_loop_runs_says_why_it_has_no_rate_figure():
    import pandas as pd
    figures = serving_figures(pd.DataFrame(closed_rows()))
    assert [(fig, caption.split(":")[0]) for fig, caption in figures.values()] == \
        [(None, "no latency against the arrival rate")]


def test_a_rate_set_as_workload_qps_is_the_rate_run(files, capsys):  # noqa: F811
    """--set workload.qps=7 was dropped unseen: every run took --qps, 1 by default (and said qps 1)."""
    import json
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "3", "--set", "workload.qps=7", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["qps"] == 7.0
    assert main(["serve-sim", trace, "--hw", hw, "--set", "workload.qps=-1"]) == 2
    assert "field 'workload.qps': '-1' is not a rate" in capsys.readouterr().err


def test_a_rate_given_twice_is_refused(files, capsys, no_runs):  # noqa: F811
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--qps", "2", "--set", "workload.qps=7"]) == 2
    assert capsys.readouterr().err.strip() == ("moesim: error: field '--qps': the arrival rate is given twice: "
                                               "--qps 2 and --set workload.qps=7 (fix: give it once (--qps takes "
                                               "several))")
    assert no_runs == []


@pytest.mark.parametrize("args, field", [
    (["--set", "workload.cv=4"], "workload.cv"),  # poisson gaps have no cv
    (["--set", "workload.concurrency=4"], "workload.concurrency"),  # clients of a closed loop only
    (["--set", "workload.arrival_file=a.csv"], "workload.arrival_file"),
    (["--qps", "7", "--set", "workload.arrival=closed"], "--qps"),  # a closed loop sets its own pace
    (["--set", "workload.qps=7", "--set", "workload.arrival=closed"], "workload.qps"),
    (["--set", "workload.arrival=gamma", "--set", "workload.concurrency=2"], "workload.concurrency"),
])
def test_a_workload_setting_the_arrival_process_ignores_is_refused(files, capsys, no_runs, args, field):  # noqa: F811
    """Each ran as if it had not been given: the same numbers, exit 0."""
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"field '{field}'" in err and "so it would change nothing" in err
    assert no_runs == []


@pytest.mark.parametrize("args", [["--set", "workload.arrival=gamma", "--set", "workload.cv=3", "--qps", "2"],
                                  ["--set", "workload.arrival=closed", "--set", "workload.concurrency=2"]])
def test_a_workload_setting_its_arrival_process_reads_runs(files, capsys, args):  # noqa: F811
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "2", *args]) == 0


def test_help_metrics_lists_every_key_of_a_runs_json(files, capsys):  # noqa: F811
    """`moesim serve-sim --help-metrics` did not exist (no such option), while `moesim replay --help-metrics`
    lists every key of its JSON: every key of a serving run's JSON (the engine's as engine.KEY) has a unit and
    a meaning, in the table and with `--json -` as JSON alone on stdout."""
    import json
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "3", "--slo", "ttft_ms=1000,tpot_ms=100",
                 "--json", "-"]) == 0
    run = json.loads(capsys.readouterr().out)
    keys = {f"engine.{k}" for k in run["engine"]} | set(run)
    assert main(["serve-sim", "--help-metrics", "--json", "-"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert set(docs) == keys
    assert docs["ttft_ms_p99"]["unit"] == "ms" and "arrival" in docs["ttft_ms_p50"]["meaning"]
    assert all(doc["meaning"] for doc in docs.values())
    assert main(["serve-sim", "--help-metrics"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("keys of moesim serve-sim --json")
    assert all(key in table for key in docs)
    assert main(["serve-sim"]) == 2  # no trace and no --help-metrics: the trace is still required
    assert "Missing argument 'TRACE...'" in capsys.readouterr().err


def test_the_table_title_names_the_profiles_gpu_and_host_cpu(files, capsys):  # noqa: F811
    """The title read 'serving on hw.yaml': the GPU and the host CPU (its cores, its DRAM bandwidth) that the
    runs' figures depend on were not said."""
    trace, hw = files
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--set", "hw.cpu.cores=2"]) == 0
    assert capsys.readouterr().out.startswith(f"serving on {Path(hw).name} (test gpu + test cpu, 2 cores, 100 GB/s DRAM)\n")


def test_the_runtimes_line_of_replay_follows_the_table(files, capsys):  # noqa: F811
    """serve-sim did not say which runtime each system ran on (its launch costs, which shape the ranking),
    while `moesim replay` prints it under its table: the same line follows serve-sim's table."""
    trace, hw = files
    assert main(["replay", trace, "--hw", hw, "--system", "gpu-only-lru,cpu-only"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("runtimes ("))
    assert line == ("runtimes (launch costs, CPU kernel efficiency; --set runtime=NAME): "
                    "generic (gpu-only-lru, cpu-only)")
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--system", "gpu-only-lru,cpu-only",
                 "--qps", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[out.index(next(o for o in out if o.startswith("└"))) + 1] == line  # right under the table
    assert main(["serve-sim", trace, "--hw", hw, "--requests", "2", "--set", "runtime=ideal"]) == 0
    assert "--set runtime=NAME): ideal (gpu-only-lru)" in capsys.readouterr().out
