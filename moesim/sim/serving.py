"""Serving workloads: requests arrive (SimPy processes), a scheduler batches them, the engine runs each batch.

Routing depends on a token's hidden state, not on the batch it runs in, so a
request's rows (every layer of every prompt and decode token) recorded in any
trace can be replayed inside any batch. :class:`RequestPool` reads those rows
from one or more traces; :func:`serve` sends ``workload.requests`` requests
drawn from the pool in turn, arriving by ``workload.arrival`` (:mod:`moesim.sim.workload`).

Whenever the engine is free the scheduler (:mod:`moesim.policy.scheduler`)
forms a batch; its rows become one :class:`~moesim.trace.io.Step` that
:meth:`Simulator.run_step` runs as it runs a trace's step, so every system
plans its layers as in a replay. KV cache comes out of the GPU memory the
expert cache leaves (:func:`kv_budget_tokens`), cut into the scheduler's KV
blocks, which a request holds from its admission (the whole prompt's, under vLLM
and Sarathi-Serve) or as its tokens are computed (llama.cpp); when they run out,
requests are preempted and recomputed (counted per request).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from moesim.errors import ConfigError, UnservableError
from moesim.policy.scheduler import Batch, Request, Scheduler, build_scheduler
from moesim.sim.engine import Simulator
from moesim.sim.memory import MemoryPlan
from moesim.sim.result import SimResult, StepRecord
from moesim.sim.workload import WorkloadConfig, arrival_times, check_horizon, split_settings
from moesim.trace.io import Step, read_meta, read_table, trace_columns
from moesim.trace.schema import PHASES, PREDICTOR_COLUMNS, score_rows
from moesim.util import host_bytes_available, listed

# ----------------------------------------------------------------------------- requests from traces
@dataclass
class TraceRequest:
    """One request's rows from a trace, as (layer, token) arrays."""

    source: str
    request: int
    prompt: int
    output: int
    experts: np.ndarray  # (layers, tokens, top_k)
    optional: dict[str, np.ndarray] = field(default_factory=dict)  # (layers, tokens, ...) per column

    @property
    def tokens(self) -> int:
        return self.prompt + self.output


class RequestPool:
    """The requests of one or more traces (same model), with their prompt and output lengths."""

    def __init__(self, traces: list[str], columns: list[str]) -> None:
        """``columns``: optional columns the system reads; those the first trace has, every trace must have
        (a system that needs one the first trace lacks falls back or refuses, as in a replay)."""
        if not traces:
            raise ConfigError("no trace given", field="TRACE", fix="give at least one trace")
        self.model = read_meta(traces[0]).model
        columns = [c for c in columns if c in trace_columns(traces[0])]
        self.requests: list[TraceRequest] = []
        #: the MoE layers the traces route (all of the model's, unless they logged only some: those are served)
        self.layers: list[int] = []
        for path in traces:
            model = read_meta(path).model
            if (model.num_layers, model.num_experts, model.top_k) != \
                    (self.model.num_layers, self.model.num_experts, self.model.top_k):
                raise ConfigError(f"model '{model.name}' differs from '{self.model.name}' of {traces[0]}",
                                  source=path, field="moesim.model", fix="serve traces of one model together")
            missing = [c for c in columns if c not in trace_columns(path)]
            if missing:
                raise ConfigError(f"column(s) {missing} of {traces[0]} are missing here", source=path,
                                  field=missing[0], fix="serve traces with the same optional columns together")
            logged, requests = _read_requests(path, columns)
            if self.layers and logged != self.layers:
                raise ConfigError(f"the trace logs MoE layers {listed(logged)}, {traces[0]} logs "
                                  f"{listed(self.layers)}", source=path, field="layer",
                                  fix="serve traces that logged the same layers together")
            self.layers = logged
            self.requests += requests
        if not self.requests:
            raise ConfigError("the traces hold no requests", source=traces[0], field="request",
                              fix="give a trace with rows")

    def __len__(self) -> int:
        return len(self.requests)


