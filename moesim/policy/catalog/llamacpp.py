"""llama.cpp with ``--n-cpu-moe N`` (a baseline of 001_66a328d79a3cae8d.txt Sec. 6; 000 Sec. I cites it).

``--n-cpu-moe N`` keeps the expert tensors of the first ``N`` MoE layers in host
memory and loads everything else (every expert of the other layers) onto the
GPU. Layers whose experts live on the host compute them on the CPU, except that
ggml's scheduler offloads a matrix multiplication whose weights are in host
memory to the GPU when its batch has at least ``GGML_OP_OFFLOAD_MIN_BATCH`` (32)
tokens, copying the weights over for that one use (``ggml_backend_cuda_device_offload_op``;
for MoE it copies only the experts the batch activates). Prompts of 32 tokens or
more therefore run every expert on the GPU, CPU layers paying the copies.

The engine gives every layer the same number of expert slots, so this system
asks for full layers (``ignores_memory``) and checks the GPU memory itself:
GPU memory - reserved - non-expert weights - KV cache - workspace - 2 staging
buffers must hold ``(layers - N) * experts`` experts, or the replay stops with
the arithmetic and the smallest ``N`` that fits. ``cache.n_cpu_moe=-1`` picks
that smallest ``N``. Copies for op offload go through the staging buffers
(ping-pong), whereas llama.cpp copies the activated experts of a layer in one
batch before the multiplication.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesim.errors import ConfigError
from moesim.model.spec import DTYPE_BITS
from moesim.policy.assign import Assignment
from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.cache import CachePolicy
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system

GIB = 2**30


def peak_kv_tokens(path: str | None) -> int:
    """Largest total context held at once over a trace (the same count as the engine's memory plan)."""
    if path is None:
        return 0
    import pyarrow.parquet as pq
    frame = pq.read_table(path, columns=["step", "request", "position"]).to_pandas()
    per_request = frame.groupby(["step", "request"], sort=False)["position"].max() + 1
    return int(per_request.groupby(level=0).sum().max()) if len(per_request) else 0


@register_component
@dataclass
class LlamaCppLayers(CachePolicy):
    """Layer placement of ``--n-cpu-moe N``: layers ``0..N-1`` keep their experts on the CPU, the rest hold all."""

    name = "llamacpp-layers"
    #: MoE layers whose experts stay in host memory (-1: the fewest that let the rest fit on the GPU)
    n_cpu_moe: int = -1
    #: dtype of non-expert weights on the GPU (empty: the expert dtype, as one GGUF quantisation gives)
    non_expert_dtype: str = ""
    #: GPU memory kept for activations and buffers, GiB (the engine's memory.workspace_gib default)
    workspace_gib: float = 0.5
    _cpu_layers: int = 0
    _experts: int = 0

    def configure(self, ctx: RunContext) -> None:
        layers, experts = ctx.model.num_layers, ctx.model.num_experts
        self._experts = experts
        fit = self.gpu_layers_that_fit(ctx)
        smallest = max(layers - fit, 0)
        if self.n_cpu_moe < 0:
            self._cpu_layers = smallest
        elif self.n_cpu_moe < smallest:
            raise ConfigError(f"--n-cpu-moe {self.n_cpu_moe} leaves {layers - self.n_cpu_moe} MoE layers of "
                              f"{experts} experts on the GPU, but memory holds only {fit} such layers",
                              field="cache.n_cpu_moe", fix=f"use cache.n_cpu_moe >= {smallest} (or -1)")
        else:
            self._cpu_layers = min(self.n_cpu_moe, layers)
        ctx.notes.append(f"llamacpp: experts of MoE layers 0..{self._cpu_layers - 1} on the CPU "
                         f"(--n-cpu-moe {self._cpu_layers}), layers {self._cpu_layers}..{layers - 1} all on the GPU")

    def gpu_layers_that_fit(self, ctx: RunContext) -> int:
        """Whole MoE layers of experts that GPU memory holds after everything else."""
        model, costs = ctx.model, ctx.costs
        dtype = self.non_expert_dtype or costs.dtype
        if dtype not in DTYPE_BITS:
            raise ConfigError(f"unknown dtype '{dtype}'", field="cache.non_expert_dtype",
                              fix=f"use one of {', '.join(DTYPE_BITS)}")
        profile = costs.profile
        free = (profile.gpu_memory_bytes - profile.gpu_reserved_bytes - model.non_expert_bytes(dtype)
                - peak_kv_tokens(ctx.trace_path) * model.kv_bytes_per_token()
                - int(self.workspace_gib * GIB) - 2 * costs.expert_bytes)
        layer_bytes = model.num_experts * costs.expert_bytes
        return max(int(free // layer_bytes), 0)

    @property
    def cpu_layers(self) -> int:
        return self._cpu_layers

    def initial(self, layer: int, capacity: int) -> list[int]:
        return [] if layer < self._cpu_layers else list(range(min(self._experts, capacity)))


@register_component
@dataclass
class LlamaCppAssign(Assignment):
    """Resident experts on the GPU; the others on the CPU unless the batch is large enough for op offload."""

    name = "llamacpp"
    #: tokens in a batch from which ggml offloads host-weight multiplications to the GPU (0: never)
    op_offload_min_batch: int = 32

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        resident = view.cache.resident[view.layer]
        offload = 0 < self.op_offload_min_batch <= view.tokens
        gpu = [e for e in view.active if e in resident or offload]
        cpu = [e for e in view.active if e not in resident and not offload]
        return gpu, cpu


@dataclass
class LlamaCppSystem(ComposedSystem):
    """Nothing is ever cached at run time: GPU experts not resident are copied for one use."""

    def _place(self, view: LayerView) -> LayerPlan:
        gpu, cpu = self.assign.split(view)
        resident = view.cache.resident[view.layer]
        plan = LayerPlan(cpu=cpu)
        plan.streamed = [e for e in gpu if e not in resident]
        plan.gpu = [e for e in gpu if e in resident] + plan.streamed
        return plan


register_system("llamacpp", SystemSpec(
    "llama.cpp --n-cpu-moe N: experts of the first N MoE layers on the CPU, all others resident on the GPU "
    "(memory checked; N=-1 picks the smallest that fits); batches of 32+ tokens offload CPU layers to the GPU",
    cache="llamacpp-layers", assign="llamacpp", ignores_memory=True, system_class=LlamaCppSystem, runtime="llamacpp"))
