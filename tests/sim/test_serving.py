"""Serving runs: invariants (hypothesis), replay equivalence, KV preemption, arrival processes."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from moesim.analysis.metrics import metrics
from moesim.analysis.serving import preemption_notes, request_frame, serving_metrics
from moesim.api import slice_trace
from moesim.errors import ConfigError
from moesim.sim.run import prepare, simulate
from moesim.sim.serving import kv_budget_tokens, serve
from moesim.sim.workload import WorkloadConfig, arrival_times
from tests.factories import tiny_model, tiny_profile, write_tiny_trace

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "traces" / "mixtral-8x7b-humaneval.parquet"
FAST = settings(max_examples=int(__import__('os').environ.get('MOESIM_SERVING_EXAMPLES', 20)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
STATELESS = ["cpu-only", "static-hot", "all-in-gpu"]  # no state carried from one request to the next


def request_routing(rng: np.random.Generator, model, lengths: list[tuple[int, int]]) -> list[dict]:
    """One request after another: its prompt in one step, then one step per decode token."""
    def pick(n: int) -> list[list[list[int]]]:
        return [[sorted(rng.choice(model.num_experts, model.top_k, replace=False).tolist()) for _ in range(n)]
                for _ in range(model.num_layers)]
    steps = []
    for r, (prompt, decode) in enumerate(lengths):
        if prompt:
            steps.append({"phase": "prefill", "tokens": {r: (0, pick(prompt))}})
        for d in range(decode):
            steps.append({"phase": "decode", "tokens": {r: (prompt + d, pick(1))}})
    return steps


@st.composite
def pools(draw):
    experts = draw(st.integers(2, 6))
    model = tiny_model(layers=draw(st.integers(1, 3)), experts=experts, top_k=draw(st.integers(1, min(2, experts))))
    lengths = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=3))
    profile = dict(gpu_us=(draw(st.floats(10, 500)), 5000.0), cpu_us=(draw(st.floats(10, 5000)), 50000.0),
                   attention_us=draw(st.floats(1, 200)), pcie_gbps=draw(st.sampled_from([0.001, 0.01, 1.0])))
    return model, request_routing(np.random.default_rng(draw(st.integers(0, 2**16))), model, lengths), profile


def run_serve(tmp: str, model, routing, profile, system: str, extra: dict[str, str]):
    path = str(write_tiny_trace(Path(tmp) / "t.parquet", model, routing))
    return path, serve([path], tiny_profile(**profile), system, extra)


def _livelock_pool():
    """Two requests that once yielded their KV to each other in turn without end (vllm, chunked prompts)."""
    model = tiny_model(layers=1, experts=2, top_k=1)
    experts = [[1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]  # per request, by position
    routing = []
    for r, (prompt, ids) in enumerate(zip((1, 3, 3), experts)):
        routing.append({"phase": "prefill", "tokens": {r: (0, [[[e] for e in ids[:prompt]]])}})
        routing += [{"phase": "decode", "tokens": {r: (p, [[[ids[p]]]])}} for p in range(prompt, len(ids))]
    profile = dict(gpu_us=(10.0, 5000.0), cpu_us=(10.0, 50000.0), attention_us=1.0, pcie_gbps=0.001)
    return model, routing, profile


def _long_recompute_pool():
    """Prompts of 2 and 12 decodes under max_tokens 6, unchunked: two closed-loop clients fill a KV cache of
    14 + 4 entries with 9 each, and the one preempted needs a recompute of 9 or more tokens, more than a step
    holds (it waited at the head of the queue forever)."""
    model = tiny_model(layers=1, experts=2, top_k=1)
    routing = request_routing(np.random.default_rng(9), model, [(2, 12)])
    profile = dict(gpu_us=(10.0, 5000.0), cpu_us=(10.0, 50000.0), attention_us=1.0, pcie_gbps=1.0)
    return model, routing, profile


#: (KV block size, watermark) drawn for the continuous schedulers: per token, small blocks, a watermark that
#: keeps blocks free on budgets of a few blocks, and vLLM's defaults
PAGING = [(1, 0.0), (2, 0.0), (4, 0.0), (3, 0.25), (2, 0.5), (16, 0.01)]


def least_kv_tokens(longest: int, block: int, watermark: float) -> int:
    """The least budget (entries) on which a request of ``longest`` tokens runs alone: whole blocks for it
    and the watermark's int(watermark * blocks) kept free at admission (worked here, not by the scheduler)."""
    need = -(-longest // block)
    total = need
    while total - int(watermark * total) < need:
        total += 1
    return total * block


@FAST
@example(_livelock_pool(), "gpu-only-lru", "vllm", "gamma", 5, True, (1, 0.0))
@example(_long_recompute_pool(), "cpu-only", "vllm", "closed", 4, False, (1, 0.0))
@given(pools(), st.sampled_from(["gpu-only-lru", "cpu-only", "static-hot"]),
       st.sampled_from(["static", "vllm", "sarathi", "llamacpp"]), st.sampled_from(["poisson", "gamma", "closed"]),
       st.integers(0, 30), st.booleans(), st.sampled_from(PAGING))
def test_serving_invariants(pool, system, scheduler, arrival, kv, chunked, paging):
    model, routing, profile = pool
    block, watermark = (1, 0.0) if scheduler == "static" else paging  # static batching reserves per token
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(r.tokens for r in _pool_lengths(tmp, model, routing))
        extra = {"workload.arrival": arrival, "workload.qps": "20", "workload.cv": "3", "workload.requests": "7",
                 "workload.concurrency": "2", "scheduler": scheduler, "cache.slots_per_layer": str(model.top_k),
                 "scheduler.max_tokens": "4", "scheduler.chunk_tokens": "2",
                 "scheduler.kv_block_tokens": str(block), "scheduler.kv_watermark": str(watermark)}
        if scheduler == "static":
            for key in ("max_tokens", "chunk_tokens", "kv_block_tokens", "kv_watermark"):
                del extra[f"scheduler.{key}"]
        elif not chunked:  # whole prompts (up to 6 tokens); a recompute of prompt and output may be longer
            extra.update({"scheduler.max_tokens": "6", "scheduler.chunk_tokens": "0"})
        if kv:  # small KV caches force preemptions; a few entries over whole blocks hold no request's KV
            extra["workload.kv_tokens"] = str(least_kv_tokens(longest, block, watermark) + kv % 5)
        _, result = run_serve(tmp, model, routing, profile, system, extra)
    frame = request_frame(result)
    # no request finishes before it arrives, and its events are in order
    assert (frame.scheduled_s >= frame.arrival_s).all()
    assert (frame.first_token_s >= frame.scheduled_s).all()
    assert (frame.finish_s >= frame.first_token_s).all()
    # every token of every request computed once, plus those a preemption dropped, computed again
    positions: dict[int, Counter] = {r: Counter() for r in frame.request}
    for batch in result.batches:
        assert len({rid for rid, _, _ in batch}) == len(batch)
        for rid, first, n in batch:
            positions[rid].update(range(first, first + n))
    for row in frame.itertuples():
        total = row.prompt_tokens + row.output_tokens
        assert set(positions[row.request]) == set(range(total))
        assert sum(positions[row.request].values()) == row.computed_tokens == total + row.recomputed_tokens
        assert (row.recomputed_tokens > 0) == (row.preemptions > 0)
    # KV never over budget; throughput never above the offered load
    m = serving_metrics(result)
    if kv:
        assert 0 < m["kv_peak_tokens"] <= m["kv_tokens"] == int(extra["workload.kv_tokens"])
        assert m["kv_block_tokens"] == block and m["kv_blocks"] == m["kv_tokens"] // block
        assert 0 < m["kv_peak_blocks"] <= m["kv_blocks"]
        assert m["kv_watermark_blocks"] == int(watermark * m["kv_blocks"])
    if arrival != "closed":
        assert m["throughput_rps"] <= m["offered_qps"] * (1 + 1e-12)
    # the engine saw every step back to back, never before the batch was formed, and never an ulp before the
    # last one ended (env.now, as start + (end - start), can fall short of that end)
    steps = result.engine.steps
    assert all(b.start >= a.end for a, b in zip(steps, steps[1:]))
    _check_against_the_batch_log(result, frame, int(extra["workload.kv_tokens"]) if kv else None, block,
                                 int(watermark * (int(extra["workload.kv_tokens"]) // block)) if kv else 0,
                                 allocation={"static": "request", "llamacpp": "chunk"}.get(scheduler, "prompt"))


def _check_against_the_batch_log(result, frame, kv_tokens: int | None, block: int = 1, kept_free: int = 0,
                                 allocation: str = "chunk") -> None:
    """The KV held, the recomputation and each request's times, rebuilt from the log of what each step ran
    and whom it preempted, independently of the scheduler's own counts. KV is held in blocks of ``block``
    entries; a step that admits a request (its first entry since it arrived or was preempted, at position 0)
    leaves ``kept_free`` blocks free (admissions come last in a step: nothing is added after them). An
    admitted request holds the blocks of what it has computed (``allocation`` "chunk", llama.cpp) or, from
    admission on, those of its whole prompt or recompute, its prompt and every token it had emitted when
    preempted ("prompt": vLLM, Sarathi-Serve), or of its whole length ("request": static batching). The
    run's KV peaks are the most entries written and the most blocks held (allocated) during a step."""
    arrival = dict(zip(frame.request, frame.arrival_s))
    total = dict(zip(frame.request, frame.prompt_tokens + frame.output_tokens))
    prompt = dict(zip(frame.request, frame.prompt_tokens))
    held: dict[int, int] = {}  # KV entries per request, from its last preemption (or start) on
    target = dict(prompt)  # tokens a request prefills when admitted: its prompt, then its recompute
    reserved: dict[int, int] = {}  # entries whose blocks an admission allocated ahead of computing them
    peak_tokens = peak_blocks = 0
    dropped: Counter = Counter()
    first_step: dict[int, float] = {}
    first_token: dict[int, float] = {}
    finish: dict[int, float] = {}
    steps = result.engine.steps
    assert len(steps) == len(result.batches) and set(result.preempted) <= set(range(len(steps)))
    for i, (batch, step) in enumerate(zip(result.batches, steps)):
        for rid in result.preempted.get(i, []):
            lost = held.pop(rid)  # a preempted request held KV, and frees all of it (reserved blocks too)
            reserved.pop(rid, None)
            dropped[rid] += lost
            target[rid] = max(target[rid], lost + 1 if lost >= prompt[rid] else prompt[rid])
        # the engine is charged every token the scheduler batched, recomputed ones included
        assert step.tokens == sum(n for _, _, n in batch) and step.requests == sorted(r for r, _, _ in batch)
        for rid, first, n in batch:
            assert step.start >= arrival[rid]  # nothing computed before its request arrives
            assert first == held.get(rid, 0)  # a request goes on where its KV ends: 0 after a preemption
            if first == 0 and allocation != "chunk":  # admitted: the blocks of all it prefills (a first
                # decode token for a request without prompt), or of its whole length
                reserved[rid] = max(target[rid], 1) if allocation == "prompt" else total[rid]
            held[rid] = first + n
            first_step.setdefault(rid, step.start)
            if held[rid] >= max(prompt[rid], 1):
                first_token.setdefault(rid, step.end)
        # during the step: entries written and blocks held, with those it adds
        blocks = sum(-(-max(h, reserved.get(rid, 0)) // block) for rid, h in held.items())
        peak_tokens, peak_blocks = max(peak_tokens, sum(held.values())), max(peak_blocks, blocks)
        if kv_tokens is not None:
            assert blocks <= kv_tokens // block
            if any(first == 0 for _, first, _ in batch):
                assert blocks <= kv_tokens // block - kept_free
        for rid, _, _ in batch:
            assert held[rid] <= total[rid]
            if held[rid] == total[rid]:  # finished: its tokens all produced, once since its last preemption
                assert rid not in finish
                finish[rid] = step.end
                del held[rid]
                reserved.pop(rid, None)
    assert not held and set(finish) == set(total)
    assert (result.kv_peak, result.kv_peak_blocks) == (peak_tokens, peak_blocks)
    for row in frame.itertuples():
        assert row.recomputed_tokens == dropped[row.request]
        assert (row.scheduled_s, row.first_token_s, row.finish_s) == \
            (first_step[row.request], first_token[row.request], finish[row.request])


def _pool_lengths(tmp, model, routing):
    from moesim.sim.serving import RequestPool
    path = str(write_tiny_trace(Path(tmp) / "t.parquet", model, routing))
    return RequestPool([path], []).requests


@FAST
@given(pools(), st.sampled_from(STATELESS))
def test_latency_at_vanishing_load_equals_solo_replay(pool, system):
    model, routing, profile = pool
    with tempfile.TemporaryDirectory() as tmp:
        same = {"cache.slots_per_layer": str(model.top_k)}
        if system == "static-hot":  # the hot set from the whole pool, not from each request's own rows
            same["cache.calibration"] = str(write_tiny_trace(Path(tmp) / "calibration.parquet", model, routing))
        path, result = run_serve(tmp, model, routing, profile, system,
                                 {"workload.qps": "1e-3", "workload.requests": "3", **same})
        frame = request_frame(result)
        for row in frame.itertuples():
            solo = slice_trace(path, Path(tmp) / f"solo{row.source_request}.parquet", requests=[row.source_request])
            replay = simulate(str(solo), tiny_profile(**profile), system, same)
            assert row.queue_ms == 0
            # equal up to the rounding of absolute times near 1e3 s (2e-13 s)
            assert row.e2e_ms == pytest.approx(replay.makespan_s * 1e3, rel=1e-9, abs=1e-6)
            if row.prompt_tokens:
                assert row.ttft_ms == pytest.approx(metrics(replay)["ttft_ms"], rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("system", ["gpu-only-lru", "cpu-only", "fiddler"])
def test_one_request_closed_loop_reproduces_the_replay(tmp_path, system):
    trace = slice_trace(BUNDLED, tmp_path / "r0.parquet", requests=[0])
    replay = metrics(simulate(str(trace), "rtx4090", system))
    served = serve([str(trace)], "rtx4090", system,
                   {"workload.arrival": "closed", "workload.requests": "1", "scheduler": "static",
                    "scheduler.max_batch": "1"})
    again = metrics(served.engine)
    for m in (replay, again):
        m.pop("sim_wall_s")
    assert json.dumps(again, sort_keys=True, default=str) == json.dumps(replay, sort_keys=True, default=str)
    row = request_frame(served).iloc[0]
    assert row.ttft_ms == replay["ttft_ms"] and row.e2e_ms == replay["makespan_s"] * 1e3


def test_kv_budget_is_the_memory_the_expert_cache_leaves(tmp_path):
    model = tiny_model(layers=2, experts=4, top_k=2)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model, request_routing(np.random.default_rng(0), model,
                                                                                 [(3, 2)])))
    profile = tiny_profile()
    sim = prepare(path, profile, "gpu-only-lru", {"cache.slots_per_layer": "2"})
    mem = sim.memory
    left = (mem.gpu_bytes - mem.reserved_bytes - mem.non_expert_bytes - mem.workspace_bytes - mem.staging_bytes
            - 4 * mem.expert_bytes)
    assert kv_budget_tokens(mem, model.kv_bytes_per_token(), False) == left // model.kv_bytes_per_token()
    # one more slot per layer costs 2 experts' bytes of KV
    more = prepare(path, profile, "gpu-only-lru", {"cache.slots_per_layer": "3"}).memory
    fewer_tokens = kv_budget_tokens(mem, model.kv_bytes_per_token(), False) - \
        kv_budget_tokens(more, model.kv_bytes_per_token(), False)
    assert abs(fewer_tokens - 2 * mem.expert_bytes / model.kv_bytes_per_token()) <= 1
    assert kv_budget_tokens(mem, model.kv_bytes_per_token(), True) is None
    # KTransformers without static GPU experts (its default) holds no expert slots: its KV gets what cpu-only's does
    cpu = kv_budget_tokens(prepare(path, profile, "cpu-only").memory, model.kv_bytes_per_token(), False)
    ktrans = kv_budget_tokens(prepare(path, profile, "ktransformers").memory, model.kv_bytes_per_token(), False)
    assert ktrans == cpu > kv_budget_tokens(mem, model.kv_bytes_per_token(), False)


def test_small_kv_preempts_and_recomputes(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=1)
    routing = request_routing(np.random.default_rng(1), model, [(4, 4)])
    path = str(write_tiny_trace(tmp_path / "t.parquet", model, routing))
    base = {"workload.arrival": "closed", "workload.concurrency": "3", "workload.requests": "3",
            "scheduler": "vllm", "scheduler.kv_block_tokens": "1"}  # per token: 12 entries hold 3 prompts of 4
    roomy = serving_metrics(serve([path], tiny_profile(), "cpu-only", base))
    tight = serving_metrics(serve([path], tiny_profile(), "cpu-only", {**base, "workload.kv_tokens": "12"}))
    assert roomy["preemptions"] == 0 and roomy["recomputed_tokens"] == 0
    # 3 prompts of 4 fill 12 entries; the first decode preempts the newest (5 tokens come back as prefill)
    assert tight["preemptions"] >= 1 and tight["recomputed_tokens"] >= 5
    assert tight["e2e_ms_mean"] > roomy["e2e_ms_mean"]
    assert preemption_notes([roomy]) == []
    assert preemption_notes([roomy, tight]) == [
        f"KV entries for 12 tokens (workload.kv_tokens): cpu-only {tight['preemptions']} "
        f"preemption{'s' if tight['preemptions'] > 1 else ''}, "
        f"{tight['recomputed_tokens']} tokens prefilled again"]


def test_a_kv_limit_below_one_request_names_the_limit(tmp_path):
    """workload.kv_tokens=7 for requests of 8 tokens: the user's limit is at fault, not the expert slots (the
    error named cache.slots_per_layer, even for systems without a cache). Per token 8 entries suffice; in
    vLLM's blocks of 16 the least budget is one whole block, 16 entries."""
    from moesim.errors import ConfigError
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(1), model, [(4, 4)])))
    per_token = {"scheduler.kv_block_tokens": "1"}
    for system, blocks, kv, least in (("cpu-only", per_token, "7", 8), ("all-in-gpu", per_token, "7", 8),
                                      ("cpu-only", {}, "15", 16), ("all-in-gpu", {}, "8", 16)):
        with pytest.raises(ConfigError) as err:
            serve([path], tiny_profile(), system, {"workload.requests": "1", "workload.kv_tokens": kv, **blocks})
        assert err.value.field == "workload.kv_tokens"
        assert f"a request of 8 tokens needs more KV cache than workload.kv_tokens={kv}" in str(err.value)
        assert f"use workload.kv_tokens={least} or more" in str(err.value)
        fits = serving_metrics(serve([path], tiny_profile(), "cpu-only", {"workload.requests": "1",
                                                                           "workload.kv_tokens": str(least),
                                                                           **blocks}))
        assert fits["kv_tokens"] == least and fits["kv_peak_tokens"] == 8


def test_preempting_runs_say_how_many_kv_entries_a_slot_would_add(tmp_path):
    """Where the KV cache is what the expert cache leaves, the note names the trade: one slot's bytes in
    KV entries (docs/serving.md); runs at one rate with one budget share a line."""
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(1), model, [(4, 4)])))
    m = serving_metrics(serve([path], tiny_profile(), "gpu-only-lru", {"workload.requests": "2"}))
    assert m["kv_tokens_per_slot"] == model.expert_bytes("bf16") // model.kv_bytes_per_token() > 0
    lru = dict(m, preemptions=3, recomputed_tokens=20, qps=0.5)
    dali = dict(lru, system="dali", preemptions=1, recomputed_tokens=7)
    later = dict(lru, qps=2.0)
    assert m["kv_blocks"] == m["kv_tokens"] // 16  # vLLM's blocks of 16
    budget = (f"KV entries for {m['kv_tokens']:,} tokens in {m['kv_blocks']:,} blocks of 16 at {{}} req/s "
              f"(the GPU memory {m['engine']['expert_slots']} expert slots leave; each slot fewer holds "
              f"{m['kv_tokens_per_slot']:,} more: --set cache.slots=N trades them, docs/serving.md): ")
    assert preemption_notes([lru, dali, later, m]) == [
        budget.format("0.5") + "gpu-only-lru 3 preemptions, 20 tokens prefilled again; dali 1 preemption, 7 tokens "
                               "prefilled again",
        budget.format("2") + "gpu-only-lru 3 preemptions, 20 tokens prefilled again"]


