"""Mixtral-offloading baseline (Eliseev and Mazur, arXiv 2312.17238; github.com/dvmazur/mixtral-offloading).

What the open-source cache does (its ``ExpertCache``): each MoE layer is an
eviction group with a fixed number of GPU slots; every routed expert is marked
used (least recently used order per layer); experts already on the GPU run
first, missing ones are swapped in, each replacing the layer's least recently
used expert (see the stream note at the end); nothing runs on the CPU.

Initial residents: ``build_model.py`` offloads expert ``i`` of a layer when
``i < offload_per_layer``, so the GPU starts with each layer's *last* experts
(``mixoff-lru``: LRU, initial = the last ids; the never-used ones age by id,
as the cache's insertion order does). The cache is filled when the model is
loaded, before the first step, free as every system's initial cache.

Precision: the report quantizes with HQQ (Sec. 3.3; its speed measurements
use 2- to 4-bit experts with 4-bit attention, and the released demo
``notebooks/demo.ipynb`` 2-bit experts, group 16, and 4-bit attention
projections, group 64, with embeddings and LM head left in fp16). moesim's
narrowest dtype is int4 (group scales), so the system defaults to
``memory.expert_dtype=int4`` and ``memory.non_expert_dtype=int4``; the one
non-expert dtype also counts the embeddings and LM head in int4, 0.39 GB
less than the demo holds for Mixtral (about 4 int4 experts of GPU memory),
where bf16 would count 2.0 GB more. ``--set memory.expert_dtype=bf16 --set
memory.non_expert_dtype=bf16`` replays unquantized weights. The demo's 2-bit
experts with 8-bit scale and zero per group of 16 take about 3 bits a weight
against int4's 4.125 here, so each expert copy is about 1.375 times the demo's.

Cache size: the demo sets ``offload_per_layer = 4`` of Mixtral's 8 experts
(k = 4 resident per layer on a 16 GB GPU; 5, k = 3, on 12 GB). moesim gives
every system the slots that fit in the profile's GPU memory, so k follows the
GPU; ``--set cache.slots_per_layer=4`` replays the demo's k.

Speculative expert loading (Sec. 3.2): the next layer's gate applied to the
current hidden state guesses its experts, which are loaded early. The
repository lists it as not yet available, so it is off by default;
``--set prefetch=speculative`` turns it on (``pred_next_layer`` column, else the
request's previous token's experts at the next layer stand in, noted;
``prefetch.size`` guesses per layer, 2 = Mixtral's top-k).

A swap also copies the evicted expert back to pinned host memory: ``ExpertCache._swap``
issues the host-to-device copy of the loaded expert and the device-to-host copy of the
evicted one on the same stream, one after the other. The plan lists each evicted expert
as a write-back (``LayerPlan.writebacks``); the engine puts its device-to-host copy
(``pcie.d2h``) on the copy engine right after the load that takes its slot, so the next
load waits for it (``cache.writeback=false`` drops it). One difference: on the original's
single stream the loaded expert's kernels also queue behind the write-back issued just before
them; here the expert waits for its own load only, while the next load waits for the write-back.
More broadly, the original issues its copies on the compute stream (no stream of its own in ``src/``), and
``load_experts`` issues up to ``buffer_size - 1`` = 3 swaps before the resident experts' kernels, so the GPU
computes nothing while they copy; here copies run on the profile's copy engines and resident experts compute
meanwhile (the engine has no shared copy-and-compute stream). The gap is at most the resident experts'
compute per layer, small beside an expert's copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.cache import LRUCache
from moesim.policy.prefetch import LastTokenPredictor, Prefetch, ranked_predictions
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system

#: 2312.17238 Sec. 3.3 (HQQ experts and attention); int4 is the narrowest dtype moesim models
DEFAULT_EXPERT_DTYPE = "int4"
DEFAULT_NON_EXPERT_DTYPE = "int4"


@register_component
@dataclass
class LastExpertsLRU(LRUCache):
    """LRU per layer whose slots start with the layer's last experts (``build_model.py`` offloads
    expert ``i`` when ``i < offload_per_layer``)."""

    name = "mixoff-lru"
    #: a swap copies the evicted expert back to host memory first (``ExpertCache._swap``)
    writeback: bool = True
    _experts: int = 0

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        self._experts = ctx.model.num_experts

    def initial(self, layer: int, capacity: int) -> list[int]:
        first = max(self._experts - capacity, 0)
        return list(range(first, self._experts))


@register_component
@dataclass
class SpeculativePrefetch(Prefetch):
    """Speculative loading of the next layer's guessed experts (2312.17238 Sec. 3.2)."""

    name = "speculative"
    columns = ("pred_next_layer",)
    #: guessed experts loaded per layer
    size: int = 2
    _layers: int = 0
    _fallback: LastTokenPredictor | None = field(default=None, repr=False)

    def configure(self, ctx: RunContext) -> None:
        self._layers = ctx.model.num_layers
        self._fallback = None
        if ctx.columns and "pred_next_layer" not in ctx.columns:
            self._fallback = LastTokenPredictor()
            ctx.notes.append("speculative: the trace has no pred_next_layer column; each token is guessed to use, "
                             "at the next layer, what its request's previous token used there")

    @property
    def issued_per_layer(self) -> int | None:
        """``size``: the guessed experts loaded per layer."""
        return self.size if self.size >= 0 else None

    def candidates(self, view: LayerView) -> list[tuple[int, int]]:
        predicted = self._fallback.predict(view) if self._fallback else view.predictors.get("pred_next_layer")
        if view.layer + 1 >= self._layers or not predicted:
            return []
        return [(view.layer + 1, e) for e in ranked_predictions(predicted)[:self.size]]


@dataclass
class MixtralOffloadingSystem(ComposedSystem):
    """Every eviction is a swap: the evicted expert is written back to host memory (device-to-host)."""

    _writes_back: bool = field(default=False, init=False, repr=False)

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        # decided once per run: plan() runs for every layer of every step
        self._writes_back = bool(getattr(self.cache, "writeback", False))

    def plan(self, view: LayerView) -> LayerPlan:
        plan = super().plan(view)
        if plan.evictions and self._writes_back:
            plan.writebacks = list(plan.evictions)
        return plan


register_system("mixtral-offloading", SystemSpec(
    "Mixtral-offloading's open-source expert cache: per-layer LRU over fixed GPU slots (the last experts "
    "loaded first), every expert on the GPU, resident experts first, HQQ-style int4 experts and attention, each "
    "swap writing the evicted expert back to host memory; speculative next-layer loading with --set "
    "prefetch=speculative",
    cache="mixoff-lru", assign="gpu", system_class=MixtralOffloadingSystem,
    defaults=(("memory.expert_dtype", DEFAULT_EXPERT_DTYPE), ("memory.non_expert_dtype", DEFAULT_NON_EXPERT_DTYPE)),
    runtime="pytorch-eager"))
