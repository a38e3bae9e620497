"""Simulator vs real kernels on one GPU host: measure a profile, run `moesim validate --real`, collect the results.

    python benchmarks/gpu_validation.py STEP OUT_DIR [--device cuda|cpu] [--dry-run] [--threads N]

STEP is one of

* ``profile``: `moesim profile` of this host for both model shapes into OUT_DIR/profile/measured-GPU.yaml (GPU:
  the model nvidia-smi names, e.g. measured-h200; measured-h100 in a dry run);
* ``v2lite``: DeepSeek-V2-Lite, all 26 MoE layers, every system at two cache sizes;
* ``qwen3``: Qwen3-30B-A3B with as many MoE layers as host memory holds, every system at two cache sizes;
* ``all``: the three in turn (one process; on a machine with a 10-minute limit per command, run them one by one;
  ``--slots K`` splits a validate step further, one cache size per call).

Each step writes OUT_DIR/STEP/ and packs it into OUT_DIR/STEP.tar.gz (traces left out: the synth command
and seed in OUT_DIR/STEP/commands.txt rebuild them; timelines left out unless --timelines: the reports carry
each run's time breakdown). Validate steps read the profile from --profile
(default: OUT_DIR/profile/measured-GPU.yaml, else hwprofiles/measured-GPU.yaml). Everything runs from
the repository tree (`python -m moesim`, no install); simpy may come from a wheel on PYTHONPATH.

``--deadline S`` starts no validate run that would be expected to end more than S seconds after the
driver started (expected: as long as its longest validate run so far, or FIRST_RUN_ESTIMATE_S before the
first), so that a call with a time limit ends with what it finished packed instead of being killed
mid-run; each step's archive is packed again after each of its runs, and the runs left out are listed
in its shape.json and in the closing line, with the command that runs them. ``--copy-to DIR`` copies each
archive (and the measured profile) into DIR as soon as it is written (the device tool's $OUT).

``--dry-run`` runs the same steps on two tiny shapes (an MLA and a GQA model of a few layers, a short
trace) so the whole driver can be exercised on a CPU in a minute; the test suite does so with
``--device cpu``. ``benchmarks/gpu_validation_report.py`` turns the output folder into docs/validation/h100.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SYSTEMS = ("cpu-only", "gpu-only-lru", "static-hot", "smoe", "hybrimoe", "dali", "ktransformers-ed", "buddymoe")
#: the profile's name without a GPU to name it after (the dry run), and the GPU validation issue's
PROFILE_NAME = "measured-h100"
#: seconds a full-size validate run (8 systems, one cache size) is expected to take before one has been timed
FIRST_RUN_ESTIMATE_S = 240.0
#: share of available host memory the routed experts of one shape may take (pinned, never swapped; torch's pinned
#: allocator rounds an allocation up to a power of two, so the pinned memory can be up to twice this share)
HOST_MEMORY_SHARE = 0.5


@dataclass
class Shape:
    """One model shape of the validation: preset, layers run, trace, and the two cache sizes."""

    step: str
    preset: str
    #: MoE layers executed (None: all; "memory": as many as HOST_MEMORY_SHARE of host memory holds)
    layers: int | str | None
    requests: int
    prompt_len: int
    decode_len: int
    slots: tuple[int, int]


FULL = (Shape("v2lite", "deepseek-v2-lite", None, 2, 256, 32, (8, 24)),
        Shape("qwen3", "qwen3-30b-a3b", "memory", 1, 256, 32, (16, 48)))
DRY = (Shape("v2lite", "tiny-mla", None, 1, 12, 4, (2, 4)),
       Shape("qwen3", "tiny-gqa", "memory", 1, 12, 4, (2, 6)))


def tiny_presets(folder: Path) -> dict[str, Path]:
    """Two tiny presets shaped like the real ones (MLA with shared experts; GQA without), for dry runs."""
    import yaml

    from moesim.model.spec import ModelSpec
    folder.mkdir(parents=True, exist_ok=True)
    source = {"*": "dry-run shape of benchmarks/gpu_validation.py: small numbers for a fast CPU check"}
    mla = {"name": "tiny-mla", "num_layers": 3, "num_experts": 8, "top_k": 2, "hidden_size": 64,
           "moe_intermediate_size": 96, "num_shared_experts": 1, "shared_intermediate_size": 192,
           "num_dense_layers": 1, "dense_intermediate_size": 256, "num_attention_heads": 2, "num_kv_heads": 2,
           "head_dim": 32, "attention": "mla", "kv_lora_rank": 32, "qk_rope_head_dim": 16, "vocab_size": 1000,
           "expert_dtype": "bf16", "sources": source}
    gqa = {"name": "tiny-gqa", "num_layers": 4, "num_experts": 16, "top_k": 4, "hidden_size": 64,
           "moe_intermediate_size": 48, "num_shared_experts": 0, "shared_intermediate_size": 0,
           "num_dense_layers": 0, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16,
           "attention": "gqa", "vocab_size": 1000, "expert_dtype": "bf16", "sources": source}
    out = {}
    for data in (mla, gqa):
        # the total the shapes give, as a released model's total_params would (load_preset checks it)
        shape = ModelSpec.from_dict({k: v for k, v in data.items() if k not in ("sources", "total_params")})
        data["total_params"] = shape.routed_expert_params + shape.counted_non_expert_params()
        path = folder / f"{data['name']}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        out[data["name"]] = path
    return out


def profile_name(device: str) -> str:
    """``measured-<GPU model>``: measured-h200 on an NVIDIA H200, measured-h100 on an H100 (``nvidia-smi``, which
    answers at once; torch would take seconds of the device's time to import), :data:`PROFILE_NAME` without
    one."""
    if device != "cuda" or shutil.which("nvidia-smi") is None:
        return PROFILE_NAME
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"], text=True,
                             capture_output=True, timeout=30, check=True).stdout.strip().lower()
    except (OSError, subprocess.SubprocessError):
        return PROFILE_NAME
    model = re.findall(r"\b[a-z]+\d{2,4}[a-z]?\b", gpu)  # h100, h200, a100, l40s: the first such word
    slug = model[0] if model else re.sub(r"[^a-z0-9]+", "-", gpu.replace("nvidia", "")).strip("-")
    return f"measured-{slug}" if slug else PROFILE_NAME


class Driver:
    def __init__(self, out: Path, device: str, dry_run: bool, threads: int, profile: str | None,
                 slots: int | None = None, timelines: bool = False, deadline_s: float | None = None,
                 copy_to: Path | None = None) -> None:
        self.out = out
        self.device = device
        self.dry_run = dry_run
        self.threads = threads
        self.shapes = DRY if dry_run else FULL
        self.presets = {s.preset: s.preset for s in self.shapes}
        if dry_run:
            self.presets.update({k: str(v) for k, v in tiny_presets(out / "presets").items()})
        self.profile_arg = profile
        self.only_slots = slots
        self.timelines = timelines
        self.deadline_s = deadline_s
        self.copy_to = copy_to
        self.profile_name = profile_name(device)
        #: wall seconds of each validate run so far, the estimate of the next one
        self.run_s: list[float] = []
        #: (step, cache slots) of the validate runs the deadline left out
        self.left_out: list[tuple[str, int]] = []
        self.started = time.perf_counter()

    # -------------------------------------------------------------- helpers
    def say(self, text: str) -> None:
        print(f"[gpu-validation {time.perf_counter() - self.started:7.1f} s] {text}", flush=True)

    def moesim(self, args: list[str], log: Path) -> None:
        """`python -m moesim ARGS` from the tree, streamed to the console and appended to ``log``."""
        cmd = [sys.executable, "-m", "moesim", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.say("$ " + shlex.join(["python", "-m", "moesim", *args]))
        with open(log.parent / "commands.txt", "a") as f:
            f.write(shlex.join(["python", "-m", "moesim", *args]) + "\n")
        with open(log, "a") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write("    " + line)
                sys.stdout.flush()
                f.write(line)
            if proc.wait() != 0:
                raise SystemExit(f"gpu-validation: command failed (exit {proc.returncode}), log in {log}")

    def profile_path(self) -> Path:
        candidates = [Path(self.profile_arg)] if self.profile_arg else \
            [self.out / "profile" / f"{self.profile_name}.yaml", ROOT / "hwprofiles" / f"{self.profile_name}.yaml"]
        for path in candidates:
            if path.exists():
                return path
        raise SystemExit(f"gpu-validation: no profile at {', '.join(map(str, candidates))}: run the profile "
                         "step first (or pass --profile)")

    def pack(self, step: str) -> Path:
        folder = self.out / step
        part = f"-slots-{self.only_slots}" if self.only_slots is not None and step != "profile" else ""
        archive = self.out / f"{step}{part}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(folder.rglob("*")):
                timeline = path.name.endswith("-timeline.parquet")
                if path.is_file() and not path.name.startswith("trace") and (self.timelines or not timeline):
                    tar.add(path, arcname=str(path.relative_to(self.out)))
        self.say(f"packed {archive} ({archive.stat().st_size / 1e6:.2f} MB)")
        if self.copy_to is not None:
            self.copy_to.mkdir(parents=True, exist_ok=True)
            shutil.copy2(archive, self.copy_to / archive.name)
        return archive

    def fits(self) -> bool:
        """Whether another validate run is expected to end by the deadline (always, without one)."""
        if self.deadline_s is None:
            return True
        expected = max(self.run_s, default=0.0 if self.dry_run else FIRST_RUN_ESTIMATE_S)
        return time.perf_counter() - self.started + expected <= self.deadline_s

    # -------------------------------------------------------------- steps
    def step_profile(self) -> None:
        folder = self.out / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        args = ["profile", "--device", self.device, "--name", self.profile_name, "--threads", str(self.threads),
                "--out", str(folder / f"{self.profile_name}.yaml")]
        for shape in self.shapes:
            args += ["--model", self.presets[shape.preset]]
        if self.dry_run:
            args.append("--quick")
        self.moesim(args, folder / "log.txt")
        self.pack("profile")
        if self.copy_to is not None:
            shutil.copy2(folder / f"{self.profile_name}.yaml", self.copy_to / f"{self.profile_name}.yaml")

    def layers_for(self, shape: Shape) -> int:
        from moesim.model.presets import load_preset
        model = load_preset(self.presets[shape.preset])
        if shape.layers is None:
            return model.num_layers
        if isinstance(shape.layers, int):
            return shape.layers
        per_layer = model.num_experts * model.expert_bytes()
        available = _mem_available()
        fit = int(HOST_MEMORY_SHARE * available // per_layer) if available else model.num_layers
        if self.dry_run:
            fit = min(fit, 2)  # a truncated trace is exercised in the dry run too
        return max(1, min(model.num_layers, fit))

    def step_validate(self, shape: Shape) -> None:
        from moesim.analysis.validation import truncate_trace
        folder = self.out / shape.step
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "log.txt"
        profile = self.profile_path()
        trace = folder / "trace.parquet"
        self.moesim(["trace", "synth", "--model", self.presets[shape.preset], "--requests", str(shape.requests),
                     "--prompt-len", str(shape.prompt_len), "--decode-len", str(shape.decode_len), "--seed", "0",
                     "--out", str(trace)], log)
        layers = self.layers_for(shape)
        from moesim.trace.io import read_meta
        if layers < read_meta(trace).model.num_layers:
            trace = truncate_trace(str(trace), layers, folder / f"trace-{layers}-layers.parquet")
            self.say(f"{shape.preset}: first {layers} MoE layers (as many as {HOST_MEMORY_SHARE:.0%} of "
                     "available host memory holds)")
        with open(folder / "commands.txt", "a") as f:
            f.write(f"# {shape.preset}: {layers} MoE layers; profile {profile}\n")
        wanted = [k for k in shape.slots if self.only_slots is None or k == self.only_slots]
        for i, slots in enumerate(wanted):
            if not self.fits():
                self.left_out += [(shape.step, k) for k in wanted[i:]]
                self.say(f"{shape.step}: deadline of {self.deadline_s:.0f} s near: cache sizes "
                         f"{', '.join(map(str, wanted[i:]))} left out")
                break
            start = time.perf_counter()
            self.moesim(["validate", "--real", "--device", self.device, "--trace", str(trace), "--profile",
                         str(profile), "--systems", ",".join(SYSTEMS), "--threads", str(self.threads),
                         "--set", f"cache.slots_per_layer={slots}", "--out", str(folder / f"slots-{slots}")], log)
            self.run_s.append(time.perf_counter() - start)
            if slots != wanted[-1]:
                self.write_shape(shape, layers, profile, folder)
                self.pack(shape.step)  # what is done travels even if a later run is cut off
        self.write_shape(shape, layers, profile, folder)
        self.pack(shape.step)

    def write_shape(self, shape: Shape, layers: int, profile: Path, folder: Path) -> None:
        left_out = [k for step, k in self.left_out if step == shape.step]
        (folder / "shape.json").write_text(json.dumps({**dataclasses.asdict(shape), "layers_run": layers,
                                                       "profile": str(profile), "left_out_slots": left_out},
                                                      indent=2) + "\n")

    def run(self, step: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        steps = ["profile", *(s.step for s in self.shapes)] if step == "all" else [step]
        for name in steps:
            self.say(f"step {name}: start")
            if name == "profile":
                self.step_profile()
            else:
                self.step_validate(next(s for s in self.shapes if s.step == name))
            self.say(f"step {name}: done")
        if self.left_out:
            steps_left = sorted({step for step, _ in self.left_out})
            reruns = "; ".join(f"benchmarks/gpu_validation.sh {step} {self.out} --slots {k}"
                               for step, k in self.left_out)
            self.say(f"left out for the deadline: {len(self.left_out)} validate run(s) of "
                     f"{', '.join(steps_left)}; to run them: {reruns}")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["profile", "v2lite", "qwen3", "all"])
    parser.add_argument("out", type=Path, help="output folder (one per whole run)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes and traces (a CPU check of the driver)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU expert pool threads, for profile and runs alike (default: all CPUs but two, which "
                             "stay free for the thread launching GPU work and the copy-engine thread)")
    parser.add_argument("--profile", default=None, help="profile YAML for the validate steps")
    parser.add_argument("--slots", type=int, default=None,
                        help="run only this one of the shape's two cache sizes (to split a step over two calls)")
    parser.add_argument("--timelines", action="store_true",
                        help="pack the per-system timelines too (tens of MB on the full shapes; left out by default)")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="start no validate run expected to end past this many seconds from the start; what "
                             "is done gets packed and the closing line says what was left out")
    parser.add_argument("--copy-to", type=Path, default=None, metavar="DIR",
                        help="copy each archive, and the measured profile, here as soon as it is written")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) - 2) if hasattr(os, "sched_getaffinity") else 0
    Driver(args.out, args.device, args.dry_run, args.threads, args.profile, args.slots, args.timelines,
           args.deadline, args.copy_to).run(args.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
