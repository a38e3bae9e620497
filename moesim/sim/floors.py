"""Floors of a portfolio member's remaining steps: time it spends whatever it plans (moesim.sim.portfolio).

Every member replays the same steps (:class:`TraceShape`, moesim.sim.shape). After ``k`` steps, a
member's bound on a metric is its exact record so far plus a floor on the
steps left; the tighter the floor, the earlier a member that cannot be best is
stopped. Three floors, each taken from the engine's own costs
(moesim.sim.engine) and each at most what the engine can produce:

1. Per step, any member (:func:`step_floors`): the runtime's host work and
   launches, embedding, dense layers, LM head and sampling; per MoE layer its
   launches and attention, which run before its experts, then its shared and
   routed experts: each routed expert runs on the GPU for at least
   ``gpu_expert(n)`` plus its launch or on the CPU for at least
   ``cpu_expert(n)``, so a layer lasts at least the fractional balance of GPU
   stream and CPU (``balanced_groups``) and, each expert whole on one side and
   the CPU's experts a sync after the attention, the least over how many go to
   the CPU of the longer side (:func:`split_costs`). A member that defers CPU
   experts past their layer (001 Sec. 4) balances them over the whole step
   instead. A member
   that rewrites routing (002, 004) counts the routed experts of single-token
   layers only (a token keeps ``top_k`` distinct experts, one token each).
2. Per step, a member whose placement is fixed (:func:`placed_floors`): a
   plain composition that never prefetches nor rewrites routing and puts every
   routed expert on the CPU (``AllCPU``) or the resident ones on the GPU and
   the rest on the CPU (``ResidentOnGPU``). It never copies an expert, so the
   experts resident at its start stay so, every layer's split is known, and a
   layer lasts exactly its launches and attention, then the longer of GPU
   stream (shared experts, GPU experts) and CPU (one synchronisation, CPU
   experts); with deferral, the step is at least every layer's GPU side, and
   at least the GPU side up to some layer plus one synchronisation and the CPU
   work of that layer and all later ones (the CPU works one expert at a time
   and starts a layer's experts a synchronisation after its attention; later
   layers' synchronisations may run beside CPU work still under way).
3. Per window of consecutive decode steps, a member that never rewrites
   routing (:class:`Windows`, :func:`window_terms`; a system with a planning
   step of its own is taken to prefetch and split as it likes, since only the
   memory plan and the engine bind it): at most
   ``memory.slots`` experts (per layer: the layer's quota, when the member has
   no pool and no reserved buffer) are held when a window starts, resident or
   in flight; each other (layer, expert) the window uses is copied inside it
   (one copy engine's time ``tau`` each, spread over the engines) or computed
   on the CPU (``c``, the least CPU time of one expert), at least once. With
   ``M`` such misses and ``F`` the window's fixed work (host work, launches and
   attention, during which the CPU runs nothing unless the member defers), the
   window lasts at least the least over splits of ``M`` into copies and CPU
   experts of what its resources need (:func:`window_need`): every expert on the
   GPU without prefetch, ``F + tau M`` (a layer's copies run after its attention
   and before its end); without prefetch, ``F + M c tau / (c + tau)`` (a layer
   lasts the longer of its CPU experts and its copies); with prefetch, copies may
   overlap anything: ``max(F, tau (F + c M) / (c + tau))``. A member that does
   not defer, in a window whose MoE layers are all alike (one-token decoding),
   pays its copies and its experts' split together (:func:`split_window_need`):
   the window lasts at least ``tau K`` for its ``K`` copied misses, and at least
   ``F`` plus each layer's :func:`split_costs` with the other misses among its
   CPU experts; spread evenly over the layers (the costs' convex envelope), the
   least over ``K`` of the longer of the two. With few CPU experts free beside
   the GPU's (DeepSeek-V3 int4 on rtx4090 under ``ktransformers-eager``: one of
   a layer's 8), misses past them cost a CPU expert or a copy each.

   Each window length (1, 2, 4, ... steps) partitions every decode run; the
   windows that start at or after step ``k`` bound the steps they cover, the
   other steps keep their per-step floors, and the best length counts
   (:class:`MemberFloors`). The mean TPOT weighs a window by the fewest
   requests of its steps.

Left out besides (each only lengthens a step): waits, DRAM sharing, decision
overheads, and the synchronisations of a member that defers outside floor 2.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from moesim.policy.assign import AllCPU, AllGPU, ResidentOnGPU
from moesim.policy.base import active_experts
from moesim.policy.catalog.bounds import balanced_groups
from moesim.policy.prefetch import NoPrefetch
from moesim.policy.systems import ComposedSystem, NoDeferral, NoSubstitution
from moesim.sim.engine import Simulator
from moesim.sim.shape import TraceShape, Windows
from moesim.trace.io import iter_steps

# ----------------------------------------------------------------------------- what a member is
@dataclass(frozen=True)
class Traits:
    """What a member's composition guarantees about its schedule (the module docstring)."""

    #: its routed experts are what the trace routes
    keeps_routing: bool
    #: CPU work may run past its layer
    defers: bool
    #: a plain composition (``ComposedSystem`` itself: no planning step of its own)
    plain: bool
    #: never copies ahead of the layer that uses the copy
    no_prefetch: bool
    #: "cpu": every routed expert on the CPU; "resident": resident ones on the GPU; "gpu": every one on
    #: the GPU; "": any split
    placement: str

    @classmethod
    def of(cls, sim: Simulator) -> Traits:
        system = sim.system
        plain = type(system) is ComposedSystem
        assign = getattr(system, "assign", None)
        placement = {AllCPU: "cpu", ResidentOnGPU: "resident", AllGPU: "gpu"}.get(type(assign), "")  # type: ignore
        # a system with a planning step of its own may place and copy as it likes: only what every plan
        # obeys holds for it (the engine runs deferral from ``defer`` alone, whoever plans)
        return cls(keeps_routing=isinstance(system.substitute, NoSubstitution),
                   defers=not isinstance(system.defer, NoDeferral), plain=plain,
                   no_prefetch=plain and isinstance(system.prefetch, NoPrefetch),
                   placement=placement if plain else "")

    @property
    def placed(self) -> bool:
        """Every layer's split is known from the experts resident at the start (placed floors)."""
        return self.plain and self.keeps_routing and self.no_prefetch and self.placement in ("cpu", "resident")

    @property
    def windowed(self) -> bool:
        return self.keeps_routing


