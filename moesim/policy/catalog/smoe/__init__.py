"""SMoE: hybrid CPU/GPU MoE inference with dynamic expert caching (000_dba2fecbbc66318b.txt).

Systems:

* ``smoe``: prefill places each expert by the rule of Alg. 1 (GPU when
  ``T_CPU(e) > T_GPU(e) + T_PCIe``) and streams the GPU experts through the
  engine's two staging buffers (the ping-pong pipeline of Alg. 1 / Fig. 7);
  decode applies the same rule with T_PCIe zero for a cached expert and
  infinite for a miss (SMoE never loads on demand while decoding, Sec. IV-C),
  so hits run on the GPU wherever it is the faster device and misses on the
  CPU; it starts from a cache of the experts each layer used most in the
  prefill (Sec. IV-E) and refreshes it with token-wise prefetch (Sec. IV-D)
  under Fixed-N LFU eviction (the setting of Sec. VI-D), two experts per layer
  (Table I).
* ``smoe-flex``: the same, with prefetch switched off on the half of the layers
  where the token-wise predictor is least accurate and three experts prefetched
  on the others (Sec. IV-D, VI-D, VI-F).

Timing of the decode cache updates (Sec. IV-E): token-wise prefetches enter
the transfer queue once the layer's GPU experts have finished
(``LayerPlan.prefetch_after_gpu``) and have the rest of the forward pass,
until the same layer of the next token, to arrive. The decode cache is filled
when the prefill ends (Sec. IV-E: the slots are allocated only then and take
the layer's most activated prefill experts as the first cache): the plan of a
prefill pass's last layer queues, for every layer, its most used prefill
experts, after that layer's GPU work; these fill transfers count as
prefetches. Prompts prefilled back to back (000 runs one request at a time)
are one prefill: their counts add up until a decode step. Token-wise prefetch
runs from the first decode step on.

Cache size: Sec. IV-E sizes the decode cache by the GPU memory left over; the
eight experts per layer of Sec. VI-D are what a 24 GB RTX 4090 left beside
4-bit DeepSeek-V3 (Sec. IV-D). moesim takes the slots its memory plan leaves on
the replayed profile; ``cache.slots_per_layer=8`` sets the paper's.

The predictor (Sec. IV-D: an MLP shaped like the MoE gate; Sec. IV-E: started
on the GPU as soon as the layer's attention output is there) is charged on
every decode layer that predicts, as ``predict`` time (Sec. VI-E's
``predict_time``), ahead of the layer's experts on both devices (the plan,
and with it the CPU thread, waits for it; Fig. 13 stacks it into the layer's
time, 000 does not say whether it overlaps the gate): by default the roofline
time of a gate-shaped GEMV (hidden x experts, bf16) on the profile's GPU plus
two kernel launches (the linear layer and its top-k); the paper calls it
negligible and gives no figure, so ``prefetch.predict_us`` overrides it.

Prefetch count per layer (``prefetch.n``) follows Table I / Sec. VI-D: 2 on
DeepSeek-V3, 3 on Qwen3 (Sec. VI-D puts the larger count down to Qwen3's
smaller experts; moesim gives 3 to every Qwen3 model by name); other models
take 2, noted. SMoE-Flex prefetches 3 (Sec. VI-F, Fig. 15, stated for
DeepSeek-V3).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from moesim.policy.assign import Assignment
from moesim.policy.base import LayerPlan, LayerView, PerTokens, RunContext, expert_times, split_plan
from moesim.policy.cache import CachePolicy
from moesim.policy.catalog.smoe.prefetch import TokenWisePrefetch
from moesim.policy.systems import ComposedSystem, SystemSpec, register_component, register_system

# ----------------------------------------------------------------------------- cache
@register_component
@dataclass
class SMoELFUCache(CachePolicy):
    """Least-frequently-used eviction with counts of every routed token (000 Sec. IV-E).

    SMoE records expert activation frequencies in the prefill and keeps
    collecting them during decoding; victims are the resident experts with the
    fewest activations (ties, on which 000 is silent: the one routed longest
    ago, then the lower id). The cache starts empty: SMoE allocates and fills
    its slots only after the prefill.

    Never victims: an expert arriving, and the experts the current layer
    computes on the GPU. 000 replaces experts once the layer's GPU work is done,
    when those are free again; moesim's plan evicts when it is made, before
    that work, so it keeps them (they have just been counted, so they are
    rarely the least frequent anyway).
    """

    name = "smoe-lfu"
    #: per layer, each expert's eviction order (activation count, the observation that last routed to it,
    #: id), kept as the counts change: plain lists, since a layer touches its top-k experts only, where
    #: numpy's per-call overhead would exceed the work
    _order: list[list[tuple[int, int, int]]] = field(default_factory=list, repr=False)
    _clock: int = 0

    def configure(self, ctx: RunContext) -> None:
        layers, experts = ctx.model.num_layers, ctx.model.num_experts
        self._order = [[(0, 0, e) for e in range(experts)] for _ in range(layers)]
        self._clock = 0

    def initial(self, layer: int, capacity: int) -> list[int]:
        return []

    def observe(self, view: LayerView) -> None:
        """Count this layer's activations (every phase, every device)."""
        self._clock += 1
        clock, order = self._clock, self._order[view.layer]
        if view.experts.size == len(view.active):  # one token each (a decode layer of one request)
            for expert in view.active:
                order[expert] = (order[expert][0] + 1, clock, expert)
            return
        for expert, tokens in zip(view.active, view.counts):
            order[expert] = (order[expert][0] + tokens, clock, expert)

    def frequency(self, layer: int, expert: int) -> int:
        return self._order[layer][expert][0]

    def victims(self, view: LayerView, layer: int, n: int, protected: Collection[int],
                incoming: list[int] | None = None) -> list[int]:
        """``protected`` may be any collection (SMoE's decode plan passes its GPU list, not a set of it)."""
        if n <= 0:
            return []
        resident = view.cache.resident[layer]
        candidates = resident.difference(protected) if protected else resident
        # least frequent, then least recent, then lowest id
        return sorted(candidates, key=self._order[layer].__getitem__)[:n]


