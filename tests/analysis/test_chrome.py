"""Chrome Trace Event Format export: structure, units, completeness, nesting, step markers."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moesim.analysis.chrome import event_name, to_chrome_trace, write_chrome_trace
from moesim.analysis.timeline import busy_time
from moesim.errors import ConfigError
from moesim.hw.profile import parse_profile
from moesim.model.spec import ModelSpec
from moesim.sim.result import TIMELINE_COLUMNS, result_to_frames
from moesim.sim.run import simulate
from moesim.trace import TraceMeta, write_trace

PROFILE = {
    "schema_version": 1,
    "name": "test",
    "gpu": {"name": "test gpu", "memory_gib": 24, "reserved_gib": 1, "launch_us": 5, "graph_launch_us": 1,
            "cuda_graph": False, "peak_tflops": {"bf16": 165}, "mem_bandwidth_gbps": 1008},
    "cpu": {"name": "test cpu", "cores": 10, "dram_bandwidth_gbps": 100, "peak_tflops": {"avx512": 2},
            "amx_switch_tokens": None},
    "pcie": {"generation": 4,
             "h2d": {"size_bytes": [65536, 1048576, 67108864], "gbps": [6, 20, 25], "source": "test"},
             "d2h": {"size_bytes": [65536, 1048576, 67108864], "gbps": [6, 20, 25], "source": "test"},
             "latency_us": 10, "copy_engines": 1, "duplex_slowdown": 0.8},
    "sync": {"per_layer_us": 20},
    "sources": {"gpu": "test", "cpu": "test", "pcie": "test", "sync": "test"},
}

MODEL = ModelSpec(name="tiny", num_layers=3, num_experts=8, top_k=2, hidden_size=256, moe_intermediate_size=512,
                  num_shared_experts=1, shared_intermediate_size=512, num_attention_heads=4, num_kv_heads=4,
                  head_dim=64, vocab_size=1000, total_params=10_000_000)


def _write_trace(path: Path, prompt: int = 3, decode: int = 3) -> Path:
    """One request: a ``prompt``-token prefill step, then ``decode`` one-token steps."""
    rng = np.random.default_rng(7)
    rows: dict[str, list] = {k: [] for k in ("request", "step", "phase", "position", "layer", "experts")}
    for step in range(1 + decode):
        positions = range(prompt) if step == 0 else [prompt + step - 1]
        for layer in range(MODEL.num_layers):
            for position in positions:
                rows["request"].append(0)
                rows["step"].append(step)
                rows["phase"].append("prefill" if step == 0 else "decode")
                rows["position"].append(position)
                rows["layer"].append(layer)
                rows["experts"].append(rng.choice(MODEL.num_experts, MODEL.top_k, replace=False))
    data = {k: np.array(v) for k, v in rows.items()}
    return write_trace(path, data, TraceMeta(model=MODEL, source={"kind": "test"}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Timelines of a run that streams experts over PCIe and of one that computes on the CPU."""
    trace = _write_trace(tmp_path_factory.mktemp("trace") / "t.parquet")
    profile = parse_profile(PROFILE, origin="test-profile")
    out = {}
    for system in ("gpu-only-lru", "static-hot"):
        result = simulate(str(trace), profile, system, {"cache.slots_per_layer": "2"}, timeline=True)
        out[system] = (result, result_to_frames(result)["timeline"])
    return out


def _frame(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(TIMELINE_COLUMNS))


def _spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _assert_nested(trace: dict) -> None:
    """Complete events of one thread never partly overlap (viewers drop those that do)."""
    by_thread: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in _spans(trace):
        by_thread[(e["pid"], e["tid"])].append(e)
    for events in by_thread.values():
        ns = sorted((round(e["ts"] * 1000), round(e["dur"] * 1000)) for e in events)  # as Perfetto reads them
        for (ts0, dur0), (ts1, _) in zip(ns, ns[1:]):
            assert ts1 >= ts0 + dur0


def _assert_well_formed(trace: dict) -> None:
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    assert trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    for e in events:
        assert e["ph"] in ("X", "M", "i", "C")
        assert type(e["pid"]) is int and type(e["tid"]) is int
        assert isinstance(e["name"], str) and e["name"]
    named_processes = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in _spans(trace):
        assert e["dur"] >= 0
        assert e["pid"] in named_processes
        assert (e["pid"], e["tid"]) in named_threads
    _assert_nested(trace)


