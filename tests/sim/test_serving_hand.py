"""Serving runs small enough to work by hand: every reported metric against the hand computation.

One MoE layer, every token routed to expert 0, ``cpu-only`` on the tiny profile (tests/factories.py), so a
step of ``n`` tokens from ``s`` requests takes

    d(n, s) = n * 50 us (attention) + 20 us (sync) + 1000 us * sqrt(n) (the CPU expert) + step_extra(n, s)

(step_extra: embedding, LM head and sampling, tests/sim/test_closed_form.py). Definitions checked (the
common ones, as vLLM's benchmark reports them): TTFT from arrival, queueing included, to the end of the step
that computes the last prompt token; TPOT over the tokens after the first, (finish - first token) /
(tokens out - 1); goodput the requests meeting every SLO per second; percentiles over requests (linear
interpolation, numpy's default).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from moesim.analysis.serving import preemption_notes, request_frame, serving_metrics
from moesim.errors import ConfigError
from moesim.sim.serving import serve
from tests.factories import tiny_model, tiny_profile, write_tiny_trace
from tests.sim.test_closed_form import ATTN, SYNC, cpu_expert, step_extra

MS = 1e3


def d(tokens: int, sequences: int) -> float:
    """Seconds one step of ``tokens`` tokens from ``sequences`` requests takes (the module docstring)."""
    return tokens * ATTN + SYNC + cpu_expert(tokens) + step_extra(tokens, sequences)


def pool_trace(folder: Path, lengths: list[tuple[int, int]]) -> str:
    """A trace of requests with these (prompt, decode) lengths, one after another, every token to expert 0."""
    model = tiny_model(layers=1, experts=2, top_k=1)
    steps = []
    for r, (prompt, decode) in enumerate(lengths):
        steps.append({"phase": "prefill", "tokens": {r: (0, [[[0]] * prompt])}})
        steps += [{"phase": "decode", "tokens": {r: (prompt + k, [[[0]]])}} for k in range(decode)]
    return str(write_tiny_trace(folder / "t.parquet", model, steps))


def arrivals(folder: Path, times: list[float]) -> dict[str, str]:
    (folder / "arrivals.csv").write_text("arrival_s\n" + "\n".join(map(repr, times)) + "\n")
    return {"workload.arrival": "trace", "workload.arrival_file": str(folder / "arrivals.csv"),
            "workload.requests": str(len(times))}


def pct(low: float, high: float, q: int) -> float:
    """numpy's percentile of two values."""
    return low + (high - low) * q / 100


def steps_of(result) -> list[tuple[list[tuple[int, int, int]], float, float]]:
    return [(sorted(b), s.start, s.end) for b, s in zip(result.batches, result.engine.steps)]


def test_the_step_time_is_the_hand_formula(tmp_path):
    """The premise of every case below: a step's time on this model and profile is d(n, s)."""
    trace = pool_trace(tmp_path, [(3, 2)])
    result = serve([trace], tiny_profile(), "cpu-only", {"workload.requests": "1", "workload.arrival": "closed"})
    assert [s.end - s.start for s in result.engine.steps] == pytest.approx([d(3, 1), d(1, 1), d(1, 1)], rel=1e-9)