def test_arrival_processes():
    rng = np.random.default_rng(0)
    gaps = np.diff(arrival_times(WorkloadConfig(arrival="poisson", qps=4.0, requests=20000), rng))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03) and gaps.std() / gaps.mean() == pytest.approx(1, rel=0.05)
    gaps = np.diff(arrival_times(WorkloadConfig(arrival="gamma", qps=4.0, cv=3.0, requests=20000), rng))
    assert gaps.mean() == pytest.approx(0.25, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(3, rel=0.1)


def test_arrival_file_and_closed_loop(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(2), model, [(2, 3), (1, 1)])))
    (tmp_path / "arrivals.csv").write_text("arrival_s\n0.5\n0.5\n7\n")
    result = serve([path], tiny_profile(), "cpu-only",
                   {"workload.arrival": "trace", "workload.arrival_file": str(tmp_path / "arrivals.csv"),
                    "workload.requests": "3"})
    frame = request_frame(result)
    assert frame.arrival_s.tolist() == [0.5, 0.5, 7.0]
    assert frame.source_request.tolist() == [0, 1, 0]  # drawn from the pool in turn
    closed = request_frame(serve([path], tiny_profile(), "cpu-only",
                                 {"workload.arrival": "closed", "workload.requests": "4"}))
    # one client: each request arrives when the previous one finishes
    assert closed.arrival_s.tolist()[1:] == closed.finish_s.tolist()[:-1]
    two = request_frame(serve([path], tiny_profile(), "cpu-only",
                              {"workload.arrival": "closed", "workload.requests": "4", "workload.concurrency": "2"}))
    assert (two.arrival_s == 0).sum() == 2


