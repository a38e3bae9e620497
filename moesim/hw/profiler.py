"""``moesim profile``: measure a hardware profile v1 on the machine at hand.

Every curve the cost model reads is measured for one model shape: expert FFN
time vs tokens on the GPU (routed and, where it differs, shared shape) and on
the CPU pool, attention (with the gate) vs context at a few token counts,
host-to-device and device-to-host bandwidth vs transfer size from pinned
memory, the slowdown when both directions run at once, kernel-launch and
CPU-GPU hand-off overheads, plus the matmul and memory-bandwidth ceilings the
roofline fallback uses. The kernels timed are the real backend's own
(:mod:`backends.kernels`, :mod:`backends.devices`), so a measured profile
describes exactly what ``moesim validate --real`` executes; torch is imported
inside the functions only.

Expert and attention curves are timed from the first launch to the end of
the last kernel, so kernel-launch time is inside them: replay with a measured
profile as ``moesim validate`` does, with ``engine.kernels_per_expert=0`` and
``engine.kernels_per_shared=0``, or launches count twice.

With ``device="cpu"`` the GPU stand-in is measured (a host thread, host
memory, plain memcpy between two host buffers for the "PCIe" curves).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from moesim.hw.profile import PROFILE_SCHEMA_VERSION, parse_profile
from moesim.model.spec import ModelSpec
from moesim.util import atomic_write_text

KIB, MIB = 2**10, 2**20
EXPERT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ATTENTION_TOKENS = (1, 16, 128)
CONTEXTS = (128, 512, 2048, 8192)
COPY_SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 128 * MIB)


@dataclass
class ProfileConfig:
    model: ModelSpec
    device: str = "cuda"
    #: torch threads of the CPU expert pool (0: every core)
    threads: int = 0
    #: timed repetitions per point (median taken), after one warm-up call
    repeats: int = 5
    #: the command line, recorded in every source
    command: str = "moesim profile"
    #: fewer points and repetitions (tests, quick looks)
    quick: bool = False
    name: str = ""

    def cpu_threads(self) -> int:
        return self.threads or os.cpu_count() or 1


# ----------------------------------------------------------------------------- machine identity
def cpu_info() -> dict[str, Any]:
    """CPU model, ISA flags that matter to expert kernels, core count (from /proc/cpuinfo where present)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(("amx", "avx512")) or f in ("avx2", "fma", "avx_vnni"))
    return {"model": model, "isa": isa, "cores": os.cpu_count() or 1}


def cpu_kernel_family(isa: list[str]) -> str:
    """The cost model's kernel family for torch's CPU matmuls on this ISA (oneDNN uses AMX when present)."""
    if any(f.startswith("amx") for f in isa):
        return "amx"
    if "avx512f" in isa:
        return "avx512"
    return "avx2"


