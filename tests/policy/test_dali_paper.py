"""DALI (003_46c415738ddfa491.txt) worked by hand: the cost vectors of Eq. 5-6 with the cache of Sec. 4.3,
Alg. 1 run on them, and one window of Alg. 2 turned into a layer plan by the ``dali`` system.

Costs are a stub with round numbers so every figure below can be checked on paper: a GPU kernel takes
1 s per token, the CPU 3 s per token, one expert's PCIe copy (trans_time of Eq. 6) 4 s."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.hw.cost import CostModel
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.dali.assign import DaliGreedy, expert_time_lists
from moesim.policy.catalog.dali.workload import ResidualPrefetch
from moesim.policy.state import CacheState
from moesim.policy.systems import build_system
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace


class RoundCosts:
    """1 s per token on the GPU, 3 s per token on the CPU, 4 s to copy one expert."""

    expert_load = 4.0

    def __init__(self, model):
        self.model = model

    def gpu_expert(self, tokens: int) -> float:
        return 1.0 * tokens

    def cpu_expert(self, tokens: int) -> float:
        return 3.0 * tokens

    def gate(self, tokens: int) -> float:  # the prediction's gate call is free here (its test costs it)
        return 0.0

    def launch_per_kernel(self, phase: str) -> float:
        return 0.0


def _view(rows, state, costs, step=0, now=0.0, arrivals=None, launch=0.0):
    experts = np.array(rows)
    active, counts = active_experts(experts, costs.model.num_experts)
    return LayerView(step, 0, "decode", experts, active, counts, state, costs, now=now,
                     arrivals=arrivals or {}, expert_launch_s=launch)


def test_eq5_6_cost_vectors_count_no_copy_for_a_cached_expert_and_the_rest_of_one_arriving():
    """Eq. 5: t_gpu = max(Trans, compute); Eq. 6: Trans = trans_time for an expert with work; Sec. 4.3: a
    cached expert's Trans is 0. An expert already on its way costs the copy time still to run."""
    costs = RoundCosts(tiny_model(layers=1, experts=4, top_k=2))
    state = CacheState(capacity=[4])
    state.preload(0, [0])
    # tokens: expert 0 three, expert 2 two, expert 1 one; 0 cached, 2 arriving at t = 11 (now 10), 1 on the CPU
    view = _view([[0, 2], [0, 2], [0, 1]], state, costs, now=10.0, arrivals={2: 11.0}, launch=0.5)
    experts, t_gpu, t_cpu = expert_time_lists(view)
    assert experts == [0, 2, 1]
    # 0: max(0, 3 + 0.5) = 3.5; 2: max(11 - 10, 2 + 0.5) = 2.5; 1: max(4, 1 + 0.5) = 4
    assert t_gpu == [3.5, 2.5, 4.0]
    assert t_cpu == [9.0, 6.0, 3.0]
    # Alg. 1 on these: |t_gpu - t_cpu| = 5.5, 3.5, 1 -> order 0, 2, 1
    #   0: 0 + 3.5 <= 0 + 9  -> GPU (T_gpu 3.5)
    #   2: 3.5 + 2.5 <= 0 + 6 -> GPU, the tie of line 12's "<=" (T_gpu 6)
    #   1: 6 + 4 <= 0 + 3     -> no: CPU (T_cpu 3)
    greedy = DaliGreedy(solve_us=0.0)
    assert greedy.split(view) == ([0, 2], [1])
    # without the cache (expert 0 copied too: max(4, 3.5) = 4) the copy, not the kernel, is its GPU time
    uncached = _view([[0, 2], [0, 2], [0, 1]], CacheState(capacity=[4]), costs, now=10.0, arrivals={2: 11.0},
                     launch=0.5)
    assert expert_time_lists(uncached)[1] == [4.0, 2.5, 4.0]


