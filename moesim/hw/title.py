"""A hardware profile as titles name it: its name with the GPU and host CPU it describes.

A profile's file name ('rtx4090', 'hw.yaml') says neither its GPU nor its CPU, and the bundled profiles
differ in their CPUs as much as in their GPUs; tables (``moesim replay``) and figures (moesim.analysis) name
both, the same way, through :func:`profile_title`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moesim.hw.profile import HardwareProfile


def profile_parts(profile: HardwareProfile) -> dict[str, Any]:
    """The GPU and host CPU of ``profile`` (with whatever overrides it carries): the ``hw_parts`` of a
    ``moesim replay --json``."""
    return {"gpu": profile.gpu.name, "cpu": profile.cpu.name, "cpu_cores": profile.cpu.cores,
            "cpu_dram_bandwidth_gbps": profile.cpu.dram_bandwidth_gbps}


def profile_title(name: str, parts: Mapping[str, Any] | None) -> str:
    """``name`` with its GPU and host CPU (``parts``, as :func:`profile_parts` gives them): 'rtx4090 (NVIDIA
    GeForce RTX 4090 + AMD EPYC 7T83, 10 cores, 102.4 GB/s DRAM)'; ``name`` alone without parts. The CPU's
    name loses a closing bracket ('(10 of 64 cores)'): the cores in use follow it."""
    name = _file_name(name)
    if parts is None:
        return name
    cpu = re.sub(r"\s*\([^()]*\)$", "", parts["cpu"]) or parts["cpu"]
    return (f"{name} ({parts['gpu']} + {cpu}, {parts['cpu_cores']} cores, "
            f"{parts['cpu_dram_bandwidth_gbps']:g} GB/s DRAM)")


def _file_name(name: str) -> str:
    """A profile given as a path by its file name, as titles name a trace ('rtx4090.yaml', not the folders
    it sits in, whose length made a title wrap in a different place for every folder)."""
    return name.replace("\\", "/").rsplit("/", 1)[-1] or name
