"""How a real run is set up: its device, CPU threads and seed, and the trace's largest batch shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.devices import allowed_cpus
from moesim.errors import ConfigError
from moesim.trace.capture.model import pick_device
from moesim.trace.io import read_table


@dataclass
class RealConfig:
    """How the real backend runs."""

    #: "cuda" (one GPU) or "cpu" (the GPU stand-in on the CPU as well)
    device: str = "cuda"
    #: torch intra-op threads of the CPU expert pool (0: every core)
    cpu_threads: int = 0
    #: steps executed once and discarded before the measured run (kernel selection, allocator, caches)
    warmup_steps: int = 2
    #: seed of the random weights
    seed: int = 0

    def threads(self) -> int:
        return self.cpu_threads or len(allowed_cpus())


def check_device(device: str) -> torch.device:
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device '{device}'", field="--device", fix="use cuda or cpu")
    return torch.device(pick_device(device))  # refuses cuda where torch sees none, as capture does


def trace_shape(trace_path: str) -> tuple[int, int, int]:
    """(most requests in one step, longest context, most token rows of one layer in one step)."""
    frame = read_table(trace_path, columns=["step", "layer", "request", "position"]).to_pandas()
    first = frame[frame["layer"] == frame["layer"].min()]
    per_step = first.groupby("step")
    return (int(per_step["request"].nunique().max()), int(frame["position"].max()) + 1,
            int(per_step.size().max()))


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "the CPU (GPU stand-in: a host thread and host memory)"
