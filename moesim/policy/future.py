"""Whole-trace knowledge for bounds and profile-guided policies (pure numpy, read from the file)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from moesim.model.spec import ModelSpec

NEVER = 1 << 62


def _routing(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = pq.read_table(path, columns=["step", "layer", "experts"])
    steps = table.column("step").to_numpy()
    layers = table.column("layer").to_numpy()
    experts = table.column("experts").combine_chunks()
    width = experts.type.list_size
    return steps, layers, experts.flatten().to_numpy().reshape(-1, width)


def expert_frequencies(path: str | None, model: ModelSpec) -> np.ndarray:
    """Activations per (layer, expert) over a whole trace."""
    if path is None:
        return np.zeros((model.num_layers, model.num_experts))
    _, layers, experts = _routing(path)
    flat = layers.astype(np.int64)[:, None] * model.num_experts + experts.astype(np.int64)
    counts = np.bincount(flat.ravel(), minlength=model.num_layers * model.num_experts)
    return counts.reshape(model.num_layers, model.num_experts).astype(float)


@dataclass
class FutureRouting:
    """For every (layer, expert), the sorted steps that use it; for every (step, layer), its experts."""

    uses: list[dict[int, list[int]]]
    routed: dict[tuple[int, int], list[int]]
    step_order: list[int]

    @classmethod
    def load(cls, path: str | None, model: ModelSpec) -> "FutureRouting":
        if path is None:
            raise ValueError("future routing needs the trace path")
        steps, layers, experts = _routing(path)
        uses: list[dict[int, list[int]]] = [dict() for _ in range(model.num_layers)]
        routed: dict[tuple[int, int], list[int]] = {}
        keys = steps.astype(np.int64) * model.num_layers + layers
        cuts = np.flatnonzero(np.diff(keys)) + 1
        for chunk_rows, chunk_experts in zip(np.split(np.arange(len(keys)), cuts), np.split(experts, cuts)):
            step, layer = int(steps[chunk_rows[0]]), int(layers[chunk_rows[0]])
            counts = np.bincount(chunk_experts.ravel().astype(np.int64), minlength=model.num_experts)
            active = [int(e) for e in np.lexsort((np.arange(len(counts)), -counts)) if counts[e] > 0]
            routed[(step, layer)] = active
            for e in active:
                uses[layer].setdefault(e, []).append(step)
        return cls(uses=uses, routed=routed, step_order=sorted({int(s) for s in np.unique(steps)}))

    def next_use(self, layer: int, expert: int, from_step: int) -> int:
        steps = self.uses[layer].get(expert)
        if not steps:
            return NEVER
        i = bisect_left(steps, from_step)
        return steps[i] if i < len(steps) else NEVER

    def next_position(self, step: int, layer: int, num_layers: int) -> tuple[int, int] | None:
        """The (step, layer) that runs after this one, if any."""
        if layer + 1 < num_layers and (step, layer + 1) in self.routed:
            return step, layer + 1
        i = bisect_left(self.step_order, step + 1)
        if i < len(self.step_order):
            return self.step_order[i], 0
        return None
