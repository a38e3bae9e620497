"""``moesim profile``: measure a hardware profile v1 on the machine at hand.

Every curve the cost model reads is measured for one or more model shapes:
expert FFN time vs tokens on the GPU (routed and, where it differs, shared
shape) and on the CPU pool, attention (with the gate) vs context at a few
token counts, host-to-device and device-to-host bandwidth vs transfer size
from pinned memory, the slowdown when both directions run at once,
kernel-launch and CPU-GPU hand-off overheads, plus the matmul and
memory-bandwidth ceilings the roofline fallback uses. The kernels timed are
the real backend's own (:mod:`backends.kernels`, :mod:`backends.devices`),
under the same thread set-up (:func:`backends.devices.host_threads`), so a
measured profile describes exactly what ``moesim validate --real`` executes.

Measurement hygiene, so that profiles repeat: buffers are allocated once and
touched before timing (no page faults inside a sample), every point is
warmed up before it is timed and reported as the median of many samples,
and expert weights rotate over a pool larger than the last-level cache
(the real run reads each expert's weights from memory, not from cache).

Expert and attention curves are timed from the first launch to the end of
the last kernel, so kernel-launch time is inside them: replay with a measured
profile as ``moesim validate`` does, with ``engine.kernels_per_expert=0`` and
``engine.kernels_per_shared=0``, or launches count twice.

With ``device="cpu"`` the GPU stand-in is measured (a host thread, host
memory, plain memcpy between two host buffers for the "PCIe" curves); its
"GPU" expert curves are then the CPU pool's, the same kernels on the same
threads, measured once.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
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
#: expert weights timed in rotation over at least this many bytes (at most MAX_ROTATION buffers): more
#: than the last-level cache of the CPUs and GPUs at hand (32 MiB L3 here, 50 MB L2 on an H100), as in a real run
ROTATION_BYTES = 256 * MIB
MAX_ROTATION = 64


@dataclass
class ProfileConfig:
    #: the model shapes whose expert and attention curves are measured (one profile serves them all)
    models: tuple[ModelSpec, ...]
    device: str = "cuda"
    #: torch threads of the CPU expert pool (0: every CPU this process may use)
    threads: int = 0
    #: timed repetitions per point at least (median taken), after the warm-up
    repeats: int = 7
    #: the command line, recorded in every source
    command: str = "moesim profile"
    #: fewer points and repetitions (tests, quick looks)
    quick: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.models, ModelSpec):
            self.models = (self.models,)
        self.models = tuple(self.models)

    def cpu_threads(self) -> int:
        from backends.devices import allowed_cpus
        return self.threads or len(allowed_cpus())


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


def _memory_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        return out[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_info(device: str) -> dict[str, Any]:
    import torch
    if device != "cuda":
        return {"name": "GPU stand-in on the host CPU", "driver": "none", "memory_bytes":
                (_memory_kib("MemTotal") or 0) * 1024, "free_bytes": (_memory_kib("MemAvailable") or 0) * 1024,
                "pcie_generation": 1}
    free, total = torch.cuda.mem_get_info()
    generation = _nvidia_smi("pcie.link.gen.current")
    return {"name": torch.cuda.get_device_name(), "driver": _nvidia_smi("driver_version") or "unknown",
            "memory_bytes": total, "free_bytes": free, "cuda": torch.version.cuda,
            "pcie_generation": int(generation) if generation and generation.isdigit() else 1}


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median seconds of a callable on the measured device (CUDA events, or host clock for the stand-in).

    Untimed warm-up calls first (kernel selection, allocator, caches), at
    least two and :attr:`WARMUP_S` worth; then at least ``repeats`` timed
    calls and more, up to :attr:`MAX_CALLS` or :attr:`MAX_POINT_S`, until
    :attr:`MIN_TOTAL_S` of samples are in: short kernels get many samples, so
    one interrupted call on a busy machine does not become the curve.

    Host samples also read the calling thread's CPU time, which keeps the
    time slices of other processes (on a machine shared with other work)
    out of the curves. With one torch thread the whole call runs on the
    calling thread, and its CPU time is the sample. With several, a sample
    whose thread was descheduled for a while (CPU time under
    :attr:`UNDISTURBED` of the wall time) is set aside, and the median is
    taken over the undisturbed samples while there are ``repeats`` of them.
    """

    WARMUP_S = 0.01
    MIN_TOTAL_S = 0.1
    MAX_CALLS = 400
    MAX_POINT_S = 0.5
    UNDISTURBED = 0.9

    def __init__(self, device: str, repeats: int) -> None:
        import torch
        self.cuda = device == "cuda"
        self.repeats = repeats
        self.torch = torch

    def _sample(self, once: Callable[[], tuple[float, bool]]) -> float:
        warm = once()[0] + once()[0]
        calls = 2
        while warm < self.WARMUP_S and calls < self.MAX_CALLS:
            warm += once()[0]
            calls += 1
        clean: list[float] = []
        disturbed: list[float] = []
        started = time.perf_counter()
        while True:
            seconds, undisturbed = once()
            (clean if undisturbed else disturbed).append(seconds)
            total = sum(clean)
            calls = len(clean) + len(disturbed)
            enough = len(clean) >= self.repeats and (total >= self.MIN_TOTAL_S or len(clean) >= self.MAX_CALLS)
            out_of_time = calls >= self.MAX_CALLS or time.perf_counter() - started > self.MAX_POINT_S
            if enough or (out_of_time and calls >= self.repeats):
                break
        return statistics.median(clean if len(clean) >= self.repeats else clean + disturbed)

    def device(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            return self.host(fn)
        torch = self.torch

        def once() -> tuple[float, bool]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, True
        return self._sample(once)

    def host(self, fn: Callable[[], Any]) -> float:
        single = self.torch.get_num_threads() == 1

        def once() -> tuple[float, bool]:
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if single:  # all the work ran on this thread: its CPU time is the time it took while it had a core
                return cpu, True
            return wall, cpu >= self.UNDISTURBED * wall
        return self._sample(once)


# ----------------------------------------------------------------------------- measurements
class Measurements:
    """Each method measures one curve or number of the machine; shapes are passed in."""

    def __init__(self, config: ProfileConfig) -> None:
        import torch

        from backends.kernels import torch_dtype
        self.torch = torch
        self.config = config
        self.cuda = config.device == "cuda"
        self.dev = torch.device(config.device)
        self.dtype = torch_dtype(config.models[0].expert_dtype)
        self.timer = Timer(config.device, 3 if config.quick else config.repeats)
        self.generator = torch.Generator().manual_seed(0)
        q = config.quick
        self.expert_tokens = (1, 4, 16, 64) if q else EXPERT_TOKENS
        self.attention_tokens = (1, 16) if q else ATTENTION_TOKENS
        self.contexts = (128, 512) if q else CONTEXTS
        self.rotation_bytes = (16 if q else 256) * MIB
        self.copy_sizes = tuple(sorted({*((4 * KIB, 64 * KIB, MIB) if q else COPY_SIZES),
                                        *(m.expert_bytes() for m in config.models)}))

    def _random(self, *shape: int, device: Any = None):
        from backends.kernels import random_fill
        t = self.torch.empty(*shape, dtype=self.dtype, device=device or self.dev)
        return random_fill(t, self.generator)

    def _bytes(self, nbytes: int, *, on_device: bool):
        """A pre-faulted byte buffer: host (pinned for CUDA) or on the measured device."""
        torch = self.torch
        if on_device:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return buffer.fill_(1)

    # -- compute -------------------------------------------------------------------
    def expert_curve(self, model: ModelSpec, intermediate: int, on_gpu: bool) -> list[float]:
        """µs per expert call (gather, FFN, weighted scatter-add) vs tokens, as the backend runs it.

        Each call takes the next of a pool of weight buffers of more than
        ``rotation_bytes`` in all, so weights come from memory as in a real run.
        """
        from backends.kernels import expert_params, ffn
        torch, m = self.torch, model
        device = self.dev if on_gpu else torch.device("cpu")
        params = expert_params(m, intermediate)
        pool = self.rotation(params)
        weights = self._random(pool, params, device=device)
        turn = [0]
        out = []
        for tokens in self.expert_tokens:
            x = self._random(tokens, m.hidden_size, device=device)
            acc = torch.zeros_like(x)
            rows = torch.arange(tokens, device=device)
            gate = torch.ones(tokens, 1, dtype=self.dtype, device=device)

            def call() -> None:
                w = weights[turn[0] % pool]
                turn[0] += 1
                y = ffn(w, x.index_select(0, rows), m.hidden_size, intermediate, m.expert_matrices)
                acc.index_add_(0, rows, y * gate)
            seconds = self.timer.device(call) if on_gpu else self.timer.host(call)
            out.append(seconds * 1e6)
        return out

    def rotation(self, params: int) -> int:
        """How many weight buffers an expert curve of ``params`` parameters rotates over."""
        return min(max(math.ceil(self.rotation_bytes / (params * self.dtype.itemsize)), 1), MAX_ROTATION)

    def rotation_note(self, model: ModelSpec, intermediate: int) -> str:
        from backends.kernels import expert_params
        params = expert_params(model, intermediate)
        pool = self.rotation(params)
        return f"weights rotating over {pool} buffers, {pool * params * self.dtype.itemsize / MIB:.1f} MiB"

    def attention_curves(self, model: ModelSpec) -> list[tuple[int, list[int], list[float]]]:
        """(tokens, contexts, µs) for one attention block with its gate, as the backend runs it."""
        from backends.kernels import Attention, Batch
        curves = []
        block = Attention(model, self.dtype, self.dev, 1, max(self.contexts), self.generator)
        for tokens in self.attention_tokens:
            contexts = [c for c in self.contexts if c >= tokens]
            x = self._random(tokens, model.hidden_size)
            times = [self.timer.device(lambda c=c: block(x, Batch(1, tokens, c))) * 1e6 for c in contexts]
            curves.append((tokens, contexts, times))
        return curves

    def matmul_tflops(self, on_gpu: bool) -> float:
        """A bf16 matmul ceiling: 8192^3 on a CUDA GPU, 1024^3 on a CPU (large enough to be compute-bound)."""
        torch = self.torch
        gpu = on_gpu and self.cuda
        n = 8192 if gpu and not self.config.quick else 1024
        device = self.dev if gpu else torch.device("cpu")
        a, b = self._random(n, n, device=device), self._random(n, n, device=device)
        seconds = (self.timer.device if gpu else self.timer.host)(lambda: a @ b)
        return 2 * n**3 / seconds / 1e12

    def copy_gbps(self, on_gpu: bool) -> float:
        """Memory bandwidth of a large device-local (or host) copy, read plus write."""
        gpu = on_gpu and self.cuda
        nbytes = (64 if self.config.quick else 1024 if gpu else 256) * MIB
        src, dst = self._bytes(nbytes, on_device=gpu), self._bytes(nbytes, on_device=gpu)
        seconds = (self.timer.device if gpu else self.timer.host)(lambda: dst.copy_(src))
        return 2 * nbytes / seconds / 1e9

    # -- transfers -------------------------------------------------------------------
    def _copy_time(self, dst, src) -> float:
        if self.cuda:
            return self.timer.device(lambda: dst.copy_(src, non_blocking=True))
        return self.timer.host(lambda: dst.copy_(src))

    def copy_curve(self, to_device: bool) -> tuple[float, list[float]]:
        """(latency µs, GB/s vs size) such that latency + bytes / bandwidth(size) is the measured time."""
        largest = max(self.copy_sizes)
        host, dev = self._bytes(largest, on_device=False), self._bytes(largest, on_device=True)

        def seconds(size: int) -> float:
            h, d = host[:size], dev[:size]
            return self._copy_time(d, h) if to_device else self._copy_time(h, d)
        latency = seconds(4)
        gbps = []
        for size in self.copy_sizes:
            took = seconds(size)
            payload = max(took - latency, 0.05 * took)  # the rest is per-copy latency
            gbps.append(size / payload / 1e9)
        return latency * 1e6, gbps

    def duplex_slowdown(self) -> float:
        """H2D bandwidth while a D2H copy of the same size runs at once, over H2D alone."""
        torch = self.torch
        size = max(self.copy_sizes)
        h_src, d_dst = self._bytes(size, on_device=False), self._bytes(size, on_device=True)
        h_dst, d_src = self._bytes(size, on_device=False), self._bytes(size, on_device=True)
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
        samples = []
        for _ in range(self.timer.repeats + 1):
            if self.cuda:
                x = torch.zeros(16, device=self.dev)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    x.add_(1)
                samples.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            else:
                from backends.devices import Clock, HostStream
                stream = HostStream(Clock(False), "moesim-profile")
                try:
                    stream.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        stream.launch(lambda: None)
                    stream.synchronize()
                    samples.append(time.perf_counter() - t0)
                finally:
                    stream.close()
        return statistics.median(samples[1:]) / n * 1e6

    def handoff_us(self, hidden: int) -> float:
        """One CPU-expert hand-off as the backend does it: activations to the host, the pool, result back, added."""
        from backends.devices import Clock, CudaStream, HostStream
        torch = self.torch
        clock = Clock(self.cuda)
        gpu = CudaStream(clock) if self.cuda else HostStream(clock, "moesim-profile-gpu")
        pool = HostStream(clock, "moesim-profile-cpu")
        x = self._random(1, hidden)
        x_host = torch.zeros(1, hidden, dtype=self.dtype, pin_memory=self.cuda)
        times = []
        try:
            for i in range(max(self.timer.repeats, 20) + 3):
                gpu.synchronize()
                t0 = time.perf_counter()
                copy_in = gpu.launch(lambda: x_host.copy_(x, non_blocking=True))
                job = pool.launch(lambda: x_host.mul_(1), waits=(copy_in,))
                gpu.launch(lambda: x.add_(x_host.to(self.dev, non_blocking=True)), waits=(job,))
                gpu.synchronize()
                if i >= 3:  # warm-up: threads started, caches filled
                    times.append(time.perf_counter() - t0)
        finally:
            pool.close()
            gpu.close()
        return statistics.median(times) * 1e6


# ----------------------------------------------------------------------------- what was measured
@dataclass
class ExpertMeasure:
    model: ModelSpec
    intermediate: int
    tokens: list[int]
    time_us: list[float]
    #: how the curve was obtained, beyond the common source text
    note: str = ""


@dataclass
class Measured:
    """Every number one profiling run measured, with the machine's identity: the input of :func:`profile_document`."""

    config: ProfileConfig
    host: str
    date: str
    cpu: dict[str, Any]
    gpu: dict[str, Any]
    threads: int
    gpu_experts: list[ExpertMeasure] = field(default_factory=list)
    cpu_experts: list[ExpertMeasure] = field(default_factory=list)
    #: (model name, attention kind, tokens, contexts, µs)
    attention: list[tuple[str, str, int, list[int], list[float]]] = field(default_factory=list)
    gpu_tflops: float = 0.0
    gpu_gbps: float = 0.0
    cpu_tflops: float = 0.0
    cpu_gbps: float = 0.0
    copy_sizes: list[int] = field(default_factory=list)
    h2d_latency_us: float = 0.0
    h2d_gbps: list[float] = field(default_factory=list)
    d2h_latency_us: float = 0.0
    d2h_gbps: list[float] = field(default_factory=list)
    duplex: float = 1.0
    launch_us: float = 0.0
    handoff_us: float = 0.0

    @property
    def family(self) -> str:
        return cpu_kernel_family(self.cpu["isa"])

    @property
    def source(self) -> str:
        return f"measured by moesim profile on {self.host} {self.date}: {self.config.command}"


def _shapes(config: ProfileConfig) -> list[tuple[ModelSpec, int, str]]:
    """(model, intermediate, label) of every distinct GPU FFN shape: routed experts, then shared ones."""
    seen, out = set(), []
    for m in config.models:
        for intermediate, kind in ((m.moe_intermediate_size, "experts"), (m.shared_intermediate_size, "shared")):
            key = (m.hidden_size, intermediate, m.expert_matrices)
            if intermediate and key not in seen:
                seen.add(key)
                out.append((m, intermediate, f"{kind} {m.name} {m.hidden_size}x{intermediate}"))
    return out


def _routed_shapes(config: ProfileConfig) -> list[ModelSpec]:
    seen, out = set(), []
    for m in config.models:
        key = (m.hidden_size, m.moe_intermediate_size, m.expert_matrices)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def measurement_labels(config: ProfileConfig) -> list[str]:
    """The progress labels :func:`measure` reports, in order."""
    labels = [f"CPU expert FFN {m.name}" for m in _routed_shapes(config)]
    if config.device == "cuda":
        labels += [f"GPU {label}" for _, _, label in _shapes(config)]
    else:  # the stand-in's routed curve is the CPU pool's; only other (shared) shapes are timed again
        routed = {(m.hidden_size, m.moe_intermediate_size, m.expert_matrices) for m in config.models}
        labels += [f"GPU stand-in {label}" for m, i, label in _shapes(config)
                   if (m.hidden_size, i, m.expert_matrices) not in routed]
    labels += [f"attention {m.name}" for m in config.models]
    return labels + ["matmul and memory ceilings", "host-to-device copies", "device-to-host copies",
                     "both directions at once", "launch and hand-off overheads"]


def measure(config: ProfileConfig, progress: Callable[[str], None] | None = None) -> Measured:
    """Measure every curve and number of a hardware profile v1 on this machine."""
    from backends.devices import host_threads
    say = progress or (lambda _label: None)
    threads = config.cpu_threads()
    out = Measured(config=config, host=platform.node() or "unknown-host",
                   date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"), cpu=cpu_info(),
                   gpu=gpu_info(config.device), threads=threads)
    with host_threads(threads):
        meas = Measurements(config)
        for m in _routed_shapes(config):
            say(f"CPU expert FFN {m.name}")
            out.cpu_experts.append(ExpertMeasure(m, m.moe_intermediate_size, list(meas.expert_tokens),
                                                 meas.expert_curve(m, m.moe_intermediate_size, False),
                                                 meas.rotation_note(m, m.moe_intermediate_size)))
        cpu_by_shape = {(e.model.hidden_size, e.intermediate, e.model.expert_matrices): e for e in out.cpu_experts}
        for m, intermediate, label in _shapes(config):
            same = cpu_by_shape.get((m.hidden_size, intermediate, m.expert_matrices))
            if not meas.cuda and same is not None:
                out.gpu_experts.append(ExpertMeasure(m, intermediate, same.tokens, same.time_us,
                                                     f"{same.note}; GPU stand-in: the CPU pool's curve, same "
                                                     "kernels and threads"))
                continue
            say(f"GPU stand-in {label}" if not meas.cuda else f"GPU {label}")
            out.gpu_experts.append(ExpertMeasure(m, intermediate, list(meas.expert_tokens),
                                                 meas.expert_curve(m, intermediate, True),
                                                 meas.rotation_note(m, intermediate)))
        for m in config.models:
            say(f"attention {m.name}")
            out.attention += [(m.name, m.attention, t, c, us) for t, c, us in meas.attention_curves(m)]
        say("matmul and memory ceilings")
        out.cpu_tflops, out.cpu_gbps = meas.matmul_tflops(False), meas.copy_gbps(False)
        if meas.cuda:
            out.gpu_tflops, out.gpu_gbps = meas.matmul_tflops(True), meas.copy_gbps(True)
        else:  # the stand-in's ceilings are the host's
            out.gpu_tflops, out.gpu_gbps = out.cpu_tflops, out.cpu_gbps
        out.copy_sizes = list(meas.copy_sizes)
        say("host-to-device copies")
        out.h2d_latency_us, out.h2d_gbps = meas.copy_curve(True)
        say("device-to-host copies")
        out.d2h_latency_us, out.d2h_gbps = meas.copy_curve(False)
        say("both directions at once")
        out.duplex = meas.duplex_slowdown()
        say("launch and hand-off overheads")
        out.launch_us = meas.launch_us()
        out.handoff_us = meas.handoff_us(max(m.hidden_size for m in config.models))
    return out


# ----------------------------------------------------------------------------- the profile document
def profile_document(x: Measured) -> dict[str, Any]:
    """The hardware profile v1 mapping of a measurement: the one place that lays out the YAML.

    A new schema field is one more entry here (with its ``sources`` line) and,
    where it is measured, one more field of :class:`Measured`.
    """
    config, cpu, gpu, measured, family = x.config, x.cpu, x.gpu, x.source, x.family
    cuda = config.device == "cuda"
    names = ", ".join(m.name for m in config.models)
    reserved = max(gpu["memory_bytes"] - gpu["free_bytes"], 0) / 2**30
    cpu_curves = [_expert_entry(e, measured) | {"kernel": family, "threads": x.threads} for e in x.cpu_experts]
    for curve in cpu_curves:
        curve["source"] += f" (torch CPU matmuls on {x.threads} threads; kernel family from the ISA flags)"
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": config.name or f"{x.host}-{config.device}",
        "description": (f"{gpu['name']} (driver {gpu['driver']}) + {cpu['model']} ({cpu['cores']} cores, "
                        f"ISA {' '.join(cpu['isa']) or 'none listed'}); measured {x.date} on {x.host} for "
                        f"{names}: {config.command}"),
        "gpu": {
            "name": gpu["name"], "memory_gib": _round(gpu["memory_bytes"] / 2**30),
            "reserved_gib": _round(reserved), "launch_us": _round(x.launch_us), "graph_launch_us": _round(x.launch_us),
            "cuda_graph": False, "peak_tflops": {"bf16": _round(x.gpu_tflops)},
            "mem_bandwidth_gbps": _round(x.gpu_gbps), "roofline_efficiency": 1.0, "bandwidth_efficiency": 1.0,
            "expert_ffn": [_expert_entry(e, measured) for e in x.gpu_experts],
            "attention": [{"model": model, "tokens": t, "context": c, "time_us": _round(us),
                           "source": f"{measured} (attention block with gate, {kind}, batch 1)"}
                          for model, kind, t, c, us in x.attention],
        },
        "cpu": {
            "name": cpu["model"], "cores": x.threads, "dram_bandwidth_gbps": _round(x.cpu_gbps),
            "peak_tflops": {family: _round(x.cpu_tflops)}, "amx_switch_tokens": 1 if family == "amx" else None,
            "roofline_efficiency": 1.0, "bandwidth_efficiency": 1.0, "expert_ffn": cpu_curves,
        },
        "pcie": {
            "generation": gpu["pcie_generation"],
            "h2d": {"size_bytes": x.copy_sizes, "gbps": _round(x.h2d_gbps),
                    "source": f"{measured} (pinned host memory, bandwidth net of pcie.latency_us)" if cuda else
                    f"{measured} (GPU stand-in: host memcpy, net of pcie.latency_us)"},
            "d2h": {"size_bytes": x.copy_sizes, "gbps": _round(x.d2h_gbps),
                    "source": f"{measured} (net of pcie.latency_us)"},
            "latency_us": _round((x.h2d_latency_us + x.d2h_latency_us) / 2), "copy_engines": 1,
            "duplex_slowdown": _round(x.duplex),
        },
        "sync": {"per_layer_us": _round(x.handoff_us)},
        "sources": {
            "gpu": measured, "cpu": measured, "pcie": measured, "sync": measured,
            "gpu.memory_gib": f"{measured} (torch.cuda.mem_get_info total)" if cuda
            else f"{measured} (/proc/meminfo MemTotal: the stand-in's memory is host memory)",
            "gpu.reserved_gib": f"{measured} (memory in use before the run)",
            "gpu.launch_us": f"{measured} (host time per small-kernel launch; expert and attention curves "
                             "already include launches: replay with engine.kernels_per_expert=0)",
            "gpu.graph_launch_us": f"{measured} (no CUDA graphs: same as launch_us)",
            "gpu.peak_tflops": f"{measured} (bf16 matmul, 8192^3)" if cuda and not config.quick
            else f"{measured} (bf16 matmul, 1024^3{'' if cuda else ', on the host: the stand-in is the CPU'})",
            "gpu.roofline_efficiency": "1.0: gpu.peak_tflops is a measured matmul ceiling",
            "gpu.bandwidth_efficiency": "1.0: gpu.mem_bandwidth_gbps is a measured copy bandwidth",
            "cpu.cores": f"{measured} (torch threads of the CPU expert pool; machine has {cpu['cores']} cores)",
            "cpu.amx_switch_tokens": f"{measured} (ISA flags {' '.join(cpu['isa'])}: one kernel family for "
                                     "every token count, as torch picks it)",
            "cpu.roofline_efficiency": "1.0: cpu.peak_tflops is a measured matmul ceiling",
            "cpu.bandwidth_efficiency": "1.0: cpu.dram_bandwidth_gbps is a measured copy bandwidth",
            "pcie.generation": f"{measured} (nvidia-smi pcie.link.gen.current)" if cuda
            else "1: placeholder, no PCIe link in CPU-only mode (the cost model does not read it)",
            "pcie.copy_engines": "1: the real backend issues every copy on one copy stream, one at a time",
            "pcie.duplex_slowdown": f"{measured} (H2D with a D2H of the same size at once, over H2D alone)",
            "sync.per_layer_us": f"{measured} (activations to the host, an empty CPU job, back and added)",
        },
    }