def test_residual_prefetch_has_nothing_to_prefetch_after_the_last_layer():
    """Sec. 4.2, Eq. 11: the last MoE layer keeps no residual vector, nothing follows it to prefetch."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    costs = RoundCosts(model)
    prefetch = ResidualPrefetch(size=2)
    prefetch.configure(RunContext(model=model, costs=costs, capacity=[4, 4], columns=("pred_residual",)))
    preds = {"pred_residual": [np.array([3, 1])]}
    view = _view([[0, 1]], CacheState(capacity=[4, 4]), costs)
    view.predictors = preds
    assert prefetch.candidates(view) == [(1, 1), (1, 3)]  # one token each: ids ascending
    view.layer = 1
    assert prefetch.candidates(view) == []


def test_one_alg2_window_becomes_an_eviction_and_a_load_in_the_dali_plan():
    """cache_size 2 (experts 0, 1), w_size 2, u_size 1, 4 experts, no prefetch; two tokens per step.

    step 0 routes (0, 2), (2, 3): workloads 0:1 2:2 3:1
    step 1 routes (2, 3), (2, 1): workloads 1:1 2:2 3:1; window scores 0:1 1:1 2:4 3:2, the window closes
    Alg. 1 at step 1 (t_gpu, t_cpu): 2 (max(4, 2) = 4, 6), 1 cached (1, 3), 3 (max(4, 1) = 4, 3);
      |diff| 2, 2, 1 -> order 2, 1, 3: 2 GPU (T_gpu 4); 1: 4 + 1 <= 0 + 3 no, CPU (3); 3: 8 <= 6 no, CPU (6)
    Alg. 2 lines 10-13: the top uncached expert, 2 (4), replaces the lowest cached one, 0 (1; 1 ties with
    it at 1 and the lower id goes): evict (0, 0), load (0, 2). Expert 2 is this layer's GPU expert too, so its
    one copy goes into the slot 0 frees (a demand load), not through a staging buffer and then again.
    """
    model = tiny_model(layers=1, experts=4, top_k=2)
    costs = RoundCosts(model)
    system = build_system("dali", {"prefetch": "none", "cache.w_size": "2", "cache.u_size": "1",
                                   "assign.solve_us": "0"})
    system.configure(RunContext(model=model, costs=costs, capacity=[2]))
    system.cache.initial(0, 2)
    system.cache._cached[0] = {0, 1}  # Sec. 4 draws them at random; fixed here
    state = CacheState(capacity=[2])
    state.preload(0, [0, 1])
    first = system.plan(_view([[0, 2], [2, 3]], state, costs, step=0))
    assert first.evictions == [] and first.prefetches == []  # the window is still open
    plan = system.plan(_view([[2, 3], [2, 1]], state, costs, step=1))
    assert plan.gpu == [2] and plan.loads == [2] and plan.streamed == [] and sorted(plan.cpu) == [1, 3]
    assert plan.evictions == [(0, 0)] and plan.prefetches == []
    assert system.cache.cached(0) == {1, 2}
    assert system.cache._scores[0].sum() == 0  # line 15: the scores restart


def test_residual_prefetch_copies_only_the_top_experts_not_already_on_the_gpu():
    """Sec. 4.2: the top-``size`` experts by predicted workload are the prefetch; one of them already cached
    needs no copy, and the next one down is not taken in its place.

    Predictions for layer 1 from three tokens: (1, 2), (1, 3), (2, 1) -> workloads 1:3 2:2 3:1, top-2 = 1, 2.
    Layer 1 caches 0 and 1, so only expert 2 is copied (into the buffer); 3 is not.
    """
    model = tiny_model(layers=2, experts=4, top_k=2)
    costs = RoundCosts(model)
    system = build_system("dali", {"prefetch.size": "2", "cache.w_size": "4", "cache.u_size": "1",
                                   "assign.solve_us": "0"})
    system.configure(RunContext(model=model, costs=costs, capacity=[2, 2], columns=("pred_residual",)))
    for layer in (0, 1):
        system.cache.initial(layer, 2)
        system.cache._cached[layer] = {0, 1}
    state = CacheState(capacity=[6, 6])  # each layer's 2 cached slots and the buffer's 4 beside them
    for layer in (0, 1):
        state.preload(layer, [0, 1])
    view = _view([[0, 1], [0, 1], [0, 1]], state, costs)
    view.predictors = {"pred_residual": [np.array([1, 2]), np.array([1, 3]), np.array([2, 1])]}
    plan = system.plan(view)
    assert plan.prefetches == [(1, 2)] and plan.evictions == []


def test_the_residual_prediction_costs_one_gate_and_one_launch_at_every_layer_but_the_last():
    """003 Sec. 6.3 (4): "prefetching requires additional gating computations for prediction". tiny_model's gate
    is 64 x 4 = 256 bf16 weights (512 B); tiny_profile's GPU reads 1,000 GB/s and computes 100 TFLOPS, both at
    0.6, and launches a kernel in 5 us. One token: max(512 flops / 6e13, 512 B / 6e11 B/s) = 0.8533 ns
    (memory-bound); 1,000 tokens: 512,000 flops / 6e13 = 8.533 ns (compute-bound). Each plus one launch."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    costs = CostModel(tiny_profile(), model)
    assert costs.gate(1) == pytest.approx(512 / 6e11)
    assert costs.gate(1000) == pytest.approx(512_000 / 6e13)
    prefetch = ResidualPrefetch(size=2)
    prefetch.configure(RunContext(model=model, costs=costs, capacity=[4, 4], columns=("pred_residual",)))
    view = _view([[0, 1]], CacheState(capacity=[4, 4]), costs)
    assert prefetch.prediction_s(view) == pytest.approx(512 / 6e11 + 5e-6)
    view.layer = 1  # the last layer predicts nothing
    assert prefetch.prediction_s(view) == 0.0
    view.layer = 0
    assert ResidualPrefetch(size=0, gate_cost=True).prediction_s(view) == 0.0  # no prefetch, no prediction
    off = ResidualPrefetch(size=2, gate_cost=False)
    off.configure(RunContext(model=model, costs=costs, capacity=[4, 4], columns=("pred_residual",)))
    assert off.prediction_s(view) == 0.0


