"""`moesim replay` end to end: its outputs (the table, stable JSON keys, the files it writes, what reaches stdout)
and where it refuses an output path."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moesim.cli import main


METRIC_KEYS = {"ttft_ms", "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "decode_tokens_per_s",
               "prefill_tokens_per_s", "gpu_hit_rate", "late_prefetches", "pcie_h2d_bytes", "cpu_util", "gpu_util",
               "pcie_util", "breakdown_ms", "substituted_experts", "deferred_experts", "sim_wall_s"}


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_stable_keys(files, tmp_path, capsys):
    trace, hw = files
    out_json = tmp_path / "m.json"
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", "--set", "cache.slots_per_layer=2",
                        "--json", str(out_json)], capsys)
    assert code == 0
    metrics = json.loads(out_json.read_text())
    assert METRIC_KEYS <= set(metrics)
    assert metrics["tpot_ms_mean"] > 0 and 0 <= metrics["gpu_hit_rate"] <= 1
    assert set(metrics["breakdown_ms"]) >= {"gpu_compute", "wait_cache", "shared_expert", "cpu_other"}
    assert "TPOT" in out
    title = " ".join(out.split("┌")[0].split())  # the table's title, however it wrapped
    assert title.startswith("gpu-only-lru on t.parquet") and title.endswith("(cache.slots_per_layer=2)")
    assert out.rstrip().endswith(f"wrote {out_json}")  # where the JSON went, as for every other output


def test_all_systems_in_one_table(files, tmp_path, capsys):
    trace, hw = files
    out_json = tmp_path / "all.json"
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "all", "--set", "cache.slots_per_layer=2",
                        "--json", str(out_json)], capsys)
    assert code == 0
    listed = json.loads(out_json.read_text())
    from moesim.policy.systems import system_names
    assert set(listed) == set(system_names())  # every system, those skipped with their reason
    skipped = {name for name, m in listed.items() if "skipped" in m}
    by_system = {name: m for name, m in listed.items() if name not in skipped}
    for name in skipped:  # systems that cannot run on this trace are named with the reason
        assert f"skipped {name}:" in out and listed[name]["skipped"]
    assert skipped and f"{len(skipped)} of {len(listed)} systems skipped" in out
    assert "scores" in listed["importance"]["skipped"]
    for m in listed.values():  # what the file came from
        assert m["inputs"] == {"trace": trace, "hw": hw, "settings": {"cache.slots_per_layer": "2"}, "seed": 0,
                               "model": None, "hw_parts": {"gpu": "test gpu", "cpu": "test cpu", "cpu_cores": 8,
                                                           "cpu_dram_bandwidth_gbps": 100}}
    flat = " ".join(out.split())  # the console wraps long notes
    assert "needs the trace column 'scores'" in flat  # importance-driven caching refuses without scores
    assert not skipped & {"cpu-only", "gpu-only-lru", "static-hot", "all-in-gpu", "oracle"}
    # every system is measured against the physical lower bound, and none beats it
    for name, m in by_system.items():
        assert m["gap_to_lower_bound"] >= 1.0, name
        assert m["tpot_ms_mean"] >= m["lower_bound"]["tpot_ms_mean"], name
    assert "time vs lower bound" in out
    # a system whose defaults change the work (mixtral-offloading's int4 experts) has its own, lower bound
    own = by_system["mixtral-offloading"]["lower_bound"]
    assert own["makespan_s"] < by_system["gpu-only-lru"]["lower_bound"]["makespan_s"]
    assert {"cpu-only", "gpu-only-lru", "static-hot", "all-in-gpu", "oracle"} <= set(by_system)
    for name in by_system:
        assert name in out
    assert by_system["oracle"]["makespan_s"] <= min(by_system[s]["makespan_s"]
                                                    for s in ("cpu-only", "gpu-only-lru", "static-hot"))


def test_several_systems_by_comma_or_repeated_option(files, tmp_path, capsys):
    trace, hw = files
    out_json = tmp_path / "some.json"
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "cpu-only,static-hot", "--system", "gpu-only-lru",
                        "--set", "cache.slots_per_layer=2", "--json", str(out_json)], capsys)
    assert code == 0
    by_system = json.loads(out_json.read_text())
    assert set(by_system) == {"cpu-only", "static-hot", "gpu-only-lru"}  # every one named
    assert by_system["cpu-only"]["tpot_ms_mean"] != by_system["gpu-only-lru"]["tpot_ms_mean"]
    for name in by_system:
        assert name in out


def test_all_systems_decode_the_trace_once(files, capsys, monkeypatch):
    """--system all replays one trace many times (and its lower bounds and decision logs): it is decoded once,
    with every optional column some system reads, and nothing stays kept after the command."""
    import moesim.trace.io as io
    trace, hw = files
    calls = []
    real = io._decode_steps

    def counted(path, columns, batch_rows):
        calls.append(None if columns is None else tuple(sorted(columns)))
        yield from real(path, columns, batch_rows)
    monkeypatch.setattr(io, "_decode_steps", counted)
    code, _, _ = run(["replay", trace, "--hw", hw, "--system", "all", "--set", "cache.slots_per_layer=2"], capsys)
    assert code == 0 and calls == [("pred_next_layer", "pred_next_token", "pred_residual", "scores", "weights")]
    assert io._DECODED == {} and io._KEEP == [False]
    run(["replay", trace, "--hw", hw, "--system", "cpu-only"], capsys)
    run(["replay", trace, "--hw", hw, "--system", "cpu-only"], capsys)
    assert calls[-2:] == [(), ()]  # one system: streamed, each time


def test_every_output_is_written(files, tmp_path, capsys):
    trace, hw = files
    paths = {k: tmp_path / f"{k}{ext}" for k, ext in
             (("timeline", ".parquet"), ("decisions", ".parquet"), ("chrome", ".json"), ("plot", ".png"))}
    code, _, _ = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", "--set", "cache.slots_per_layer=2",
                      "--timeline", str(paths["timeline"]), "--decisions", str(paths["decisions"]),
                      "--chrome-trace", str(paths["chrome"]), "--plot", str(paths["plot"])], capsys)
    assert code == 0
    timeline = pq.read_table(paths["timeline"]).to_pandas()
    assert set(timeline.resource) == {"gpu", "pcie"}
    decisions = pq.read_table(paths["decisions"]).to_pandas()
    assert {"gpu_hit", "gpu_load"} <= set(decisions.action)
    assert json.loads(paths["chrome"].read_text())["traceEvents"]
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("outputs, words", [
    (["--timeline", "{trace}"], ["'--timeline'", "would overwrite an input (TRACE"]),
    (["--decisions", "{trace}"], ["'--decisions'", "would overwrite an input (TRACE"]),
    (["--json", "{hw}"], ["'--json'", "would overwrite an input (--hw"]),
    (["--json", "{dir}/m.json", "--chrome-trace", "{dir}/./m.json"], ["'--chrome-trace'", "another output (--json"]),
    (["--timeline", "-"], ["'--timeline'", "'-' (standard output) is for --json only"]),
    (["--set", "cache.slots_per_layer=[1,2,"], ["'[1,2,' is not a valid int or a list of ints"]),
    (["--set", "cache.slots_per_layer=2", "--set", "cache.slots_per_layer=1"], ["given twice"]),
])
def test_an_output_never_replaces_an_input_or_another_output(files, tmp_path, capsys, outputs, words):
    trace, hw = files
    before = {path: Path(path).read_bytes() for path in (trace, hw)}
    args = [a.format(trace=trace, hw=hw, dir=tmp_path) for a in outputs]
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", *args], capsys)
    assert code == 2 and err.count("\n") == 1 and all(word in err for word in words), err
    assert {path: Path(path).read_bytes() for path in (trace, hw)} == before
    assert not (tmp_path / "m.json").exists() and not Path("-").exists()


@pytest.mark.parametrize("option", ["--json", "--decisions"])
def test_an_output_never_replaces_a_file_a_setting_names(files, tmp_path, capsys, option):
    """moe-infinity's calibration trace (prefetch.calibration=PATH) was written over by an output given its
    path: only the trace and the profile counted as inputs."""
    import shutil
    trace, hw = files
    calibration = tmp_path / "calibration.parquet"
    shutil.copy(trace, calibration)
    before = calibration.read_bytes()
    code, _, err = run(["replay", trace, "--hw", hw, "--system", "moe-infinity",
                        "--set", f"prefetch.calibration={calibration}", option, str(calibration)], capsys)
    assert code == 2 and "would overwrite an input (--set prefetch.calibration" in err, err
    assert calibration.read_bytes() == before


def test_special_files_take_several_outputs(files, capsys):
    trace, hw = files
    code, _, _ = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", "--json", "/dev/null",
                      "--timeline", "/dev/null"], capsys)
    assert code == 0


def test_a_reader_that_stops_early_ends_the_command_quietly_and_its_files_still_land(files, tmp_path):
    """`moesim replay T --json m.json | head -1`: exit 0, no error on stderr (rich and click would exit 1
    on the broken pipe), and the files written; the reader here, `true`, is gone before the first write."""
    import subprocess
    import sys
    trace, hw = files
    replay_args = ["replay", trace, "--hw", hw, "--system", "gpu-only-lru"]
    for command, written in ((["systems"], None), (["systems", "--json", "-"], None), (replay_args, None),
                             ([*replay_args, "--json", str(tmp_path / "m.json")], tmp_path / "m.json"),
                             ([*replay_args, "--json", "-"], None)):
        done = subprocess.run(f"{sys.executable} -m moesim.cli {' '.join(command)} | true; "
                              "echo ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                              text=True, timeout=120)
        # (with --json - the table goes to stderr, as it should)
        quiet = "Traceback" not in done.stderr and "error" not in done.stderr
        assert done.stdout.strip() == "0" and quiet and (done.stderr == "" or "-" in command), command
        if written is not None:
            assert json.loads(written.read_text())["tpot_ms_mean"] > 0


def test_bundled_trace_no_row_beats_the_oracle_on_the_same_weights(capsys):
    """Issue acceptance on the README's main run: every slot that fits is used (60 for Mixtral bf16 on
    rtx4090) and no system that schedules the replay's weights beats the oracle on TPOT or TTFT; a system
    that brings its own weights (mixtral-offloading's int4) is marked, not compared."""
    trace = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")
    code = main(["replay", trace, "--hw", "rtx4090", "--system", "all", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    by_system = {name: m for name, m in json.loads(out).items() if "skipped" not in m}
    oracle = by_system["oracle"]
    assert oracle["expert_slots"] == 60
    from moesim.policy.systems import SYSTEMS, own_weights
    for name, m in by_system.items():
        if SYSTEMS[name].ignores_memory or own_weights(name):
            continue
        assert m["tpot_ms_mean"] >= oracle["tpot_ms_mean"] - 1e-9, name
        assert m["ttft_ms"] >= oracle["ttft_ms"] - 1e-9, name
        if SYSTEMS[name].uses_cache and name not in ("dali", "fiddler", "llamacpp", "ktransformers",
                                                      "ktransformers-ed"):
            assert m["expert_slots"] == 60, name
    # KTransformers holds its static GPU experts only (cache.per_layer, none by default)
    assert by_system["ktransformers"]["expert_slots"] == by_system["ktransformers-ed"]["expert_slots"] == 0
    assert "mixtral-offloading: runs its own weights by default (memory.expert_dtype=int4, " \
           "memory.non_expert_dtype=int4), so the oracle, which schedules the replay's weights, is no bound for it; " \
           "compare with --set memory.expert_dtype=int4 --set memory.non_expert_dtype=int4 --system oracle" \
           in " ".join(err.split())


def test_a_file_name_with_brackets_is_printed_as_it_is(files, tmp_path, capsys):
    """rich would read "[bold]" in a name as a style tag and print "run.parquet"."""
    named = tmp_path / "run[bold].parquet"
    Path(files[0]).rename(named)
    code, out, _ = run(["replay", str(named), "--hw", files[1], "--system", "cpu-only,gpu-only-lru"], capsys)
    assert code == 0 and f"run[bold].parquet on {Path(files[1]).name}" in out
    code, out, _ = run(["trace", "inspect", str(named)], capsys)
    assert code == 0 and "run[bold].parquet" in out


def test_json_to_dev_stdout_leaves_stdout_json_alone(files):
    """`--json /dev/stdout | jq .`: the JSON is all stdout holds, as with `--json -` (no "wrote" line after it)."""
    import subprocess
    import sys
    trace, hw = files
    for command in (["replay", trace, "--hw", hw, "--system", "cpu-only"], ["systems"]):
        done = subprocess.run([sys.executable, "-m", "moesim.cli", *command, "--json", "/dev/stdout"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        parsed = json.loads(done.stdout)
        assert parsed and "wrote" not in done.stdout + done.stderr, command


@pytest.mark.parametrize("outputs, said", [
    (["--json", "-", "--timeline", "/dev/stdout"], "--json - and --timeline /dev/stdout both write to standard output"),
    (["--json", "/dev/stdout", "--chrome-trace", "/proc/self/fd/1"],
     "--json /dev/stdout and --chrome-trace /proc/self/fd/1 both write to standard output"),
    (["--timeline", "/dev/stdout", "--decisions", "/dev/fd/1", "--json", "-"],
     "--json -, --timeline /dev/stdout and --decisions /dev/fd/1 all write to standard output"),
])
def test_two_outputs_to_stdout_are_refused_before_the_run(files, capsys, outputs, said):
    """`--json - --timeline /dev/stdout | jq .` put Parquet bytes into the JSON stream: refused in one line
    naming both options, before any work (nothing on stdout)."""
    trace, hw = files
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", *outputs], capsys)
    assert code == 2 and out == "" and err.strip().count("\n") == 0, err
    assert err.startswith("moesim: error: ") and said in err and "fix: write all but one of them to a file" in err


def test_an_output_naming_the_file_stdout_goes_to_is_refused_beside_json_on_stdout(files, tmp_path):
    """`moesim replay T --json - --timeline out.bin > out.bin`: both land in out.bin, mixed; refused, and
    stdout left empty. One output to stdout, or stdout on /dev/null, still runs."""
    import subprocess
    import sys
    trace, hw = files
    base = [sys.executable, "-m", "moesim.cli", "replay", trace, "--hw", hw, "--system", "cpu-only"]
    target = tmp_path / "out.bin"
    with open(target, "w") as stdout:
        done = subprocess.run([*base, "--json", "-", "--timeline", str(target)], stdout=stdout,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2 and target.read_bytes() == b""
    assert done.stderr.count("\n") == 1
    assert f"--json - and --timeline {target} both write to standard output" in done.stderr
    done = subprocess.run([*base, "--json", "-", "--timeline", "/dev/stdout"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*base, "--json", "-", "--timeline", str(tmp_path / "timeline.parquet")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["tpot_ms_mean"] > 0, done.stderr


def test_an_output_piped_to_stdout_is_all_stdout_holds(files, capsys):
    """`moesim replay T --timeline /dev/stdout | consumer`: the table went to stdout beside the Parquet bytes.
    The table now goes to stderr and stdout holds the Parquet file alone; the next command in the same process
    prints its table to stdout again."""
    import io
    import subprocess
    import sys

    import pyarrow.parquet as pq
    trace, hw = files
    done = subprocess.run([sys.executable, "-m", "moesim.cli", "replay", trace, "--hw", hw, "--system", "smoe",
                           "--timeline", "/dev/stdout"], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    timeline = pq.read_table(io.BytesIO(done.stdout))
    assert timeline.num_rows > 0 and b"TTFT" in done.stderr and b"TTFT" not in done.stdout
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only", "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["tpot_ms_mean"] > 0 and "TTFT" in err
    code, out, _ = run(["trace", "inspect", trace], capsys)  # a command with no output files of its own
    assert code == 0 and "prev-token reuse" in out


def test_outputs_rolled_back_are_not_said_to_be_written(files, tmp_path, capsys, monkeypatch):
    """A later output failing (here the plot, on a full disk) rolls back those written before it: no
    "wrote" line claims otherwise."""
    import errno

    import moesim.analysis.plots

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    trace, hw = files
    kept = tmp_path / "keep.json"
    kept.write_text("OLD\n")
    timeline = tmp_path / "keep-tl.parquet"
    with monkeypatch.context() as patch:
        patch.setattr(moesim.analysis.plots, "plot_gantt", full_disk)
        code, out, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only", "--json", str(kept),
                              "--timeline", str(timeline), "--plot", str(tmp_path / "x.png")], capsys)
        assert code == 2 and "x.png" in err and "No space" in err
    assert kept.read_text() == "OLD\n" and not timeline.exists()
    assert "wrote" not in out + err
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "cpu-only", "--json", str(kept),
                        "--timeline", str(timeline)], capsys)
    assert code == 0 and f"wrote {kept}" in out and f"wrote {timeline}" in out


@pytest.mark.parametrize("option, name, kind", [("--chrome-trace", "timeline.parquet", "Parquet"),
                                                ("--json", "gantt.png", "a figure"),
                                                ("--json", "spec.yaml", "YAML")])
def test_a_json_output_named_as_another_format_is_refused_and_that_file_kept(files, tmp_path, capsys, option, name,
                                                                             kind):
    """--chrome-trace timeline.parquet replaced an earlier run's timeline with JSON (a slip of the option);
    a JSON output named as a Parquet, figure or YAML file is now refused before the run, the file left as it was."""
    trace, hw = files
    target = tmp_path / name
    target.write_bytes(b"an earlier output")
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", option, str(target)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"field '{option}': this output is written as JSON, but its name has '{target.suffix}' ({kind}" in err
    assert f"(fix: name it e.g. {target.stem}.json)" in err and "TPOT" not in out
    assert target.read_bytes() == b"an earlier output"
    code, _, _ = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", option,  # any other name is taken
                      str(tmp_path / "out.txt")], capsys)
    assert code == 0 and (tmp_path / "out.txt").read_text().lstrip().startswith("{")


def test_an_oracles_chrome_trace_names_the_member_whose_timeline_it_is(files, tmp_path, capsys):
    """The oracle's timeline is its best member's on TPOT, but the trace and the Gantt said only 'oracle'."""
    trace, hw = files
    out = tmp_path / "o.json"
    code, _, err = run(["replay", trace, "--hw", hw, "--system", "oracle", "--chrome-trace", str(out),
                        "--json", str(tmp_path / "m.json")], capsys)
    assert code == 0, err
    best = dict(part.split("=") for part in json.loads((tmp_path / "m.json").read_text())["portfolio_best"].split("; "))
    assert json.loads(out.read_text())["otherData"]["timeline_of"] == best["tpot_ms_mean"]
    code, _, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only", "--chrome-trace", str(out)], capsys)
    assert code == 0 and "timeline_of" not in json.loads(out.read_text())["otherData"]


def test_an_oracles_timeline_and_decisions_say_whose_they_are_when_written(files, tmp_path, capsys):
    """`--system oracle --timeline T --decisions D` said 'wrote T' and 'wrote D': the Parquet files hold the
    replay of the oracle's best member on TPOT, and neither they nor the lines said which."""
    trace, hw = files
    tl, dec, met = tmp_path / "tl.parquet", tmp_path / "d.parquet", tmp_path / "m.json"
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "oracle", "--timeline", str(tl), "--decisions",
                          str(dec), "--json", str(met)], capsys)
    assert code == 0, err
    best = dict(part.split("=") for part in json.loads(met.read_text())["portfolio_best"].split("; "))
    lines = out.splitlines()
    for path in (tl, dec):
        assert f"wrote {path} ({best['tpot_ms_mean']}'s, oracle's best schedule on TPOT)" in lines
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "cpu-only", "--timeline", str(tl)], capsys)
    assert code == 0 and f"wrote {tl}" in out.splitlines()


