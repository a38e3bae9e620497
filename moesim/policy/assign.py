"""Assignment components: for each activated expert, GPU or CPU."""

from __future__ import annotations

from dataclasses import dataclass

from moesim.policy.base import Component, LayerView


class Assignment(Component):
    role = "assign"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        """(gpu experts, cpu experts) for ``view.active``."""
        raise NotImplementedError


@dataclass
class AllCPU(Assignment):
    """Every routed expert on the CPU; attention and shared experts stay on the GPU (001 Sec. 3)."""

    name = "cpu"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        return [], list(view.active)


@dataclass
class AllGPU(Assignment):
    """Every routed expert on the GPU, loading whatever is missing."""

    name = "gpu"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        return list(view.active), []


@dataclass
class ResidentOnGPU(Assignment):
    """Resident experts on the GPU, the rest on the CPU: no transfers on the critical path (Fiddler-style)."""

    name = "resident"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        resident = view.cache.resident[view.layer]
        gpu = [e for e in view.active if e in resident]
        cpu = [e for e in view.active if e not in resident]
        return gpu, cpu


def layer_time_estimate(view: LayerView, gpu: list[int], cpu: list[int]) -> float:
    """Estimated time from plan to layer end for a split, as the engine would run it.

    GPU experts resident or arriving run in arrival order; missing ones are
    loaded back to back over PCIe after the arrivals already known.
    """
    costs = view.costs
    count = dict(zip(view.active, view.counts))
    now = view.now
    gpu_t = now + costs.gpu_shared(view.tokens)
    link_free = max([now, *view.arrivals.values()])
    ready: list[float] = []
    for e in gpu:
        if e in view.cache.resident[view.layer]:
            ready.append(now)
        elif e in view.arrivals:
            ready.append(view.arrivals[e])
        else:
            link_free += costs.expert_load
            ready.append(link_free)
    for e, at in sorted(zip(gpu, ready), key=lambda p: p[1]):
        gpu_t = max(gpu_t, at) + costs.gpu_expert(count[e]) + view.expert_launch_s
    cpu_t = now
    if cpu:
        cpu_t += costs.sync_s + sum(costs.cpu_expert(count[e]) for e in cpu)
    return max(gpu_t, cpu_t) - now


@dataclass
class BestSplit(Assignment):
    """Of a few candidate splits, the one with the shortest estimated layer time (the oracle's choice).

    Candidates: all on CPU; all on GPU; resident or arriving on GPU, the rest on
    CPU; and a greedy that adds the expert with the largest CPU cost to the GPU
    while the estimate improves.
    """

    name = "best"

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        active = list(view.active)
        present = [e for e in active if e in view.cache.resident[view.layer] or e in view.arrivals]
        candidates = [([], active), (active, []), (present, [e for e in active if e not in present])]
        gpu = list(present)
        cpu = [e for e in active if e not in present]
        count = dict(zip(view.active, view.counts))
        cpu.sort(key=lambda e: (-view.costs.cpu_expert(count[e]), e))
        best = layer_time_estimate(view, gpu, cpu)
        while cpu:
            trial_gpu, trial_cpu = gpu + [cpu[0]], cpu[1:]
            trial = layer_time_estimate(view, trial_gpu, trial_cpu)
            if trial >= best:
                break
            gpu, cpu, best = trial_gpu, trial_cpu, trial
        candidates.append((gpu, cpu))
        return min(candidates, key=lambda c: layer_time_estimate(view, c[0], c[1]))