def test_two_requests_under_vllm_every_metric_by_hand(tmp_path):
    """A (prompt 2, 2 decodes) at 0; B (prompt 3, 1 decode) at 1 ms, during A's prefill. vLLM prefills first:
    B's prompt runs alone while A's decode waits, then both decode, then A's last decode."""
    trace = pool_trace(tmp_path, [(2, 2), (3, 1)])
    a = 0.001
    assert a < d(2, 1)  # B arrives during A's prefill
    result = serve([trace], tiny_profile(), "cpu-only", arrivals(tmp_path, [0.0, a]))
    t1 = d(2, 1)
    t2 = t1 + d(3, 1)
    t3 = t2 + d(2, 2)
    t4 = t3 + d(1, 1)
    assert [b for b, _, _ in steps_of(result)] == [[(0, 0, 2)], [(1, 0, 3)], [(0, 2, 1), (1, 3, 1)], [(0, 3, 1)]]
    assert [e for _, _, e in steps_of(result)] == pytest.approx([t1, t2, t3, t4], rel=1e-12)

    f = request_frame(result)
    hand = {  # per request: queue (arrival to first step), TTFT (queueing included), TPOT, E2E, in ms
        "queue_ms": [0.0, (t1 - a) * MS],
        "ttft_ms": [t1 * MS, (t2 - a) * MS],
        # A: 3 tokens out (the prefill's and 2 decodes), TPOT over the 2 after the first; B: 2 out, 1 after
        "tpot_ms": [(t4 - t1) / 2 * MS, (t3 - t2) * MS],
        "e2e_ms": [t4 * MS, (t3 - a) * MS],
    }
    for key, values in hand.items():
        assert f[key].tolist() == pytest.approx(values, rel=1e-9), key
    assert f.tpot_ms[1] == pytest.approx(d(2, 2) * MS, rel=1e-9)  # B's one gap: the step both decode in

    m = serving_metrics(result, {"ttft_ms": 2.0})
    for key, values in hand.items():
        low, high = sorted(values)
        assert m[f"{key}_mean"] == pytest.approx((low + high) / 2, rel=1e-9)
        for q in (50, 90, 99):
            assert m[f"{key}_p{q}"] == pytest.approx(pct(low, high, q), rel=1e-9), (key, q)
    assert m["offered_qps"] == pytest.approx(2 / a)  # 2 requests over the time of the last arrival
    assert m["throughput_rps"] == pytest.approx(2 / t4, rel=1e-12)  # over the time of the last finish
    assert m["output_tokens_per_s"] == pytest.approx((3 + 2) / t4, rel=1e-12)
    assert m["engine"]["makespan_s"] == pytest.approx(t4, rel=1e-12)
    # TTFT 1.53 ms and 2.44 ms against 2 ms: exactly half meet it, goodput one request over the run
    assert hand["ttft_ms"][0] < 2.0 < hand["ttft_ms"][1]
    assert m["slo_attainment"] == 0.5 and m["goodput_rps"] == pytest.approx(1 / t4, rel=1e-12)
    assert m["preemptions"] == m["recomputed_tokens"] == 0
    assert m["kv_peak_tokens"] == 2 + 3 + 2  # during the step both decode: 2 + 3 held, 2 new


def test_goodput_needs_every_slo_met(tmp_path):
    """Same run: A meets TTFT 2 ms but not TPOT 2 ms (2.25 ms), B meets TPOT (1.53 ms) but not TTFT (2.44 ms);
    each SLO alone is met by half, both together by none. A request with one token out has no TPOT and
    meets any TPOT limit (vLLM's benchmark counts its TPOT as 0)."""
    trace = pool_trace(tmp_path, [(2, 2), (3, 1)])
    result = serve([trace], tiny_profile(), "cpu-only", arrivals(tmp_path, [0.0, 0.001]))
    end = result.engine.steps[-1].end
    for slo, share in (({"ttft_ms": 2.0}, 0.5), ({"tpot_ms": 2.0}, 0.5), ({"ttft_ms": 2.0, "tpot_ms": 2.0}, 0.0),
                       ({"e2e_ms": 4.0}, 0.5), ({"ttft_ms": 3.0, "tpot_ms": 3.0, "e2e_ms": 7.0}, 1.0)):
        m = serving_metrics(result, slo)
        assert m["slo_attainment"] == share and m["goodput_rps"] == pytest.approx(2 * share / end), slo
    alone = tmp_path / "one"
    alone.mkdir()
    one = serve([pool_trace(alone, [(2, 0)])], tiny_profile(), "cpu-only", arrivals(alone, [0.0]))
    m = serving_metrics(one, {"tpot_ms": 1e-6})
    assert math.isnan(m["tpot_ms_p50"]) and m["slo_attainment"] == 1.0


