"""notebooks/serving.ipynb runs top to bottom and computes its conclusion (helpers of tests/test_notebooks.py)."""

from __future__ import annotations

import pytest

from tests.test_notebooks import execute, outputs


@pytest.mark.slow
def test_serving_notebook():
    notebook = execute("serving.ipynb")
    conclusion = outputs(notebook, "text/markdown")[-1]
    # TTFT and TPOT percentiles vs QPS, then the request timeline of the best system's run when one serves
    assert len(outputs(notebook, "image/png")) == (3 if "serves the most load" in conclusion else 2)
    assert "Maximum load under p90 TTFT" in conclusion
    assert conclusion.count("\n- ") == 3 and ("serves the most load" in conclusion or "No system" in conclusion)
