"""Synthetic requests of different lengths: per-request prompt and decode lengths, given or fitted."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.trace.io import read_meta, read_table
from moesim.trace.stats import trace_stats
from moesim.trace.synth import SynthConfig, synth_rows, synthesize
from moesim.trace.validate import validate_trace


def tokens_by_request(path) -> dict[int, dict[str, int]]:
    """Prompt and decode tokens of each request of a trace, counted at its first layer."""
    table = read_table(path, ["request", "phase", "layer"])
    first = table.column("layer").to_numpy() == 0
    request = table.column("request").to_numpy()[first]
    phase = np.asarray(table.column("phase").combine_chunks().dictionary_decode().to_pylist())[first]
    return {int(r): {p: int(((request == r) & (phase == p)).sum()) for p in ("prefill", "decode")}
            for r in np.unique(request)}


def steps_of(path) -> list[tuple[str, list[int]]]:
    """Each step's phase and its requests (one entry per token), at the first layer."""
    table = read_table(path, ["step", "request", "phase", "layer"]).to_pandas()
    first = table[table.layer == 0]
    return [(str(rows.phase.iloc[0]), rows.request.tolist()) for _, rows in first.groupby("step")]


def test_each_request_gets_its_own_prompt_and_decode_length(tmp_path):
    """Prompts 5, 1, 9 and decodes 2, 0, 4 in groups of 2: requests 0 and 1 are prefilled (steps 0, 1),
    then decode together until the longer one ends: request 1 decodes nothing, so steps 2 and 3 hold request
    0 alone; request 2 is prefilled (step 4) and decodes 4 steps (5-8). 9 steps, (15 + 6) x 32 rows."""
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=3, batch=2, prompt_lens=[5, 1, 9],
                                       decode_lens=[2, 0, 4])
    path = synthesize(config, tmp_path / "t.parquet")
    assert validate_trace(path).rows == synth_rows(config) == (15 + 6) * 32
    assert tokens_by_request(path) == {0: {"prefill": 5, "decode": 2}, 1: {"prefill": 1, "decode": 0},
                                       2: {"prefill": 9, "decode": 4}}
    assert steps_of(path) == [("prefill", [0] * 5), ("prefill", [1]), ("decode", [0]), ("decode", [0]),
                              ("prefill", [2] * 9)] + [("decode", [2])] * 4
    table = read_table(path, ["request", "position", "layer"]).to_pandas()
    positions = table[(table.layer == 0) & (table.request == 2)].position.tolist()
    assert positions == list(range(13))  # decode continues after its own prompt
    source = read_meta(path).source
    assert (source["prompt_lens"], source["decode_lens"]) == ([5, 1, 9], [2, 0, 4])


def test_a_batch_loses_each_request_as_it_ends(tmp_path):
    """Decodes 3, 1, 2 batched together: 3 requests in the first step, then 0 and 2, then 0."""
    config = SynthConfig.from_settings(model="mixtral-8x7b", requests=3, batch=3, prompt_len=2,
                                       decode_lens=[3, 1, 2], scores=False)
    path = synthesize(config, tmp_path / "t.parquet")
    validate_trace(path)
    assert steps_of(path)[3:] == [("decode", [0, 1, 2]), ("decode", [0, 2]), ("decode", [0])]
    assert {r: n["prefill"] for r, n in tokens_by_request(path).items()} == {0: 2, 1: 2, 2: 2}
    assert trace_stats(path)["tokens_by_phase"] == {"prefill": 6, "decode": 6}


def content_digest(path) -> str:
    """The rows and the recorded source of a trace (not the Parquet bytes, which a pyarrow version may lay out
    otherwise)."""
    digest = hashlib.sha256(json.dumps(read_meta(path).source, sort_keys=True).encode())
    table = read_table(path)
    for name in sorted(table.column_names):
        digest.update(name.encode() + repr(table.column(name).to_pylist()).encode())
    return digest.hexdigest()


