"""KTransformers (001_66a328d79a3cae8d.txt): routed experts on the CPU, attention and shared experts on the GPU.

What the engine and cost model already provide, and this module relies on:

* AMX/AVX-512 kernel switch by tokens per expert (001 Sec. 3.2):
  ``CostModel.cpu_kernel`` picks AMX from ``cpu.amx_switch_tokens`` up and
  ``cpu_expert`` reads that kernel's curve. Departure: KTransformers' kernel
  (kt-kernel/operators/amx/moe.hpp; archive/csrc/ktransformers_ext/operators/amx/moe.hpp)
  decides once per MoE call, AMX when the call's tokens exceed 4 x experts / top-k (mean
  tokens per expert above 4), so every expert of the layer runs the same kernel; the cost
  model decides per expert from its own token count. Both give the same kernel under
  uniform routing; under skewed routing (prefill, batched decode) a hot expert may run AMX
  here where KTransformers keeps AVX-512, and a cold one AVX-512 where it runs AMX.
* Shared experts on the GPU overlapping the CPU's routed experts (001 Sec. 3.3):
  the engine runs the GPU track (shared experts) and the CPU track in parallel.
* Runtime ``ktransformers`` (profile ``runtimes.ktransformers``, 001 Sec. 3.3, 6.4): the
  whole decode step in one CUDA Graph (one ``gpu.graph_launch_us`` per decode step, no
  per-kernel launches; prefill launched eagerly), the fused AVX-512/AMX kernels and
  NUMA-aware placement as the profile's CPU curves. ``--set runtime=ktransformers-eager``
  (as SMoE ran it, 000 Sec. VI-A) or ``--set hw.runtimes.ktransformers.graph=none`` turns
  the graph off; ``cpu-only`` is the same placement on the ``generic`` runtime.
* Fused MoE operator and dynamic work scheduling (001 Sec. 3.2, 6.4): the CPU pool runs a layer's
  routed experts one after another, each on all configured cores, after one sync per layer: the
  perfectly balanced outcome dynamic scheduling aims at. Departure: the imbalance of static
  scheduling (dynamic scheduling's up to 1.83x in prefill, Sec. 6.4) and the NUMA reduce-scatter
  (Sec. 3.3) are not modelled apart from the CPU curves, so no parameter turns them on or off.
* Expert Skipping, 001 Sec. 6.3's accuracy baseline (Fig. 13), is not a system here; deferral reports
  the gate-weight mass it delays (``deferred_weight_mass``) as its quality proxy.

Systems: ``ktransformers`` (no deferral, optional static GPU experts) and
``ktransformers-ed`` (Expert Deferral, 001 Sec. 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from moesim.errors import ConfigError
from moesim.policy.base import LayerPlan, LayerView, RunContext
from moesim.policy.cache import SlotSpread, StaticCache
from moesim.policy.systems import Deferral, SystemSpec, register_component, register_system
from moesim.trace.io import read_meta


@register_component
@dataclass
class KTransformersStatic(StaticCache):
    """Optional static GPU experts: the ``per_layer`` hottest experts of each layer stay on the GPU.

    KTransformers' injection rules name each module's device (001 Sec. 5), so
    some routed experts can sit on the GPU; for models without shared experts
    001 Sec. 1 picks the popular ones by offline profiling, as Fiddler does:
    here the most activated on ``calibration`` (default: the replayed trace,
    flagged in the notes). With ``per_layer=0`` (the default) every routed
    expert runs on the CPU, as in 001's evaluation (Table 1: the GPU holds
    17B of DeepSeek-V3's 671B parameters, everything but the routed experts). The memory
    plan holds ``per_layer`` slots per layer, no more: the rest of the GPU stays
    free for the KV cache (a served workload's batches).

    Departure: KTransformers' helper for GPU experts (kt-kernel/python/experts_base.py,
    ``generate_gpu_experts_masks``) takes the most activated (layer, expert) pairs of
    the whole model under one total budget, so hot layers get more; here every layer
    gets the same ``per_layer`` (001 gives no rule beyond offline profiling, Sec. 1).
    """

    name = "ktrans-static"
    sized_by: ClassVar[str] = "cache.per_layer static experts per layer"
    #: routed experts per layer kept on the GPU (0: all on the CPU, as in 001's evaluation)
    per_layer: int = 0

    def configure(self, ctx: RunContext) -> None:
        if self.per_layer < 0:
            raise ConfigError(f"cache.per_layer={self.per_layer} is negative", field="cache.per_layer",
                              fix="use 0 or more")
        if self.per_layer == 0:
            self._hot = [[] for _ in ctx.capacity]
            if self.calibration:
                # nothing is pinned, so the calibration trace would be ignored without a word
                ctx.notes.append(f"ktrans-static: cache.calibration={self.calibration} is unused: cache.per_layer=0 "
                                 "keeps every routed expert on the CPU; set cache.per_layer to pin hot experts")
            return
        room = min(ctx.capacity) if ctx.capacity else 0
        if self.per_layer > room:
            raise ConfigError(f"{self.per_layer} static GPU experts per layer do not fit: GPU memory holds "
                              f"{room} per layer", field="cache.per_layer", fix=f"use cache.per_layer <= {room}")
        super().configure(ctx)

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """The plan's quotas cut to ``per_layer``: slots this cache would never fill stay free memory."""
        quotas = super().spread(total, layers, experts, requested).capacity
        return SlotSpread([min(self.per_layer, q) for q in quotas])

    def initial(self, layer: int, capacity: int) -> list[int]:
        return self._hot[layer][:min(self.per_layer, capacity)]


