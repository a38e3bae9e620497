"""moesim profile: a quick CPU-only profile of a tiny model loads, covers every curve and names its source."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from moesim.hw.cost import CostModel  # noqa: E402
from moesim.hw.profile import load_profile  # noqa: E402
from backends.devices import allowed_cpus, host_threads  # noqa: E402
from backends.measurements import Timer, cpu_kernel_family  # noqa: E402
from backends.profiler import ProfileConfig, _round, measure_profile, measurement_labels, write_profile  # noqa: E402
from tests.factories import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    model = tiny_model(shared=True)
    labels: list[str] = []
    config = ProfileConfig(models=(model,), device="cpu", threads=1, quick=True, command="moesim profile x",
                           name="tiny-cpu")
    data = measure_profile(config, progress=labels.append)
    path = write_profile(data, tmp_path_factory.mktemp("profile") / "tiny.yaml")
    return model, data, path, labels, config


def test_profile_loads_and_every_cost_has_a_curve(measured):
    model, data, path, labels, config = measured
    profile = load_profile(path)
    assert profile.name == "tiny-cpu" and profile.cpu.cores == 1
    costs = CostModel(profile, model)
    for value in (costs.gpu_expert(1), costs.gpu_expert(64), costs.cpu_expert(16), costs.gpu_shared(4),
                  costs.attention(1, 300), costs.attention(16, 512), costs.h2d(costs.expert_bytes), costs.sync_s):
        assert value > 0
    assert costs.fallbacks == set()  # the tiny shape is measured, nothing falls back to the roofline
    assert labels == measurement_labels(config)
    # the stand-in's routed curve is the CPU pool's; shared experts of the tiny model have the routed shape
    assert labels[:3] == ["CPU expert FFN tiny", "attention tiny", "LM head and sampling tiny"] and len(labels) == 8


def test_the_lm_head_and_sampling_are_measured_curves_the_cost_model_reads(measured):
    """The step's end was a roofline the real backend never ran; now both are timed as the backend runs them."""
    model, data, path, _, _ = measured
    output = {c["kind"]: c for c in data["gpu"]["output"]}
    assert set(output) == {"lm_head", "sampling"}
    for curve in output.values():
        assert (curve["hidden"], curve["vocab"], curve["sequences"]) == (64, 100, [1, 4])
        assert all(t > 0 for t in curve["time_us"]) and "measured by moesim profile" in curve["source"]
    costs = CostModel(load_profile(path), model)
    assert costs.lm_head(1) == pytest.approx(output["lm_head"]["time_us"][0] * 1e-6)
    assert costs.sampling(4) == pytest.approx(output["sampling"]["time_us"][1] * 1e-6)
    # another vocabulary is another shape: the roofline stands in
    other = CostModel(load_profile(path), dataclasses.replace(model, vocab_size=101))
    assert other.lm_head(1) == pytest.approx(other._gpu_roof(other.profile, 2.0 * 101 * 64, 101 * 64 * 2, "bf16"))


def test_dense_layers_ffn_shape_is_measured(tmp_path):
    model = dataclasses.replace(tiny_model(), num_dense_layers=1, dense_intermediate_size=192)
    config = ProfileConfig(models=(model,), device="cpu", threads=1, quick=True, command="x", name="dense")
    data = measure_profile(config)
    assert [(c["hidden"], c["intermediate"]) for c in data["gpu"]["expert_ffn"]] == [(64, 128), (64, 192)]
    costs = CostModel(load_profile(write_profile(data, tmp_path / "dense.yaml")), model)
    assert costs.dense_ffn(4) > 0 and costs.fallbacks == set()


def test_profile_curves_cover_the_measured_points(measured):
    model, data, _, _, _ = measured
    gpu_curve = data["gpu"]["expert_ffn"][0]
    assert (gpu_curve["hidden"], gpu_curve["intermediate"], gpu_curve["dtype"]) == (64, 128, "bf16")
    assert gpu_curve["tokens"] == [1, 4, 16, 64] and len(gpu_curve["time_us"]) == 4
    # shared experts of the tiny model have the routed shape: one curve serves both
    assert len(data["gpu"]["expert_ffn"]) == 1
    assert [(c["model"], c["tokens"], c["context"]) for c in data["gpu"]["attention"]] == \
        [("tiny", 1, [128, 512]), ("tiny", 16, [128, 512])]
    sizes = data["pcie"]["h2d"]["size_bytes"]
    assert sizes == sorted(sizes) and model.expert_bytes() in sizes
    assert data["cpu"]["expert_ffn"][0]["threads"] == 1
    assert 0 < data["pcie"]["duplex_slowdown"] <= 1