def _read_requests(path: str, columns: list[str]) -> tuple[list[int], list[TraceRequest]]:
    """The MoE layers the trace logged, and each request's rows as (layer, token) arrays over them."""
    names = ["request", "phase", "position", "layer", "experts", *columns]
    table = read_table(path, names)
    request = table.column("request").to_numpy()
    layer = table.column("layer").to_numpy()
    position = table.column("position").to_numpy()
    phase = np.asarray(table.column("phase").combine_chunks().dictionary_decode().to_pylist()) == PHASES[0]
    order = np.lexsort((position, layer, request))
    data = {"experts": _rows(table.column("experts"))[order]}
    num_experts = read_meta(path).model.num_experts
    for name in columns:
        column = table.column(name)
        rows = score_rows(column, num_experts) if name == "scores" else _rows(column)
        data[name] = rows[order]
    request, layer, position, phase = request[order], layer[order], position[order], phase[order]
    out = []
    logged = np.unique(layer)
    layers = len(logged)
    cuts = np.flatnonzero(np.diff(request)) + 1
    for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(request)]))):
        rid = int(request[lo])
        n = hi - lo
        tokens = n // layers
        fix = "serving needs every token of a request on every layer, prompt before decode"
        if n % layers or not (layer[lo:hi] == np.repeat(logged, tokens)).all():
            raise ConfigError(f"request {rid} does not have the same tokens on every layer", source=path,
                              field="layer", fix=fix)
        pos = position[lo:lo + tokens]
        if not (position[lo:hi] == np.tile(pos, layers)).all() or not (np.diff(pos) > 0).all():
            raise ConfigError(f"request {rid} has repeated positions", source=path, field="position", fix=fix)
        prefill = phase[lo:lo + tokens]
        prompt = int(prefill.sum())
        if prefill[prompt:].any():
            raise ConfigError(f"request {rid} has prefill rows after decode rows", source=path,
                              field="phase", fix=fix)
        shaped = {k: v[lo:hi].reshape((layers, tokens) + v.shape[1:]) for k, v in data.items()}
        out.append(TraceRequest(path, rid, prompt, int(tokens - prompt), shaped.pop("experts"), shaped))
    return logged.tolist(), out


def _rows(column: Any) -> np.ndarray:
    """A column as a numpy array with one entry per row (fixed lists as 2-D, variable lists as objects)."""
    column = column.combine_chunks()
    typ = column.type
    if hasattr(typ, "list_size"):
        return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, typ.list_size)
    if hasattr(typ, "value_type"):  # variable-length lists (predictor columns)
        values = np.empty(len(column), dtype=object)
        values[:] = [np.asarray(v, dtype=np.int16) for v in column.to_pylist()]
        return values
    return column.to_numpy(zero_copy_only=False)


def build_step(index: int, entries: list[tuple[Request, int]], pool: list[TraceRequest], layer_ids: list[int]
               ) -> Step:
    """The rows of one batch, ordered as a trace orders a step: by layer (``layer_ids``, those the traces
    logged), then request, then position."""
    layers = len(layer_ids)
    entries = sorted(entries, key=lambda e: e[0].rid)
    parts = [(r, pool[r.rid], r.done, n) for r, n in entries]
    # per token row, as whole arrays (a step may batch thousands of requests): its request, position, phase
    counts = np.array([n for _, _, _, n in parts])
    ids = np.repeat(np.array([r.rid for r, _, _, _ in parts]), counts).astype(np.int32)
    offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # 0, 1, ... per request
    positions = np.repeat(np.array([a for _, _, a, _ in parts]), counts) + offset
    phases = np.where(positions < np.repeat(np.array([r.prefill_until for r, _, _, _ in parts]), counts), 0, 1)

    def gather(key: str | None) -> np.ndarray:
        arrays = [(t.experts if key is None else t.optional[key])[:, a:a + n] for _, t, a, n in parts]
        stacked = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)
        return stacked.reshape((-1,) + stacked.shape[2:])

    tokens = len(positions)
    optional = pool[entries[0][0].rid].optional
    predictors = {k: list(gather(k)) for k in optional if k in PREDICTOR_COLUMNS}
    return Step(step=index, request=np.tile(ids, layers), position=np.tile(positions, layers).astype(np.int32),
                layer=np.repeat(np.asarray(layer_ids, dtype=np.int16), tokens),
                phase=np.tile(phases, layers).astype(np.int8), experts=gather(None),
                weights=gather("weights") if "weights" in optional else None,
                scores=gather("scores") if "scores" in optional else None,
                token_id=gather("token_id") if "token_id" in optional else None, predictors=predictors)


