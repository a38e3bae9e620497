"""DALI: workload-aware offloading (003_46c415738ddfa491.txt, Sec. 4).

Components:

* ``dali-greedy`` (assign, Sec. 4.1, Alg. 1): each activated expert costs
  ``t_cpu(w)`` on the CPU and ``t_gpu(w) = max(transfer, compute)`` on the GPU
  (Eq. 5-6; transfer 0 when the expert is cached, its remaining time when it
  is arriving); experts in descending ``|t_gpu - t_cpu|`` order go to the GPU
  when ``T_gpu + t_gpu <= T_cpu + t_cpu``, else to the CPU. Alg. 1 line 5 does
  not say how equal differences are ordered; here they keep the layer's order
  (most tokens first, then lower id), so the result is deterministic.
* ``dali-optimal`` (assign, Eq. 3-9): the exact minimum of
  ``max(T_gpu, T_cpu)`` over all assignments, by branch and bound over groups
  of identical experts (exact; no solver dependency). Eq. 9 (GPU memory) never
  binds here: GPU experts that are not cached go through the staging buffers.

Decision time: both are charged on the critical path of every layer (category
``predict``: the breakdown's decision-time slot, 000 Sec. VI-E) as 003 reports
it, a share of end-to-end time: 4.50% for greedy (Table 6, App. A.4), 55% for
the exact solve (Sec. 6.3); see :class:`SolveClock`. ``assign.solve_share``
changes the share, ``assign.solve_us`` charges a fixed time per layer instead
(0: free).
* ``dali-residual`` (prefetch, Sec. 4.2): the experts of the next layer with
  the largest predicted workload (tokens predicting them in ``pred_residual``,
  the residual-corrected gate of Eq. 10; the residual vectors of Eq. 11 are
  fitted when the trace is captured), ``size`` of them; none after the last
  layer. One of them already on the GPU or arriving needs no copy, and the
  next one down is not taken in its place: the paper picks the top experts by
  predicted workload, then prefetches them. 003 Sec. 6.3 (4) names two costs of the prediction: an extra
  gate call, charged on the layer's critical path as one gate GEMM (``CostModel.gate``, roofline) and one
  kernel launch of the runtime (``prefetch.gate_cost=false``: free), and a CUDA stream switch, not charged:
  the paper gives no figure for it.
* ``dali-workload`` (cache, Sec. 4.3, Alg. 2): per layer, workload scores
  (tokens per expert) summed over a window of ``w_size`` iterations; at the end
  of each window the ``u_size`` highest-scoring experts not cached replace the
  ``u_size`` lowest-scoring cached ones, and the scores restart at zero. The
  initial cached set is ``cache_size`` experts drawn at random per layer
  (Sec. 4, "we randomly select"), seeded by the run's seed.

Per-model settings (``cache.u_size`` and ``prefetch.size`` at -1, the default): 003 Fig. 12 and
Sec. 6.4 run Mixtral with ``u_size`` 1 and a prefetch size of 1, DeepSeek and Qwen with 8 and 4
(``w_size`` 4 for all); a model of another family takes the setting of the paper's models nearest in
experts per layer (Mixtral's 8, or DeepSeek-V2-Lite's 64 and Qwen3-30B-A3B's 128, Table 3), and the
report says so. The breakdown of Fig. 19 prefetches 8 experts on Qwen; the main comparison (Fig. 12)
prefetches 4, and that is the setting taken.

The ``dali`` system (:class:`DaliSystem`) keeps DALI's structure: the cache
changes only through Alg. 2; a GPU expert that is not cached is transferred
for this use only (streamed through the staging buffers, Fig. 9's E3/E7),
unless the window's swap takes it into the cache in the same plan (below);
prefetched experts land in a model-wide prefetch buffer of ``cache.prefetch_slots``
slots (default: twice the prefetch size, so the next layer's prefetch never
overwrites the experts the current layer is using; with another prefetcher swapped in,
twice what it issues per layer, ``Prefetch.issued_per_layer``, e.g. smoe-token's ``n``,
or twice the model's top-k, with a note, for one whose count no parameter fixes), apart from the cache: the
buffer is its own part of the one GPU memory budget (``moesim.sim.memory``), not
carved out of the cache, so a cache of 1 slot per layer holds 1 expert per layer.
When the buffer is full, the entry whose layer comes round last in the forward
pass makes room. Used as a plain cache in another system (``--set
cache=dali-workload``) the component evicts the lowest window score and
admits the highest, and sees the layers whose plan ran experts on the GPU.

Interpretation of Alg. 2 (003 Sec. 4.3):

* the printed loop tests ``i mod w_size == 0`` from ``i = 0``, which would
  replace after the first token; the text says "after processing a window of
  w_size tokens", which is what is done. "Token" is one forward pass of the
  batch (Fig. 11 sums a batch's sequences per token): a prefill pass is one
  iteration whose workload is every prompt token's (the paper's loop runs over
  generated tokens and does not say how the prompt counts). Line 7's EOS ends
  a request, not the batch's windows;
* line 11 prints ``TopK`` of the cached experts' scores, the text takes the
  ``u_size`` lowest: the lowest go (ties: lower id first, as among the
  incoming experts);
* a swap happens only where the incoming expert's window score exceeds the
  outgoing one's (``strict=True``, default). Alg. 2 pairs the two lists
  unconditionally, so it would copy in experts of score 0 whenever fewer than
  ``u_size`` uncached experts were used, and drop a cached expert for one that
  did less work in the window, both against the stated aim of maximising the
  cache's use while paying a PCIe copy; ``cache.strict=false`` is the literal rule;
* a cached expert the layer is computing with on the GPU, or whose copy has not
  landed, is not evicted (the next lowest goes): the swap is planned inside the
  layer that closes the window, and evicting either would take weights from
  under a running kernel or copy; the paper swaps between tokens and says nothing
  of this case;
* an incoming expert that the same layer computes on the GPU and would
  otherwise stream (neither cached nor arriving) is copied once, straight into
  the cache slot its swap frees (``plan.loads``), not streamed and copied
  again. Alg. 2 line 13's transfer and Sec. 4's load of an uncached GPU expert
  (Fig. 9's E3/E7) would move the same weights in one layer; the swap is
  planned before the layer's copies start, and Sec. 4.3 lets a cached expert
  serve the GPU with no transfer of its own. The cache ends up holding the
  same experts;
* the swap's copies are queued before the same plan's residual prefetches for
  the next layer (the paper orders neither); both wait behind demand copies.

``cache_size`` (Sec. 4) is ``cache.slots_per_layer`` (default: as many as fit
beside the buffer); 003's runs cache 50% of each layer's experts (Fig. 12) or
25% (Fig. 19), e.g. ``--set cache.slots_per_layer=32`` on DeepSeek-V2-Lite.
Not modelled: the beam search of App. A.2 (an alternative 003 tried and set
aside) and Sec. 6.5's multi-GPU runs.

The assignment lives in ``assign.py``, the prefetch and the cache in ``workload.py``, the system here.
"""