def test_every_number_names_the_measurement(measured):
    _, data, path, _, _ = measured
    text = path.read_text()
    assert text.startswith("# Hardware profile measured by `moesim profile`.")
    for section in ("gpu", "cpu", "pcie", "sync"):
        assert data["sources"][section].startswith("measured by moesim profile on ")
        assert data["sources"][section].endswith(": moesim profile x")
    for curve in data["gpu"]["expert_ffn"] + data["gpu"]["attention"] + data["cpu"]["expert_ffn"]:
        assert curve["source"].startswith("measured by moesim profile on ")


@pytest.mark.parametrize("isa, family", [(["avx2", "amx_bf16", "avx512f"], "amx"), (["avx2", "avx512f"], "avx512"),
                                         (["avx2"], "avx2"), ([], "avx2")])
def test_kernel_family_follows_the_isa_flags(isa, family):
    assert cpu_kernel_family(isa) == family


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
def test_cuda_profile_loads(tmp_path):
    data = measure_profile(ProfileConfig(models=(tiny_model(),), device="cuda", threads=1, quick=True))
    profile = load_profile(write_profile(data, tmp_path / "gpu.yaml"))
    assert profile.gpu.memory_gib > 1 and profile.pcie.generation >= 3


def test_one_profile_serves_several_shapes(tmp_path):
    mla = tiny_model(layers=2, experts=4, shared=True)
    gqa = dataclasses.replace(tiny_model(layers=3, experts=8), name="tiny-gqa", moe_intermediate_size=48,
                              num_attention_heads=4, num_kv_heads=2, head_dim=16)
    config = ProfileConfig(models=(mla, gqa), device="cpu", threads=1, quick=True, name="two")
    labels: list[str] = []
    data = measure_profile(config, progress=labels.append)
    assert labels == measurement_labels(config)
    assert labels[:2] == ["CPU expert FFN tiny", "CPU expert FFN tiny-gqa"]
    shapes = {(c["hidden"], c["intermediate"]) for c in data["cpu"]["expert_ffn"]}
    assert shapes == {(64, 128), (64, 48)}
    assert {c["model"] for c in data["gpu"]["attention"]} == {"tiny", "tiny-gqa"}
    sizes = data["pcie"]["h2d"]["size_bytes"]
    assert mla.expert_bytes() in sizes and gqa.expert_bytes() in sizes
    profile = load_profile(write_profile(data, tmp_path / "two.yaml"))
    for model in (mla, gqa):
        costs = CostModel(profile, model)
        costs.gpu_expert(4), costs.cpu_expert(4), costs.attention(1, 200), costs.gpu_shared(2)
        assert costs.fallbacks == set(), model.name


def test_stand_in_gpu_curve_is_the_cpu_pools(measured):
    _, data, _, _, _ = measured
    gpu, cpu = data["gpu"]["expert_ffn"][0], data["cpu"]["expert_ffn"][0]
    assert gpu["time_us"] == cpu["time_us"] and "same kernels and threads" in gpu["source"]


def test_timer_takes_the_median_of_undisturbed_samples():
    timer = Timer("cpu", repeats=5)
    timer.MIN_TOTAL_S = 0.0
    # warm-up (two calls), then samples: preempted ones (another process had the core) are set aside
    script = iter([(9.0, True), (9.0, True)] + [(50.0, False), (1.0, True)] * 5 + [(2.0, True)] * 10)
    assert timer._sample(lambda: next(script)) == 1.0
    # when too few samples are undisturbed, every sample counts
    timer.MAX_CALLS = 6
    script = iter([(1.0, True)] * 2 + [(50.0, False)] * 4 + [(1.0, True)] * 2)
    assert timer._sample(lambda: next(script)) == 50.0