@pytest.mark.parametrize("text, message", [("arrival_s\n", "holds no arrival times"),
                                           ("arrival_s\n0.5\nsoon\n", "not a number of seconds")])
def test_an_arrival_file_without_usable_times_names_the_column(tmp_path, text, message):
    """An empty file asked for workload.requests <= 0 (refused in turn); a word among the times was an
    internal error."""
    (tmp_path / "arrivals.csv").write_text(text)
    w = WorkloadConfig(arrival="trace", arrival_file=str(tmp_path / "arrivals.csv"), requests=1)
    with pytest.raises(ConfigError, match=message) as err:
        arrival_times(w, np.random.default_rng(0))
    assert err.value.field == "arrival_s" and "<= 0" not in str(err.value)


def test_bad_serving_input_names_the_field(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(3), model, [(2, 1)])))
    cases = [({"workload.arrival": "bursty"}, "workload.arrival"), ({"workload.qps": "0"}, "workload.qps"),
             ({"workload.arrival": "trace"}, "workload.arrival_file"), ({"workload.speed": "1"}, "workload.speed"),
             ({"workload.kv_tokens": "10000000000"}, "workload.kv_tokens")]
    for settings_, field in cases:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            serve([path], tiny_profile(), "gpu-only-lru", settings_)
    with pytest.raises(ConfigError, match="future routing"):
        serve([path], tiny_profile(), "belady", {})
    with pytest.raises(ConfigError, match="portfolio"):
        serve([path], tiny_profile(), "oracle", {})


