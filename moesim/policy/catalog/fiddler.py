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
alone, which a prefill copying its heavy experts to the GPU would not show). Difference from the
original that the engine imposes: Fiddler picks the popular experts globally over
(layer, expert) pairs, moesim gives every layer the same number of slots, so the
hottest experts are taken per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesim.policy.assign import Assignment
from moesim.policy.base import LayerView
from moesim.policy.systems import SystemSpec, register_component, register_system


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
    "Fiddler (baseline of 001): profiled hot experts pinned on the GPU; a cold expert is copied over when "
    "T_CPU > T_PCIe + T_GPU (long prompts), else computed on the CPU",
    cache="static-hot", assign="fiddler", defaults=(("engine.staging_slots", "1"),), runtime="pytorch-eager"))
