"""trace synth draws the routing of short requests many at a time (moesim.trace.synth_routing.draw_routers);
the files are byte for byte those of drawing each request on its own, a few tokens at a time
(synth_routing.RequestRouter, the generator as it was before)."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.trace import synth as synth_mod
from moesim.trace.synth import SynthConfig, synthesize
from moesim.trace.synth_routing import Layout

CASES = {  # model, requests, prompt_len, decode_len, batch, seed, settings, lengths
    "one-token requests": ("mixtral-8x7b", 40, 1, 1, 1, 0, {}, {}),
    "deepseek batch": ("deepseek-v3", 9, 1, 2, 4, 3, {}, {}),
    "qwen prompts": ("qwen3-30b-a3b", 6, 5, 3, 2, 1, {"cold_fraction": "0.2"}, {}),
    "own lengths": ("mixtral-8x7b", None, None, None, 3, 9, {"token_corr": "0.9"},
                    {"prompt_lens": [3, 1, 7, 2, 5, 1], "decode_lens": [0, 4, 2, 9, 1, 3]}),
    "no predictors": ("mixtral-8x7b", 12, 2, 0, 1, 0, {"predictors": "false"}, {}),
    # 160 and 151 Mixtral tokens are past DRAWN_ELEMENTS: drawn on their own beside the short ones
    "long and short": ("mixtral-8x7b", None, None, None, 2, 0, {},
                       {"prompt_lens": [3, 160, 2, 1], "decode_lens": [150, 1, 0, 2]}),
}


def config_of(case: tuple, scores: bool) -> SynthConfig:
    model, requests, prompt_len, decode_len, batch, seed, settings, lengths = case
    shape = {"requests": requests or len(lengths["prompt_lens"]), "prompt_len": prompt_len or 1,
             "decode_len": decode_len if decode_len is not None else 1}
    return SynthConfig.from_settings(model=model, batch=batch, seed=seed, settings=settings, scores=scores,
                                     **shape, **lengths)


@pytest.mark.parametrize("name", sorted(CASES))
def test_drawing_many_requests_at_once_writes_the_same_bytes(tmp_path, monkeypatch, name):
    long = 151 * 32 * 9  # logits of 151 Mixtral tokens (32 layers, 8 experts, at least 1 cluster)
    assert 3 * 32 * 16 <= synth_mod.DRAWN_ELEMENTS < long  # the short requests are drawn together
    scores = name != "no predictors"
    together = synthesize(config_of(CASES[name], scores), tmp_path / "together.parquet").read_bytes()
    monkeypatch.setattr(synth_mod, "DRAWN_ELEMENTS", 0)  # every request drawn alone, incrementally
    alone = synthesize(config_of(CASES[name], scores), tmp_path / "alone.parquet").read_bytes()
    assert together == alone


def test_blocks_hold_a_bounded_number_of_groups(monkeypatch):
    # requests too long to be drawn together add nothing to a block: it still ends after DRAWN_GROUPS groups
    monkeypatch.setattr(synth_mod, "DRAWN_ELEMENTS", 0)
    config = config_of(("mixtral-8x7b", 3000, 1, 1, 1, 0, {}, {}), scores=False)
    layout = Layout.draw(config.model, config.params, np.random.default_rng(0))
    sizes = [len(block) for block in synth_mod._group_blocks(config, layout)]
    assert sizes == [synth_mod.DRAWN_GROUPS] * 2 + [3000 - 2 * synth_mod.DRAWN_GROUPS]
