"""`trace synth --fit`: the generator's parameters fitted to a real trace reproduce its statistics."""

from __future__ import annotations

from pathlib import Path

import pytest

from moesim.cli import main
from moesim.trace.io import read_meta
from moesim.trace.stats import trace_stats
from moesim.trace.synth import FIT_TARGETS, SynthConfig, fit_params, synthesize, trace_shape

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "traces" / "mixtral-8x7b-humaneval.parquet"
MODELLED = [stat for stat, _ in FIT_TARGETS]


def within(stats: dict, target: dict, tolerance: float) -> dict[str, float]:
    """Relative errors above ``tolerance`` (empty when every modelled statistic is close)."""
    errors = {k: abs(stats[k] - v) / abs(v) for k, v in target.items()}
    return {k: e for k, e in errors.items() if e > tolerance}


@pytest.mark.slow
def test_fit_to_the_bundled_mixtral_trace(tmp_path):
    real = trace_stats(REAL)
    result = fit_params(REAL)
    assert set(result.target) == set(MODELLED)
    assert not within(result.fitted, result.target, 0.05)
    # a trace written with the fitted parameters and another seed: the statistics hold, not one draw
    config = SynthConfig.from_settings(model=str(real["model"]), seed=7, settings=result.settings(),
                                       **trace_shape(real))
    synthetic = trace_stats(synthesize(config, tmp_path / "fit.parquet"))
    assert not within(synthetic, {k: real[k] for k in MODELLED}, 0.20)


@pytest.mark.slow
def test_fit_recovers_a_known_generator(tmp_path):
    """Fitted to a synthetic trace of known, far-from-default parameters, the fit reaches its statistics."""
    truth = {"skew_first": "0.6", "skew_last": "1.2", "token_corr": "0.8", "cluster_strength": "0.4",
             "score_scale": "3.0"}
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=2, prompt_len=40, decode_len=120, seed=3,
                                       settings=truth)
    known = synthesize(config, tmp_path / "known.parquet")
    default = trace_stats(synthesize(SynthConfig.from_settings(model="mixtral-8x7b", requests=2, prompt_len=40,
                                                               decode_len=120, seed=3), tmp_path / "d.parquet"))
    target = trace_stats(known)
    assert within(default, {k: target[k] for k in MODELLED}, 0.20)  # the defaults do not already match
    result = fit_params(known)
    assert not within(result.fitted, result.target, 0.05)
    # reuse is mostly the token correlation; the other statistics share their parameters (score_scale
    # and cluster_strength both spread the scores), so only their statistics are held to
    assert result.params.token_corr == pytest.approx(0.8, abs=0.1)


def test_shape_of_a_trace():
    stats = {"requests": 2, "tokens_by_phase": {"prefill": 135, "decode": 338}, "steps": {"decode": 338}}
    assert trace_shape(stats) == {"requests": 2, "prompt_len": 68, "decode_len": 169, "batch": 1}
    batched = {"requests": 4, "tokens_by_phase": {"prefill": 40, "decode": 400}, "steps": {"decode": 100}}
    assert trace_shape(batched)["batch"] == 4
    long = {"requests": 1, "tokens_by_phase": {"prefill": 4000, "decode": 4000}, "steps": {"decode": 4000}}
    shape = trace_shape(long)
    assert shape["prompt_len"] == shape["decode_len"] == 512  # scaled down, proportions kept


@pytest.mark.slow
def test_cli_fit_writes_a_trace_that_records_its_source(tmp_path, capsys):
    out = tmp_path / "fit.parquet"
    assert main(["trace", "synth", "--fit", str(REAL), "--decode-len", "20", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "top10_share" in printed and "reuse_prev_token" in printed
    source = read_meta(out).source
    stats = trace_stats(out)
    assert stats["model"] == "mixtral-8x7b" and stats["requests"] == 2
    assert stats["tokens_by_phase"]["decode"] == 40  # --decode-len wins over the fitted shape
    assert source["fitted_to"] == str(REAL) and source["params"]["token_corr"] < 0.5


def test_a_fit_to_a_trace_of_some_layers_says_what_it_could_not_see(tmp_path):
    """An importer's per-layer log holds one layer: the fit matches it with the mean over every synthetic
    layer, and says so, since how skew grows over the layers is not in the trace."""
    from tests.factories import write_partial_trace
    partial = write_partial_trace(tmp_path / "l1.parquet", [1], num_layers=3, steps=6, requests=2)
    whole = write_partial_trace(tmp_path / "all.parquet", [0, 1, 2], num_layers=3, steps=6, requests=2)
    said = "the trace logs 1 of the model's 3 MoE layers: the fit matches their statistics with the mean over all 3"
    assert any(said in note for note in fit_params(partial, rounds=1, steps=1).notes)
    assert not any("MoE layers" in note for note in fit_params(whole, rounds=1, steps=1).notes)