def test_pool_reads_several_traces_of_one_model(tmp_path):
    from moesim.sim.serving import RequestPool
    model = tiny_model(layers=2, experts=4, top_k=1)
    rng = np.random.default_rng(4)
    a = str(write_tiny_trace(tmp_path / "a.parquet", model, request_routing(rng, model, [(3, 2), (1, 4)])))
    b = str(write_tiny_trace(tmp_path / "b.parquet", model, request_routing(rng, model, [(0, 5)])))
    pool = RequestPool([a, b], [])
    assert [(Path(r.source).name, r.request, r.prompt, r.output) for r in pool.requests] == \
        [("a.parquet", 0, 3, 2), ("a.parquet", 1, 1, 4), ("b.parquet", 0, 0, 5)]
    frame = request_frame(serve([a, b], tiny_profile(), "cpu-only", {"workload.requests": "4", "workload.qps": "5"}))
    assert frame.source_request.tolist() == [0, 1, 0, 0] and frame.output_tokens.tolist() == [2, 4, 5, 2]
    other = tiny_model(layers=2, experts=6, top_k=1)
    c = str(write_tiny_trace(tmp_path / "c.parquet", other, request_routing(rng, other, [(1, 1)])))
    with pytest.raises(ConfigError, match="c.parquet.*moesim.model"):
        RequestPool([a, c], [])


