"""Real backend: same decisions as the simulator, copies land in the right slots, copy-engine priority."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.devices import Clock, CopyEngine, HostWork  # noqa: E402
from backends.torch_backend import LayerRouting, RealConfig, RealExecutor, check_device, prepare_real  # noqa: E402
from moesim.analysis.metrics import metrics  # noqa: E402
from moesim.errors import ConfigError  # noqa: E402
from moesim.sim.result import TIMELINE_COLUMNS, result_to_frames  # noqa: E402
from moesim.sim.run import simulate  # noqa: E402
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace  # noqa: E402

SETTINGS = {"cache.slots_per_layer": "3"}
TIMING_INDEPENDENT = ("cpu-only", "gpu-only-lru", "static-hot")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model = tiny_model(layers=3, experts=8, top_k=2, shared=True)
    path = tmp_path_factory.mktemp("real") / "tiny.parquet"
    return str(write_tiny_trace(path, model, random_routing(np.random.default_rng(1), model, 2, 8, 4)))


def _config(device: str = "cpu") -> RealConfig:
    return RealConfig(device=device, cpu_threads=1, warmup_steps=1)


@pytest.mark.parametrize("system", TIMING_INDEPENDENT)
def test_cpu_run_logs_the_simulators_decisions(trace, system):
    executor = prepare_real(trace, tiny_profile(), system, SETTINGS, _config())
    real = executor.run()
    sim = simulate(trace, tiny_profile(), system, SETTINGS, decisions=True)
    assert real.decisions == sim.decisions
    assert [s.step for s in real.steps] == [s.step for s in sim.steps] == list(range(6))
    assert [s.phase for s in real.steps] == ["prefill", "prefill"] + ["decode"] * 4
    assert all(s.end > s.start for s in real.steps)
    assert real.counters.hits == sim.counters.hits
    assert real.counters.demand_loads == sim.counters.demand_loads
    assert real.counters.evictions == sim.counters.evictions
    frame = result_to_frames(real)["timeline"]
    assert list(frame.columns) == list(TIMELINE_COLUMNS)
    assert (frame["end_s"] >= frame["start_s"]).all()
    kinds = set(zip(frame["resource"], frame["kind"]))
    assert ("gpu", "attention") in kinds and ("gpu", "shared") in kinds
    # attention once per (step, layer); every CPU decision is a CPU interval
    assert (frame["kind"] == "attention").sum() == 6 * 3
    assert (frame["resource"] == "cpu").sum() == sum(1 for d in real.decisions if d[3] == "cpu")
    m = metrics(real)
    assert m["ttft_ms"] > 0 and m["tpot_ms_mean"] > 0 and m["decode_tokens"] == 8


def test_prefetches_started_after_the_last_token_count_as_cancelled_as_in_the_simulator(tmp_path, monkeypatch):
    """SMoE fills its decode cache when a prefill ends (000 Sec. IV-E): on a prefill-only trace the run ends
    with those prefetches still to copy. Issued prefetches less cancelled ones are the copies whose bytes both
    the real run and the simulator count. The stand-in's copy engine waits 20 ms after each copy, so that the
    real run too ends with copies not started (it counted all 8 prefetches with one expert's bytes)."""
    import time

    from backends.devices import CopyEngine
    model = tiny_model(layers=2, experts=4, top_k=2)
    prompt = [[0, 1], [1, 2], [2, 3]]
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "prefill", "tokens": {0: (0, [prompt, prompt])}}])
    copy = CopyEngine._copy
    monkeypatch.setattr(CopyEngine, "_copy", lambda engine, t: (copy(engine, t), time.sleep(0.02))[0])
    executor = prepare_real(str(path), tiny_profile(), "smoe", {}, RealConfig(device="cpu", cpu_threads=1))
    real = metrics(executor.run())
    sim = metrics(simulate(str(path), tiny_profile(), "smoe"))
    expert_bytes = executor.transfers[0].src.numel() * executor.transfers[0].src.element_size()
    for m in (real, sim):
        copies = m["prefetches"] - m["cancelled_prefetches"] + m["demand_loads"] + m["streamed_experts"]
        assert m["prefetches"] == 8 and 0 < copies < 8
        assert m["pcie_h2d_bytes"] == copies * expert_bytes