def test_a_dali_replay_charges_the_predictions_in_the_predict_breakdown(tmp_path):
    """One request, a 4-token prompt and 6 decode tokens on two layers: seven steps each predict once (layer 0
    for layer 1). With the solver's time off (assign.solve_us=0), ``predict`` is the predictions alone:
    (gate(4) + 5 us) + 6 x (gate(1) + 5 us) = 7 x (0.8533 ns + 5 us) = 35.006 us (four tokens are memory-bound
    too); with prefetch.gate_cost=false, nothing."""
    from moesim.sim.run import simulate
    model = tiny_model(layers=2, experts=4, top_k=2)
    routing = random_routing(np.random.default_rng(3), model, requests=1, prompt=4, decode=6)
    trace = str(write_tiny_trace(tmp_path / "t.parquet", model, routing))
    costs = CostModel(tiny_profile(), model)
    settings = {"assign.solve_us": "0", "prefetch.size": "1"}
    charged = simulate(trace, tiny_profile(), "dali", settings)
    free = simulate(trace, tiny_profile(), "dali", {**settings, "prefetch.gate_cost": "false"})
    expected = (costs.gate(4) + 5e-6) + 6 * (costs.gate(1) + 5e-6)
    assert expected == pytest.approx(7 * (512 / 6e11 + 5e-6))
    assert charged.counters.breakdown["predict"] == pytest.approx(expected, rel=1e-12)
    assert free.counters.breakdown["predict"] == 0.0
    assert charged.makespan_s > free.makespan_s  # on the critical path


# ----------------------------------------------------------------------------- Alg. 2's w_size and u_size
def _windowed(w_size, u_size):
    from moesim.policy.catalog.dali.workload import WorkloadAwareCache
    model = tiny_model(layers=1, experts=8, top_k=2)
    cache = WorkloadAwareCache(w_size=w_size, u_size=u_size, prefetch_slots=0)
    cache.configure(RunContext(model=model, costs=RoundCosts(model), capacity=[4]))
    cache.initial(0, 4)
    cache._cached[0] = {0, 1, 2, 3}  # Sec. 4 draws them at random; fixed here
    return cache


#: Fig. 11's four tokens (8 experts, a batch of two sequences, cache_size 4 holding 0-3)
FIG11_TOKENS = [[[0, 4], [4, 5]], [[0, 3], [4, 5]], [[3, 4], [2, 5]], [[0, 4], [5, 7]]]


