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

Floors 1 and 2 are here; floor 3 is in moesim.sim.window_floors, and what
they share (a member's traits, its costs, the split of a layer's experts) in
moesim.sim.floor_parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.policy.base import active_experts
from moesim.policy.catalog.bounds import balanced_groups
from moesim.sim.engine import Simulator
from moesim.sim.floor_parts import MemberCosts, Traits
from moesim.sim.shape import TraceShape, Windows
from moesim.sim.window_floors import window_terms
from moesim.trace.io import iter_steps
# ----------------------------------------------------------------------------- per-step floors
def step_floors(sim: Simulator, shape: TraceShape) -> np.ndarray:
    """Seconds each step of ``shape`` lasts at least when ``sim`` replays it (floor 1 of the module docstring)."""
    return _balanced_floors(sim, shape, MemberCosts.of(sim))


def _balanced_floors(sim: Simulator, shape: TraceShape, parts: MemberCosts) -> np.ndarray:
    traits = Traits.of(sim)
    layer_memo: dict[tuple, tuple[float, list[tuple[float, float, int]]]] = {}

    def layer(tokens: int, counts: tuple[int, ...], phase: str) -> tuple[float, list[tuple[float, float, int]]]:
        """(GPU-stream seconds before routed experts plus, unless deferred, the layer's expert balance;
        the experts as (gpu, cpu, how many) when they are balanced over the step instead)."""
        key = (tokens, counts, phase)
        value = layer_memo.get(key)
        if value is None:
            shared = parts.shared(tokens, phase)
            groups: list[tuple[float, float, int]] = []
            if traits.keeps_routing or tokens == 1:
                groups = parts.expert_groups(counts, phase)
            if traits.defers:
                value = layer_memo[key] = (shared, groups)
            else:
                least = float(parts.split_costs(tokens, counts, phase, traits, groups).min())
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

def placed_floors(sim: Simulator, shape: TraceShape, parts: MemberCosts, on_gpu: list[set[int]]) -> np.ndarray:
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


def _placed_decode_floors(sim: Simulator, shape: TraceShape, parts: MemberCosts, mask: np.ndarray,
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
        parts = MemberCosts.of(sim, shared)
        traits = Traits.of(sim)
        floors = _balanced_floors(sim, shape, parts)
        if traits.placed and shape.path:
            on_gpu = [set(r) for r in sim.cache.resident] if traits.placement == "resident" else \
                [set() for _ in sim.cache.resident]
            floors = np.maximum(floors, placed_floors(sim, shape, parts, on_gpu))
        fixed = parts.fixed_all(shape)
        extra_span, extra_tpot = window_terms(sim, shape, windows or Windows(), floors, fixed)
        return cls(floors, extra_span, extra_tpot)