def test_a_copy_running_when_the_run_ends_has_its_span_cut_there(tmp_path, monkeypatch):
    """pcie_busy_s counts a copy's part inside the run; the timeline shows that part too (as the simulator's).
    Each stand-in copy takes 20 ms, so SMoE's cache fill at the prefill's end runs past it."""
    import threading
    import time

    from backends.devices import CopyEngine
    model = tiny_model(layers=2, experts=4, top_k=2)
    prompt = [[0, 1], [1, 2], [2, 3]]
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "prefill", "tokens": {0: (0, [prompt, prompt])}}])

    started = threading.Event()

    def slow(engine, t):
        t.issued.set()
        t.start_s = engine.clock.now()
        started.set()
        time.sleep(0.02)
        t.dst.copy_(t.src)
        t.end_s = engine.clock.now()
    monkeypatch.setattr(CopyEngine, "_copy", slow)
    executor = prepare_real(str(path), tiny_profile(), "smoe", {}, RealConfig(device="cpu", cpu_threads=1))
    step = executor._step

    def step_with_a_copy_on_the_wire(one):
        step(one)
        # on a loaded machine the copy thread may not have started the fill's first copy before the run ends
        # (then no copy runs at the end, and none is cut): the run ends once one is on the wire
        assert started.wait(10)
    executor._step = step_with_a_copy_on_the_wire
    result = executor.run()
    pcie = result_to_frames(result)["timeline"].query("resource == 'pcie'")
    assert len(pcie) and pcie.end_s.max() == result.makespan_s
    assert (pcie.end_s - pcie.start_s).sum() == pytest.approx(result.pcie_busy_s, rel=1e-9)


def test_lru_run_moves_weights_into_the_slots_it_reports(trace):
    executor = prepare_real(trace, tiny_profile(), "gpu-only-lru", SETTINGS, _config())
    result = executor.run()
    actions = {d[3] for d in result.decisions}
    assert {"gpu_load", "evict", "gpu_hit"} <= actions
    assert result.pcie_bytes == result.counters.demand_loads * executor.costs.expert_bytes \
        + result.counters.streamed * executor.costs.expert_bytes
    weights = executor.weights
    for layer in range(3):
        # the last step's loads complete before it ends; the cache state learns so at the next plan
        experts = executor.cache.resident[layer] | executor.cache.in_flight[layer]
        assert len(experts) == 3
        for e in experts:
            assert torch.equal(weights.on_gpu(layer, e), weights.host[layer, e])
    pcie = result_to_frames(result)["timeline"].query("resource == 'pcie'")
    assert len(pcie) == result.counters.demand_loads + result.counters.streamed


def test_copy_engine_serves_demand_before_queued_prefetches():
    clock = Clock(False)
    engine = CopyEngine(clock, cuda=False)
    gate = HostWork()  # holds both copies until both are queued
    src, a, b = torch.ones(1000), torch.zeros(1000), torch.zeros(1000)
    prefetch = engine.submit(a, src, priority=1, kind="prefetch", layer=1, expert=0, step=0, after=gate)
    demand = engine.submit(b, src, priority=0, kind="load", layer=0, expert=0, step=0, after=gate)
    assert [t.kind for t in engine.queued()] == ["load", "prefetch"]
    gate.event.set()
    prefetch.wait()
    demand.wait()
    engine.close()
    assert demand.interval()[1] <= prefetch.interval()[0]
    assert torch.equal(a, src) and torch.equal(b, src)


def test_routing_groups_rows_by_expert():
    experts = np.array([[2, 0], [0, 1], [2, 1]])
    weights = np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]], dtype=np.float32)
    routing = LayerRouting.of(experts, weights)
    assert routing.spans == {0: (0, 2), 1: (2, 2), 2: (4, 2)}
    assert routing.rows.tolist() == [0, 1, 1, 2, 0, 2]
    assert routing.weights.tolist() == pytest.approx([0.4, 0.7, 0.3, 0.5, 0.6, 0.5])


def test_attention_batches_follow_requests():
    same = RealExecutor._batches(np.array([0, 1, 2]), np.array([9, 4, 7]))
    assert [(b.requests, b.tokens, b.context) for _, b in same] == [(3, 1, 10)]
    mixed = RealExecutor._batches(np.array([5, 5, 5, 6]), np.array([0, 1, 2, 30]))
    assert [(s.start, s.stop, b.requests, b.tokens, b.context) for s, b in mixed] == [(0, 3, 1, 3, 3), (3, 4, 1, 1, 31)]


