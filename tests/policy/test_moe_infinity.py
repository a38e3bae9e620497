"""MoE-Infinity baseline: request-level activation matrices, matching prefetch, request-level LFU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.analysis.metrics import metrics
from moesim.errors import ConfigError
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.moe_infinity import RequestLFUCache
from moesim.policy.catalog.moe_infinity.eam import ActivationTracker, request_eams
from moesim.policy.catalog.moe_infinity.order import EvictionOrder
from moesim.policy.state import CacheState
from moesim.sim.run import prepare, simulate
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


def test_request_eams_count_tokens_per_layer_and_expert(tmp_path):
    model = tiny_model(layers=2, experts=4, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [
        {"phase": "prefill", "tokens": {0: (0, [[[0, 1], [0, 2]], [[3, 1], [3, 2]]])}},
        {"phase": "decode", "tokens": {0: (2, [[[0, 1]], [[2, 3]]]), 1: (0, [[[2, 3]], [[0, 1]]])}},
    ])
    eams = request_eams(str(trace), 2, 4)
    assert eams[0].tolist() == [[3, 2, 1, 0], [0, 1, 2, 3]]
    assert eams[1].tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]


def test_best_match_is_the_most_cosine_similar_eam():
    tracker = ActivationTracker(2, 3, eamc_size=2, last_step={})
    a = np.array([[5.0, 0, 0], [0, 5, 0]])
    b = np.array([[0, 0, 5.0], [5, 0, 0]])
    c = np.array([[0, 5.0, 0], [0, 0, 5]])
    for eam in (a, b, c):
        tracker.add_to_collection(eam)
    assert len(tracker.collection) == 2  # the oldest (a) left first
    match = tracker.best_match(np.array([[0, 0, 1.0], [2, 0, 0]]))
    assert np.allclose(match, b / 5)  # each row at unit length
    assert tracker.best_match(np.zeros((2, 3))) is None


@pytest.fixture(scope="module")
def sequential_requests(tmp_path_factory):
    out = tmp_path_factory.mktemp("moeinf")
    model = tiny_model(layers=3, experts=8, top_k=2)
    return str(synthesize(SynthConfig.from_settings(model=model, requests=4, prompt_len=6, decode_len=10, batch=1,
                                                    seed=9), out / "t.parquet"))


def test_moe_infinity_prefetches_once_requests_have_finished(sequential_requests):
    settings = {"engine.check": "true", "cache.slots_per_layer": "3", "prefetch.calibration": "none"}
    result = simulate(sequential_requests, tiny_profile(), "moe-infinity", settings, decisions=True)
    m = metrics(result)
    assert m["prefetches"] > 0 and any("EAM collection starts empty" in n for n in m["notes"])
    decisions = [d for d in result.decisions if d[3] == "prefetch"]
    first_prefetch_step = min(d[0] for d in decisions)
    first_request_steps = 1 + 10  # request 0's prefill and decode steps come first
    assert first_prefetch_step >= first_request_steps  # nothing to match before a request ended


def test_seeded_collection_prefetches_from_the_start(sequential_requests):
    settings = {"cache.slots_per_layer": "3", "prefetch.calibration": sequential_requests}
    result = simulate(sequential_requests, tiny_profile(), "moe-infinity", settings, decisions=True)
    assert min(d[0] for d in result.decisions if d[3] == "prefetch") == 0


def test_eams_follow_the_request_id_of_every_row(tmp_path):
    """Two requests batched together: each row's routing goes to its own request's EAM (LayerView.requests)."""
    model = tiny_model(layers=2, experts=8, top_k=2)
    path = str(synthesize(SynthConfig.from_settings(model=model, requests=4, prompt_len=5, decode_len=6, batch=2,
                                                    seed=4), tmp_path / "t.parquet"))
    sim = prepare(path, tiny_profile(), "moe-infinity", {"engine.check": "true", "cache.slots_per_layer": "3",
                                                         "prefetch.calibration": "none"})
    sim.run()
    tracker = sim.system.prefetch.tracker
    truth = request_eams(path, 2, 8)
    # requests 2 and 3 ran in the last steps: still live, with exactly their own tokens' activations
    assert sorted(tracker.live) == [2, 3]
    for r in (2, 3):
        assert np.array_equal(tracker.live[r], truth[r])
    # requests 0 and 1 finished first and went to the collection, rows at unit length, in request order
    assert len(tracker.collection) == 2
    for r, entry in zip((0, 1), tracker.collection):
        assert np.allclose(entry, (truth[r] / np.linalg.norm(truth[r], axis=1, keepdims=True)).ravel())


def test_best_match_leaves_out_the_batchs_own_requests():
    """Leave-one-out: a request's own EAM (seeded from the replayed trace) never predicts it."""
    tracker = ActivationTracker(2, 3, eamc_size=10, last_step={})
    own = np.array([[5.0, 0, 0], [0, 5, 0]])
    other = np.array([[0, 0, 5.0], [5, 0, 0]])
    tracker.add_to_collection(own, request=0)
    tracker.add_to_collection(other, request=1)
    tracker.add_to_collection(own, request=0)  # request 0 finishing online is not added twice
    assert list(tracker.owners) == [0, 1]
    assert np.allclose(tracker.best_match(own), own / 5)
    assert np.allclose(tracker.best_match(own, exclude=frozenset({0})), other / 5)
    assert tracker.best_match(own, exclude=frozenset({0, 1})) is None


