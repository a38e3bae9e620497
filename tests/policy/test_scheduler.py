"""Batching schedulers on hand-worked queues: each mechanism and each parameter changes the batches it forms."""

from __future__ import annotations

import pytest

from moesim.errors import ConfigError
from moesim.policy.scheduler import ContinuousBatching, Request, StaticBatching, build_scheduler


def req(rid: int, prompt: int, output: int) -> Request:
    return Request(rid, 0.0, prompt, output)


def plan(scheduler, kv: int | None = None) -> list[tuple[int, int]]:
    """Run the scheduler until idle; the (request, tokens) of every step."""
    scheduler.set_kv_tokens(kv)
    steps = []
    while not scheduler.idle:
        batch = scheduler.next_batch()
        assert batch.entries
        steps.append(sorted((r.rid, n) for r, n in batch.entries))
        scheduler.advance(batch)
    return steps


def test_static_batch_runs_to_its_last_request():
    s = StaticBatching(max_batch=2)
    for r in (req(0, 3, 1), req(1, 2, 3), req(2, 1, 0)):
        s.add(r)
    # prompts of 0 and 1 together, then decodes; 0 finishes after one decode, 2 may not join until 1 is done
    assert plan(s) == [[(0, 3), (1, 2)], [(0, 1), (1, 1)], [(1, 1)], [(1, 1)], [(2, 1)]]


def test_static_admits_only_what_fits_in_kv():
    s = StaticBatching(max_batch=4)
    for r in (req(0, 3, 2), req(1, 3, 2)):
        s.add(r)
    assert plan(s, kv=9)[0] == [(0, 3)]  # 5 + 5 > 9: the second waits for the next batch
    s = StaticBatching(max_batch=4)
    for r in (req(0, 3, 2), req(1, 3, 2)):
        s.add(r)
    assert plan(s, kv=10)[0] == [(0, 3), (1, 3)]


def test_vllm_prefills_first_and_stalls_decodes():
    s = build_scheduler("vllm", {})
    s.add(req(0, 2, 3))
    s.set_kv_tokens(None)
    first = s.next_batch()
    s.advance(first)
    s.add(req(1, 4, 1))
    second = s.next_batch()
    assert [(r.rid, n) for r, n in second.entries] == [(1, 4)]  # request 0's decode waits
    s.advance(second)
    assert sorted((r.rid, n) for r, n in s.next_batch().entries) == [(0, 1), (1, 1)]


def test_decode_priority_mixes_decodes_with_prefill_chunks():
    s = ContinuousBatching(max_batch=8, max_tokens=4, chunk_tokens=4, priority="decode")
    s.add(req(0, 2, 3))
    s.set_kv_tokens(None)
    s.advance(s.next_batch())
    s.add(req(1, 7, 1))
    steps = []
    for _ in range(3):
        batch = s.next_batch()
        steps.append(sorted((r.rid, n) for r, n in batch.entries))
        s.advance(batch)
    # one decode token of 0 plus 3 prompt tokens of 1 fill the budget of 4; the last 1 prompt token, then decodes
    assert steps == [[(0, 1), (1, 3)], [(0, 1), (1, 3)], [(0, 1), (1, 1)]]


def test_chunk_tokens_caps_one_requests_prefill_piece():
    def first_step(chunk: int) -> list[tuple[int, int]]:
        s = ContinuousBatching(max_batch=8, max_tokens=100, chunk_tokens=chunk, priority="prefill")
        s.add(req(0, 10, 1))
        s.add(req(1, 10, 1))
        return plan(s)[0]
    assert first_step(0) == [(0, 10), (1, 10)]
    assert first_step(4) == [(0, 4), (1, 4)]


def test_max_tokens_without_chunking_holds_a_prompt_back():
    s = ContinuousBatching(max_batch=8, max_tokens=12, chunk_tokens=0)
    for r in (req(0, 8, 1), req(1, 8, 1)):
        s.add(r)
    assert plan(s)[:2] == [[(0, 8)], [(1, 8)]]


def test_max_batch_limits_requests_per_step():
    s = ContinuousBatching(max_batch=2, max_tokens=100)
    for r in (req(0, 1, 1), req(1, 1, 1), req(2, 1, 1)):
        s.add(r)
    steps = plan(s)
    assert steps[0] == [(0, 1), (1, 1)] and max(len(x) for x in steps) == 2


