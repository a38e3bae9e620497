"""`moesim replay` end to end: outputs, stable JSON keys, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from moesim.cli import main
from tests.factories import random_routing, tiny_model, write_tiny_trace, write_trace_and_profile

METRIC_KEYS = {"ttft_ms", "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p99", "decode_tokens_per_s",
               "prefill_tokens_per_s", "gpu_hit_rate", "late_prefetches", "pcie_h2d_bytes", "cpu_util", "gpu_util",
               "pcie_util", "breakdown_ms", "substituted_experts", "deferred_experts", "sim_wall_s"}


@pytest.fixture
def files(tmp_path):
    return write_trace_and_profile(tmp_path, 3, decode=6)


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
                               "model": None}
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


def test_a_named_system_that_cannot_run_is_an_error_not_a_skip(files, capsys):
    trace, hw = files  # no scores column: importance cannot run; with 'all' it is skipped, named it is refused
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only,importance",
                          "--set", "cache.slots_per_layer=2"], capsys)
    assert code == 2
    assert "scores" in err and "skipped" not in out


def test_an_unknown_system_in_a_list_fails_before_any_replay(files, capsys):
    trace, hw = files
    code, out, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only,nope"], capsys)
    assert code == 2 and "unknown system 'nope'" in err
    assert "cpu-only" not in out  # nothing was replayed

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


@pytest.mark.parametrize("args, words", [
    (["--system", "nope"], ["unknown system 'nope'", "cpu-only", "oracle"]),
    (["--system", "gpu-only-lru", "--set", "cache.nope=1"], ["unknown parameter 'cache.nope'", "engine.*"]),
    (["--system", "gpu-only-lru", "--set", "cache.slots_per_layer=7"], ["outside [0, 6]"]),
    (["--system", "gpu-only-lru", "--set", "hw.gpu.memory_gib=1.2"], ["does not fit", "GiB", "slots"]),
    (["--system", "gpu-only-lru", "--model", "mixtral-8x7b"], ["does not match preset", "num_layers"]),
    (["--system", "all", "--set", "cache.slots_per_layer=2", "--timeline", "x.parquet"], ["need a single system"]),
    (["--window", "50:60", "--plot", "g.png"], ["no step in 50:60", "the trace has steps 0 to 6"]),
    # the field as it was set (it was named 'expert_dtype', no such --set key)
    (["--set", "memory.expert_dtype=fp7"], ["field 'memory.expert_dtype': unknown expert dtype 'fp7'",
                                            "use one of bf16, fp16, fp8, int8, int4"]),
])
def test_bad_input_is_one_line_and_exit_2(files, capsys, args, words):
    trace, hw = files
    code, _, err = run(["replay", trace, "--hw", hw, *args], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moesim: error:"), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]


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


def test_cache_that_cannot_fit_prints_the_arithmetic(files, capsys):
    trace, hw = files
    # 10M-parameter tiny model: ~0.018 GiB of non-expert weights; 49,152-byte experts: ~0.0003 GiB left
    code, _, err = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", "--set", "hw.gpu.memory_gib=0.5",
                        "--set", "hw.gpu.reserved_gib=0.01", "--set", "memory.workspace_gib=0.4715",
                        "--set", "cache.slots_per_layer=6"], capsys)
    assert code == 2
    assert "GPU 0.50 GiB - reserved 0.01 GiB - non-expert weights" in err
    assert "cache.slots_per_layer <=" in err


def test_bundled_trace_no_row_beats_the_oracle_on_the_same_weights(capsys):
    """Issue acceptance on the README's main run: every slot that fits is used (60 for Mixtral bf16 on
    rtx4090) and no system that schedules the replay's weights beats the oracle on TPOT or TTFT; a system
    that brings its own weights (mixtral-offloading's int4) is marked, not compared."""
    trace = str(Path(__file__).resolve().parents[1] / "traces" / "mixtral-8x7b-humaneval.parquet")
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


def test_a_file_name_with_brackets_is_printed_as_it_is(files, tmp_path, capsys):
    """rich would read "[bold]" in a name as a style tag and print "run.parquet"."""
    named = tmp_path / "run[bold].parquet"
    Path(files[0]).rename(named)
    code, out, _ = run(["replay", str(named), "--hw", files[1], "--system", "cpu-only,gpu-only-lru"], capsys)
    assert code == 0 and f"run[bold].parquet on {files[1]}" in out
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


def test_a_gpu_memory_override_too_small_is_named_not_the_profile(tmp_path, capsys):
    """`--set hw.gpu.memory_gib=0.1` on the README's run: the error blamed rtx4090.yaml ("use a larger GPU
    profile") though the file says 24 GiB. It names the override and the least size that holds Mixtral-8x7B
    without experts: 2.99 GiB of bf16 non-expert weights + 0.03 KV + 0.50 workspace + 0.66 staging (two
    336 MiB experts) = 4.18 GiB, which runs; 4.17 does not. A profile file of 0.1 GiB is still the file's fault."""
    root = Path(__file__).resolve().parents[1]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), "hwprofiles/rtx4090.yaml"
    args = ["replay", trace, "--hw", str(root / hw), "--system", "gpu-only-lru", "--set"]
    code, _, err = run([*args, "hw.gpu.memory_gib=0.1"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err == ("moesim: error: field '--set': parameter 'hw.gpu.memory_gib'=0.1 (the profile's own: 24) leaves "
                   f"too little GPU memory: the model does not fit on the GPU of rtx4090 ({root / hw}) even without "
                   "experts: GPU 0.10 GiB - reserved 0.00 GiB - non-expert weights 2.99 GiB - KV cache 0.03 GiB - "
                   "workspace 0.50 GiB - staging 0.66 GiB = -4.08 GiB for experts of 336.0 MiB = 0 slots (fix: --set "
                   "hw.gpu.memory_gib=4.18 or more, --set memory.non_expert_dtype=int4, or a shorter trace)\n")
    assert run([*args, "hw.gpu.memory_gib=4.17"], capsys)[0] == 2
    assert run([*args, "hw.gpu.memory_gib=4.18"], capsys)[0] == 0
    import moesim  # the Python API names its keyword
    from moesim.errors import MoesimError
    with pytest.raises(MoesimError, match=r"^field 'hw__gpu__memory_gib': parameter 'hw.gpu.memory_gib'=0.1 "):
        moesim.replay(trace, hw=str(root / hw), system="gpu-only-lru", hw__gpu__memory_gib=0.1)
    code, _, err = run([*args, "hw.gpu.reserved_gib=22"], capsys)
    assert code == 2 and "parameter 'hw.gpu.reserved_gib'=22 (the profile's own: 0)" in err
    assert "(fix: --set hw.gpu.reserved_gib=19.82 or less, " in err
    small = yaml.safe_load((root / hw).read_text())
    small["gpu"]["memory_gib"] = 0.1
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(small))
    code, _, err = run(["replay", trace, "--hw", str(tmp_path / "small.yaml"), "--system", "gpu-only-lru"], capsys)
    assert code == 2 and err.startswith("moesim: error: field 'memory': the model does not fit on the GPU of "
                                        f"rtx4090 ({tmp_path / 'small.yaml'}) even without experts: GPU 0.10 GiB")
    assert "(fix: use a larger GPU profile, " in err


@pytest.mark.parametrize("setting, said", [
    ("hw.gpu.memory_gib=0", "parameter 'hw.gpu.memory_gib'=0 ({hw}'s own: 24): must be positive, got 0"),
    ("hw.gpu.memory_gib=abc", "parameter 'hw.gpu.memory_gib'=abc ({hw}'s own: 24): 'abc' is not a number "
                              "(fix: give a number, like 24)"),
    ("hw.gpu.memory_gib=0.5", "parameter 'hw.gpu.memory_gib'=0.5 ({hw}'s own: 24): 1 GiB reserved of 0.5 GiB "
                              "(fix: give hw.gpu.memory_gib more than the 1 GiB reserved, or reserve less)"),
])
def test_a_profile_value_an_override_set_is_refused_as_the_override(files, capsys, setting, said):
    """A value the profile refuses, set by --set: the error named the file (`hw.yaml, field 'gpu.memory_gib'`),
    whose own value is fine."""
    trace, hw = files
    code, _, err = run(["replay", trace, "--hw", hw, "--system", "cpu-only", "--set", setting], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("moesim: error: field '--set': " + said.format(hw=hw)), err


@pytest.mark.parametrize("system, key", [("smoe-flex", "prefetch.calibration"), ("smoe", "prefetch.calibration"),
                                         ("static-hot", "cache.calibration"),
                                         ("ktransformers-ed", "cache.calibration"),
                                         ("buddymoe", "substitute.calibration")])
def test_a_calibration_trace_that_is_missing_or_of_another_model_is_one_line(files, tmp_path, capsys, system, key):
    """A calibration path that is no trace, or a trace of another routing shape, is refused before the run with
    one line naming the parameter (smoe-flex crashed on a missing file and ranked Mixtral layers on a Qwen trace
    without a word; static-hot and ktransformers-ed crashed on another model's trace; smoe took a missing file)."""
    trace, hw = files
    other = write_tiny_trace(tmp_path / "other.parquet", tiny_model(layers=3, experts=6, top_k=2),
                             random_routing(np.random.default_rng(4), tiny_model(layers=3, experts=6, top_k=2),
                                            requests=1, prompt=4, decode=6))
    base = ["replay", trace, "--hw", hw, "--system", system, "--set", "cache.slots_per_layer=2"]
    if system == "smoe-flex":
        base += ["--set", "prefetch.flex_off_fraction=0.5"]
    for value, said in [(tmp_path / "missing.parquet", "file not found"), (tmp_path, "is a folder, not a trace file"),
                        (other, "does not match the replayed tiny (num_layers: 2 vs 3)")]:
        code, out, err = run([*base, "--set", f"{key}={value}"], capsys)
        assert code == 2, (value, err)
        line = err.strip()
        assert "\n" not in line and line.startswith(f"moesim: error: field '{key}': ") and said in line, line
        assert "or leave it empty" in line and "TPOT" not in out
    code, out, err = run([*base, "--set", f"{key}={trace}"], capsys)  # a trace of the same model runs
    assert code == 0 and "TPOT" in out


@pytest.mark.parametrize("system, setting, said", [
    # a percentile beyond 100 stopped the run with an internal error (exit 1)
    ("buddymoe", "substitute.tau_percentile=150",
     "field 'substitute.tau_percentile': substitute.tau_percentile=150.0 outside [0, 100] "
     "(fix: give a value from 0 to 100, e.g. 10.0)"),
    # a parameter whose default is -1 said "give a value >= 0", hiding the -1 it takes
    ("smoe", "prefetch.n=-5", "field 'prefetch.n': -5 is negative (fix: give a value >= 0, or -1 as by default "
                              "(prefetch.n: experts prefetched per layer and step (-1: 000 Table I's"),
    ("dali", "cache.u_size=-3", "field 'cache.u_size': -3 is negative (fix: give a value >= 0, or -1 as by default"),
    ("buddymoe", "prefetch.size=-2", "field 'prefetch.size': -2 is negative (fix: give a value >= 0, or -1 as by "
                                     "default (prefetch.size: experts loaded ahead per layer"),
])
def test_a_set_value_out_of_range_names_what_the_parameter_takes(files, capsys, system, setting, said):
    trace, hw = files
    code, out, err = run(["replay", trace, "--hw", hw, "--system", system, "--set", "cache.slots_per_layer=2",
                          "--set", setting], capsys)
    assert code == 2 and "TPOT" not in out
    line = " ".join(err.split())
    assert err.strip().count("\n") == 0 and line.startswith("moesim: error: ") and said in line, line


def test_a_percentile_at_its_bounds_runs(files, capsys):
    trace, hw = files
    for value in ("0", "100"):
        code, out, err = run(["replay", trace, "--hw", hw, "--system", "buddymoe", "--set", "cache.slots_per_layer=2",
                              "--set", f"substitute.tau_percentile={value}"], capsys)
        assert code == 0 and "TPOT" in out, err


def test_any_negative_tau_runs_as_the_default(files, capsys):
    """substitute.tau's doc says "negative: the tau_percentile-th percentile": -0.5 was refused, only -1 ran."""
    trace, hw = files
    outs = []
    for value in ("-0.5", "-1"):
        code, out, err = run(["replay", trace, "--hw", hw, "--system", "buddymoe", "--set", "cache.slots_per_layer=2",
                              "--set", f"substitute.tau={value}", "--json", "-"], capsys)
        assert code == 0, err
        outs.append(json.loads(out))
    keys = ("tpot_ms_mean", "substituted_experts", "pcie_h2d_bytes")
    assert [outs[0][k] for k in keys] == [outs[1][k] for k in keys]


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


@pytest.mark.parametrize("setting, field, buffer, largest", [
    ("cache.prefetch_slots=100000", "cache.prefetch_slots", "100000 slots (cache.prefetch_slots=100000)",
     "cache.prefetch_slots=60"),
    ("prefetch.size=100", "prefetch.size", "200 slots (twice prefetch.size=100)", "prefetch.size=30"),
])
def test_a_dali_prefetch_buffer_too_large_names_its_parameter(capsys, setting, field, buffer, largest):
    """`--system dali --set cache.prefetch_slots=100000` (or prefetch.size=100) on the README's run blamed
    cache.slots_per_layer, which the user never gave ("total 0", "use at most 0 slots"). It names the
    parameter given, the 60 slots rtx4090 holds for Mixtral-8x7B in all, and the largest value that fits."""
    root = Path(__file__).resolve().parents[1]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), root / "hwprofiles" / "rtx4090.yaml"
    args = ["replay", trace, "--hw", str(hw), "--system", "dali", "--set"]
    code, _, err = run([*args, setting], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"moesim: error: field '{field}': dali's prefetch buffer of {buffer} does not fit on the "
                          f"GPU of rtx4090 ({hw}), which holds 60 expert slots in all, cache and buffer together: "
                          "GPU 24.00 GiB - "), err
    assert f"(fix: --set {largest} or less (the cache then gets the slots it leaves)" in err
    assert "slots_per_layer" not in err
    # beside a cache the user sized, the largest buffer left beside it
    code, _, err = run([*args, setting, "--set", "cache.slots=10"], capsys)
    assert code == 2 and f"field '{field}': " in err and "beside the cache of 10 slots that cache.slots=10" in err
    assert ("--set cache.prefetch_slots=50 or less" if field == "cache.prefetch_slots" else
            "--set prefetch.size=25 or less") in err


def test_a_dali_default_buffer_that_a_smaller_gpu_memory_leaves_no_room_for_names_the_override(capsys):
    """`--system dali --set hw.gpu.memory_gib=4.7` on the README's run: dali's default buffer of 2 slots no longer
    fits; the error named field 'memory' (the profile) and "1 expert slots". It names the --set parameter, and
    the memory that fits, which runs (one GiB-hundredth less does not)."""
    import moesim
    from moesim.errors import ConfigError
    root = Path(__file__).resolve().parents[1]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), root / "hwprofiles" / "rtx4090.yaml"
    args = ["replay", trace, "--hw", str(hw), "--system", "dali", "--set"]
    code, _, err = run([*args, "hw.gpu.memory_gib=4.7"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("moesim: error: field '--set': dali's prefetch buffer of 2 slots (twice prefetch.size=1, "
                          f"dali's default for the model) does not fit on the GPU of rtx4090 ({hw}) with parameter "
                          "'hw.gpu.memory_gib'=4.7 (the profile's own: 24), which holds 1 expert slot in all"), err
    assert "= 1 slot (fix: " in err and "--set hw.gpu.memory_gib=4.84 or more" in err
    code, _, err = run([*args, "hw.gpu.memory_gib=4.83"], capsys)
    assert code == 2 and "which holds 1 expert slot in all" in err
    code, out, _ = run([*args, "hw.gpu.memory_gib=4.84", "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["slot_spread"].endswith("+ a model-wide prefetch buffer of 2 (of 2 that fit)")
    with pytest.raises(ConfigError, match="field 'hw__gpu__memory_gib': dali's prefetch buffer"):
        moesim.replay(trace, hw=str(hw), system="dali", hw__gpu__memory_gib=4.7)


@pytest.mark.parametrize("setting, said, fix", [
    ("hw.gpu.nope=1", "parameter 'hw.gpu.nope'=1: no such profile field in {hw}",
     "fields of hw.gpu: bandwidth_efficiency, cuda_graph, graph_launch_us, kernels_per_layer, launch_us, "
     "mem_bandwidth_gbps, memory_gib, peak_tflops, reserved_gib, roofline_efficiency"),
    ("hw.gpu.launch_usec=3", "parameter 'hw.gpu.launch_usec'=3: no such profile field in {hw}",
     "did you mean hw.gpu.launch_us? fields of hw.gpu: "),
    ("hw.pcei.latency_us=1", "parameter 'hw.pcei.latency_us'=1: no such profile field in {hw}",
     "did you mean hw.pcie.latency_us? sections of hw: cpu, gpu, pcie, runtimes, sync"),
    ("hw.gpu.name=x", "parameter 'hw.gpu.name'=x: gpu.name of {hw} cannot be overridden: a label",
     "override a number the costs are computed from"),
])
def test_an_unknown_hw_override_is_named_as_the_override(capsys, setting, said, fix):
    """`--set hw.gpu.nope=1` blamed the profile file (`rtx4090.yaml, field 'gpu.nope'`) for a field the user
    typed on the command line; it names `--set hw.gpu.nope` and offers the fields an override can set."""
    root = Path(__file__).resolve().parents[1]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), root / "hwprofiles" / "rtx4090.yaml"
    code, _, err = run(["replay", trace, "--hw", str(hw), "--set", setting], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"moesim: error: field '--set': {said.format(hw=hw)} (fix: "), err
    assert fix in err and "field 'gpu." not in err


def test_a_runtime_the_profile_lacks_is_named_as_the_override(tmp_path, capsys):
    """`--set runtime=nosuch` blamed the profile file (`rtx4090.yaml, field 'runtimes.nosuch'`) for a name the
    user typed on the command line; it names `--set runtime` and lists the runtimes the profile has. A sweep
    names it where its spec gives it, the Python API by its keyword."""
    root = Path(__file__).resolve().parents[1]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), root / "hwprofiles" / "rtx4090.yaml"
    runtimes = "generic, ideal, ktransformers, ktransformers-eager, llamacpp, pytorch-eager"
    code, _, err = run(["replay", trace, "--hw", str(hw), "--set", "runtime=nosuch"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err == (f"moesim: error: field '--set': parameter 'runtime'=nosuch: no runtime 'nosuch' in the profile "
                   f"rtx4090 ({hw}) (fix: use one of: {runtimes})\n")
    code, _, err = run(["replay", trace, "--hw", str(hw), "--set", "runtime=llamacp"], capsys)
    assert code == 2 and f"(fix: did you mean llamacpp? use one of: {runtimes})" in err
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"traces": [trace], "hw": [str(hw)], "systems": ["cpu-only"],
                                    "grid": {"runtime": ["llamacpp", "nosuch"]}}))
    code, _, err = run(["sweep", str(spec), "--out", str(tmp_path / "r.parquet")], capsys)
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "r.parquet").exists()
    assert err.startswith(f"moesim: error: {spec}, field 'grid.runtime': parameter 'runtime'=nosuch: "), err
    import moesim
    from moesim.errors import MoesimError
    with pytest.raises(MoesimError, match=r"^field 'runtime': parameter 'runtime'=nosuch: no runtime 'nosuch' "):
        moesim.replay(trace, hw=str(hw), runtime="nosuch")