def test_collection_is_seeded_from_the_replayed_trace_by_default(sequential_requests):
    """The EAMC starts with every request of the trace (leave-one-out), so prefetch starts at step 0,
    where an empty collection (today's default) waits for the first request to finish."""
    settings = {"engine.check": "true", "cache.slots_per_layer": "3"}
    sim = prepare(sequential_requests, tiny_profile(), "moe-infinity", settings, decisions=True)
    result = sim.run()
    assert sorted(sim.system.prefetch.tracker.owners) == [0, 1, 2, 3]
    assert min(d[0] for d in result.decisions if d[3] == "prefetch") == 0
    assert any("leave-one-out" in n for n in metrics(result)["notes"])
    empty = simulate(sequential_requests, tiny_profile(), "moe-infinity",
                     {**settings, "prefetch.calibration": "none"}, decisions=True)
    assert min(d[0] for d in empty.decisions if d[3] == "prefetch") > 0


def test_seeded_prefetch_follows_another_requests_eam(tmp_path):
    """Request 0 is served first; by default its prefetches come from request 1's EAM, never its own."""
    model = tiny_model(layers=2, experts=4, top_k=1)
    trace = write_tiny_trace(tmp_path / "t.parquet", model, [
        {"phase": "decode", "tokens": {0: (0, [[[0]], [[1]]])}},
        {"phase": "decode", "tokens": {1: (0, [[[0]], [[3]]])}},
    ])
    result = simulate(str(trace), tiny_profile(), "moe-infinity", {"cache.slots_per_layer": "1"}, decisions=True)
    # step 0, layer 0 (request 0): the best match other than itself is request 1, which used expert 3 at layer 1
    assert (0, 0, 3, "prefetch", 1) in result.decisions
    assert (0, 0, 1, "prefetch", 1) not in result.decisions


