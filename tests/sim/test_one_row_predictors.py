"""one_row_predictors gives each row what slicing the step's predictor columns to that row gives."""

import numpy as np

from moesim.trace.io import one_row_predictors


def _columns(names: tuple[str, ...], rows: int) -> dict[str, list[np.ndarray]]:
    return {name: [np.arange(k, k + 3) + 10 * n for k in range(rows)] for n, name in enumerate(names)}


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        type(got[k]) is type(want[k]) and len(got[k]) == len(want[k])
        and all(np.array_equal(a, b) for a, b in zip(got[k], want[k])) for k in want)


def test_rows_match_slices_for_one_and_several_columns():
    for names in (("pred_next_layer",), ("pred_next_layer", "pred_residual", "pred_next_token")):
        predictors = _columns(names, 5)
        split = one_row_predictors(predictors)
        assert len(split) == 5
        for i, row in enumerate(split):
            assert _same(row, {k: v[i:i + 1] for k, v in predictors.items()})


def test_no_columns_gives_no_rows():
    assert one_row_predictors({}) == []