def _memory_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def gpu_info(device: str) -> dict[str, Any]:
    import torch
    if device != "cuda":
        return {"name": "GPU stand-in on the host CPU", "driver": "none", "memory_bytes":
                (_memory_kib("MemTotal") or 0) * 1024, "free_bytes": (_memory_kib("MemAvailable") or 0) * 1024}
    free, total = torch.cuda.mem_get_info()
    driver = "unknown"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {"name": torch.cuda.get_device_name(), "driver": driver, "memory_bytes": total, "free_bytes": free,
            "cuda": torch.version.cuda}


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median seconds of a callable on the measured device (CUDA events, or host clock for the stand-in).

    Two untimed calls first (kernel selection, allocator); then at least
    ``repeats`` timed calls and more, up to :attr:`MAX_CALLS`, until
    :attr:`MIN_TOTAL_S` of samples are in: short kernels get many samples, so
    one interrupted call on a busy machine does not become the curve.
    """

    MIN_TOTAL_S = 0.05
    MAX_CALLS = 200

    def __init__(self, device: str, repeats: int) -> None:
        import torch
        self.cuda = device == "cuda"
        self.repeats = repeats
        self.torch = torch

    def _sample(self, once: Callable[[], float]) -> float:
        once()
        once()
        times: list[float] = []
        while len(times) < self.repeats or (sum(times) < self.MIN_TOTAL_S and len(times) < self.MAX_CALLS):
            times.append(once())
        return statistics.median(times)

    def device(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            return self.host(fn)
        torch = self.torch

        def once() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return self._sample(once)

    def host(self, fn: Callable[[], Any]) -> float:
        def once() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return self._sample(once)


# ----------------------------------------------------------------------------- measurements
class Measurements:
    """Each method measures one curve or number; ``plan()`` lists them for a progress bar."""

    def __init__(self, config: ProfileConfig) -> None:
        import torch

        from backends.kernels import torch_dtype
        self.torch = torch
        self.config = config
        self.model = config.model
        self.cuda = config.device == "cuda"
        self.dev = torch.device(config.device)
        self.dtype = torch_dtype(config.model.expert_dtype)
        self.timer = Timer(config.device, 2 if config.quick else config.repeats)
        self.generator = torch.Generator().manual_seed(0)
        q = config.quick
        self.expert_tokens = (1, 4, 16, 64) if q else EXPERT_TOKENS
        self.attention_tokens = (1, 16) if q else ATTENTION_TOKENS
        self.contexts = (128, 512) if q else CONTEXTS
        self.copy_sizes = tuple(sorted({*((4 * KIB, 64 * KIB, MIB) if q else COPY_SIZES),
                                        self.model.expert_bytes()}))

    def _random(self, *shape: int, device: Any = None, pin: bool = False):
        from backends.kernels import random_fill
        t = self.torch.empty(*shape, dtype=self.dtype, device=device or self.dev, pin_memory=pin)
        return random_fill(t, self.generator)

    # -- compute -------------------------------------------------------------------
    def expert_curve(self, intermediate: int, on_gpu: bool) -> list[float]:
        """µs per expert call (gather, FFN, weighted scatter-add) vs tokens, as the backend runs it."""
        from backends.kernels import expert_params, ffn
        torch, m = self.torch, self.model
        device = self.dev if on_gpu else torch.device("cpu")
        weights = self._random(expert_params(m, intermediate), device=device)
        out = []
        for tokens in self.expert_tokens:
            x = self._random(tokens, m.hidden_size, device=device)
            acc = torch.zeros_like(x)
            rows = torch.arange(tokens, device=device)
            gate = torch.ones(tokens, 1, dtype=self.dtype, device=device)

            def call() -> None:
                y = ffn(weights, x.index_select(0, rows), m.hidden_size, intermediate, m.expert_matrices)
                acc.index_add_(0, rows, y * gate)
            seconds = self.timer.device(call) if on_gpu else self.timer.host(call)
            out.append(seconds * 1e6)
        return out

    def attention_curves(self) -> list[tuple[int, list[int], list[float]]]:
        """(tokens, contexts, µs) for one attention block with its gate, as the backend runs it."""
        from backends.kernels import Attention, Batch
        curves = []
        max_context = max(self.contexts)
        block = Attention(self.model, self.dtype, self.dev, 1, max_context, self.generator)
        for tokens in self.attention_tokens:
            contexts = [c for c in self.contexts if c >= tokens]
            x = self._random(tokens, self.model.hidden_size)
            times = [self.timer.device(lambda c=c: block(x, Batch(1, tokens, c))) * 1e6 for c in contexts]
            curves.append((tokens, contexts, times))
        return curves

    def matmul_tflops(self, on_gpu: bool) -> float:
        torch = self.torch
        n = 1024 if (self.config.quick or not on_gpu) else 8192
        device = self.dev if on_gpu else torch.device("cpu")
        a, b = self._random(n, n, device=device), self._random(n, n, device=device)
        seconds = (self.timer.device if on_gpu else self.timer.host)(lambda: a @ b)
        return 2 * n**3 / seconds / 1e12

    def copy_gbps(self, on_gpu: bool) -> float:
        """Memory bandwidth of a large device-local (or host) copy, read plus write."""
        torch = self.torch
        nbytes = (64 if self.config.quick else 1024) * MIB
        device = self.dev if on_gpu else torch.device("cpu")
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        seconds = (self.timer.device if on_gpu else self.timer.host)(lambda: dst.copy_(src))
        return 2 * nbytes / seconds / 1e9

    # -- transfers -------------------------------------------------------------------
    def _buffers(self, nbytes: int):
        torch = self.torch
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return host, torch.empty(nbytes, dtype=torch.uint8, device=self.dev)

    def _copy_time(self, dst, src) -> float:
        if self.cuda:
            return self.timer.device(lambda: dst.copy_(src, non_blocking=True))
        return self.timer.host(lambda: dst.copy_(src))

    def copy_curve(self, to_device: bool) -> tuple[float, list[float]]:
        """(latency µs, GB/s vs size) such that latency + bytes / bandwidth(size) is the measured time."""
        host, dev = self._buffers(4)
        latency = self._copy_time(dev, host) if to_device else self._copy_time(host, dev)
        gbps = []
        for size in self.copy_sizes:
            host, dev = self._buffers(size)
            seconds = self._copy_time(dev, host) if to_device else self._copy_time(host, dev)
            payload = max(seconds - latency, 0.05 * seconds)  # the rest is per-copy latency
            gbps.append(size / payload / 1e9)
        return latency * 1e6, gbps

    def duplex_slowdown(self) -> float:
        """H2D bandwidth while a D2H copy of the same size runs at once, over H2D alone."""
        torch = self.torch
        size = max(self.copy_sizes)
        h_src, d_dst = self._buffers(size)
        h_dst, d_src = self._buffers(size)
        alone = self._copy_time(d_dst, h_src)
        if self.cuda:
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

            def both() -> None:
                with torch.cuda.stream(s1):
                    d_dst.copy_(h_src, non_blocking=True)
                with torch.cuda.stream(s2):
                    h_dst.copy_(d_src, non_blocking=True)
                torch.cuda.current_stream().wait_stream(s1)
                torch.cuda.current_stream().wait_stream(s2)
            together = self.timer.device(both)
        else:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(2) as pool:
                def both() -> None:
                    a = pool.submit(d_dst.copy_, h_src)
                    b = pool.submit(h_dst.copy_, d_src)
                    a.result()
                    b.result()
                together = self.timer.host(both)
        return min(alone / together * 2, 1.0)

    # -- overheads -------------------------------------------------------------------
    def launch_us(self) -> float:
        """Host time to launch one small kernel (CUDA), or to hand one closure to the stand-in thread."""
        torch = self.torch
        n = 200
        if self.cuda:
            x = torch.zeros(16, device=self.dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                x.add_(1)
            launched = time.perf_counter() - t0
            torch.cuda.synchronize()
            return launched / n * 1e6
        from backends.devices import Clock, HostStream
        stream = HostStream(Clock(False), "moesim-profile")
        try:
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                stream.launch(lambda: None)
            stream.synchronize()
            return (time.perf_counter() - t0) / n * 1e6
        finally:
            stream.close()

    def handoff_us(self) -> float:
        """One CPU-expert hand-off as the backend does it: activations to the host, the pool, result back, added."""
        from backends.devices import Clock, CudaStream, HostStream
        torch, h = self.torch, self.model.hidden_size
        clock = Clock(self.cuda)
        gpu = CudaStream(clock) if self.cuda else HostStream(clock, "moesim-profile-gpu")
        pool = HostStream(clock, "moesim-profile-cpu")
        x = self._random(1, h)
        x_host = torch.zeros(1, h, dtype=self.dtype, pin_memory=self.cuda)
        times = []
        try:
            for i in range(self.timer.repeats + 1):
                gpu.synchronize()
                t0 = time.perf_counter()
                copy_in = gpu.launch(lambda: x_host.copy_(x, non_blocking=True))
                job = pool.launch(lambda: x_host.mul_(1), waits=(copy_in,))
                gpu.launch(lambda: x.add_(x_host.to(self.dev, non_blocking=True)), waits=(job,))
                gpu.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
        finally:
            pool.close()
            gpu.close()
        return statistics.median(times) * 1e6


# ----------------------------------------------------------------------------- the profile
def measurement_count(model: ModelSpec) -> int:
    """How many progress labels :func:`measure_profile` reports for ``model``."""
    return 9 if model.shared_intermediate_size not in (0, model.moe_intermediate_size) else 8


def measure_profile(config: ProfileConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every curve and number of a hardware profile v1; returns the YAML mapping."""
    import torch
    say = progress or (lambda _label: None)
    m = config.model
    host = platform.node() or "unknown-host"
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    measured = f"measured by moesim profile on {host} {date}: {config.command}"
    threads = config.cpu_threads()
    from backends.devices import fast_thread_switching
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    switching = fast_thread_switching()
    switching.__enter__()
    try:
        cpu, gpu = cpu_info(), gpu_info(config.device)
        meas = Measurements(config)
        family = cpu_kernel_family(cpu["isa"])
        shape = f"{m.name} ({m.hidden_size}x{{}} {m.expert_dtype})"

        say("GPU expert FFN")
        gpu_curves = [_expert_entry(m, m.moe_intermediate_size, meas.expert_tokens,
                                    meas.expert_curve(m.moe_intermediate_size, True), measured, shape)]
        if m.shared_intermediate_size and m.shared_intermediate_size != m.moe_intermediate_size:
            say("GPU shared experts")
            gpu_curves.append(_expert_entry(m, m.shared_intermediate_size, meas.expert_tokens,
                                            meas.expert_curve(m.shared_intermediate_size, True), measured, shape))
        say("CPU expert FFN")
        cpu_curve = _expert_entry(m, m.moe_intermediate_size, meas.expert_tokens,
                                  meas.expert_curve(m.moe_intermediate_size, False), measured, shape)
        cpu_curve.update(kernel=family, threads=threads)
        cpu_curve["source"] += f" (torch CPU matmuls on {threads} threads; kernel family from the ISA flags)"
        say("attention")
        attention = [{"model": m.name, "tokens": t, "context": c, "time_us": _round(us),
                      "source": f"{measured} (attention block with gate, {m.attention}, batch 1)"}
                     for t, c, us in meas.attention_curves()]
        say("matmul and memory ceilings")
        gpu_tflops, gpu_gbps = meas.matmul_tflops(True), meas.copy_gbps(True)
        cpu_tflops, cpu_gbps = meas.matmul_tflops(False), meas.copy_gbps(False)
        say("host-to-device copies")
        h2d_latency, h2d = meas.copy_curve(True)
        say("device-to-host copies")
        d2h_latency, d2h = meas.copy_curve(False)
        say("both directions at once")
        duplex = meas.duplex_slowdown()
        say("launch and hand-off overheads")
        launch, handoff = meas.launch_us(), meas.handoff_us()
    finally:
        switching.__exit__(None, None, None)
        torch.set_num_threads(previous)

    sizes = list(meas.copy_sizes)
    reserved = max(gpu["memory_bytes"] - gpu["free_bytes"], 0) / 2**30
    data: dict[str, Any] = {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": config.name or f"{host}-{config.device}",
        "description": (f"{gpu['name']} (driver {gpu['driver']}) + {cpu['model']} ({cpu['cores']} cores, "
                        f"ISA {' '.join(cpu['isa']) or 'none listed'}); measured {date} on {host} for "
                        f"{m.name}: {config.command}"),
        "gpu": {
            "name": gpu["name"], "memory_gib": _round(gpu["memory_bytes"] / 2**30),
            "reserved_gib": _round(reserved), "launch_us": _round(launch), "graph_launch_us": _round(launch),
            "cuda_graph": False, "peak_tflops": {"bf16": _round(gpu_tflops)},
            "mem_bandwidth_gbps": _round(gpu_gbps), "roofline_efficiency": 1.0, "bandwidth_efficiency": 1.0,
            "expert_ffn": gpu_curves, "attention": attention,
        },
        "cpu": {
            "name": cpu["model"], "cores": threads, "dram_bandwidth_gbps": _round(cpu_gbps),
            "peak_tflops": {family: _round(cpu_tflops)}, "amx_switch_tokens": 1 if family == "amx" else None,
            "roofline_efficiency": 1.0, "bandwidth_efficiency": 1.0, "expert_ffn": [cpu_curve],
        },
        "pcie": {
            "generation": _pcie_generation(config.device),
            "h2d": {"size_bytes": sizes, "gbps": _round(h2d), "source": f"{measured} (pinned host memory, "
                    "bandwidth net of pcie.latency_us)" if config.device == "cuda" else
                    f"{measured} (GPU stand-in: host memcpy, net of pcie.latency_us)"},
            "d2h": {"size_bytes": sizes, "gbps": _round(d2h), "source": f"{measured} (net of pcie.latency_us)"},
            "latency_us": _round((h2d_latency + d2h_latency) / 2), "copy_engines": 1,
            "duplex_slowdown": _round(duplex),
        },
        "sync": {"per_layer_us": _round(handoff)},
        "sources": {
            "gpu": measured, "cpu": measured, "pcie": measured, "sync": measured,
            "gpu.memory_gib": f"{measured} (torch.cuda.mem_get_info total)" if config.device == "cuda"
            else f"{measured} (/proc/meminfo MemTotal: the stand-in's memory is host memory)",
            "gpu.reserved_gib": f"{measured} (memory in use before the run)",
            "gpu.launch_us": f"{measured} (host time per small-kernel launch; expert and attention curves "
                             "already include launches: replay with engine.kernels_per_expert=0)",
            "gpu.graph_launch_us": f"{measured} (no CUDA graphs: same as launch_us)",
            "gpu.roofline_efficiency": "1.0: gpu.peak_tflops is a measured matmul ceiling",
            "gpu.bandwidth_efficiency": "1.0: gpu.mem_bandwidth_gbps is a measured copy bandwidth",
            "cpu.cores": f"{measured} (torch threads of the CPU expert pool; machine has {cpu['cores']} cores)",
            "cpu.amx_switch_tokens": f"{measured} (ISA flags {' '.join(cpu['isa'])}: one kernel family for "
                                     "every token count, as torch picks it)",
            "cpu.roofline_efficiency": "1.0: cpu.peak_tflops is a measured matmul ceiling",
            "cpu.bandwidth_efficiency": "1.0: cpu.dram_bandwidth_gbps is a measured copy bandwidth",
            "pcie.generation": f"{measured} (nvidia-smi pcie.link.gen.current)" if config.device == "cuda"
            else "1: placeholder, no PCIe link in CPU-only mode (the cost model does not read it)",
            "pcie.copy_engines": "1: the real backend issues every copy on one copy stream, one at a time",
            "pcie.duplex_slowdown": f"{measured} (H2D with a D2H of the same size at once, over H2D alone)",
            "sync.per_layer_us": f"{measured} (activations to the host, an empty CPU job, back and added)",
        },
    }
    parse_profile(data, origin=config.name or "measured profile")  # what load_profile will accept
    return data


def _expert_entry(m: ModelSpec, intermediate: int, tokens: tuple[int, ...], times: list[float], measured: str,
                  shape: str) -> dict[str, Any]:
    return {"hidden": m.hidden_size, "intermediate": intermediate, "dtype": m.expert_dtype,
            "tokens": list(tokens), "time_us": _round(times),
            "source": f"{measured} (gather, FFN and weighted scatter-add of {shape.format(intermediate)}, "
                      "launches included)"}


def _round(value: Any) -> Any:
    """Four significant digits, never zero (profile curves must be positive)."""
    if isinstance(value, list):
        return [_round(v) for v in value]
    if not value:
        return 1e-6 if isinstance(value, float) else value
    return max(float(f"{value:.4g}"), 1e-6)


def _pcie_generation(device: str) -> int:
    if device != "cuda":
        return 1
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        return int(out[0])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return 1


def write_profile(data: dict[str, Any], path: str | Path) -> Path:
    """Write the profile YAML atomically, with the machine's identity as a comment header."""
    header = "".join(f"# {line}\n" for line in ("Hardware profile measured by `moesim profile`.",
                                                 data["description"]))
    return atomic_write_text(Path(path), header + yaml.safe_dump(data, sort_keys=False, width=120))