def test_static_batching_queues_an_arrival_behind_the_running_batch(tmp_path):
    """Same arrivals under request-level batching (max_batch 2): B arrives while A's batch runs and may not
    join it; it waits for A's last token, its queueing is A's whole run less its arrival time."""
    trace = pool_trace(tmp_path, [(2, 2), (3, 1)])
    a = 0.001
    result = serve([trace], tiny_profile(), "cpu-only",
                   {**arrivals(tmp_path, [0.0, a]), "scheduler": "static", "scheduler.max_batch": "2"})
    t1 = d(2, 1)
    a_done = t1 + 2 * d(1, 1)
    b_first = a_done + d(3, 1)
    b_done = b_first + d(1, 1)
    assert [b for b, _, _ in steps_of(result)] == [[(0, 0, 2)], [(0, 2, 1)], [(0, 3, 1)], [(1, 0, 3)], [(1, 3, 1)]]
    f = request_frame(result)
    assert f.queue_ms.tolist() == pytest.approx([0.0, (a_done - a) * MS], rel=1e-9)
    assert f.ttft_ms.tolist() == pytest.approx([t1 * MS, (b_first - a) * MS], rel=1e-9)
    assert f.e2e_ms.tolist() == pytest.approx([a_done * MS, (b_done - a) * MS], rel=1e-9)
    assert f.tpot_ms.tolist() == pytest.approx([d(1, 1) * MS, d(1, 1) * MS], rel=1e-9)


def test_one_preemption_recomputes_the_prompt_and_every_token_emitted(tmp_path):
    """Two requests of prompt 2 and 2 decodes, both at 0, 6 KV entries. Step 1: both prompts (4 entries);
    step 2: both decode (6); step 3: A needs a 7th, B (the newest) yields its 3 and A finishes; step 4: B's new
    prompt is its prompt and both tokens it emitted (vLLM's recompute): 4 tokens, ending with its last token.
    Before, B prefilled 3 and took a separate decode step for the 4th (5 steps, not 4). KV per token
    (scheduler.kv_block_tokens=1): vLLM's blocks of 16 would not hold 6 tokens at all."""
    trace = pool_trace(tmp_path, [(2, 2)])
    result = serve([trace], tiny_profile(), "cpu-only",
                   {"workload.arrival": "closed", "workload.concurrency": "2", "workload.requests": "2",
                    "workload.kv_tokens": "6", "scheduler.kv_block_tokens": "1"})
    t1 = d(4, 2)
    t2 = t1 + d(2, 2)
    t3 = t2 + d(1, 1)
    t4 = t3 + d(4, 1)
    assert [b for b, _, _ in steps_of(result)] == [[(0, 0, 2), (1, 0, 2)], [(0, 2, 1), (1, 2, 1)], [(0, 3, 1)],
                                                     [(1, 0, 4)]]
    f = request_frame(result)
    assert f.preemptions.tolist() == [0, 1]
    assert f.recomputed_tokens.tolist() == [0, 3]  # B's prompt and its first decode token lost their KV
    assert f.computed_tokens.tolist() == [4, 4 + 3]
    assert f.ttft_ms.tolist() == pytest.approx([t1 * MS, t1 * MS], rel=1e-9)  # B's first token is not re-sent
    assert f.e2e_ms.tolist() == pytest.approx([t3 * MS, t4 * MS], rel=1e-9)
    assert f.tpot_ms.tolist() == pytest.approx([(t3 - t1) / 2 * MS, (t4 - t1) / 2 * MS], rel=1e-9)
    m = serving_metrics(result)
    assert m["preemptions"] == 1 and m["recomputed_tokens"] == 3
    assert m["kv_peak_tokens"] == 6 == m["kv_tokens"]
    assert m["throughput_rps"] == pytest.approx(2 / t4, rel=1e-12)