@pytest.mark.parametrize("systems, takers, others", [
    ("all", "hybrimoe, smoe, smoe-flex", "cpu-only, gpu-only-lru"),
    ("smoe,dali", "smoe", "dali"),
])
def test_a_parameter_of_only_some_systems_names_those_that_take_it(files, capsys, systems, takers, others):
    """prefetch.n with --system all was refused as unknown to cpu-only, listing cpu-only's parameters."""
    trace, hw = files
    code, out, err = run(["replay", trace, "--hw", hw, "--system", systems, "--set", "prefetch.n=3"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and out == ""
    assert f"--set prefetch.n is a parameter of {takers} only, not of {others}" in err
    assert f"--system {takers.replace(', ', ',')} with it" in err


def test_a_parameter_a_component_swap_brings_is_taken_by_every_system_swapped(files, capsys):
    trace, hw = files
    code, out, _ = run(["replay", trace, "--hw", hw, "--system", "smoe,dali", "--set", "prefetch=smoe-token",
                        "--set", "prefetch.n=1", "--set", "cache.slots_per_layer=2"], capsys)
    assert code == 0 and "smoe" in out and "dali" in out


@pytest.mark.parametrize("command", ["replay", "systems"])
def test_every_option_says_what_it_does(command):
    """--seed had no help: `moesim replay --help` showed its range and default only."""
    from moesim.cli.app import cli
    options = [p for p in cli.commands[command].params if p.param_type_name == "option"]
    assert [p.name for p in options if not (p.help or "").strip()] == []


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