#: deferred experts per token in 001 Sec. 6.3 by (model preset, expert dtype): "for DS-3, we defer 3 experts in
#: the BF16 model and 6 in the quantized model. For DS-2, we defer 4 ... For QW-2, ... 2 ... and 4". Sec. 6.1 names
#: the quantized builds: DS-3 in Int4, DS-2 (DeepSeek-V2.5-1210) and QW-2 (Qwen2-57B-A14B) in Int8; the full-precision
#: runs are BF16/FP16 (the same bytes per weight)
DEFERRED_BY_MODEL = {
    ("deepseek-v3", "bf16"): 3, ("deepseek-v3", "int4"): 6,
    ("deepseek-v2.5", "bf16"): 4, ("deepseek-v2.5", "int8"): 4,
    ("qwen2-57b-a14b", "bf16"): 2, ("qwen2-57b-a14b", "int8"): 4,
}
#: 16-bit expert dtypes: 001's full-precision runs
FULL_PRECISION = ("bf16", "fp16")


def paper_deferral(model: str, dtype: str) -> tuple[int, str] | None:
    """001 Sec. 6.3's count for ``model`` and the 001 run it comes from, or None for a model 001 did not run.

    A dtype 001 did not run for that model borrows the count of its run at the same precision class (16-bit:
    the BF16 run; 8 bits or fewer: the quantized run); the second item then names the borrowed run.
    """
    key = "bf16" if dtype in FULL_PRECISION else dtype
    if (model, key) in DEFERRED_BY_MODEL:
        return DEFERRED_BY_MODEL[model, key], ""
    runs = [d for (m, d) in DEFERRED_BY_MODEL if m == model]
    if not runs:
        return None
    borrowed = "bf16" if key == "bf16" else next(d for d in runs if d != "bf16")
    return DEFERRED_BY_MODEL[model, borrowed], borrowed