def test_sarathi_chunks_a_prompt_beside_a_decode(tmp_path):
    """A (prompt 1, 3 decodes) at 0; B (prompt 5, 1 decode) at 1 ms; token budget 3, chunks of 3, decodes
    first. A's decode token takes 1 of each step's 3, B's prompt the other 2: 2 + 2 + 1 tokens, so B's first
    token comes at the end of the step A finishes in."""
    trace = pool_trace(tmp_path, [(1, 3), (5, 1)])
    a = 0.001
    assert a < d(1, 1)
    result = serve([trace], tiny_profile(), "cpu-only",
                   {**arrivals(tmp_path, [0.0, a]), "scheduler": "sarathi", "scheduler.max_tokens": "3",
                    "scheduler.chunk_tokens": "3"})
    t1 = d(1, 1)
    t2 = t1 + d(3, 2)
    t3 = t2 + d(3, 2)
    t4 = t3 + d(2, 2)
    t5 = t4 + d(1, 1)
    assert [b for b, _, _ in steps_of(result)] == [[(0, 0, 1)], [(0, 1, 1), (1, 0, 2)], [(0, 2, 1), (1, 2, 2)],
                                                     [(0, 3, 1), (1, 4, 1)], [(1, 5, 1)]]
    assert [e for _, _, e in steps_of(result)] == pytest.approx([t1, t2, t3, t4, t5], rel=1e-12)
    f = request_frame(result)
    assert f.queue_ms.tolist() == pytest.approx([0.0, (t1 - a) * MS], rel=1e-9)
    assert f.ttft_ms.tolist() == pytest.approx([t1 * MS, (t4 - a) * MS], rel=1e-9)
    assert f.tpot_ms.tolist() == pytest.approx([(t4 - t1) / 3 * MS, (t5 - t4) * MS], rel=1e-9)
    assert f.e2e_ms.tolist() == pytest.approx([t4 * MS, (t5 - a) * MS], rel=1e-9)
    assert np.diff([t1, t2, t3, t4]).max() == pytest.approx(d(3, 2), rel=1e-12)  # A's gaps stay one step each


def test_kv_in_blocks_preempts_where_kv_per_token_fits(tmp_path):
    """A and B, prompt 3 and 3 decodes each, both at 0; 12 KV entries. Per token (blocks of 1) both run to
    the end: 6 + 2 + 2 + 2 = 12 entries at most, 4 steps. In blocks of 4 the 12 entries are 3 blocks: the
    prompts take one each (3 of 4 entries), both first decodes fit in them (4 of 4); for the second, A takes
    the free block and B, finding none, yields its own 4 tokens (vLLM preempts the sequence itself when no
    newer one runs). B's recompute of 5 tokens (prompt and both tokens emitted) needs 2 blocks, one is free
    while A runs: it waits for A's end."""
    trace = pool_trace(tmp_path, [(3, 3)])
    settings = {"workload.arrival": "closed", "workload.concurrency": "2", "workload.requests": "2",
                "workload.kv_tokens": "12"}

    per_token = serve([trace], tiny_profile(), "cpu-only", {**settings, "scheduler.kv_block_tokens": "1"})
    assert [b for b, _, _ in steps_of(per_token)] == [[(0, 0, 3), (1, 0, 3)], *[[(0, k, 1), (1, k, 1)]
                                                                                  for k in (3, 4, 5)]]
    m = serving_metrics(per_token)
    assert m["preemptions"] == 0 and m["kv_peak_tokens"] == 12 == m["kv_peak_blocks"] == m["kv_blocks"]

    paged = serve([trace], tiny_profile(), "cpu-only", {**settings, "scheduler.kv_block_tokens": "4"})
    t1 = d(6, 2)
    t2 = t1 + d(2, 2)
    t3 = t2 + d(1, 1)
    t4 = t3 + d(1, 1)
    t5 = t4 + d(5, 1)
    t6 = t5 + d(1, 1)
    assert [b for b, _, _ in steps_of(paged)] == [[(0, 0, 3), (1, 0, 3)], [(0, 3, 1), (1, 3, 1)], [(0, 4, 1)],
                                                    [(0, 5, 1)], [(1, 0, 5)], [(1, 5, 1)]]
    assert [e for _, _, e in steps_of(paged)] == pytest.approx([t1, t2, t3, t4, t5, t6], rel=1e-12)
    assert paged.preempted == {2: [1]}
    f = request_frame(paged)
    assert f.preemptions.tolist() == [0, 1] and f.recomputed_tokens.tolist() == [0, 4]
    assert f.computed_tokens.tolist() == [6, 6 + 4]
    assert f.ttft_ms.tolist() == pytest.approx([t1 * MS, t1 * MS], rel=1e-9)
    assert f.e2e_ms.tolist() == pytest.approx([t4 * MS, t6 * MS], rel=1e-9)
    m = serving_metrics(paged)
    assert (m["kv_tokens"], m["kv_block_tokens"], m["kv_blocks"], m["kv_watermark_blocks"]) == (12, 4, 3, 0)
    # most held: 8 tokens in 2 blocks (both after their first decode; A's 5 and 6 tokens later, B's 5 and 6)
    assert m["kv_peak_tokens"] == 8 and m["kv_peak_blocks"] == 2
    assert m["preemptions"] == 1 and m["recomputed_tokens"] == 4