def test_a_fault_in_an_unread_column_of_any_served_trace_refuses_the_run(tmp_path):
    from moesim.errors import TraceFormatError
    from tests.factories import with_scores
    model = tiny_model(layers=2, experts=4, top_k=1)
    rng = np.random.default_rng(5)
    a = str(write_tiny_trace(tmp_path / "a.parquet", model, request_routing(rng, model, [(2, 2)])))
    b = str(write_tiny_trace(tmp_path / "b.parquet", model, request_routing(rng, model, [(1, 3)])))
    bad = str(with_scores(Path(b), tmp_path / "b-bad.parquet", bad={3: -1.0}))
    workload = {"workload.requests": "2", "workload.qps": "5"}
    assert len(request_frame(serve([a, str(with_scores(Path(b), tmp_path / "b-ok.parquet"))], tiny_profile(),
                                   "cpu-only", workload))) == 2
    with pytest.raises(TraceFormatError, match="b-bad.parquet, field 'scores', row 3"):
        serve([a, bad], tiny_profile(), "cpu-only", workload)


def test_a_request_missing_rows_on_a_layer_is_refused(tmp_path):
    from moesim.sim.serving import RequestPool
    model = tiny_model(layers=2, experts=4, top_k=1)
    routing = [{"phase": "prefill", "tokens": {0: (0, [[[0], [1]], [[2]]])}}]  # two tokens on layer 0, one on 1
    path = str(write_tiny_trace(tmp_path / "t.parquet", model, routing))
    with pytest.raises(ConfigError, match="request 0 does not have the same tokens on every layer"):
        RequestPool([path], [])