# ----------------------------------------------------------------------------- hand-made timelines
def test_units_names_and_args() -> None:
    frame = _frame([
        ("gpu", 0, 0.0, 0.0005, "attention", 0, 12, -1, 4),
        ("pcie", 0, 0.0005, 0.002, "load", 0, 12, 37, 0),
        ("gpu", 0, 0.002, 0.0035, "expert", 0, 12, 37, 4),
        ("cpu", 0, 0.0005, 0.0025, "expert", 0, 12, 5, 1),
    ])
    trace = to_chrome_trace(frame, {"system": "smoe"})
    _assert_well_formed(trace)
    spans = {e["name"]: e for e in _spans(trace)}
    assert set(spans) == {"L12 attention (4 tok)", "L12 E37 load", "L12 E37 expert (4 tok)", "L12 E5 expert (1 tok)"}
    gpu_expert = spans["L12 E37 expert (4 tok)"]
    assert gpu_expert["ts"] == 2000 and gpu_expert["dur"] == 1500  # 1.5 ms span
    assert spans["L12 E37 load"]["dur"] == 1500 and spans["L12 E37 load"]["ts"] == 500
    assert gpu_expert["args"] == {"step": 0, "layer": 12, "expert": 37, "tokens": 4}
    assert gpu_expert["cat"] == "gpu,expert"
    # one process per resource group, the transfers in their own process
    pids = {name: e["pid"] for name, e in spans.items()}
    assert pids["L12 attention (4 tok)"] == pids["L12 E37 expert (4 tok)"]
    assert len({pids["L12 E37 load"], pids["L12 E37 expert (4 tok)"], pids["L12 E5 expert (1 tok)"]}) == 3
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[pids["L12 E37 load"]].startswith("PCIe") and names[pids["L12 E5 expert (1 tok)"]] == "CPU"
    assert trace["otherData"] == {"system": "smoe"}


def test_event_name() -> None:
    assert event_name("expert", 12, 37, 4) == "L12 E37 expert (4 tok)"
    assert event_name("shared", 3, -1, 16) == "L3 shared (16 tok)"
    assert event_name("prefetch", 4, 2, 0) == "L4 E2 prefetch"
    assert event_name("embedding", -1, -1, 135) == "embedding (135 tok)"  # outside the MoE layers: no 'L-1'
    assert event_name("lm_head", -1, -1, 0) == "lm_head"


def test_step_markers_at_each_step_start() -> None:
    frame = _frame([
        ("gpu", 0, 0.000, 0.001, "attention", 0, 0, -1, 1),
        ("gpu", 0, 0.001, 0.002, "attention", 0, 1, -1, 1),
        ("gpu", 0, 0.002, 0.003, "attention", 1, 0, -1, 1),
        ("gpu", 0, 0.003, 0.004, "attention", 1, 1, -1, 1),
        ("pcie", 0, 0.0015, 0.0045, "prefetch", 1, 0, 3, 0),  # issued in step 1's layer 0... after it starts
    ])
    trace = to_chrome_trace(frame, {})
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert [(e["name"], e["ts"], e["s"]) for e in instants] == [("step 0", 0, "g"), ("step 1", 1500, "g")]
    assert [(e["ts"], e["args"]["step"]) for e in counters] == [(0, 0), (1500, 1)]


def test_overlapping_spans_of_one_lane_go_to_separate_threads() -> None:
    # two copy engines logged on lane 0: the second transfer starts before the first ends
    frame = _frame([
        ("pcie", 0, 0.000, 0.004, "prefetch", 0, 1, 1, 0),
        ("pcie", 0, 0.001, 0.005, "prefetch", 0, 1, 2, 0),
        ("pcie", 0, 0.004, 0.006, "load", 0, 2, 3, 0),
    ])
    trace = to_chrome_trace(frame, {})
    _assert_well_formed(trace)
    tid = {e["args"]["expert"]: e["tid"] for e in _spans(trace)}
    assert tid[1] != tid[2]
    assert tid[3] == tid[1]  # back-to-back with the first transfer: same thread
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {tid[1]: "copy engine 0", tid[2]: "copy engine 0 #2"}