def test_a_budget_is_cut_into_whole_blocks(tmp_path):
    """vLLM's defaults (blocks of 16): 15 entries hold no block, so a request of 8 tokens is refused and the
    fix names 16; 31 entries are 1 block, as 16 are, so two such requests run one after the other."""
    trace = pool_trace(tmp_path, [(4, 4)])
    with pytest.raises(ConfigError) as err:
        serve([trace], tiny_profile(), "cpu-only", {"workload.requests": "1", "workload.kv_tokens": "15"})
    assert err.value.field == "workload.kv_tokens" and "use workload.kv_tokens=16 or more" in str(err.value)
    closed = {"workload.arrival": "closed", "workload.concurrency": "2", "workload.requests": "2"}
    for kv in ("16", "31"):
        result = serve([trace], tiny_profile(), "cpu-only", {**closed, "workload.kv_tokens": kv})
        # the second prompt (1 more block) waits for the first request's end: 1 + 4 steps, then its own 5
        assert [b for b, _, _ in steps_of(result)][:6] == [[(0, 0, 4)], *[[(0, k, 1)] for k in range(4, 8)],
                                                           [(1, 0, 4)]], kv
        assert serving_metrics(result)["kv_blocks"] == 1
    result = serve([trace], tiny_profile(), "cpu-only", {**closed, "workload.kv_tokens": "32"})
    assert [b for b, _, _ in steps_of(result)][0] == [(0, 0, 4), (1, 0, 4)]