def test_chunked_prefill_keeps_decodes_flowing(tmp_path):
    """A long prompt arriving during another request's decode: vLLM stalls the decode for the whole
    prefill; Sarathi-Serve's token budget bounds the gap between its tokens and delays the long prompt."""
    model = tiny_model(layers=2, experts=4, top_k=1)
    rng = np.random.default_rng(5)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model, request_routing(rng, model, [(1, 12), (80, 1)])))
    (tmp_path / "arrivals.csv").write_text("arrival_s\n0\n0.003\n")
    base = {"workload.arrival": "trace", "workload.arrival_file": str(tmp_path / "arrivals.csv"),
            "workload.requests": "2"}

    def run(scheduler: str, **params: str):
        result = serve([path], tiny_profile(), "cpu-only", {**base, "scheduler": scheduler,
                                                           **{f"scheduler.{k}": v for k, v in params.items()}})
        ends = [s.end for s in result.engine.steps if 0 in s.requests]
        # steps holding part of the long prompt beside a decode token of request 0
        mixed = sum(any(r == 1 and first < 80 for r, first, _ in b) and any(r == 0 for r, _, _ in b)
                    for b in result.batches)
        return max(np.diff(ends)), request_frame(result).ttft_ms[1], mixed

    vllm_gap, vllm_ttft, vllm_mix = run("vllm")
    sarathi_gap, sarathi_ttft, sarathi_mix = run("sarathi", max_tokens="17", chunk_tokens="16")
    assert vllm_mix == 0 and sarathi_mix == 5  # 80 prompt tokens in chunks of 16 beside a decode token each
    assert sarathi_gap < vllm_gap / 2
    assert sarathi_ttft > vllm_ttft


# ----------------------------------------------------------------------------- progress and host memory
def test_progress_counts_every_finished_request_once(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(5), model, [(3, 2), (1, 4)])))
    for arrival in ("poisson", "closed"):
        calls: list[int] = []
        result = serve([path], tiny_profile(), "cpu-only", {"workload.arrival": arrival, "workload.requests": "7",
                                                            "workload.qps": "5"}, progress=calls.append)
        assert sum(calls) == 7 and all(n >= 1 for n in calls)
        assert len(calls) == len({r.finish_s for r in result.requests})  # one call per step that finished any


def test_host_memory_floor_counts_requests_and_batch_entries():
    from moesim.sim.serving import ENTRY_BYTES, REQUEST_BYTES, TraceRequest, serving_bytes
    empty = np.zeros((1, 0, 1))
    pool = [TraceRequest("a", 0, 3, 5, empty), TraceRequest("a", 1, 0, 2, empty)]
    # 5 requests: a, b, a, b, a; entries: a's prefill + 5 decodes = 6, b's 2 decodes (no prompt)
    assert serving_bytes(pool, 5) == 5 * REQUEST_BYTES + (3 * 6 + 2 * 2) * ENTRY_BYTES