def test_the_table_titles_name_the_profiles_gpu_and_host_cpu(files, capsys):
    """A title read 't.parquet on rtx4090': the bundled profiles differ in their host CPU (10 EPYC cores at
    102.4 GB/s on rtx4090, 72 Xeon cores at 440 GB/s on rtx4080 and a100-40g) as much as in their GPU, so a
    CPU-bound difference passed for a GPU one. The titles name both, with the cores a --set gives; the JSON's
    inputs hold them too."""
    from moesim.cli.app import hw_title
    trace, hw = files
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "cpu-only,gpu-only-lru"], capsys)
    assert code == 0 and out.startswith(f"t.parquet on {Path(hw).name} (test gpu + test cpu, 8 cores, 100 GB/s DRAM)\n")
    code, out, _ = run(["replay", trace, "--hw", hw, "--set", "hw.cpu.cores=4", "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["inputs"]["hw_parts"] == {
        "gpu": "test gpu", "cpu": "test cpu", "cpu_cores": 4, "cpu_dram_bandwidth_gbps": 100}
    code, out, _ = run(["replay", trace, "--hw", hw, "--set", "hw.cpu.cores=4"], capsys)
    assert out.startswith(f"gpu-only-lru on t.parquet / {Path(hw).name} (test gpu + test cpu, 4 cores, 100 GB/s DRAM) "
                          "(hw.cpu.cores=4)\n")
    assert hw_title("rtx4090", {}) == "rtx4090 (NVIDIA GeForce RTX 4090 + AMD EPYC 7T83, 10 cores, 102.4 GB/s DRAM)"
    assert hw_title("a100-40g", {}) == ("a100-40g (NVIDIA A100 40GB + 2x Intel Xeon Platinum 8452Y, 72 cores, "
                                        "440 GB/s DRAM)")


@pytest.mark.parametrize("command", [["replay", "--system", "cpu-only", "--timeline", "{tmp}/tl.parquet"],
                                     ["replay", "--system", "cpu-only,gpu-only-lru", "--plot", "{tmp}/x.png"],
                                     ["serve-sim", "--system", "cpu-only", "--requests", "2", "--qps", "1",
                                      "--requests-plot", "{tmp}/x.png"]])
def test_a_command_whose_other_output_fails_prints_no_json_on_stdout(files, tmp_path, capsys, monkeypatch, command):
    """Issue: `moesim replay T --json - --timeline OUT` whose timeline could not be written (a full disk, a
    folder it may not write) exited 2 with the whole JSON already on stdout, so `... --json - | jq` went on with
    the results of a command that failed. The JSON of `--json -` now reaches stdout once every output has
    landed: a failure leaves stdout empty, as it leaves the files."""
    import errno

    import moesim.analysis.plots
    import moesim.analysis.serving
    import moesim.analysis.timeline

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    trace, hw = files
    args = [command[0], trace, "--hw", hw, *(a.format(tmp=tmp_path) for a in command[1:]), "--json", "-"]
    with monkeypatch.context() as patch:
        for module, name in ((moesim.analysis.timeline, "write_timeline"), (moesim.analysis.plots, "plot_breakdown"),
                             (moesim.analysis.serving, "plot_requests")):
            patch.setattr(module, name, full_disk)
        code, out, err = run(args, capsys)
    assert code == 2 and "No space" in err and err.count("moesim: error:") == 1
    assert out == ""
    code, out, _ = run(args, capsys)  # the same command that can write its files prints its JSON
    assert code == 0 and isinstance(json.loads(out), dict)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, where no file can be created")
@pytest.mark.parametrize("option, name", [("--json", "m.json"), ("--timeline", "tl.parquet"),
                                          ("--chrome-trace", "c.json"), ("--plot", "g.png"),
                                          ("--decisions", "d.parquet")])
def test_an_output_folder_that_takes_no_file_is_refused_before_the_run(files, capsys, option, name):
    """As root, os.access says /proc is writable: `moesim replay T --json /proc/m.json` replayed, printed the
    table and only then failed to write. Creating a file there is now tried before the run (one line, exit 2,
    no table); as anyone else the output check said so already."""
    trace, hw = files
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only", option, f"/proc/{name}"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"/proc/{name}, field '{option}': " in err
    assert "cannot create a file in /proc" in err or "folder /proc is not writable" in err