def test_the_lm_head_reads_each_sequences_last_token():
    same = RealExecutor._batches(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]))
    assert RealExecutor._last_rows(same) == [1, 3]
    mixed = RealExecutor._batches(np.array([5, 5, 5, 6]), np.array([0, 1, 2, 30]))
    assert RealExecutor._last_rows(mixed) == [2, 3]


def test_a_step_runs_what_the_simulator_charges_outside_the_moe_layers(tmp_path):
    """Embedding, dense decoder layers, LM head and token choice: the simulator counts them in every step, so
    the measured run executes them too (a comparison without them would set a modelled cost against nothing)."""
    model = dataclasses.replace(tiny_model(layers=2, experts=8, top_k=2), num_dense_layers=1,
                                dense_intermediate_size=96)
    path = str(write_tiny_trace(tmp_path / "dense.parquet", model,
                                random_routing(np.random.default_rng(2), model, 2, 8, 4)))
    real = prepare_real(path, tiny_profile(), "cpu-only", {}, _config()).run()
    sim = simulate(path, tiny_profile(), "cpu-only", {}, timeline=True)

    def gpu_work(result):
        frame = result_to_frames(result)["timeline"].query("resource == 'gpu'")
        return frame.groupby(["kind", frame["layer"] >= 0], observed=True).size().to_dict()
    steps = len(real.steps)
    expected = {("embedding", False): steps, ("attention", False): steps, ("dense_ffn", False): steps,
                ("attention", True): 2 * steps, ("lm_head", False): steps, ("sampling", False): steps}
    assert gpu_work(real) == gpu_work(sim) == expected
    breakdown = metrics(real)["breakdown_ms"]
    assert all(breakdown[key] > 0 for key in ("embedding", "dense_ffn", "lm_head", "sampling"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu_is_one_clear_error():
    with pytest.raises(ConfigError, match="no CUDA device.*--device cpu"):
        check_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.parametrize("system", TIMING_INDEPENDENT)
def test_cuda_run_logs_the_simulators_decisions(trace, system):
    real = prepare_real(trace, tiny_profile(), system, SETTINGS, _config("cuda")).run()
    sim = simulate(trace, tiny_profile(), system, SETTINGS, decisions=True)
    assert real.decisions == sim.decisions
    frame = result_to_frames(real)["timeline"]
    assert (frame["end_s"] >= frame["start_s"]).all()


def test_copy_engine_cancels_queued_prefetches_and_honours_not_before():
    clock = Clock(False)
    engine = CopyEngine(clock, cuda=False)
    gate, gpu_done = HostWork(), HostWork()
    src, a, b, c = torch.ones(1000), torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    dropped = engine.submit(a, src, priority=1, kind="prefetch", layer=1, expert=0, step=0, after=gate)
    kept = engine.submit(b, src, priority=0, kind="load", layer=0, expert=0, step=0, after=gate)
    late = engine.submit(c, src, priority=1, kind="prefetch", layer=1, expert=1, step=0, not_before=gpu_done)
    assert engine.cancel("prefetch") == [dropped, late]
    assert dropped.finished.is_set() and [t.kind for t in engine.queued()] == ["load"]
    gate.event.set()
    kept.wait()
    assert torch.equal(b, src) and not a.any()  # a cancelled copy never touches its slot
    again = engine.submit(c, src, priority=1, kind="prefetch", layer=1, expert=1, step=0, not_before=gpu_done)
    assert not again.ready()
    gpu_done.event.set()
    again.wait()
    engine.close()
    assert torch.equal(c, src)


def test_the_cpu_stand_ins_slots_that_would_not_fit_beside_the_experts_are_refused(monkeypatch):
    """On --device cpu the "GPU" slots are host memory too: a plan sized by a measured profile's GPU memory
    (the host's own) was killed for memory; it is refused with the slot count that fits (80% of what is left)."""
    import backends.weights as weights
    model = tiny_model(layers=2, experts=4, top_k=2)
    slot_bytes = weights.expert_params(model, model.moe_intermediate_size) * 2  # bf16
    monkeypatch.setattr(weights, "host_bytes_available", lambda: 100 * slot_bytes)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError) as err:
        weights.ExpertWeights(model, torch.bfloat16, torch.device("cpu"), [60, 40], 2, generator)
    assert "the CPU stand-in's 100 expert slots and 2 staging buffers need" in str(err.value)
    assert err.value.field == "cache.slots" and "--set cache.slots=78 or fewer" in str(err.value)
    fitted = weights.ExpertWeights(model, torch.bfloat16, torch.device("cpu"), [40, 38], 2, generator)
    assert fitted.pool.shape[0] == 78


def test_the_trace_shape_of_a_trace_whose_name_is_not_utf8(trace, tmp_path):
    """pyarrow cannot encode such a name (bytes a shell passes through): sizing a real run ended in a
    UnicodeEncodeError."""
    import os
    import shutil

    from backends.run_config import trace_shape
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/t\xff.parquet")
    shutil.copy(trace, odd)
    assert trace_shape(odd) == trace_shape(str(trace))


def test_measured_sync_counts_only_its_part_past_the_layers_gpu_work(trace):
    """As in the simulator (docs/engine.md), a layer's CPU time past its GPU work is split between the syncs'
    part past it [sync] and the rest [cpu_other]: the two add up to that time, and a hidden sync costs nothing."""
    executor = prepare_real(trace, tiny_profile(), "cpu-only", SETTINGS, _config())
    real = executor.run()
    frame = result_to_frames(real)["timeline"].query("layer >= 0")
    ends = frame.groupby(["resource", "step", "layer"], observed=True)["end_s"].max()
    gpu, cpu = ends["gpu"], ends["cpu"]
    past_gpu = sum(max(end - gpu.get(key, end), 0.0) for key, end in cpu.items())
    breakdown = real.counters.breakdown
    assert past_gpu > 0
    assert breakdown["sync"] + breakdown["cpu_other"] == pytest.approx(past_gpu, rel=1e-9)
    measured = sum(t1 - t0 for spans in executor.sync_spans.values() for t0, t1 in spans)
    assert len(executor.sync_spans) == 6 * 3 and measured > 0
    assert 0 <= breakdown["sync"] <= measured


def _requests_seen(run, monkeypatch) -> list[list[int] | None]:
    """The request ids of the token rows of every layer view a system plans, in order."""
    from moesim.policy.systems import ComposedSystem
    seen: list[list[int] | None] = []
    plan = ComposedSystem.plan

    def spy(self, view):
        seen.append(None if view.requests is None else np.asarray(view.requests).tolist())
        return plan(self, view)
    monkeypatch.setattr(ComposedSystem, "plan", spy)
    run()
    monkeypatch.setattr(ComposedSystem, "plan", plan)
    return seen


@pytest.mark.parametrize("system", ["moe-infinity", "smoe-flex"])
def test_the_views_carry_each_token_rows_request_as_in_the_simulator(trace, system, monkeypatch):
    """moe-infinity's activation matrices and smoe-flex's online predictor accuracy are kept per request
    (``LayerView.requests``); the real backend left the field out, so every row read as request 0."""
    config = RealConfig(device="cpu", cpu_threads=1, warmup_steps=0)
    real = _requests_seen(lambda: prepare_real(trace, tiny_profile(), system, SETTINGS, config).run(), monkeypatch)
    sim = _requests_seen(lambda: simulate(trace, tiny_profile(), system, SETTINGS), monkeypatch)
    assert real == sim
    assert [0, 1] in real  # the decode steps batch both requests


@pytest.mark.parametrize("system", ["moe-infinity", "fiddler"])
def test_a_model_wide_pool_takes_the_pools_slots_and_shares_them_between_layers(tmp_path, system):
    """moe-infinity and fiddler cache into one model-wide pool whose per-layer quotas are every expert of a
    layer: the backend allocated the quotas' sum (here 3 x 8 slots for a pool of 5), on a GPU the whole
    model's experts where the memory plan holds a pool that fits."""
    model = tiny_model(layers=3, experts=8, top_k=2)
    path = write_tiny_trace(tmp_path / "t.parquet", model, random_routing(np.random.default_rng(3), model, 1, 6, 8))
    settings = {"cache.slots": "5"}
    executor = prepare_real(str(path), tiny_profile(), system, settings, _config())
    assert executor.memory.pool == 5 and sum(executor.memory.capacity) > 5
    real = executor.run()
    weights = executor.weights
    assert weights.pool.shape[0] == 5
    held = [(layer, e) for layer in range(3)
            for e in executor.cache.resident[layer] | executor.cache.in_flight[layer]]
    assert len({weights.slot[key] for key in held}) == len(held) <= 5
    for layer, e in held:
        assert torch.equal(weights.on_gpu(layer, e), weights.host[layer, e])
    assert real.counters.hits > 0 and (system == "fiddler" or real.counters.demand_loads > 0)


def test_mixtral_offloadings_write_backs_are_copied_after_their_loads(trace):
    """mixtral-offloading writes each evicted expert back to host memory (``LayerPlan.writebacks``); the
    backend ignored the field, so the real run's copy engine did less work than the simulated one. Each
    write-back now follows the load that took its slot, as the simulator queues it, and adds busy time but
    no host-to-device bytes."""
    settings = {**SETTINGS, "memory.expert_dtype": "bf16", "memory.non_expert_dtype": "bf16"}
    executor = prepare_real(trace, tiny_profile(), "mixtral-offloading", settings, _config())
    real = executor.run()
    sim = simulate(trace, tiny_profile(), "mixtral-offloading", settings, decisions=True, timeline=True)
    assert real.decisions == sim.decisions  # every expert on the GPU, demand loads only: no timing in the plan
    frames = {name: result_to_frames(r)["timeline"].query("resource == 'pcie'") for name, r in
              (("real", real), ("sim", sim))}
    backs = {name: f.query("kind == 'writeback'") for name, f in frames.items()}
    evicted = sorted((d[0], d[4], d[2]) for d in real.decisions if d[3] == "evict")
    assert len(evicted) == real.counters.demand_loads > 0
    for name in frames:
        assert sorted(zip(backs[name].step, backs[name].layer, backs[name].expert)) == evicted, name
    copies = real.counters.demand_loads + real.counters.streamed
    assert real.pcie_bytes == sim.pcie_bytes == copies * executor.costs.expert_bytes
    ordered = frames["real"].sort_values("start_s")
    kinds = ordered.kind.tolist()
    assert all(kinds[i - 1] == "load" for i, k in enumerate(kinds) if k == "writeback")
    assert real.pcie_busy_s == pytest.approx((ordered.end_s - ordered.start_s).sum(), rel=1e-9)


def test_chunked_copies_let_a_demand_load_overtake_a_running_prefetch():
    """engine.copy_chunk_bytes: the simulator cuts a running prefetch at its next chunk boundary for a demand
    copy and requeues its rest; the backend copied every expert whole whatever the setting."""
    from tests.factories import preempted_prefetch
    clock = Clock(False)
    engine = CopyEngine(clock, cuda=False, chunk_bytes=4096)
    prefetch, demand, a, b, src = preempted_prefetch(engine, 4_000_000)
    demand.wait()
    prefetch.wait()
    engine.close()
    assert prefetch.parts and prefetch.part_elements[0] < src.numel()
    assert prefetch.parts[0][1] <= demand.interval()[0] and demand.interval()[1] <= prefetch.interval()[0]
    assert torch.equal(a, src) and torch.equal(b, src[:1000])


def test_a_chunked_run_counts_each_byte_once(trace):
    """A preempted prefetch's parts are 'chunk' spans; its bytes count once, its busy time part by part."""
    settings = {**SETTINGS, "engine.copy_chunk_bytes": "1024"}
    executor = prepare_real(trace, tiny_profile(), "smoe", settings, _config())
    result = executor.run()
    m = metrics(result)
    copies = m["prefetches"] - m["cancelled_prefetches"] + m["demand_loads"] + m["streamed_experts"]
    assert m["pcie_h2d_bytes"] == copies * executor.costs.expert_bytes
    pcie = result_to_frames(result)["timeline"].query("resource == 'pcie'")
    assert (pcie.end_s - pcie.start_s).sum() == pytest.approx(result.pcie_busy_s, rel=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
def test_cuda_chunked_copies_land_whole_and_time_each_part():
    engine = CopyEngine(Clock(True), cuda=True, chunk_bytes=1 << 20)
    src = torch.arange(64 << 20, dtype=torch.float32).pin_memory()  # 256 MiB: many chunk boundaries
    small = torch.ones(1000).pin_memory()
    a, b = torch.empty(src.shape, device="cuda"), torch.empty(1000, device="cuda")
    prefetch = engine.submit(a, src, priority=1, kind="prefetch", layer=1, expert=0, step=0)
    while engine.running is not prefetch:
        pass
    demand = engine.submit(b, small, priority=0, kind="load", layer=0, expert=0, step=0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        prefetch.gate(stream)  # a stream waiting for a preempted copy waits for its last chunk
        total = a.sum()
    demand.wait()
    prefetch.wait()
    engine.close()
    stream.synchronize()
    assert torch.equal(a.cpu(), src) and torch.equal(b.cpu(), small)
    assert total.item() == pytest.approx(src.double().sum().item(), rel=1e-3)
    if prefetch.parts:
        assert prefetch.parts[0][1] <= demand.interval()[0] + 1e-4
    assert prefetch.interval()[0] < prefetch.interval()[1]


def test_a_layer_sees_the_loads_earlier_layers_waited_for_as_landed(tmp_path, monkeypatch):
    """The simulator plans a layer when its attention ends, after the earlier layers' experts and so after
    every load they waited for; the backend plans once it has launched that attention, usually ahead of the
    stream, and saw those loads in flight. In a model-wide pool they could then not be evicted: moe-infinity
    loaded and streamed other experts than simulated. The stand-in's experts are slowed here, so that the host
    is well ahead."""
    import time

    from backends.layer_compute import LayerCompute
    model = tiny_model(layers=3, experts=8, top_k=2)
    path = write_tiny_trace(tmp_path / "t.parquet", model, random_routing(np.random.default_rng(3), model, 1, 6, 8))
    settings = {"cache.slots": "5", "prefetch": "none"}
    expert = LayerCompute._expert
    monkeypatch.setattr(LayerCompute, "_expert", lambda self, *a: (time.sleep(0.003), expert(self, *a))[1])
    real = prepare_real(str(path), tiny_profile(), "moe-infinity", settings, _config()).run()
    sim = simulate(str(path), tiny_profile(), "moe-infinity", settings, decisions=True)
    assert any(d[3] == "evict" and d[4] != d[1] for d in sim.decisions)  # evictions from other layers
    assert real.decisions == sim.decisions


def test_a_queued_prefetch_that_compute_waits_for_is_not_cancelled():
    """importance and moe-infinity drop queued prefetches at a plan (cancel_queued_prefetches). On the real
    run the host plans ahead of the stream, so a prefetch an earlier layer's GPU expert waits for could still
    be queued, and was cancelled: its expert computed on a slot never copied (or freed for another load), and
    an expert evicted before the cancel was dropped twice (KeyError in ExpertWeights.drop). In the simulator
    that prefetch has started by then; it is kept."""
    engine = CopyEngine(Clock(False), cuda=False)
    gate = HostWork()
    src, a, b = torch.ones(1000), torch.zeros(1000), torch.zeros(1000)
    awaited = engine.submit(a, src, priority=1, kind="prefetch", layer=1, expert=0, step=0, after=gate)
    awaited.awaited = True  # what launching a GPU expert that waits for it sets
    idle = engine.submit(b, src, priority=1, kind="prefetch", layer=1, expert=1, step=0, after=gate)
    assert engine.cancel("prefetch") == [idle]
    gate.event.set()
    awaited.wait()
    engine.close()
    assert torch.equal(a, src) and not b.any()


def test_a_layer_is_planned_once_its_attention_and_gate_have_run(trace, monkeypatch):
    """The simulator plans a layer when its attention ends; a real system reads the gate's routing back before
    it can decide. The backend planned as soon as it had launched the attention, usually well ahead of the
    stream, so copies that had landed in the simulator looked in flight (hybrimoe, importance and dali then
    placed experts otherwise). A slowed attention (5 ms) shows it: every plan now sees its attention done."""
    import time

    slow = RealExecutor._attend
    monkeypatch.setattr(RealExecutor, "_attend", staticmethod(lambda *a: (time.sleep(0.005), slow(*a))[1]))
    executor = prepare_real(trace, tiny_profile(), "gpu-only-lru", SETTINGS, _config())
    system = executor.setup.system
    plan, seen = system.plan, []

    def checked(view):
        last = executor.pending_rows[-1]
        seen.append(last.kind == "attention" and last.work.done())
        return plan(view)
    system.plan = checked  # an instance attribute: the backend looks plan() up on the instance
    executor.run()
    assert len(seen) == 6 * 3 and all(seen)


def test_int4_non_expert_weights_are_refused_naming_the_setting(trace):
    """mixtral-offloading defaults both dtypes to int4. With only memory.expert_dtype=bf16 the backend ran bf16
    attention against a simulated int4 one, without a word; it now refuses, naming memory.non_expert_dtype."""
    with pytest.raises(ConfigError, match="not int4") as err:
        prepare_real(trace, tiny_profile(), "mixtral-offloading", {**SETTINGS, "memory.expert_dtype": "bf16"},
                     _config())
    assert err.value.field == "memory.non_expert_dtype" and "memory.non_expert_dtype=bf16" in str(err.value)


def _host_time(trace, system, wrap=None):
    """The host time of a real run of ``system``, its plan() wrapped by ``wrap`` (plan -> plan) if given."""
    executor = prepare_real(trace, tiny_profile(), system, SETTINGS, _config())
    if wrap is not None:
        executor.setup.system.plan = wrap(executor.setup.system.plan)  # the backend looks plan() up on the instance
    return executor.run().host_time


def _least_host_time(trace, system, wrap=None, runs=3):
    """Each figure of :func:`_host_time`'s summary, the least of ``runs`` runs: another process's time slice only
    adds to a host-clock figure, so the least is the run's own on a busy machine too."""
    summaries = [_host_time(trace, system, wrap).summary() for _ in range(runs)]
    return {key: min(s[key] for s in summaries) for key, value in summaries[0].items()
            if isinstance(value, (int, float))}


def _spin(seconds):
    import time
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("system", ["cpu-only", "gpu-only-lru", "hybrimoe"])
def test_a_real_run_measures_the_host_time_before_each_layers_first_expert(trace, system):
    """On a GPU the host's work between a layer's attention and its first expert (retire, view, plan(), launches)
    is on the critical path, and the simulator does not charge it. The real run measures it per MoE layer, and
    plan()'s own part; the simulator's result has no such figure."""
    executor = prepare_real(trace, tiny_profile(), system, SETTINGS, _config())
    result = executor.run()
    host = result.host_time
    assert host.moe_layers == 3
    assert host.layers == 6 * 3 and host.decode_layers == 4 * 3  # every MoE layer of the measured run, once
    assert 0 < host.plan_s <= host.host_s and 0 < host.decode_plan_s <= host.decode_host_s
    assert host.decode_host_s <= host.host_s
    summary = host.summary()
    assert 0 < summary["plan_us_per_layer"] <= summary["host_us_per_layer"]
    assert 0 < summary["decode_plan_us_per_layer"] <= summary["decode_host_us_per_layer"]
    assert summary["host_us_per_layer"] == pytest.approx(host.host_s / 18 * 1e6)
    assert executor.host_span is None  # every layer's span was closed at its first expert
    assert not hasattr(simulate(trace, tiny_profile(), system, SETTINGS), "host_time")


def test_a_plan_that_takes_2_ms_longer_raises_the_measured_plan_and_host_time_by_about_that(trace):
    """A system whose plan() spins 2 ms more per layer: plan() and host time per MoE layer grow by about 2 ms."""
    def slow(plan):
        return lambda view: (_spin(0.002), plan(view))[1]
    base, slowed = _least_host_time(trace, "gpu-only-lru"), _least_host_time(trace, "gpu-only-lru", slow)
    for key in ("plan_us_per_layer", "host_us_per_layer", "decode_plan_us_per_layer", "decode_host_us_per_layer"):
        assert 1500 <= slowed[key] - base[key] <= 5000, (key, base[key], slowed[key])
    assert slowed["plan_us_per_layer"] >= 2000


def test_a_plans_declared_overhead_is_not_counted_as_host_time(trace):
    """A plan's overhead_s is charged by the simulator (and spun by the backend): it is not host time it misses."""
    def declared(plan):
        def run(view):
            made = plan(view)
            made.overhead_s["predict"] = 0.002
            return made
        return run
    base, charged = _least_host_time(trace, "gpu-only-lru"), _least_host_time(trace, "gpu-only-lru", declared)
    assert charged["host_us_per_layer"] - base["host_us_per_layer"] < 1000, (base, charged)
