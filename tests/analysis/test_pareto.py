"""The Pareto front of metric-against-metric scatter plots."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.analysis.figures import pareto_front


def test_hand_worked_front_both_lower_is_better():
    # (memory, TPOT): (1, 9) (2, 5) (3, 5) (4, 2) (5, 3): (3, 5) is beaten by (2, 5), (5, 3) by (4, 2)
    x = np.array([1, 2, 3, 4, 5])
    y = np.array([9, 5, 5, 2, 3])
    assert pareto_front(x, y).tolist() == [0, 1, 3]


def test_hand_worked_front_higher_y_is_better():
    # (memory, throughput): more throughput is better
    x = np.array([1, 2, 3, 4])
    y = np.array([10, 8, 30, 25])
    assert pareto_front(x, y, maximize_y=True).tolist() == [0, 2]


def test_duplicates_are_kept_once():
    assert pareto_front(np.array([1.0, 1.0, 2.0]), np.array([3.0, 3.0, 1.0])).tolist() == [0, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=30),
       st.booleans(), st.booleans())
def test_front_is_exactly_the_undominated_points(points, max_x, max_y):
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    front = set(pareto_front(x, y, maximize_x=max_x, maximize_y=max_y).tolist())
    sx = -x if max_x else x
    sy = -y if max_y else y

    def dominated(i: int) -> bool:
        return any(sx[j] <= sx[i] and sy[j] <= sy[i] and (sx[j] < sx[i] or sy[j] < sy[i]) for j in range(len(x)))
    undominated = {i for i in range(len(x)) if not dominated(i)}
    # one representative of each undominated (x, y) value
    assert {(x[i], y[i]) for i in front} == {(x[i], y[i]) for i in undominated}
    assert len(front) == len({(x[i], y[i]) for i in front})


def test_serving_rates_and_slo_share_are_maximised_on_a_front():
    """A scatter of TTFT p99 against throughput drew the front of the lowest throughputs: the serving rates,
    goodput, SLO attainment and a serving run's engine hit rate were minimised like latencies."""
    from moesim.analysis.sweep_results import HIGHER_IS_BETTER
    assert {"throughput_rps", "goodput_rps", "output_tokens_per_s", "slo_attainment",
            "engine_gpu_hit_rate"} <= HIGHER_IS_BETTER
    assert not {"ttft_ms_p99", "tpot_ms_p50", "e2e_ms_mean", "engine_makespan_s"} & HIGHER_IS_BETTER