def test_float_noise_at_a_step_boundary_keeps_one_thread() -> None:
    """The engine's sums put a step's first span 1e-19 s before the last one ended (0.00055422264 s): one
    stream, one thread, and the written spans follow each other without overlap."""
    end = 0.00055422264
    frame = _frame([
        ("gpu", 0, 0.0005542206, end, "sampling", 2, -1, -1, 1),
        ("gpu", 0, np.nextafter(end, 0.0), 0.00055422285, "embedding", 3, -1, -1, 1),
        ("gpu", 0, 0.00055422285, 0.0006, "attention", 3, 0, -1, 1),
    ])
    trace = to_chrome_trace(frame, {})
    _assert_well_formed(trace)
    assert {e["tid"] for e in _spans(trace)} == {2001}
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert threads == ["stream 0"]


def test_an_overlap_of_one_rounded_nanosecond_is_noise_but_two_are_not() -> None:
    # 0.4 ns apart straddling a nanosecond: 2 ns and 1 ns once rounded; the second span moves to 2 ns
    noise = to_chrome_trace(_frame([("pcie", 0, 0.0, 1.6e-9, "load", 0, 0, 1, 0),
                                    ("pcie", 0, 1.2e-9, 5e-9, "load", 0, 0, 2, 0)]), {})
    _assert_well_formed(noise)
    assert [(e["ts"], e["dur"], e["tid"]) for e in _spans(noise)] == [(0.0, 0.002, 1001), (0.002, 0.003, 1001)]
    real = to_chrome_trace(_frame([("pcie", 0, 0.0, 3e-9, "load", 0, 0, 1, 0),
                                   ("pcie", 0, 1e-9, 5e-9, "load", 0, 0, 2, 0)]), {})
    _assert_well_formed(real)
    assert [e["tid"] for e in _spans(real)] == [1001, 1002]


def test_tids_unique_across_processes() -> None:
    frame = _frame([("gpu", 0, 0.0, 0.001, "attention", 0, 0, -1, 1), ("cpu", 0, 0.0, 0.001, "expert", 0, 0, 1, 1),
                    ("pcie", 0, 0.0, 0.001, "load", 0, 0, 2, 0)])
    tids = {e["tid"] for e in _spans(to_chrome_trace(frame, {}))}
    assert len(tids) == 3 and 0 not in tids


def test_meta_made_json_safe() -> None:
    frame = _frame([("gpu", 0, 0.0, 0.001, "attention", 0, 0, -1, 1)])
    meta = {"slots": np.int64(3), "hit_rate": np.float64(0.5), "ttft": float("nan"), "trace": Path("/x/t.parquet"),
            "notes": ("a", "b")}
    trace = to_chrome_trace(frame, meta)
    assert trace["otherData"] == {"slots": 3, "hit_rate": 0.5, "ttft": None, "trace": "/x/t.parquet",
                                  "notes": ["a", "b"]}
    json.dumps(trace, allow_nan=False)


def test_bad_frames_rejected_in_one_line() -> None:
    with pytest.raises(ConfigError, match="lacks column 'tokens'"):
        to_chrome_trace(_frame([("gpu", 0, 0.0, 0.001, "attention", 0, 0, -1, 1)]).drop(columns="tokens"), {})
    backwards = _frame([("gpu", 0, 0.0, 0.001, "attention", 0, 0, -1, 1), ("gpu", 0, 0.002, 0.001, "expert", 0, 0, 1, 1)])
    with pytest.raises(ConfigError) as err:
        to_chrome_trace(backwards, {})
    assert "row 1" in str(err.value) and "end_s" in str(err.value) and "\n" not in str(err.value)


def test_empty_timeline() -> None:
    trace = to_chrome_trace(_frame([]), {})
    assert trace["traceEvents"] == [] and trace["displayTimeUnit"] == "ms"


# ----------------------------------------------------------------------------- simulated timelines
@pytest.mark.parametrize("system", ["gpu-only-lru", "static-hot"])
def test_every_row_present_and_well_formed(runs: dict, system: str) -> None:
    result, frame = runs[system]
    trace = to_chrome_trace(frame, {"system": system})
    _assert_well_formed(trace)
    spans = _spans(trace)
    assert len(spans) == len(frame)
    got = Counter((e["cat"], e["args"]["step"], e["args"]["layer"], e["args"]["expert"], e["args"]["tokens"],
                   e["ts"], e["dur"]) for e in spans)
    want = Counter((f"{r.resource},{r.kind}", r.step, r.layer, r.expert, r.tokens, round(r.start_s * 1e6, 3),
                    round(round(r.end_s * 1e6, 3) - round(r.start_s * 1e6, 3), 3)) for r in frame.itertuples())
    assert got == want
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [e["args"]["step"] for e in instants] == [s.step for s in result.steps]
    assert [e["ts"] for e in instants] == [round(s.start * 1e6, 3) for s in result.steps]


