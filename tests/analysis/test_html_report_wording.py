"""The report's summary reads right for a sweep of one point and lists per-layer list settings apart."""

from __future__ import annotations

from moesim.analysis.html_report import render_report
from tests.analysis.test_figures import results
from tests.analysis.test_long_settings import ALTERNATING, OTHER_WAY
from tests.analysis.test_long_settings import results as list_results


def test_one_point_is_counted_in_the_singular():
    """'1 points, 1 finished, 0 failed' and '1 rows (the Parquet file has every metric)'."""
    page = render_report(results().iloc[:1], title="t", gantt=False)
    assert "<li>1 point, 1 finished, 0 failed</li>" in page
    assert "<summary>1 row (the Parquet file has every metric)</summary>" in page
    page = render_report(results(), title="t", gantt=False)
    assert "<li>19 points, 18 finished, 1 failed</li>" in page and "<summary>19 rows (" in page


def test_list_settings_are_listed_with_semicolons_between_them():
    """'cache.slots_per_layer: 1, 1,2,1,2,..., 2,1,2,1,...': where one list ended and the next began was lost."""
    page = render_report(list_results(), title="t", gantt=False)
    assert f"<li>cache.slots_per_layer: 1; {ALTERNATING}; {OTHER_WAY}</li>" in page
    assert "<li>cache.slots_per_layer: 1, 2, 4, 9</li>" in render_report(results(), title="t", gantt=False)


def test_a_list_setting_in_a_table_cell_may_break_after_its_commas():
    """A browser finds no place to break '1,2,1,2,...': a list of 32 numbers made the TPOT table wider than the
    page."""
    page = render_report(list_results(), title="t", gantt=False)
    broken = ALTERNATING.replace(",", ",<wbr>")
    assert f'<td class="text">{broken}</td>' in page
    assert '<td class="text">1</td>' in page  # a single value as it was