def test_host_threads_sets_and_restores_the_thread_count_without_pinning():
    before_cpus, before_threads = allowed_cpus(), torch.get_num_threads()
    with host_threads(1):
        assert torch.get_num_threads() == 1
        assert allowed_cpus() == before_cpus  # stand-in, pool and copy threads keep every core
    assert torch.get_num_threads() == before_threads


@pytest.mark.parametrize("command", [
    ["profile", "--device", "cpu", "--model", "flame-moe-290m", "--quick", "--out", "p.yaml"],
    ["validate", "--real", "--device", "cpu", "--trace", "t.parquet", "--systems", "cpu-only", "--out", "v"],
])
def test_more_threads_than_cpus_is_one_line_before_any_measuring(tmp_path, monkeypatch, capsys, command):
    """`--threads 1000` on 2 CPUs was timed oversubscribed and the profile said `cores: 1000`."""
    from moesim.cli import main
    from tests.factories import write_tiny_trace
    monkeypatch.chdir(tmp_path)
    write_tiny_trace(tmp_path / "t.parquet", tiny_model(), [])
    too_many = len(allowed_cpus()) + 1
    assert main([*command, "--threads", str(too_many)]) == 2
    err = capsys.readouterr().err
    assert err == (f"moesim: error: field '--threads': {too_many} threads, more than the {too_many - 1} CPUs this "
                   f"process may run on (fix: use --threads 1 to {too_many - 1}, or 0 for all of them)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_a_line_break_in_the_description_stays_inside_the_header_comment(measured, tmp_path):
    """The description (with the command line) went into one '# ' comment line: a line break in an argument
    started YAML of its own there ('gpu: 1' after `--name $'x\\ngpu: 1'`: the profile no longer loaded)."""
    _, data, _, _, _ = measured
    data = {**data, "description": data["description"] + " --model 'a\ngpu: 1'"}
    path = write_profile(data, tmp_path / "p.yaml")
    assert load_profile(path).name == "tiny-cpu"
    assert all(line.startswith("#") for line in path.read_text().split("schema_version:")[0].splitlines())


def test_a_profile_name_with_a_line_break_is_one_line(tmp_path, capsys):
    from moesim.cli import main
    assert main(["profile", "--device", "cpu", "--model", "flame-moe-290m", "--name", "x\ngpu: 1",
                 "--out", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err == ("moesim: error: field '--name': profile name 'x\\ngpu: 1' has a line break "
                                       "or other control character (fix: give a name on one line, e.g. --name "
                                       "h100-lab)\n")
    assert not (tmp_path / "p.yaml").exists()


def test_a_model_given_twice_is_one_line(tmp_path, capsys):
    """`--model flame-moe-290m --model flame-moe-290m` measured it twice and wrote its attention curves twice."""
    from moesim.cli import main
    assert main(["profile", "--device", "cpu", "--model", "flame-moe-290m", "--model", "flame-moe-290m", "--quick",
                 "--threads", "1", "--out", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err == ("moesim: error: field '--model': model flame-moe-290m given more than once "
                                       "(fix: give each model shape once)\n")
    assert not (tmp_path / "p.yaml").exists()


def _inflating_timer(monkeypatch, inflated_s: float, calls: int):
    """Timer.host returning ``inflated_s`` for its first ``calls`` calls (another process took the core), then
    the real timing; returns what each call returned, in order."""
    real = Timer.host
    returned: list[float] = []

    def host(self, fn):
        seconds = inflated_s if len(returned) < calls else real(self, fn)
        returned.append(seconds)
        return seconds
    monkeypatch.setattr(Timer, "host", host)
    return returned


def test_a_point_inflated_once_is_measured_again_and_the_profile_loads(tmp_path, monkeypatch, capsys):
    """A quick profile on a busy 2-core machine measured 44 ms at 1 token against 1.5 ms at 4: the loader refused
    the curve (a fall of more than TIME_FALL_LIMIT) and the validate run that measured it was lost."""
    returned = _inflating_timer(monkeypatch, 0.044, calls=1)  # the first point timed: CPU expert FFN at 1 token
    config = ProfileConfig(models=(tiny_model(),), device="cpu", threads=1, quick=True, name="busy")
    data = measure_profile(config)  # notes on stderr by default
    curve = data["cpu"]["expert_ffn"][0]
    # the point is the fresh measurement (the 5th timing: the other three points came between), not the 44 ms
    assert returned[:5] == [0.044, *returned[1:5]] and curve["time_us"][0] == _round(returned[4] * 1e6) < 44000 / 4
    assert curve["time_us"][1:] == _round([s * 1e6 for s in returned[1:4]])  # the others as measured
    assert data["gpu"]["expert_ffn"][0]["time_us"] == curve["time_us"]  # the stand-in's curve is the same
    profile = load_profile(write_profile(data, tmp_path / "busy.yaml"))
    assert profile.name == "busy"
    notes = [line.removeprefix("moesim: note: ") for line in capsys.readouterr().err.splitlines()]
    assert len(notes) == 1
    assert notes[0].startswith("CPU expert FFN tiny 64x128 (cpu.expert_ffn[0].time_us): measured tokens 1 again "
                               "(1 of 3, 2x the samples): ")
    assert f"{curve['time_us'][0]:.4g} µs, was 44000 µs (44000 µs at tokens 1 over 4x " in notes[0]
    assert notes[0].endswith(" and 1 more: the loader would refuse the curve)")


def test_a_point_inflated_every_time_writes_nothing_and_is_one_line(tmp_path, monkeypatch, capsys):
    from moesim.cli import main
    from backends.measurements import Measurements
    real = Measurements.expert_curve

    def busy_at_one_token(self, model, intermediate, on_gpu):
        """The curve as measured, but 44 ms at 1 token however often it is measured."""
        series = real(self, model, intermediate, on_gpu)
        if isinstance(series, list):  # the measurements before points could be measured again
            return [44000.0, *series[1:]]
        again = series.again
        series.values[0] = 44000.0
        series.again = lambda i: 44000.0 if i == 0 else again(i)
        return series
    monkeypatch.setattr(Measurements, "expert_curve", busy_at_one_token)
    out = tmp_path / "p.yaml"
    assert main(["profile", "--device", "cpu", "--model", "flame-moe-290m", "--quick", "--threads", "1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("moesim: error:")]
    assert len(error) == 1 and err.endswith(error[0] + "\n"), err
    assert error[0].startswith("moesim: error: field 'cpu.expert_ffn[0].time_us': CPU expert FFN flame-moe-290m ")
    assert ": 44000 µs at tokens 1 against " in error[0] and " µs at tokens 4, " in error[0]
    assert error[0].endswith("more than 4x apart after measuring them again 3 times; the loader would refuse "
                             "the profile, nothing written (fix: rerun on a quieter machine (other work inflates "
                             "single points), or with fewer --threads, e.g. --threads 1)")
    assert err.count("moesim: note: CPU expert FFN flame-moe-290m") >= 3 and "(3 of 3, 8x the samples)" in err
    assert not out.exists()


def test_a_last_point_inflated_once_is_measured_again_though_the_loader_would_take_it(monkeypatch, capsys):
    """A busy machine inflated a CPU expert curve's last points 370x over the point before (540 us at 64 tokens,
    200 ms at 128): no fall, so the loader took it, and a validate run then simulated +1199% TPOT. A time that
    grows more than TIME_RISE_LIMIT times faster than its tokens is measured again, and the fresh median kept."""
    real = Timer.host
    returned: list[float] = []

    def host(self, fn):
        seconds = 10.0 if len(returned) == 3 else real(self, fn)  # the 4th timing: the curve's last point
        returned.append(seconds)
        return seconds
    monkeypatch.setattr(Timer, "host", host)
    config = ProfileConfig(models=(tiny_model(),), device="cpu", threads=1, quick=True, name="busy")
    curve = measure_profile(config)["cpu"]["expert_ffn"][0]
    assert len(curve["time_us"]) == 4 and curve["time_us"][3] == _round(returned[4] * 1e6) < 1e6
    notes = [line.removeprefix("moesim: note: ") for line in capsys.readouterr().err.splitlines()]
    assert len(notes) == 1 and "measured tokens " in notes[0] and ", was 1e+07 µs" not in notes[0]
    assert notes[0].endswith("more than 4x faster than the work grows, which no kernel does)")