#: content digests of traces the generator wrote before per-request lengths existed (commit 394d7f7)
BEFORE_LENGTH_LISTS = [
    (dict(model="mixtral-8x7b", requests=3, prompt_len=5, decode_len=6, batch=2, seed=0),
     "ffea7739e0a002650ea647127afb5b11c3b2c428e5bdd4f97abb4b6e9dfa28f4"),
    (dict(model="mixtral-8x7b", requests=5, prompt_len=40, decode_len=300, batch=3, seed=4),
     "0bdb4d040162988c59eb52d38b7a301c41616b3f632a556ff324fc48b50e497d"),
    # a prompt of two generation chunks (612 tokens each on this model)
    (dict(model="qwen3-30b-a3b", requests=2, prompt_len=700, decode_len=50, batch=2, seed=1, scores=False),
     "92bbb766e8a3c0064e8a51b722faf833f805d10937419e823c6b5b3c72839433"),
    (dict(model="olmoe-1b-7b", requests=4, prompt_len=1, decode_len=0, batch=4, seed=2),
     "9a833f0a698cd6b8c266114b44e79f71e5869f58ce2dff6c3d3fdc6c0bdd2384"),
]


@pytest.mark.parametrize("args, digest", BEFORE_LENGTH_LISTS)
def test_equal_lengths_write_what_they_wrote_before(tmp_path, args, digest):
    assert content_digest(synthesize(SynthConfig.from_settings(**args), tmp_path / "t.parquet")) == digest


def test_the_cli_without_length_lists_writes_the_same_bytes_as_before(tmp_path):
    """--prompt-len/--decode-len as before: the same file, byte for byte, as the config they stand for."""
    out = tmp_path / "cli.parquet"
    assert main(["trace", "synth", "--model", "mixtral-8x7b", "--requests", "3", "--prompt-len", "5",
                 "--decode-len", "6", "--batch", "2", "--out", str(out)]) == 0
    assert content_digest(out) == BEFORE_LENGTH_LISTS[0][1]
    api = synthesize(SynthConfig.from_settings(**BEFORE_LENGTH_LISTS[0][0]), tmp_path / "api.parquet")
    assert out.read_bytes() == api.read_bytes()


def test_equal_length_lists_route_as_the_scalar_lengths(tmp_path):
    """The lists change only the lengths: [5, 5, 5] routes every token as --prompt-len 5 does."""
    plain = synthesize(SynthConfig.from_settings(**BEFORE_LENGTH_LISTS[0][0]), tmp_path / "a.parquet")
    listed = synthesize(SynthConfig.from_settings(**BEFORE_LENGTH_LISTS[0][0], prompt_lens=[5, 5, 5],
                                                  decode_lens=[6, 6, 6]), tmp_path / "b.parquet")
    assert read_table(plain).equals(read_table(listed))


@pytest.mark.parametrize("prompt_lens, decode_lens, field, words", [
    ([5, 0, 9], None, "prompt_lens", "entry 2 is 0, below 1"),
    (None, [2, -1, 4], "decode_lens", "entry 2 is -1, below 0"),
    ([5, 1.5, 9], None, "prompt_lens", "entry 2 is not a whole number: 1.5"),
    (["5", 1, 9], None, "prompt_lens", "entry 1 is not a whole number: '5'"),
    ([5, 1], None, "prompt_lens", "has 2 entries for 3 requests"),
    (None, [], "decode_lens", "is empty"),
    ("5,1,9", None, "prompt_lens", "must be a list of whole numbers"),
])
def test_bad_length_lists_are_config_errors(prompt_lens, decode_lens, field, words):
    with pytest.raises(ConfigError, match=words) as raised:
        SynthConfig.from_settings(model="mixtral-8x7b", requests=3, prompt_lens=prompt_lens, decode_lens=decode_lens)
    assert raised.value.field == field


# ----------------------------------------------------------------------------- command line
def synth(tmp_path, *args: str) -> int:
    return main(["trace", "synth", "--model", "mixtral-8x7b", "--no-scores", *args, "--out",
                 str(tmp_path / "out.parquet")])