@pytest.mark.parametrize("w_size,u_size,swaps,final", [
    # Fig. 11's (w_size 4, u_size 2): one window; scores 0:3 1:0 2:1 3:2 4:5 5:4 6:0 7:1, the top two uncached
    # (4, 5) replace the lowest two cached (1, 2)
    (4, 2, [(3, [4, 5], [1, 2])], {0, 3, 4, 5}),
    # u_size 1: the same window swaps 4 for 1 alone
    (4, 1, [(3, [4], [1])], {0, 2, 3, 4}),
    # w_size 2, u_size 1: two windows. Tokens 0-1 score 0:2 3:1 4:3 5:2: 4 (3) replaces 1 (0; 2 ties at 0,
    # the lower id goes). Tokens 2-3 score 0:1 2:1 3:1 4:2 5:2 7:1 over cached {0, 2, 3, 4}: 5 (2) replaces
    # 0 (1; 2 and 3 tie at 1, the lower id goes)
    (2, 1, [(1, [4], [1]), (3, [5], [0])], {2, 3, 4, 5}),
    # w_size 1, u_size 1: a swap after every token. Token 0 (0:1 4:2 5:1): 4 (2) for 1 (0). Token 1 (0:1 3:1
    # 4:1 5:1) over {0, 2, 3, 4}: 5 (1) for 2 (0). Token 2 (2:1 3:1 4:1 5:1) over {0, 3, 4, 5}: 2 (1) for 0 (0).
    # Token 3 (0:1 4:1 5:1 7:1) over {2, 3, 4, 5}: 0 (1; 7 ties, the lower id first) for 2 (0; 3 ties)
    (1, 1, [(0, [4], [1]), (1, [5], [2]), (2, [2], [0]), (3, [0], [2])], {0, 3, 4, 5}),
])
def test_alg2_window_and_update_sizes_change_the_swaps(w_size, u_size, swaps, final):
    """Alg. 2 lines 9-15 with Fig. 11's tokens under four (w_size, u_size) settings (Sec. 6.4 (3), Table 9:
    a smaller window replaces more often, a larger u_size replaces more experts per window)."""
    cache = _windowed(w_size, u_size)
    got = []
    for step, routing in enumerate(FIG11_TOKENS):
        view = _view(routing, CacheState(capacity=[4]), RoundCosts(tiny_model(layers=1, experts=8, top_k=2)),
                     step=step)
        if cache.observe(view):
            got.append((step, *cache.replacement(0, set())))
    assert got == swaps
    assert cache.cached(0) == final


def test_the_initial_cache_is_cache_size_experts_drawn_at_random_per_layer_and_seed():
    """Sec. 4: "for each MoE layer, we randomly select a fixed number of experts (cache_size) to be cached":
    cache_size distinct experts per layer, the draw differing between layers and seeds, the same for the
    same seed (runs are reproducible)."""
    from moesim.policy.catalog.dali.workload import WorkloadAwareCache
    model = tiny_model(layers=4, experts=64, top_k=2)

    def draws(seed):
        cache = WorkloadAwareCache()
        cache.configure(RunContext(model=model, costs=RoundCosts(model), capacity=[8] * 4, seed=seed))
        return [cache.initial(layer, 8) for layer in range(4)]

    first = draws(0)
    assert all(len(set(chosen)) == 8 and chosen == sorted(chosen) for chosen in first)
    assert len({tuple(chosen) for chosen in first}) == 4  # each layer its own draw
    assert draws(0) == first and draws(1) != first


