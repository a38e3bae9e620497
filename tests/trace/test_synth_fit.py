"""`trace synth --fit`: the generator's parameters fitted to a real trace reproduce its statistics."""

from __future__ import annotations

import os
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
    # eight experts: one cold expert is too coarse a step of the prefill coverage to fit it (it stays 0, as
    # this trace's 1.0 coverage asks anyway)
    assert set(result.target) == set(MODELLED) - {"prefill_coverage"} and result.params.cold_fraction == 0
    assert any(note.startswith("prefill_coverage not fitted: a cold expert is 1/8") for note in result.notes)
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
    assert trace_shape(long) == {"requests": 1, "prompt_len": 4000, "decode_len": 4000, "batch": 1}  # unscaled
    from moesim.trace.synth import fit_lengths
    # what the fit's candidate traces hold: each request scaled down to 1,024 tokens in all, proportions kept
    assert fit_lengths([4000], [4000]) == ([512], [512])
    # x 1024/1300: 600 -> 472.6, 400 -> 315.1, 200 -> 157.5 (rounds to even), 100 -> 78.8
    assert fit_lengths([600, 400], [200, 100]) == ([473, 315], [158, 79])
    assert fit_lengths([1, 30], [0, 2]) == ([1, 30], [0, 2])  # within 1,024 tokens: as they are


