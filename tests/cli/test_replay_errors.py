"""`moesim replay` refusing bad input in one line: unknown or unrunnable systems, parameters out of range or of
other systems, calibration traces, and hardware overrides that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.cli.test_replay_outputs import run
from tests.factories import random_routing, tiny_model, write_tiny_trace


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


@pytest.mark.parametrize("args, words", [
    (["--system", "nope"], ["unknown system 'nope'", "cpu-only", "oracle"]),
    # the systems listed left out 'all', which --system takes
    (["--system", "nope"], ["smoe-flex, all; a system of one's own"]),
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


def test_cache_that_cannot_fit_prints_the_arithmetic(files, capsys):
    trace, hw = files
    # 10M-parameter tiny model: ~0.018 GiB of non-expert weights; 49,152-byte experts: ~0.0003 GiB left
    code, _, err = run(["replay", trace, "--hw", hw, "--system", "gpu-only-lru", "--set", "hw.gpu.memory_gib=0.5",
                        "--set", "hw.gpu.reserved_gib=0.01", "--set", "memory.workspace_gib=0.4715",
                        "--set", "cache.slots_per_layer=6"], capsys)
    assert code == 2
    assert "GPU 0.50 GiB - reserved 0.01 GiB - non-expert weights" in err
    assert "cache.slots_per_layer=3 or fewer" in err


def test_a_gpu_memory_override_too_small_is_named_not_the_profile(tmp_path, capsys):
    """`--set hw.gpu.memory_gib=0.1` on the README's run: the error blamed rtx4090.yaml ("use a larger GPU
    profile") though the file says 24 GiB. It names the override and the least size that holds Mixtral-8x7B
    without experts: 2.99 GiB of bf16 non-expert weights + 0.03 KV + 0.50 workspace + 0.66 staging (two
    336 MiB experts) = 4.18 GiB, which runs; 4.17 does not. A profile file of 0.1 GiB is still the file's fault."""
    root = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize("setting, field, buffer, largest", [
    ("cache.prefetch_slots=100000", "cache.prefetch_slots", "100000 slots (cache.prefetch_slots=100000)",
     "cache.prefetch_slots=60"),
    ("prefetch.size=100", "prefetch.size", "200 slots (twice prefetch.size=100)", "prefetch.size=30"),
])
def test_a_dali_prefetch_buffer_too_large_names_its_parameter(capsys, setting, field, buffer, largest):
    """`--system dali --set cache.prefetch_slots=100000` (or prefetch.size=100) on the README's run blamed
    cache.slots_per_layer, which the user never gave ("total 0", "use at most 0 slots"). It names the
    parameter given, the 60 slots rtx4090 holds for Mixtral-8x7B in all, and the largest value that fits."""
    root = Path(__file__).resolve().parents[2]
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


def test_a_buffer_sized_by_a_swapped_in_prefetcher_says_so_and_how_to_size_it_apart(capsys):
    """`--system dali --set prefetch=smoe-token --set prefetch.n=40` (a buffer of twice 40 since bbf1a92) said only
    "dali's prefetch buffer of 80 slots" and offered a bigger GPU; it names what sized it and cache.prefetch_slots,
    up to the 60 slots rtx4090 holds for Mixtral-8x7B."""
    root = Path(__file__).resolve().parents[2]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), root / "hwprofiles" / "rtx4090.yaml"
    code, _, err = run(["replay", trace, "--hw", str(hw), "--system", "dali", "--set", "prefetch=smoe-token",
                        "--set", "prefetch.n=40"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "dali's prefetch buffer of 80 slots (twice the 40 experts prefetch 'smoe-token' issues per layer)" in err
    assert "(fix: --set cache.prefetch_slots=60 or less (the cache then gets the slots it leaves)" in err


def test_a_dali_default_buffer_that_a_smaller_gpu_memory_leaves_no_room_for_names_the_override(capsys):
    """`--system dali --set hw.gpu.memory_gib=4.7` on the README's run: dali's default buffer of 2 slots no longer
    fits; the error named field 'memory' (the profile) and "1 expert slots". It names the --set parameter, and
    the memory that fits, which runs (one GiB-hundredth less does not)."""
    import moesim
    from moesim.errors import ConfigError
    root = Path(__file__).resolve().parents[2]
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
    root = Path(__file__).resolve().parents[2]
    trace, hw = str(root / "traces" / "mixtral-8x7b-humaneval.parquet"), root / "hwprofiles" / "rtx4090.yaml"
    code, _, err = run(["replay", trace, "--hw", str(hw), "--set", setting], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"moesim: error: field '--set': {said.format(hw=hw)} (fix: "), err
    assert fix in err and "field 'gpu." not in err


def test_a_runtime_the_profile_lacks_is_named_as_the_override(tmp_path, capsys):
    """`--set runtime=nosuch` blamed the profile file (`rtx4090.yaml, field 'runtimes.nosuch'`) for a name the
    user typed on the command line; it names `--set runtime` and lists the runtimes the profile has. A sweep
    names it where its spec gives it, the Python API by its keyword."""
    root = Path(__file__).resolve().parents[2]
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
