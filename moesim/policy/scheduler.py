"""Batching schedulers for serving workloads: which tokens of which requests form the next step.

Plain Python, no SimPy: the serving loop (:mod:`moesim.sim.serving`) asks
:meth:`Scheduler.next_batch` for a batch whenever the engine is free, runs it
through the engine and reports the tokens done with :meth:`Scheduler.advance`.

A request is ``prompt`` prefill tokens followed by ``output`` decode tokens.
Its KV cache holds one entry per computed token, allocated in blocks of
``kv_block_tokens`` entries: a request holding ``n`` tokens takes
``ceil(n / kv_block_tokens)`` blocks, as PagedAttention pages it (Kwon et al.,
SOSP'23, Sec. 4.1-4.3). The budget of ``kv_tokens`` entries is cut into whole
blocks (rounded down) and the running requests never hold more blocks than that;
a waiting request is admitted only if the blocks left after it stay at or above
``kv_watermark`` of them (vLLM's ``can_allocate``). ``kv_allocation`` says what
an admission allocates: ``prompt`` (vLLM, Sarathi-Serve) the blocks of the whole
prompt, or of the whole recompute, held from admission on while chunked prefill
computes it step by step (vLLM's ``_allocate_and_set_running`` allocates every
block of the sequence's tokens; a later chunk writes into blocks it already has);
``chunk`` (llama.cpp) the blocks of the piece that runs, later pieces taking blocks
as they run. When a decode needs a new
block and none is free, the most recently admitted request is preempted and recomputed later
(its KV freed; it waits at the head of the queue from the next step on), as vLLM
does by default (Kwon et al., SOSP'23, "Efficient Memory Management for Large
Language Model Serving with PagedAttention", Sec. 4.5, recomputation). Its new
prompt is its prompt and every token it has emitted, the last one included: the
tokens whose KV was dropped plus the token it was about to decode, so the
recompute step emits its next token itself (no separate decode step follows).

Schedulers (``--set scheduler=NAME``, parameters ``scheduler.<field>``):

* ``static``: request-level batching, the baseline Orca describes (Yu et al.,
  OSDI'22, Sec. 2.2): a batch of up to ``max_batch`` requests runs until its
  last request finishes; nobody joins in between.
* ``vllm``: continuous (iteration-level) batching with prefill priority, as
  vLLM's default scheduler: a step prefills waiting requests when any fit
  (``max_batch`` sequences, ``max_tokens`` batched tokens, free KV), and
  otherwise decodes every running request.
* ``sarathi``: chunked prefill with decode priority and stall-free batching
  (Agrawal et al., OSDI'24, "Taming Throughput-Latency Tradeoff in LLM
  Inference with Sarathi-Serve", Sec. 4.2-4.3): every running decode first,
  then prefill chunks fill the token budget ``max_tokens``.
* ``llamacpp``: llama.cpp's server (``tools/server``): ``max_batch`` slots
  (``--parallel``); each iteration adds one token per generating slot, then
  prompt tokens of the other slots until the batch holds ``n_batch`` tokens
  (``max_tokens``), splitting a prompt across iterations. Its KV cache is an
  array of cells, one per token position (``src/llama-kv-cells.h``), so it
  allocates per token: blocks of 1, no watermark, cells found for each batch as
  it is decoded, so a prompt takes them chunk by chunk (``kv_allocation`` chunk).

The last three are one :class:`ContinuousBatching` with different defaults;
each of its fields changes the batches it forms (tests/policy/test_scheduler.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from moesim.errors import ConfigError, did_you_mean
from moesim.policy.base import Component


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it: lengths and progress, no routing."""

    rid: int
    arrival: float
    prompt: int
    output: int
    #: tokens computed so far whose KV is held (prompt first, then decode tokens)
    done: int = 0
    #: tokens to compute in prefill mode: the prompt, or more after a preemption (recompute)
    prefill_until: int = 0
    preemptions: int = 0
    #: tokens whose KV a preemption dropped, computed again
    recomputed: int = 0
    #: KV entries its blocks were allocated for at admission (its whole prefill, written chunk by chunk);
    #: 0 when blocks are taken as tokens are computed. It holds the blocks of max(done, reserved) entries
    reserved: int = 0

    def __post_init__(self) -> None:
        self.prefill_until = max(self.prefill_until, self.prompt)

    @property
    def total(self) -> int:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.done < self.prefill_until

    @property
    def finished(self) -> bool:
        return self.done >= self.total


