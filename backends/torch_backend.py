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

Parts: the executor's set-up, steps and layer plans are here; the compute of a
layer is in :mod:`backends.layer_compute`, the weight copies in
:mod:`backends.copies`, the timeline rows and the result in
:mod:`backends.recording`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from backends.copies import WeightCopies
from backends.devices import Clock, CopyEngine, CudaStream, HostStream, Transfer, Work, host_threads
from backends.kernels import Attention, Batch, DenseLayer, LMHead, expert_params, random_fill, torch_dtype
from backends.layer_compute import LayerCompute
from backends.recording import GPUExpertRun, HostTime, Pending, RunRecording
from backends.run_config import RealConfig, check_device, trace_shape
from backends.weights import ExpertWeights, LayerRouting
from moesim.errors import ConfigError
from moesim.hw.profile import HardwareProfile
from moesim.policy.base import LayerView, active_experts
from moesim.policy.state import CacheState
from moesim.sim.bookkeeping import (Counters, account_plan, placement_decisions, substitution_mass,
                                    weight_mass)
from moesim.sim.result import SimResult, StepRecord
from moesim.trace.io import Step, iter_steps
from moesim.trace.schema import PHASES


# ----------------------------------------------------------------------------- executor
@dataclass
class RealExecutor(LayerCompute, WeightCopies, RunRecording):
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
        # the non-expert weights run in the experts' dtype; a simulated int4 attention would be set against bf16
        torch_dtype(self.costs.non_expert_dtype, "memory.non_expert_dtype")
        self.max_batch, self.max_context, self.max_tokens = trace_shape(self.trace_path)

    # ------------------------------------------------------------------ set-up
    def _allocate(self) -> None:
        generator = torch.Generator().manual_seed(self.config.seed)
        model, dtype, dev = self.model, self.dtype, self.device
        try:
            # experts draw from a generator of their own: the rest is the same whether or not they are reused
            self.weights = ExpertWeights(model, dtype, dev, list(self.memory.capacity),
                                         self.engine_config.staging_slots,
                                         torch.Generator().manual_seed(self.config.seed + 1), self.memory.pool)
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
        self.pcie = CopyEngine(self.clock, self.cuda, self.engine_config.copy_chunk_bytes)

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
        #: (step, layer, the copy of the layer's input to the host): the CPU-GPU sync before its CPU experts
        self.sync_works: list[tuple[int, int, Work]] = []
        #: by (step, layer), the measured (start, end) of its syncs
        self.sync_spans: dict[tuple[int, int], list[tuple[float, float]]] = {}
        #: the host's time on each MoE layer's critical path; the open layer's (start, plan() seconds, phase)
        self.host_time = HostTime(self.model.num_layers)
        self.host_span: tuple[float, float, str] | None = None
        self.weights.reset()
        ctx = self.setup_ctx(system)
        system.check_columns(ctx)
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

        # the plan reads the layer's routing, which a real system reads back from its gate: the host waits for
        # the attention and gate here, as the simulator plans when they end (copies landed by then count so)
        attend.wait()
        # the host's time on the critical path (HostTime) starts here: the GPU stream has run the gate and has
        # nothing of this layer to run until the host launches its experts
        host_start = time.perf_counter()
        self._retire()
        view = self._view(step, layer, rows, phase)
        plan_start = time.perf_counter()
        plan = self.system.plan(view)
        plan_s = time.perf_counter() - plan_start
        if plan.substitutions:
            self.counters.substituted_weight_mass += substitution_mass(view, plan)
            view = view.substituted(plan.substitutions)
        count = dict(zip(view.active, view.counts))
        resident_at_plan = set(self.cache.resident[layer])
        account_plan(self.counters, view, plan, count, self.cache.resident[layer], self.prefetched[layer])
        if plan.overhead_s:
            for category, seconds in plan.overhead_s.items():
                self.counters.breakdown[category] = self.counters.breakdown.get(category, 0.0) + seconds
            spin_start = time.perf_counter()
            _spin(sum(plan.overhead_s.values()))  # declared decision time, spent on the critical path
            host_start += time.perf_counter() - spin_start  # the simulator charges it: not in the host time
        # The span ends just before the launch of the layer's first expert work (_expert_launch): a shared or GPU
        # expert, a CPU or deferred expert job, or a prediction the GPU stream runs ahead of the experts. From
        # that call on the stream can start the expert as soon as the call enqueues it; what the call itself
        # takes is the launch (which the profile's measured expert curves include) and any wait for the
        # expert's weights (wait_cache, which the simulator charges), not planning. The routing upload and the
        # input copy to the host launched before it are stream work of microseconds the experts wait for.
        self.host_span = (host_start, plan_s, phase)

        for lay, e in plan.evictions:
            self.cache.evict(lay, e)
            self.weights.drop(lay, e)
            self.prefetched[lay].discard(e)
            self.decisions.append((s, layer, e, "evict", lay))
        self.decisions += placement_decisions(view, plan, resident_at_plan)
        if plan.cancel_queued_prefetches:
            # a queued prefetch of an expert this layer computes on the GPU is its load now: keep it
            self._cancel_prefetches(frozenset((layer, e) for e in plan.gpu), s, layer)
        if plan.loads or plan.writebacks:
            self._loads(layer, plan.loads, plan.writebacks, s)
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
        self._expert_launch()  # a layer without expert work (none yet in the catalogue) ends its span here
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
                         requests=step.request[rows], context=int(step.position[rows].max()) + 1)


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
