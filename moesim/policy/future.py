"""Whole-trace knowledge for bounds and profile-guided policies (pure numpy, read from the file)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from moesim.model.spec import ModelSpec
from moesim.trace.io import read_table

NEVER = 1 << 62


def _routing(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = read_table(path, ["step", "layer", "experts"])
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
    #: per step, the MoE layers it routes, in order (all of the model's, unless the trace logged only some)
    layers_of: dict[int, list[int]]

    @classmethod
    def load(cls, path: str | None, model: ModelSpec) -> "FutureRouting":
        if path is None:
            raise ValueError("future routing needs the trace path")
        return _load_future(str(path), Path(path).stat().st_mtime_ns, model.num_layers, model.num_experts)

    def next_use(self, layer: int, expert: int, from_step: int) -> int:
        steps = self.uses[layer].get(expert)
        if not steps:
            return NEVER
        i = bisect_left(steps, from_step)
        return steps[i] if i < len(steps) else NEVER

    def next_position(self, step: int, layer: int) -> tuple[int, int] | None:
        """The (step, layer) that runs after this one, if any: the step's next layer in the trace, else the
        next step's first (a trace that logged only some of the model's layers replays only those)."""
        layers = self.layers_of.get(step, [])
        i = bisect_right(layers, layer)
        if i < len(layers):
            return step, layers[i]
        i = bisect_left(self.step_order, step + 1)
        if i < len(self.step_order):
            following = self.step_order[i]
            return following, self.layers_of[following][0]
        return None


@lru_cache(maxsize=4)
def _load_future(path: str, mtime_ns: int, num_layers: int, num_experts: int) -> FutureRouting:
    """Whole-trace routing, vectorised; cached because a bound's components all read the same trace."""
    steps, layers, experts = _routing(path)
    top_k = experts.shape[1]
    position = np.repeat(steps.astype(np.int64) * num_layers + layers, top_k)
    code, counts = np.unique(position * num_experts + experts.ravel(), return_counts=True)
    key, expert = code // num_experts, code % num_experts
    # per (step, layer): most tokens first, then lower id
    order = np.lexsort((expert, -counts, key))
    key_o, experts_in_order = key[order], expert[order].tolist()
    starts, ends = _runs(key_o)
    routed = {(step, layer): experts_in_order[a:b] for step, layer, a, b in
              zip(*(x.tolist() for x in np.divmod(key_o[starts], num_layers)), starts.tolist(), ends.tolist())}
    # per (layer, expert): the steps that use it, in order
    step_of, layer_of = key // num_layers, key % num_layers
    pair = layer_of * num_experts + expert
    # (layer, expert, step) is unique per use, so one sort key orders them as a lexsort would, faster
    order = np.argsort(pair * (int(step_of.max(initial=0)) + 1) + step_of)
    pair, steps_in_order = pair[order], step_of[order].tolist()
    starts, ends = _runs(pair)
    uses: list[dict[int, list[int]]] = [dict() for _ in range(num_layers)]
    for layer, e, a, b in zip(*(x.tolist() for x in np.divmod(pair[starts], num_experts)), starts.tolist(),
                              ends.tolist()):
        uses[layer][e] = steps_in_order[a:b]
    layers_of: dict[int, list[int]] = {}
    for step, layer in routed:  # in (step, layer) order, as the keys were sorted
        layers_of.setdefault(step, []).append(layer)
    return FutureRouting(uses=uses, routed=routed, step_order=np.unique(steps).astype(int).tolist(),
                         layers_of=layers_of)


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of each run of equal neighbours in ``values``."""
    if not len(values):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(values)) + 1
    return np.concatenate(([0], cuts)), np.concatenate((cuts, [len(values)]))