@dataclass
class Batch:
    """One step: ``(request, tokens)`` pairs in admission order, and the requests preempted to make it."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler(Component):
    """Owns the waiting queue and the running set; forms one batch per step."""

    role: ClassVar[str] = "scheduler"

    def __post_init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kv_tokens: int | None = None

    def set_kv_tokens(self, kv_tokens: int | None) -> None:
        """KV cache entries available to requests (None: unlimited); they are used in whole blocks."""
        self.kv_tokens = kv_tokens

    def block_tokens(self) -> int:
        """KV entries per block (1: the KV cache is allocated per token)."""
        return 1

    def watermark_blocks_of(self, total_blocks: int) -> int:
        """Blocks an admission must leave free out of ``total_blocks`` (0: none)."""
        return 0

    def watermark_blocks(self) -> int:
        """Blocks an admission must leave free out of the budget's."""
        return 0 if self.kv_blocks is None else self.watermark_blocks_of(self.kv_blocks)

    @property
    def kv_blocks(self) -> int | None:
        """The budget in whole blocks: a partial block at the end of the memory holds no request's KV."""
        return None if self.kv_tokens is None else self.kv_tokens // self.block_tokens()

    def blocks(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` entries of one request (its last block may be partly empty)."""
        return -(-tokens // self.block_tokens())

    def held_blocks(self, request: Request) -> int:
        """Blocks ``request`` holds: those of its computed entries, or of all it was allocated at admission."""
        return self.blocks(max(request.done, request.reserved))

    def growth(self, request: Request, n: int) -> int:
        """New blocks ``request`` takes to add ``n`` entries to those it holds (none within its allocation)."""
        return self.blocks(max(request.done + n, request.reserved)) - self.held_blocks(request)

    def tokens_to_fit(self, tokens: int) -> int:
        """The least budget, in entries, on which a request of ``tokens`` tokens can run alone: whole
        blocks for it, plus the watermark it must leave free when admitted."""
        need = self.blocks(tokens)
        total = need
        while total - self.watermark_blocks_of(total) < need:
            total += 1
        return total * self.block_tokens()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def kv_used(self) -> int:
        """KV entries the running requests have written (tokens computed; allocated entries not yet written
        are not counted)."""
        return sum(r.done for r in self.running)

    def kv_used_blocks(self) -> int:
        """KV blocks the running requests hold, allocated ones not yet written included."""
        return sum(self.held_blocks(r) for r in self.running)

    def kv_free(self) -> float:
        """Free KV blocks (inf: unlimited)."""
        return float("inf") if self.kv_blocks is None else self.kv_blocks - self.kv_used_blocks()

    def next_batch(self) -> Batch:
        raise NotImplementedError

    def advance(self, batch: Batch) -> list[Request]:
        """Record the batch as computed; return the requests it finished (they leave, freeing their KV)."""
        for request, n in batch.entries:
            request.done += n
        done = [r for r, _ in batch.entries if r.finished]
        if done:
            gone = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in gone]
        return done

    def check(self, request: Request) -> None:
        """Refuse a request that could never run alone (it would wait forever). Its whole length must be
        admissible: a request preempted at its last token comes back as a recompute of all its tokens, whose
        blocks a whole-prompt admission (``kv_allocation`` prompt) allocates at once."""
        if self.kv_tokens is not None and self.tokens_to_fit(request.total) > self.kv_tokens:
            raise ConfigError(f"a request of {request.total} tokens needs more KV cache than the "
                              f"{self.kv_tokens} entries left beside the expert cache{self.in_blocks()}",
                              field="cache.slots_per_layer",
                              fix="use fewer expert slots, workload.kv_tokens=0, or shorter requests")

    def in_blocks(self) -> str:
        """How the budget is cut into blocks, for messages ('' when allocated per token)."""
        if self.block_tokens() == 1 and not self.watermark_blocks():
            return ""
        return (f" ({self.kv_blocks} blocks of {self.block_tokens()} tokens, {self.watermark_blocks()} of them "
                f"kept free at admission)")


@dataclass
class StaticBatching(Scheduler):
    """Request-level batching (Orca, OSDI'22, Sec. 2.2): a batch runs to its last request's end.

    The batch's prompts are prefilled in one step, then all its requests decode
    together; requests that finish early leave, none join until the batch is
    empty. KV for a request's whole length is reserved when it is admitted, so
    a static batch is never preempted.
    """

    name: ClassVar[str] = "static"
    #: requests per batch
    max_batch: int = 8

    def next_batch(self) -> Batch:
        if not self.running:
            reserved = 0
            while self.waiting and len(self.running) < self.max_batch:
                head = self.waiting[0]
                if self.kv_blocks is not None and reserved + self.blocks(head.total) > self.kv_blocks:
                    break
                reserved += self.blocks(head.total)
                head.reserved = head.total  # held from admission on, as kv_peak_blocks counts it
                self.running.append(self.waiting.popleft())
        prefilling = [r for r in self.running if r.prefilling]
        chosen = prefilling or self.running
        return Batch([(r, r.prefill_until - r.done if r.prefilling else 1) for r in chosen])


@dataclass
class ContinuousBatching(Scheduler):
    """Iteration-level batching (Orca, OSDI'22, Sec. 4.2) with a token budget, optional chunking and a priority."""

    name: ClassVar[str] = "continuous"
    #: most requests admitted at once, so most in one step (vLLM max_num_seqs, llama.cpp --parallel slots)
    max_batch: int = 256
    #: most tokens in one step (vLLM max_num_batched_tokens, Sarathi token budget, llama.cpp n_batch)
    max_tokens: int = 8192
    #: most prefill tokens of one request per step; 0: a prompt is prefilled whole or not at all
    chunk_tokens: int = 0
    #: "prefill": a step prefills when it can and decodes otherwise (vLLM); "decode": decodes first,
    #: prefill fills the rest of the budget (Sarathi-Serve, llama.cpp)
    priority: str = "prefill"
    #: KV entries per block: KV is allocated in whole blocks, a request of n tokens holding ceil(n / this)
    #: (vLLM --block-size, Sarathi-Serve CacheConfig.block_size: 16); 1: per token (llama.cpp's cells)
    kv_block_tokens: int = 1
    #: share of the KV blocks a waiting request's admission must leave free; decodes may use them (vLLM and
    #: Sarathi-Serve block managers' watermark: 0.01)
    kv_watermark: float = 0.0
    #: what an admission allocates: "prompt", the blocks of its whole prompt (or recompute), held while its
    #: chunks run (vLLM, Sarathi-Serve); "chunk", those of the piece that runs, later pieces allocating as they
    #: run (llama.cpp's cells, found per batch)
    kv_allocation: str = "chunk"

    def block_tokens(self) -> int:
        return self.kv_block_tokens

    def watermark_blocks_of(self, total_blocks: int) -> int:
        # vLLM: int(watermark * num_gpu_blocks), rounded down (vllm/core/block_manager.py)
        return int(self.kv_watermark * total_blocks)

    def validate(self) -> None:
        if self.priority not in ("prefill", "decode"):
            raise ConfigError(f"unknown priority '{self.priority}'", field="scheduler.priority",
                              fix="use prefill or decode")
        if self.kv_allocation not in ("prompt", "chunk"):
            raise ConfigError(f"unknown kv_allocation '{self.kv_allocation}'", field="scheduler.kv_allocation",
                              fix="use prompt (the whole prompt's blocks at admission) or chunk (as chunks run)")
        if not 0 <= self.kv_watermark < 1:
            raise ConfigError(f"scheduler.kv_watermark={self.kv_watermark} is out of range",
                              field="scheduler.kv_watermark", fix="use a share of the blocks in [0, 1), e.g. 0.01")
        for key, least in (("max_batch", 1), ("max_tokens", 1), ("chunk_tokens", 0), ("kv_block_tokens", 1)):
            if getattr(self, key) < least:  # the one out of range: max_tokens=0 was reported as max_batch
                raise ConfigError(f"scheduler.{key}={getattr(self, key)} is out of range",
                                  field=f"scheduler.{key}", fix=f"use {key} >= {least}")

    def check(self, request: Request) -> None:
        super().check(request)
        if not self.chunk_tokens and request.prompt > self.max_tokens:
            raise ConfigError(f"a prompt of {request.prompt} tokens exceeds scheduler.max_tokens="
                              f"{self.max_tokens} and prompts are not chunked", field="scheduler.max_tokens",
                              fix=f"use scheduler.max_tokens >= {request.prompt} or scheduler.chunk_tokens > 0")

    def next_batch(self) -> Batch:
        batch = Batch()
        while not batch.entries and (self.running or self.waiting):
            preempted = len(batch.preempted)
            if self.priority == "prefill":
                self._prefill(batch)
                if not batch.entries:
                    self._decode(batch)
            else:
                self._decode(batch)
                self._prefill(batch)
            if not batch.entries:
                if not self.running:
                    break  # the head of the queue waits for KV that only finishing requests free
                # a decode that yielded freed KV: the others try again before anyone else yields
                if len(batch.preempted) == preempted:
                    # running prompts hold all the KV and none can go on: the newest yields (recompute)
                    self._preempt(self.running[-1], batch)
        return batch

    # ------------------------------------------------------------------ parts of a step
    def _decode(self, batch: Batch) -> None:
        """One token for every running request past its prefill, preempting the newest when it needs a new
        block and none is free (a token that fits in its last block needs none: vLLM's can_append_slots)."""
        tokens = batch.tokens  # preemptions below add no entries: counted once (a step may hold thousands)
        free = self.kv_free() - self._batch_blocks(batch)
        queue = deque(r for r in self.running if not r.prefilling)
        taken: list[Request] = []
        while queue:
            request = queue.popleft()
            if len(batch.entries) + len(taken) >= self.max_batch or tokens + len(taken) >= self.max_tokens:
                break
            need = self.growth(request, 1)
            while free < need and (victim := self._victim(request)) is not None:
                free += self.held_blocks(victim)  # a victim mid-prefill frees the blocks of its whole prompt
                if queue and queue[-1] is victim:  # not yet given its token (the newest is the queue's last)
                    queue.pop()
                self._preempt(victim, batch)
            if free < need:  # nothing left to preempt: this request waits itself
                self._preempt(request, batch)
                continue
            taken.append(request)
            free -= need
        batch.entries += [(r, 1) for r in taken]

    def _batch_blocks(self, batch: Batch) -> int:
        """New blocks the batch's entries take."""
        return sum(self.growth(r, n) for r, n in batch.entries)

    def _victim(self, request: Request) -> Request | None:
        """The running request to preempt for ``request``: the newest, if admitted after it. Those taken
        into this batch so far were all admitted before it (the decode goes in admission order)."""
        newest = self.running[-1]
        return None if newest is request else newest

    def _preempt(self, request: Request, batch: Batch) -> None:
        """Free ``request``'s KV; it waits at the head of the queue and prefills its tokens again."""
        if self.running[-1] is request:  # the common case: the newest yields
            self.running.pop()
        else:
            del self.running[next(i for i, r in enumerate(self.running) if r is request)]
        # past its prompt it has emitted a token beyond its KV (the input of its next decode): vLLM's new prompt
        # holds that token too, so the recompute step emits the next token as a prefill ends with one
        emitted_to = request.done + 1 if request.done >= request.prompt else request.prompt
        request.prefill_until = max(request.prefill_until, emitted_to)
        request.recomputed += request.done  # the entries written; allocated ones not yet written cost nothing
        request.done = 0
        request.reserved = 0
        request.preemptions += 1
        self.waiting.appendleft(request)
        batch.preempted.append(request)

    def _prefill(self, batch: Batch) -> None:
        """Prefill work in admission order: running requests mid-prompt first, then waiting ones."""
        free = self.kv_free() - self._batch_blocks(batch)
        for request in [r for r in self.running if r.prefilling]:
            n = self._piece(request, batch, free)
            if n:
                batch.entries.append((request, n))
                free -= self.growth(request, n)
        # admitted requests hold their place (and KV) until they finish: vLLM counts the running ones against
        # max_num_seqs before it schedules a new prompt, and llama.cpp has that many slots
        while self.waiting and len(batch.entries) < self.max_batch and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if any(request is p for p in batch.preempted):
                break  # it yielded in this step: back in the queue for the next (vLLM requeues after the step)
            # an admission leaves the watermark's blocks free (vLLM's can_allocate), for running decodes
            n = self._piece(request, batch, free - self.watermark_blocks(), admitting=True)
            if not n:
                break  # first come, first served: nobody overtakes the head of the queue
            self.running.append(self.waiting.popleft())
            before = self.held_blocks(request)
            if self.kv_allocation == "prompt":  # its whole prompt (or recompute) is allocated now
                request.reserved = request.done + self._prefill_need(request)
            batch.entries.append((request, n))
            free -= self.held_blocks(request) - before + self.growth(request, n)  # its allocation, its piece

    @staticmethod
    def _prefill_need(request: Request) -> int:
        """Tokens ``request`` computes before it decodes one per step: the rest of its prompt or recompute (a
        request without prompt, from a trace that logged no prefill, joins with its first decode token)."""
        return request.prefill_until - request.done if request.prefilling else 1

    def _piece(self, request: Request, batch: Batch, free: float, admitting: bool = False) -> int:
        """Prefill tokens of ``request`` that fit this step and ``free`` blocks (0: none). Admitted with its
        whole prompt's blocks, it needs them all free, whatever piece of it runs now."""
        if len(batch.entries) >= self.max_batch:
            return 0
        need = self._prefill_need(request)
        if admitting and self.kv_allocation == "prompt" and self.blocks(request.done + need) > free:
            return 0
        # tokens up to the end of the free blocks, the rest of those it holds (its last, or its allocation) first
        fit = (self.held_blocks(request) + free) * self.kv_block_tokens - request.done
        room = min(self.max_tokens - batch.tokens, fit)
        if self.chunk_tokens:
            return int(max(min(need, self.chunk_tokens, room), 0))
        if need > self.max_tokens and request.prefill_until > request.prompt:
            # a recompute longer than a step's token budget could never run whole (check() bounds prompts, not
            # prompts plus the tokens emitted before a preemption): it goes in pieces, not waiting forever
            return int(max(min(need, room), 0))
        return need if need <= room else 0


#: scheduler name -> (class, defaults): each preset cites the system whose defaults it takes
SCHEDULERS: dict[str, tuple[type[Scheduler], dict[str, object]]] = {
    "static": (StaticBatching, {}),
    # vLLM (v0) defaults: max_num_seqs 256, max_num_batched_tokens 8192 here (vLLM uses at least the
    # model length), no chunked prefill, prefills first; KV blocks of 16 tokens (--block-size: 16 on CUDA,
    # vllm/platforms/cuda.py, EngineArgs.block_size before) and a watermark of 0.01 of them
    # (SelfAttnBlockSpaceManager in vllm/core/block_manager.py); with chunked prefill it still allocates the
    # whole prompt's blocks when it admits a request (Scheduler._allocate_and_set_running)
    "vllm": (ContinuousBatching, {"max_batch": 256, "max_tokens": 8192, "chunk_tokens": 0, "priority": "prefill",
                                  "kv_block_tokens": 16, "kv_watermark": 0.01, "kv_allocation": "prompt"}),
    # Sarathi-Serve (OSDI'24 Sec. 5): token budget 512 for the latency-bound setting, chunks fill it; KV blocks
    # of 16 (sarathi/config/config.py, CacheConfig) and a watermark of 0.01
    # (sarathi/core/block_space_manager/base_block_space_manager.py), which allocates a request's whole prompt
    # when the scheduler admits it, before its first chunk (its allocate, called on admission)
    "sarathi": (ContinuousBatching, {"max_batch": 256, "max_tokens": 512, "chunk_tokens": 512,
                                     "priority": "decode", "kv_block_tokens": 16, "kv_watermark": 0.01,
                                     "kv_allocation": "prompt"}),
    # llama.cpp server: 4 slots (--parallel) and n_batch 2048 (common/common.h defaults); KV in cells of one
    # token each (src/llama-kv-cells.h), no watermark, found for each batch as it is decoded (chunk by chunk)
    "llamacpp": (ContinuousBatching, {"max_batch": 4, "max_tokens": 2048, "chunk_tokens": 2048,
                                      "priority": "decode", "kv_block_tokens": 1, "kv_watermark": 0.0,
                                      "kv_allocation": "chunk"}),
}


def build_scheduler(name: str, params: dict[str, str]) -> Scheduler:
    """The scheduler ``name`` with ``scheduler.<field>`` parameters (strings, as ``--set`` gives them)."""
    if name not in SCHEDULERS:
        raise ConfigError(f"unknown scheduler '{name}'", field="scheduler",
                          fix=f"{did_you_mean(name, SCHEDULERS)}use one of {', '.join(SCHEDULERS)}")
    cls, defaults = SCHEDULERS[name]
    scheduler = cls(**defaults)  # type: ignore[arg-type]
    scheduler.name = name  # the preset's name, not the class's
    for key, raw in params.items():
        scheduler.set_param(key, raw)
    if isinstance(scheduler, ContinuousBatching):
        scheduler.validate()
    elif scheduler.max_batch < 1:  # type: ignore[attr-defined]
        raise ConfigError("max_batch must be >= 1", field="scheduler.max_batch", fix="use max_batch >= 1")
    return scheduler
