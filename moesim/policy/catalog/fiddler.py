"""Fiddler (Kamahori et al., arXiv 2402.07033; a baseline of 001_66a328d79a3cae8d.txt Sec. 6).

After its public implementation (github.com/efeslab/fiddler, ``src/fiddler/mixtral.py``):
the most popular experts found by offline profiling are placed on the GPU once and
never move; for every other expert the layer compares the estimated CPU time
(tokens x per-token CPU cost) with the cost of copying its weights to the GPU and
picks the cheaper, per expert (its partition search minimises the sum of costs,
which separates by expert). A copied expert runs from a single placeholder buffer
and is not kept.

How this differs from the ``static-hot`` system: static-hot never copies an expert;
it computes every non-resident expert on the CPU. Fiddler copies a non-resident
expert when ``T_CPU(tokens) > T_PCIe + T_GPU(tokens)`` (the cost model's curves
stand in for Fiddler's two hand-set constants), which on the bundled profiles happens with many
tokens per expert, i.e. in the prefill; in decoding the two systems agree there. The rule weighs one
expert's copy against its CPU time, not the copies queued ahead of it, so a faster link can make
Fiddler slower: DeepSeek-V3 int4 on ``rtx4090`` with ``hw.pcie.bandwidth_scale=2`` copies a decode
expert too (439 us + kernel against 688 us on the CPU) and streams every cold prefill expert, one
at a time through the one buffer, while the CPU idles (two synthetic 128-token prompts: TTFT 3,961 ms
at 1x, 4,696 ms at 2x; 2,796 ms at 4x).

Fiddler's one placeholder buffer is the system's default
``engine.staging_slots=1``: the next copy waits until the current copied expert
has run (``--set engine.staging_slots=2`` lets them overlap). ``assign.copy_cold=false`` computes every
cold expert on the CPU, prefill included: the Fiddler that 001_66a328d79a3cae8d.txt Sec. 2.3 and 6.1
profiled and compared with ("executing routed experts on the CPU while processing other computations
on the GPU"; its Sec. 6.4 speeds Fiddler's prefill up 3.14x by replacing the PyTorch MoE on the CPU
alone, which a prefill copying its heavy experts to the GPU would not show).

Placement (``cache=fiddler-popular``): Fiddler ranks (layer, expert) pairs by popularity over the whole
model (``set_expert_loc``: one list of pairs, most popular first) and pins the first ones that fit, so a
layer with hot experts gets more slots than a flat one. moesim does the same over one model-wide pool
of the slots the shared memory plan leaves (Fiddler itself fills 95% of the GPU left after the other
weights, ``calc_n_expert_on_gpu``); explicit per-layer quotas (``cache.slots_per_layer``) pin each
layer's hottest experts instead. Popularity is counted on ``cache.calibration`` (default: the replayed
trace, flagged), where Fiddler ships a list profiled offline on ShareGPT.

Departures from the original, by choice of model: within a layer Fiddler runs its GPU experts first
and then the CPU ones (the CPU experts' inputs are copied to the host with a blocking copy that waits
for the GPU queue), so the two do not overlap; the engine runs the layer's CPU experts beside its GPU
work after the sync (docs/engine.md), as for every system. Fiddler's copy buffer is filled by a blocking
``load_state_dict``, which the one staging buffer models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.policy.assign import Assignment
from moesim.policy.base import LayerView, RunContext
from moesim.policy.cache import SlotSpread, StaticCache
from moesim.policy.systems import SystemSpec, register_component, register_system


@register_component
@dataclass
class FiddlerPopular(StaticCache):
    """Fiddler's placement: the most popular (layer, expert) pairs of the whole model pinned on the GPU.

    After ``set_expert_loc`` in efeslab/fiddler ``src/fiddler/mixtral.py``: one ranking over every pair,
    not a quota per layer. Ties go to the lower layer, then the lower expert id.
    """

    name = "fiddler-popular"

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """One model-wide pool of ``total`` slots (explicit per-layer quotas are kept as given)."""
        if requested is not None:
            return SlotSpread(list(requested))
        return SlotSpread([experts] * layers, min(total, layers * experts))

    def configure(self, ctx: RunContext) -> None:
        if ctx.pool is None:  # per-layer quotas asked for: each layer's hottest, as static-hot
            super().configure(ctx)
            return
        from moesim.policy.future import expert_frequencies  # pure numpy over the trace file
        if not self.calibration:
            ctx.notes.append("fiddler-popular: popular experts counted on the replayed trace itself "
                             "(set cache.calibration=PATH for a separate calibration trace)")
        freq = expert_frequencies(self.calibration or ctx.trace_path, ctx.model)
        # stable sort of the flattened (layer, expert) grid: equal counts keep layer-major, expert order
        ranked = np.argsort(-freq.ravel(), kind="stable")[:ctx.pool]
        experts = ctx.model.num_experts
        self._hot = [[] for _ in ctx.capacity]
        for flat in sorted(int(i) for i in ranked):
            self._hot[flat // experts].append(flat % experts)


@register_component
@dataclass
class FiddlerAssign(Assignment):
    """Resident experts on the GPU; others copied over when that beats the CPU, else on the CPU."""

    name = "fiddler"
    #: copy a cold expert to the GPU when that beats the CPU (false: every cold expert on the CPU, 001's setup)
    copy_cold: bool = True

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        costs = view.costs
        gpu, cpu = [], []
        for expert, tokens in zip(view.active, view.counts):
            if view.resident(expert):
                gpu.append(expert)
                continue
            if not self.copy_cold:
                cpu.append(expert)
                continue
            t_gpu = costs.expert_load + costs.gpu_expert(tokens) + view.expert_launch_s
            (gpu if costs.cpu_expert(tokens) > t_gpu else cpu).append(expert)
        return gpu, cpu


register_system("fiddler", SystemSpec(
    "Fiddler (baseline of 001): the model's most popular (layer, expert) pairs pinned on the GPU; a cold expert is "
    "copied over when T_CPU > T_PCIe + T_GPU (long prompts), else computed on the CPU",
    cache="fiddler-popular", assign="fiddler", defaults=(("engine.staging_slots", "1"),), runtime="pytorch-eager"))
