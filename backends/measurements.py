"""The measurements behind ``moesim profile``: machine identity, a careful timer, and one method per curve.

Every method times the real backend's own kernels (:mod:`backends.kernels`)
and streams (:mod:`backends.devices`) the way the backend runs them; the
profile is assembled from the results in :mod:`backends.profiler`.
Measurement hygiene, so that profiles repeat: buffers are allocated once and
touched before timing, every point is warmed up and reported as a median,
and expert weights rotate over a pool larger than the last-level cache.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moesim.model.spec import ModelSpec

if TYPE_CHECKING:
    from backends.profiler import ProfileConfig

KIB, MIB = 2**10, 2**20
EXPERT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ATTENTION_TOKENS = (1, 16, 128)
CONTEXTS = (128, 512, 2048, 8192)
OUTPUT_SEQUENCES = (1, 4, 16, 64)
COPY_SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 128 * MIB)
#: expert weights timed in rotation over at least this many bytes (at most MAX_ROTATION buffers): more
#: than the last-level cache of the CPUs and GPUs at hand (32 MiB L3 here, 50 MB L2 on an H100), as in a real run
ROTATION_BYTES = 256 * MIB
MAX_ROTATION = 64



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


#: ``gpu.name`` of a profile measured with ``--device cpu``: how validate tells a profile of the stand-in
STAND_IN_GPU_NAME = "GPU stand-in on the host CPU"


def gpu_info(device: str) -> dict[str, Any]:
    import torch
    if device != "cuda":
        return {"name": STAND_IN_GPU_NAME, "driver": "none", "memory_bytes":
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

    @contextmanager
    def patient(self, factor: int) -> Iterator[None]:
        """Within the block, ``factor`` times the samples and time per point (a point measured again)."""
        saved = self.repeats, self.MIN_TOTAL_S, self.MAX_CALLS, self.MAX_POINT_S
        self.repeats, self.MIN_TOTAL_S = saved[0] * factor, saved[1] * factor
        self.MAX_CALLS, self.MAX_POINT_S = saved[2] * factor, saved[3] * factor
        try:
            yield
        finally:
            self.repeats, self.MIN_TOTAL_S, self.MAX_CALLS, self.MAX_POINT_S = saved

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
@dataclass
class Series:
    """One measured curve: ``values[i]`` at ``xs[i]``, and ``again(i)``, which measures point ``i`` afresh
    (same buffers, same unit) while the curve's buffers are still held."""

    xs: list[int]
    values: list[float]
    again: Callable[[int], float]

    @classmethod
    def measured(cls, xs: list[int], point: Callable[[int], float]) -> Series:
        return cls(list(xs), [point(i) for i in range(len(xs))], point)


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
        self.output_sequences = (1, 4) if q else OUTPUT_SEQUENCES
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
    def expert_curve(self, model: ModelSpec, intermediate: int, on_gpu: bool) -> Series:
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

        def point(i: int) -> float:
            tokens = self.expert_tokens[i]
            x = self._random(tokens, m.hidden_size, device=device)
            acc = torch.zeros_like(x)
            rows = torch.arange(tokens, device=device)
            gate = torch.ones(tokens, 1, dtype=self.dtype, device=device)

            def call() -> None:
                w = weights[turn[0] % pool]
                turn[0] += 1
                y = ffn(w, x.index_select(0, rows), m.hidden_size, intermediate, m.expert_matrices)
                acc.index_add_(0, rows, y * gate)
            return (self.timer.device(call) if on_gpu else self.timer.host(call)) * 1e6
        return Series.measured(list(self.expert_tokens), point)

    def rotation(self, params: int) -> int:
        """How many weight buffers an expert curve of ``params`` parameters rotates over."""
        return min(max(math.ceil(self.rotation_bytes / (params * self.dtype.itemsize)), 1), MAX_ROTATION)

    def rotation_note(self, model: ModelSpec, intermediate: int) -> str:
        from backends.kernels import expert_params
        params = expert_params(model, intermediate)
        pool = self.rotation(params)
        return f"weights rotating over {pool} buffers, {pool * params * self.dtype.itemsize / MIB:.1f} MiB"

    def attention_curves(self, model: ModelSpec) -> list[tuple[int, Series]]:
        """(tokens, µs vs context) for one attention block with its gate, as the backend runs it.

        Calls rotate over blocks (weights and KV cache each) of more than ``rotation_bytes`` in all: a real
        run reads every layer's block from memory, not from a cache the previous call left warm.
        """
        from backends.kernels import Attention, Batch

        def block() -> Attention:
            return Attention(model, self.dtype, self.dev, 1, max(self.contexts), self.generator)
        first = block()
        blocks = [first] + [block() for _ in range(self.rotation(first.nbytes // self.dtype.itemsize) - 1)]
        turn = [0]

        def call(x, batch: Batch) -> None:
            blocks[turn[0] % len(blocks)](x, batch)
            turn[0] += 1
        curves = []
        for tokens in self.attention_tokens:
            contexts = [c for c in self.contexts if c >= tokens]
            x = self._random(tokens, model.hidden_size)

            def point(i: int, x=x, tokens=tokens, contexts=contexts) -> float:
                return self.timer.device(lambda: call(x, Batch(1, tokens, contexts[i]))) * 1e6
            curves.append((tokens, Series.measured(contexts, point)))
        return curves

    def output_curves(self, model: ModelSpec) -> tuple[Series, Series]:
        """µs of the LM head (final norm, projection of each sequence's last token) and of the token choice
        (softmax, argmax) vs sequences, as the backend ends each step."""
        from backends.kernels import LMHead
        torch = self.torch
        head = LMHead(model, self.dtype, self.dev, self.generator)
        inputs = []
        for sequences in self.output_sequences:
            h = self._random(sequences, model.hidden_size)
            rows = torch.arange(sequences, device=self.dev)
            inputs.append((h, rows, head.logits(h, rows)))

        def lm_head(i: int) -> float:
            h, rows, _ = inputs[i]
            return self.timer.device(lambda: head.logits(h, rows)) * 1e6

        def sampling(i: int) -> float:
            return self.timer.device(lambda: head.sample(inputs[i][2])) * 1e6
        return (Series.measured(list(self.output_sequences), lm_head),
                Series.measured(list(self.output_sequences), sampling))

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

    def copy_curve(self, to_device: bool) -> tuple[float, Series]:
        """(latency µs, GB/s vs size) such that latency + bytes / bandwidth(size) is the measured time; a size
        measured again keeps the latency measured first."""
        largest = max(self.copy_sizes)
        host, dev = self._bytes(largest, on_device=False), self._bytes(largest, on_device=True)

        def seconds(size: int) -> float:
            h, d = host[:size], dev[:size]
            return self._copy_time(d, h) if to_device else self._copy_time(h, d)
        latency = seconds(4)

        def gbps(i: int) -> float:
            size = self.copy_sizes[i]
            took = seconds(size)
            payload = max(took - latency, 0.05 * took)  # the rest is per-copy latency
            return size / payload / 1e9
        return latency * 1e6, Series.measured(list(self.copy_sizes), gbps)

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
