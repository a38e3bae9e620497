"""llama.cpp with ``--n-cpu-moe N`` (a baseline of 001_66a328d79a3cae8d.txt Sec. 6; 000 Sec. I cites it).

``--n-cpu-moe N`` keeps the expert tensors of the first ``N`` transformer blocks in host
memory and loads everything else (every expert of the other layers) onto the
GPU: ``common/arg.cpp`` adds one CPU buffer override per block ``i < N``, matching
``blk.i.ffn_(up|down|gate)_exps`` (``llm_ffn_exps_block_regex``), so a dense block
(DeepSeek's first three) counts towards ``N`` and holds no experts; ``cache.n_cpu_moe``
takes the flag's value in the same blocks. Layers whose experts live on the host compute them on the CPU, except that
ggml's scheduler offloads a matrix multiplication whose weights are in host
memory to the GPU when its batch has at least ``GGML_OP_OFFLOAD_MIN_BATCH`` (32)
tokens, copying the weights over for that one use (``ggml_backend_cuda_device_offload_op``;
for MoE it copies only the experts the batch activates). Prompts of 32 tokens or
more therefore run every expert on the GPU, CPU layers paying the copies.
``assign.op_offload_min_batch`` is that threshold (the ``GGML_OP_OFFLOAD_MIN_BATCH``
environment variable of newer ggml; 0: ``--no-op-offload``).

Not modelled: ``--n-gpu-layers`` below the block count, which leaves whole blocks (attention
included) on the CPU; the engine runs every attention on the GPU, i.e. ``-ngl 999``, the setting
``--n-cpu-moe`` is used with. ggml's scheduler runs a graph's splits one after another (a CPU
split starts once the GPU split before it has finished and its outputs are copied), whereas the
engine runs a layer's CPU experts beside the GPU's shared experts after the sync, as for every
system (docs/engine.md).

Memory comes from the one plan every system shares (``moesim.sim.memory``):
non-expert weights in ``memory.non_expert_dtype``, KV cache, workspace and
staging buffers first, then expert slots. This cache spreads them as whole
layers: ``(layers - N) * experts`` slots must hold, so ``cache.n_cpu_moe=-1``
(default) picks the smallest ``N`` that fits and a smaller ``N`` stops with the
arithmetic. ``cache.slots`` or ``cache.slots_per_layer`` shrink the budget as
for every other system (``cache.slots_per_layer=2`` gives ``2 * layers`` slots,
used as whole layers). Slots left over from the last whole layer stay unused,
as in llama.cpp. Copies for op offload go through the staging buffers
(ping-pong), whereas llama.cpp copies the activated experts of a layer in one
batch before the multiplication.

``llamacpp-experts`` is llama.cpp as 001_66a328d79a3cae8d.txt Sec. 6.1 extended it for its comparison
(stock llama.cpp has since gained the same placement as ``--cpu-moe``, ``-ot exps=CPU``):
"expert-level offloading analogous to Fiddler", every routed expert on the CPU and the rest of the
model on the GPU, whatever GPU memory is left, and the runtime is llama.cpp's (C++ launches of 5 us,
about 3,000 kernels per decoded DeepSeek-V3 token, no CUDA Graph: 001 Sec. 2.3). Its prefill keeps the
experts on the CPU too (``assign.op_offload_min_batch=0``): 001 Sec. 6.2 finds it faster than Fiddler on
short prompts ("superior operator fusion") and slower on long ones, where Fiddler wins by "better
utilization of AMX instructions in its oneDNN backend". Copying every activated expert to the GPU from
32 tokens up would make it the slowest of the three on short prompts (a 32-token prompt activates most
experts of every layer) and, on Qwen2-57B at 8,192 tokens, faster than Fiddler
(``--set assign.op_offload_min_batch=32`` gives stock ggml's rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moesim.errors import ConfigError
from moesim.model.spec import ModelSpec
from moesim.policy.assign import Assignment
from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.cache import CachePolicy, SlotSpread
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system


def placement(cpu_layers: int, layers: int) -> str:
    """Where experts of the first ``cpu_layers`` of a model's ``layers`` MoE layers on the CPU go, in words."""
    if cpu_layers <= 0:
        return f"experts of all {layers} MoE layers on the GPU"
    if cpu_layers >= layers:
        return f"experts of all {layers} MoE layers on the CPU"
    return f"experts of MoE {span(0, cpu_layers)} on the CPU, {span(cpu_layers, layers)} all on the GPU"


