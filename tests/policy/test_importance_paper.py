"""Importance-driven scheduling (004_91681cee0e4a4add.txt) against the paper, mechanism by mechanism: each
test works a tiny case by hand in its comments and asserts the plan or number 004's rule gives."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.errors import ConfigError
from moesim.hw.cost import CostModel
from moesim.hw.profile import load_profile
from moesim.model.presets import load_preset
from moesim.policy.base import LayerView, RunContext, active_experts
from moesim.policy.catalog.importance import (ImportanceRouter, ScoreHistoryCache, StaticFirstCache,
                                              TopScorePrefetch, TwoPointerBalancer)
from moesim.policy.state import CacheState
from moesim.policy.systems import SYSTEMS
from tests.factories import tiny_model, tiny_profile


def view_of(experts, scores=None, resident=(), num_experts=8, layers=2, layer=0, phase="decode", step=0):
    model = tiny_model(layers=layers, experts=num_experts, top_k=len(experts[0]))
    state = CacheState(capacity=[num_experts] * layers)
    state.preload(layer, sorted(resident))
    arr = np.array(experts)
    active, counts = active_experts(arr, num_experts)
    return LayerView(step, layer, phase, arr, active, counts, state, CostModel(tiny_profile(), model),
                     scores=None if scores is None else np.array(scores, dtype=np.float64))


# ----------------------------------------------------------------------------- 004 Sec. 6.1: the software
def test_importance_runs_on_the_pytorch_runtime():
    """004 Sec. 6.1 builds the system on PyTorch (Python without the GIL) with the transformers library's
    model code; Sec. 7 names KTransformers as another system, left out of the comparison. Its launches are
    PyTorch's eager ones: on the a100-40g profile 115 non-expert kernels per layer at 16 us each."""
    assert SYSTEMS["importance"].runtime == "pytorch-eager"
    model = load_preset("deepseek-v3")
    costs = CostModel(load_profile("a100-40g"), model, runtime_name=SYSTEMS["importance"].runtime)
    assert costs.layer_launches("decode") == pytest.approx(115 * 16e-6)


# ----------------------------------------------------------------------------- 004 Sec. 5.2
def _prefetch(**params):
    model = tiny_model(layers=2, experts=8, top_k=3)
    prefetch = TopScorePrefetch(**params)
    prefetch.configure(RunContext(model=model, costs=CostModel(tiny_profile(), model), capacity=[8, 8],
                                  columns=("pred_next_layer",)))
    return prefetch


def test_top_score_prefetch_per_token_zero_queues_each_tokens_whole_prediction():
    """Sec. 5.2 read literally: each token's top-k predicted experts go to the load queue, highest first.
    Token 0 predicts 4, 2, 7; token 1 predicts 2, 5, 4. Votes: 2 and 4 two each (2 ranks first for token 1,
    4 for token 0: a tie on position, the lower id first), then 5 and 7 one each (5 at position 1, 7 at 2).
    per_token=1 takes the first of each: 4 and 2, one vote each at position 0, the lower id first."""
    view = view_of([[0, 1, 3], [0, 1, 3]])
    view.predictors = {"pred_next_layer": [np.array([4, 2, 7]), np.array([2, 5, 4])]}
    assert _prefetch(per_token=0).candidates(view) == [(1, 2), (1, 4), (1, 5), (1, 7)]
    assert _prefetch(per_token=1).candidates(view) == [(1, 2), (1, 4)]


def test_top_score_prefetch_refuses_a_negative_count():
    with pytest.raises(ConfigError, match="prefetch.per_token"):
        _prefetch(per_token=-1)
