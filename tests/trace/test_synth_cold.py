"""Cold experts (``cold_fraction``): a tail of experts a whole prefill batch leaves (nearly) unused, and the
``prefill_coverage`` statistic the fit matches with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from moesim.model.presets import load_preset
from moesim.trace.io import read_meta
from moesim.trace.stats import trace_stats
from moesim.trace.synth import COLD_OFFSET, SynthConfig, SynthParams, cold_experts, fit_params, synthesize
from moesim.trace.synth_routing import Layout

ROOT = Path(__file__).resolve().parents[2]
#: the Qwen3-30B-A3B calibration trace (soryxie token_distri_8, see traces/README.md)
QWEN3_CALIBRATION = ROOT / "traces" / "qwen3-30b-a3b-prefill.parquet"


def test_cold_experts_are_a_whole_number_of_the_least_popular_ranks():
    model = load_preset("mixtral-8x7b")  # 8 experts per layer
    params = SynthParams.for_model(model)
    warm = Layout.draw(model, params, np.random.default_rng(0))
    cold = Layout.draw(model, dataclasses.replace(params, cold_fraction=0.25), np.random.default_rng(0))
    lowered = warm.log_pop - cold.log_pop
    # 0.25 of 8 = 2 experts per layer, each exactly COLD_OFFSET below the Zipf profile, the other 6 untouched
    assert np.isclose(lowered, COLD_OFFSET).sum(axis=1).tolist() == [2] * model.num_layers
    assert np.isclose(lowered[~np.isclose(lowered, COLD_OFFSET)], 0).all()
    # the two of each layer that were already the least popular
    least = np.argsort(warm.log_pop, axis=1)[:, :2]
    assert np.isclose(np.take_along_axis(lowered, least, axis=1), COLD_OFFSET).all()
    assert (cold_experts(0.25, 8), cold_experts(0.06, 8), cold_experts(0.07, 8), cold_experts(1.0, 8)) == (2, 0, 1, 8)


def test_cold_experts_lower_the_prefill_coverage_and_are_recorded(tmp_path):
    """A 512-token Qwen3 prefill step reaches nearly every expert at the defaults; with a quarter of the
    experts cold (32 of 128) it reaches no more than the 96 warm ones and a stray cold one now and then."""
    args = dict(model="qwen3-30b-a3b", requests=1, prompt_len=512, decode_len=0, seed=0)
    plain = synthesize(SynthConfig.from_settings(**args), tmp_path / "plain.parquet")
    cold = synthesize(SynthConfig.from_settings(**args, settings={"cold_fraction": "0.25"}), tmp_path / "c.parquet")
    before, after = trace_stats(plain), trace_stats(cold)
    assert before["unique_experts_per_layer_step"]["prefill"] > 120
    assert 90 < after["unique_experts_per_layer_step"]["prefill"] <= 97
    assert after["prefill_coverage"] < 0.77 < before["prefill_coverage"]
    # the metadata names the parameter when it is set, and leaves it out at 0 (so older traces keep their bytes)
    assert read_meta(cold).source["params"]["cold_fraction"] == 0.25
    assert "cold_fraction" not in read_meta(plain).source["params"]


def test_cold_fraction_outside_its_range_is_refused():
    from moesim.errors import ConfigError
    with pytest.raises(ConfigError, match="cold_fraction"):
        synthesize(SynthConfig.from_settings(model="mixtral-8x7b", settings={"cold_fraction": "1.5"}),
                   Path("/nonexistent/never-written.parquet"))


@pytest.mark.slow
def test_fit_reaches_the_prefill_coverage_of_the_qwen3_calibration_trace(tmp_path):
    """The real 2,050-token batch reaches 110.3 of 128 experts per layer (coverage 0.862); before cold experts
    existed the fitted trace reached 127.9 (0.999, 16% off)."""
    result = fit_params(QWEN3_CALIBRATION)
    target = result.target["prefill_coverage"]
    assert target == pytest.approx(0.862, abs=0.001)
    assert abs(result.fitted["prefill_coverage"] - target) <= 0.05 * target
    assert 0.08 <= result.params.cold_fraction <= 0.2
    # the candidates were 1,024 tokens long; the trace written at the real length holds the coverage
    config = SynthConfig(model=read_meta(QWEN3_CALIBRATION).model, seed=1, scores=False, params=result.params,
                         requests=1, prompt_len=2050, decode_len=0)
    full = trace_stats(synthesize(config, tmp_path / "full.parquet"))
    assert abs(full["prefill_coverage"] - target) <= 0.05 * target
