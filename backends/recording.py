"""Recording a real run (the real backend, :mod:`backends.torch_backend`): the work waiting for its times, and
how finished work becomes the simulator's timeline rows, busy times, breakdown and :class:`SimResult`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from backends.devices import Transfer, Work
from backends.run_config import describe_device
from moesim.sim.result import SimResult


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


@dataclass
class HostTime:
    """The host's time on each MoE layer's critical path, which the simulator does not charge (host clock).

    Per MoE layer, from the return of the wait for its attention and gate to the launch of its first expert
    work (:meth:`RunRecording._expert_launch`): retiring landed copies, the layer view, ``plan()``, the
    accounting, and the copies, the routing upload and the input copy launched before the experts. The GPU
    stream has nothing of the layer to run meanwhile; the simulator plans in zero time. A plan's declared
    ``overhead_s``, which the simulator charges and the backend spins, is left out. ``plan_s`` is ``plan()``'s
    own share. A real run's result carries it as ``result.host_time`` (the simulator's results have none)."""

    #: MoE layers per step (of the trace as run: ``--layers`` cuts it)
    moe_layers: int
    #: MoE layers timed, all steps and in decode steps
    layers: int = 0
    decode_layers: int = 0
    host_s: float = 0.0
    plan_s: float = 0.0
    decode_host_s: float = 0.0
    decode_plan_s: float = 0.0

    def add(self, phase: str, host_s: float, plan_s: float) -> None:
        self.layers += 1
        self.host_s += host_s
        self.plan_s += plan_s
        if phase == "decode":
            self.decode_layers += 1
            self.decode_host_s += host_s
            self.decode_plan_s += plan_s

    def summary(self) -> dict[str, Any]:
        """Means in µs per MoE layer (None without such layers): over all steps, and over decode steps."""
        def us(total: float, layers: int) -> float | None:
            return total / layers * 1e6 if layers else None
        return {"moe_layers_per_step": self.moe_layers, "layers_timed": self.layers,
                "host_us_per_layer": us(self.host_s, self.layers), "plan_us_per_layer": us(self.plan_s, self.layers),
                "decode_layers_timed": self.decode_layers,
                "decode_host_us_per_layer": us(self.decode_host_s, self.decode_layers),
                "decode_plan_us_per_layer": us(self.decode_plan_s, self.decode_layers)}


class RunRecording:
    """The bookkeeping part of :class:`backends.torch_backend.RealExecutor`."""

    def _expert_launch(self) -> None:
        """Called just before each launch of expert work (or of a prediction ahead of it): the first in a layer
        ends the layer's host span (:class:`HostTime`), opened in ``_layer`` once its attention was waited for."""
        span = self.host_span
        if span is None:
            return
        self.host_span = None
        start, plan_s, phase = span
        self.host_time.add(phase, time.perf_counter() - start, plan_s)

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
        for s, layer, work in self.sync_works:
            self.sync_spans.setdefault((s, layer), []).append(work.interval())
        self.sync_works = []

    def _charge_cpu_side(self, gpu_end: dict[tuple[int, int], float], cpu_end: dict[tuple[int, int], float]) -> None:
        """Each layer's CPU time past its GPU work, split as the simulator splits it (docs/engine.md): the part
        of its syncs past the GPU work [sync], the rest [cpu_other]; a sync the GPU work outlasts costs nothing."""
        breakdown = self.counters.breakdown
        for key, end in cpu_end.items():
            gpu = gpu_end.get(key, end)
            if end <= gpu:
                continue
            past = sum(max(t1 - max(t0, gpu), 0.0) for t0, t1 in self.sync_spans.get(key, ()))
            past = min(past, end - gpu)
            breakdown["sync"] += past
            breakdown["cpu_other"] += end - gpu - past

    def _result(self, wall_s: float) -> SimResult:
        makespan = self.steps[-1].end if self.steps else 0.0
        busy = nbytes = 0
        for t in self.transfers:
            size = t.src.element_size()
            for (c0, c1), elements in zip(t.parts, t.part_elements):  # a chunked prefetch's preempted parts
                if c0 >= makespan:
                    continue
                busy += min(c1, makespan) - c0
                nbytes += elements * size
                self.timeline.append(("pcie", 0, c0, min(c1, makespan), "chunk", t.step, t.layer, t.expert, 0))
            if not t.finished.is_set():
                continue
            t0, t1 = t.interval()
            if t0 >= makespan:
                # copied nothing within the run: a prefetch counts as cancelled, as the simulator counts it
                self.counters.cancelled_prefetches += t.kind == "prefetch" and not t.parts
                continue
            busy += min(t1, makespan) - t0
            if t.kind != "writeback":  # device to host: not counted in the bytes (host to device), as simulated
                nbytes += (t.src.numel() - sum(t.part_elements)) * size
            # a copy still running at the end: its span cut there, the part the busy time counts
            self.timeline.append(("pcie", 0, t0, min(t1, makespan), t.kind, t.step, t.layer, t.expert, 0))
        gpu_end = {}
        for row in self.timeline:
            if row[0] == "gpu":
                gpu_end[(row[5], row[6])] = max(gpu_end.get((row[5], row[6]), 0.0), row[3])
        cpu_end = {}
        for row in self.timeline:
            if row[0] == "cpu":
                cpu_end[(row[5], row[6])] = max(cpu_end.get((row[5], row[6]), 0.0), row[3])
        self._charge_cpu_side(gpu_end, cpu_end)
        notes = list(self.notes) + [f"measured on {describe_device(self.device)} with "
                                    f"{self.config.threads()} CPU threads"]
        result = SimResult(system=self.system.name, steps=self.steps, counters=self.counters, pcie_busy_s=busy,
                           pcie_bytes=nbytes, makespan_s=makespan, memory=self.memory, notes=notes,
                           timeline=self.timeline, decisions=self.decisions, sim_wall_s=wall_s, cost_fallbacks=[],
                           initial_resident=self.initial, pcie_engines=1,
                           rewrites=self.system.rewrites, runtime="measured")
        result.host_time = self.host_time  # type: ignore[attr-defined]  # measured only: not a simulator field
        return result
