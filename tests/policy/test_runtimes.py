"""Runtimes (001_66a328d79a3cae8d.txt Sec. 2.3, 3.3, 6.4): launches, CUDA Graph, CPU kernel efficiency."""

from __future__ import annotations

import pytest

from moesim.analysis.metrics import metrics
from moesim.errors import ProfileError
from moesim.hw.cost import CostModel
from moesim.hw.profile import load_profile
from moesim.model.presets import load_preset
from moesim.policy.systems import SYSTEMS
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize
from tests.factories import tiny_model, tiny_profile, write_tiny_trace


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds3.parquet"
    synthesize(SynthConfig.from_settings(model=load_preset("deepseek-v3"), requests=1, prompt_len=8,
                                         decode_len=4, batch=1, seed=0), path)
    return str(path)


def test_systems_name_their_papers_runtimes():
    assert SYSTEMS["ktransformers"].runtime == "ktransformers"
    assert SYSTEMS["fiddler"].runtime == "pytorch-eager"
    assert SYSTEMS["llamacpp"].runtime == "llamacpp"
    assert SYSTEMS["smoe"].runtime == "ktransformers-eager"  # 000 Sec. VI-A: KTransformers, no CUDA Graph
    assert SYSTEMS["cpu-only"].runtime == "generic"
    assert SYSTEMS["oracle"].runtime == "ideal"


def test_launch_costs_by_graph_mode():
    profile = load_profile("a100-40g")
    model = load_preset("deepseek-v3")
    kt = CostModel(profile, model, runtime_name="ktransformers")
    assert kt.launch_per_kernel("decode") == 0.0 and kt.step_launch("decode") == 0.0  # graph_launch_us 0
    assert kt.layer_launches("prefill") == pytest.approx(24 * 16e-6)
    llama = CostModel(profile, model, runtime_name="llamacpp")
    assert llama.layer_launches("decode") == pytest.approx(49 * 5e-6)
    with pytest.raises(ProfileError, match="no runtime"):
        CostModel(profile, model, runtime_name="vllm")


def test_cpu_efficiency_applies_to_the_binding_regime():
    profile = load_profile("a100-40g")
    model = load_preset("deepseek-v3")
    kt = CostModel(profile, model, runtime_name="ktransformers")
    pt = CostModel(profile, model, runtime_name="pytorch-eager")
    # one token: bandwidth-bound AVX-512; many tokens: compute-bound AMX (001 Sec. 3.2, 6.4)
    assert pt.cpu_expert(1) == pytest.approx(kt.cpu_expert(1) / 0.276, rel=1e-9)
    assert pt.cpu_expert(512) == pytest.approx(kt.cpu_expert(512) / 0.251, rel=1e-9)


def test_ktransformers_graph_makes_decode_faster_than_cpu_only(deepseek):
    """Before runtimes, ktransformers and cpu-only were byte-identical on every profile."""
    kt = metrics(simulate(deepseek, "a100-40g", "ktransformers"))
    cpu = metrics(simulate(deepseek, "a100-40g", "cpu-only"))
    # the same eager prefill; decode without 24 launches of 16 us per layer (58 MoE + 3 dense layers)
    assert kt["ttft_ms"] == pytest.approx(cpu["ttft_ms"], rel=1e-9)
    assert cpu["tpot_ms_mean"] - kt["tpot_ms_mean"] == pytest.approx(61 * 24 * 16e-3, rel=1e-6)
    assert 1.0 < cpu["tpot_ms_mean"] / kt["tpot_ms_mean"] <= 1.23  # 001 Sec. 6.4: CUDA Graph up to 1.23x


def test_ktransformers_beats_fiddler_and_llamacpp_in_decode(deepseek):
    """001 Sec. 6.2: 2.42-4.09x over Fiddler and 1.25-1.76x over llama.cpp in decode (full precision)."""
    kt = metrics(simulate(deepseek, "a100-40g", "ktransformers"))["tpot_ms_mean"]
    fiddler = metrics(simulate(deepseek, "a100-40g", "fiddler"))["tpot_ms_mean"]
    llama = metrics(simulate(deepseek, "a100-40g", "llamacpp"))["tpot_ms_mean"]
    assert 2.42 <= fiddler / kt <= 4.09
    assert 1.25 <= llama / kt <= 1.76


def test_runtime_setting_swaps_it(deepseek):
    kt = metrics(simulate(deepseek, "a100-40g", "ktransformers"))
    eager = metrics(simulate(deepseek, "a100-40g", "ktransformers", {"runtime": "pytorch-eager"}))
    assert eager["tpot_ms_mean"] > 2 * kt["tpot_ms_mean"]


def test_profile_without_runtimes_falls_back_to_generic_and_says_so(tmp_path):
    model = tiny_model(layers=1, experts=4, top_k=1)
    path = write_tiny_trace(tmp_path / "t.parquet", model, [{"phase": "decode", "tokens": {0: (0, [[[0]]])}}])
    result = simulate(str(path), tiny_profile(), "ktransformers")
    assert any("runtime ktransformers" in f for f in result.cost_fallbacks)


def test_cpu_efficiency_for_a_kernel_the_cpu_lacks_is_refused():
    data = load_profile("rtx4090").raw
    import copy
    data = copy.deepcopy(data)
    data["runtimes"]["llamacpp"]["cpu_compute_efficiency"] = {"amx": 0.5}
    from moesim.hw.profile import parse_profile
    with pytest.raises(ProfileError, match="no 'amx' kernel"):
        parse_profile(data, origin="x.yaml")
