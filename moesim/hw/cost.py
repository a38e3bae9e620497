"""Cost model: durations (seconds) of the engine's operations for one model on one profile.

Curves are interpolated log-log between tabulated points. Below the first
point the first value holds (a kernel never gets faster than at its smallest
size); above the last, time grows in proportion to tokens (the compute-bound
regime). When a profile has no curve for a shape, a roofline
``max(flops / (peak * eff), bytes / (bandwidth * bw_eff))`` stands in, and the
shape is added to :attr:`CostModel.fallbacks` so reports can say so. The
shipped profiles' derived curves are tabulations of exactly this roofline, so
a curve and the fallback never disagree (tests/hw/test_profile.py checks it).

CPU kernels: AMX from ``cpu.amx_switch_tokens`` tokens per expert up, the
CPU's vector family (AVX-512, or AVX2 where the CPU has no AVX-512) below it
(001_66a328d79a3cae8d.txt Sec. 3.2).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

from moesim.hw.profile import Curve, ExpertCurve, HardwareProfile
from moesim.model.spec import DTYPE_BITS, ModelSpec, scale_bytes_per_param

US = 1e-6


def interp_loglog(curve: Curve, x: float, *, extrapolate_linear: bool = True) -> float:
    """``y`` at ``x``: log-log between points, first value below, proportional (or flat) above."""
    xs, ys = curve.x, curve.y
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * (x / xs[-1]) if extrapolate_linear else ys[-1]
    i = bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def bytes_per_param(dtype: str, group_size: int = 128) -> float:
    """Weight bytes per parameter in ``dtype``, quantisation scales included (as ModelSpec.expert_bytes)."""
    return DTYPE_BITS[dtype] / 8 + scale_bytes_per_param(dtype, group_size)


def roofline_s(flops: float, nbytes: float, tflops: float, compute_eff: float,
               gbps: float, bandwidth_eff: float) -> float:
    """Seconds for ``flops`` and ``nbytes`` on a device with the given peaks and achievable fractions."""
    return max(flops / (tflops * 1e12 * compute_eff), nbytes / (gbps * 1e9 * bandwidth_eff))


@dataclass
class CostModel:
    """Per-operation durations in seconds, memoised by token count."""

    profile: HardwareProfile
    model: ModelSpec
    expert_dtype: str | None = None
    fallbacks: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dtype = self.expert_dtype or self.model.expert_dtype
        self.expert_bytes = self.model.expert_bytes(self.dtype)
        self._memo: dict[tuple[str, int], float] = {}
        gpu = self.profile.gpu
        self.launch_s = (gpu.graph_launch_us if gpu.cuda_graph else gpu.launch_us) * US
        self.sync_s = self.profile.sync.per_layer_us * US

    # -- curve lookup ------------------------------------------------------------
    def _find(self, curves: tuple[ExpertCurve, ...], intermediate: int, kernel: str) -> ExpertCurve | None:
        for c in curves:
            if (c.hidden == self.model.hidden_size and c.intermediate == intermediate
                    and c.dtype == self.dtype and c.kernel == kernel):
                return c
        return None

    def _memoised(self, key: str, tokens: int, compute) -> float:
        if tokens <= 0:
            return 0.0  # an expert no token was routed to does not run
        k = (key, tokens)
        value = self._memo.get(k)
        if value is None:
            value = self._memo[k] = compute(tokens)
        return value

    # -- GPU ---------------------------------------------------------------------
    def gpu_roofline(self, tokens: int, intermediate: int) -> float:
        """Roofline seconds of one FFN (hidden x ``intermediate``) on the GPU; weights read once."""
        gpu = self.profile.gpu
        params = self.model.expert_matrices * self.model.hidden_size * intermediate
        peak = gpu.peak_tflops.get(self.dtype, gpu.peak_tflops["bf16"])
        return roofline_s(2.0 * tokens * params, params * bytes_per_param(self.dtype, self.model.quant_group_size),
                          peak, gpu.roofline_efficiency, gpu.mem_bandwidth_gbps,
                          gpu.effective_bandwidth_efficiency)

    def _gpu_ffn(self, tokens: int, intermediate: int, label: str) -> float:
        curve = self._find(self.profile.gpu.expert_ffn, intermediate, "gpu")
        if curve is not None:
            return interp_loglog(curve.curve, tokens) * US
        self.fallbacks.add(f"gpu {label} FFN {self.model.hidden_size}x{intermediate} {self.dtype}")
        return self.gpu_roofline(tokens, intermediate)

    def gpu_expert(self, tokens: int) -> float:
        """One routed expert on the GPU for ``tokens`` tokens (kernel time, launches excluded)."""
        return self._memoised("gpu_expert", tokens,
                              lambda t: self._gpu_ffn(t, self.model.moe_intermediate_size, "expert"))

    def gpu_shared(self, tokens: int) -> float:
        """All shared experts of one layer on the GPU (0 when the model has none)."""
        if not self.model.shared_intermediate_size:
            return 0.0
        return self._memoised("gpu_shared", tokens,
                              lambda t: self._gpu_ffn(t, self.model.shared_intermediate_size, "shared"))

    def attention_roofline(self, tokens: int, context: int) -> float:
        """Roofline seconds of one attention layer: projections and gate read once, KV read per context token."""
        gpu = self.profile.gpu
        m = self.model
        params = m.attention_params_per_layer() + m.hidden_size * m.num_experts
        kv_bytes = m.kv_bytes_per_token() / max(m.num_layers + m.num_dense_layers, 1)
        flops = 2.0 * tokens * params + 4.0 * tokens * context * max(m.num_attention_heads, 1) * max(m.head_dim, 1)
        return roofline_s(flops, params * 2 + kv_bytes * context, gpu.peak_tflops["bf16"],
                          gpu.roofline_efficiency, gpu.mem_bandwidth_gbps, gpu.effective_bandwidth_efficiency)

    def attention(self, tokens: int, context: int) -> float:
        """One attention layer (projections, gate and SDPA) for ``tokens`` new tokens at ``context``.

        With curves for this model (or model-less ones): log-log in context on each tabulated token
        count, then log-log across token counts (first count's time below it,
        proportional growth above the last).
        """
        own = [c for c in self.profile.gpu.attention if c.model == self.model.name]
        curves = sorted(own or [c for c in self.profile.gpu.attention if not c.model], key=lambda c: c.tokens)
        if not curves:
            self.fallbacks.add(f"gpu attention {self.model.name}")
            return self.attention_roofline(max(tokens, 1), max(context, 1))
        at_context = [interp_loglog(c.curve, max(context, 1)) for c in curves]
        across = Curve(tuple(float(c.tokens) for c in curves), tuple(at_context), "")
        return interp_loglog(across, max(tokens, 1)) * US

    # -- CPU ---------------------------------------------------------------------
    def cpu_vector_kernel(self) -> str:
        """The CPU's non-AMX kernel family: AVX-512 where the profile has it, else AVX2."""
        cpu = self.profile.cpu
        if "avx512" in cpu.peak_tflops or any(c.kernel == "avx512" for c in cpu.expert_ffn):
            return "avx512"
        if "avx2" in cpu.peak_tflops or any(c.kernel == "avx2" for c in cpu.expert_ffn):
            return "avx2"
        return "avx512"

    def cpu_kernel(self, tokens: int) -> str:
        """Kernel family for ``tokens`` tokens per expert: AMX from the switch point up (001 Sec. 3.2)."""
        switch = self.profile.cpu.amx_switch_tokens
        return "amx" if switch is not None and tokens >= switch else self.cpu_vector_kernel()

    def cpu_roofline(self, tokens: int, kernel: str) -> float:
        """Roofline seconds of one routed expert on all configured cores with ``kernel``."""
        cpu = self.profile.cpu
        peak = cpu.peak_tflops.get(kernel, next(iter(cpu.peak_tflops.values())))
        return roofline_s(self.model.expert_flops(tokens), self.expert_bytes, peak, cpu.roofline_efficiency,
                          cpu.dram_bandwidth_gbps, cpu.effective_bandwidth_efficiency)

    def _cpu_ffn(self, tokens: int) -> float:
        cpu = self.profile.cpu
        kernel = self.cpu_kernel(tokens)
        curve = self._find(cpu.expert_ffn, self.model.moe_intermediate_size, kernel)
        if curve is not None:
            time = interp_loglog(curve.curve, tokens) * US
            if curve.threads and curve.threads != cpu.cores:
                # fewer cores than measured: slower in proportion; more: no gain assumed
                time *= max(curve.threads / cpu.cores, 1.0)
            return time
        self.fallbacks.add(f"cpu expert FFN {self.model.hidden_size}x{self.model.moe_intermediate_size} "
                           f"{self.dtype} {kernel}")
        return self.cpu_roofline(tokens, kernel)

    def cpu_expert(self, tokens: int) -> float:
        """One routed expert on the CPU pool (all configured cores) for ``tokens`` tokens."""
        return self._memoised("cpu_expert", tokens, self._cpu_ffn)

    # -- PCIe --------------------------------------------------------------------
    def _copy(self, curve: Curve, nbytes: int) -> float:
        pcie = self.profile.pcie
        gbps = interp_loglog(curve, nbytes, extrapolate_linear=False) * pcie.bandwidth_scale
        return pcie.latency_us * US + nbytes / (gbps * 1e9)

    def h2d(self, nbytes: int) -> float:
        """Host-to-device copy of ``nbytes`` from pinned memory: latency + bytes / bandwidth(size)."""
        return self._copy(self.profile.pcie.h2d, nbytes)

    def d2h(self, nbytes: int) -> float:
        """Device-to-host copy of ``nbytes`` into pinned memory: latency + bytes / bandwidth(size)."""
        return self._copy(self.profile.pcie.d2h, nbytes)

    @property
    def expert_load(self) -> float:
        """Time to copy one expert host-to-device."""
        value = self._memo.get(("h2d_expert", 0))
        if value is None:
            value = self._memo[("h2d_expert", 0)] = self.h2d(self.expert_bytes)
        return value

    def launches(self, kernels: int) -> float:
        return kernels * self.launch_s
