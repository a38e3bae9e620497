"""`moesim replay --plot` names the --set values in the figure's title, as in the table's, and the title stays
within the figure however long they are."""

from __future__ import annotations

import pytest

from moesim.analysis import plots
from moesim.analysis.plots import plot_breakdown
from moesim.cli import main



@pytest.fixture
def drawn(monkeypatch):
    """The figures the command draws, kept as it returns them."""
    figures = []
    for name in ("plot_gantt", "plot_breakdown"):
        original = getattr(plots, name)

        def keep(*args, _original=original, **kwargs):
            figures.append(_original(*args, **kwargs))
            return figures[-1]
        monkeypatch.setattr(plots, name, keep)
    return figures


def _title(fig) -> str:
    text = fig._suptitle or fig.axes[0].title
    return text.get_text() or fig.axes[0].get_title(loc="left")


@pytest.mark.parametrize("systems", ["gpu-only-lru", "gpu-only-lru,static-hot"])
def test_the_figure_of_a_replay_names_its_set_values(files, tmp_path, capsys, drawn, systems):
    """Replays with other --set values drew figures with the same title: nothing said which was which."""
    trace, hw = files
    slots = "2,1"  # one per layer of the test model
    code = main(["replay", trace, "--hw", hw, "--system", systems, "--set", f"cache.slots_per_layer={slots}",
                 "--set", "hw.pcie.bandwidth_scale=0.5", "--plot", str(tmp_path / "f.png")])
    capsys.readouterr()
    assert code == 0
    [fig] = drawn
    title = " ".join(_title(fig).split())
    assert f"(cache.slots_per_layer={slots}, hw.pcie.bandwidth_scale=0.5)" in title, title


def test_a_breakdown_title_with_long_settings_stays_within_the_figure():
    """A title the layout engine could not place left the axes where they stood before it ran; broken for that
    place, the title then started further right once the layout ran, and its lines ran past the edge."""
    # six-digit milliseconds: the y axis's labels as wide as a real run's, which moves the axes as the layout runs
    run = {"system": "gpu-only-lru", "makespan_s": 224.0,
           "breakdown_ms": {"gpu_compute": 6000.0, "wait_cache": 218000.0},
           "inputs": {"trace": "/x/mixtral-8x7b-humaneval.parquet", "hw": "a100-40g",
                      "hw_parts": {"cpu": "2x Intel Xeon Platinum 8452Y (72 of 72 cores)", "cpu_cores": 72,
                                   "cpu_dram_bandwidth_gbps": 440, "gpu": "NVIDIA A100 40GB"},
                      "settings": {"cache.slots_per_layer": ",".join(["1", "2"] * 16)}}}
    fig = plot_breakdown([run, {**run, "system": "static-hot"}])
    fig.draw_without_rendering()
    title = fig.axes[0]._left_title
    assert "(32 values)" in title.get_text()
    renderer = fig.canvas.get_renderer()
    assert title.get_window_extent(renderer).x1 <= fig.bbox.x1


@pytest.mark.parametrize("decode, metric", [(0, "makespan"), (4, "TPOT")])
def test_an_oracles_outputs_say_which_metric_chose_the_schedule_they_show(tmp_path, capsys, drawn, decode, metric):
    """On a trace without decode steps the oracle's timeline is its best schedule on makespan (there is no TPOT),
    and the Gantt title and the 'wrote' lines said 'its best schedule on TPOT'."""
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 5, decode=decode)
    code = main(["replay", trace, "--hw", hw, "--system", "oracle", "--timeline", str(tmp_path / "timeline.parquet"),
                 "--plot", str(tmp_path / "g.png")])
    out = capsys.readouterr().out
    assert code == 0
    [fig] = drawn
    title = " ".join(_title(fig).split())
    assert f"best schedule on {metric})" in title, title
    wrote = " ".join(line for line in out.splitlines() if line.startswith("wrote"))
    assert f"best schedule on {metric})" in wrote, out
    assert ("TPOT" in title) == (metric == "TPOT")