@pytest.mark.parametrize("name", ["vllm", "sarathi", "llamacpp"])
def test_max_batch_caps_the_requests_admitted_not_only_those_in_a_step(name):
    """Prefills first (vllm) filled a step with new prompts while the running requests waited: with max_batch 2
    and six requests, all six were admitted and held KV although only two could decode at a time."""
    s = build_scheduler(name, {"max_batch": "2"})
    for r in (req(i, 2, 3) for i in range(6)):
        s.add(r)
    s.set_kv_tokens(None)
    admitted: set[int] = set()
    while not s.idle:
        batch = s.next_batch()
        s.advance(batch)
        admitted |= {r.rid for r, _ in batch.entries}
        assert len(s.running) <= 2
    assert admitted == set(range(6))


def test_kv_exhaustion_preempts_the_newest_and_recomputes():
    s = ContinuousBatching(max_batch=8, max_tokens=100)
    a, b = req(0, 4, 3), req(1, 4, 3)
    s.add(a)
    s.add(b)
    s.set_kv_tokens(10)
    s.advance(s.next_batch())  # both prompts: 8 entries
    s.advance(s.next_batch())  # both decode: 10 entries, the budget
    batch = s.next_batch()  # no room: request 1 (admitted last) is preempted for request 0
    assert [(r.rid, n) for r, n in batch.entries] == [(0, 1)]
    assert batch.preempted == [b] and b.preemptions == 1 and b.done == 0
    # its prompt and first decode token lost their KV (5 recomputed); its new prompt, as vLLM forms it, is its
    # prompt and both tokens it emitted: 6 tokens, the second emitted one (position 5) computed for the first time
    assert b.prefill_until == 6 and b.recomputed == 5
    s.advance(batch)
    steps = plan(s, kv=10)
    # request 0 finishes (7 entries), then 1 prefills 6 tokens, emitting its 3rd token, and decodes its last
    assert steps == [[(0, 1)], [(1, 6)], [(1, 1)]]
    assert b.finished and b.recomputed == 5 and b.preemptions == 1


def test_a_preemption_before_any_decode_recomputes_the_prompt_and_the_first_token():
    """Preempted right after its prefill, a request has emitted one token and holds KV for its prompt only:
    vLLM's new prompt is the prompt plus that token (3 + 1), one step, where a prefill of 3 and a decode
    step of the 4th token were two."""
    s = ContinuousBatching(max_batch=8, max_tokens=100)
    a, b = req(0, 3, 3), req(1, 3, 1)
    s.add(a)
    s.add(b)
    # both prompts: 6 of 7 entries; a's decode takes the 7th and b, the newest, yields its 3 for want of one;
    # b's 4 tokens fit only once a (6 tokens) has finished
    assert plan(s, kv=7) == [[(0, 3), (1, 3)], [(0, 1)], [(0, 1)], [(0, 1)], [(1, 4)]]
    assert b.preemptions == 1 and b.recomputed == 3 and b.finished


def test_a_recompute_longer_than_the_token_budget_runs_in_pieces():
    """Prompts of 2 fit max_tokens=3 unchunked, but a request preempted after 4 decodes needs a prefill of 7
    (2 + 5 emitted tokens): it waited at the head of the queue forever (an empty batch, then SimPy's 'No
    scheduled events left'). It now recomputes in pieces of what the step's budget leaves."""
    s = ContinuousBatching(max_batch=8, max_tokens=3, chunk_tokens=0)
    a, b = req(0, 2, 6), req(1, 2, 6)
    s.add(a)
    s.add(b)
    steps = plan(s, kv=12)
    assert steps == [
        [(0, 2)], [(1, 2)],  # 2 + 2 > 3: one prompt per step; prefill first stalls a's decode
        *[[(0, 1), (1, 1)]] * 4,  # both decode to 6 entries each: 12, the budget
        [(0, 1)],  # a needs a 13th: b (6 entries) yields; its new prompt is 7 tokens
        [(1, 3)], [(1, 2)],  # 3 of them (the budget), then 2 (the 2 entries left)
        [(0, 1)],  # a needs an entry: b (5 entries) yields again, a finishes (8 tokens)
        [(1, 3)], [(1, 3)], [(1, 1)],  # b's 7 tokens in pieces of 3
        [(1, 1)],  # and its last decode
    ]
    assert b.preemptions == 2 and b.recomputed == 6 + 5 and a.preemptions == 0


