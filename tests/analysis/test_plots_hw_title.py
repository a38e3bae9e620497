"""Figure titles name the profile's GPU and host CPU as table titles do (moesim.hw.title.profile_title): a
profile's name ('rtx4090', 'hw.yaml') says neither, and the bundled profiles differ in their CPUs as much as in
their GPUs."""

from __future__ import annotations

import pandas as pd
import yaml

from moesim.analysis.figures import fig_breakdown, fig_gantt, fig_hit_rate_vs_prefetch, fig_tpot_vs_slots, \
    load_results, plot_scatter
from moesim.analysis.plots import breakdown_title, plot_breakdown
from moesim.sim.bookkeeping import BREAKDOWN
from moesim.sweep import load_spec, run_sweep
from tests.factories import write_sweep_files

RTX4090 = "rtx4090 (NVIDIA GeForce RTX 4090 + AMD EPYC 7T83, 10 cores, 102.4 GB/s DRAM)"
A100 = "a100-40g (NVIDIA A100 40GB + 2x Intel Xeon Platinum 8452Y, 72 cores, 440 GB/s DRAM)"


def _results(profiles=("rtx4090",), **extra) -> pd.DataFrame:
    """Two systems x slots 1, 2 per profile, TPOT = 100 / slots; ``extra`` columns on every row."""
    rows = []
    for hw in profiles:
        for system in ("gpu-only-lru", "static-hot"):
            for slots in (1, 2):
                rows.append({"point_id": f"{hw}-{system}-{slots}", "trace": "traces/x.parquet", "hw": hw,
                             "system": system, "seed": 0, "cache.slots_per_layer": slots, "status": "ok",
                             "error": "", "tpot_ms_mean": 100.0 / slots, "gpu_hit_rate": slots / 8,
                             "gpu_memory_gib": 10.0 + slots, "prefetches": slots, "decode_tokens": 10,
                             "prefill_tokens": 0, **{f"breakdown_{c}_ms": 1.0 for c in BREAKDOWN}, **extra})
    return pd.DataFrame(rows)


def _flat(text: str) -> str:
    """A title as one line: a long one is wrapped at spaces to fit the figure."""
    return " ".join(text.split())


def test_sweep_figure_titles_name_each_profiles_gpu_and_host_cpu():
    """Issue: 'TPOT vs GPU cache slots per layer' with panels 'hw = a100-40g', 'hw = rtx4090' named the
    profiles' files only. Now the heading's second line names each with its GPU and host CPU."""
    title = _flat(fig_tpot_vs_slots(_results(("a100-40g", "rtx4090")))._suptitle.get_text())
    assert title.startswith(f"TPOT vs GPU cache slots per layer on {A100}; {RTX4090}")
    scatter = _flat(plot_scatter(_results(), x="gpu_memory_gib", y="tpot_ms_mean")._suptitle.get_text())
    assert scatter.startswith(f"TPOT, mean (ms) vs GPU memory planned (GiB) on {RTX4090} one marker per run")
    hits = _flat(fig_hit_rate_vs_prefetch(_results())._suptitle.get_text())
    assert hits == f"GPU hit rate vs prefetches (one marker per point) on {RTX4090}"
    breakdown = _flat(fig_breakdown(_results(), {"cache.slots_per_layer": 2}).axes[0].get_title(loc="left"))
    assert breakdown.startswith(f"time breakdown per system (cache.slots_per_layer=2) on {RTX4090}")


def test_the_hw_settings_the_rows_share_are_applied_and_one_they_vary_is_not():
    """hw.cpu.cores=4 on every rtx4090 row: 4 cores, as `moesim replay --set hw.cpu.cores=4` titles its table;
    rows that ran with 4 and 16 cores share no count: the profile's own 10."""
    shared = _flat(fig_tpot_vs_slots(_results(**{"hw.cpu.cores": 4}))._suptitle.get_text())
    assert RTX4090.replace("10 cores", "4 cores") in shared
    varied = pd.concat([_results(**{"hw.cpu.cores": 4}), _results(**{"hw.cpu.cores": 16}).assign(
        point_id=lambda f: f["point_id"] + "-16")])
    assert RTX4090 in _flat(fig_tpot_vs_slots(varied)._suptitle.get_text())


def test_a_replays_breakdown_names_the_parts_its_inputs_recorded_or_read_with_its_settings():
    """`moesim replay --plot` of several systems: 'time breakdown per system on t.parquet, rtx4090' now names
    the GPU and CPU, the parts the CLI recorded in the inputs (hw_parts), else the profile with the runs'
    hw.* settings."""
    inputs = {"trace": "traces/t.parquet", "hw": "rtx4090", "settings": {"hw.cpu.cores": "16"}}
    runs = [{"system": s, "breakdown_ms": {"gpu_compute": 1.0}, "inputs": inputs} for s in ("a", "b")]
    # and the --set values, as a sweep point's Gantt chart gives them (tests/cli/test_replay_plot_titles.py)
    assert breakdown_title(runs) == "time breakdown per system on t.parquet, " + RTX4090.replace(
        "10 cores", "16 cores") + " (hw.cpu.cores=16)"
    parts = {"gpu": "test gpu", "cpu": "test cpu (8 of 32 cores)", "cpu_cores": 8, "cpu_dram_bandwidth_gbps": 100}
    recorded = [{**run, "inputs": {**inputs, "hw_parts": parts}} for run in runs]
    fig = plot_breakdown(recorded)
    assert _flat(fig.axes[0].get_title(loc="left")).startswith(
        "time breakdown per system on t.parquet, rtx4090 (test gpu + test cpu, 8 cores, 100 GB/s DRAM)")