def flag(cpu_layers: int, layers: int, dense: int) -> str:
    """llama.cpp's option for the first ``cpu_layers`` MoE layers on the CPU: it counts blocks, and the
    ``dense`` blocks before the MoE layers hold no experts."""
    if cpu_layers >= layers:
        return "--cpu-moe"
    return f"--n-cpu-moe {cpu_layers + dense if cpu_layers else 0}"


def span(first: int, end: int) -> str:
    """``layer 4`` or ``layers 4..9`` for the layers from ``first`` up to (not including) ``end``."""
    return f"layer {first}" if end - first == 1 else f"layers {first}..{end - 1}"


@register_component
@dataclass
class LlamaCppLayers(CachePolicy):
    """Layer placement of ``--n-cpu-moe N``: layers ``0..N-1`` keep their experts on the CPU, the rest hold all."""

    name = "llamacpp-layers"
    #: llama.cpp's --n-cpu-moe: transformer blocks, dense ones included, whose experts stay in host memory
    #: (common/arg.cpp); -1: the fewest that let the rest fit on the GPU
    n_cpu_moe: int = -1
    _cpu_layers: int = 0
    _experts: int = 0
    #: dense blocks before the MoE layers (counted by --n-cpu-moe, holding no experts)
    _dense: int = 0

    def for_model(self, model: ModelSpec) -> None:
        self._dense = model.num_dense_layers

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """Whole layers: the last MoE layers hold every expert, those in the first ``N`` blocks none."""
        fit = min(total // experts, layers) if experts else layers
        smallest = layers - fit
        if self.n_cpu_moe < 0:
            cpu_layers = smallest
        else:
            cpu_layers = min(max(self.n_cpu_moe - self._dense, 0), layers)
            if cpu_layers < smallest:
                dense = f" (its first {self._dense} blocks are dense)" if self._dense else ""
                raise ConfigError(f"--n-cpu-moe {self.n_cpu_moe}{dense} leaves {layers - cpu_layers} MoE layers "
                                  f"of {experts} experts on the GPU, but its {total} expert slots hold only {fit} "
                                  f"such layers", field="cache.n_cpu_moe",
                                  fix=f"use cache.n_cpu_moe >= {smallest + self._dense} (or -1)")
        return SlotSpread([0] * cpu_layers + [experts] * (layers - cpu_layers))

    def configure(self, ctx: RunContext) -> None:
        layers = ctx.model.num_layers
        self._experts = ctx.model.num_experts
        self._cpu_layers = next((i for i, c in enumerate(ctx.capacity) if c > 0), layers)
        ctx.notes.append(f"llamacpp: {placement(self._cpu_layers, layers)} "
                         f"({flag(self._cpu_layers, layers, ctx.model.num_dense_layers)})")

    @property
    def cpu_layers(self) -> int:
        return self._cpu_layers

    def initial(self, layer: int, capacity: int) -> list[int]:
        return [] if layer < self._cpu_layers else list(range(min(self._experts, capacity)))


@register_component
@dataclass
class LlamaCppExpertOffload(LlamaCppLayers):
    """001's extension: the experts of every MoE layer stay in host memory (``--n-cpu-moe`` = all layers)."""

    name = "llamacpp-experts"
    #: fixed at every MoE layer (not a parameter: its spread ignores it)
    n_cpu_moe: int = field(default=-1, init=False)

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        return SlotSpread([0] * layers)


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
    "(whole layers of the shared memory budget; N=-1 picks the smallest that fits); batches of 32+ tokens "
    "offload CPU layers to the GPU",
    cache="llamacpp-layers", assign="llamacpp", system_class=LlamaCppSystem,
    runtime="llamacpp"))
register_system("llamacpp-experts", SystemSpec(
    "llama.cpp as 001 extended it: every routed expert on the CPU (Fiddler-style expert offloading), prefill "
    "included (no op offload, 001 Sec. 6.2), attention and shared experts on the GPU, llama.cpp's launches",
    cache="llamacpp-experts", assign="llamacpp", system_class=LlamaCppSystem, uses_cache=False, runtime="llamacpp",
    defaults=(("assign.op_offload_min_batch", "0"),)))