def test_a_decode_that_yields_lets_an_older_prompt_go_on():
    """The newest request, decoding, yields its KV when it runs out; the older one, mid-prompt, uses it in
    the same step instead of yielding too, and the one that yielded is not readmitted before the next step
    (both yielding and both prefilling again, step after step, was a livelock)."""
    s = ContinuousBatching(max_batch=8, max_tokens=4, chunk_tokens=2, priority="prefill")
    old, new = req(0, 5, 3), req(1, 4, 1)
    s.add(old)
    s.add(new)
    s.set_kv_tokens(8)
    s.advance(s.next_batch())
    s.advance(s.next_batch())  # 2 + 2 prompt tokens each: 8 entries, old one prompt token short
    batch = s.next_batch()
    assert batch.preempted == [new] and old.preemptions == 0
    assert [(r.rid, n) for r, n in batch.entries] == [(0, 1)]
    s.advance(batch)
    steps = plan(s, kv=8)  # every step does work until both are done
    assert old.finished and new.finished and old.preemptions == 0
    assert sum(n for step in steps for rid, n in step if rid == 0) == 3  # the older one's three decode tokens


def test_presets_cite_their_defaults():
    assert build_scheduler("sarathi", {}).max_tokens == 512
    assert build_scheduler("llamacpp", {}).max_batch == 4
    assert build_scheduler("vllm", {"max_batch": "3"}).max_batch == 3
    with pytest.raises(ConfigError, match="scheduler.priority"):
        build_scheduler("vllm", {"priority": "fastest"})
    with pytest.raises(ConfigError, match="unknown scheduler"):
        build_scheduler("fcfs", {})
    with pytest.raises(ConfigError, match="scheduler.nope"):
        build_scheduler("static", {"nope": "1"})


def test_requests_that_could_never_run_are_refused():
    s = ContinuousBatching(max_tokens=8)
    with pytest.raises(ConfigError, match="exceeds scheduler.max_tokens"):
        s.check(req(0, 9, 1))
    s.set_kv_tokens(5)
    with pytest.raises(ConfigError, match="KV cache"):
        s.check(req(0, 3, 3))


@pytest.mark.parametrize("key, value", [("max_batch", "0"), ("max_tokens", "0"), ("chunk_tokens", "-1")])
def test_a_limit_out_of_range_is_named(key, value):
    """Every limit out of range was reported as field 'scheduler.max_batch', whichever it was."""
    with pytest.raises(ConfigError) as err:
        build_scheduler("sarathi", {key: value})
    assert err.value.field == f"scheduler.{key}"