def test_a_sweep_points_gantt_chart_names_its_profiles_parts(tmp_path):
    """The Gantt chart of `moesim report` was titled 'gpu-only-lru on t.parquet, hw.yaml'."""
    write_sweep_files(tmp_path, seed=11)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["gpu-only-lru"],
        "set": {"hw.cpu.cores": 4}}))
    run_sweep(load_spec(tmp_path / "spec.yaml"), tmp_path / "r.parquet", workers=1)
    row = load_results(tmp_path / "r.parquet").iloc[0]
    title = _flat(fig_gantt(row)._suptitle.get_text())
    assert title.startswith("gpu-only-lru on t.parquet, hw.yaml (test gpu + test cpu, 4 cores, 100 GB/s DRAM) "
                            "(hw.cpu.cores=4)")


def test_a_replays_own_figures_name_its_profiles_parts(tmp_path):
    """`moesim.replay(...).plot_timeline()` and `.plot_breakdown()` were titled 'cpu-only on t.parquet', naming
    no machine at all; they now name the profile with its GPU and host CPU (its hw.* settings applied), and a
    saved result keeps it."""
    import moesim
    from moesim.analysis.runs import load_replay
    write_sweep_files(tmp_path, seed=11)
    result = moesim.replay(tmp_path / "t.parquet", str(tmp_path / "hw.yaml"), "cpu-only",
                           settings={"hw.cpu.cores": 4}, timeline=True)
    machine = "hw.yaml (test gpu + test cpu, 4 cores, 100 GB/s DRAM)"
    assert result.hw == machine
    assert _flat(result.plot_timeline()._suptitle.get_text()).startswith(f"cpu-only on t.parquet / {machine}")
    assert _flat(result.plot_breakdown().axes[0].get_title(loc="left")).startswith(
        f"time breakdown of cpu-only on t.parquet / {machine} ")
    result.save(tmp_path / "saved")
    assert load_replay(tmp_path / "saved").hw == machine


def test_serving_figures_name_the_machine_they_served_on(tmp_path):
    """moesim.serve runs drawn against the arrival rate, their requests, and a serving sweep's report figure
    named no machine ('TTFT per request vs arrival rate: ...', 'cpu-only: 3 requests at 20 req/s')."""
    import moesim
    from moesim.analysis.serving import plot_latency_vs_qps, serving_figures
    write_sweep_files(tmp_path, seed=11)
    runs = [moesim.serve(tmp_path / "t.parquet", hw=str(tmp_path / "hw.yaml"), system="cpu-only", qps=q,
                         requests=3, settings={"hw.cpu.cores": 4}) for q in (10, 20)]
    machine = "hw.yaml (test gpu + test cpu, 4 cores, 100 GB/s DRAM)"
    assert runs[0].hw == machine
    assert f"vs arrival rate on {machine}" in _flat(plot_latency_vs_qps(runs).axes[0].get_title(loc="left"))
    assert _flat(runs[1].plot_requests().axes[0].get_title(loc="left")).startswith(f"cpu-only on {machine}: 3")
    swept = pd.DataFrame([{**run.metrics, "hw": "rtx4090", "trace": "t.parquet", "seed": 0} for run in runs])
    figure, _ = serving_figures(swept)["ttft_ms_vs_qps"]
    assert f"on {RTX4090}" in _flat(figure.axes[0].get_title(loc="left"))


def test_a_run_given_a_profile_object_names_its_parts(tmp_path):
    """moesim.replay and moesim.serve take a HardwareProfile as hw; its title read the profile again from
    str(profile), its repr, which names no file: 'test' alone, no GPU or CPU."""
    import moesim
    from moesim.hw.profile import load_profile
    write_sweep_files(tmp_path, seed=11)
    profile = load_profile(tmp_path / "hw.yaml")
    machine = f"{profile.name} (test gpu + test cpu, 4 cores, 100 GB/s DRAM)"
    replayed = moesim.replay(tmp_path / "t.parquet", profile, "cpu-only", settings={"hw.cpu.cores": 4})
    served = moesim.serve(tmp_path / "t.parquet", hw=profile, system="cpu-only", qps=10, requests=2,
                          settings={"hw.cpu.cores": 4})
    assert (replayed.hw, served.hw) == (machine, machine)


def test_a_replays_own_figures_name_its_settings_and_a_saved_result_keeps_them(tmp_path):
    """`moesim replay --plot` titles name the --set values; `moesim.replay(...).plot_timeline()` and
    `.plot_breakdown()` did not, so replays with other settings drew identically titled figures."""
    import json

    import moesim
    from moesim.analysis.runs import load_replay
    write_sweep_files(tmp_path, seed=11)
    result = moesim.replay(tmp_path / "t.parquet", str(tmp_path / "hw.yaml"), "cpu-only",
                           settings={"hw.cpu.cores": 4}, timeline=True)
    assert result.settings == {"hw.cpu.cores": "4"}
    assert "DRAM) (hw.cpu.cores=4): steps 0-1" in _flat(result.plot_timeline()._suptitle.get_text())
    assert "DRAM) (hw.cpu.cores=4)" in _flat(result.plot_breakdown().axes[0].get_title(loc="left"))
    result.save(tmp_path / "saved")
    assert load_replay(tmp_path / "saved").settings == {"hw.cpu.cores": "4"}
    meta = tmp_path / "saved" / "result.json"  # saved before results kept their settings: none named
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "settings"}))
    assert load_replay(tmp_path / "saved").settings == {}