# ----------------------------------------------------------------------------- KV memory
def kv_budget_tokens(memory: MemoryPlan, kv_bytes_per_token: int, ignores_memory: bool) -> int | None:
    """KV entries that fit in the GPU memory left after the expert slots in use (None: memory not enforced).

    GPU bytes minus reserved, non-expert weights, workspace, staging buffers and
    the expert cache (slots x expert bytes): the same budget the expert cache
    was cut from (:func:`moesim.sim.memory.plan_memory`).
    """
    if ignores_memory:
        return None
    slots = slots_in_use(memory)
    left = (memory.gpu_bytes - memory.reserved_bytes - memory.non_expert_bytes - memory.workspace_bytes
            - memory.staging_bytes - slots * memory.expert_bytes)
    return max(left, 0) // kv_bytes_per_token


def slots_in_use(memory: MemoryPlan) -> int:
    """Expert slots the GPU holds: the layers' quotas, or a model-wide pool, which holds fewer."""
    slots = sum(memory.capacity)
    pool = getattr(memory, "pool", None)
    return slots if pool is None else min(slots, pool)


def check_kv_left(need: int, longest: int, kv: int, memory: MemoryPlan, kv_bytes_per_token: int) -> None:
    """Refuse a request longer than the KV the expert cache leaves, saying how many slots to give up: the
    scheduler's own line told to set workload.kv_tokens=0, which was already the case."""
    if need <= kv:
        return
    slots = slots_in_use(memory)
    per_slot = memory.expert_bytes // kv_bytes_per_token
    fewer = -(-(need - kv) // per_slot) if per_slot else slots + 1
    what = (f"a request of {longest} tokens needs KV for {need} (whole blocks and the watermark included); the "
            f"GPU memory {slots:,} expert slots leave holds {kv:,}")
    if fewer > slots - memory.reserved_slots:
        raise ConfigError(what + ", and giving up every slot would not make room", field="workload.requests",
                          fix="serve shorter requests, or on a GPU with more memory (--hw)")
    cache = slots - memory.reserved_slots - fewer  # cache.slots counts the cache, not a prefetch buffer beside it
    raise ConfigError(what, field="cache.slots",
                      fix=f"give up {fewer:,} slot{'s' if fewer > 1 else ''} ({per_slot:,} KV entries each): "
                          f"--set cache.slots={cache} or fewer; or serve shorter requests")


# ----------------------------------------------------------------------------- host memory
#: Host bytes a served request holds whatever its length (its record, scheduler state, arrival time and the
#: objects of its arrival), and per entry of the batch log (one request in one step: a prompt's prefill, or
#: one decode token). A run's records must all live until its percentiles are taken, so memory grows with
#: the request count and cannot be made lazy. Both are floors: about 10% under the peak tracemalloc measured
#: (460 and 82 bytes, Python 3.11) under a load that batches every request at once, the least a run takes
#: (tests/sim/test_serving.py checks them); a lightly loaded run takes up to about 450 bytes per entry, its
#: engine recording one step per decode token.
REQUEST_BYTES = 360
ENTRY_BYTES = 72


def serving_bytes(pool: list[TraceRequest], requests: int) -> int:
    """Least host memory a run of ``requests`` requests drawn in turn from ``pool`` takes: every request
    has its prompt prefilled in at least one step and each decode token in a step of its own."""
    def entries(part: list[TraceRequest]) -> int:
        return sum(t.output + (1 if t.prompt else 0) for t in part)
    rounds, rest = divmod(requests, len(pool))
    return requests * REQUEST_BYTES + (rounds * entries(pool) + entries(pool[:rest])) * ENTRY_BYTES


def check_rate(workload: WorkloadConfig, available: int | None) -> None:
    """Refuse, before any run, a rate too low for its requests to arrive within float64's digits
    (:func:`check_horizon`), unless their records alone exceed host memory: :func:`check_host_memory`
    then says so when the run starts, the more useful line for a count such as 10**12."""
    if available is not None and workload.requests * REQUEST_BYTES > available:
        return
    check_horizon(workload)


def check_host_memory(pool: list[TraceRequest], requests: int, available: int | None) -> None:
    """Refuse, before anything is allocated, a run whose floor of host memory exceeds ``available``."""
    need = serving_bytes(pool, requests)
    if available is None or need <= available:
        return
    per_request = need / requests
    fits = int(available // per_request)
    raise ConfigError(f"{requests:,} requests need at least {need / 2**30:,.1f} GiB of host memory "
                      f"({per_request:,.0f} bytes each), {available / 2**30:,.1f} GiB are available",
                      field="workload.requests",
                      fix=f"serve at most {fits:,} requests per run (--requests), or split the load into runs")


#: options of `moesim serve-sim` that serving errors name in their fix, and the sweep spec key each stands for:
#: a sweep point says the key (``workload.requests``), since a spec takes no command-line option
SPEC_KEYS = {"--requests": "workload.requests", "--qps": "workload.qps", "--hw": "hw"}
_SERVE_OPTION = re.compile(r"--(?:requests|qps|hw)\b(?!-)")


def spec_wording(text: str) -> str:
    """``text`` of a serving error, written for `moesim serve-sim`, in a sweep spec's terms.

    >>> spec_wording("serve at most 9 requests per run (--requests), or split the load into runs")
    'serve at most 9 requests per run (workload.requests), or split the load into runs'
    """
    return _SERVE_OPTION.sub(lambda option: SPEC_KEYS[option.group(0)], text)


# ----------------------------------------------------------------------------- the serving run
@dataclass
class RequestRecord:
    """What happened to one served request (seconds of simulated time)."""

    request: int
    source: str
    source_request: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    scheduled_s: float = float("nan")
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    preemptions: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0

    @property
    def emitted(self) -> int:
        """Tokens the request returns: one per decode token, plus the one its prefill ends with."""
        return self.output_tokens + (1 if self.prompt_tokens else 0)


@dataclass
class ServeResult:
    """A serving run: per-request records, the engine's result over all steps, and the run's set-up."""

    requests: list[RequestRecord]
    engine: SimResult
    workload: WorkloadConfig
    scheduler: str
    kv_tokens: int | None
    offered_qps: float
    batches: list[list[tuple[int, int, int]]] = field(default_factory=list)
    #: step index -> the requests preempted to form that step (their KV freed before it ran); steps without any
    #: are left out (a list per step would cost host memory on runs of many steps)
    preempted: dict[int, list[int]] = field(default_factory=dict)
    #: most KV entries (tokens) written during one step: the running requests' computed tokens and those the
    #: step computes (entries allocated but not yet written, the rest of a prompt admitted whole, not counted)
    kv_peak: int = 0
    #: KV entries that one expert slot's bytes would hold (0: unknown)
    kv_tokens_per_slot: int = 0
    #: KV entries per block of the scheduler (1: per token)
    kv_block_tokens: int = 1
    #: the budget in whole blocks (None: unlimited)
    kv_blocks: int | None = None
    #: most KV blocks held during one step: allocated to a request, written or not (a prompt admitted whole holds
    #: all its blocks from its first chunk on), so it can exceed ceil(kv_peak / kv_block_tokens) by more than
    #: one block per request
    kv_peak_blocks: int = 0
    #: blocks an admission had to leave free
    kv_watermark_blocks: int = 0


class ServingRun:
    """Drives one :class:`Simulator` with a scheduler and an arrival process (SimPy processes on its env)."""

    def __init__(self, sim: Simulator, pool: RequestPool, scheduler: Scheduler, workload: WorkloadConfig,
                 seed: int = 0, progress: Callable[[int], None] | None = None) -> None:
        self.sim, self.pool, self.scheduler, self.workload = sim, pool, scheduler, workload
        #: called with the number of requests each step finished
        self.progress = progress
        self.rng = np.random.default_rng(seed)
        self.env = sim.env
        self.layers = pool.layers
        self.served = [pool.requests[i % len(pool)] for i in range(workload.requests)]
        self.records = [RequestRecord(i, t.source, t.request, t.prompt, t.output, float("nan"))
                        for i, t in enumerate(self.served)]
        self.states: dict[int, Request] = {}
        #: per step, (request, first position, tokens) of each entry: what ran when
        self.batches: list[list[tuple[int, int, int]]] = []
        #: step index -> the requests preempted to form it (steps with any)
        self.preempted: dict[int, list[int]] = {}
        self._work = self.env.event()
        #: a closed loop's client waits on its request's event; open loops need none (memory per request)
        self._finished: dict[int, Any] = {}
        self._left = workload.requests
        # every step advances a token, so without preemption a request finishes within all the tokens left;
        # four times that allows recomputation after preemptions, more means a livelock
        self._step_limit = 4 * sum(t.prompt + t.output for t in self.served) + 16
        self.kv_peak = 0
        self.kv_peak_blocks = 0
        #: requests over the time of the last arrival (open loops only)
        self.offered = float("nan")

    def run(self) -> ServeResult:
        engine = self.sim.run(driver=self._drive)  # the engine configures the system and closes the run
        for record in self.records:
            state = self.states[record.request]
            record.preemptions = state.preemptions
            record.recomputed_tokens = state.recomputed
        s = self.scheduler
        return ServeResult(self.records, engine, self.workload, s.name, s.kv_tokens,
                           self.offered, self.batches, self.preempted, self.kv_peak,
                           self.sim.memory.expert_bytes // self.sim.model.kv_bytes_per_token(),
                           s.block_tokens(), s.kv_blocks, self.kv_peak_blocks, s.watermark_blocks())

    # ------------------------------------------------------------------ processes
    def _submit(self, i: int) -> None:
        t = self.served[i]
        self.records[i].arrival_s = self.env.now
        state = Request(i, self.env.now, t.prompt, t.output)
        self.states[i] = state
        self.scheduler.add(state)
        if not self._work.triggered:
            self._work.succeed()

    def _open_loop(self, times: np.ndarray):
        for i, t in enumerate(times.tolist()):
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            self._submit(i)

    def _client(self, first: int):
        stride = self.workload.concurrency
        for i in range(first, self.workload.requests, stride):
            self._finished[i] = self.env.event()
            self._submit(i)
            yield self._finished[i]

    def _drive(self):
        """Start the arrivals, then serve until every request is done (the engine's forward process)."""
        w = self.workload
        if w.arrival == "closed":
            for client in range(min(w.concurrency, w.requests)):
                self.env.process(self._client(client))
        else:
            times = arrival_times(w, self.rng)
            self.offered = len(times) / times[-1] if times[-1] > 0 else float("inf")
            self.env.process(self._open_loop(times))
        yield from self._server()

    def _server(self):
        env, sim = self.env, self.sim
        index = 0
        since_finish, left = 0, self._left
        while self._left:
            batch = self.scheduler.next_batch()
            if not batch.entries:
                self._work = env.event()
                yield self._work
                continue
            since_finish = 0 if self._left != left else since_finish + 1
            left = self._left
            if since_finish > self._step_limit:
                raise RuntimeError(f"serving made no progress: {since_finish} steps without a request finishing "
                                   f"under scheduler '{self.scheduler.name}' (requests preempted and recomputed "
                                   "in a loop)")
            # after the last step, env.now (start + (end - start)) can fall an ulp short of its end
            start = max(env.now, sim.steps[-1].end) if sim.steps else env.now
            step = build_step(index, batch.entries, self.served, self.layers)
            self.batches.append([(r.rid, r.done, n) for r, n in batch.entries])
            if batch.preempted:
                self.preempted[index] = [r.rid for r in batch.preempted]
            end = sim.run_step(step, start)
            yield env.timeout(end - start)
            requests = sorted({r.rid for r, _ in batch.entries})
            sim.steps.append(StepRecord(index, PHASES[int(step.phase.min())], start, end, step.tokens, requests))
            self._record(batch, start, end)
            index += 1

    def _record(self, batch: Batch, start: float, end: float) -> None:
        # entries written and blocks held during the step: the running requests' (their allocations included)
        # and those the batch adds
        self.kv_peak = max(self.kv_peak, self.scheduler.kv_used() + batch.tokens)
        added = sum(self.scheduler.growth(r, n) for r, n in batch.entries)
        self.kv_peak_blocks = max(self.kv_peak_blocks, self.scheduler.kv_used_blocks() + added)
        for request, n in batch.entries:
            record = self.records[request.rid]
            if record.scheduled_s != record.scheduled_s:  # nan: first time it runs
                record.scheduled_s = start
            record.computed_tokens += n
        finished = self.scheduler.advance(batch)
        for request in finished:
            self.records[request.rid].finish_s = end
            waiting = self._finished.pop(request.rid, None)
            if waiting is not None:
                waiting.succeed()
            self._left -= 1
        if finished and self.progress is not None:
            self.progress(len(finished))
        for request, _ in batch.entries:
            record = self.records[request.rid]
            if record.first_token_s != record.first_token_s and request.done >= max(request.prompt, 1):
                record.first_token_s = end


def check_servable(system: str, replay_settings: dict[str, str]) -> None:
    """Refuse a system that cannot serve, before anything runs: a portfolio of schedules (a bound), or one
    that plans with the trace's future routing, which requests served in another order do not follow."""
    from moesim.sim.run import members
    schedules = members(system)
    if schedules != (system,):
        # only the members this check lets through: oracle's belady and oracle-prefetch plan ahead
        online = [name for name in schedules if _servable_member(name, replay_settings)]
        raise UnservableError(f"'{system}' is a portfolio of schedules; serving runs single systems",
                              field="--system", fix=f"use one of its members that can serve: {', '.join(online)}"
                              if online else "serve an online system (see `moesim systems`)")
    if _plans_ahead(system, replay_settings):
        raise UnservableError(f"'{system}' plans with the trace's future routing, which a served order does not "
                              "have", field="--system", fix="serve an online system (see `moesim systems`)")


def _plans_ahead(system: str, replay_settings: dict[str, str]) -> bool:
    """Whether a component of ``system``, with these settings, plans with the trace's future routing."""
    from moesim.sim.run import check_settings
    return any(hasattr(c, "_future") for c in check_settings(system, replay_settings).components.values())


def _servable_member(system: str, replay_settings: dict[str, str]) -> bool:
    """A portfolio member to suggest: online, and taking these settings (one it refuses would fail too)."""
    try:
        return not _plans_ahead(system, replay_settings)
    except ConfigError:
        return False


def serve(traces: list[str], hw: Any, system: str, settings: dict[str, str] | None = None, *,
          model_preset: str | None = None, seed: int = 0, timeline: bool = False,
          decisions: bool = False, progress: Callable[[int], None] | None = None) -> ServeResult:
    """Serve ``workload.requests`` requests drawn from ``traces`` under ``system`` and a scheduler.

    ``progress`` is called with the number of requests each step finished. A run whose records cannot
    fit in host memory (:func:`serving_bytes`) is refused before it starts.
    """
    from moesim.sim.run import checked_seed, prepare
    from moesim.trace.validate import checked_meta, settle
    seed = checked_seed(seed)
    parsed = split_settings(settings)
    check_servable(system, parsed.replay)
    scheduler = build_scheduler(parsed.scheduler, parsed.scheduler_params)
    sim = prepare(traces[0], hw, system, parsed.replay, model_preset=model_preset, seed=seed,
                  timeline=timeline, decisions=decisions)
    for trace in traces[1:]:  # (prepare checked the first)
        checked_meta(trace, sim.system.needed_columns())
    pool = RequestPool(list(traces), sim.system.needed_columns())
    check_host_memory(pool.requests, parsed.workload.requests, host_bytes_available())
    check_horizon(parsed.workload)
    kv = kv_budget_tokens(sim.memory, sim.model.kv_bytes_per_token(), sim.system.ignores_memory)
    if parsed.workload.kv_tokens:
        if kv is not None and parsed.workload.kv_tokens > kv:
            raise ConfigError(f"workload.kv_tokens={parsed.workload.kv_tokens} exceeds the {kv} KV entries "
                              f"the GPU has beside the expert cache", field="workload.kv_tokens",
                              fix=f"use <= {kv}, or fewer expert slots")
        kv = parsed.workload.kv_tokens
    scheduler.set_kv_tokens(kv)
    served = [Request(0, 0.0, t.prompt, t.output) for t in pool.requests[:parsed.workload.requests]]
    longest = max((r.total for r in served), default=0)
    need = scheduler.tokens_to_fit(longest)  # whole blocks, and the watermark an admission leaves
    if parsed.workload.kv_tokens and need > parsed.workload.kv_tokens:  # the user's own limit is at fault
        raise ConfigError(f"a request of {longest} tokens needs more KV cache than workload.kv_tokens="
                          f"{parsed.workload.kv_tokens}{scheduler.in_blocks()}", field="workload.kv_tokens",
                          fix=f"use workload.kv_tokens={need} or more, or 0 for all the GPU's free memory")
    if kv is not None and not parsed.workload.kv_tokens:
        check_kv_left(need, longest, kv, sim.memory, sim.model.kv_bytes_per_token())
    for request in served:
        scheduler.check(request)
    result = ServingRun(sim, pool, scheduler, parsed.workload, seed=seed, progress=progress).run()
    for trace in traces:
        settle(trace)  # the columns the run did not read, checked beside it
    return result