# ----------------------------------------------------------------------------- assignment
@register_component
@dataclass
class SMoEAssign(Assignment):
    """The expert allocation rule of 000 Alg. 1, lines 1-6: GPU when ``T_CPU(e) > T_GPU(e) + T_PCIe``.

    ``T_PCIe`` is zero for a resident expert, the remaining transfer time for
    one in flight, one expert load in the prefill (on-demand loading, Sec. IV-B)
    and infinite in decoding, where SMoE never loads on demand (Sec. IV-C: the
    transfer latency would dominate) and computes cache misses on the CPU.
    ``T_GPU`` includes the kernel launches the engine charges.

    Sec. IV-B words the same choice as a count: the top-``K`` experts by load
    go to the GPU, ``K`` chosen so that their GPU and PCIe time stays below
    their CPU time. Line 3 tests each expert on its own, with one copy each, as
    printed; the experts it picks are those with a positive saving
    ``T_CPU - T_GPU - T_PCIe``, which (the saving growing with the tokens) are
    a head of the load ranking and the ``K`` of largest total saving.
    ``queue_aware`` instead counts the copies queued ahead of each expert.
    ``G`` is kept in load order, most tokens first (the view's order), so the
    ping-pong pipeline copies the heaviest expert first.
    """

    name = "smoe"
    #: load missing experts on demand in decoding too (the paper does not)
    decode_on_demand: bool = False
    #: T_PCIe counts the copies queued ahead of an expert (this layer's loads in flight and the experts
    #: already given to the GPU, most tokens first) instead of one expert's copy alone
    queue_aware: bool = False
    #: (GPU kernel, CPU) seconds by token count, kept between layers
    _times: PerTokens | None = field(default=None, repr=False)

    def split(self, view: LayerView) -> tuple[list[int], list[int]]:
        times = self._times
        if times is None or times.costs is not view.costs:  # PerTokens.of, inline: it runs every layer
            times = self._times = PerTokens(view.costs, expert_times)
        if view.phase == "prefill" or self.decode_on_demand:
            return self._split_loading(view, times)
        # decoding: T_PCIe is 0 for a resident expert, the rest of its copy for one in flight, and infinite for
        # a miss, which runs on the CPU
        gpu, cpu = [], []
        launch, now, arrivals = view.expert_launch_s, view.now, view.arrivals
        resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
        if view.experts.size == len(view.active):  # one token each (a decode layer of one request)
            t_gpu, t_cpu = times[1]
            hit_on_gpu = t_cpu > t_gpu + launch  # the test below for every resident expert (T_PCIe 0)
            if not in_flight:  # the loop below, where no expert is arriving
                if not hit_on_gpu:
                    return gpu, list(view.active)
                for expert in view.active:
                    (gpu if expert in resident else cpu).append(expert)
                return gpu, cpu
            for expert in view.active:
                if expert in resident:
                    (gpu if hit_on_gpu else cpu).append(expert)
                elif expert in in_flight and t_cpu > t_gpu + launch + max(arrivals.get(expert, now) - now, 0.0):
                    gpu.append(expert)
                else:
                    cpu.append(expert)
            return gpu, cpu
        for expert, tokens in zip(view.active, view.counts):
            if expert in resident:
                transfer = 0.0
            elif expert in in_flight:
                transfer = max(arrivals.get(expert, now) - now, 0.0)
            else:
                cpu.append(expert)
                continue
            t_gpu, t_cpu = times[tokens]
            if t_cpu > t_gpu + launch + transfer:  # T_GPU: kernel and launches
                gpu.append(expert)
            else:
                cpu.append(expert)
        return gpu, cpu

    def _split_loading(self, view: LayerView, times: PerTokens) -> tuple[list[int], list[int]]:
        """:meth:`split` where a missing expert is loaded (the prefill, or decoding with ``decode_on_demand``)."""
        gpu, cpu = [], []
        queue_aware, load = self.queue_aware, view.costs.expert_load
        queued = self._queue_s(view) if queue_aware else 0.0
        launch, now, arrivals = view.expert_launch_s, view.now, view.arrivals
        resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
        for expert, tokens in zip(view.active, view.counts):
            # T_PCIe: 0 resident, the rest of its copy in flight, else one expert load
            if expert in resident:
                transfer = 0.0
            elif expert in in_flight:
                transfer = max(arrivals.get(expert, now) - now, 0.0)
            else:
                transfer = load
            copies = queue_aware and transfer == load
            if copies:
                transfer += queued  # the copies queued ahead of it
            t_gpu, t_cpu = times[tokens]
            if t_cpu > t_gpu + launch + transfer:  # T_GPU: kernel and launches
                gpu.append(expert)
                if copies:
                    queued += load
            else:
                cpu.append(expert)
        return gpu, cpu

    @staticmethod
    def _queue_s(view: LayerView) -> float:
        """Time until this layer's loads already in flight have arrived."""
        return max([0.0] + [at - view.now for at in view.arrivals.values()])


