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


def test_the_serving_loop_run_again_after_an_interrupt_runs_only_what_did_not_finish():
    """An interrupted loop of moesim.serve lost its finished runs: running the cell again started from the first."""
    import nbclient
    import nbformat

    from tests.test_notebooks import NOTEBOOKS
    code = [c.source for c in nbformat.read(NOTEBOOKS / "serving.ipynb", as_version=4).cells if c.cell_type == "code"]
    setup, loop = code[0], code[1]
    interrupting = """
SYSTEMS, QPS, REQUESTS = ["cpu-only"], [0.05, 0.1, 0.2], 3
real_serve, calls = moesim.serve, []
def serve(*args, **kwargs):
    calls.append(kwargs["qps"])
    if len(calls) == 3:
        raise KeyboardInterrupt
    return real_serve(*args, **kwargs)
moesim.serve = serve"""
    cells = [setup, interrupting, loop, "calls.clear()", loop, "calls"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    assert [o["ename"] for o in notebook.cells[2].outputs if o["output_type"] == "error"] == ["KeyboardInterrupt"]
    assert not [o for c in notebook.cells[3:] for o in c.outputs if o["output_type"] == "error"]
    assert notebook.cells[-1].outputs[0]["data"]["text/plain"] == "[0.2]"  # the two finished rates did not run again
    table = notebook.cells[4].outputs[0]["data"]["text/plain"].splitlines()
    assert [line.split()[1:3] for line in table[1:4]] == [["cpu-only", q] for q in ("0.05", "0.10", "0.20")], table