@register_component
@dataclass
class ExpertDeferral(Deferral):
    """Expert Deferral (001 Sec. 4.1): each token's ``deferred`` lowest-scoring routed experts finish
    while the next layer runs; the top ``k - deferred`` are immediate.

    Only in decoding (prefill would nearly double the experts touched, Sec. 4.1),
    never at the model's last MoE layer (its output has no later layer to merge into,
    and Sec. 4.1 keeps it whole "to preserve critical information"), and only experts
    computed on the CPU. A trace that logs some layers only (an imported per-layer log)
    ends its steps at a layer the model follows with others: 001 defers there, so this
    does too, and the gate-weight mass counts it; the layers its deferred experts would
    overlap are not replayed, so the step waits for them (the engine) and the deferral
    gains no time at that layer, which a note says. Routing slots are ordered by gate score,
    so a token's deferred experts are its last ``deferred`` slots; with several
    tokens in a step an expert is deferred only when every token routed to it
    has it among its deferred slots (the engine defers whole experts), as
    KTransformers' ``select_deferred_experts`` (kt-kernel/python/experts_base.py)
    makes an expert immediate for the whole batch when any token keeps it. There the
    deferred task is queued on the CPU after the immediate one and writes into the
    next layer's output buffer, which that layer's immediate pass adds onto; the
    layer's sync waits for the immediate task only. The engine does the same: one
    CPU queue in submission order, deferred results joining the next layer's output.
    The engine reports the gate-weight mass deferred (a quality proxy).
    """

    name = "ktrans-deferral"
    phases = ("decode",)
    columns = ("weights",)
    #: deferred experts per token; -1: the count 001 Sec. 6.3 used for the model and expert dtype
    #: (DEFERRED_BY_MODEL; another dtype of those models borrows its precision class's count, noted), else
    #: 3 (Sec. 4.2's DeepSeek-V3 BF16 count) cut to keep at least 2 immediate (none for top-2): Sec. 4.2's
    #: rule, the fewest deferred experts that saturate the CPU, needs a measurement of the CPU's idle time a
    #: replay makes only after the count is fixed
    deferred: int = -1
    #: the run's deferred experts per token (``deferred`` resolved for the model)
    count: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.count = self.deferred  # the value asked for, until a run resolves -1 for its model

    def configure(self, ctx: RunContext) -> None:
        # resolved per run, so that a component configured again for another model takes that model's count
        self.count = self.deferred
        if self.count < 0:
            chosen = paper_deferral(ctx.model.name, ctx.costs.dtype)
            if chosen is not None:
                self.count, borrowed = chosen
                if borrowed:
                    ctx.notes.append(f"ktrans-deferral: 001 Sec. 6.3 ran {ctx.model.name} with no {ctx.costs.dtype} "
                                     f"experts; {self.count} deferred expert(s) per token, the count of its "
                                     f"{borrowed} run; set defer.deferred to override")
            else:
                self.count = max(min(3, ctx.model.top_k - 2), 0)
                ctx.notes.append(f"ktrans-deferral: 001 Sec. 6.3 gives no deferral count for {ctx.model.name}; "
                                 f"{self.count} deferred expert(s) per token: Sec. 4.2's DeepSeek-V3 count (3), "
                                 f"keeping at least 2 of top-{ctx.model.top_k} immediate; set defer.deferred to "
                                 f"override")
        if not 0 <= self.count < ctx.model.top_k:
            raise ConfigError(f"defer.deferred={self.count} leaves no immediate expert of top-{ctx.model.top_k}",
                              field="defer.deferred", fix=f"use 0..{ctx.model.top_k - 1}; 001 Sec. 4.2 keeps at "
                              f"least 2 immediate: 0..{max(ctx.model.top_k - 2, 0)}")
        if self.count:
            self._note_partial_trace(ctx)
        if self.count and ctx.model.top_k - self.count < 2:
            ctx.notes.append(f"ktrans-deferral: {self.count} deferred of top-{ctx.model.top_k} leaves "
                             f"{ctx.model.top_k - self.count} immediate expert per token; 001 Sec. 4.2 and 6.3 "
                             f"keep at least 2 immediate for model stability")

    def _note_partial_trace(self, ctx: RunContext) -> None:
        """A note when the trace logs some of the model's layers only and its last logged one is not the model's
        last: deferral there overlaps layers the replay does not run, so it gains no time there."""
        if ctx.trace_path is None:
            return
        present = read_meta(ctx.trace_path).source.get("layers_present")
        if not isinstance(present, list) or not present or max(present) >= ctx.model.num_layers - 1:
            return
        ctx.notes.append(f"ktrans-deferral: the trace logs {len(present)} of the model's {ctx.model.num_layers} MoE "
                         f"layers; at its last logged layer ({max(present)}) experts are deferred as 001 defers them "
                         f"at every layer but the model's last, and the step waits for them, since the layers they "
                         f"would overlap are not replayed: deferral gains no time there")

    def choose(self, view: LayerView, plan: LayerPlan) -> list[int]:
        if view.phase != "decode" or view.layer == view.num_layers - 1 or self.count <= 0:
            return []
        # a decode layer holds a few tokens: plain sets of their slots
        split = view.experts.shape[1] - self.count
        immediate = set(view.experts[:, :split].ravel().tolist())
        late = set(view.experts[:, split:].ravel().tolist()) - immediate
        return [e for e in plan.cpu if e in late]


register_system("ktransformers", SystemSpec(
    "KTransformers (001 Sec. 3): routed experts on the CPU (AMX/AVX-512 by tokens per expert), attention and "
    "shared experts on the GPU, one CUDA Graph per decode step; cache.per_layer static GPU experts (default 0)",
    cache="ktrans-static", assign="resident", runtime="ktransformers"))
register_system("ktransformers-ed", SystemSpec(
    "KTransformers with Expert Deferral (001 Sec. 4): each token's defer.deferred lowest-score experts "
    "overlap the next layer; decode only, never the last layer",
    cache="ktrans-static", assign="resident", defer="ktrans-deferral", runtime="ktransformers"))
