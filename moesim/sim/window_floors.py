"""Floor 3 of moesim.sim.floors: per window of consecutive decode steps, the copies or CPU work that the
experts beyond those a member's memory holds cost (the docstring there says why it holds)."""

from __future__ import annotations

import numpy as np

from moesim.sim.engine import Simulator
from moesim.sim.floor_parts import MemberCosts, Traits, split_envelope
from moesim.sim.shape import TraceShape, Windows


def window_terms(sim: Simulator, shape: TraceShape, windows: Windows, floors: np.ndarray,
                 fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Floor 3 of moesim.sim.floors: for each ``k``, what the windows starting at or after step ``k`` add
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
    """Per window length of ``windows``: seconds each window lasts at least (floor 3 of moesim.sim.floors:
    :func:`window_need` and, for a member that does not defer, :func:`split_window_need`); ``fixed``: each
    step's work outside its experts (``MemberCosts.fixed_all``). Empty for a member the windows do not bind."""
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
    parts, ids = MemberCosts.of(sim), {}
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
    :func:`split_envelope` (floor 3 of moesim.sim.floors, its experts' split and copies together).

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
    the CPU (``cpu`` at least) (floor 3 of moesim.sim.floors). With ``n`` misses on the CPU and ``k``
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