from __future__ import annotations

from moesim.model.spec import ModelSpec
from moesim.policy.base import LayerPlan, LayerView, RunContext, split_plan
from moesim.policy.cache import SlotSpread
from moesim.policy.catalog.dali import assign  # noqa: F401 - registers dali-greedy and dali-optimal
from moesim.policy.catalog.dali.workload import ResidualPrefetch, WorkloadAwareCache
from moesim.policy.catalog.importance import ObservingSystem
from moesim.policy.prefetch import NoPrefetch
from moesim.policy.systems import SystemSpec, register_system


# ----------------------------------------------------------------------------- the system
class DaliSystem(ObservingSystem):
    """DALI's planning steps (003 Sec. 4, Fig. 9); see the module docstring."""

    #: (layer, expert) pairs that may be buffer entries: prefetched, and not yet found cached or gone
    _buffer_pairs: set[tuple[int, int]]
    #: whether every layer was looked at once for uncached experts (the run may start with some)
    _scanned: bool = False

    #: the model's top-k, the buffer's unit for a prefetcher that fixes no count (set by for_model)
    _top_k: int = 1

    def for_model(self, model: ModelSpec) -> None:
        super().for_model(model)  # the prefetcher resolves its count for the model first
        self._top_k = model.top_k

    def configure(self, ctx: RunContext) -> None:
        super().configure(ctx)
        self._buffer_pairs, self._scanned = set(), False
        if self._buffer_by_default() and self.prefetch.issued_per_layer is None:
            ctx.notes.append(f"dali: prefetch '{self.prefetch.name}' loads no fixed number of experts per layer; "
                             f"the prefetch buffer holds twice the model's top-k, {self._buffer()} slots "
                             "(set cache.prefetch_slots)")

    def _has_buffer(self) -> bool:
        """Whether there is a prefetch buffer: DALI's own cache and a prefetcher, not swapped out."""
        return isinstance(self.cache, WorkloadAwareCache) and not isinstance(self.prefetch, NoPrefetch)

    def _buffer_by_default(self) -> bool:
        """Whether the buffer exists and is sized from the prefetcher (``cache.prefetch_slots`` at -1)."""
        return self._has_buffer() and self.cache.prefetch_slots < 0

    def _buffer(self) -> int:
        """Slots of the prefetch buffer (0 when another cache or no prefetch is swapped in): the prefetcher's
        ``issued_per_layer`` twice over, or twice the model's top-k when it fixes no number (a batch's
        predictions decide; one token's routing is the unit then)."""
        if not self._has_buffer():
            return 0
        if self.cache.prefetch_slots >= 0:
            return self.cache.prefetch_slots
        # any prefetcher's count, resolved for the model (smoe-token's n, hybrimoe-layer's n, eam-match's
        # lookahead x per_layer): sizing from a `size` field alone gave smoe-token 2 slots whatever its n,
        # top-score none (its size 0 means no cap) and next-layer at -1 a negative buffer
        issued = self.prefetch.issued_per_layer
        return 2 * (self._top_k if issued is None or issued < 0 else issued)

    def reserved_slots(self, layers: int) -> int:
        return self._buffer()

    def spread(self, total: int, layers: int, experts: int, requested: list[int] | None = None) -> SlotSpread:
        """The cache's quotas, each layer allowed the buffer on top (at most all its experts), the whole
        held to cache + buffer; the cache itself fills its own quotas."""
        buffer = self._buffer()
        cache = self.cache.spread(total, layers, experts, requested)
        if not buffer:
            return cache
        return SlotSpread([min(q + buffer, experts) for q in cache.capacity], sum(cache.capacity) + buffer,
                          cached=list(cache.capacity))

    def _place(self, view: LayerView) -> LayerPlan:
        cache = self.cache
        if not isinstance(cache, WorkloadAwareCache):
            return super()._place(view)  # another cache swapped in: the generic steps
        window_closed = cache.observe(view)
        gpu, cpu = self.assign.split(view)
        plan = split_plan([], cpu)  # every layer: without calling the class
        solve_s = getattr(self.assign, "_last_solve_s", 0.0)
        if solve_s:
            plan.overhead_s["predict"] = solve_s
        resident, in_flight = view.cache.resident[view.layer], view.cache.in_flight[view.layer]
        ready = [e for e in gpu if e in resident]
        arriving = [e for e in gpu if e in in_flight and e not in resident]
        if len(arriving) > 1:  # by arrival (a stable sort, as sorted() is)
            arriving.sort(key=lambda e: view.arrivals.get(e, 0.0))
        plan.streamed = [e for e in gpu if e not in resident and e not in in_flight]
        plan.gpu = ready + arriving + plan.streamed
        if window_closed:
            self._swap(view, plan, set(gpu))
            if plan.loads:  # loads are placed before the staged copies: the GPU takes them first
                plan.gpu = ready + arriving + plan.loads + plan.streamed
        self._prefetch(view, plan)
        if self._prefetching and isinstance(self.prefetch, ResidualPrefetch):  # another prefetch: its own cost
            predict_s = self.prefetch.prediction_s(view)
            if predict_s:
                plan.overhead_s["predict"] = plan.overhead_s.get("predict", 0.0) + predict_s
        return plan

    def _swap(self, view: LayerView, plan: LayerPlan, in_use: set[int]) -> None:
        """The window's replacement: evict the dropped experts, load the new ones (or promote them
        from the prefetch buffer, where they already are). A new one this layer streams is loaded into
        its cache slot instead (``plan.loads``, taken out of ``plan.streamed``): one copy, not two."""
        cache, layer, state = self.cache, view.layer, view.cache
        assert isinstance(cache, WorkloadAwareCache)
        protected = in_use | state.in_flight[layer]
        swaps_in, swaps_out = cache.replacement(layer, protected)
        for e in swaps_out:
            plan.evictions.append((layer, e))
        incoming = set(swaps_in)
        if plan.streamed and not incoming.isdisjoint(plan.streamed):
            plan.loads = [e for e in plan.streamed if e in incoming]  # in the GPU's order
            plan.streamed = [e for e in plan.streamed if e not in incoming]
        loading = set(plan.loads)
        for e in swaps_in:
            if e not in loading and not state.has(layer, e):
                plan.prefetches.append((layer, e))

    def _prefetch(self, view: LayerView, plan: LayerPlan) -> None:
        """Prefetched experts go to buffer slots; stale buffer entries make room, never cached experts."""
        if not self._prefetching:
            return
        state = view.cache
        wanted = self.prefetch.candidates(view)
        evicted = set(plan.evictions)
        # free slots after the plan so far: of each target's quota (found at its first need), of the whole
        room: dict[int, int] = {}
        taken = len(plan.prefetches) + len(plan.loads)  # the swap's copies, into the cache
        pool_left = None if state.pool is None else state.pool - state.held() + len(evicted) - taken
        # the buffer's entries, found at the first need: one layer's (a full quota) or every layer's (a full pool)
        entries: dict[int | None, list[tuple[int, int]]] = {}
        swaps = len(plan.prefetches)  # the window's swap-ins, cached experts
        resident, in_flight = state.resident, state.in_flight
        # what this layer copies for its own use already (a prefetcher that names the current layer, such as
        # SMoE's token-wise one swapped in, would copy it a second time)
        copied_now = set(plan.loads).union(plan.streamed) if plan.loads or plan.streamed else ()
        for target, e in wanted:
            pair = (target, e)
            held = e in resident[target] or e in in_flight[target]
            if (held and pair not in evicted) or pair in plan.prefetches or (target == view.layer and e in copied_now):
                continue
            if target not in room:
                room[target] = self._quota_left(view, plan, target, evicted)
            full = room[target] <= 0
            if full or (pool_left is not None and pool_left <= 0):
                where = target if full else None
                if where not in entries:
                    entries[where] = self._buffer_entries(view, where)
                found = entries[where]
                stale = self._stale_entry(view, plan, where, wanted, evicted, found) if found else None
                if stale is None:
                    entries[where] = []  # none now, and the plan only takes more away: none later either
                    continue
                plan.evictions.append(stale)
                evicted.add(stale)
                if stale[0] in room:
                    room[stale[0]] += 1
                if pool_left is not None:
                    pool_left += 1
            plan.prefetches.append(pair)
            room[target] -= 1
            if pool_left is not None:
                pool_left -= 1
        self._buffer_pairs.update(plan.prefetches[swaps:])  # after the loop: not in flight before the plan runs

    def _quota_left(self, view: LayerView, plan: LayerPlan, target: int, evicted: set[tuple[int, int]]) -> int:
        """Free slots of ``target``'s quota after this plan so far."""
        state = view.cache
        dropped = sum(1 for (l, _) in evicted if l == target)
        queued = sum(1 for (l, _) in plan.prefetches if l == target)
        if target == view.layer:
            queued += len(plan.loads)  # the window's swap-ins loaded into this layer's cache
        return state.capacity[target] - state.used(target) + dropped - queued

    def _buffer_entries(self, view: LayerView, layer: int | None = None) -> list[tuple[int, int]]:
        """Every (layer, expert) resident and not cached: what the prefetch buffer holds (in ``layer`` alone
        when given)."""
        cache, resident = self.cache, view.cache.resident
        assert isinstance(cache, WorkloadAwareCache)
        if layer is not None:
            return [(layer, x) for x in resident[layer] - cache.cached(layer)]
        kept, in_flight = cache.cached_sets(), view.cache.in_flight
        if not self._scanned:  # the first time, every layer
            self._buffer_pairs.update((l, x) for l, (held, cached) in enumerate(zip(resident, kept))
                                      if not held <= cached for x in held - cached)
            self._scanned = True
        # only a prefetch puts an uncached expert in a layer, so the entries are among the prefetched pairs;
        # a pair leaves them once its expert is cached, or neither resident nor arriving
        entries = []
        for pair in list(self._buffer_pairs):
            l, x = pair
            if x in resident[l]:
                if x in kept[l]:
                    self._buffer_pairs.discard(pair)
                else:
                    entries.append(pair)
            elif x not in in_flight[l]:
                self._buffer_pairs.discard(pair)
        return entries

    def _stale_entry(self, view: LayerView, plan: LayerPlan, layer: int | None, wanted: list[tuple[int, int]],
                     evicted: set[tuple[int, int]], entries: list[tuple[int, int]]) -> tuple[int, int] | None:
        """A buffer entry (of ``entries``) nobody needs now: in ``layer`` when given, else the one whose
        layer comes round last in the forward pass."""
        if not entries:
            return None
        busy = set(wanted) | evicted | {(view.layer, x) for x in plan.gpu}
        stale = [(l, x) for l, x in entries if (layer is None or l == layer) and (l, x) not in busy]
        if not stale:
            return None
        turns = view.cache.num_layers
        return max(stale, key=lambda p: ((p[0] - view.layer - 1) % turns, -p[1]))


register_system("dali", SystemSpec(
    "DALI (003): greedy CPU/GPU assignment, residual-based prefetch into a buffer, workload-aware cache "
    "replacement over token windows; uncached GPU experts are transferred for one use",
    cache="dali-workload", assign="dali-greedy", prefetch="dali-residual", system_class=DaliSystem,
    runtime="ktransformers-eager"))