# ----------------------------------------------------------------------------- per-step floors
@dataclass
class _Costs:
    """A member's memoised costs of the parts of a step (the engine's own figures)."""

    sim: Simulator
    #: attention seconds by (tokens, context) and the GPU work outside the MoE layers by (tokens, context,
    #: sequences), shared by members with the same profile, model and non-expert dtype (the only inputs of
    #: ``CostModel.attention`` and ``CostModel.step_fixed``); each member's set-up builds its own profile
    #: object, so profiles are told apart by value (their text, the profile before overrides included)
    attention_memo: dict = field(default_factory=dict)
    head_memo: dict = field(default_factory=dict)
    #: the member's own runtime costs of a step by phase (:meth:`_launches`)
    launch_memo: dict = field(default_factory=dict)
    #: :meth:`split_costs` by (layer tokens, token counts of its routed experts, phase)
    split_memo: dict = field(default_factory=dict)

    @classmethod
    def of(cls, sim: Simulator, shared: dict | None = None) -> _Costs:
        costs = sim.costs
        profile = costs.profile
        key = (repr(profile), repr(profile.base), costs.model, costs.non_expert_dtype)
        return cls(sim, {} if shared is None else shared.setdefault(key, {}))

    def attention(self, tokens: int, context: int) -> float:
        key = (tokens, context)
        value = self.attention_memo.get(key)
        if value is None:
            value = self.attention_memo[key] = self.sim.costs.attention(tokens, context)
        return value

    def head_tail(self, key: tuple[int, int, int, str]) -> float:
        """Host work, launches and GPU work of a step outside its MoE layers."""
        value = self.head_memo.get(key)
        if value is None:
            step_launch, dense_launches, host = self._launches(key[3])
            value = self.head_memo[key] = self._outside_gpu(key[:3]) + step_launch + dense_launches + host
        return value

    def _outside_gpu(self, key: tuple[int, int, int]) -> float:
        """GPU work of a step outside its MoE layers, by (tokens, context, sequences)."""
        value = self.attention_memo.get(key)
        if value is None:
            value = self.attention_memo[key] = sum(self.sim.costs.step_fixed(*key).values())
        return value

    def _launches(self, phase: str) -> tuple[float, float, float]:
        """The member's own runtime costs of a step: its graph launch, its dense layers' launches, host work."""
        launches = self.launch_memo.get(phase)
        if launches is None:
            costs = self.sim.costs
            launches = self.launch_memo[phase] = (costs.step_launch(phase),
                                                self.sim.model.num_dense_layers * costs.layer_launches(phase),
                                                costs.host_per_step)
        return launches

    def alike_steps(self, layer_tokens: int, steps: list[int], shape: TraceShape) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`head_tail` of each of ``steps`` and :meth:`attention` of ``layer_tokens`` tokens at its
        context, as arrays (the steps' GPU work kept for members alike)."""
        key = ("steps", layer_tokens, tuple(steps))
        shared = self.attention_memo.get(key)
        if shared is None:
            gpu = [self._outside_gpu(shape.work[i][:3]) for i in steps]
            attention = [self.attention(layer_tokens, shape.work[i][1]) for i in steps]
            shared = self.attention_memo[key] = (np.array(gpu), np.array(attention))
        gpu, attention = shared
        phases = {shape.work[i][3] for i in steps}
        if len(phases) > 1:
            return np.array([self.head_tail(shape.work[i]) for i in steps]), attention
        step_launch, dense_launches, host = self._launches(phases.pop())
        return gpu + step_launch + dense_launches + host, attention  # head_tail's sum, term by term

    def shared(self, tokens: int, phase: str) -> float:
        sim = self.sim
        if not sim.model.shared_intermediate_size:
            return 0.0
        return sim.costs.gpu_shared(tokens) + sim._launch[phase][1]

    def split_costs(self, tokens: int, counts: tuple[int, ...], phase: str, traits: Traits) -> np.ndarray:
        """:func:`split_costs` of a layer of ``tokens`` tokens whose routed experts have ``counts`` tokens each."""
        key = (tokens, counts, phase)
        value = self.split_memo.get(key)
        if value is None:
            sim = self.sim
            costs, expert_launch = sim.costs, sim._launch[phase][0]
            known = traits.keeps_routing or tokens == 1  # a rewriting member keeps top_k experts of one token
            by_count = sorted(Counter(counts).items()) if known else []
            gpu = [costs.gpu_expert(n) + expert_launch for n, m in by_count for _ in range(m)]
            cpu = [costs.cpu_expert(n) for n, m in by_count for _ in range(m)]
            value = self.split_memo[key] = split_costs(self.shared(tokens, phase), np.array(gpu), np.array(cpu),
                                                       costs.sync_s, cpu_allowed=traits.placement != "gpu")
        return value

    def fixed_all(self, shape: TraceShape) -> np.ndarray:
        """:meth:`fixed` of every step (those of one kind of layer at once, by the same operations)."""
        out = np.empty(len(shape.work))
        for (((layer_tokens, _), m), phase), steps in shape.alike().items():
            head, attention = self.alike_steps(layer_tokens, steps, shape)
            out[steps] = head + m * (self.sim._layer_launches[phase] + attention)
        for i, kinds in enumerate(shape.layers):
            if len(kinds) != 1:
                out[i] = self.fixed(shape, i)
        return out

    def fixed(self, shape: TraceShape, i: int) -> float:
        """Step ``i``'s work outside its experts: head and tail, and every MoE layer's launches and attention."""
        tokens, context, _, phase = work = shape.work[i]
        total = self.head_tail(work)
        launch = self.sim._layer_launches[phase]
        for (layer_tokens, _), m in shape.layers[i]:
            total += m * (launch + self.attention(layer_tokens, context))
        return total


def step_floors(sim: Simulator, shape: TraceShape) -> np.ndarray:
    """Seconds each step of ``shape`` lasts at least when ``sim`` replays it (floor 1 of the module docstring)."""
    return _balanced_floors(sim, shape, _Costs.of(sim))


def _balanced_floors(sim: Simulator, shape: TraceShape, parts: _Costs) -> np.ndarray:
    costs = sim.costs
    traits = Traits.of(sim)
    layer_memo: dict[tuple, tuple[float, list[tuple[float, float, int]]]] = {}

    def layer(tokens: int, counts: tuple[int, ...], phase: str) -> tuple[float, list[tuple[float, float, int]]]:
        """(GPU-stream seconds before routed experts plus, unless deferred, the layer's expert balance;
        the experts as (gpu, cpu, how many) when they are balanced over the step instead)."""
        key = (tokens, counts, phase)
        value = layer_memo.get(key)
        if value is None:
            expert_launch = sim._launch[phase][0]
            shared = parts.shared(tokens, phase)
            groups: list[tuple[float, float, int]] = []
            if traits.keeps_routing or tokens == 1:
                groups = [(costs.gpu_expert(n) + expert_launch, costs.cpu_expert(n), m)
                          for n, m in sorted(Counter(counts).items())]
            if traits.defers:
                value = layer_memo[key] = (shared, groups)
            else:
                least = float(parts.split_costs(tokens, counts, phase, traits).min())
                value = layer_memo[key] = (max(balanced_groups(shared, groups), least), [])
        return value

    floors = np.empty(len(shape.work))
    # without deferral, steps of one kind of layer at once, by the walk's own operations
    alike = {} if traits.defers else shape.alike()
    for (((layer_tokens, counts), m), phase), steps in alike.items():
        fixed, _ = layer(layer_tokens, counts, phase)
        launch = sim._layer_launches[phase]
        head, attention = parts.alike_steps(layer_tokens, steps, shape)
        floors[steps] = head + m * (launch + attention + fixed)
    for i, (work, kinds) in enumerate(zip(shape.work, shape.layers)):
        if len(kinds) == 1 and alike:
            continue
        _, context, _, phase = work
        total = parts.head_tail(work)
        step_groups: list[tuple[float, float, int]] = []
        launch = sim._layer_launches[phase]
        for (layer_tokens, counts), m in kinds:
            fixed, groups = layer(layer_tokens, counts, phase)
            total += m * (launch + parts.attention(layer_tokens, context) + fixed)
            step_groups += [(g, c, n * m) for g, c, n in groups]
        floors[i] = balanced_groups(total, step_groups) if step_groups else total
    return floors


def split_costs(shared: float, gpu: np.ndarray, cpu: np.ndarray, sync: float, cpu_allowed: bool = True
                ) -> np.ndarray:
    """Per ``b`` (0 to the layer's routed experts): seconds a layer of a member that does not defer lasts at
    least past its launches and attention with ``b`` of its routed experts on the CPU (floor 1 of the module
    docstring, whole experts).

    Each routed expert runs wholly on one side (``engine.check``: "each routed expert computed once, on one
    side"). The GPU stream runs the ``shared`` experts, then each GPU expert for at least its ``gpu`` seconds
    (its launch included); the CPU starts a ``sync`` after the attention and runs its experts one after another,
    each for at least its ``cpu`` seconds; the layer ends after both. Whichever ``b`` experts go to the CPU,
    the GPU side is at least ``shared`` plus all ``gpu`` less the ``b`` largest, and the CPU side at least
    ``sync`` plus the ``b`` smallest ``cpu``: the longer of the two. ``cpu_allowed`` False (every expert on the
    GPU): ``b`` = 0 only."""
    gpu_left = shared + float(gpu.sum()) - np.concatenate([[0.0], np.cumsum(np.sort(gpu)[::-1])])
    cpu_side = np.concatenate([[0.0], sync + np.cumsum(np.sort(cpu))])
    out = np.maximum(gpu_left, cpu_side)
    return out if cpu_allowed else out[:1]


def split_envelope(costs: np.ndarray) -> np.ndarray:
    """The greatest convex, non-decreasing function under ``costs`` (a layer's :func:`split_costs`), at 0, 1, ...:
    the least ``costs[b']`` over ``b' >= b`` (at least ``b`` experts on the CPU), then its lower convex hull."""
    at_least = np.minimum.accumulate(costs[::-1])[::-1]
    hull: list[int] = []
    for i, y in enumerate(at_least.tolist()):
        # drop the last hull point while it lies on or above the chord from the one before it to (i, y)
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (at_least[b] - at_least[a]) * (i - a) >= (y - at_least[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.interp(np.arange(len(costs)), hull, at_least[hull])


def placed_floors(sim: Simulator, shape: TraceShape, parts: _Costs, on_gpu: list[set[int]]) -> np.ndarray:
    """Floor 2 of the module docstring: each step of a member whose GPU experts are those of ``on_gpu`` (per
    layer) that the layer routes, the others on the CPU."""
    costs, defers = sim.costs, Traits.of(sim).defers
    sync = costs.sync_s
    layers = len(on_gpu)
    mask = np.zeros((layers, sim.model.num_experts), dtype=bool)
    for layer, experts in enumerate(on_gpu):
        mask[layer, sorted(experts)] = True
    every_layer = np.arange(layers)
    floors = np.empty(len(shape.work))
    done = _placed_decode_floors(sim, shape, parts, mask, floors, defers)
    left = np.flatnonzero(~done)
    for i, step in enumerate(iter_steps(shape.path, columns=()) if len(left) else ()):
        if i > left[-1]:
            break
        if done[i]:
            continue
        tokens, context, _, phase = work = shape.work[i]
        expert_launch = sim._launch[phase][0]
        launch = sim._layer_launches[phase]
        if step.rows == layers and np.array_equal(step.layer, every_layer):  # one token: a row per layer
            gpu_n = mask[every_layer[:, None], step.experts].sum(axis=1)
            cpu_n = step.experts.shape[1] - gpu_n
            before = np.full(layers, launch + parts.attention(1, context))
            gpu_side = parts.shared(1, phase) + gpu_n * (costs.gpu_expert(1) + expert_launch)
            cpu_side = np.where(cpu_n > 0, cpu_n * costs.cpu_expert(1) + (0.0 if defers else sync), 0.0)
            floors[i] = parts.head_tail(work) + _layers_floor(before.tolist(), gpu_side.tolist(),
                                                              cpu_side.tolist(), defers, sync)
            continue
        before, gpu_list, cpu_list = [], [], []
        for layer, rows in step.layers():
            n_rows = rows.stop - rows.start
            if n_rows == 1:
                active, counts = step.experts[rows.start].tolist(), [1] * step.experts.shape[1]
            else:
                active, counts = active_experts(step.experts[rows], sim.model.num_experts)
            resident = on_gpu[layer]
            gpu = parts.shared(n_rows, phase)
            cpu = 0.0
            for e, n in zip(active, counts):
                if e in resident:
                    gpu += costs.gpu_expert(n) + expert_launch
                else:
                    cpu += costs.cpu_expert(n)
            before.append(launch + parts.attention(n_rows, context))
            gpu_list.append(gpu)
            cpu_list.append(cpu + sync if cpu > 0 and not defers else cpu)
        floors[i] = parts.head_tail(work) + _layers_floor(before, gpu_list, cpu_list, defers, sync)
    return floors


def _placed_decode_floors(sim: Simulator, shape: TraceShape, parts: _Costs, mask: np.ndarray,
                          floors: np.ndarray, defers: bool) -> np.ndarray:
    """:func:`placed_floors` of the one-token decode steps (a row per layer, layers in order) at once, into
    ``floors``; which steps it filled. By the same operations in the same order as the step-by-step walk
    and :func:`_layers_floor` (sums and differences over the layers taken one after another), so the same
    numbers."""
    done = np.zeros(len(shape.work), dtype=bool)
    layers, num_experts = mask.shape
    if shape.decode_pairs is None or not layers:
        return done
    top_k = sim.model.top_k
    one_kind = (((1, (1,) * top_k), layers),)
    steps = [i for i, (work, kinds, pairs) in enumerate(zip(shape.work, shape.layers, shape.decode_pairs))
             if work[0] == 1 and work[3] == "decode" and kinds == one_kind and pairs.size == layers * top_k]
    if not steps:
        return done
    pairs = np.stack([shape.decode_pairs[i] for i in steps]).reshape(len(steps), layers, top_k)
    in_order = (pairs // num_experts == np.arange(layers)[None, :, None]).all(axis=(1, 2))
    steps = [i for i, ok in zip(steps, in_order.tolist()) if ok]
    if not steps:
        return done
    pairs = pairs[in_order]
    costs = sim.costs
    gpu_n = mask.ravel()[pairs].sum(axis=2)
    cpu_n = top_k - gpu_n
    before = np.array([sim._layer_launches["decode"] + parts.attention(1, shape.work[i][1]) for i in steps])
    gpu_side = parts.shared(1, "decode") + gpu_n * (costs.gpu_expert(1) + sim._launch["decode"][0])
    cpu_side = np.where(cpu_n > 0, cpu_n * costs.cpu_expert(1) + (0.0 if defers else costs.sync_s), 0.0)
    before = np.repeat(before[:, None], layers, axis=1)
    if defers:
        layer_sums = _deferring_layers_floor(before, gpu_side, cpu_side, costs.sync_s)
    else:
        layer_sums = np.cumsum(before + np.maximum(gpu_side, cpu_side), axis=1)[:, -1]  # in layer order
    floors[steps] = np.array([parts.head_tail(shape.work[i]) for i in steps]) + layer_sums
    done[steps] = True
    return done


def _deferring_layers_floor(before: np.ndarray, gpu: np.ndarray, cpu: np.ndarray, sync: float) -> np.ndarray:
    """:func:`_layers_floor` with deferral of many steps at once (a row each), its running sums kept."""
    steps = before.shape[0]
    gpu_prefix = np.cumsum(before + gpu, axis=1)
    done = gpu_prefix[:, -1]
    prefix = np.concatenate([np.zeros((steps, 1)), gpu_prefix[:, :-1]], axis=1)
    cpu_left = np.cumsum(cpu[:, ::-1], axis=1)[:, ::-1]  # from each layer on, summed from the last layer back
    return np.maximum(done, (prefix + before + cpu_left + np.where(cpu_left > 0, sync, 0.0)).max(axis=1))


def _layers_floor(before: list[float], gpu: list[float], cpu: list[float], defers: bool,
                  sync: float = 0.0) -> float:
    """MoE layers, each ``before`` then its GPU and CPU sides side by side (``cpu`` with its sync); with
    deferral, the CPU side of a layer may run on through later layers (one CPU, after the layer's
    ``before``): from any layer on, the CPU's work (``cpu`` without syncs there) follows one ``sync``, since a
    layer's experts start a sync after its ``before`` and later layers' syncs may run beside CPU work."""
    if not defers:
        return sum(b + max(g, c) for b, g, c in zip(before, gpu, cpu))
    best = done = sum(b + g for b, g in zip(before, gpu))
    cpu_left, left = [], 0.0
    for c in reversed(cpu):  # the order of the vectorised walk's reversed cumulative sum
        left += c
        cpu_left.append(left)
    cpu_left.reverse()
    prefix = 0.0
    for b, g, c_left in zip(before, gpu, cpu_left):
        best = max(best, prefix + b + c_left + (sync if c_left > 0 else 0.0))
        prefix += b + g
    return max(best, done)


# ----------------------------------------------------------------------------- window floors
def window_terms(sim: Simulator, shape: TraceShape, windows: Windows, floors: np.ndarray,
                 fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Floor 3 of the module docstring: for each ``k``, what the windows starting at or after step ``k`` add
    to the makespan's and to the mean TPOT's sums of step floors (seconds; TPOT entries weighted)."""
    steps = len(floors)
    extra_span, extra_tpot = np.zeros(steps + 1), np.zeros(steps + 1)
    weight = shape.decode_weight
    cum = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
    floors_at, tpot_at = cum(floors), cum(floors * weight)
    for length, need in window_needs(sim, shape, windows, fixed).items():
        starts, ends, _ = windows.by_length[length]
        span = floors_at[ends] - floors_at[starts]
        tpot = tpot_at[ends] - tpot_at[starts]
        fewest = windows.fewest(length, weight)
        for extra, add in ((extra_span, np.maximum(need - span, 0.0)),
                           (extra_tpot, np.maximum(need * fewest - tpot, 0.0))):
            at = np.zeros(steps + 1)
            np.add.at(at, starts, add)
            np.maximum(extra, np.cumsum(at[::-1])[::-1], out=extra)
    return extra_span, extra_tpot


def window_needs(sim: Simulator, shape: TraceShape, windows: Windows, fixed: np.ndarray) -> dict[int, np.ndarray]:
    """Per window length of ``windows``: seconds each window lasts at least (floor 3 of the module docstring:
    :func:`window_need` and, for a member that does not defer, :func:`split_window_need`); ``fixed``: each
    step's work outside its experts (``_Costs.fixed_all``). Empty for a member the windows do not bind."""
    traits = Traits.of(sim)
    if not traits.windowed or not windows.by_length or sim.memory.ignores_memory:
        return {}
    memory, costs = sim.memory, sim.costs
    nbytes = costs.expert_bytes
    tau = min(costs.h2d(nbytes), sim.pcie.duration(nbytes)) / max(sim.profile.pcie.copy_engines, 1)
    most = max((t for t, _, _, p in shape.work if p == "decode"), default=1)
    c = min(costs.cpu_expert(n) for n in range(1, most + 1))
    per_layer = memory.pool is None and not memory.reserved_slots
    fixed_at = np.concatenate([[0.0], np.cumsum(fixed)])
    kind_of, layers_at, envelopes = _step_kinds(sim, shape, traits)
    run_of = np.cumsum(np.concatenate([[0], kind_of[1:] != kind_of[:-1]]))  # runs of steps of one kind
    out = {}
    for length, (starts, ends, distinct) in windows.by_length.items():
        if per_layer:
            quota = np.asarray(memory.capacity[:distinct.shape[1]], dtype=np.int64)
            misses = np.maximum(distinct - quota, 0).sum(axis=1)
        else:
            misses = np.maximum(distinct.sum(axis=1) - memory.slots, 0)
        window_fixed = fixed_at[ends] - fixed_at[starts]
        need = window_need(traits, window_fixed, misses, tau, c)
        # windows whose steps all have one kind of layer (one-token decoding): their experts' split too
        kind = np.where(run_of[starts] == run_of[ends - 1], kind_of[starts], -1)
        for k, envelope in enumerate(envelopes):
            one = kind == k
            if one.any():
                layers = layers_at[ends[one]] - layers_at[starts[one]]
                need[one] = np.maximum(need[one], split_window_need(window_fixed[one], misses[one], layers,
                                                                    envelope, tau))
        out[length] = need
    return out


def _step_kinds(sim: Simulator, shape: TraceShape, traits: Traits) -> tuple[np.ndarray, np.ndarray, list]:
    """For :func:`split_window_need`: per step, the index of its one kind of MoE layer (-1: a step with
    several kinds, or not decoding, or a member that defers); the MoE layers before each step (a running sum);
    and per kind the :func:`split_envelope` of its :func:`split_costs`."""
    steps = len(shape.work)
    kind_of = np.full(steps, -1, dtype=np.int64)
    layers = np.zeros(steps + 1)
    envelopes: list[np.ndarray] = []
    if traits.defers:
        return kind_of, layers, envelopes
    parts, ids = _Costs.of(sim), {}
    for i, (work, kinds) in enumerate(zip(shape.work, shape.layers)):
        if len(kinds) == 1 and work[3] == "decode":
            (tokens, counts), m = kinds[0]
            k = ids.get((tokens, counts))
            if k is None:
                k = ids[(tokens, counts)] = len(envelopes)
                envelopes.append(split_envelope(parts.split_costs(tokens, counts, "decode", traits)))
            kind_of[i], layers[i + 1] = k, m
    return kind_of, np.cumsum(layers), envelopes


def split_window_need(fixed: np.ndarray, misses: np.ndarray, layers: np.ndarray, envelope: np.ndarray,
                      tau: float) -> np.ndarray:
    """Seconds windows of a member that does not defer last at least, each window of ``layers`` MoE layers
    alike (one kind: the same tokens and routed experts' token counts), ``fixed`` seconds outside the layers'
    experts, ``misses`` (layer, expert) pairs beyond those held at its start, and ``envelope`` the layers'
    :func:`split_envelope` (floor 3 of the module docstring, its experts' split and copies together).

    With ``K`` misses copied in the window and ``b_j`` experts of its layer ``j`` on the CPU: each copy takes
    ``tau`` of the copy engines inside the window (it starts after the window does, or it would be held at its
    start, and lands before the expert's first use in it), so the window lasts at least ``tau K``, whatever
    else the copies overlap; each other miss runs on the CPU in some layer of the window, so ``sum b_j >=
    misses - K``; and the window lasts at least ``fixed`` plus each layer's :func:`split_costs` at its
    ``b_j``, at least ``fixed + layers * envelope(b)`` with ``b`` = (misses - K) / layers (the envelope is
    convex and non-decreasing: Jensen). So the window lasts at least the least over ``b`` in [0, the layer's
    routed experts] (K = misses - layers b >= 0) of the longer of ``tau (misses - layers b)`` and ``fixed +
    layers envelope(b)``: one falls and the other rises in ``b``, so on each piece of the envelope the least is
    where they cross, or the piece's end next to it.
    """
    experts = len(envelope) - 1
    most = np.minimum(experts, misses / layers)  # b at K = 0
    copies = lambda b: tau * (misses - layers * b)  # noqa: E731
    if not experts:
        return np.maximum(copies(0.0), fixed + layers * envelope[0])
    best = np.full(len(fixed), np.inf)
    for i in range(experts):
        slope = envelope[i + 1] - envelope[i]
        base = fixed + layers * (envelope[i] - slope * i)  # the piece's line: base + layers slope b
        denominator = layers * (tau + slope)
        cross = np.divide(tau * misses - base, denominator, out=np.full(len(fixed), float(i)),
                          where=denominator > 0)
        b = np.clip(cross, i, np.minimum(i + 1, most))
        value = np.maximum(copies(b), base + layers * slope * b)
        best = np.where(most >= i, np.minimum(best, value), best)
    return best


def window_need(traits: Traits, fixed: np.ndarray, misses: np.ndarray, tau: float, cpu: float) -> np.ndarray:
    """Seconds windows last at least with ``fixed`` seconds of host work, launches and attention and
    ``misses`` experts beyond those held at their start, each copied (``tau`` per copy and engine) or run on
    the CPU (``cpu`` at least) (floor 3 of the module docstring). With ``n`` misses on the CPU and ``k``
    copied (``n + k >= misses``), the window lasts at least:

    * every expert on the GPU: ``fixed + tau k`` without prefetch (a layer's copies run after its
      attention, before its end), else the longer of ``fixed`` and ``tau k``;
    * no prefetch: ``fixed`` plus, per layer, the longer of its CPU experts and its copies, at least
      ``c tau / (c + tau)`` per miss; with deferral the CPU may run on through later layers' attention:
      the longer of ``fixed + tau k`` and ``c n``;
    * prefetch: the longer of ``fixed + c n`` (no deferral; else ``fixed`` and ``c n``) and ``tau k``;

    each at its least over ``k``.
    """
    if traits.placement == "gpu":
        return fixed + tau * misses if traits.no_prefetch else np.maximum(fixed, tau * misses)
    if cpu + tau <= 0:
        return fixed
    either = cpu * tau / (cpu + tau)  # max(c n, tau k) over n + k = 1 at its least
    if traits.no_prefetch:
        if traits.defers:
            return np.maximum(fixed, cpu * (fixed + tau * misses) / (cpu + tau))
        return fixed + misses * either
    if traits.defers:
        return np.maximum(fixed, misses * either)
    return np.maximum(fixed, tau * (fixed + cpu * misses) / (cpu + tau))


@dataclass
class MemberFloors:
    """A member's floors: per step (what TTFT sums), and the window terms the makespan and TPOT add."""

    steps: np.ndarray
    #: per ``k``: seconds the windows from step ``k`` on add to the steps' floors (makespan), and the TPOT's
    #: request-weighted seconds
    extra_span: np.ndarray
    extra_tpot: np.ndarray

    @classmethod
    def of(cls, sim: Simulator, shape: TraceShape, windows: Windows | None = None,
           shared: dict | None = None) -> MemberFloors:
        """Floors of ``sim`` (a placed member must have started: its floors need the experts it starts with).
        ``shared``: cost tables members share (one dict for all)."""
        parts = _Costs.of(sim, shared)
        traits = Traits.of(sim)
        floors = _balanced_floors(sim, shape, parts)
        if traits.placed and shape.path:
            on_gpu = [set(r) for r in sim.cache.resident] if traits.placement == "resident" else \
                [set() for _ in sim.cache.resident]
            floors = np.maximum(floors, placed_floors(sim, shape, parts, on_gpu))
        fixed = parts.fixed_all(shape)
        extra_span, extra_tpot = window_terms(sim, shape, windows or Windows(), floors, fixed)
        return cls(floors, extra_span, extra_tpot)
