"""Assignment components: for each activated expert, GPU or CPU."""

from __future__ import annotations

from dataclasses import dataclass

from moesim.policy.base import Component, LayerView, RunContext


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


def layer_time_estimate(view: LayerView, gpu: list[int], cpu: list[int], copy_engines: int = 1) -> float:
    """Estimated time from plan to layer end for a split, as the engine would run it.

    GPU experts resident or arriving run in arrival order; missing ones are
    loaded over the copy engines after the transfers already known.
    """
    costs = view.costs
    count = dict(zip(view.active, view.counts))
    now = view.now
    engines = sorted([now] * copy_engines)
    for at in sorted(view.arrivals.values()):
        engines[0] = max(engines[0], at)
        engines.sort()
    ready: list[tuple[float, int]] = []
    for e in gpu:
        if e in view.cache.resident[view.layer]:
            ready.append((now, e))
        elif e in view.arrivals:
            ready.append((view.arrivals[e], e))
        else:
            engines[0] += costs.expert_load
            ready.append((engines[0], e))
            engines.sort()
    gpu_t = now + (costs.gpu_shared(view.tokens) + view.shared_launch_s if costs.model.shared_intermediate_size else 0.0)
    for at, e in sorted(ready):
        gpu_t = max(gpu_t, at) + costs.gpu_expert(count[e]) + view.expert_launch_s
    cpu_t = now
    if cpu:
        cpu_t += costs.sync_s + sum(costs.cpu_expert(count[e]) for e in cpu)
    return max(gpu_t, cpu_t) - now


@dataclass
class BestSplit(Assignment):
    """The split with the shortest estimated layer time among a family of candidates (the oracle's choice).

    Candidates: every prefix of the experts ordered by how much the GPU saves
    over the CPU for them (cached ones first), which covers all on the CPU and
    all on the GPU; and resident-on-GPU, rest-on-CPU.
    """

    name = "best"
    _copy_engines: int = 1

    def configure(self, ctx: RunContext) -> None:
        self._copy_engines = ctx.costs.profile.pcie.copy_engines

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        active = list(view.active)
        costs = view.costs
        count = dict(zip(view.active, view.counts))
        resident = view.cache.resident[view.layer]

        def gpu_cost(e: int) -> float:
            ready = 0.0 if e in resident else view.arrivals.get(e, view.now + costs.expert_load) - view.now
            return max(ready, 0.0) + costs.gpu_expert(count[e]) + view.expert_launch_s

        order = sorted(active, key=lambda e: (gpu_cost(e) - costs.cpu_expert(count[e]), e))
        candidates = [(order[:i], order[i:]) for i in range(len(order) + 1)]
        present = [e for e in active if e in resident or e in view.arrivals]
        candidates.append((present, [e for e in active if e not in present]))
        best = min(candidates, key=lambda c: layer_time_estimate(view, c[0], c[1], self._copy_engines))
        return list(best[0]), list(best[1])