def test_sarathi_admits_a_prompt_only_when_all_its_blocks_fit(tmp_path):
    """A (prompt 2, 2 decodes) at 0; B (prompt 5, 1 decode) at 1 ms, during A's prefill; 7 KV entries in
    blocks of 1, no watermark; token budget 3, chunks of 3, decodes first.

    Whole prompt (Sarathi-Serve's and vLLM's block managers allocate every block of a prompt when they admit
    it): after A's prefill, A holds 2 entries and its decode takes a 3rd; B's 5 would make 8 > 7, so B waits,
    and again beside A's last decode (A's 4 held until the step ends). Steps: A 2 | A 1 | A 1 | B 3 | B 2
    (first token) | B 1. Written entries peak at B's last step (6), so do the blocks held (6): during B's first
    chunk it holds 5 blocks with 3 entries written.

    Chunk by chunk (scheduler.kv_allocation=chunk, as before): B joins in step 2 with the 2 tokens A's decode
    leaves of the budget (3 + 2 = 5 held), then 1 (the last free entry: 4 + 3 = 7), then its last 2 once A has
    ended: A 2 | A 1 + B 2 | A 1 + B 1 | B 2 (first token) | B 1. B's first token comes a step earlier;
    7 entries are held at once."""
    trace = pool_trace(tmp_path, [(2, 2), (5, 1)])
    a = 0.001
    assert a < d(2, 1)  # B arrives during A's prefill
    settings = {**arrivals(tmp_path, [0.0, a]), "scheduler": "sarathi", "scheduler.max_tokens": "3",
                "scheduler.chunk_tokens": "3", "scheduler.kv_block_tokens": "1", "scheduler.kv_watermark": "0",
                "workload.kv_tokens": "7"}

    whole = serve([trace], tiny_profile(), "cpu-only", settings)
    t1 = d(2, 1)
    t2 = t1 + d(1, 1)
    t3 = t2 + d(1, 1)
    t4 = t3 + d(3, 1)
    t5 = t4 + d(2, 1)
    t6 = t5 + d(1, 1)
    assert [b for b, _, _ in steps_of(whole)] == [[(0, 0, 2)], [(0, 2, 1)], [(0, 3, 1)], [(1, 0, 3)], [(1, 3, 2)],
                                                    [(1, 5, 1)]]
    assert [e for _, _, e in steps_of(whole)] == pytest.approx([t1, t2, t3, t4, t5, t6], rel=1e-12)
    f = request_frame(whole)
    assert f.queue_ms.tolist() == pytest.approx([0.0, (t3 - a) * MS], rel=1e-9)  # B waits for A's end
    assert f.ttft_ms.tolist() == pytest.approx([t1 * MS, (t5 - a) * MS], rel=1e-9)
    assert f.tpot_ms.tolist() == pytest.approx([(t3 - t1) / 2 * MS, (t6 - t5) * MS], rel=1e-9)
    assert f.e2e_ms.tolist() == pytest.approx([t3 * MS, (t6 - a) * MS], rel=1e-9)
    assert f.computed_tokens.tolist() == [4, 6]
    m = serving_metrics(whole)
    assert m["preemptions"] == m["recomputed_tokens"] == 0 and whole.preempted == {}
    assert (m["kv_tokens"], m["kv_block_tokens"], m["kv_blocks"], m["kv_watermark_blocks"]) == (7, 1, 7, 0)
    assert m["kv_peak_tokens"] == 6 and m["kv_peak_blocks"] == 6
    assert m["throughput_rps"] == pytest.approx(2 / t6, rel=1e-12)
    assert m["output_tokens_per_s"] == pytest.approx((3 + 2) / t6, rel=1e-12)

    chunked = serve([trace], tiny_profile(), "cpu-only", {**settings, "scheduler.kv_allocation": "chunk"})
    c1 = d(2, 1)
    c2 = c1 + d(3, 2)
    c3 = c2 + d(2, 2)
    c4 = c3 + d(2, 1)
    c5 = c4 + d(1, 1)
    assert [b for b, _, _ in steps_of(chunked)] == [[(0, 0, 2)], [(0, 2, 1), (1, 0, 2)], [(0, 3, 1), (1, 2, 1)],
                                                      [(1, 3, 2)], [(1, 5, 1)]]
    assert [e for _, _, e in steps_of(chunked)] == pytest.approx([c1, c2, c3, c4, c5], rel=1e-12)
    g = request_frame(chunked)
    assert g.queue_ms.tolist() == pytest.approx([0.0, (c1 - a) * MS], rel=1e-9)
    assert g.ttft_ms.tolist() == pytest.approx([c1 * MS, (c4 - a) * MS], rel=1e-9)
    assert g.e2e_ms.tolist() == pytest.approx([c3 * MS, (c5 - a) * MS], rel=1e-9)
    n = serving_metrics(chunked)
    assert n["preemptions"] == 0 and n["kv_peak_tokens"] == 7 == n["kv_peak_blocks"]
    assert g.ttft_ms[1] < f.ttft_ms[1]  # whole-prompt allocation delays B's first token


