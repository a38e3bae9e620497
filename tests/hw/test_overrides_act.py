"""Every ``hw.*`` override changes a metric or fails naming why (a parameter that changes nothing is a bug)."""

from __future__ import annotations

from typing import Any

import pytest

from moesim.analysis.metrics import metrics
from moesim.errors import ConfigError, ProfileError
from moesim.hw.profile import OPTIONAL_SCALARS, load_profile
from moesim.model.presets import load_preset
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize

SYSTEMS = ("cpu-only", "gpu-only-lru", "hybrimoe", "smoe", "ktransformers", "fiddler", "llamacpp")
WATCHED = ("ttft_ms", "tpot_ms_mean", "makespan_s", "pcie_h2d_bytes")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mx") / "mixtral.parquet"
    synthesize(SynthConfig.from_settings(model=load_preset("mixtral-8x7b"), requests=1, prompt_len=16,
                                         decode_len=3, batch=1, seed=0), path)
    return str(path)


def _keys(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted keys of a profile's fields: scalars, and curves or lists as one key each."""
    if isinstance(node, dict) and "source" not in node:
        out = []
        for key, value in node.items():
            if key == "sources" or value == {}:
                continue
            out += _keys(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    return [(prefix, node)]


def _changed(value: Any) -> str:
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):
        return "2" if value == 1 else "10" if value == 0 else str(max(1, value // 10))
    if isinstance(value, float):
        return "50" if value == 0 else str(value * 0.01)
    if value is None:
        return "4"
    if value in ("none", "decode_step", "kernel"):
        return "none" if value != "none" else "decode_step"
    return "changed"


def test_every_hw_key_acts_or_is_refused(mixtral):
    raw = load_profile("rtx4090").raw
    keys = _keys(raw) + [(k, 1.0) for k in sorted(OPTIONAL_SCALARS) if k.split(".")[1] not in raw[k.split(".")[0]]]
    base = {name: metrics(simulate(mixtral, "rtx4090", name)) for name in SYSTEMS}
    moved: dict[str, str] = {}
    for key, value in keys:
        setting = {f"hw.{key}": _changed(value)}
        try:
            for name in SYSTEMS:
                m = metrics(simulate(mixtral, "rtx4090", name, setting))
                if any(m[k] != base[name][k] for k in WATCHED):
                    moved[key] = name
                    break
        except (ProfileError, ConfigError) as error:
            assert str(error).count("\n") == 0
            moved[key] = "error"
        assert key in moved, f"hw.{key}={setting} changed no metric of {SYSTEMS} and raised no error"
    assert moved["gpu.name"] == moved["pcie.d2h"] == moved["cpu.numa_note"] == "error"
    assert moved["cpu.dram_bandwidth_gbps"] == "cpu-only"
    assert all(v != "error" for k, v in moved.items() if k.startswith("runtimes."))


@pytest.mark.parametrize("setting", [{"hw.cpu.dram_bandwidth_gbps": "10"}, {"hw.gpu.mem_bandwidth_gbps": "100"},
                                     {"hw.cpu.peak_tflops.avx2": "0.01"}])
def test_issue_overrides_change_cpu_only_tpot(mixtral, setting):
    """Before, curves were read as tabulated whatever the numbers they were derived from said."""
    base = metrics(simulate(mixtral, "rtx4090", "cpu-only"))["tpot_ms_mean"]
    assert metrics(simulate(mixtral, "rtx4090", "cpu-only", setting))["tpot_ms_mean"] > base


def test_derived_curve_is_recomputed_from_overridden_numbers():
    from moesim.hw.cost import CostModel
    model = load_preset("mixtral-8x7b")
    profile = load_profile("rtx4090")
    slow = profile.with_overrides({"cpu.dram_bandwidth_gbps": 10})
    # the curve is the roofline tabulated, so the overridden curve equals the overridden roofline
    costs = CostModel(slow, model)
    assert costs.cpu_expert(1) == pytest.approx(costs.cpu_roofline(1, "avx2"), rel=1e-3)
    assert costs.cpu_expert(1) == pytest.approx(3 * 4096 * 14336 * 2 / (10e9 * 0.716), rel=1e-3)
