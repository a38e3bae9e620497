"""Keeping a timeline draws a replay's work and changes none of its figures.

A sweep runs without a timeline and ``moesim replay`` / ``moesim.replay`` with one, so the same point must
give the same numbers either way, to the last bit: a decode layer's CPU experts were summed one by one
with a timeline and as one product without it, which moved ``smoe``'s makespan by about 1e-13.
"""

from __future__ import annotations

import pytest

from moesim.sim.run import prepare
from moesim.trace.synth import SynthConfig, synthesize

SETTINGS = {"memory.non_expert_dtype": "int4", "memory.expert_dtype": "int4"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("neutral")
    paths = {}
    for name, prompt, decode in (("decode", 24, 60), ("prefill", 96, 0)):
        path = folder / f"{name}.parquet"
        synthesize(SynthConfig.from_settings(model="deepseek-v3", requests=1, prompt_len=prompt, decode_len=decode,
                                             batch=1, seed=5, settings={}, scores=True), path)
        paths[name] = str(path)
    return paths


def figures(trace: str, system: str, timeline: bool) -> tuple:
    result = prepare(trace, "rtx4090", system, SETTINGS, timeline=timeline).run()
    steps = [(r.step, r.start, r.end) for r in result.steps]
    counters = {k: v for k, v in vars(result.counters).items()}
    return steps, counters


@pytest.mark.parametrize("system", ["cpu-only", "smoe", "smoe-flex", "ktransformers-ed", "dali", "hybrimoe",
                                    "fiddler", "gpu-only-lru", "importance"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_timeline_changes_no_figure(traces, system, phase):
    with_timeline = figures(traces[phase], system, timeline=True)
    without = figures(traces[phase], system, timeline=False)
    assert with_timeline[0] == without[0]  # every step's start and end, bit for bit
    assert with_timeline[1] == without[1]  # every counter and breakdown category