def test_kv_in_blocks_preempts_a_decode_that_per_token_kv_keeps():
    """Two prompts of 3 and 3 decodes on 12 entries. Per token everything fits (12 at most). In blocks of 4,
    3 blocks: one each for the prompts, the first decodes fill them; for the second, A takes the last block
    and B, needing one, yields its own (4 tokens recomputed, its new prompt 5 tokens = 2 blocks, which wait
    for A's end)."""
    def run(block: int) -> tuple[list[list[tuple[int, int]]], Request]:
        s = ContinuousBatching(max_batch=8, max_tokens=100, kv_block_tokens=block)
        a, b = req(0, 3, 3), req(1, 3, 3)
        s.add(a)
        s.add(b)
        return plan(s, kv=12), b
    steps, b = run(1)
    assert steps == [[(0, 3), (1, 3)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    assert b.preemptions == 0
    steps, b = run(4)
    assert steps == [[(0, 3), (1, 3)], [(0, 1), (1, 1)], [(0, 1)], [(0, 1)], [(1, 5)], [(1, 1)]]
    assert b.preemptions == 1 and b.recomputed == 4


def test_a_token_that_fits_in_its_last_block_needs_no_free_block():
    """Blocks of 4, 8 entries = 2 blocks. Prompts of 1 and 2 hold both blocks, yet every decode writes into
    its own block's empty entries: nobody yields. A prompt of 4 fills its block: its decode needs a second,
    which B holds (as the newest, it yields), where per token 6 + 2 of 8 entries would fit."""
    s = ContinuousBatching(max_batch=8, max_tokens=100, kv_block_tokens=4)
    a, b = req(0, 1, 3), req(1, 2, 1)
    s.add(a)
    s.add(b)
    # per-token accounting of 8 entries agrees here: 3, 5, 3, 4 held
    assert plan(s, kv=8) == [[(0, 1), (1, 2)], [(0, 1), (1, 1)], [(0, 1)], [(0, 1)]]
    assert b.preemptions == 0
    s = ContinuousBatching(max_batch=8, max_tokens=100, kv_block_tokens=4)
    a, b = req(0, 4, 1), req(1, 2, 1)
    s.add(a)
    s.add(b)
    # B's recompute: its prompt and the token it emitted (3), which ends it
    assert plan(s, kv=8) == [[(0, 4), (1, 2)], [(0, 1)], [(1, 3)]]
    assert b.preemptions == 1 and b.recomputed == 2


def test_the_watermark_holds_back_an_admission_and_spares_a_preemption():
    """4 blocks of 2 entries. A (prompt 4, 1 decode) takes 2 blocks; B (prompt 3, 1 decode) needs 2 more.
    Without watermark B is admitted beside A, A's decode then needs a 5th block and B yields (recompute).
    With a watermark of 0.25 (1 block) B's admission would leave 0 free: it waits one step for A's end and
    runs without preemption (per token, 7 of 8 entries, it would have been admitted)."""
    def run(watermark: float) -> tuple[list[list[tuple[int, int]]], Request]:
        s = ContinuousBatching(max_batch=8, max_tokens=100, kv_block_tokens=2, kv_watermark=watermark)
        a, b = req(0, 4, 1), req(1, 3, 1)
        s.add(a)
        s.add(b)
        return plan(s, kv=8), b
    steps, b = run(0.0)
    assert steps == [[(0, 4), (1, 3)], [(0, 1)], [(1, 4)]]
    assert b.preemptions == 1 and b.recomputed == 3
    steps, b = run(0.25)
    assert steps == [[(0, 4)], [(0, 1)], [(1, 3)], [(1, 1)]]
    assert b.preemptions == 0


def test_the_watermark_is_a_share_of_the_blocks_rounded_down():
    s = build_scheduler("vllm", {})
    s.set_kv_tokens(16 * 199 + 15)  # 199 whole blocks: int(0.01 * 199) = 1
    assert (s.kv_blocks, s.watermark_blocks()) == (199, 1)
    s.set_kv_tokens(16 * 99)
    assert (s.kv_blocks, s.watermark_blocks()) == (99, 0)
    # a request of 17 tokens needs 2 blocks; a watermark of 0.5 keeps 1 of 2 free, and 1 of 3: it needs 3
    # blocks (48 entries) to be admitted alone; one of 16 tokens fits 1 block (int(0.5) = 0 kept free)
    s = build_scheduler("vllm", {"kv_watermark": "0.5"})
    assert s.tokens_to_fit(17) == 48 and s.tokens_to_fit(16) == 16


def test_kv_blocks_and_watermark_presets_cite_their_systems():
    for name, block, watermark in (("vllm", 16, 0.01), ("sarathi", 16, 0.01), ("llamacpp", 1, 0.0)):
        s = build_scheduler(name, {})
        assert (s.kv_block_tokens, s.kv_watermark) == (block, watermark), name
    assert build_scheduler("vllm", {"kv_block_tokens": "32"}).kv_block_tokens == 32
    with pytest.raises(ConfigError, match="scheduler.kv_block_tokens"):
        build_scheduler("static", {"kv_block_tokens": "16"})  # request-level batching reserves per token
    for key, value in (("kv_block_tokens", "0"), ("kv_watermark", "1.0")):
        with pytest.raises(ConfigError) as err:
            build_scheduler("vllm", {key: value})
        assert err.value.field == f"scheduler.{key}"


def test_kv_block_of_one_without_watermark_is_per_token_accounting():
    """The vllm preset with blocks of 1 and no watermark forms the batches of the per-token scheduler."""
    def steps(s) -> list[list[tuple[int, int]]]:
        for r in (req(0, 4, 3), req(1, 4, 3), req(2, 2, 5)):
            s.add(r)
        return plan(s, kv=10)
    per_token = ContinuousBatching(max_batch=256, max_tokens=8192, chunk_tokens=0, priority="prefill")
    expected = steps(per_token)
    assert steps(build_scheduler("vllm", {"kv_block_tokens": "1", "kv_watermark": "0"})) == expected
    assert steps(build_scheduler("vllm", {"kv_block_tokens": "2", "kv_watermark": "0"})) != expected


def test_chunked_prefill_under_vllm_holds_the_whole_prompts_blocks_from_admission():
    """vllm with chunk_tokens 2, 6 entries per token. A (prompt 4) is admitted with all 4 entries of its
    prompt, though its first chunk writes 2; B (prompt 3) needs 3 of the 2 left: it waits until A ends (A's
    decode, which fills its 5th entry, comes when no prompt can run). Taken chunk by chunk, B joined A at once
    (2 + 2 entries)."""
    def run(allocation: str) -> tuple[list[list[tuple[int, int]]], tuple[int, int]]:
        s = build_scheduler("vllm", {"chunk_tokens": "2", "kv_block_tokens": "1", "kv_watermark": "0",
                                     "kv_allocation": allocation})
        s.add(req(0, 4, 1))
        s.add(req(1, 3, 1))
        s.set_kv_tokens(6)
        first = s.next_batch()
        held = (s.kv_used_blocks() + s._batch_blocks(first), s.kv_used() + first.tokens)
        s.advance(first)
        return [sorted((r.rid, n) for r, n in first.entries)] + plan(s, kv=6), held
    steps, held = run("prompt")
    assert steps == [[(0, 2)], [(0, 2)], [(0, 1)], [(1, 2)], [(1, 1)], [(1, 1)]]
    assert held == (4, 2)  # blocks held during the first step, entries written in it
    steps, held = run("chunk")
    assert steps[0] == [(0, 2), (1, 2)] and held == (4, 4)


def test_a_preempted_request_frees_the_blocks_it_had_not_written():
    """Decodes first, blocks of 2, 4 blocks. A (prompt 1) decodes; B (prompt 5) is admitted with 3 blocks
    and prefills 1 token; A's next decode needs a block: B yields all 3 (1 entry written), recomputes 1."""
    s = ContinuousBatching(max_batch=8, max_tokens=2, chunk_tokens=2, priority="decode", kv_block_tokens=2,
                           kv_allocation="prompt")
    a, b = req(0, 1, 4), req(1, 5, 1)
    s.set_kv_tokens(8)
    s.add(a)
    s.advance(s.next_batch())
    s.add(b)
    s.advance(s.next_batch())
    assert (b.done, b.reserved, s.kv_used_blocks(), s.kv_free()) == (1, 5, 4, 0)
    batch = s.next_batch()
    assert batch.preempted == [b] and [(r.rid, n) for r, n in batch.entries] == [(0, 1)]
    assert (b.done, b.reserved, b.recomputed, b.prefill_until) == (0, 0, 1, 5)
    assert s.kv_used_blocks() == 1 and s._batch_blocks(batch) == 1  # A's 2nd block, from B's 3 freed


def test_kv_allocation_presets_and_values():
    for name, allocation in (("vllm", "prompt"), ("sarathi", "prompt"), ("llamacpp", "chunk")):
        assert build_scheduler(name, {}).kv_allocation == allocation, name
    assert build_scheduler("sarathi", {"kv_allocation": "chunk"}).kv_allocation == "chunk"
    with pytest.raises(ConfigError) as err:
        build_scheduler("vllm", {"kv_allocation": "lazy"})
    assert err.value.field == "scheduler.kv_allocation"


def test_static_batching_holds_each_requests_whole_length_from_admission():
    s = StaticBatching(max_batch=4)
    s.add(req(0, 3, 2))
    s.add(req(1, 1, 4))
    s.set_kv_tokens(None)
    batch = s.next_batch()
    assert (s.kv_used_blocks(), s.kv_used()) == (10, 0)
    assert sum(s.growth(r, n) for r, n in batch.entries) == 0  # its prompts write into blocks it holds
