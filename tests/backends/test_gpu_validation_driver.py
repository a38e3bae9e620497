"""benchmarks/gpu_validation.py on the CPU with tiny shapes: the H100 driver and its report cannot rot unseen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = {"cpu-only", "gpu-only-lru", "static-hot", "smoe", "hybrimoe", "dali", "ktransformers-ed", "buddymoe"}


@pytest.mark.slow
def test_dry_run_of_every_step_and_the_report(tmp_path):
    out = tmp_path / "gpu-validation"
    env = {**os.environ, "MOESIM_PROGRESS_INTERVAL": "0.2"}  # plain progress lines often, as a long run gets them
    run = subprocess.run([sys.executable, "benchmarks/gpu_validation.py", "all", str(out), "--device", "cpu",
                          "--dry-run", "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # progress: every step announced, every validate stage printed as it happens
    for step in ("profile", "v2lite", "qwen3"):
        assert f"step {step}: done" in run.stdout
    assert "profile: done, " in run.stdout and "validate: done, 16/16 (100%)" in run.stdout
    profile = out / "profile" / "measured-h100.yaml"
    assert "measured by moesim profile on" in profile.read_text()
    for step, layers in (("v2lite", 3), ("qwen3", 2)):  # the GQA shape is cut to the layers memory holds
        shape = json.loads((out / step / "shape.json").read_text())
        assert shape["layers_run"] == layers
        folders = sorted((out / step).glob("slots-*"))
        assert len(folders) == 2  # two cache sizes
        for folder in folders:
            report = json.loads((folder / "validation.json").read_text())
            assert set(report["systems"]) == SYSTEMS
            assert report["profile"] == str(profile)
            for name in ("cpu-only", "gpu-only-lru", "static-hot"):
                assert report["systems"][name]["decisions"]["identical"], name
            assert "breakdown_ms" in report["systems"]["cpu-only"]["real"]
        with tarfile.open(out / f"{step}.tar.gz") as tar:
            names = tar.getnames()
        assert f"{step}/slots-{shape['slots'][0]}/validation.json" in names
        # traces and timelines stay behind (archives stay small); decision logs travel
        assert not any(Path(n).name.startswith("trace") or n.endswith("-timeline.parquet") for n in names)
        assert f"{step}/slots-{shape['slots'][0]}/buddymoe/real-decisions.parquet" in names
        assert (out / f"{step}.tar.gz").stat().st_size < 5e6
    doc = tmp_path / "h100.md"
    made = subprocess.run([sys.executable, "benchmarks/gpu_validation_report.py", str(out), "--out", str(doc)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    text = doc.read_text()
    assert text.count("| buddymoe |") == 8  # two shapes x two cache sizes, in the results and the host-time tables
    assert "## tiny-mla, 3 MoE layers, 2 cache slots per layer" in text
    assert "## tiny-gqa, 2 MoE layers, 6 cache slots per layer" in text
    assert "Where the largest error comes from" in text and "| sync |" in text
    assert "not tuned to these runs" in text
    # per shape and cache size, the host time between each layer's attention and first expert, for every system
    assert text.count("| system | host µs per MoE layer | plan() µs per MoE layer |") == 4
    assert text.count("The simulator does not charge this time") == 4
    host = re.findall(r"^\| [a-z-]+ \| ([\d,]+) \| ([\d,]+) \| (\d+\.\d\d) \| (\d+\.\d)% \|$", text, flags=re.M)
    assert len(host) == 4 * len(SYSTEMS)
    assert all(int(plan.replace(",", "")) <= int(layer.replace(",", "")) and float(share) > 0
               for layer, plan, _, share in host), host
    rankings = re.findall(r"^- ranking by (TPOT|TTFT): (.*)$", text, flags=re.M)
    assert len(rankings) == 8  # both metrics of two shapes x two cache sizes
    swap = r"[a-z-]+ vs [a-z-]+: \d+\.\d% faster measured, \d+\.\d% slower simulated"
    assert all(re.fullmatch(rf"same|DIFFERENT(; {swap})+", verdict) for _, verdict in rankings), rankings


def test_python_dash_m_moesim_exits_with_the_error_status(tmp_path):
    """The driver runs `python -m moesim` and stops on a failed step: the status must reach it."""
    run = subprocess.run([sys.executable, "-m", "moesim", "validate", "--trace", "x.parquet", "--systems", "cpu-only",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "pass --real" in run.stderr


def test_a_deadline_leaves_runs_out_packs_what_is_done_and_says_how_to_run_the_rest(tmp_path):
    """With no time left, the validate step runs nothing, still packs its shape (copied to --copy-to), and its
    closing line names the runs left out with the commands that run them; the report lists them as not run."""
    out, copies = tmp_path / "gv", tmp_path / "copies"
    run = subprocess.run([sys.executable, "benchmarks/gpu_validation.py", "v2lite", str(out), "--device", "cpu",
                          "--dry-run", "--threads", "1", "--profile", "hwprofiles/rtx4090.yaml", "--deadline", "0",
                          "--copy-to", str(copies)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "v2lite: deadline of 0 s near: cache sizes 2, 4 left out" in run.stdout
    assert (f"to run them: benchmarks/gpu_validation.sh v2lite {out} --slots 2; "
            f"benchmarks/gpu_validation.sh v2lite {out} --slots 4") in run.stdout
    assert "$ python -m moesim validate" not in run.stdout
    shape = json.loads((out / "v2lite" / "shape.json").read_text())
    assert shape["left_out_slots"] == [2, 4]
    assert (copies / "v2lite.tar.gz").read_bytes() == (out / "v2lite.tar.gz").read_bytes()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_validation_report import missing_runs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert missing_runs(out) == ["v2lite at 2 slots", "v2lite at 4 slots"]


def test_without_a_deadline_every_run_fits(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_validation import FIRST_RUN_ESTIMATE_S, Driver
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    driver = Driver(tmp_path, "cpu", dry_run=False, threads=1, profile=None)
    assert driver.fits()
    driver.deadline_s = FIRST_RUN_ESTIMATE_S - 1  # the first run is expected to take FIRST_RUN_ESTIMATE_S
    assert not driver.fits()
    driver.deadline_s, driver.run_s = 1e6, [1e6]  # then as long as the longest run so far
    assert not driver.fits()
    driver.run_s = [10.0]
    assert driver.fits()


@pytest.mark.parametrize("answer, name", [("NVIDIA H200", "measured-h200"), ("NVIDIA H100 80GB HBM3", "measured-h100"),
                                          ("NVIDIA A100-SXM4-80GB", "measured-a100"),
                                          ("NVIDIA GeForce RTX 4090", "measured-geforce-rtx-4090"),
                                          (None, "measured-h100")])
def test_the_profile_is_named_after_the_gpu_nvidia_smi_names(tmp_path, monkeypatch, answer, name):
    """The driver named every profile measured-h100, whatever the GPU (the device lent may be an H200); it now
    takes the GPU's model from nvidia-smi (no torch import: seconds of device time), and keeps measured-h100
    without one (None: no nvidia-smi on PATH)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_validation import profile_name
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    if answer is not None:
        tool = tmp_path / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\necho '{answer}'\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert profile_name("cuda") == name
    assert profile_name("cpu") == "measured-h100"


def test_the_report_shows_the_host_time_of_each_system_and_none_for_older_results():
    """The document's host-time table, from validation.json: per system the host µs and plan() µs per MoE layer
    of the decode steps, times the MoE layers per decode step and its share of the measured TPOT; results written
    before the backend measured it have no table."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_validation_report import host_time_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    host = {"moe_layers_per_step": 26, "decode_host_us_per_layer": 1234.4, "decode_plan_us_per_layer": 80.2,
            "decode_host_ms_per_step": 32.0944, "decode_host_share_of_tpot": 0.25}
    lines = host_time_table({"systems": {"smoe": {"host_time": host}, "dali": {"host_time": None}}})
    assert "The simulator does not charge this time" in lines[0]
    assert lines[2] == ("| system | host µs per MoE layer | plan() µs per MoE layer | host ms per decode step "
                        "(x 26 MoE layers) | share of measured TPOT |")
    assert lines[4:] == ["| smoe | 1,234 | 80 | 32.09 | 25.0% |", ""]
    assert host_time_table({"systems": {"smoe": {"real": {}}}}) == []
