"""Engine invariants of one replay (README "the engine", docs/engine.md), checked from its result, timeline and
decision log; shared by the property tests of catalogue systems (test_properties.py) and of component swaps
(test_properties_swaps.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moesim.analysis.metrics import metrics
from moesim.model.spec import ModelSpec
from moesim.sim.result import SimResult
from moesim.trace import TraceMeta, write_trace
from tests.factories import routing_rows

EPS = 1e-12
#: timeline kinds of an expert's computation: with the layer, or overlapping the next one (001 Sec. 4)
COMPUTED = ("expert", "deferred")


def routed_rows(model: ModelSpec, routing: list[dict[str, Any]]) -> dict[tuple[int, int], list[list[int]]]:
    """(step, layer) -> each token row's experts, in the trace's row order (request, then position)."""
    out = {}
    for step, entry in enumerate(routing):
        for layer in range(model.num_layers):
            out[(step, layer)] = [list(token) for request in sorted(entry["tokens"])
                                  for token in entry["tokens"][request][1][layer]]
    return out


def routed_sets(model: ModelSpec, routing: list[dict[str, Any]],
                rewrites: dict[tuple[int, int], Any] | None = None) -> dict[tuple[int, int], list[int]]:
    """(step, layer) -> the distinct experts its tokens route to, after the run's substitutions (``rewrites``:
    (token row, top-k slot, new expert) per (step, layer), as ``SimResult.rewrites`` keeps them)."""
    out = {}
    for key, rows in routed_rows(model, routing).items():
        for row, slot, expert in (rewrites or {}).get(key, ()):
            rows[row][slot] = int(expert)
        out[key] = sorted({e for token in rows for e in token})
    return out


def check_time(result: SimResult, timeline, copy_engines: int) -> None:
    """Time never goes backwards: spans are ordered, steps follow each other, one lane never overlaps itself
    (not even by an ulp: a span summed in another order than the step's clock once did), and no more copies run
    at once than the profile has copy engines."""
    assert (timeline.end_s >= timeline.start_s).all()
    for (resource, lane), spans in timeline.groupby(["resource", "lane"]):
        spans = spans.sort_values(["start_s", "end_s"])
        assert (spans.start_s.values[1:] >= spans.end_s.values[:-1]).all(), (resource, lane)
    pcie = timeline[timeline.resource == "pcie"]
    for t in pcie.start_s:
        running = ((pcie.start_s <= t + EPS) & (pcie.end_s > t + EPS)).sum()
        assert running <= copy_engines
    starts = [s.start for s in result.steps]
    ends = [s.end for s in result.steps]
    assert all(b >= a for a, b in zip(ends, starts[1:]))


def check_computed_once(model: ModelSpec, routing: list[dict[str, Any]], result: SimResult, timeline) -> None:
    """Every routed expert computed exactly once (deferred ones included), or in its substitute's place."""
    computed = timeline[timeline.kind.isin(COMPUTED)]
    per_layer = computed.groupby(["step", "layer"]).expert.apply(list).to_dict()
    for key, routed in routed_sets(model, routing, result.rewrites).items():
        assert sorted(per_layer.get(key, [])) == routed, key


def check_weights_arrive(timeline, decisions) -> None:
    """No expert runs on the GPU before its weights arrive: one not resident at its plan has a copy that ended
    before it starts, and every copy of it begun by then has ended."""
    pcie = timeline[timeline.resource == "pcie"]
    gpu = timeline[timeline.kind.isin(COMPUTED) & (timeline.resource == "gpu")]
    actions = decisions.set_index(["step", "layer", "expert", "action"]).index
    for row in gpu.itertuples():
        was_resident = (row.step, row.layer, row.expert, "gpu_hit") in actions
        copies = pcie[(pcie.layer == row.layer) & (pcie.expert == row.expert) & (pcie.start_s <= row.start_s + EPS)]
        if not was_resident:
            assert len(copies), f"expert {row.expert} of layer {row.layer} computed without a copy"
        if len(copies):
            assert copies.end_s.max() <= row.start_s + EPS, (row.step, row.layer, row.expert)


def check_slots(result: SimResult, decisions) -> None:
    """The cache never exceeds its slots and an expert in use is never evicted, followed from the decision log
    in the order the engine applied it: a slot is taken by a demand load (``gpu_load``) or a prefetch, and
    freed by an eviction or a prefetch dropped from the copy queue (``cancel``); a streamed expert
    (``gpu_stream``) passes through the staging buffers and takes none. Each layer holds at most its quota,
    all layers together at most the model-wide pool where there is one."""
    capacity, pool = result.memory.capacity, result.memory.pool
    held = [set(x) for x in result.initial_resident]
    assert all(len(h) <= c for h, c in zip(held, capacity))
    assert pool is None or sum(map(len, held)) <= pool
    gpu_rows = decisions[decisions.action.str.startswith("gpu")]
    in_use = gpu_rows.groupby(["step", "layer"]).expert.apply(set).to_dict()
    for row in decisions.itertuples():
        target = held[row.target_layer]
        if row.action == "evict":
            assert not (row.target_layer == row.layer and row.expert in in_use.get((row.step, row.layer), ())), row
            target.discard(row.expert)
        elif row.action == "cancel":
            target.discard(row.expert)
        elif row.action in ("gpu_load", "prefetch"):
            target.add(row.expert)
            assert len(target) <= capacity[row.target_layer], row
            assert pool is None or sum(map(len, held)) <= pool, row


def check_busy_time(result: SimResult, timeline) -> None:
    """The timeline shows the copy engines' busy time that pcie_util counts (copies still running at the end
    cut at it), and no resource is busy for more than the run."""
    pcie = timeline[timeline.resource == "pcie"]
    assert (pcie.end_s - pcie.start_s).sum() == pytest.approx(result.pcie_busy_s, rel=1e-9, abs=1e-15)
    assert (pcie.end_s <= result.makespan_s + EPS).all()
    m = metrics(result)
    for util in ("cpu_util", "gpu_util", "pcie_util"):
        assert m[util] <= 1 + 1e-9, util


def check_all(model: ModelSpec, routing: list[dict[str, Any]], result: SimResult, frames: dict[str, Any],
              copy_engines: int) -> None:
    """Every invariant above, of one replay run with the timeline and the decision log on."""
    timeline, decisions = frames["timeline"], frames["decisions"]
    check_time(result, timeline, copy_engines)
    check_computed_once(model, routing, result, timeline)
    check_weights_arrive(timeline, decisions)
    check_slots(result, decisions)
    check_busy_time(result, timeline)


def write_full_trace(path: Path, model: ModelSpec, routing: list[dict[str, Any]],
                     rng: np.random.Generator) -> str:
    """``routing`` (tests.factories.random_routing) as a trace with every optional column a component reads:
    gate ``weights`` (the routed experts' shares, highest first, summing to 1), router ``scores`` (routed
    experts above the rest), and the predictions ``pred_next_layer`` and ``pred_residual`` (the token's
    next-layer experts, the last sometimes wrong) and ``pred_next_token`` (the request's next token's experts
    at this layer, the token's own for its request's last)."""
    rows = routing_rows(model, routing)
    # the experts each request's token at (position, layer) used, for the next token's prediction
    used = {(r[2], r[3], r[1]): r[5] for r in rows}
    n, k = len(rows), model.top_k

    def noisy(experts: list[int]) -> list[int]:
        experts = list(experts)
        if experts and rng.random() < 0.3:
            experts[-1] = int(rng.integers(model.num_experts))
        return list(dict.fromkeys(experts))

    next_layer = [noisy(used[(r[2], r[3], r[1] + 1)]) if r[1] + 1 < model.num_layers else [] for r in rows]
    next_token = [noisy(used.get((r[2], r[3] + 1, r[1]), r[5])) for r in rows]
    scores = rng.random((n, model.num_experts)) * 0.3
    weights = rng.random((n, k)) + 0.1
    for i, row in enumerate(rows):
        scores[i, row[5]] = 0.3 + 0.6 * rng.random(k)
    data = {name: np.array([r[i] for r in rows]) for i, name in enumerate(("step", "layer", "request", "position"))}
    data["phase"] = [r[4] for r in rows]
    data["experts"] = np.array([r[5] for r in rows], dtype=np.int16).reshape(n, k)
    # highest first, as a gate's top-k lists its experts
    data["weights"] = -np.sort(-weights / weights.sum(axis=1, keepdims=True), axis=1).astype(np.float32)
    data["scores"] = scores.astype(np.float16)
    data["pred_next_layer"] = next_layer
    data["pred_residual"] = [noisy(p) for p in next_layer]
    data["pred_next_token"] = next_token
    return str(write_trace(path, data, TraceMeta(model=model, source={"kind": "test"})))