# ----------------------------------------------------------------------------- Sec. 6.4's settings, per model
def test_paper_settings_are_resolved_for_each_model_a_component_is_configured_for():
    """u_size=-1 and prefetch size -1 mean Sec. 6.4's setting for the run's model: (8, 4) on DeepSeek, (1, 1)
    on Mixtral. Components configured for DeepSeek and then again for Mixtral take Mixtral's: Alg. 2 swaps
    one expert per window, and of the predictions 5 (two tokens), 6, 7 the prefetch takes 5 alone. (They
    kept DeepSeek's 8 and 4: the first run's resolution overwrote the parameters.) A value given explicitly
    stays."""
    from moesim.model.presets import load_preset
    from moesim.policy.catalog.dali.workload import WorkloadAwareCache
    deepseek, mixtral = load_preset("deepseek-v2-lite"), load_preset("mixtral-8x7b")
    cache, prefetch = WorkloadAwareCache(), ResidualPrefetch()
    for model in (deepseek, mixtral):
        ctx = RunContext(model=model, costs=RoundCosts(model), capacity=[4] * model.num_layers,
                         columns=("pred_residual",))
        cache.for_model(model)
        prefetch.for_model(model)
        cache.configure(ctx)
        prefetch.configure(ctx)
    assert (cache.u_size, prefetch.size) == (1, 1)
    view = _view([[0, 1], [0, 2]], CacheState(capacity=[8] * mixtral.num_layers), RoundCosts(mixtral))
    view.predictors = {"pred_residual": [np.array([5, 6]), np.array([5, 7])]}
    assert prefetch.candidates(view) == [(1, 5)]
    # Fig. 11's window on Mixtral's cache: u_size 1 swaps 4 (5) for 1 (0) alone
    for layer in range(mixtral.num_layers):
        cache.initial(layer, 4)
    cache._cached[0] = {0, 1, 2, 3}
    for step, routing in enumerate(FIG11_TOKENS):
        observed = _view(routing, CacheState(capacity=[8] * mixtral.num_layers), RoundCosts(mixtral), step=step)
        closed = cache.observe(observed)
    assert closed and cache.replacement(0, set()) == ([4], [1])
    # an explicit setting is kept whatever the model
    given_cache, given_prefetch = WorkloadAwareCache(u_size=3), ResidualPrefetch(size=2)
    for model in (deepseek, mixtral):
        given_cache.for_model(model)
        given_prefetch.for_model(model)
    assert (given_cache.u_size, given_prefetch.size) == (3, 2)


# ----------------------------------------------------------------------------- Alg. 2 in the dali plan
def test_a_prefill_pass_is_one_window_iteration_with_every_prompt_tokens_workload():
    """Alg. 2 line 5-6 per forward pass: a 3-token prefill pass ((0, 4), (4, 5), (4, 6)) is one iteration of a
    window of 2 (it does not close it) and adds 0:1 4:3 5:1 6:1; the decode pass after it ((4, 5)) closes it
    with 0:1 4:4 5:2 6:1. Over cached {0, 1, 2, 3}, u_size 1: 4 (4) replaces 1 (0; 2 and 3 tie, the lower id
    goes)."""
    cache = _windowed(2, 1)
    costs = RoundCosts(tiny_model(layers=1, experts=8, top_k=2))
    prefill = _view([[0, 4], [4, 5], [4, 6]], CacheState(capacity=[4]), costs, step=0)
    prefill.phase = "prefill"
    assert cache.observe(prefill) is False
    assert cache._scores[0].tolist() == [1, 0, 0, 0, 3, 1, 1, 0]
    assert cache.observe(_view([[4, 5]], CacheState(capacity=[4]), costs, step=1)) is True
    assert cache._scores[0].tolist() == [1, 0, 0, 0, 4, 2, 1, 0]
    assert cache.replacement(0, set()) == ([4], [1])


