"""What a portfolio member is and what the parts of its steps cost: the inputs of its floors.

:class:`Traits` says what a member's composition guarantees about its schedule; :class:`MemberCosts` memoises
the engine's own costs of a step's parts; :func:`split_costs` and :func:`split_envelope` are a layer's least
time by how many of its routed experts run on the CPU. The floors themselves are in moesim.sim.floors (per
step) and moesim.sim.window_floors (per window of decode steps); moesim.sim.floors' docstring says why each
holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from moesim.policy.assign import AllCPU, AllGPU, ResidentOnGPU
from moesim.policy.prefetch import NoPrefetch
from moesim.policy.systems import ComposedSystem, NoDeferral, NoSubstitution
from moesim.sim.engine import Simulator
from moesim.sim.shape import TraceShape

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


# ----------------------------------------------------------------------------- costs of a step's parts
@dataclass
class MemberCosts:
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
    #: (GPU seconds with its launch, CPU seconds) of a routed expert by (its tokens, phase): a prefill's layers
    #: share most of their experts' token counts
    expert_memo: dict = field(default_factory=dict)

    @classmethod
    def of(cls, sim: Simulator, shared: dict | None = None) -> MemberCosts:
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

    def expert_groups(self, counts: tuple[int, ...], phase: str) -> list[tuple[float, float, int]]:
        """Routed experts of ``counts`` tokens each as (GPU seconds with its launch, CPU seconds, how many),
        by token count."""
        costs, expert_launch, memo = self.sim.costs, self.sim._launch[phase][0], self.expert_memo
        groups = []
        for n, m in sorted(Counter(counts).items()):
            times = memo.get((n, phase))
            if times is None:
                times = memo[(n, phase)] = (costs.gpu_expert(n) + expert_launch, costs.cpu_expert(n))
            groups.append((*times, m))
        return groups

    def split_costs(self, tokens: int, counts: tuple[int, ...], phase: str, traits: Traits,
                    groups: list[tuple[float, float, int]] | None = None) -> np.ndarray:
        """:func:`split_costs` of a layer of ``tokens`` tokens whose routed experts have ``counts`` tokens each
        (``groups``: their :meth:`expert_groups`, when the caller has them)."""
        key = (tokens, counts, phase)
        value = self.split_memo.get(key)
        if value is None:
            known = traits.keeps_routing or tokens == 1  # a rewriting member keeps top_k experts of one token
            if not known:
                groups = []
            elif groups is None:
                groups = self.expert_groups(counts, phase)
            how_many = [m for _, _, m in groups]
            gpu = np.repeat([g for g, _, _ in groups], how_many)
            cpu = np.repeat([c for _, c, _ in groups], how_many)
            value = self.split_memo[key] = split_costs(self.shared(tokens, phase), gpu.astype(float),
                                                       cpu.astype(float), self.sim.costs.sync_s,
                                                       cpu_allowed=traits.placement != "gpu")
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

def split_costs(shared: float, gpu: np.ndarray, cpu: np.ndarray, sync: float, cpu_allowed: bool = True
                ) -> np.ndarray:
    """Per ``b`` (0 to the layer's routed experts): seconds a layer of a member that does not defer lasts at
    least past its launches and attention with ``b`` of its routed experts on the CPU (floor 1 of moesim.sim.floors,
    whole experts).

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
