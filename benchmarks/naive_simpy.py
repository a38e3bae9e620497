"""A naive per-expert SimPy model of a replay: the yardstick `replay_speed.py` compares against.

Each (step, layer) is a SimPy process: attention holds the GPU resource, then
every routed expert is its own process that, on a miss, takes the PCIe
resource for its load (LRU per layer, as ``gpu-only-lru``) and then the GPU
resource for its compute; the layer waits for all of them. This is the
straightforward way to write the simulation in SimPy (events and resource
requests per expert), with the same durations the engine uses, and it does
the work of ``gpu-only-lru``. Its speed is the baseline each catalogue system's
speed is reported against.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import simpy

from moesim.sim.run import prepare
from moesim.trace.io import iter_steps


def naive_replay(trace: str, hw: str, settings: dict[str, str]) -> tuple[int, float, float]:
    """(expert activations, wall seconds, simulated makespan) of the naive model on ``trace``."""
    sim = prepare(trace, hw, "gpu-only-lru", settings)
    costs, capacity = sim.costs, sim.memory.capacity
    env = simpy.Environment()
    gpu, pcie = simpy.Resource(env, 1), simpy.Resource(env, 1)
    caches = [OrderedDict() for _ in capacity]
    load_s = costs.expert_load
    activations = 0

    def expert(layer: int, e: int, tokens: int):
        cache = caches[layer]
        if e in cache:
            cache.move_to_end(e)
        else:
            with pcie.request() as req:
                yield req
                yield env.timeout(load_s)
            if capacity[layer] > 0:
                if len(cache) >= capacity[layer]:
                    cache.popitem(last=False)
                cache[e] = True
        with gpu.request() as req:
            yield req
            yield env.timeout(costs.gpu_expert(tokens))

    def forward():
        nonlocal activations
        for step in iter_steps(trace, columns=()):
            first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
            context = int(step.position[first].max()) + 1
            for layer, rows in step.layers():
                experts = step.experts[rows]
                with gpu.request() as req:
                    yield req
                    yield env.timeout(costs.attention(rows.stop - rows.start, context))
                ids, counts = _counts(experts)
                activations += int(experts.size)
                yield env.all_of([env.process(expert(layer, e, n)) for e, n in zip(ids, counts)])

    start = time.perf_counter()
    env.run(until=env.process(forward()))
    return activations, time.perf_counter() - start, env.now


def _counts(experts):
    import numpy as np
    ids, counts = np.unique(experts, return_counts=True)
    return ids.tolist(), counts.tolist()
