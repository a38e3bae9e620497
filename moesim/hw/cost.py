"""Cost model: durations (seconds) of the engine's operations for one model on one profile.

Curves are interpolated log-log between tabulated points. Below the first
point the first value holds (a kernel never gets faster than at its smallest
size); above the last, time grows in proportion to tokens (the compute-bound
regime). When a profile has no curve for a shape, a roofline
``max(flops / (peak * eff), bytes / (bandwidth * eff))`` stands in, and the
shape is added to :attr:`CostModel.fallbacks` so reports can say so.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

from moesim.hw.profile import Curve, ExpertCurve, HardwareProfile
from moesim.model.spec import DTYPE_BITS, ModelSpec

US = 1e-6


def interp_loglog(curve: Curve, x: float, *, extrapolate_linear: bool = True) -> float:
    xs, ys = curve.x, curve.y
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * (x / xs[-1]) if extrapolate_linear else ys[-1]
    i = bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


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
        k = (key, tokens)
        value = self._memo.get(k)
        if value is None:
            value = self._memo[k] = compute(tokens)
        return value

    # -- GPU ---------------------------------------------------------------------
    def _gpu_ffn(self, tokens: int, intermediate: int, label: str) -> float:
        curve = self._find(self.profile.gpu.expert_ffn, intermediate, "gpu")
        if curve is not None:
            return interp_loglog(curve.curve, tokens) * US
        self.fallbacks.add(f"gpu {label} FFN {self.model.hidden_size}x{intermediate} {self.dtype}")
        gpu = self.profile.gpu
        params = self.model.expert_matrices * self.model.hidden_size * intermediate
        peak = gpu.peak_tflops.get(self.dtype, gpu.peak_tflops["bf16"]) * 1e12
        flops = 2.0 * tokens * params
        weight_bytes = params * DTYPE_BITS[self.dtype] / 8
        eff = gpu.roofline_efficiency
        return max(flops / (peak * eff), weight_bytes / (gpu.mem_bandwidth_gbps * 1e9 * eff))

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

    def attention(self, tokens: int, context: int) -> float:
        """One attention layer (projections, gate and SDPA) for ``tokens`` new tokens at ``context``."""
        curves = self.profile.gpu.attention
        if curves:
            sizes = [c.tokens for c in curves]
            # nearest tabulated token count, scaled in proportion (prefill is compute-bound)
            best = min(curves, key=lambda c: abs(math.log(c.tokens) - math.log(max(tokens, 1))))
            base = interp_loglog(best.curve, max(context, 1))
            scale = max(tokens / best.tokens, 1.0) if tokens > max(sizes) else 1.0
            return base * scale * US
        self.fallbacks.add("gpu attention")
        gpu = self.profile.gpu
        eff = gpu.roofline_efficiency
        params = self.model.attention_params_per_layer() + self.model.hidden_size * self.model.num_experts
        kv_bytes = self.model.kv_bytes_per_token() / max(self.model.num_layers + self.model.num_dense_layers, 1)
        flops = 2.0 * tokens * params + 4.0 * tokens * context * max(self.model.num_attention_heads, 1) \
            * max(self.model.head_dim, 1)
        read = params * 2 + kv_bytes * context
        return max(flops / (gpu.peak_tflops["bf16"] * 1e12 * eff), read / (gpu.mem_bandwidth_gbps * 1e9 * eff))

    # -- CPU ---------------------------------------------------------------------
    def cpu_kernel(self, tokens: int) -> str:
        """Kernel family for ``tokens`` tokens per expert: AMX from the switch point up (001 Sec. 3.2)."""
        switch = self.profile.cpu.amx_switch_tokens
        return "amx" if switch is not None and tokens >= switch else "avx512"

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
        peak = cpu.peak_tflops.get(kernel, next(iter(cpu.peak_tflops.values()))) * 1e12
        eff = cpu.roofline_efficiency
        return max(self.model.expert_flops(tokens) / (peak * eff),
                   self.expert_bytes / (cpu.dram_bandwidth_gbps * 1e9 * eff))

    def cpu_expert(self, tokens: int) -> float:
        """One routed expert on the CPU pool (all configured cores) for ``tokens`` tokens."""
        return self._memoised("cpu_expert", tokens, self._cpu_ffn)

    # -- PCIe --------------------------------------------------------------------
    def h2d(self, nbytes: int) -> float:
        pcie = self.profile.pcie
        gbps = interp_loglog(pcie.h2d, nbytes, extrapolate_linear=False) * pcie.bandwidth_scale
        return pcie.latency_us * US + nbytes / (gbps * 1e9)

    @property
    def expert_load(self) -> float:
        """Time to copy one expert host-to-device."""
        value = self._memo.get(("h2d_expert", 0))
        if value is None:
            value = self._memo[("h2d_expert", 0)] = self.h2d(self.expert_bytes)
        return value

    def launches(self, kernels: int) -> float:
        return kernels * self.launch_s