def test_a_simulated_gpu_stream_is_one_thread(tmp_path: Path) -> None:
    """gpu-only-lru over many decode steps: the engine's one GPU stream and one copy engine are one thread
    each in the viewer (step boundaries used to split the stream into 'stream 0 #2')."""
    from tests.factories import tiny_model, tiny_profile, write_tiny_trace
    model = tiny_model(layers=1, experts=4, top_k=1)
    routing = [{"phase": "decode", "tokens": {0: (i, [[[e]]])}} for i, e in enumerate([0, 3, 3, 1, 0, 2, 2, 1])]
    trace = write_tiny_trace(tmp_path / "t.parquet", model, routing)
    result = simulate(str(trace), tiny_profile(pcie_gbps=1.0), "gpu-only-lru", {"cache.slots_per_layer": "1"},
                      timeline=True)
    chrome = to_chrome_trace(result_to_frames(result)["timeline"], {})
    _assert_well_formed(chrome)
    threads = sorted(e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "thread_name")
    assert threads == ["copy engine 0", "stream 0"]


def test_simulated_runs_cover_all_resources(runs: dict) -> None:
    kinds = {(r, k) for _, frame in runs.values() for r, k in zip(frame["resource"], frame["kind"])}
    assert {("gpu", "attention"), ("gpu", "shared"), ("gpu", "expert"), ("cpu", "expert")} <= kinds
    assert any(r == "pcie" for r, _ in kinds)


def test_busy_time_matches_engine_counters(runs: dict) -> None:
    for result, frame in runs.values():
        assert busy_time(frame, "gpu") == pytest.approx(result.counters.gpu_busy_s, rel=1e-9)
        assert busy_time(frame, "cpu") == pytest.approx(result.counters.cpu_busy_s, rel=1e-9, abs=1e-12)


def test_write_chrome_trace_loads_back(runs: dict, tmp_path: Path) -> None:
    _, frame = runs["gpu-only-lru"]
    path = write_chrome_trace(frame, tmp_path / "out" / "run.json", {"system": "gpu-only-lru"})
    assert json.loads(path.read_text()) == to_chrome_trace(frame, {"system": "gpu-only-lru"})
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temporary file left


def test_a_window_of_steps_keeps_their_spans_and_markers_only(runs: dict, tmp_path: Path) -> None:
    _, frame = runs["gpu-only-lru"]
    whole = to_chrome_trace(frame, {})
    window = to_chrome_trace(frame, {}, steps=(1, 2))
    spans = _spans(window)
    assert {e["args"]["step"] for e in spans} == {1, 2}
    assert len(spans) == sum(1 for e in _spans(whole) if e["args"]["step"] in (1, 2))
    markers = [e["args"]["step"] for e in window["traceEvents"] if e.get("cat") == "step"]
    assert markers == [1, 1, 2, 2]  # an instant and a counter sample per step
    times = [e["ts"] for e in window["traceEvents"] if e["ph"] != "M"]
    assert times == sorted(times)
    path = write_chrome_trace(frame, tmp_path / "w.json", {}, steps=(1, 2))
    assert json.loads(path.read_text()) == window


def test_failed_write_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text("previous")
    with pytest.raises(ConfigError):
        write_chrome_trace(_frame([("gpu", 0, 0.002, 0.001, "expert", 0, 0, 1, 1)]), path, {})
    assert path.read_text() == "previous"


def test_write_backs_are_not_called_host_to_device() -> None:
    """mixtral-offloading's copy engine writes evicted experts back to the host between its loads."""
    loads = _frame([("pcie", 0, 0.0, 0.001, "load", 0, 0, 1, 0)])
    both = _frame([("pcie", 0, 0.0, 0.001, "load", 0, 0, 1, 0), ("pcie", 0, 0.001, 0.002, "writeback", 0, 0, 2, 0)])
    names = [[e["args"]["name"] for e in to_chrome_trace(frame, {})["traceEvents"] if e["name"] == "process_name"]
             for frame in (loads, both)]
    assert names == [["PCIe (host to device)"], ["PCIe (host to device; writeback: device to host)"]]
