"""moesim validate --real and moesim profile, as the command line runs them: what lands in the output and when."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moesim.cli import main  # noqa: E402
from tests.factories import random_routing, tiny_model, write_tiny_trace  # noqa: E402


@pytest.fixture
def trace(tmp_path: Path) -> str:
    model = tiny_model(layers=2, experts=8, top_k=2)
    return str(write_tiny_trace(tmp_path / "tiny.parquet", model, random_routing(np.random.default_rng(1), model,
                                                                                   1, 4, 2)))


def test_interrupted_validate_keeps_the_earlier_reports_profile(trace: str, tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C after validate had measured OUT/profile.yaml left the new profile beside the earlier report,
    which had been computed with the profile it replaced; the profile now lands with the report or not at all."""
    import moesim.analysis.validation as validation
    out = tmp_path / "report"
    out.mkdir()
    (out / "profile.yaml").write_text("earlier profile\n")
    (out / "validation.json").write_text("earlier report\n")
    measured: list[str] = []

    def interrupted(trace_file, names, profile, **kwargs):
        measured.append(profile.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(validation, "run_validation", interrupted)
    code = main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only",
                 "--threads", "1", "--quick-profile", "--out", str(out)])
    assert code == 130 and measured  # interrupted after the profile was measured
    assert sorted(p.name for p in out.iterdir()) == ["profile.yaml", "validation.json"]
    assert (out / "profile.yaml").read_text() == "earlier profile\n"


def test_validate_writes_the_profile_it_measured_and_names_it(trace: str, tmp_path: Path, capsys) -> None:
    import json
    out = tmp_path / "report"
    assert main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only",
                 "--threads", "1", "--quick-profile", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"] == str(out / "profile.yaml")
    assert (out / "profile.yaml").read_text().startswith("# Hardware profile measured by `moesim profile`.")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


CANNOT_WRITE = ("cannot create a file in /proc", "folder /proc is not writable")  # as root / as anyone else


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, where no file can be created")
@pytest.mark.parametrize("command", [
    ["profile", "--device", "cpu", "--model", "flame-moe-290m", "--quick", "--threads", "1", "--out", "/proc/p.yaml"],
    ["validate", "--real", "--device", "cpu", "--systems", "cpu-only", "--threads", "1", "--out", "/proc/report"],
])
def test_an_output_folder_no_file_can_be_created_in_is_one_line_before_the_work(trace: str, capsys, command) -> None:
    """As root, os.access said /proc (or /sys, or a root-squashed NFS folder) was writable: the measurement ran,
    then the write failed as an internal error (exit 1)."""
    root = Path(__file__).resolve().parents[2]
    if command[0] == "validate":
        command = [*command, "--trace", trace, "--profile", str(root / "hwprofiles" / "rtx4090.yaml")]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith("moesim: error: /proc/") and err.count("\n") == 1
    assert any(words in err for words in CANNOT_WRITE), err


def test_an_output_folder_under_a_file_is_one_line(trace: str, tmp_path: Path, capsys) -> None:
    assert main(["validate", "--real", "--device", "cpu", "--systems", "cpu-only", "--trace", trace,
                 "--out", str(Path(trace) / "report")]) == 2
    assert capsys.readouterr().err == (f"moesim: error: {trace}/report, field '--out': {trace} is a file, not a "
                                       "folder (fix: give a path whose folders are folders)\n")


def test_a_system_named_twice_is_one_line(trace: str, tmp_path: Path, capsys) -> None:
    """`--systems cpu-only,cpu-only` ran it twice: the table had two rows, validation.json and the logs one."""
    assert main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only,static-hot,cpu-only",
                 "--threads", "1", "--out", str(tmp_path / "report")]) == 2
    assert capsys.readouterr().err == ("moesim: error: field '--systems': cpu-only given more than once (fix: name "
                                       "each system once: --systems cpu-only,static-hot)\n")
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("available_gib, fix", [
    (16, "run the first 5 MoE layers or fewer: moesim validate --layers 5"),
    (2, "fewer MoE layers (moesim validate --layers N) cannot help: one layer's experts need 2.6 GiB; free host "
        "memory or use a larger machine"),
])
def test_experts_beyond_host_memory_name_the_layers_that_fit(monkeypatch, available_gib: int, fix: str) -> None:
    """The error said 'run fewer MoE layers (moesim validate --layers N)', leaving N to guess."""
    import backends.weights as weights
    from moesim.errors import ConfigError
    from moesim.model.presets import load_preset
    monkeypatch.setattr(weights, "host_bytes_available", lambda: available_gib * weights.GIB)
    with pytest.raises(ConfigError) as info:
        weights.check_host_memory(load_preset("mixtral-8x7b"), "bf16")  # 32 layers x 2.6 GiB of experts
    assert str(info.value) == (f"field '--layers': routed experts need 84.0 GiB of host memory, {available_gib:.1f} "
                               f"GiB is available (fix: {fix})")


