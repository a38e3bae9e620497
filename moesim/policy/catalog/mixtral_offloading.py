"""Mixtral-offloading baseline (Eliseev and Mazur, arXiv 2312.17238; github.com/dvmazur/mixtral-offloading).

What the open-source cache does (its ``ExpertCache``): each MoE layer is an
eviction group with a fixed number of GPU slots, filled at load time with the
layer's first experts; every routed expert is marked used (least recently used
order per layer); experts already on the GPU run first, missing ones are
swapped in, each replacing the layer's least recently used expert, while the
GPU computes; nothing runs on the CPU. In moesim terms that is an ``lru``
cache with ``initial`` = first ids, every expert on the GPU (``gpu``),
resident experts first in the plan, which is exactly what ``gpu-only-lru``
already does: ``mixtral-offloading`` is that composition under the project's
own name, plus the speculative loading below as an option.

Speculative expert loading (tech report Sec. 3.2): the next layer's gate
applied to the current hidden state guesses its experts, which are loaded
early. The repository lists it as not yet available, so it is off by default;
``--set prefetch=speculative`` turns it on (``pred_next_layer`` column,
``prefetch.size`` guesses per layer, 2 = Mixtral's top-k).

Not modelled, because the engine has no mechanism for it: a swap also copies
the evicted expert back to pinned host memory (device-to-host traffic beside
each load). Experts in the report are HQQ-quantized; replay with
``--set memory.expert_dtype=int4`` (or the closest dtype) to match.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesim.policy.base import LayerView, RunContext
from moesim.policy.catalog.importance import ranked_predictions, require_column
from moesim.policy.prefetch import Prefetch
from moesim.policy.systems import SystemSpec, register_component, register_system


@register_component
@dataclass
class SpeculativePrefetch(Prefetch):
    """Speculative loading of the next layer's guessed experts (2312.17238 Sec. 3.2)."""

    name = "speculative"
    columns = ("pred_next_layer",)
    #: guessed experts loaded per layer
    size: int = 2
    _layers: int = 0

    def configure(self, ctx: RunContext) -> None:
        require_column(ctx, "pred_next_layer", "prefetch 'speculative'", "the next layer's gate on this layer's input")
        self._layers = ctx.model.num_layers

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        predicted = view.predictors.get("pred_next_layer")
        if view.layer + 1 >= self._layers or not predicted:
            return []
        return [(view.layer + 1, e) for e in ranked_predictions(predicted)[:self.size]]


register_system("mixtral-offloading", SystemSpec(
    "Mixtral-offloading's open-source expert cache: per-layer LRU over fixed GPU slots (first experts loaded "
    "first), every expert on the GPU, resident experts first; speculative next-layer loading with "
    "--set prefetch=speculative", cache="lru", assign="gpu", runtime="pytorch-eager"))
