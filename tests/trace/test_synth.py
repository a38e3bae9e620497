"""Synthetic traces: determinism, validity, shape, realism and calibration against real logs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.trace.io import iter_steps, read_meta, read_table
from moesim.trace.stats import trace_stats
from moesim.trace.synth import SynthConfig, anchor_defaults, synthesize
from moesim.trace.validate import validate_trace

REPO = Path(__file__).resolve().parents[2]
SPECULATIVE_MOE = REPO.parent / "shared" / "real-traces" / "speculative-moe"


def small(tmp_path, name="t.parquet", **kw):
    args = dict(model="mixtral-8x7b", requests=3, prompt_len=5, decode_len=6, batch=2, seed=0)
    args.update(kw)
    return synthesize(SynthConfig.from_settings(**args), tmp_path / name)


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path):
    a = small(tmp_path, "a.parquet").read_bytes()
    b = small(tmp_path, "b.parquet").read_bytes()
    c = small(tmp_path, "c.parquet", seed=1).read_bytes()
    assert a == b
    assert a != c


def test_trace_is_valid_and_has_the_expected_shape(tmp_path):
    path = small(tmp_path)
    summary = validate_trace(path)
    # rows = requests * (prompt + decode) * layers; steps = one prefill per request + decode per group
    assert summary.rows == 3 * (5 + 6) * 32
    assert summary.steps == 3 + 2 * 6
    table = read_table(path)
    assert set(table.column_names) >= {"weights", "scores", "token_id", "pred_next_layer",
                                       "pred_residual", "pred_next_token"}
    meta = read_meta(path)
    assert meta.weights_renormalized is True and meta.source["kind"] == "synthetic"
    s = trace_stats(path)
    assert s["steps"] == {"prefill": 3, "decode": 6 + 6}
    assert s["tokens_by_phase"] == {"prefill": 15, "decode": 18}
    assert s["unique_experts_per_layer_step"]["decode"] > 2  # batches of 2 requests, top-2


def test_experts_are_the_top_k_scores_in_descending_order(tmp_path):
    path = small(tmp_path)
    for step in iter_steps(path):
        scores = step.scores.astype(np.float32)
        routed = np.take_along_axis(scores, step.experts.astype(np.int64), axis=1)
        assert (np.diff(routed, axis=1) <= 0).all()
        kth = routed[:, -1]
        others = scores.copy()
        np.put_along_axis(others, step.experts.astype(np.int64), -1.0, axis=1)
        assert (others.max(axis=1) <= kth).all()
        assert np.allclose(scores.sum(axis=1), 1.0, atol=0.02)
        assert np.allclose(step.weights.sum(axis=1), 1.0, atol=1e-5)  # Mixtral renormalizes top-2


def test_prediction_columns_have_the_configured_recall(tmp_path):
    settings = {"recall_next_layer": "0.5", "recall_residual": "0.9", "recall_next_token": "0.7"}
    path = small(tmp_path, requests=4, prompt_len=40, decode_len=60, settings=settings, scores=False)
    recall = trace_stats(path)["predictor_recall"]
    # about 8,000 predicted experts per column: sampling error well under 0.03
    assert recall["pred_next_layer"] == pytest.approx(0.5, abs=0.03)
    assert recall["pred_residual"] == pytest.approx(0.9, abs=0.03)
    assert recall["pred_next_token"] == pytest.approx(0.7, abs=0.03)


def test_skew_grows_with_depth(tmp_path):
    path = small(tmp_path, model="qwen3-30b-a3b", requests=4, prompt_len=64, decode_len=32, scores=False)
    top10 = trace_stats(path)["top10_share_by_layer"]
    quarter = len(top10) // 4
    assert top10[-1] > top10[0]
    assert np.mean(top10[-quarter:]) > 1.3 * np.mean(top10[:quarter])


def test_defaults_follow_expert_granularity():
    coarse, fine = anchor_defaults(8, 2), anchor_defaults(128, 8)
    assert anchor_defaults(256, 8) == fine  # clamped beyond the finest calibrated model
    mid = anchor_defaults(64, 8)  # E/k = 8: halfway in log2 between 4 and 16
    assert mid["skew_last"] == pytest.approx((coarse["skew_last"] + fine["skew_last"]) / 2, abs=1e-3)


def test_unknown_setting_is_a_config_error_listing_valid_keys():
    with pytest.raises(ConfigError, match="valid keys: .*recall_next_layer.*skew_first"):
        SynthConfig.from_settings(model="mixtral-8x7b", settings={"skew": "1"})
    with pytest.raises(ConfigError, match="token_corr"):
        SynthConfig.from_settings(model="mixtral-8x7b", settings={"token_corr": "2"})


def test_cli_synth_writes_a_trace_and_rejects_bad_settings(tmp_path, capsys):
    out = tmp_path / "cli.parquet"
    code = main(["trace", "synth", "--model", "mixtral-8x7b", "--requests", "2", "--prompt-len", "4",
                 "--decode-len", "3", "--seed", "7", "--set", "cluster_size=4", "--no-scores", "--out", str(out)])
    assert code == 0
    assert validate_trace(out).rows == 2 * 7 * 32
    assert "scores" not in read_table(out).column_names
    assert read_meta(out).source["params"]["cluster_size"] == 4
    bad = tmp_path / "bad.parquet"
    assert main(["trace", "synth", "--model", "mixtral-8x7b", "--set", "nope=1", "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown generator parameter 'nope'" in err and "valid keys" in err
    assert not bad.exists()
    assert main(["trace", "synth", "--model", "mixtral-8x7b", "--set", "skew_first=high", "--out", str(bad)]) == 2
    assert "is not a float" in capsys.readouterr().err


def test_compare_synthetic_traces(tmp_path, capsys):
    a, b = small(tmp_path, "a.parquet"), small(tmp_path, "b.parquet", seed=3)
    assert main(["trace", "compare", str(a), str(b)]) == 0
    assert "top-10% share (mean)" in capsys.readouterr().out


def test_deepseek_v3_decode_shape(tmp_path):
    """A DeepSeek-V3 decode has every layer and step (its speed: benchmarks/synth_speed.py)."""
    config = SynthConfig.from_settings(model="deepseek-v3", requests=1, prompt_len=1, decode_len=50)
    path = synthesize(config, tmp_path / "ds.parquet")
    assert read_meta(path).model.num_layers == 58
    table = pq.read_table(path, columns=["step", "layer"])
    assert table.num_rows == 51 * 58


# ----------------------------------------------------------------------------- calibration
def _imported(name: str, tmp_path: Path) -> dict:
    importers = pytest.importorskip("moesim.trace.importers", reason="trace importers not available")
    source = SPECULATIVE_MOE / name
    if not source.exists():
        pytest.skip(f"{source} not found (../shared/real-traces next to the repository)")
    out = tmp_path / f"{source.stem}.parquet"
    importers.import_trace("speculative-moe", [source], out)
    return trace_stats(out)


@pytest.mark.parametrize("name", ["humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl"])
def test_mixtral_defaults_match_real_skew_and_reuse_within_20_percent(name, tmp_path):
    """humaneval is a calibration file; gsm8k is validation only (never used to choose defaults)."""
    real = _imported(name, tmp_path)
    per_request = real["tokens"] // real["requests"]
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=real["requests"], prompt_len=1,
                                       decode_len=per_request - 1, seed=0, scores=False)
    synth = trace_stats(synthesize(config, tmp_path / "synth.parquet"))
    for key in ("top10_share", "reuse_prev_token"):
        assert synth[key] == pytest.approx(real[key], rel=0.2), key


#: every numeric generator parameter with its documented range on mixtral-8x7b (8 experts): (low, high, low allowed)
RANGES = {"skew_first": (0, 100, True), "skew_last": (0, 100, True), "request_bias": (0, 100, True),
          "cluster_size": (0, 8, True), "cluster_strength": (0, 100, True), "token_corr": (0, 1, True),
          "score_scale": (0, 100, False), "recall_next_layer": (0, 1, True), "recall_residual": (0, 1, True),
          "recall_next_token": (0, 1, True), "cold_fraction": (0, 1, True)}


def _bad_values(name: str) -> list[str]:
    low, high, low_allowed = RANGES[name]
    below = str(low) if not low_allowed else str(low - 1 if name == "cluster_size" else low - 0.01)
    above = str(high + 1) if name == "cluster_size" else str(high * 1.01)
    return ["nan", "inf", "-inf", below, above, "1e308" if high > 1 else "-1e308"]


def test_every_numeric_parameter_has_a_range():
    import dataclasses

    from moesim.trace.synth import SynthParams
    numeric = {f.name for f in dataclasses.fields(SynthParams) if f.type in ("float", "int")}
    assert numeric == set(RANGES)


@pytest.mark.parametrize("name, value", [(n, v) for n in RANGES for v in _bad_values(n)])
def test_cli_synth_refuses_a_parameter_outside_its_range(tmp_path, capsys, name, value):
    out = tmp_path / "syn.parquet"
    code = main(["trace", "synth", "--model", "mixtral-8x7b", "--requests", "1", "--prompt-len", "2",
                 "--decode-len", "2", "--set", f"{name}={value}", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"field '{name}'" in err
    low, high, low_allowed = RANGES[name]
    if name != "cluster_size" or value not in ("nan", "inf", "-inf", "1e308"):  # not an int: a parse error
        assert f"{'[' if low_allowed else '('}{low:g}, {high:g}]" in err.split("(fix:")[1]  # the range, in the fix
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, value", [("skew_first", "0"), ("skew_last", "100"), ("score_scale", "100"),
                                         ("request_bias", "100"), ("cluster_strength", "0"), ("token_corr", "1"),
                                         ("cluster_size", "8"), ("recall_residual", "0"),
                                         ("cold_fraction", "1")])
def test_synth_accepts_the_ends_of_each_range(tmp_path, name, value):
    path = small(tmp_path, settings={name: value})
    assert validate_trace(path).rows == 3 * 11 * 32
    table = read_table(path, ["weights"]).column("weights").combine_chunks()
    assert np.isfinite(table.flatten().to_numpy()).all()


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_score_scale_sharpens_the_scores_and_leaves_the_routing(tmp_path, model):
    """score_scale multiplies the logits inside the score softmax. At 100 most scores round to 0 in float16;
    the routed experts among them were taken in index order (on Mixtral, expert 0 got 45% of all activations
    instead of 12%), so the parameter the fit uses for the top-1 weight share also moved skew and reuse."""
    def routing(scale: float) -> tuple[np.ndarray, dict]:
        path = small(tmp_path, f"s{scale}.parquet", model=model, requests=2, prompt_len=16, decode_len=32,
                     settings={"score_scale": scale, "predictors": False})
        experts = np.stack(read_table(path, columns=["experts"]).column("experts").to_numpy(zero_copy_only=False))
        return experts, trace_stats(path)
    plain, plain_stats = routing(1.0)
    sharp, sharp_stats = routing(100.0)
    same_set = (np.sort(plain, axis=1) == np.sort(sharp, axis=1)).all(axis=1)
    assert same_set.mean() > 0.99
    for stat in ("top10_share", "reuse_prev_token", "coactivation_top4_share"):
        assert sharp_stats[stat] == pytest.approx(plain_stats[stat], abs=0.01)
    assert sharp_stats["weight_top1_share"] > plain_stats["weight_top1_share"] + 0.1


def test_synthesize_reports_every_row_it_writes(tmp_path):
    from moesim.trace.synth import synth_rows
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=3, prompt_len=4, decode_len=70, batch=2,
                                       settings={"predictors": False}, scores=False)
    written: list[int] = []
    synthesize(config, tmp_path / "s.parquet", progress=written.append)
    assert len(written) > 1 and sum(written) == synth_rows(config) == 3 * 74 * 32


@pytest.mark.parametrize("settings, shape, field, words", [
    ({"cluster_size": 2.5}, {}, "cluster_size", "2.5 is not an int"),  # was cut to 2
    ({"renormalize": 0.5}, {}, "renormalize", "0.5 is not a bool"),  # was read as true
    ({"predictors": 2}, {}, "predictors", "2 is not a bool"),
    ({"skew_first": True}, {}, "skew_first", "True is not a float"),
    ({"cluster_size": "2.5"}, {}, "cluster_size", "'2.5' is not an int"),  # text, as --set gives it
    ({}, {"requests": "2"}, "requests", "whole number, got '2'"),  # was a TypeError
    ({}, {"decode_len": 1.5}, "decode_len", "whole number, got 1.5"),
])
def test_settings_of_another_type_are_refused_not_converted(settings, shape, field, words):
    with pytest.raises(ConfigError, match=words) as raised:
        SynthConfig.from_settings(model="mixtral-8x7b", settings=settings, **shape)
    assert raised.value.field == field


def test_settings_given_as_python_values_of_their_type_are_taken():
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=np.int64(2), settings={
        "cluster_size": 4.0, "predictors": 0, "renormalize": np.bool_(False), "skew_first": 1})
    params = config.params
    assert (params.cluster_size, params.predictors, params.renormalize, params.skew_first) == (4, False, False, 1.0)
    assert type(params.cluster_size) is int and type(config.requests) is int and config.requests == 2


def test_requests_of_one_length_are_synthesized_without_a_list_of_every_request(tmp_path, monkeypatch):
    """config.prompts() and decodes() list every request's length, held for the whole run: 1 GB for
    `trace synth --requests 50000000 --prompt-len 1`. Lengths given per request still go by their lists."""
    from moesim.trace.synth import synth_rows
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=3, prompt_len=5, decode_len=6, batch=2)
    listed = SynthConfig.from_settings(model="mixtral-8x7b", requests=3, prompt_lens=[5, 5, 5], decode_lens=[6, 6, 6],
                                       batch=2)

    def refuse(self):
        raise AssertionError("a list of every request's length")
    monkeypatch.setattr(SynthConfig, "prompts", refuse)
    monkeypatch.setattr(SynthConfig, "decodes", refuse)
    assert synth_rows(config) == synth_rows(listed) == 3 * 11 * 32
    a, b = synthesize(config, tmp_path / "a.parquet"), synthesize(listed, tmp_path / "b.parquet")
    assert read_table(a).equals(read_table(b))