def _serve_peak_bytes(path: str, requests: int) -> int:
    import tracemalloc
    tracemalloc.start()
    try:
        serve([path], tiny_profile(), "cpu-only", {"workload.requests": str(requests), "workload.qps": "1e6"})
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_host_memory_floor_is_below_what_a_run_takes_and_close_to_it(tmp_path):
    """At a rate that batches every request at once (the floor's case), the measured peak per extra request
    is at least the floor (the refusal never turns away a run that fits) and within 2x of it."""
    from moesim.sim.serving import RequestPool, serving_bytes
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(6), model, [(4, 20), (2, 3)])))
    _serve_peak_bytes(path, 50)  # caches and imports out of the way
    measured = _serve_peak_bytes(path, 600) - _serve_peak_bytes(path, 200)
    pool = RequestPool([path], []).requests
    floor = serving_bytes(pool, 600) - serving_bytes(pool, 200)
    assert floor <= measured <= 2 * floor


def test_a_run_that_cannot_fit_in_host_memory_is_refused_before_it_starts(tmp_path):
    from moesim.sim.serving import TraceRequest, check_host_memory, serving_bytes
    from moesim.util import host_bytes_available
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(7), model, [(2, 1)])))
    with pytest.raises(ConfigError, match=r"workload\.requests.*need at least .* GiB of host memory") as err:
        serve([path], tiny_profile(), "cpu-only", {"workload.requests": str(10**12)})  # 400 TB
    assert "serve at most" in str(err.value) and "\n" not in str(err.value)
    available = host_bytes_available()
    assert available is None or 0 < available < 10**15
    pool = [TraceRequest("a", 0, 2, 1, np.zeros((1, 3, 1)))]
    need = serving_bytes(pool, 1000)
    check_host_memory(pool, 1000, need)  # exactly enough
    check_host_memory(pool, 1000, None)  # unknown: the run goes ahead
    with pytest.raises(ConfigError, match="serve at most 999 requests"):
        check_host_memory(pool, 1000, need - 1)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_a_seed_numpy_cannot_take_is_a_config_error(tmp_path, seed):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(8), model, [(2, 1)])))
    with pytest.raises(ConfigError, match="field 'seed'"):
        serve([path], tiny_profile(), "cpu-only", {"workload.requests": "2"}, seed=seed)


def test_a_trace_that_logged_some_layers_is_served_on_those_layers(tmp_path):
    """The vLLM MoE logger writes one file per layer (layer 12 of 24, say): serving runs the logged layers,
    as a replay does, with the replay's note."""
    from tests.factories import write_partial_trace
    path = str(write_partial_trace(tmp_path / "l1.parquet", [1], num_layers=3, steps=5, requests=2))
    result = serve([path], tiny_profile(), "cpu-only", {"workload.requests": "2", "workload.qps": "100"})
    assert any("logs 1 of the model's 3 MoE layers (1)" in n for n in result.engine.notes)
    # 2 requests x 5 tokens x 1 layer x top-2
    assert result.engine.counters.activations == 2 * 5 * 2
    both = str(write_partial_trace(tmp_path / "l12.parquet", [1, 2], num_layers=3, steps=5, requests=2))
    with pytest.raises(ConfigError, match=r"logs MoE layers 1, 2, .*l1.parquet logs 1 \(fix: serve traces that "
                                          r"logged the same layers together"):
        serve([path, both], tiny_profile(), "cpu-only", {"workload.requests": "2"})


@pytest.mark.parametrize("key, raw, suggestion", [("workload.qps", "-1", "0.5"), ("workload.qps", "0", "0.5"),
                                                  ("workload.cv", "-2", "2"), ("workload.requests", "-3", "1"),
                                                  ("workload.concurrency", "0", "1")])
def test_a_workload_number_valid_only_above_zero_asks_for_that(key, raw, suggestion):
    """qps=-1 was told 'give a value >= 0', and then 0 was refused too."""
    from moesim.sim.workload import split_settings
    name = key.removeprefix("workload.")
    with pytest.raises(ConfigError, match=rf"^field '{key}': {name} must be above 0, got {raw} "
                                          rf"\(fix: use e.g. {suggestion}\)$"):
        split_settings({key: raw})
    assert getattr(split_settings({key: suggestion}).workload, name) == float(suggestion)


