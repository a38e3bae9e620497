"""The real-execution backend: one trace, one system, real torch kernels on a GPU (or its CPU stand-in).

It drives the very policy objects the simulator drives, through the same
:class:`~moesim.policy.base.LayerView` / :class:`~moesim.policy.base.LayerPlan`
protocol, and keeps a :class:`~moesim.policy.state.CacheState` the same way
(preload the initial set, evict, ``start_load`` when a copy is queued,
``finish_load`` when it is seen complete at the next plan). The plan is then
executed for real:

* routed expert weights live in (pinned) host memory in the model's shape and
  dtype; GPU cache slots are one preallocated pool, plus staging buffers for
  experts streamed through without caching (000 Alg. 1) (:mod:`backends.weights`);
* demand loads, staging copies and prefetches go through one copy engine on
  its own stream (:class:`backends.devices.CopyEngine`), demand first;
* attention (an SDPA over a KV cache of the trace's context length), the gate,
  shared experts and GPU experts run in order on the compute stream, each GPU
  expert waiting for its weights' copy event; each step also runs what the
  simulator charges outside the MoE layers: the embedding rows, the dense
  decoder layers before the first MoE layer, and the LM head and token choice
  for each sequence's last token;
* CPU experts run one after another on a worker thread with a set torch
  thread count, after the layer's activations were copied to the host, and
  their sum is copied back and added before the next layer (the two copies
  and the host wait are the CPU-GPU synchronisation the simulator models as
  ``sync``); deferred experts (001 Sec. 4) are added one layer later.

Times come from CUDA events (device work and copies) and the host clock
(CPU experts, step boundaries). The result is a :class:`~moesim.sim.result.SimResult`
with the simulator's timeline and decision-log schema, so
:func:`moesim.analysis.metrics.metrics` and ``result_to_frames`` read it unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from backends.devices import Clock, CopyEngine, CudaStream, HostStream, Transfer, Work, host_threads
from backends.kernels import Attention, Batch, DenseLayer, LMHead, expert_params, ffn, random_fill, torch_dtype
from backends.run_config import RealConfig, check_device, describe_device, trace_shape
from backends.weights import ExpertWeights, LayerRouting
from moesim.errors import ConfigError
from moesim.hw.profile import HardwareProfile
from moesim.policy.base import LayerPlan, LayerView, active_experts
from moesim.policy.state import CacheState
from moesim.sim.bookkeeping import (Counters, account_plan, placement_decisions, substitution_mass,
                                    weight_mass)
from moesim.sim.result import SimResult, StepRecord
from moesim.trace.io import Step, iter_steps
from moesim.trace.schema import PHASES


@dataclass
class Pending:
    """Timeline rows waiting for their work to finish (resolved at the end of each step)."""

    resource: str
    work: Work
    kind: str
    step: int
    layer: int
    expert: int = -1
    tokens: int = 0
    #: the breakdown category, when not the one ``kind`` maps to (a prediction is attention work, ``predict``)
    category: str = ""


@dataclass
class GPUExpertRun:
    work: Work
    transfer: Transfer | None
    previous: Work | None


# ----------------------------------------------------------------------------- executor
@dataclass
class RealExecutor:
    """One real run of one trace under one system; build it with :func:`prepare_real`."""

    trace_path: str
    setup: object  # the simulator set-up of the same run: model, profile, system, costs, memory, config
    config: RealConfig
    warmup_setup: object | None = None
    progress: Callable[[int], None] | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        s = self.setup
        self.model = s.model
        self.profile: HardwareProfile = s.profile
        self.costs = s.costs
        self.memory = s.memory
        self.engine_config = s.config
        self.device = check_device(self.config.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch_dtype(self.costs.dtype)
        self.max_batch, self.max_context, self.max_tokens = trace_shape(self.trace_path)

    # ------------------------------------------------------------------ set-up
    def _allocate(self) -> None:
        generator = torch.Generator().manual_seed(self.config.seed)
        model, dtype, dev = self.model, self.dtype, self.device
        try:
            # experts draw from a generator of their own: the rest is the same whether or not they are reused
            self.weights = ExpertWeights(model, dtype, dev, list(self.memory.capacity),
                                         self.engine_config.staging_slots,
                                         torch.Generator().manual_seed(self.config.seed + 1))
            self.attention = [Attention(model, dtype, dev, self.max_batch, self.max_context, generator)
                              for _ in range(model.num_layers)]
            shared = expert_params(model, model.shared_intermediate_size) if model.shared_intermediate_size else 0
            self.shared = random_fill(torch.empty(model.num_layers, max(shared, 1), dtype=dtype, device=dev),
                                      generator)
            self.embedding = random_fill(torch.empty(self.max_tokens, model.hidden_size, dtype=dtype, device=dev),
                                         generator)
            self.dense = [DenseLayer(model, dtype, dev, self.max_batch, self.max_context, generator)
                          for _ in range(model.num_dense_layers)]
            self.lm_head = LMHead(model, dtype, dev, generator) if model.vocab_size else None
            pin = self.cuda
            shape = (2, self.max_tokens, model.hidden_size)
            self.x_host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.cpu_out = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.deferred_out = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        except torch.OutOfMemoryError:
            raise ConfigError(f"the real run does not fit in GPU memory ({self.memory.arithmetic()})",
                              field="cache.slots_per_layer", fix="use fewer slots per layer or fewer layers") from None

    def _start_devices(self) -> None:
        self.clock = Clock(self.cuda)
        self.gpu = CudaStream(self.clock) if self.cuda else HostStream(self.clock, "moesim-gpu-standin")
        self.cpu = HostStream(self.clock, "moesim-cpu-pool")
        self.pcie = CopyEngine(self.clock, self.cuda)

    def _stop_devices(self) -> None:
        self.gpu.synchronize()
        self.pcie.close()
        self.cpu.close()
        self.gpu.close()

    def _reset(self, system) -> None:
        self.system = system
        self.cache = CacheState(capacity=list(self.memory.capacity), pool=self.memory.pool)
        self.counters = Counters()
        self.timeline: list[tuple] = []
        self.decisions: list[tuple] = []
        self.steps: list[StepRecord] = []
        self.pending_rows: list[Pending] = []
        self.transfers: list[Transfer] = []
        self.in_flight: dict[tuple[int, int], Transfer] = {}
        #: per layer, the experts prefetched there and not used since
        self.prefetched: list[set[int]] = [set() for _ in range(self.model.num_layers)]
        self.gpu_runs: list[tuple[GPUExpertRun, int]] = []
        self.sync_works: list[Work] = []
        self.weights.reset()
        ctx = self.setup_ctx(system)
        system.configure(ctx)
        self.notes = ctx.notes
        self.initial = [sorted(system.initial(layer, quota)) for layer, quota in enumerate(self.memory.cache_quota)]
        for layer, experts in enumerate(self.initial):
            self.cache.preload(layer, experts)
            for e in experts:
                slot, _ = self.weights.take(layer, e)
                slot.copy_(self.weights.host[layer, e])
        if self.cuda:
            torch.cuda.synchronize()
        self.act: dict[str, torch.Tensor] = {}
        self.deferred_job: Work | None = None
        self.deferred_parity = 0

    def setup_ctx(self, system):
        from moesim.policy.base import RunContext
        return RunContext(model=self.model, costs=self.costs, capacity=list(self.memory.capacity),
                          pool=self.memory.pool, trace_path=self.trace_path, seed=self.setup.seed,
                          columns=self.setup.columns)

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        wall = time.perf_counter()
        with host_threads(self.config.threads()):
            self._allocate()
            if self.config.warmup_steps and self.warmup_setup is not None:
                self._start_devices()
                try:
                    self._reset(self.warmup_setup.system)
                    self._execute(self.config.warmup_steps)
                finally:
                    self._stop_devices()
            self._start_devices()
            try:
                self._reset(self.setup.system)
                self.clock.reset()
                self._execute(None)
            finally:
                self._stop_devices()
        return self._result(time.perf_counter() - wall)

    def _execute(self, max_steps: int | None) -> None:
        for i, step in enumerate(iter_steps(self.trace_path, columns=self.system.needed_columns())):
            if max_steps is not None and i >= max_steps:
                break
            self._step(step)
            if self.progress is not None and max_steps is None:
                self.progress(step.rows)

    def _step(self, step: Step) -> None:
        start = self.clock.now()
        first = slice(int(step.layer_bounds[0]), int(step.layer_bounds[1]))
        phase = PHASES[int(step.phase.min())]
        batches = self._batches(step.request[first], step.position[first])
        tokens = first.stop - first.start
        embedding = self.embedding
        work = self.gpu.launch(lambda: self.act.__setitem__("h", embedding[:tokens].clone()))
        self._record("gpu", work, "embedding", step.step, -1, tokens=tokens)
        for dense in self.dense:
            self._dense_layer(dense, batches, step.step, tokens)
        for layer, rows in step.layers():
            self._layer(step, layer, rows, phase, batches)
        self._head(batches, step.step, tokens)
        self.gpu.synchronize()
        end = self.clock.now()
        requests = np.unique(step.request[first]).tolist()
        self.steps.append(StepRecord(step.step, phase, start, end, step.tokens, requests))
        self._resolve(step.step)

    @staticmethod
    def _batches(request: np.ndarray, position: np.ndarray) -> list[tuple[slice, Batch]]:
        """Attention calls of a step: one batched call when every request brings as many tokens, else one each."""
        ids, starts, counts = np.unique(request, return_index=True, return_counts=True)
        order = np.argsort(starts)
        ids, starts, counts = ids[order], starts[order], counts[order]
        contexts = [int(position[s:s + n].max()) + 1 for s, n in zip(starts, counts)]
        if len(set(counts.tolist())) == 1:
            return [(slice(0, len(request)), Batch(len(ids), int(counts[0]), max(contexts)))]
        return [(slice(int(s), int(s + n)), Batch(1, int(n), c)) for s, n, c in zip(starts, counts, contexts)]

    @staticmethod
    def _attend(attention: Attention, h: torch.Tensor, batches: list[tuple[slice, Batch]]) -> torch.Tensor:
        if len(batches) == 1:
            return attention(h, batches[0][1])
        return torch.cat([attention(h[sl], batch) for sl, batch in batches])

    def _dense_layer(self, dense: DenseLayer, batches: list[tuple[slice, Batch]], s: int, tokens: int) -> None:
        """A dense decoder layer before the first MoE layer, as the simulator places it."""
        act = self.act
        attend = self.gpu.launch(lambda: act.__setitem__("h", self._attend(dense.attention, act["h"], batches)))
        self._record("gpu", attend, "attention", s, -1, tokens=tokens)
        self._record("gpu", self.gpu.launch(lambda: act.__setitem__("h", dense.ffn(act["h"]))), "dense_ffn", s, -1,
                     tokens=tokens)

    @staticmethod
    def _last_rows(batches: list[tuple[slice, Batch]]) -> list[int]:
        """Each sequence's last token row in the step: where its next token's logits come from."""
        return [sl.start + (r + 1) * batch.tokens - 1 for sl, batch in batches for r in range(batch.requests)]

    def _head(self, batches: list[tuple[slice, Batch]], s: int, tokens: int) -> None:
        """LM head on each sequence's last token, then the token choice (what every step ends with)."""
        if self.lm_head is None:
            return
        last = torch.tensor(self._last_rows(batches))
        if self.cuda:
            last = last.pin_memory()  # an asynchronous upload: no host wait at the end of the step
        act, head, dev = self.act, self.lm_head, self.device

        def project() -> None:
            act["logits"] = head.logits(act["h"], last.to(dev, non_blocking=True))
        project_work = self.gpu.launch(project)
        self._record("gpu", project_work, "lm_head", s, -1, tokens=tokens)
        self._record("gpu", self.gpu.launch(lambda: act.__setitem__("token", head.sample(act["logits"]))),
                     "sampling", s, -1, tokens=tokens)

    # ------------------------------------------------------------------ one layer
    def _layer(self, step: Step, layer: int, rows: slice, phase: str, batches: list[tuple[slice, Batch]]) -> None:
        s = step.step
        tokens = rows.stop - rows.start
        act, attention = self.act, self.attention[layer]
        attend = self.gpu.launch(lambda: act.__setitem__("x", self._attend(attention, act["h"], batches)))
        self._record("gpu", attend, "attention", s, layer, tokens=tokens)

        self._retire()
        view = self._view(step, layer, rows, phase)
        plan = self.system.plan(view)
        if plan.substitutions:
            self.counters.substituted_weight_mass += substitution_mass(view, plan)
            view = view.substituted(plan.substitutions)
        count = dict(zip(view.active, view.counts))
        resident_at_plan = set(self.cache.resident[layer])
        account_plan(self.counters, view, plan, count, self.cache.resident[layer], self.prefetched[layer])
        if plan.overhead_s:
            for category, seconds in plan.overhead_s.items():
                self.counters.breakdown[category] = self.counters.breakdown.get(category, 0.0) + seconds
            _spin(sum(plan.overhead_s.values()))  # declared decision time, spent on the critical path

        for lay, e in plan.evictions:
            self.cache.evict(lay, e)
            self.weights.drop(lay, e)
            self.prefetched[lay].discard(e)
            self.decisions.append((s, layer, e, "evict", lay))
        self.decisions += placement_decisions(view, plan, resident_at_plan)
        if plan.cancel_queued_prefetches:
            # a queued prefetch of an expert this layer computes on the GPU is its load now: keep it
            self._cancel_prefetches(frozenset((layer, e) for e in plan.gpu))
        for e in plan.loads:
            self._load(layer, e, "load", s)
        staged = {e: self._stage(layer, e, i, s) for i, e in enumerate(plan.streamed[:self.staging_slots])}
        predict = plan.prefetch_after_predict
        if not plan.prefetch_after_gpu and predict is None:
            self._prefetch(plan, s, layer)

        routing = LayerRouting.of(view.experts, view.weights)
        self.gpu.launch(lambda: self._upload(routing))
        parity = layer % 2
        cpu_job = self._cpu_job(plan.cpu, routing, s, layer, parity, tokens, "expert") if plan.cpu else None
        deferred_job = self._cpu_job(plan.deferred, routing, s, layer, parity, tokens, "deferred",
                                     after_input=cpu_job is not None) if plan.deferred else None
        if deferred_job is not None:
            self.counters.deferred_weight_mass += weight_mass(view, plan.deferred)
        last_gpu = self._gpu_track(plan, routing, staged, count, s, layer, tokens, batches, predict)
        if plan.prefetch_after_gpu and predict is None:
            self._prefetch(plan, s, layer, not_before=last_gpu)
        self._combine(cpu_job, parity, tokens)
        self.deferred_job, self.deferred_parity = deferred_job, parity
        if deferred_job is not None and layer == self.model.num_layers - 1:
            self._combine(None, parity, tokens)  # nothing later to overlap with
            self.deferred_job = None

    @property
    def staging_slots(self) -> int:
        return self.engine_config.staging_slots

    def _view(self, step: Step, layer: int, rows: slice, phase: str) -> LayerView:
        experts = step.experts[rows]
        active, counts = active_experts(experts, self.model.num_experts)
        now = self.clock.now()
        in_flight = self.cache.in_flight[layer]
        arrivals = self._arrivals(layer, in_flight, now) if in_flight else {}
        return LayerView(step.step, layer, phase, experts, active, counts, self.cache, self.costs,
                         None if step.weights is None else step.weights[rows],
                         None if step.scores is None else step.scores[rows],
                         {k: v[rows] for k, v in step.predictors.items()} if step.predictors else {},
                         now, arrivals, self.setup.expert_launch_s, self.setup.shared_launch_s,
                         context=int(step.position[rows].max()) + 1)

    def _arrivals(self, layer: int, in_flight: set[int], now: float) -> dict[int, float]:
        """Estimated arrival of this layer's in-flight experts: the queue ahead of each, at the profile's load time."""
        load = self.costs.expert_load
        t = now + (load if self.pcie.running is not None else 0.0)
        out = {}
        for transfer in self.pcie.queued():
            t += load
            if transfer.layer == layer and transfer.expert in in_flight and transfer.kind != "stage":
                out[transfer.expert] = t
        for e in in_flight:
            out.setdefault(e, now + load)
        return out

    # ------------------------------------------------------------------ transfers
    def _load(self, layer: int, expert: int, kind: str, step: int, not_before: Work | None = None) -> None:
        self.cache.start_load(layer, expert)
        slot, previous_user = self.weights.take(layer, expert)
        transfer = self.pcie.submit(slot, self.weights.host[layer, expert], priority=1 if kind == "prefetch" else 0,
                                    kind=kind, layer=layer, expert=expert, step=step, after=previous_user,
                                    not_before=not_before)
        self.in_flight[(layer, expert)] = transfer
        self.transfers.append(transfer)

    def _stage(self, layer: int, expert: int, index: int, step: int) -> Transfer:
        buffer = index % self.staging_slots
        transfer = self.pcie.submit(self.weights.staging[buffer], self.weights.host[layer, expert], priority=0,
                                    kind="stage", layer=layer, expert=expert, step=step,
                                    after=self.weights.staging_use.get(buffer))
        self.transfers.append(transfer)
        return transfer

    def _retire(self) -> None:
        """Make completed loads resident, as the simulator does when it reaches a plan."""
        for key, transfer in list(self.in_flight.items()):
            if transfer.done():
                self.cache.finish_load(*key)
                del self.in_flight[key]

    # ------------------------------------------------------------------ compute
    def _upload(self, routing: LayerRouting) -> None:
        rows, weights = torch.from_numpy(routing.rows), torch.from_numpy(routing.weights).to(self.dtype)
        if self.cuda:
            rows, weights = rows.pin_memory(), weights.pin_memory()
        routing.rows_t = rows.to(self.device, non_blocking=True)
        routing.weights_t = weights.to(self.device, non_blocking=True)
        self.act["out"] = torch.zeros_like(self.act["x"])

    def _expert(self, weights: torch.Tensor, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                gate: torch.Tensor, span: tuple[int, int], intermediate: int) -> None:
        start, n = span
        idx = rows[start:start + n]
        y = ffn(weights, x.index_select(0, idx), self.model.hidden_size, intermediate, self.model.expert_matrices)
        out.index_add_(0, idx, y * gate[start:start + n, None])

    def _prefetch(self, plan: LayerPlan, s: int, layer: int, not_before: Work | None = None) -> None:
        for lay, e in plan.prefetches:
            self._load(lay, e, "prefetch", s, not_before)
            self.prefetched[lay].add(e)
            self.decisions.append((s, layer, e, "prefetch", lay))

    def _cancel_prefetches(self, keep: frozenset) -> None:
        """Drop prefetches still queued (but those in ``keep``); their slots free up again (004 Sec. 5.2)."""
        for transfer in self.pcie.cancel("prefetch", keep):
            key = (transfer.layer, transfer.expert)
            self.in_flight.pop(key, None)
            self.cache.in_flight[transfer.layer].discard(transfer.expert)
            self.weights.drop(*key)
            self.prefetched[transfer.layer].discard(transfer.expert)
            self.transfers.remove(transfer)
            self.counters.cancelled_prefetches += 1

    def _gpu_track(self, plan: LayerPlan, routing: LayerRouting, staged: dict[int, Transfer],
                   count: dict[int, int], s: int, layer: int, tokens: int,
                   batches: list[tuple[slice, Batch]] | None = None, predict: float | None = None) -> Work | None:
        """Launch shared and GPU experts; return the layer's last GPU work.

        With ``predict`` (``LayerPlan.prefetch_after_predict``, 004 Sec. 4.2) the experts resident at plan
        time go first, then the prediction: the next layer's attention and gate, for real, on this layer's
        output so far (shared and resident experts); the plan's prefetches wait for it on the copy engine
        (``not_before``); then the other GPU experts. A prediction the plan costs at 0 s is not run."""
        act, model = self.act, self.model
        previous: Work | None = None
        if model.shared_intermediate_size:
            shared = self.shared[layer]

            def run_shared() -> None:
                x = act["x"]
                act["out"] += ffn(shared, x, model.hidden_size, model.shared_intermediate_size,
                                  model.expert_matrices)
            previous = self.gpu.launch(run_shared)
            self._record("gpu", previous, "shared", s, layer, tokens=tokens)
        stream_index = {e: i for i, e in enumerate(plan.streamed)}
        runs: dict[int, Work] = {}
        order = plan.gpu
        ready = -1  # index in ``order`` after which the prediction runs (-1: none)
        if predict is not None:
            resident = self.cache.resident[layer]  # this plan's loads are in flight, not resident, until retired
            first = [e for e in plan.gpu if e in resident]
            order = first + [e for e in plan.gpu if e not in resident] if len(first) < len(plan.gpu) else first
            ready = len(first)
            if not first:
                previous = self._predict(plan, s, layer, tokens, batches, predict, previous)
        for n, e in enumerate(order):
            transfer: Transfer | None = None
            if e in stream_index:
                i = stream_index[e]
                transfer = staged.get(e)
                if transfer is None:  # its buffer frees when the expert `staging_slots` earlier has run
                    transfer = self._stage(layer, e, i, s)
                weights = self.weights.staging[i % self.staging_slots]
            else:
                transfer = self.in_flight.get((layer, e))
                weights = self.weights.on_gpu(layer, e)
            span = routing.spans[e]

            def run(weights: torch.Tensor = weights, span: tuple[int, int] = span) -> None:
                self._expert(weights, act["x"], act["out"], routing.rows_t, routing.weights_t, span,
                             model.moe_intermediate_size)
            work = self.gpu.launch(run, waits=(transfer,) if transfer is not None else ())
            runs[e] = work
            if e in stream_index:
                self.weights.staging_use[stream_index[e] % self.staging_slots] = work
            else:
                self.weights.last_use[self.weights.slot[(layer, e)]] = work
            self._record("gpu", work, "expert", s, layer, e, count[e])
            self.gpu_runs.append((GPUExpertRun(work, transfer, previous), count[e]))
            previous = work
            if n + 1 == ready:
                previous = self._predict(plan, s, layer, tokens, batches, predict, previous)
        return previous

    def _predict(self, plan: LayerPlan, s: int, layer: int, tokens: int, batches: list[tuple[slice, Batch]] | None,
                 predict: float | None, previous: Work | None) -> Work | None:
        """The next-layer prediction on the GPU stream (unless costed at 0 s), then the plan's prefetches
        behind it; returns the GPU stream's last work."""
        if predict and batches is not None and layer + 1 < self.model.num_layers:
            act, attention = self.act, self.attention[layer + 1]

            def run() -> None:  # its output is only the gate's scores: dropped, as the trace holds the prediction
                self._attend(attention, act["x"] + act["out"], batches)
            previous = self.gpu.launch(run)
            self.pending_rows.append(Pending("gpu", previous, "predict", s, layer, tokens=tokens,
                                             category="predict"))
        self._prefetch(plan, s, layer, not_before=previous)
        return previous

    def _cpu_job(self, experts: list[int], routing: LayerRouting, s: int, layer: int, parity: int, tokens: int,
                 kind: str, after_input: bool = False) -> Work:
        """CPU experts one after another on the pool, after the layer's input reached the host."""
        x_host = self.x_host[parity, :tokens]
        if not after_input:
            act = self.act
            copy_in = self.gpu.launch(lambda: x_host.copy_(act["x"], non_blocking=True))
            self.sync_works.append(copy_in)
            waits: tuple[Work, ...] = (copy_in,)
        else:
            waits = ()  # follows the layer's CPU job on the same worker, which waited for the input
        out = (self.cpu_out if kind == "expert" else self.deferred_out)[parity, :tokens]
        rows = torch.from_numpy(routing.rows)
        gate = torch.from_numpy(routing.weights).to(self.dtype)
        host, model, clock = self.weights.host, self.model, self.clock
        spans: list[tuple[int, float, float]] = []

        def run() -> None:
            out.zero_()
            for e in experts:
                t0 = clock.now()
                self._expert(host[layer, e], x_host, out, rows, gate, routing.spans[e], model.moe_intermediate_size)
                spans.append((e, t0, clock.now()))
        job = self.cpu.launch(run, waits=waits)
        self.pending_rows.append(Pending("cpu", job, kind, s, layer, tokens=tokens))
        job.spans = spans  # type: ignore[attr-defined]
        job.tokens = {e: routing.spans[e][1] for e in experts}  # type: ignore[attr-defined]
        return job

    def _combine(self, cpu_job: Work | None, parity: int, tokens: int) -> None:
        """Add the CPU experts' (and the previous layer's deferred) results; the layer's output becomes ``h``."""
        act, dev = self.act, self.device
        waits = tuple(w for w in (cpu_job, self.deferred_job) if w is not None)
        parts = ([self.cpu_out[parity, :tokens]] if cpu_job is not None else []) + \
            ([self.deferred_out[self.deferred_parity, :tokens]] if self.deferred_job is not None else [])

        def combine() -> None:
            out = act["out"]
            for part in parts:
                out += part.to(dev, non_blocking=True)
            act["h"] = act["x"] + out
        self.gpu.launch(combine, waits=waits)
        self.deferred_job = None

    # ------------------------------------------------------------------ bookkeeping
    def _record(self, resource: str, work: Work, kind: str, step: int, layer: int, expert: int = -1,
                tokens: int = 0) -> None:
        self.pending_rows.append(Pending(resource, work, kind, step, layer, expert, tokens))

    def _resolve(self, step: int) -> None:
        """Turn the step's finished work into timeline rows and busy-time counters."""
        c = self.counters
        for row in self.pending_rows:
            if row.resource == "cpu":
                for e, t0, t1 in row.work.spans:  # type: ignore[attr-defined]
                    self.timeline.append(("cpu", 0, t0, t1, row.kind, row.step, row.layer, e,
                                          row.work.tokens[e]))  # type: ignore[attr-defined]
                    c.cpu_busy_s += t1 - t0
                continue
            t0, t1 = row.work.interval()
            self.timeline.append((row.resource, 0, t0, t1, row.kind, row.step, row.layer, row.expert, row.tokens))
            c.gpu_busy_s += t1 - t0
            key = row.category or {"shared": "shared_expert", "expert": "gpu_compute"}.get(row.kind, row.kind)
            c.breakdown[key] += t1 - t0
        for run, _ in self.gpu_runs:
            if run.transfer is None:
                continue
            ready = run.previous.interval()[1] if run.previous is not None else run.work.interval()[0]
            arrived = run.transfer.interval()[1]
            start = run.work.interval()[0]
            c.breakdown["wait_cache"] += max(start - ready, 0.0) if arrived > ready else 0.0
            if run.transfer.kind == "prefetch" and arrived > ready:
                c.late_prefetches += 1
        self.pending_rows, self.gpu_runs = [], []
        for work in self.sync_works:
            t0, t1 = work.interval()
            c.breakdown["sync"] += t1 - t0
        self.sync_works = []

    def _result(self, wall_s: float) -> SimResult:
        makespan = self.steps[-1].end if self.steps else 0.0
        busy = nbytes = 0
        for t in self.transfers:
            if not t.finished.is_set():
                continue
            t0, t1 = t.interval()
            if t0 >= makespan:
                continue
            busy += min(t1, makespan) - t0
            nbytes += t.src.numel() * t.src.element_size()
            if t1 <= makespan:
                self.timeline.append(("pcie", 0, t0, t1, t.kind, t.step, t.layer, t.expert, 0))
        gpu_end = {}
        for row in self.timeline:
            if row[0] == "gpu":
                gpu_end[(row[5], row[6])] = max(gpu_end.get((row[5], row[6]), 0.0), row[3])
        cpu_end = {}
        for row in self.timeline:
            if row[0] == "cpu":
                cpu_end[(row[5], row[6])] = max(cpu_end.get((row[5], row[6]), 0.0), row[3])
        self.counters.breakdown["cpu_other"] += sum(max(end - gpu_end.get(key, end), 0.0)
                                                    for key, end in cpu_end.items())
        notes = list(self.notes) + [f"measured on {describe_device(self.device)} with "
                                    f"{self.config.threads()} CPU threads"]
        return SimResult(system=self.system.name, steps=self.steps, counters=self.counters, pcie_busy_s=busy,
                         pcie_bytes=nbytes, makespan_s=makespan, memory=self.memory, notes=notes,
                         timeline=self.timeline, decisions=self.decisions, sim_wall_s=wall_s, cost_fallbacks=[],
                         initial_resident=self.initial, pcie_engines=1,
                         rewrites=self.system.rewrites, runtime="measured")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# ----------------------------------------------------------------------------- entry points
def prepare_real(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None = None,
                 config: RealConfig | None = None, *, seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> RealExecutor:
    """Set up a real run exactly as :func:`moesim.sim.run.prepare` sets up the simulator's."""
    from moesim.sim.run import members, prepare
    config = config or RealConfig()
    if members(system) != (system,):
        raise ConfigError(f"'{system}' is a bound over several schedules, not one executable system",
                          field="--systems", fix="validate its members one by one")
    setup = prepare(trace, hw, system, settings, seed=seed)
    warm = prepare(trace, hw, system, settings, seed=seed) if config.warmup_steps else None
    return RealExecutor(trace, setup, config, warmup_setup=warm, progress=progress)


def run_real(trace: str, hw: str | HardwareProfile, system: str, settings: dict[str, str] | None = None,
             config: RealConfig | None = None, **kwargs) -> SimResult:
    """Execute ``trace`` under ``system`` on real kernels; the result reads like a simulator result."""
    return prepare_real(trace, hw, system, settings, config, **kwargs).run()