def test_sarathi_preempts_a_request_mid_prefill_and_frees_all_its_blocks(tmp_path):
    """A (prompt 1, 4 decodes) at 0; B (prompt 5, 1 decode) at 1 ms; 8 KV entries in blocks of 2 (4 blocks),
    no watermark; token budget 2, chunks of 2, decodes first.

    Step 1: A's prompt (1 entry, 1 block). Step 2: A's first decode fits its block; B is admitted with the 3
    blocks of its whole prompt (1 + 3 = 4 held, 3 entries written) and prefills 1 token (the budget's rest).
    Step 3: A's decode needs a 2nd block, none is free: B, the newest, is preempted mid-prefill and frees all
    3 blocks, 2 of them never written; 1 token (the one it computed) is recomputed; its new prompt is its
    prompt (it had emitted nothing). Step 4: A's decode fits its block; B's 3 blocks are not free (2 are).
    Step 5: A's last decode takes a 3rd block (1 free); A ends. Steps 6-8: B's 5 prompt tokens in chunks of
    2, 2, 1 (first token); step 9: its decode. Written entries peak at 6 (B at the end); the blocks held at 4
    (step 2), with 3 entries written."""
    trace = pool_trace(tmp_path, [(1, 4), (5, 1)])
    a = 0.001
    assert a < d(1, 1)
    result = serve([trace], tiny_profile(), "cpu-only",
                   {**arrivals(tmp_path, [0.0, a]), "scheduler": "sarathi", "scheduler.max_tokens": "2",
                    "scheduler.chunk_tokens": "2", "scheduler.kv_block_tokens": "2", "scheduler.kv_watermark": "0",
                    "workload.kv_tokens": "8"})
    t1 = d(1, 1)
    t2 = t1 + d(2, 2)
    t3 = t2 + d(1, 1)
    t4 = t3 + d(1, 1)
    t5 = t4 + d(1, 1)
    t6 = t5 + d(2, 1)
    t7 = t6 + d(2, 1)
    t8 = t7 + d(1, 1)
    t9 = t8 + d(1, 1)
    assert [b for b, _, _ in steps_of(result)] == [[(0, 0, 1)], [(0, 1, 1), (1, 0, 1)], [(0, 2, 1)], [(0, 3, 1)],
                                                     [(0, 4, 1)], [(1, 0, 2)], [(1, 2, 2)], [(1, 4, 1)], [(1, 5, 1)]]
    assert [e for _, _, e in steps_of(result)] == pytest.approx([t1, t2, t3, t4, t5, t6, t7, t8, t9], rel=1e-12)
    assert result.preempted == {2: [1]}
    f = request_frame(result)
    assert f.preemptions.tolist() == [0, 1] and f.recomputed_tokens.tolist() == [0, 1]
    assert f.computed_tokens.tolist() == [5, 1 + 6]
    assert f.queue_ms.tolist() == pytest.approx([0.0, (t1 - a) * MS], rel=1e-9)  # its first (lost) chunk
    assert f.ttft_ms.tolist() == pytest.approx([t1 * MS, (t8 - a) * MS], rel=1e-9)
    assert f.tpot_ms.tolist() == pytest.approx([(t5 - t1) / 4 * MS, (t9 - t8) * MS], rel=1e-9)
    assert f.e2e_ms.tolist() == pytest.approx([t5 * MS, (t9 - a) * MS], rel=1e-9)
    m = serving_metrics(result)
    assert m["preemptions"] == 1 and m["recomputed_tokens"] == 1
    assert (m["kv_tokens"], m["kv_block_tokens"], m["kv_blocks"], m["kv_watermark_blocks"]) == (8, 2, 4, 0)
    assert m["kv_peak_tokens"] == 6 and m["kv_peak_blocks"] == 4
    assert m["throughput_rps"] == pytest.approx(2 / t9, rel=1e-12)
    assert preemption_notes([m]) == ["KV entries for 8 tokens in 4 blocks of 2 (workload.kv_tokens): cpu-only "
                                     "1 preemption, 1 token prefilled again"]