def test_a_calibration_trace_of_another_shape_is_one_clear_error(sequential_requests, tmp_path):
    big = tiny_model(layers=2, experts=16, top_k=2)
    other = write_tiny_trace(tmp_path / "other.parquet", big, [
        {"phase": "decode", "tokens": {0: (0, [[[15, 1]], [[2, 3]]])}}])
    with pytest.raises(ConfigError, match="beyond the model's") as err:
        simulate(sequential_requests, tiny_profile(), "moe-infinity", {"prefetch.calibration": str(other)})
    assert err.value.field == "prefetch.calibration"
    with pytest.raises(ConfigError, match="cannot read calibration trace") as err:
        simulate(sequential_requests, tiny_profile(), "moe-infinity", {"prefetch.calibration": str(tmp_path / "no")})


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pool_victims_are_the_least_by_the_documented_order(data):
    """Pool eviction takes, over every layer's resident unprotected experts, the least (current priority,
    run priority, later layer first, lower id): checked against a plain sort of every candidate."""
    layers, experts = 4, 6
    tracker = ActivationTracker(layers, experts, eamc_size=0, last_step={0: 10, 1: 10})
    tracker.total = np.zeros((layers, experts))
    cache = RequestLFUCache()
    cache.configure(RunContext(model=tiny_model(layers=layers, experts=experts, top_k=2), costs=None,
                               capacity=[experts] * layers, pool=layers * experts))
    cache.tracker = tracker
    state = CacheState([experts] * layers, pool=layers * experts)
    for layer in range(layers):
        state.preload(layer, sorted(data.draw(st.sets(st.integers(0, experts - 1)))))
    # a few layers' routing observed, two requests sharing the batch; counts small so priorities tie often
    for step in range(data.draw(st.integers(0, 2))):
        for layer in range(layers):
            routed = np.array(data.draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=2, max_size=2,
                                                          unique=True), min_size=1, max_size=3)))
            requests = np.array(data.draw(st.lists(st.integers(0, 1), min_size=len(routed),
                                                   max_size=len(routed))))
            tracker.observe(LayerView(step, layer, "decode", routed, *active_experts(routed, experts), state, None,
                                      requests=requests))
    view = LayerView(5, data.draw(st.integers(0, layers - 1)), "decode", np.array([[0, 1]]), [0, 1], [1, 1],
                     state, None, requests=np.array([0]))
    protected = data.draw(st.sets(st.tuples(st.integers(0, layers - 1), st.integers(0, experts - 1))))
    n = data.draw(st.integers(1, layers * experts))
    current, total = cache._priorities(view)
    batch = tracker.batch_eam(view)
    for layer in range(layers):  # the priorities are the module docstring's, row by row
        row, runs = batch[layer], tracker.total[layer]
        weight = 1 - layer / layers
        assert np.array_equal(current[layer], row / row.sum() * weight if row.sum() else row)
        assert np.array_equal(total[layer], runs / runs.sum() * weight if runs.sum() else runs)
    candidates = [(l, e) for l in range(layers) for e in state.resident[l] if (l, e) not in protected]
    expected = sorted(candidates, key=lambda c: (current[c], total[c], -c[0], c[1]))[:n]
    assert cache.pool_victims(view, n, protected, view.layer) == expected


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_kept_eviction_order_equals_the_ranking_afresh_through_a_run(data):
    """The eviction order kept between pool evictions (``EvictionOrder``) answers every call as ranking
    every resident expert afresh does, while routing is observed, requests join and finish, the batch
    changes and experts are evicted and loaded between calls, one by one (journalled) or in bulk, and
    while the pool's journal overflows."""
    layers, experts = 3, 5
    last_step = {r: data.draw(st.integers(0, 4)) for r in range(4)}
    tracker = ActivationTracker(layers, experts, eamc_size=2, last_step=last_step)
    tracker.total = np.zeros((layers, experts))
    cache = RequestLFUCache()
    cache.configure(RunContext(model=tiny_model(layers=layers, experts=experts, top_k=2), costs=None,
                               capacity=[experts] * layers, pool=layers * experts - 2))
    cache.tracker, cache._order = tracker, EvictionOrder(tracker, layers, experts)
    state = CacheState([experts] * layers, pool=layers * experts - 2)
    for layer in range(layers):
        state.preload(layer, sorted(data.draw(st.sets(st.integers(0, experts - 1), max_size=4))))
    state.mirror.JOURNAL_LIMIT = data.draw(st.sampled_from([1, 3, 1 << 16]))  # small: the journal overflows
    cells = st.tuples(st.integers(0, layers - 1), st.integers(0, experts - 1))
    for step in range(data.draw(st.integers(1, 4))):
        for layer in range(layers):
            routed = np.array(data.draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=2, max_size=2,
                                                          unique=True), min_size=1, max_size=3)))
            requests = np.array(data.draw(st.lists(st.integers(0, 3), min_size=len(routed), max_size=len(routed))))
            view = LayerView(step, layer, "decode", routed, *active_experts(routed, experts), state, None,
                             requests=requests)
            tracker.observe(view)
            for _ in range(data.draw(st.integers(0, 2))):  # evictions and loads since the last call
                l, e = data.draw(cells)
                if data.draw(st.integers(0, 9)) == 0:  # a bulk change: not journalled, the order starts afresh
                    state.resident[l] ^= {e} if e in state.resident[l] or state.held() < state.pool else set()
                elif e in state.resident[l]:
                    state.evict(l, e)
                elif state.held() < state.pool:
                    state.start_load(l, e)
                    state.finish_load(l, e)
            protected = data.draw(st.sets(cells, max_size=4))
            n = data.draw(st.integers(1, layers * experts))
            expected = cache.ranked_victims(view, n, protected)
            assert cache.pool_victims(view, n, protected, layer) == expected
