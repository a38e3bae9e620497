"""Real backend: the CUDA branches (CudaStream, CudaWork, the copy engine's stream, event timing, pinned
uploads) on a machine without a GPU. torch.cuda's streams and events are the small fakes of
tests/backends/fake_cuda.py: work runs eagerly on the host, but an event is timed only once the host knows it
complete, and a stream never waits for an event not yet recorded, as on a GPU. The GPU itself is checked by
the tests marked gpu."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.devices import Clock, CopyEngine  # noqa: E402
from backends.torch_backend import RealConfig, prepare_real  # noqa: E402
from moesim.sim.result import result_to_frames  # noqa: E402
from moesim.sim.run import simulate  # noqa: E402
from tests.backends import fake_cuda  # noqa: E402
from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace  # noqa: E402

SETTINGS = {"cache.slots_per_layer": "3"}
BF16 = {"memory.expert_dtype": "bf16", "memory.non_expert_dtype": "bf16"}
#: the systems benchmarks/gpu_validation.py runs on the GPU, and the other CUDA paths: write-backs (device to
#: host), deferred experts, a model-wide pool with cancelled prefetches, chunked copies
CASES = [(name, {}) for name in ("cpu-only", "gpu-only-lru", "static-hot", "smoe", "hybrimoe", "dali",
                                 "ktransformers-ed", "buddymoe")] + [
    ("mixtral-offloading", BF16), ("ktransformers-ed", {"defer.deferred": "1"}), ("moe-infinity", {}),
    ("smoe", {"engine.copy_chunk_bytes": "1024"}), ("gpu-only-lru", {"engine.copy_chunk_bytes": "1024"})]
TIMING_INDEPENDENT = ("cpu-only", "gpu-only-lru", "static-hot", "ktransformers-ed", "buddymoe", "mixtral-offloading")


@pytest.fixture
def fake(monkeypatch):
    fake_cuda.install(monkeypatch)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model = tiny_model(layers=3, experts=8, top_k=2, shared=True)
    path = tmp_path_factory.mktemp("cuda-paths") / "tiny.parquet"
    return str(write_tiny_trace(path, model, random_routing(np.random.default_rng(1), model, 2, 8, 4)))


@pytest.mark.parametrize("system, extra", CASES, ids=[f"{s}{'-' + '-'.join(e) if e else ''}" for s, e in CASES])
def test_the_cuda_branches_run_each_system_with_every_event_recorded_before_use(trace, fake, system, extra):
    settings = {**SETTINGS, **extra}
    executor = prepare_real(trace, tiny_profile(), system, settings,
                            RealConfig(device="cpu", cpu_threads=1, warmup_steps=1))
    executor.cuda = True  # CudaStream, the copy stream and CUDA events, on CPU tensors
    real = executor.run()
    if system in TIMING_INDEPENDENT:
        assert real.decisions == simulate(trace, tiny_profile(), system, settings, decisions=True).decisions
    frame = result_to_frames(real)["timeline"]
    assert len(frame) and (frame.end_s >= frame.start_s).all() and (frame.start_s >= 0).all()
    assert (frame.resource == "gpu").any()
    copies = [t for t in executor.transfers if t.end_event is not None]
    assert copies or system in ("cpu-only", "static-hot", "ktransformers-ed", "fiddler")
    for t in copies:  # every copy is timed on the copy engine's own stream
        assert t.start_event.stream is executor.pcie.stream and t.end_event.stream is executor.pcie.stream
    if system == "mixtral-offloading":
        assert {t.kind for t in copies} >= {"load", "writeback"}


def _sync_counter(engine: CopyEngine) -> list[int]:
    calls = [0]
    synchronize = engine.stream.synchronize

    def counted() -> None:
        calls[0] += 1
        synchronize()
    engine.stream.synchronize = counted
    return calls


def test_a_chunked_demand_copy_does_not_wait_on_the_host_between_chunks(fake):
    """On CUDA the copy engine synchronized the copy stream after every chunk of every copy: a demand copy,
    which nothing overtakes, paid a host round trip per chunk (the simulator charges each chunk's copy latency
    only), and a GPU expert waiting for it held the host until its last chunk was issued. Only a prefetch, which
    a demand copy may overtake at a chunk boundary, waits there."""
    engine = CopyEngine(Clock(True), cuda=True, chunk_bytes=4096)
    calls = _sync_counter(engine)
    src = torch.arange(100_000, dtype=torch.float32)  # 98 chunks of 4 KiB
    a, b = torch.zeros_like(src), torch.zeros_like(src)
    demand = engine.submit(a, src, priority=0, kind="load", layer=0, expert=0, step=0)
    demand.wait()
    assert calls[0] == 0 and torch.equal(a, src)
    prefetch = engine.submit(b, src, priority=1, kind="prefetch", layer=0, expert=1, step=0)
    prefetch.wait()
    engine.close()
    assert calls[0] == 97 and torch.equal(b, src)  # each boundary but the end, where a demand copy may take over
    assert demand.interval()[0] <= demand.interval()[1] <= prefetch.interval()[0]


def test_a_stream_waiting_for_a_preempted_chunked_prefetch_waits_for_its_last_chunk(fake):
    """The CUDA variant of the chunked preemption (tests/backends/test_torch_backend.py), on the fakes: a
    stream gated on a prefetch cut by a demand copy waits for the copy's last chunk (an event recorded then;
    the fake refuses a wait on one not yet recorded), and each cut-off part is timed on completed events."""
    from tests.factories import preempted_prefetch
    engine = CopyEngine(Clock(True), cuda=True, chunk_bytes=4096)
    prefetch, demand, a, b, src = preempted_prefetch(engine, 2_000_000)
    stream = torch.cuda.Stream()
    prefetch.gate(stream)
    assert prefetch.issued.is_set() and torch.equal(a, src)  # the gate returned only once the last chunk was on
    demand.wait()
    prefetch.wait()
    engine.close()
    assert prefetch.parts and prefetch.parts[0][1] <= demand.interval()[0]
    assert demand.interval()[1] <= prefetch.interval()[0] <= prefetch.interval()[1]
    assert torch.equal(b, src[:1000])


def test_the_profilers_cuda_measurements_time_completed_events(fake):
    """moesim profile --device cuda's timer, copies in both directions (and at once, on two streams) and the
    CPU-expert hand-off through CudaStream, on the fakes: every time read from events the host has synchronized."""
    from backends.measurements import Measurements
    from backends.profiler import ProfileConfig
    model = tiny_model()
    meas = Measurements(ProfileConfig(models=(model,), device="cpu", threads=1, quick=True))
    meas.cuda = meas.timer.cuda = True  # the CUDA branches, on CPU tensors
    meas.timer.WARMUP_S, meas.timer.MIN_TOTAL_S, meas.timer.MAX_POINT_S = 0.0, 0.001, 0.01  # few samples
    assert all(v > 0 for v in meas.expert_curve(model, model.moe_intermediate_size, True).values)
    assert all(v > 0 for _, series in meas.attention_curves(model) for v in series.values)
    for to_device in (True, False):
        latency, series = meas.copy_curve(to_device)
        assert latency > 0 and all(v > 0 for v in series.values)
    assert 0 < meas.duplex_slowdown() <= 1
    assert meas.launch_us() > 0 and meas.handoff_us(model.hidden_size) > 0


def test_pinned_experts_are_checked_at_the_power_of_two_the_pinned_allocator_takes(monkeypatch):
    """torch's pinned (caching host) allocator rounds every allocation up to a power of two: on CUDA the routed
    experts of 48 Qwen3-30B-A3B layers (54 GiB) pin 64 GiB. The host-memory check counted 54, so a run it let
    through could pin close to twice what it checked (killed for memory, or pinned memory failing). Here 3 layers
    of 1000 bytes pin 4096 bytes where 3600 are allowed: refused, naming the 2 layers whose 2048 bytes fit."""
    import backends.weights as weights
    from moesim.errors import ConfigError
    monkeypatch.setattr(weights, "host_bytes_available", lambda: 4000)
    model = tiny_model(layers=3, experts=1)
    params = 500  # 1000 bytes of bf16 a layer
    weights._check_fits(3, 1000)  # unpinned (the CPU stand-in): 3000 bytes fit
    with pytest.raises(ConfigError) as err:
        weights.host_experts(model, params, torch.bfloat16, True, torch.Generator().manual_seed(0))
    assert err.value.field == "--layers" and "rounded up to a power of two" in str(err.value)
    assert "moesim validate --layers 2" in str(err.value)
    assert [weights.pinned_bytes(n) for n in (1, 3, 4096, 4097)] == [1, 4, 4096, 8192]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_copy_engine_that_fails_hands_its_error_to_every_waiter(fake):
    """On a GPU an asynchronous error (an illegal memory access in some kernel) surfaces at the next CUDA call
    of any thread, such as the copy thread's readiness check (Event.query on a copy's previous slot user). That
    check ran outside the copy's error handling: the thread died, and the host waited for good in
    Transfer.gate (the validation run hanging until its time was up). The queued copies, and any submitted later,
    now fail with that error."""
    from backends.devices import HostWork

    class Broken(HostWork):
        def done(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    engine = CopyEngine(Clock(True), cuda=True)
    src, a = torch.ones(1000), torch.zeros(1000)
    queued = engine.submit(a, src, priority=0, kind="load", layer=0, expert=0, step=0, after=Broken())
    assert queued.issued.wait(timeout=5), "the host would wait for good"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        queued.gate(torch.cuda.Stream())
    later = engine.submit(a, src, priority=1, kind="prefetch", layer=0, expert=1, step=0)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        later.wait()
    engine.close()
