"""The compute of one MoE layer in a real run (the real backend, :mod:`backends.torch_backend`): the routing
upload, shared and GPU experts on the compute stream (with the next-layer prediction of 004 Sec. 4.2), CPU
experts on the worker thread, and the sum of their results."""

from __future__ import annotations

import torch

from backends.devices import Transfer, Work
from backends.kernels import Batch, ffn
from backends.recording import GPUExpertRun, Pending
from backends.weights import LayerRouting
from moesim.policy.base import LayerPlan


class LayerCompute:
    """The compute part of :class:`backends.torch_backend.RealExecutor`."""

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
            self._expert_launch()
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
            self._expert_launch()
            work = self.gpu.launch(run, waits=(transfer,) if transfer is not None else ())
            if transfer is not None:
                transfer.awaited = True
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
            self._expert_launch()
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
            self.sync_works.append((s, layer, copy_in))
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
        self._expert_launch()
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
