"""The notebooks in notebooks/ run top to bottom and reach their conclusions."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(name: str) -> nbformat.NotebookNode:
    """Run ``name`` in a kernel started in an empty folder outside the repository: a notebook finds its inputs
    wherever Jupyter was started (they looked for traces/ under the working folder)."""
    import tempfile
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{name} is stored with outputs; clear them"
    elsewhere = tempfile.mkdtemp(prefix="moesim-notebook-cwd-")
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": elsewhere}})
    client.execute()
    return notebook


def outputs(notebook: nbformat.NotebookNode, mime: str) -> list[str]:
    return [out["data"][mime] for cell in notebook.cells if cell.cell_type == "code"
            for out in cell.outputs if out.get("output_type") in ("execute_result", "display_data")
            and mime in out.get("data", {})]


@pytest.mark.slow
def test_policy_sweep_notebook():
    notebook = execute("policy_sweep.ipynb")
    assert len(outputs(notebook, "image/png")) == 4  # TPOT vs slots, hit rate, breakdown, Gantt
    # the failed points' cell says when none failed: an empty table under "Points that failed keep their reason"
    shown = outputs(notebook, "text/plain") + [out.get("text", "") for cell in notebook.cells
                                               if cell.cell_type == "code" for out in cell.outputs]
    assert not any("Empty DataFrame" in text for text in shown)
    conclusion = outputs(notebook, "text/markdown")[-1]
    assert conclusion.count("- a100-40g") == 3 and conclusion.count("- h100-pcie") == 3
    assert "fastest deployable system in" in conclusion and "of 6 settings" in conclusion


@pytest.mark.slow
def test_custom_policy_notebook():
    notebook = execute("custom_policy.ipynb")
    assert len(outputs(notebook, "image/png")) == 3
    conclusion = outputs(notebook, "text/markdown")[-1]
    assert conclusion.count("closes") == 5 and "best decay at 4 slots" in conclusion


def test_replay_figures_display_as_images_in_a_plain_kernel(tmp_path):
    """No `%matplotlib inline`: run.plot_timeline() and run.plot_breakdown() still show as PNG images."""
    trace = Path(__file__).resolve().parents[1] / "traces" / "mixtral-8x7b-humaneval.parquet"
    cells = [
        "import moesim\n"
        f"short = moesim.slice_trace({str(trace)!r}, {str(tmp_path / 'short.parquet')!r}, steps=4)\n"
        "run = moesim.replay(short, hw='rtx4090')",
        "run.plot_timeline()",
        "run.plot_breakdown()",
        "run.plot_timeline(steps=(2, 3))",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    for cell in notebook.cells[1:]:
        results = [o for o in cell.outputs if o.get("output_type") == "execute_result"]
        assert len(results) == 1 and "image/png" in results[0]["data"], cell.source
        assert results[0]["data"]["image/png"]  # base64 of a real PNG
        assert not any(o.get("output_type") == "error" for o in cell.outputs)
    assert "<Figure" not in "".join(str(o) for c in notebook.cells for o in c.outputs if "image/png" not in
                                    str(o.get("data", {})))


def test_sweep_progress_in_a_notebook_is_one_line_updated_in_place(tmp_path):
    """Progress lines on stderr piled up in the cell (one per interval: hundreds in a long sweep); in a kernel
    the sweep shows one output that each line replaces, ending with how the sweep ended."""
    import re

    import numpy as np

    from tests.factories import random_routing, tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             random_routing(np.random.default_rng(7), model, requests=2, prompt=3, decode=5))
    cells = [
        "import os\nos.environ['MOESIM_PROGRESS_INTERVAL'] = '0'  # a line at every point\nimport moesim",
        (f"df = moesim.sweep({{'traces': [{str(trace)!r}], 'hw': ['rtx4090'], 'systems': ['cpu-only', "
         "'gpu-only-lru'], 'grid': {'cache.slots_per_layer': [1, 2, 3]}}, workers=1)\nlen(df)"),
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    cell = notebook.cells[1]
    assert not [o for o in cell.outputs if o.get("output_type") == "stream"], cell.outputs
    shown = [o for o in cell.outputs if o.get("output_type") == "display_data"]
    assert len(shown) == 1 and re.fullmatch(r"sweep: done, 6/6 points \(100%\) in \d+s", shown[0]["data"]["text/plain"])
    assert [o["data"]["text/plain"] for o in cell.outputs if o.get("output_type") == "execute_result"] == ["6"]


def test_a_mistake_in_a_cell_shows_the_cells_line_and_the_message_not_moesims_frames(tmp_path):
    """moesim.replay(system='smo') in a notebook printed two screens of moesim's frames (sim/run.py,
    policy/systems.py, contextlib) above the one line that says what to do; the traceback shows the cell's own
    line and that message."""
    trace = Path(__file__).resolve().parents[1] / "traces" / "mixtral-8x7b-humaneval.parquet"
    cells = ["import moesim", f"run = moesim.replay({str(trace)!r}, system='smo')"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    [error] = [o for o in notebook.cells[1].outputs if o["output_type"] == "error"]
    shown = "\n".join(error["traceback"])
    package = str(Path(__file__).resolve().parents[1] / "moesim")
    assert error["ename"] == "ConfigError" and package not in shown and "site-packages" not in shown, shown
    assert "run = moesim.replay(" in shown and len(error["traceback"]) == 3, shown
    assert error["traceback"][-1].startswith("ConfigError: field 'system': unknown system 'smo' (fix: did you mean")
    import pickle  # the hook that shortens it leaves the error picklable (a process pool sends it back)

    import moesim
    from moesim.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        moesim.replay(str(trace), system="smo")
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)


def test_a_mistake_with_a_result_or_a_saved_run_shows_the_cells_line_and_the_message(tmp_path):
    """run.save(3), run.plot_timeline() of a run without a timeline, moesim.load_replay of a wrong folder and
    moesim.bundled_trace of a misspelt name showed moesim's frames (runs.py's source around the raise) above the
    message, where moesim.replay's mistakes show the cell's line and the message alone."""
    import numpy as np

    from tests.factories import random_routing, tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             random_routing(np.random.default_rng(7), model, requests=1, prompt=3, decode=3))
    mistakes = ["run.save(3)", "run.plot_timeline()", f"moesim.load_replay({str(tmp_path)!r})",
                "moesim.bundled_trace('mixtral-8x7b-humaneva')", "run.plot_breakdown('b.txt')"]
    cells = [f"import moesim\nrun = moesim.replay({str(trace)!r}, timeline=False)", *mistakes]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert not [o for o in notebook.cells[0].outputs if o["output_type"] == "error"]
    package = str(Path(__file__).resolve().parents[1] / "moesim")
    for cell, line in zip(notebook.cells[1:], mistakes):
        [error] = [o for o in cell.outputs if o["output_type"] == "error"]
        shown = "\n".join(error["traceback"])
        assert error["ename"] == "ConfigError" and package not in shown and len(error["traceback"]) == 3, shown
        assert line in shown and error["traceback"][-1].startswith("ConfigError: ") and "fix: " in shown, shown


def test_the_progress_line_of_an_interrupted_sweep_says_it_stopped(tmp_path):
    """The one progress line of a sweep interrupted in a notebook ended 'sweep: done, 2/6 points'."""
    import re

    import numpy as np

    from tests.factories import random_routing, tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             random_routing(np.random.default_rng(7), model, requests=2, prompt=3, decode=5))
    cells = [
        ("import importlib, os\nos.environ['MOESIM_PROGRESS_INTERVAL'] = '0'\nimport moesim\n"
         "engines = importlib.import_module('moesim.sweep.engines')\nreal, ran = engines.run_point, []\n"
         "def interrupted(*job):\n    if len(ran) == 2:\n        raise KeyboardInterrupt\n"
         "    ran.append(1)\n    return real(*job)\nengines.run_point = interrupted"),
        (f"moesim.sweep({{'traces': [{str(trace)!r}], 'hw': ['rtx4090'], 'systems': ['cpu-only', "
         "'gpu-only-lru'], 'grid': {'cache.slots_per_layer': [1, 2, 3]}}, workers=1)"),
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = notebook.cells[1].outputs
    shown = [o for o in outputs if o.get("output_type") == "display_data"]
    assert len(shown) == 1 and re.fullmatch(r"sweep: stopped, 2/6 points \(33%\) in \d+s",
                                            shown[0]["data"]["text/plain"]), shown
    assert [o["ename"] for o in outputs if o.get("output_type") == "error"] == ["KeyboardInterrupt"]