def test_a_validate_killed_midway_leaves_nothing_after_the_next_one(trace: str, tmp_path: Path) -> None:
    """kill -9 while the systems ran left the staged profile (OUT/.profile.PID.tmp.yaml) for good."""
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "report"
    args = ["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only", "--threads", "1",
            "--quick-profile", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.Popen([sys.executable, "-m", "moesim", *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while killed.poll() is None and time.monotonic() < deadline:
            if out.is_dir() and any(p.name.endswith(".tmp.yaml") for p in out.iterdir()):
                break  # the profile is measured and staged: the systems run now
            time.sleep(0.02)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert any(p.name.startswith(".profile.") for p in out.iterdir())
    assert main([*args[:-3], "--profile", str(Path(__file__).resolve().parents[2] / "hwprofiles" / "rtx4090.yaml"),
                 "--out", str(out)]) == 0
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_trace_without_decode_steps_has_no_tpot_ranking(tmp_path: Path, capsys, monkeypatch) -> None:
    """A prefill-only trace printed 'ranking by TPOT: same' (no system had a TPOT to rank), and no ranking by
    TTFT, the one its systems have."""
    monkeypatch.setenv("COLUMNS", "200")
    model = tiny_model(layers=2, experts=8, top_k=2)
    trace = write_tiny_trace(tmp_path / "prefill.parquet", model,
                             random_routing(np.random.default_rng(3), model, 2, 6, 0))
    profile = Path(__file__).resolve().parents[2] / "hwprofiles" / "rtx4090.yaml"
    assert main(["validate", "--real", "--device", "cpu", "--trace", str(trace), "--systems", "cpu-only,static-hot",
                 "--threads", "1", "--profile", str(profile), "--out", str(tmp_path / "report")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ranking by TPOT: - (no system has a TPOT on this trace)" in lines
    assert any(line.startswith("ranking by TTFT: ") for line in lines)


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_validate_checks_host_memory_as_the_device_takes_it(trace: str, tmp_path: Path, monkeypatch, device: str,
                                                           pinned: bool) -> None:
    """On CUDA the routed experts are pinned, and torch's pinned allocator rounds the allocation up to a power
    of two (Qwen3-30B-A3B's 54 GiB pin 64 GiB); validate's check before profiling counted the unrounded size."""
    import backends.weights as weights
    from moesim.errors import ConfigError
    seen: list[bool] = []

    def check(model, dtype, pinned: bool = False) -> None:
        seen.append(pinned)
        raise ConfigError("stop here", field="--layers")
    monkeypatch.setattr(weights, "check_host_memory", check)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device check passes: a GPU is "here"
    assert main(["validate", "--real", "--device", device, "--trace", trace, "--systems", "cpu-only",
                 "--quick-profile", "--out", str(tmp_path / "out")]) == 2
    assert seen == [pinned]


def test_validate_without_a_gpu_says_so_first_and_writes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    """`moesim validate --real` (``--device cuda`` by default) on a machine without a GPU, with a trace whose
    experts outgrow host memory, said how much pinned memory the experts need and to pass --layers; with
    --layers it wrote OUT/trace-N-layers.parquet and only then said there is no CUDA device. The device is
    now checked first, and a refused run leaves no OUT folder behind."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bundled = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")
    for layers in ((), ("--layers", "1")):
        out = tmp_path / f"out{len(layers)}"
        assert main(["validate", "--real", "--trace", bundled, "--systems", "cpu-only", "--out", str(out),
                     *layers]) == 2
        err = capsys.readouterr().err
        assert err.count("moesim: error:") == 1
        assert "field '--device': no CUDA device is visible to torch" in err and "--device cpu" in err
        assert not out.exists()


def test_validate_layers_checks_host_memory_before_writing_the_cut_trace(tmp_path: Path, monkeypatch) -> None:
    """The host-memory check of the first N layers comes before OUT/trace-N-layers.parquet is written: a run
    refused for memory left the cut trace (and OUT) behind."""
    import backends.weights as weights
    from moesim.errors import ConfigError
    seen: list[int] = []

    def check(model, dtype, pinned: bool = False) -> None:
        seen.append(model.num_layers)
        raise ConfigError("too big", field="--layers")
    monkeypatch.setattr(weights, "check_host_memory", check)
    bundled = str(Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet")
    out = tmp_path / "out"
    assert main(["validate", "--real", "--device", "cpu", "--trace", bundled, "--systems", "cpu-only",
                 "--layers", "3", "--out", str(out)]) == 2
    assert seen == [3]  # the memory of the 3 layers run, not of all 32
    assert not out.exists()


def test_validate_says_what_runs_without_a_gpu_and_what_its_error_is(trace: str, tmp_path: Path, capsys,
                                                                     monkeypatch) -> None:
    """`moesim validate --help` gave --device no help (cuda by default, with cpu a bare choice), and without
    --real the fix was only "pass --real"; the table's 'error' columns were not defined on the command line.
    Now --device says that cpu is the CPU stand-in with no GPU needed, the fix names it, and a line under the
    table defines the error and says, on the stand-in, that it compares the simulator with this CPU."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["validate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "cpu: the CPU stand-in (no GPU needed" in text
    assert "(required: the only validation there is)" in text
    assert main(["validate", "--trace", trace, "--systems", "cpu-only", "--out", str(tmp_path / "no")]) == 2
    assert "fix: pass --real (with --device cpu on a machine without a GPU" in capsys.readouterr().err
    profile = Path(__file__).resolve().parents[2] / "hwprofiles" / "rtx4090.yaml"
    assert main(["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "cpu-only",
                 "--threads", "1", "--profile", str(profile), "--out", str(tmp_path / "report")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("error: (simulated - measured) / measured; measured on the CPU stand-in (the GPU's work on a host "
            "thread), so the errors compare the simulator with this CPU, not with a GPU") in lines


def test_validate_into_an_earlier_report_names_the_systems_it_no_longer_covers(trace: str, tmp_path: Path,
                                                                               capsys) -> None:
    """A second validate run into the same --out with fewer systems replaced validation.md and .json but left
    the earlier systems' folders of decision logs and timelines beside the new ones, without a word."""
    profile = Path(__file__).resolve().parents[2] / "hwprofiles" / "rtx4090.yaml"
    out = tmp_path / "report"
    args = ["validate", "--real", "--device", "cpu", "--trace", trace, "--threads", "1", "--profile", str(profile),
            "--out", str(out)]
    assert main([*args, "--systems", "cpu-only,static-hot"]) == 0
    assert "earlier run" not in capsys.readouterr().err
    assert main([*args, "--systems", "cpu-only"]) == 0
    assert (f"moesim: note: {out} also holds static-hot/ of an earlier run, which this report does not cover "
            "(remove them, or use another --out)") in capsys.readouterr().err.splitlines()


def test_validate_warns_that_hw_settings_change_the_simulated_side_only(trace: str, tmp_path: Path, monkeypatch,
                                                                      capsys) -> None:
    """`--set hw.pcie.bandwidth_scale=0.01` (help: "Parameter for both executors") changed the simulator's copy
    costs while the real run copied at this machine's speed, and the report compared the two without a word.
    A warning now says so; the memory plan's hw.gpu.memory_gib, which the real run is set up with too, gets none."""
    import backends.weights as weights
    from moesim.errors import ConfigError

    def stop(model, dtype, pinned: bool = False) -> None:
        raise ConfigError("stop here", field="--layers")
    monkeypatch.setattr(weights, "check_host_memory", stop)
    base = ["validate", "--real", "--device", "cpu", "--trace", trace, "--systems", "gpu-only-lru", "--out",
            str(tmp_path / "out")]
    assert main([*base, "--set", "hw.pcie.bandwidth_scale=0.01", "--set", "hw.gpu.memory_gib=8"]) == 2
    err = capsys.readouterr().err
    assert ("moesim: warning: --set hw.pcie.bandwidth_scale=0.01 changes the simulated hardware only (the real run "
            "runs on this machine as it is), so the errors compare the measured run with another machine") in err
    assert main([*base, "--set", "hw.gpu.memory_gib=8"]) == 2
    assert "warning" not in capsys.readouterr().err