def test_cli_fit_to_a_long_trace_writes_the_real_lengths(tmp_path, capsys, monkeypatch):
    """Two requests of 600 + 200 and 400 + 100 tokens, 1,300 tokens. The fit compares candidates scaled to 1,024
    tokens, x 1024/1300: prompts 473 and 315, decodes 158 and 79; the trace written has the real lengths,
    request by request (it had 788 and 236 tokens, the candidates' shape, then the means 500 and 150 for
    every request)."""
    import functools

    import numpy as np

    import moesim.trace.synth
    from tests.factories import tiny_model, write_tiny_trace
    from tests.sim.test_serving import request_routing
    # the shape is the point here, not the fit's quality: one bisection step of each parameter
    monkeypatch.setattr(moesim.trace.synth, "fit_params",
                        functools.partial(moesim.trace.synth.fit_params, rounds=1, steps=1))
    model = tiny_model(layers=2, experts=6, top_k=2)
    real = write_tiny_trace(tmp_path / "real.parquet", model,
                            request_routing(np.random.default_rng(0), model, [(600, 200), (400, 100)]))
    out = tmp_path / "like.parquet"
    assert main(["trace", "synth", "--fit", str(real), "--no-scores", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    stats = trace_stats(out)
    assert (stats["requests"], stats["tokens_by_phase"]) == (2, {"prefill": 1000, "decode": 300})
    assert trace_shape(trace_stats(real)) == {"requests": 2, "prompt_len": 500, "decode_len": 150, "batch": 1}
    assert ("note: the candidate traces the fit compared have the real requests' lengths scaled down to 1,024 "
            "tokens in all to keep the fit quick: prompts of 315-473 tokens and 79-158 decode tokens per request, "
            "for the real 400-600 and 100-200; the trace written has the real lengths") in printed
    from tests.trace.test_synth_lengths import tokens_by_request
    assert tokens_by_request(out) == {0: {"prefill": 600, "decode": 200}, 1: {"prefill": 400, "decode": 100}}
    # a length given on the command line still wins over the fitted one, the other stays each request's own
    assert main(["trace", "synth", "--fit", str(real), "--no-scores", "--prompt-len", "20", "--out",
                 str(out)]) == 0
    assert tokens_by_request(out) == {0: {"prefill": 20, "decode": 200}, 1: {"prefill": 20, "decode": 100}}


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


def test_every_statistic_the_fit_misses_past_its_tolerance_is_noted():
    """One short round misses several statistics by 5-30%: each miss past the fit's 5% gets a note with its
    size (only misses past 20% had one), and a statistic within 5% none."""
    result = fit_params(REAL, rounds=1, steps=1)
    errors = result.relative_errors()
    missed = {stat for stat, error in errors.items() if error > 0.05}
    assert any(0.05 < error <= 0.20 for error in errors.values())  # the case the notes left out
    noted = {note.split(":")[0] for note in result.notes if "the fit stops at 5%" in note}
    assert noted == missed
    for stat in missed:
        assert any(note.startswith(f"{stat}:") and f"{errors[stat]:.1%} off" in note for note in result.notes)


def test_a_fit_to_a_trace_of_some_layers_says_what_it_could_not_see(tmp_path):
    """An importer's per-layer log holds one layer: the fit matches it with the mean over every synthetic
    layer, and says so, since how skew grows over the layers is not in the trace."""
    from tests.factories import write_partial_trace
    partial = write_partial_trace(tmp_path / "l1.parquet", [1], num_layers=3, steps=6, requests=2)
    whole = write_partial_trace(tmp_path / "all.parquet", [0, 1, 2], num_layers=3, steps=6, requests=2)
    said = "the trace logs 1 of the model's 3 MoE layers: the fit matches their statistics with the mean over all 3"
    assert any(said in note for note in fit_params(partial, rounds=1, steps=1).notes)
    assert not any("MoE layers" in note for note in fit_params(whole, rounds=1, steps=1).notes)


def test_requests_without_a_prompt_are_left_out_of_the_prompt_length(tmp_path):
    """Prompts of 10 and 20 tokens and one request logged from its decode only (no prefill rows): the prompt
    length is (10 + 20) / 2 = 15, not (10 + 0 + 20) / 3 = 10 as before. Decode stays the mean over every
    request, (2 + 3 + 1) / 3 = 2: a request that decoded 1 token did decode it. Per request, the one without a
    prompt gets that mean, 15, the others their own 10 and 20, and every request its own decode, 2, 3 and 1.
    The fit says so; a trace with no prompt at all gets the generator's shortest, 1 token, and says so."""
    from tests.factories import tiny_model, write_partial_trace, write_tiny_trace
    model = tiny_model(layers=2, experts=4, top_k=2)

    def routed(n: int) -> list[list[list[int]]]:
        return [[[0, 1]] * n for _ in range(model.num_layers)]
    steps = [{"phase": "prefill", "tokens": {0: (0, routed(10))}},
             {"phase": "prefill", "tokens": {2: (0, routed(20))}},
             {"phase": "decode", "tokens": {0: (10, routed(1)), 1: (40, routed(1)), 2: (20, routed(1))}},
             {"phase": "decode", "tokens": {0: (11, routed(1)), 1: (41, routed(1))}},
             {"phase": "decode", "tokens": {1: (42, routed(1))}}]
    real = write_tiny_trace(tmp_path / "real.parquet", model, steps)
    stats = trace_stats(real)
    assert stats["tokens_by_phase"] == {"prefill": 30, "decode": 6}
    assert trace_shape(stats) == {"requests": 3, "prompt_len": 15, "decode_len": 2, "batch": 2}
    assert (stats["requests"], stats["requests_with_prompt"]) == (3, 2)
    result = fit_params(real, rounds=1, steps=1)
    assert ("1 of the trace's 3 requests has no prompt (0 prefill tokens): its synthetic request gets the mean "
            "prompt of the 2 that have one (15 tokens); every other request keeps its own prompt length") in result.notes
    assert (result.real_prompt_lens, result.prompt_lens, result.decode_lens) == ([10, 0, 20], [10, 15, 20], [2, 3, 1])
    # the bundled trace: HumanEval/1 was logged from its decode only (traces/README.md), HumanEval/0's prompt is 135
    assert trace_shape(trace_stats(REAL))["prompt_len"] == 135
    decode_only = write_partial_trace(tmp_path / "decode.parquet", [0, 1, 2], steps=3, requests=2)
    stats = trace_stats(decode_only)
    assert stats["requests_with_prompt"] == 0 and trace_shape(stats)["prompt_len"] == 1
    result = fit_params(decode_only, rounds=1, steps=1)
    assert ("none of the trace's 2 requests has a prompt (0 prefill tokens): the synthetic requests get a 1-token "
            "prompt, the shortest the generator writes") in result.notes
    assert (result.real_prompt_lens, result.prompt_lens, result.decode_lens) == ([0, 0], [1, 1], [3, 3])


def test_fit_to_a_malformed_trace_is_one_error_line_and_writes_nothing(tmp_path, capsys):
    """An expert id past the model's experts (a damaged file) stopped the fit with an internal error
    (numpy broadcast, exit 1); now the validation pass names file, field and row (exit 2)."""
    from tests.trace.test_stats import write_toy_with_expert
    bad, out = tmp_path / "bad.parquet", tmp_path / "like.parquet"
    write_toy_with_expert(bad, 40)
    assert main(["trace", "synth", "--fit", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "bad.parquet" in err and "'experts'" in err and "row 0" in err and "internal error" not in err
    assert not out.exists()


def test_a_fit_removes_the_candidate_folders_of_fits_killed_before_it(tmp_path, monkeypatch):
    """`trace synth --fit` killed with -9 left its folder of candidate traces in the temporary folder for good;
    the next fit removes those of processes that are gone, and leaves a running fit's alone."""
    import subprocess
    import sys
    import tempfile

    from tests.factories import write_partial_trace
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = scratch / f"moesim-fit-{gone.stdout.strip()}-x1", scratch / f"moesim-fit-{os.getppid()}-x2"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "fit-1.parquet").write_bytes(b"candidate")
    trace = write_partial_trace(tmp_path / "t.parquet", [0, 1], num_layers=2, steps=4, requests=1)
    fit_params(trace, rounds=1, steps=1)
    assert sorted(p.name for p in scratch.iterdir()) == [alive.name]
