"""CacheState with a model-wide pool: the counted sets keep the slot tally, the resident mask and the journal
exact."""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.policy.state import CacheState

LAYERS, EXPERTS = 3, 6

operations = st.lists(st.tuples(
    st.sampled_from(["add", "discard", "remove", "pop", "clear", "update", "difference_update",
                     "intersection_update", "symmetric_difference_update", "ior", "isub", "iand", "ixor"]),
    st.booleans(), st.integers(0, LAYERS - 1), st.frozensets(st.integers(0, 2 * EXPERTS), max_size=4),
    st.integers(0, 2 * EXPERTS)), max_size=40)


def apply(target: set, op: str, items: frozenset, expert: int) -> None:
    if op in ("add", "discard"):
        getattr(target, op)(expert)
    elif op == "remove":
        if expert in target:
            target.remove(expert)
    elif op == "clear":
        target.clear()
    elif op in ("ior", "isub", "iand", "ixor"):
        getattr(target, f"__{op}__")(set(items))
    else:
        getattr(target, op)(items)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_tally_and_mask_follow_every_set_mutation(ops):
    state = CacheState([EXPERTS] * LAYERS, pool=LAYERS * EXPERTS)
    truth_resident = [set() for _ in range(LAYERS)]
    truth_in_flight = [set() for _ in range(LAYERS)]
    for op, resident, layer, items, expert in ops:
        sets, truth = (state.resident, truth_resident) if resident else (state.in_flight, truth_in_flight)
        if op == "pop":  # an arbitrary element: the model drops the one the counted set gave
            if sets[layer]:
                truth[layer].discard(sets[layer].pop())
        else:
            apply(sets[layer], op, items, expert)
            apply(truth[layer], op, items, expert)
        assert sets[layer] == truth[layer]
        assert state.held() == sum(map(len, truth_resident)) + sum(map(len, truth_in_flight))
        mask = state.mirror.resident_mask
        expected = np.zeros((LAYERS, max(mask.shape[1], 2 * EXPERTS + 1)), dtype=bool)
        for l, experts in enumerate(truth_resident):
            expected[l, list(experts)] = True
        assert np.array_equal(mask, expected[:, :mask.shape[1]])
        assert not expected[:, mask.shape[1]:].any()  # the mask widened for every larger id


@settings(max_examples=300, deadline=None)
@given(operations)
def test_journal_replays_every_resident_change_or_is_dropped(ops):
    """A reader that replays the journal in order holds the resident sets; a bulk change drops the
    journal (the reader starts afresh from the sets), and in-flight changes are not journalled."""
    state = CacheState([EXPERTS] * LAYERS, pool=LAYERS * EXPERTS)
    state.mirror.journal = []
    replayed = [set() for _ in range(LAYERS)]
    for op, resident, layer, items, expert in ops:
        sets = state.resident if resident else state.in_flight
        if op == "pop":
            if sets[layer]:
                sets[layer].pop()
        else:
            apply(sets[layer], op, items, expert)
        journal = state.mirror.journal
        if journal is None:
            assert op not in ("add", "discard", "remove", "pop") and resident
            replayed = [set(experts) for experts in state.resident]
            state.mirror.journal = []
            continue
        for l, e in journal:
            if e >= 0:
                assert e not in replayed[l]
                replayed[l].add(e)
            else:
                replayed[l].remove(~e)
        journal.clear()
        assert replayed == [set(experts) for experts in state.resident]


def test_an_unread_journal_is_dropped_past_its_limit():
    state = CacheState([8], pool=8)
    state.mirror.journal, state.mirror.JOURNAL_LIMIT = [], 3
    for expert in range(3):
        state.resident[0].add(expert)
    state.resident[0].discard(0)
    assert state.mirror.journal == [(0, 0), (0, 1), (0, 2), (0, ~0)]
    state.resident[0].add(5)
    assert state.mirror.journal is None


def test_pool_state_works_through_its_methods_and_copies_as_plain_sets():
    state = CacheState([2, 2], pool=3)
    state.preload(0, [0, 1])
    state.start_load(1, 4)
    assert state.held() == 3 and state.free(1) == 0
    state.finish_load(1, 4)
    state.evict(0, 1)
    assert state.held() == 2 and state.mirror.resident_mask[:, :5].nonzero()[1].tolist() == [0, 4]
    copied = pickle.loads(pickle.dumps(state.resident[1]))
    assert type(copied) is set and copied == {4} and repr(state.resident[1]) == "{4}"
    assert type(state.resident[0] | {3}) is set
    without_pool = CacheState([2, 2])
    assert type(without_pool.resident[0]) is set and without_pool.mirror is None


@given(st.lists(st.integers(0, EXPERTS - 1), max_size=5), st.frozensets(st.integers(0, EXPERTS - 1), max_size=3),
       st.integers(0, 5), st.sampled_from([None, 4]))
@settings(max_examples=200, deadline=None)
def test_start_loads_is_start_load_of_each_in_turn(experts, resident, capacity, pool):
    """The batch form changes the state exactly as one start_load per expert, and fails on the same expert
    with the same message."""
    def run(batch: bool):
        state = CacheState([max(capacity, len(resident)), 3], pool=pool)
        state.preload(0, sorted(resident))
        try:
            if batch:
                state.start_loads(0, experts)
            else:
                for expert in experts:
                    state.start_load(0, expert)
        except AssertionError as err:
            return str(err), None
        return None, (set(state.in_flight[0]), set(state.resident[0]), state.held())

    assert run(True) == run(False)


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, EXPERTS - 1)), max_size=6),
       st.frozensets(st.integers(0, EXPERTS - 1), max_size=4), st.sampled_from([None, 8]))
@settings(max_examples=200, deadline=None)
def test_evict_all_is_evict_of_each_in_turn(pairs, resident, pool):
    """The batch form leaves the same residents and slot count as one evict per pair, and fails on the
    same pair with the same message (an expert not resident, or evicted twice)."""
    def run(batch: bool):
        state = CacheState([4, 4], pool=pool)
        for layer in (0, 1):
            state.preload(layer, sorted(resident))
        try:
            if batch:
                state.evict_all(pairs)
            else:
                for layer, expert in pairs:
                    state.evict(layer, expert)
        except AssertionError as err:
            return str(err), None
        return None, ([set(s) for s in state.resident], state.held())

    assert run(True) == run(False)


def test_one_slot_is_one_slot():
    from moesim.policy.state import describe_quotas
    assert describe_quotas([1]) == "1 slot: 1 x 1 layer"
    assert describe_quotas([1, 1], pool=1) == "1 slot in one model-wide pool (at most 1 per layer)"
    assert describe_quotas([2, 1]).startswith("3 slots: ")
