"""The parts of a hardware profile (moesim.hw.profile): curves, the GPU, CPU, PCIe and sync sections and
the runtimes, as the cost model (moesim.hw.cost) reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

#: CPU kernel families a CPU curve or peak may name (moesim.hw.cost picks among them)
CPU_KERNELS = ("avx512", "amx", "avx2")


@dataclass(frozen=True)
class Curve:
    """``y`` tabulated at increasing ``x`` (tokens, or bytes), with the document it came from."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    source: str


@dataclass(frozen=True)
class ExpertCurve:
    """Time (µs) of one expert FFN of a given shape vs tokens routed to it."""

    hidden: int
    intermediate: int
    dtype: str
    curve: Curve
    kernel: str = "gpu"  # "gpu", or the CPU kernel family: "avx512" | "amx"
    threads: int = 0  # CPU threads the curve was measured with (0 = the profile's cores)


@dataclass(frozen=True)
class AttentionCurve:
    """Time (µs) of one attention layer (projections, gate, SDPA) of ``model`` vs context, at ``tokens`` tokens.

    Attention cost depends on the model's dimensions, so each curve names the
    model preset it was measured or derived for; a curve without ``model``
    ("") applies to any model that has no curve of its own. ``dtype`` is the
    weight dtype it was measured in; another ``memory.non_expert_dtype`` scales
    it by the roofline ratio (moesim.hw.cost).
    """

    model: str
    tokens: int
    curve: Curve  # x = context length
    dtype: str = "bf16"


#: work at the end of a forward pass that an output curve times
OUTPUT_KINDS = ("lm_head", "sampling")


@dataclass(frozen=True)
class OutputCurve:
    """Time (µs) of the work that ends a forward pass vs sequences in the batch, for one output shape:
    ``lm_head`` (final norm and vocab x hidden projection of each sequence's last token, in ``dtype``) or
    ``sampling`` (softmax and argmax over each sequence's fp32 logits)."""

    kind: str
    hidden: int
    vocab: int
    dtype: str
    curve: Curve  # x = sequences


#: CUDA Graph use of a runtime: none; every kernel replayed from graphs (per-kernel graph_launch_us);
#: the whole decode step in one graph (one graph_launch_us per decode step, 001 Sec. 3.3)
GRAPH_MODES = ("none", "kernel", "decode_step")


@dataclass(frozen=True)
class RuntimeSpec:
    """The software a system runs on, as its costs on this machine (001_66a328d79a3cae8d.txt Sec. 2.3, 3, 6.4).

    CPU efficiencies are speed factors relative to the profile's CPU curves
    (1.0: as fast as the curves), applied by the regime the roofline says binds
    at that size: ``cpu_compute_efficiency[kernel]`` where compute binds,
    ``cpu_bandwidth_efficiency`` where DRAM bandwidth binds.
    """

    name: str
    #: host time per GPU kernel launch, µs
    launch_us: float
    graph: str = "none"
    #: GPU kernels per decoder layer besides routed and shared experts (norms, attention block, gate, residuals)
    kernels_per_layer: int = 0
    cpu_compute_efficiency: dict[str, float] = field(default_factory=dict)
    cpu_bandwidth_efficiency: float = 1.0
    #: host work per forward pass not hidden behind the GPU (graph build, scheduling), µs
    host_us_per_step: float = 0.0

    def cpu_compute(self, kernel: str) -> float:
        return self.cpu_compute_efficiency.get(kernel, 1.0)


class _Roofline:
    """The roofline fallback's efficiencies, shared by the GPU and the CPU sections."""

    roofline_efficiency: float
    bandwidth_efficiency: float | None

    @property
    def effective_bandwidth_efficiency(self) -> float:
        return self.roofline_efficiency if self.bandwidth_efficiency is None else self.bandwidth_efficiency


@dataclass(frozen=True)
class GPUSpec(_Roofline):
    name: str
    memory_gib: float
    reserved_gib: float
    launch_us: float
    graph_launch_us: float
    cuda_graph: bool
    peak_tflops: dict[str, float]
    mem_bandwidth_gbps: float
    expert_ffn: tuple[ExpertCurve, ...] = ()
    attention: tuple[AttentionCurve, ...] = ()
    output: tuple[OutputCurve, ...] = ()
    #: achievable fraction of ``peak_tflops`` for the roofline fallback
    roofline_efficiency: float = 0.6
    #: achievable fraction of ``mem_bandwidth_gbps`` (None: same as roofline_efficiency)
    bandwidth_efficiency: float | None = None
    #: non-expert GPU kernels per decoder layer under the generic runtime (see RuntimeSpec)
    kernels_per_layer: int = 0


@dataclass(frozen=True)
class CPUSpec(_Roofline):
    name: str
    cores: int
    dram_bandwidth_gbps: float
    peak_tflops: dict[str, float]  # per kernel family: avx512, amx
    amx_switch_tokens: int | None  # tokens per expert from which AMX is used; None = no AMX
    expert_ffn: tuple[ExpertCurve, ...] = ()
    numa_note: str = ""
    #: achievable DRAM bandwidth when CPU kernels and H2D copies read host memory at once (None: the
    #: CPU's own achievable bandwidth, dram_bandwidth_gbps x bandwidth efficiency)
    dram_combined_gbps: float | None = None
    #: achievable fraction of ``peak_tflops`` (1.0 when the peaks are measured kernel ceilings)
    roofline_efficiency: float = 0.5
    #: achievable fraction of ``dram_bandwidth_gbps`` (None: same as roofline_efficiency)
    bandwidth_efficiency: float | None = None


@dataclass(frozen=True)
class PCIeSpec:
    generation: int
    h2d: Curve  # x = bytes, y = GB/s
    d2h: Curve
    latency_us: float
    copy_engines: int
    #: bandwidth factor when H2D and D2H run at once
    duplex_slowdown: float
    bandwidth_scale: float = 1.0


@dataclass(frozen=True)
class SyncSpec:
    per_layer_us: float  # CPU-GPU submit + synchronize when a layer hands work to the CPU