# ----------------------------------------------------------------------------- system
@dataclass
class SMoESystem(ComposedSystem):
    """Prefill by Alg. 1 with ping-pong streaming; decode with a prefill-filled cache and token-wise prefetch."""

    #: per layer, token counts of the prefill steps since the last decode step
    _fill: dict[int, dict[int, int]] = field(default_factory=dict)
    #: the cache policy's activation counter (LFU's), if it keeps one
    _observe: Callable[[LayerView], None] | None = field(default=None, repr=False, compare=False)
    #: SMoE's own components on per-layer quotas: a decode plan places the split's hits and the prefetches
    #: itself (:meth:`_decode_hits`), which is what the composed plan does for them, without its general cases
    _own_decode: bool = field(default=False, repr=False, compare=False)

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        self._fill = {}
        self._observe = getattr(self.cache, "observe", None)
        assign = self.assign
        self._own_decode = (type(self.cache) is SMoELFUCache and type(assign) is SMoEAssign
                            and not assign.decode_on_demand and type(self.prefetch) is TokenWisePrefetch
                            and ctx.pool is None)

    def _place(self, view: LayerView) -> LayerPlan:
        if self._observe is not None:
            self._observe(view)
        if view.phase == "prefill":
            plan = self._prefill(view)
            if view.layer == view.num_layers - 1:
                self._fill_cache(view, plan)
            return plan
        if self._fill:  # the next prefill starts a new count
            self._fill = {}
        return self._decode_hits(view) if self._own_decode else self._decode(view)

    def _prefill(self, view: LayerView) -> LayerPlan:
        """000 Alg. 1: GPU experts in load order, resident first, the rest streamed through two buffers."""
        gpu, cpu = self.assign.split(view)
        resident = view.cache.resident[view.layer]
        plan = LayerPlan(cpu=cpu)
        ready = [e for e in gpu if e in resident]
        arriving = sorted((e for e in gpu if e in view.cache.in_flight[view.layer]),
                          key=lambda e: view.arrivals.get(e, 0.0))
        plan.streamed = [e for e in gpu if not view.cache.has(view.layer, e)]
        plan.gpu = ready + arriving + plan.streamed
        self.cache.touch(view, plan.gpu)
        counts = self._fill.setdefault(view.layer, {})
        for expert, tokens in zip(view.active, view.counts):
            counts[expert] = counts.get(expert, 0) + tokens
        return plan

    def _decode(self, view: LayerView) -> LayerPlan:
        """A decode layer's plan by the composed components (swapped-in ones), timed as SMoE's."""
        plan = super()._place(view)
        self._decode_timing(view, plan)
        return plan

    def _decode_timing(self, view: LayerView, plan: LayerPlan) -> None:
        """Sec. IV-E: the prefetch task joins the asynchronous transfer queue when the layer's GPU experts
        are done; the predictor's time, and the cache update's where the layer prefetches, go before them."""
        plan.prefetch_after_gpu = True
        prefetch = self.prefetch
        if isinstance(prefetch, TokenWisePrefetch) and prefetch.predicts(view.layer):
            plan.overhead_s["predict"] = prefetch.predict_s(view)
            if plan.prefetches and prefetch.management_us:
                plan.overhead_s["cache_management"] = prefetch.management_us * 1e-6

    def _decode_hits(self, view: LayerView) -> LayerPlan:
        """A decode layer's plan as ``ComposedSystem._place`` makes it for SMoE's components, one step at a
        time: Alg. 1's split sends only hits (resident or arriving) to the GPU, so nothing is loaded on
        demand; the GPU runs the resident ones first, then those arriving, by arrival; token-wise prefetch
        (Fixed-N) loads its picks into the layer's free slots and evicts the least frequently used for
        the rest. Timed as :meth:`_decode_timing` times it."""
        gpu, cpu = self.assign.split(view)
        plan = split_plan(gpu, cpu)
        layer, state = view.layer, view.cache
        in_flight = state.in_flight[layer]
        if in_flight and gpu:
            resident = state.resident[layer]
            ready = [e for e in gpu if e in resident]
            if len(ready) < len(gpu):
                arrivals = view.arrivals
                plan.gpu = ready + sorted((e for e in gpu if e not in resident),
                                          key=lambda e: arrivals.get(e, 0.0))
        wanted = self.prefetch.candidates(view)  # none cached: none resident, arriving or on the GPU
        if wanted:
            free = max(state.capacity[layer] - len(state.resident[layer]) - len(in_flight), 0)
            short = len(wanted) - free
            if short > 0:  # never a victim: an expert computed on the GPU here (the wanted and the arriving
                # ones are not resident, so no victims either)
                victims = self.cache.victims(view, layer, short, plan.gpu)
                evictions = plan.evictions
                for e in victims:  # a loop, not a comprehension: one or two victims, where its call costs more
                    evictions.append((layer, e))
                wanted = wanted[:free + len(victims)]  # the rest find no slot
            plan.prefetches = wanted
        # _decode_timing, inline (the prefetch is SMoE's own)
        plan.prefetch_after_gpu = True
        prefetch = self.prefetch
        if layer not in prefetch._disabled:  # prefetch.predicts(layer)
            seconds = prefetch._predict_s.get(len(view.experts))  # predict_s(view), once it has costed the tokens
            plan.overhead_s["predict"] = prefetch.predict_s(view) if seconds is None else seconds
            if wanted and prefetch.management_us:
                plan.overhead_s["cache_management"] = prefetch.management_us * 1e-6
        return plan

    def _fill_cache(self, view: LayerView, plan: LayerPlan) -> None:
        """Sec. IV-E, once the prefill ends: every layer's slots take its most used prefill experts,
        queued after this last layer's GPU work; LFU picks the victims of a layer already holding others.

        A plan cannot see whether another prefill step follows, so every prefill step fills; prompts
        prefilled back to back (then decoded together) count as one prefill: each fill ranks the
        counts of every prefill step since the last decode step, and the last one leaves the cache
        of all of them."""
        state = view.cache
        for layer, counts in sorted(self._fill.items()):
            top = sorted(counts, key=lambda e: (-counts[e], e))[:state.capacity[layer]]
            missing = [e for e in top if not state.has(layer, e)]
            room = state.free(layer)
            if len(missing) > room:
                protected = set(top) | state.in_flight[layer]
                if layer == view.layer:
                    protected |= set(plan.gpu)
                victims = self.cache.victims(view, layer, len(missing) - room, protected)
                plan.evictions += [(layer, e) for e in victims]
                room += len(victims)
            plan.prefetches += [(layer, e) for e in missing[:max(room, 0)]]
        plan.prefetch_after_gpu = True


register_system("smoe", SystemSpec(
    "SMoE (000): prefill by T_CPU > T_GPU + T_PCIe with ping-pong streaming (Alg. 1); decode with a "
    "prefill-filled LFU cache and token-wise prefetch, Fixed-N, 2 experts (3 on Qwen3) per layer (Sec. IV-D, IV-E, "
    "Table I)",
    cache="smoe-lfu", assign="smoe", prefetch="smoe-token", system_class=SMoESystem,
    runtime="ktransformers-eager"))
register_system("smoe-flex", SystemSpec(
    "SMoE-Flex (000 Sec. IV-D, VI-D): SMoE with token-wise prefetch off on the half of the layers where the "
    "predictor is least accurate (ranked online over the first decode steps, or on prefetch.calibration) and 3 "
    "experts prefetched on the rest",
    cache="smoe-lfu", assign="smoe", prefetch="smoe-token", system_class=SMoESystem,
    defaults=(("prefetch.n", "3"), ("prefetch.flex_off_fraction", "0.5")), runtime="ktransformers-eager"))
