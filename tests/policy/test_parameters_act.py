"""Every ``--set`` parameter of every catalogue system's components changes a metric (a parameter that
changes nothing is a bug).

Each (system, parameter) pair is replayed with its default and with other values until one changes a
metric. The scene is a small DeepSeek-V3 trace on ``rtx4090`` with int4 weights (a few experts per layer
fit); a parameter that acts only under other conditions is tried under the ones :data:`CONDITIONS` gives,
with the reason it is inert in the default scene.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from moesim.analysis.metrics import metrics
from moesim.errors import ConfigError
from moesim.model.presets import load_preset
from moesim.policy.base import coerce
from moesim.policy.systems import COMPONENTS, SYSTEMS
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize

#: each scene's settings: DeepSeek-V3 in int4 holds a few experts per layer on rtx4090; Mixtral keeps its
#: trace's bf16 experts (in int4 all of them would fit, and nothing would be loaded or substituted)
SCENES = {"deepseek": {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}, "mixtral": {}}
#: metrics that say nothing about the schedule
UNWATCHED = ("sim_wall_s", "notes", "system", "cost_fallbacks")

#: (system, parameter) -> (trace, extra settings, why the default scene cannot show it)
CONDITIONS: dict[tuple[str, str], tuple[str, dict[str, str], str]] = {
    ("buddymoe", "substitute.alpha"): (
        "mixtral", {}, "with 256 experts the smoothed co-activation shares are nearly even, so every "
        "alpha needs more than k_max buddies; with Mixtral's 8 the CFT sets the list length"),
    ("smoe", "assign.decode_on_demand"): (
        "deepseek", {"hw.cpu.cores": "2"}, "a decode load wins only where the CPU's expert time exceeds "
        "the copy's; ten cores are faster than the link"),
    ("smoe-flex", "assign.decode_on_demand"): (
        "deepseek", {"hw.cpu.cores": "2"}, "as for smoe"),
    ("smoe", "prefetch.calibration"): (
        "deepseek", {"prefetch.flex_off_fraction": "0.5"}, "only SMoE-Flex ranks layers"),
    ("smoe", "prefetch.warmup"): (
        "deepseek", {"prefetch.flex_off_fraction": "0.5"}, "only SMoE-Flex ranks layers"),
    ("ktransformers", "cache.calibration"): (
        "deepseek", {"cache.per_layer": "2"}, "with per_layer=0 (001's runs) no expert is static: nothing to rank"),
    ("ktransformers-ed", "cache.calibration"): (
        "deepseek", {"cache.per_layer": "2"}, "as for ktransformers"),
}
#: parameters whose other values cannot be derived from the default's type
EXPLICIT = {
    # every MoE layer's experts on the CPU (the default fills the GPU): llama.cpp counts blocks, DeepSeek-V3's 3 dense
    # and 58 MoE ones
    "cache.n_cpu_moe": ["61"],
    "prefetch.eviction": ["adaptive"],
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("act")
    out = {}
    for name, model, seed in (("deepseek", "deepseek-v3", 0), ("mixtral", "mixtral-8x7b", 0),
                              ("calibration-deepseek", "deepseek-v3", 7), ("calibration-mixtral", "mixtral-8x7b", 7)):
        path = folder / f"{name}.parquet"
        synthesize(SynthConfig.from_settings(model=load_preset(model), requests=2, prompt_len=16,
                                             decode_len=24, batch=2, seed=seed), path)
        out[name] = str(path)
    return out


def _cases() -> list[tuple[str, str, Any]]:
    cases = []
    for name, spec in SYSTEMS.items():
        if spec.portfolio or not spec.listed:
            continue
        own = dict(spec.defaults)
        for role, component in spec.roles().items():
            for param, default in COMPONENTS[role][component].parameters().items():
                key = f"{role}.{param}"
                cases.append((name, key, coerce(own[key], default, key) if key in own else default))
    return cases


def _alternates(key: str, default: Any, calibration: str) -> list[str]:
    if key in EXPLICIT:
        return EXPLICIT[key]
    if key.endswith(".calibration"):
        return ["none", calibration] if default == "others" else [calibration]
    if isinstance(default, bool):
        return [str(not default).lower()]
    if isinstance(default, int):
        values = [default * 2 if default > 0 else 4, default + 1, 0, 1]
    elif isinstance(default, float):
        values = [default * 2 if default > 0 else 0.5, default / 2, 0.0, 0.9]
    else:
        return []
    return [str(v) for v in dict.fromkeys(values) if v != default]


def _schedule(scene: str, trace: str, system: str, settings: dict[str, str]) -> str:
    """The watched metrics as canonical JSON (NaN, e.g. the precision of no prefetches, equals itself)."""
    result = metrics(simulate(trace, "rtx4090", system, {**SCENES[scene], **settings}))
    return json.dumps({k: v for k, v in result.items() if k not in UNWATCHED}, sort_keys=True, default=str)


def acts(scene: str, trace: str, system: str, key: str, values: list[str], extra: dict[str, str]
         ) -> tuple[bool, list[str]]:
    """Whether one of ``values`` for ``key`` changes a metric; the values tried or refused, for the message."""
    base = _schedule(scene, trace, system, extra)
    tried = []
    for value in values:
        try:
            changed = _schedule(scene, trace, system, {**extra, key: value})
        except ConfigError as error:
            tried.append(f"{value} (refused: {error})")
            continue
        tried.append(value)
        if changed != base:
            return True, tried
    return False, tried


@pytest.mark.parametrize("system,key,default", _cases(), ids=lambda v: str(v))
def test_parameter_changes_a_metric(traces, system, key, default):
    scene, extra, _ = CONDITIONS.get((system, key), ("deepseek", {}, ""))
    values = _alternates(key, default, traces[f"calibration-{scene}"])
    assert values, f"{system} {key}: no other value to try (default {default!r}); add it to EXPLICIT"
    changed, tried = acts(scene, traces[scene], system, key, values, extra)
    assert changed, f"{system} {key} (default {default!r}) changed no metric with {tried}"


def test_the_check_sees_a_setting_that_changes_nothing(traces):
    """Recording the timeline must not move the schedule: the check says so rather than passing anything."""
    changed, tried = acts("deepseek", traces["deepseek"], "gpu-only-lru", "engine.timeline", ["true"], {})
    assert not changed and tried == ["true"]


def test_every_condition_names_a_real_parameter():
    cases = {(system, key) for system, key, _ in _cases()}
    assert set(CONDITIONS) <= cases


@pytest.mark.parametrize("system,key", sorted(CONDITIONS), ids=lambda v: str(v))
def test_each_condition_is_needed(traces, system, key):
    """The default scene really shows nothing for a parameter given other conditions (so its reason holds)."""
    default = next(d for s, k, d in _cases() if (s, k) == (system, key))
    values = _alternates(key, default, traces["calibration-deepseek"])
    changed, tried = acts("deepseek", traces["deepseek"], system, key, values, {})
    assert not changed, f"{system} {key} acts in the default scene with {tried}: drop its CONDITIONS entry"