def measure_profile(config: ProfileConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every curve and number of a hardware profile v1; returns the YAML mapping."""
    data = profile_document(measure(config, progress))
    parse_profile(data, origin=config.name or "measured profile")  # what load_profile will accept
    return data


def _expert_entry(e: ExpertMeasure, measured: str) -> dict[str, Any]:
    m = e.model
    shape = f"{m.name} ({m.hidden_size}x{e.intermediate} {m.expert_dtype})"
    note = f"; {e.note}" if e.note else ""
    return {"hidden": m.hidden_size, "intermediate": e.intermediate, "dtype": m.expert_dtype,
            "tokens": list(e.tokens), "time_us": _round(list(e.time_us)),
            "source": f"{measured} (gather, FFN and weighted scatter-add of {shape}, launches included{note})"}


def _round(value: Any) -> Any:
    """Four significant digits, never zero (profile curves must be positive)."""
    if isinstance(value, list):
        return [_round(v) for v in value]
    if not value:
        return 1e-6 if isinstance(value, float) else value
    return max(float(f"{value:.4g}"), 1e-6)


def write_profile(data: dict[str, Any], path: str | Path) -> Path:
    """Write the profile YAML atomically, with the machine's identity as a comment header."""
    header = "".join(f"# {line}\n" for line in ("Hardware profile measured by `moesim profile`.",
                                                 data["description"]))
    return atomic_write_text(Path(path), header + yaml.safe_dump(data, sort_keys=False, width=120))