def test_a_rate_too_low_for_float_seconds_is_refused_and_one_within_keeps_its_digits(tmp_path):
    """At 1e-20 req/s arrivals came at ~1e20 s, where float64 seconds lost every step: TTFT and TPOT read 0.
    A rate whose arrivals span more than LATEST_ARRIVAL_S is refused before the run; one just within it gives
    the latencies of a run at an ordinary rate (each request alone, the server idle)."""
    from moesim.sim.workload import LATEST_ARRIVAL_S
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = str(write_tiny_trace(tmp_path / "t.parquet", model,
                                request_routing(np.random.default_rng(2), model, [(3, 4)])))
    with pytest.raises(ConfigError, match="step times keep their digits") as err:
        serve([path], tiny_profile(), "cpu-only", {"workload.qps": "1e-20", "workload.requests": "2"})
    assert err.value.field == "workload.qps" and "at least 2e-07 req/s" in str(err.value)
    low = request_frame(serve([path], tiny_profile(), "cpu-only",
                              {"workload.qps": str(4 / LATEST_ARRIVAL_S), "workload.requests": "2"}))
    ordinary = request_frame(serve([path], tiny_profile(), "cpu-only",
                                   {"workload.qps": "1e-3", "workload.requests": "2"}))
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert low[key].tolist() == pytest.approx(ordinary[key].tolist(), rel=1e-6), key


@pytest.mark.parametrize("text, field, message", [
    ("arrival_s\n0\nnan\n", "arrival_s", "row 2 has arrival_s=nan"),
    ("arrival_s\n0\n-1\n", "arrival_s", "row 2 has arrival_s=-1"),
    ("arrival_s\n0\n2e7\n", "arrival_s", "row 2 has arrival_s=2e+07"),
    ("arrival_s\n1\n0.5\n", "arrival_s", "row 2's arrival_s=0.5 is earlier than row 1's 1"),
    ("request,arrival_s\n7,0\n9,1\n", "request", "names requests (column 'request')"),
    (" arrival_s \n0\n1\n", "arrival_s", "no arrival_s column (its columns: ' arrival_s ')"),
    ("arrival_s;x\n0;1\n1;2\n", "arrival_s", "no arrival_s column (its columns: 'arrival_s;x')"),
])
def test_an_arrival_file_is_refused_at_its_first_bad_row_or_column(tmp_path, text, field, message):
    """A nan or negative time was told to sort the file; a time past LATEST_ARRIVAL_S gave latencies of 0;
    a column naming requests (which serving does not read) was ignored unseen."""
    (tmp_path / "arrivals.csv").write_text(text)
    w = WorkloadConfig(arrival="trace", arrival_file=str(tmp_path / "arrivals.csv"), requests=2)
    with pytest.raises(ConfigError) as err:
        arrival_times(w, np.random.default_rng(0))
    assert err.value.field == field and message in str(err.value)
    assert ("sort" in str(err.value)) == ("earlier" in message)


def test_a_request_longer_than_the_kv_the_cache_leaves_is_told_how_many_slots_to_give_up(tmp_path):
    """The expert cache is sized for the first trace's KV; a longer request of a second trace was refused with
    'use fewer expert slots, workload.kv_tokens=0' (the setting already in force) and no count of slots. The
    line now names cache.slots and a count that, set, runs."""
    from moesim.cli import main
    short, long = tmp_path / "short.parquet", tmp_path / "long.parquet"
    for path, prompt in ((short, "10"), (long, "1500")):
        assert main(["trace", "synth", "--model", "mixtral-8x7b", "--prompt-lens", prompt, "--decode-lens", "2",
                     "--out", str(path)]) == 0
    traces = [str(short), str(long)]
    with pytest.raises(ConfigError) as err:
        serve(traces, "rtx4090", "gpu-only-lru", {"workload.requests": "2"})
    assert err.value.field == "cache.slots" and "workload.kv_tokens=0" not in str(err.value)
    assert "the GPU memory 60 expert slots leave holds 1,355" in str(err.value)
    assert "--set cache.slots=59 or fewer" in str(err.value)
    frame = request_frame(serve(traces, "rtx4090", "gpu-only-lru", {"workload.requests": "2", "cache.slots": "59"}))
    assert frame.prompt_tokens.tolist() == [10, 1500] and frame.finish_s.notna().all()


def test_a_bursty_draw_past_the_latest_arrival_is_refused():
    """A gamma draw can end past LATEST_ARRIVAL_S when its mean does not (seed 1: 1.2e7 s for a mean of
    8.3e6 s); its latencies would have lost their digits."""
    w = WorkloadConfig(arrival="gamma", qps=6e-7, cv=3.0, requests=5)
    with pytest.raises(ConfigError, match="comes at 1.2e[+]07 s of simulated time") as err:
        arrival_times(w, np.random.default_rng(1))
    assert err.value.field == "workload.qps"
    assert arrival_times(w, np.random.default_rng(0))[-1] <= 1e7


@pytest.mark.parametrize("cv", [1e-9, 1e-154, 1e-160, 1e-200])
def test_gamma_arrivals_of_a_vanishing_cv_are_regular(cv):
    """cv=1e-200 squared to 0 and stopped the run with a ZeroDivisionError; cv=1e-154 drew every gap as 0 and
    1e-160 as nan. Such a gamma process is regular: one arrival every 1/qps."""
    times = arrival_times(WorkloadConfig(arrival="gamma", qps=2.0, cv=cv, requests=4), np.random.default_rng(0))
    assert times.tolist() == pytest.approx([0.5, 1.0, 1.5, 2.0], rel=1e-7)