def test_cli_takes_a_length_per_request_from_a_list_or_a_file(tmp_path):
    assert synth(tmp_path, "--prompt-lens", "5,1,9", "--decode-lens", "2, 0, 4", "--batch", "2") == 0
    out = tmp_path / "out.parquet"
    assert tokens_by_request(out) == {0: {"prefill": 5, "decode": 2}, 1: {"prefill": 1, "decode": 0},
                                      2: {"prefill": 9, "decode": 4}}  # 3 requests: the lists' count
    (tmp_path / "decodes.txt").write_text("2\n0\n4\n")
    assert synth(tmp_path, "--prompt-len", "3", "--decode-lens", f"@{tmp_path / 'decodes.txt'}") == 0
    assert tokens_by_request(out) == {0: {"prefill": 3, "decode": 2}, 1: {"prefill": 3, "decode": 0},
                                      2: {"prefill": 3, "decode": 4}}


@pytest.mark.parametrize("args, field, words", [
    (["--prompt-lens", "5,-1,9"], "--prompt-lens", "entry 2 is -1, below 1"),
    (["--prompt-lens", "5,0,9"], "--prompt-lens", "entry 2 is 0, below 1"),
    (["--decode-lens", "2,-3"], "--decode-lens", "entry 2 is -3, below 0"),
    (["--prompt-lens", "5,1.5,9"], "--prompt-lens", "entry 2 is not a whole number: '1.5'"),
    (["--decode-lens", "2,x"], "--decode-lens", "entry 2 is not a whole number: 'x'"),
    (["--prompt-lens", "5,,9"], "--prompt-lens", "entry 2 is not a whole number: ''"),
    (["--prompt-lens", ""], "--prompt-lens", "is empty"),
    (["--requests", "3", "--prompt-lens", "5,1"], "--prompt-lens", "has 2 entries for --requests 3"),
    (["--prompt-lens", "5,1,9", "--decode-lens", "2,0"], "--decode-lens", "has 2 entries, --prompt-lens 3"),
    (["--prompt-lens", "5,1", "--prompt-len", "4"], "--prompt-lens", "given with --prompt-len"),
    (["--decode-lens", "@missing.txt"], "--decode-lens", "cannot read missing.txt"),
])
def test_cli_refuses_a_bad_length_list_in_one_line(tmp_path, capsys, args, field, words):
    assert synth(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"field '{field}'" in err and words in err and "(fix: " in err
    assert not (tmp_path / "out.parquet").exists()


def test_synth_help_describes_the_length_lists():
    from click.testing import CliRunner

    from moesim.cli.app import cli
    text = " ".join(CliRunner().invoke(cli, ["trace", "synth", "--help"]).output.split())
    assert "--prompt-lens" in text and "--decode-lens" in text and "12,300,40" in text and "@FILE" in text


# ----------------------------------------------------------------------------- fitted lengths
@pytest.fixture
def quick_fit(monkeypatch):
    """One bisection step of each parameter: the lengths are the point here, not the fit's quality."""
    import functools

    import moesim.trace.synth
    monkeypatch.setattr(moesim.trace.synth, "fit_params",
                        functools.partial(moesim.trace.synth.fit_params, rounds=1, steps=1))


def real_trace(tmp_path, lengths: list[tuple[int, int]]):
    from tests.factories import tiny_model, write_tiny_trace
    from tests.sim.test_serving import request_routing
    model = tiny_model(layers=2, experts=6, top_k=2)
    return write_tiny_trace(tmp_path / "real.parquet", model,
                            request_routing(np.random.default_rng(0), model, lengths))


def table_text(printed: str) -> str:
    """Printed tables as one line of words, their rules left out."""
    return " ".join(printed.replace("│", " ").replace("┃", " ").split())


def test_a_fit_takes_the_real_requests_lengths_in_order(tmp_path, capsys, quick_fit):
    """Real requests of 5 + 3, 1 + 0 and 9 + 6 tokens: the synthetic ones have exactly those, not the means
    (5 + 3 each), and the fit prints both distributions."""
    real = real_trace(tmp_path, [(5, 3), (1, 0), (9, 6)])
    out = tmp_path / "like.parquet"
    assert main(["trace", "synth", "--fit", str(real), "--no-scores", "--out", str(out)]) == 0
    expected = {0: {"prefill": 5, "decode": 3}, 1: {"prefill": 1, "decode": 0}, 2: {"prefill": 9, "decode": 6}}
    assert tokens_by_request(out) == tokens_by_request(real) == expected
    printed = table_text(capsys.readouterr().out)
    assert "request lengths (tokens; min / median / max)" in printed
    for row in ("requests 3 3", "prompt 1 / 5 / 9 1 / 5 / 9", "decode 0 / 3 / 6 0 / 3 / 6", "tokens in all 24 24"):
        assert row in printed, (row, printed)
    source = read_meta(out).source
    assert (source["prompt_lens"], source["decode_lens"], source["batch"]) == ([5, 1, 9], [3, 0, 6], 1)


def test_lengths_given_with_a_fit_win_and_more_requests_repeat_the_real_ones(tmp_path, capsys, quick_fit):
    real = real_trace(tmp_path, [(5, 3), (1, 0), (9, 6)])
    out = tmp_path / "like.parquet"
    args = ["trace", "synth", "--fit", str(real), "--no-scores", "--out", str(out)]
    assert main([*args, "--prompt-lens", "2,4,6"]) == 0  # the decodes stay the real ones
    assert tokens_by_request(out) == {0: {"prefill": 2, "decode": 3}, 1: {"prefill": 4, "decode": 0},
                                      2: {"prefill": 6, "decode": 6}}
    assert main([*args, "--requests", "5"]) == 0  # requests 3 and 4 are the real 0 and 1 again
    assert [(n["prefill"], n["decode"]) for n in tokens_by_request(out).values()] == \
        [(5, 3), (1, 0), (9, 6), (5, 3), (1, 0)]
    assert main([*args, "--decode-len", "2"]) == 0
    assert [(n["prefill"], n["decode"]) for n in tokens_by_request(out).values()] == [(5, 2), (1, 2), (9, 2)]
    capsys.readouterr()


def test_a_real_request_without_a_prompt_gets_the_mean_prompt(tmp_path, capsys, quick_fit):
    """Request 1 was logged from its decode only (positions 0-3, no prefill rows): its prompt was left out of
    the trace, not empty, so its synthetic request gets the mean of the logged prompts, (4 + 8) / 2 = 6;
    the others keep theirs, every decode its own. The real column shows the 0 logged."""
    from tests.factories import tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=4, top_k=2)

    def routed(n: int) -> list[list[list[int]]]:
        return [[[0, 1]] * n for _ in range(model.num_layers)]
    steps = [{"phase": "prefill", "tokens": {0: (0, routed(4))}}, {"phase": "decode", "tokens": {0: (4, routed(2))}},
             {"phase": "decode", "tokens": {1: (0, routed(4))}},
             {"phase": "prefill", "tokens": {2: (0, routed(8))}}, {"phase": "decode", "tokens": {2: (8, routed(1))}}]
    real = write_tiny_trace(tmp_path / "real.parquet", model, steps)
    out = tmp_path / "like.parquet"
    assert main(["trace", "synth", "--fit", str(real), "--no-scores", "--out", str(out)]) == 0
    assert [(n["prefill"], n["decode"]) for n in tokens_by_request(out).values()] == [(4, 2), (6, 4), (8, 1)]
    printed = table_text(capsys.readouterr().out)
    assert "prompt 0 / 4 / 8 4 / 6 / 8" in printed and "decode 1 / 2 / 4 1 / 2 / 4" in printed
    assert "1 of the trace's 3 requests has no prompt" in printed


def test_request_lengths_of_a_trace_with_sparse_large_ids(tmp_path):
    """Request ids as logged (here 7 and 2**31 - 1, positions up to 2**31 - 2) come back in order of id."""
    from moesim.trace.synth import request_lengths
    from tests.factories import tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=4, top_k=2)
    big = 2**31 - 1

    def routed(n: int) -> list[list[list[int]]]:
        return [[[0, 1]] * n for _ in range(model.num_layers)]
    steps = [{"phase": "prefill", "tokens": {big: (0, routed(3))}}, {"phase": "prefill", "tokens": {7: (0, routed(2))}},
             {"phase": "decode", "tokens": {7: (2, routed(1)), big: (2**31 - 2, routed(1))}}]
    assert request_lengths(write_tiny_trace(tmp_path / "t.parquet", model, steps)) == ([2, 3], [1, 1])