def test_the_window_swap_and_the_residual_prefetch_in_one_plan():
    """Sec. 4.2 and 4.3 in one layer plan (2 layers, 4 experts, each caching 0 and 1; w_size 1, u_size 1,
    prefetch size 1, so a buffer of 2 slots beside the 2 cached per layer).

    Layer 0 routes (2, 3) twice: 2 and 3 have 2 tokens each, neither cached: t_gpu = max(4, 2) = 4, t_cpu = 6.
    Alg. 1: |diff| 2 and 2, layer order; 2: 0 + 4 <= 0 + 6, GPU; 3: 4 + 4 <= 0 + 6 no, CPU.
    Alg. 2 (the window of one pass closes): the top uncached, 2 (2; 3 ties, the lower id first), replaces the
    lowest cached, 0 (0; 1 ties): evict (0, 0), copy (0, 2) into the cache; the layer computes 2 on the GPU,
    so that copy is its demand load (plan.loads), not a stream plus a second copy.
    Residual prefetch for layer 1 from (3, 1), (3, 2): workloads 3:2 1:1 2:1, the top one, 3, is not on the GPU
    and goes to the buffer: (1, 3), queued behind the demand load."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    costs = RoundCosts(model)
    system = build_system("dali", {"prefetch.size": "1", "cache.w_size": "1", "cache.u_size": "1",
                                   "assign.solve_us": "0"})
    system.configure(RunContext(model=model, costs=costs, capacity=[2, 2], columns=("pred_residual",)))
    state = CacheState(capacity=[4, 4])
    for layer in (0, 1):
        system.cache.initial(layer, 2)
        system.cache._cached[layer] = {0, 1}  # Sec. 4 draws them at random; fixed here
        state.preload(layer, [0, 1])
    view = _view([[2, 3], [2, 3]], state, costs)
    view.predictors = {"pred_residual": [np.array([3, 1]), np.array([3, 2])]}
    plan = system.plan(view)
    assert plan.gpu == [2] and plan.loads == [2] and plan.streamed == [] and plan.cpu == [3]
    assert plan.evictions == [(0, 0)]
    assert plan.prefetches == [(1, 3)]
    assert system.cache.cached(0) == {1, 2} and system.cache.cached(1) == {0, 1}


@pytest.mark.parametrize("settings,buffer,capacity,pool", [
    # prefetch_slots 3: each layer may hold its 2 cached experts and up to 3 buffer entries, at most its 4
    # experts (2 + 3 -> 4); the whole holds 2 + 2 + 3 = 7
    ({"cache.prefetch_slots": "3"}, 3, [4, 4], 7),
    # -1: twice the prefetch size, 2 x 1 = 2 slots; 2 + 2 = 4 per layer, 2 + 2 + 2 = 6 in all
    ({"prefetch.size": "1"}, 2, [4, 4], 6),
    # 1 slot: 2 + 1 = 3 per layer, 5 in all
    ({"cache.prefetch_slots": "1"}, 1, [3, 3], 5),
    # no prefetch, no buffer: the cache's own quotas, no model-wide pool
    ({"prefetch": "none", "cache.prefetch_slots": "3"}, 0, [2, 2], None),
])
def test_the_prefetch_buffer_sits_beside_the_cache(settings, buffer, capacity, pool):
    """Sec. 4.2 prefetches into memory the paper does not size: ``cache.prefetch_slots`` slots model-wide
    beside the cache_size experts of each layer (4 cache slots over 2 layers of 4 experts: 2 each)."""
    model = tiny_model(layers=2, experts=4, top_k=2)
    system = build_system("dali", settings)
    system.for_model(model)
    assert system.reserved_slots(2) == buffer
    spread = system.spread(4, 2, 4)
    assert (spread.capacity, spread.pool) == (capacity, pool)
    assert spread.cached in (None, [2, 2])


def test_the_optimal_solve_can_charge_its_own_wall_clock_time(monkeypatch):
    """``dali-optimal``'s ``measured=true`` charges the solver's own time (here a clock stepping 0.25 s over
    the solve) instead of 55% of the layer period (Sec. 6.3); the split is the exact optimum either way. On
    the Eq. 5-6 example's costs (t_gpu 3.5, 2.5, 4; t_cpu 9, 6, 3) the optimum is greedy's: 0 and 2 on the
    GPU (6), 1 on the CPU (3)."""
    import itertools

    from moesim.policy.catalog.dali import assign
    from moesim.policy.catalog.dali.assign import DaliOptimal
    ticks = itertools.count(10.0, 0.25)  # each reading 0.25 s after the one before
    monkeypatch.setattr(assign.time, "perf_counter", lambda: next(ticks))
    costs = RoundCosts(tiny_model(layers=1, experts=4, top_k=2))
    state = CacheState(capacity=[4])
    state.preload(0, [0])
    view = _view([[0, 2], [0, 2], [0, 1]], state, costs, now=10.0, arrivals={2: 11.0}, launch=0.5)
    measured = DaliOptimal(measured=True)
    assert measured.split(view) == ([0, 2], [1])
    assert measured._last_solve_s == pytest.approx(0.25)
    fixed = DaliOptimal(solve_us=100.0)
    assert fixed.split(view) == ([0, 2], [1]) and fixed._last_solve_s == pytest.approx(100e-6)
