"""Cost model: durations (seconds) of the engine's operations for one model on one profile.

Curves are interpolated log-log between tabulated points. Below the first
point the first value holds (a kernel never gets faster than at its smallest
size); above the last, time grows in proportion to tokens (the compute-bound
regime). When a profile has no curve for a shape, a roofline
``max(flops / (peak * eff), bytes / (bandwidth * bw_eff))`` stands in, and the
shape is added to :attr:`CostModel.fallbacks` so reports can say so. The
shipped profiles' derived curves are tabulations of exactly this roofline, so
a curve and the fallback never disagree (tests/hw/test_profile.py checks it).
The LM head and token sampling read ``gpu.output`` curves where a profile has
them for the model's hidden x vocab shape (``moesim profile`` measures them),
else the roofline, as the embedding lookup always does.

CPU kernels: AMX from ``cpu.amx_switch_tokens`` tokens per expert up, the
CPU's vector family (AVX-512, or AVX2 where the CPU has no AVX-512) below it
(001_66a328d79a3cae8d.txt Sec. 3.2).

Overrides (``--set hw.*``): every curve value is multiplied by the roofline at
the same point under the overridden numbers over the roofline under the
profile's own numbers. For a derived curve (a tabulated roofline) this is the
recomputation; for a measured one it scales the time by the ratio of whichever
term binds there (bandwidth where memory-bound, peak where compute-bound).
The same ratio carries an attention curve measured in one weight dtype over
to ``memory.non_expert_dtype``.

Runtimes (``profile.runtimes``, 001 Sec. 2.3, 6.4): launch cost per kernel and
CUDA Graph mode, non-expert kernels per layer, CPU kernel efficiency relative
to the curves (by the regime that binds), host work per forward pass.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable

from moesim.errors import ConfigError
from moesim.hw.parts import Curve, ExpertCurve, RuntimeSpec
from moesim.hw.profile import HardwareProfile
from moesim.model.spec import DTYPE_BITS, ModelSpec, scale_bytes_per_param

US = 1e-6


def interp_loglog(curve: Curve | _AcrossTokens, x: float, *, extrapolate_linear: bool = True) -> float:
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


class _AcrossTokens:
    """The attention curves' times at one context, as a curve over their token counts (``counts``) for
    :func:`interp_loglog`, each read where that reads it: a decode step's one token reads the first curve
    only, where tabulating them all cost four interpolations more per step."""

    __slots__ = ("x", "y")

    def __init__(self, curves: list, counts: tuple[float, ...], context: float) -> None:
        self.x = counts
        self.y = _AtContext(curves, context)


class _AtContext:
    """``interp_loglog(curves[i].curve, context)`` as its ``[i]``."""

    __slots__ = ("curves", "context")

    def __init__(self, curves: list, context: float) -> None:
        self.curves, self.context = curves, context

    def __getitem__(self, i: int) -> float:
        return interp_loglog(self.curves[i].curve, self.context)


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
    #: dtype of attention, dense FFN, embedding and LM-head weights (``memory.non_expert_dtype``)
    non_expert_dtype: str = "bf16"
    #: name of the runtime in ``profile.runtimes`` (``generic``: the gpu section's launch_us/cuda_graph)
    runtime_name: str = "generic"
    fallbacks: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dtype = self.expert_dtype or self.model.expert_dtype
        try:
            self.expert_bytes = self.model.expert_bytes(self.dtype)
        except ConfigError as err:
            if self.expert_dtype:  # the run's own dtype (--set memory.expert_dtype), named as the user set it
                err.rename_field("memory.expert_dtype")
            raise
        self._memo: dict[tuple[str, int], float] = {}
        m = self.model
        # what every attention call needs and never changes: its parameters and KV bytes per context
        # token, and the profile's curves for this model (else the model-less ones) by token count
        self._attention_sizes = (m.attention_params_per_layer() + m.gate_params,
                                 m.kv_bytes_per_token() / max(m.num_layers + m.num_dense_layers, 1))
        own = [c for c in self.profile.gpu.attention if c.model == m.name]
        self._attention_curves = sorted(own or [c for c in self.profile.gpu.attention if not c.model],
                                        key=lambda c: c.tokens)
        self._attention_counts = tuple(float(c.tokens) for c in self._attention_curves)
        self.runtime: RuntimeSpec = self.profile.runtime(self.runtime_name)
        if self.runtime_name != "generic" and not self.profile.runtimes:
            self.fallbacks.add(f"runtime {self.runtime_name}: profile has no runtimes section, generic launch "
                               "costs used")
        self.base = self.profile.original
        self.overridden = self.profile.base is not None
        self.launch_s = self.launch_per_kernel("prefill")
        self.sync_s = self.profile.sync.per_layer_us * US
        #: time to copy one expert host-to-device: fixed by the profile and dtype this model is made with, and
        #: set here with the other attributes (planners read it every layer; one set later would slow every read)
        self.expert_load = self.h2d(self.expert_bytes)

    # -- runtime -----------------------------------------------------------------
    def launch_per_kernel(self, phase: str) -> float:
        """Host launch cost of one GPU kernel in ``phase`` (0 inside a whole-decode-step graph)."""
        graph = self.runtime.graph
        if graph == "kernel" or (graph == "decode_step" and phase == "decode"):
            return 0.0 if graph == "decode_step" else self.profile.gpu.graph_launch_us * US
        return self.runtime.launch_us * US

    def step_launch(self, phase: str) -> float:
        """Launch cost charged once per forward pass: the graph launch of a whole-decode-step graph."""
        if self.runtime.graph == "decode_step" and phase == "decode":
            return self.profile.gpu.graph_launch_us * US
        return 0.0

    def layer_launches(self, phase: str) -> float:
        """Launches of one layer's non-expert kernels (``runtimes.<name>.kernels_per_layer``)."""
        return self.runtime.kernels_per_layer * self.launch_per_kernel(phase)

    @property
    def host_per_step(self) -> float:
        return self.runtime.host_us_per_step * US

    # -- override scaling --------------------------------------------------------
    def _gpu_roof(self, profile: HardwareProfile, flops: float, nbytes: float, dtype: str) -> float:
        gpu = profile.gpu
        peak = gpu.peak_tflops.get(dtype, gpu.peak_tflops["bf16"])
        return roofline_s(flops, nbytes, peak, gpu.roofline_efficiency, gpu.mem_bandwidth_gbps,
                          gpu.effective_bandwidth_efficiency)

    def _gpu_ratio(self, flops: float, nbytes_now: float, nbytes_curve: float, dtype_now: str,
                   dtype_curve: str) -> float:
        """Roofline under today's numbers and dtype over the roofline the curve stands for."""
        return (self._gpu_roof(self.profile, flops, nbytes_now, dtype_now)
                / self._gpu_roof(self.base, flops, nbytes_curve, dtype_curve))

    # -- curve lookup ------------------------------------------------------------
    def _find(self, curves: tuple[ExpertCurve, ...], intermediate: int, kernel: str,
              dtype: str | None = None) -> ExpertCurve | None:
        dtype = dtype or self.dtype
        for c in curves:
            if (c.hidden == self.model.hidden_size and c.intermediate == intermediate
                    and c.dtype == dtype and c.kernel == kernel):
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
    def _ffn_shape(self, tokens: int, intermediate: int, dtype: str) -> tuple[float, float]:
        params = self.model.expert_matrices * self.model.hidden_size * intermediate
        return 2.0 * tokens * params, params * bytes_per_param(dtype, self.model.quant_group_size)

    def gpu_roofline(self, tokens: int, intermediate: int, dtype: str | None = None) -> float:
        """Roofline seconds of one FFN (hidden x ``intermediate``) on the GPU; weights read once."""
        dtype = dtype or self.dtype
        return self._gpu_roof(self.profile, *self._ffn_shape(tokens, intermediate, dtype), dtype)

    def _gpu_ffn(self, tokens: int, intermediate: int, label: str, dtype: str | None = None) -> float:
        dtype = dtype or self.dtype
        curve = self._find(self.profile.gpu.expert_ffn, intermediate, "gpu", dtype)
        if curve is not None:
            value = interp_loglog(curve.curve, tokens) * US
            if self.overridden:
                flops, nbytes = self._ffn_shape(tokens, intermediate, dtype)
                value *= self._gpu_ratio(flops, nbytes, nbytes, dtype, dtype)
            return value
        self.fallbacks.add(f"gpu {label} FFN {self.model.hidden_size}x{intermediate} {dtype}")
        return self.gpu_roofline(tokens, intermediate, dtype)

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

    def dense_ffn(self, tokens: int) -> float:
        """The FFN of one dense layer (DeepSeek's first layers) in the non-expert dtype; 0 without dense layers."""
        if not self.model.num_dense_layers:
            return 0.0
        return self._memoised("dense_ffn", tokens, lambda t: self._gpu_ffn(
            t, self.model.dense_intermediate_size, "dense", self.non_expert_dtype))

    def gate(self, tokens: int) -> float:
        """Roofline seconds of one router gate (hidden x experts) on the GPU for ``tokens`` tokens, weights
        in the non-expert dtype read once; kernel launches excluded. Attention's curves include their
        layer's gate: this is a gate run on its own (a prediction's, 003 Sec. 6.3)."""
        def roof(t: int) -> float:
            m, dtype = self.model, self.non_expert_dtype
            return self._gpu_roof(self.profile, 2.0 * t * m.gate_params,
                                  m.gate_params * bytes_per_param(dtype, m.quant_group_size), dtype)
        return self._memoised("gate", tokens, roof)

    def _attention_shape(self, tokens: int, context: int, dtype: str) -> tuple[float, float]:
        m = self.model
        params, kv_bytes = self._attention_sizes
        flops = 2.0 * tokens * params + 4.0 * tokens * context * max(m.num_attention_heads, 1) * max(m.head_dim, 1)
        return flops, params * bytes_per_param(dtype, m.quant_group_size) + kv_bytes * context

    def attention_roofline(self, tokens: int, context: int, dtype: str | None = None) -> float:
        """Roofline seconds of one attention layer: projections and gate read once (in the non-expert
        dtype), KV read per context token."""
        dtype = dtype or self.non_expert_dtype
        return self._gpu_roof(self.profile, *self._attention_shape(tokens, context, dtype), dtype)

    def attention(self, tokens: int, context: int) -> float:
        """One attention layer (projections, gate and SDPA) for ``tokens`` new tokens at ``context``.

        With curves for this model (or model-less ones): log-log in context on each tabulated token
        count, then log-log across token counts (first count's time below it,
        proportional growth above the last); scaled to ``non_expert_dtype`` and to
        overridden numbers by the roofline ratio.
        """
        curves = self._attention_curves
        tokens, context = max(tokens, 1), max(context, 1)
        if not curves:
            self.fallbacks.add(f"gpu attention {self.model.name}")
            return self.attention_roofline(tokens, context)
        value = interp_loglog(_AcrossTokens(curves, self._attention_counts, context), tokens) * US
        dtype = self.non_expert_dtype
        if self.overridden or curves[0].dtype != dtype:
            flops, now = self._attention_shape(tokens, context, dtype)
            value *= self._gpu_ratio(flops, now, self._attention_shape(tokens, context, curves[0].dtype)[1],
                                     dtype, curves[0].dtype)
        return value

    def embedding(self, tokens: int) -> float:
        """Embedding lookup: one row of hidden weights read per token (roofline, bandwidth-bound)."""
        m = self.model
        nbytes = tokens * m.hidden_size * bytes_per_param(self.non_expert_dtype, m.quant_group_size)
        return self._gpu_roof(self.profile, 0.0, nbytes, self.non_expert_dtype)

    def lm_head(self, sequences: int) -> float:
        """Final norm and LM head for the last token of each sequence (vocab x hidden weights read once)."""
        m = self.model
        params = m.lm_head_params
        return self._output("lm_head", sequences, self.non_expert_dtype, lambda dtype: (
            2.0 * sequences * params, params * bytes_per_param(dtype, m.quant_group_size)))

    def sampling(self, sequences: int) -> float:
        """Softmax and token choice over each sequence's fp32 logits (read, write, read)."""
        nbytes = 3.0 * 4 * sequences * self.model.vocab_size
        return self._output("sampling", sequences, "bf16", lambda _dtype: (0.0, nbytes))

    def _output(self, kind: str, sequences: int, dtype: str,
                shape: Callable[[str], tuple[float, float]]) -> float:
        """A profile's output curve of this kind for the model's hidden x vocab shape (scaled by the roofline
        ratio to another dtype or overridden numbers, as attention curves are), else the roofline of
        ``shape(dtype)``, its (flops, bytes)."""
        m = self.model
        curve = next((c for c in self.profile.gpu.output
                      if c.kind == kind and c.hidden == m.hidden_size and c.vocab == m.vocab_size), None)
        flops, nbytes = shape(dtype)
        if curve is None:
            return self._gpu_roof(self.profile, flops, nbytes, dtype)
        value = interp_loglog(curve.curve, max(sequences, 1)) * US
        if self.overridden or curve.dtype != dtype:
            value *= self._gpu_ratio(flops, nbytes, shape(curve.dtype)[1], dtype, curve.dtype)
        return value

    def step_fixed(self, tokens: int, context: int, sequences: int) -> dict[str, float]:
        """GPU work of a forward pass outside the MoE layers, by breakdown category (launches excluded):
        dense layers' attention, their FFNs, embedding, LM head, sampling."""
        dense = self.model.num_dense_layers
        return {"attention": dense * self.attention(tokens, context), "dense_ffn": dense * self.dense_ffn(tokens),
                "embedding": self.embedding(tokens), "lm_head": self.lm_head(sequences),
                "sampling": self.sampling(sequences)}

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

    def _cpu_terms(self, profile: HardwareProfile, tokens: int, kernel: str) -> tuple[float, float]:
        """(compute seconds, DRAM seconds) of one routed expert on ``profile``'s CPU."""
        cpu = profile.cpu
        peak = cpu.peak_tflops.get(kernel, next(iter(cpu.peak_tflops.values())))
        return (self.model.expert_flops(tokens) / (peak * 1e12 * cpu.roofline_efficiency),
                self.expert_bytes / (cpu.dram_bandwidth_gbps * 1e9 * cpu.effective_bandwidth_efficiency))

    def cpu_roofline(self, tokens: int, kernel: str) -> float:
        """Roofline seconds of one routed expert on all configured cores with ``kernel``."""
        return max(self._cpu_terms(self.profile, tokens, kernel))

    def _cpu_ffn(self, tokens: int) -> float:
        cpu = self.profile.cpu
        kernel = self.cpu_kernel(tokens)
        compute, memory = self._cpu_terms(self.profile, tokens, kernel)
        curve = self._find(cpu.expert_ffn, self.model.moe_intermediate_size, kernel)
        if curve is not None:
            time = interp_loglog(curve.curve, tokens) * US
            if self.overridden:
                time *= max(compute, memory) / max(self._cpu_terms(self.base, tokens, kernel))
            if curve.threads and curve.threads != cpu.cores:
                # fewer cores than measured: slower in proportion; more: no gain assumed
                time *= max(curve.threads / cpu.cores, 1.0)
        else:
            self.fallbacks.add(f"cpu expert FFN {self.model.hidden_size}x{self.model.moe_intermediate_size} "
                               f"{self.dtype} {kernel}")
            time = max(compute, memory)
        rt = self.runtime
        return time / (rt.cpu_compute(kernel) if compute >= memory else rt.cpu_bandwidth_efficiency)

    def cpu_dram_rate(self, tokens: int) -> float:
        """Bytes per second one CPU expert of ``tokens`` tokens reads from DRAM while it runs alone."""
        return self.expert_bytes / self.cpu_expert(tokens)

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

    def h2d_chunked(self, nbytes: int, chunk: int) -> float:
        """A host-to-device copy issued in ``chunk``-byte pieces, each paying the per-copy latency."""
        full, rest = divmod(nbytes, chunk)
        return full * self.h2d(chunk) + (self.h2d(rest) if rest else 0.0)

    def d2h(self, nbytes: int) -> float:
        """Device-to-host copy of ``nbytes`` into pinned memory: latency + bytes / bandwidth(size)."""
        return self._copy(self.profile.pcie.d2h, nbytes)

    def launches(self, kernels: int, phase: str = "prefill") -> float:
        return kernels * self.launch_per_kernel(phase)
