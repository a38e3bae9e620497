"""Gantt chart and time-breakdown figures: lanes, bar counts, windows, files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from moesim.analysis.plots import BREAKDOWN_STYLE, KIND_STYLE, default_window, plot_breakdown, plot_gantt
from moesim.errors import ConfigError
from moesim.sim.bookkeeping import BREAKDOWN
from moesim.sim.result import TIMELINE_COLUMNS


def _frame(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(TIMELINE_COLUMNS))


def _decode_timeline(steps: int, layers: int = 4) -> pd.DataFrame:
    """Per layer: attention (1 ms), one GPU expert (1 ms), one CPU expert (2 ms), a prefetch (3 ms); 6 rows."""
    rows, t = [], 0.0
    for step in range(steps):
        for layer in range(layers):
            ms = 1e-3
            rows += [("gpu", 0, t, t + ms, "attention", step, layer, -1, 1),
                     ("gpu", 0, t + ms, t + 2 * ms, "expert", step, layer, 1, 1),
                     ("cpu", 0, t + ms, t + 3 * ms, "expert", step, layer, 2, 1),
                     ("pcie", 0, t + ms, t + 4 * ms, "prefetch", step, (layer + 1) % layers, 3, 0),
                     ("gpu", 0, t + 3 * ms, t + 4 * ms, "shared", step, layer, -1, 1),
                     ("pcie", 0, t + 4 * ms, t + 4.5 * ms, "stage", step, layer, 4, 0)]
            t += 4.5 * ms
    return _frame(rows)


def _bars(fig: Figure) -> int:
    return sum(len(c.get_paths()) for c in fig.axes[0].collections if isinstance(c, PolyCollection))


def _lane_labels(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_gantt_lanes_bars_and_legend() -> None:
    frame = _decode_timeline(steps=1)
    fig = plot_gantt(frame, window=(0.0, 1.0))
    assert isinstance(fig, Figure)
    assert _lane_labels(fig) == ["CPU", "GPU", "PCIe H2D"]  # bottom to top: PCIe drawn on top
    assert _bars(fig) == len(frame) == 24
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["attention + gate", "shared experts", "routed expert", "prefetch", "streamed (staging)"]
    assert fig.axes[0].get_xlabel() == "time (ms)"
    assert fig.axes[0].get_xlim() == pytest.approx((0.0, 1000.0))


def test_every_kind_and_category_the_engine_writes_has_a_colour(tiny_replay) -> None:
    """Unstyled kinds fell back to black (Gantt) or matplotlib's cycle (breakdown), clashing with styled ones."""
    kinds = {"attention", "predict", "shared", "expert", "deferred", "embedding", "dense_ffn", "lm_head", "sampling",
             "load", "prefetch", "stage", "chunk", "writeback"}
    assert set(tiny_replay["kind"]) <= kinds  # what a replay writes is among those checked here
    assert kinds <= set(KIND_STYLE) and set(BREAKDOWN) <= set(BREAKDOWN_STYLE)
    breakdown = [colour for colour, _ in BREAKDOWN_STYLE.values()]
    assert len(set(breakdown)) == len(breakdown)  # a stacked bar tells every category apart
    # kinds of one label share a colour and one legend entry
    by_label: dict[str, set[str]] = {}
    for colour, label in KIND_STYLE.values():
        by_label.setdefault(label, set()).add(colour)
    assert all(len(colours) == 1 for colours in by_label.values())
    ends = _frame([("gpu", 0, 0.0, 1e-3, "embedding", 0, -1, -1, 1), ("gpu", 0, 1e-3, 2e-3, "attention", 0, 0, -1, 1),
                   ("gpu", 0, 2e-3, 3e-3, "lm_head", 0, -1, -1, 1), ("gpu", 0, 3e-3, 4e-3, "sampling", 0, -1, -1, 1)])
    legend = [t.get_text() for t in plot_gantt(ends, window=(0.0, 4e-3)).legends[0].get_texts()]
    assert legend == ["attention + gate", "embedding, dense layers, LM head, sampling"]


@pytest.fixture(scope="module")
def tiny_replay(tmp_path_factory) -> pd.DataFrame:
    """The timeline of a small replay whose spans cover most kinds (loads, prefetches, streaming, write-backs, CPU)."""
    from moesim.sim.run import simulate
    from tests.factories import random_routing, tiny_model, tiny_profile, write_tiny_trace
    model = tiny_model()
    routing = random_routing(np.random.default_rng(0), model, requests=1, prompt=3, decode=4)
    trace = str(write_tiny_trace(tmp_path_factory.mktemp("t") / "t.parquet", model, routing))
    runs = [simulate(trace, tiny_profile(), system, {"cache.slots_per_layer": "1"}, timeline=True)
            for system in ("hybrimoe", "mixtral-offloading")]
    return pd.DataFrame([span for run in runs for span in run.timeline], columns=list(TIMELINE_COLUMNS))


def test_gantt_bars_sit_in_their_resource_lane() -> None:
    frame = _decode_timeline(steps=1)
    fig = plot_gantt(frame, window=(0.0, 1.0))
    lane_of = {"cpu": 0, "gpu": 1, "pcie": 2}
    for collection in fig.axes[0].collections:
        if not isinstance(collection, PolyCollection):
            continue
        ys = np.concatenate([p.vertices[:, 1] for p in collection.get_paths()])
        centre = round(float(ys.mean()))
        assert abs(ys - centre).max() <= 0.4
        kind = collection.get_label()
        assert centre in {lane_of[r] for r in frame.loc[frame["kind"] == kind, "resource"]}


def test_gantt_writes_png_and_svg(tmp_path: Path) -> None:
    frame = _decode_timeline(steps=2)
    png = tmp_path / "figs" / "gantt.png"
    plot_gantt(frame, png, title="decode")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    svg = tmp_path / "gantt.svg"
    plot_gantt(frame, svg)
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["gantt.png", "gantt.svg"]


def test_gantt_unknown_suffix_keeps_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "gantt.jpg"
    path.write_bytes(b"old")
    with pytest.raises(ConfigError, match=r"\.jpg"):
        plot_gantt(_decode_timeline(steps=1), path)
    assert path.read_bytes() == b"old"


def test_default_window_is_first_steps() -> None:
    frame = _decode_timeline(steps=5)
    start, end = default_window(frame, steps=2)
    assert start == 0.0 and end == pytest.approx(2 * 4 * 4.5e-3)
    fig = plot_gantt(frame)
    assert _bars(fig) == 2 * 24


def test_default_window_caps_bars() -> None:
    frame = _decode_timeline(steps=3)
    start, end = default_window(frame, steps=3, max_bars=10)
    shown = frame[(frame["start_s"] < end) & (frame["end_s"] > start)]
    assert len(shown) == 10
    assert end == pytest.approx(frame["start_s"].sort_values().iloc[10])


def test_explicit_window_clips_spans() -> None:
    frame = _decode_timeline(steps=2)
    # 2.5-5.5 ms: layer 0's CPU expert (1-3 ms), prefetch (1-4), shared (3-4), stage (4-4.5) and layer 1's
    # attention (4.5-5.5) overlap it; layer 0's attention (0-1) and GPU expert (1-2) do not
    fig = plot_gantt(frame, window=(2.5e-3, 5.5e-3))
    assert _bars(fig) == 5
    xs = np.concatenate([p.vertices[:, 0] for c in fig.axes[0].collections if isinstance(c, PolyCollection)
                         for p in c.get_paths()])
    assert xs.min() >= 2.5 - 1e-9 and xs.max() <= 5.5 + 1e-9
    with pytest.raises(ConfigError, match="window"):
        plot_gantt(frame, window=(0.003, 0.001))


def test_gantt_three_lanes_even_without_transfers() -> None:
    frame = _decode_timeline(steps=1)
    frame = frame[frame["resource"] != "pcie"]
    fig = plot_gantt(frame, window=(0.0, 0.02))
    assert _lane_labels(fig) == ["CPU", "GPU", "PCIe H2D"]
    assert _bars(fig) == 16


def _metrics(system: str, **ms: float) -> dict:
    return {"system": system, "breakdown_ms": {k: ms.get(k, 0.0) for k in BREAKDOWN}}


def test_breakdown_stacks_categories_per_system(tmp_path: Path) -> None:
    runs = [_metrics("hybrimoe", attention=2.0, gpu_compute=3.0, wait_cache=5.0),
            _metrics("smoe", attention=2.0, gpu_compute=4.0, cpu_other=1.5)]
    path = tmp_path / "breakdown.png"
    fig = plot_breakdown(runs, path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["hybrimoe", "smoe"]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == 2 * 4  # four categories with time in some run
    tops = {}
    for bar in bars:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert tops == pytest.approx({0: 10.0, 1: 7.5})
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert set(legend) == {"attention + gate", "GPU compute", "wait for cache", "CPU not overlapped"}
    assert [t.get_text() for t in ax.texts] == ["10.0 ms", "7.5 ms"]


def test_breakdown_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="no runs"):
        plot_breakdown([], None)
    with pytest.raises(ConfigError, match="row 1"):
        plot_breakdown([_metrics("a", attention=1.0), {"system": "b"}], None)


def test_a_long_gantt_title_is_wrapped_inside_the_figure() -> None:
    """A sweep point's settings make a long title: it was cut off at the figure's right edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    title = "static-hot on t1.parquet, my.yaml (" + ", ".join(f"engine.setting_{i}={i}" for i in range(8)) + ")"
    fig = plot_gantt(_decode_timeline(steps=3), title=title)
    suptitle = fig._suptitle
    assert suptitle.get_text().replace("\n", " ").startswith(title + ": steps 0-1 of 3")
    assert "\n" in suptitle.get_text()
    FigureCanvasAgg(fig).draw()
    assert suptitle.get_window_extent(fig.canvas.get_renderer()).x1 <= fig.bbox.x1


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": 1}, "steps must be (first, last) step numbers, got 1"),  # TypeError: not subscriptable
    ({"steps": ("a", "b")}, "steps must be (first, last) step numbers, got ('a', 'b')"),  # ValueError: int('a')
    ({"steps": (0.5, 1)}, "steps must be (first, last) step numbers, got (0.5, 1)"),  # drew steps 0 to 1
    ({"steps": (2, 1)}, "steps=(2, 1) ends before it starts"),
    ({"window": (0.1,)}, "window must be (start_s, end_s) in seconds, got (0.1,)"),  # IndexError
    ({"window": 5}, "window must be (start_s, end_s) in seconds, got 5"),  # TypeError: not subscriptable
])
def test_gantt_steps_or_window_of_the_wrong_shape_is_one_line(kwargs, words) -> None:
    with pytest.raises(ConfigError) as err:
        plot_gantt(_decode_timeline(3), **kwargs)
    assert words in str(err.value) and err.value.field == next(iter(kwargs)) and "fix: give (" in str(err.value)
    assert plot_gantt(_decode_timeline(3), steps=[np.int64(1), 2]).axes  # a list and numpy numbers are fine


def test_steps_show_those_steps_though_a_copy_of_theirs_runs_on_into_later_ones() -> None:
    """A prefetch issued in step 1 that ran until step 3: steps=(1, 1) drew steps 1 to 3 and the title said
    'steps 0-3 (part of them)' (smoe, steps=(10, 12): 'steps 8-14'); the window ends where step 2 starts, and
    the title names the steps asked for."""
    frame = _decode_timeline(steps=4)
    step_start = frame.groupby("step")["start_s"].min()
    late = ("pcie", 1, float(step_start[1]) + 1e-3, float(step_start[3]) + 2e-3, "prefetch", 1, 0, 5, 0)
    frame = pd.concat([frame, _frame([late])], ignore_index=True)
    fig = plot_gantt(frame, steps=(1, 1))
    assert fig.axes[0].get_xlim() == pytest.approx((step_start[1] * 1e3, step_start[2] * 1e3))
    assert fig._suptitle.get_text().startswith("step 1 (part of it) of 4, ")
    assert plot_gantt(frame, steps=(2, 2))._suptitle.get_text().startswith("step 2 of 4, ")  # not steps 1-2
    inside = plot_gantt(frame, window=(float(step_start[0]) + 1e-3, float(step_start[0]) + 2e-3))
    assert inside._suptitle.get_text().startswith("step 0 (part of it) of 4, ")  # a window inside one step


def test_a_copy_lane_with_write_backs_is_not_labelled_host_to_device() -> None:
    """mixtral-offloading copies each evicted expert back (D2H) on the same engine: the lane said 'PCIe H2D'."""
    frame = _frame([("pcie", 0, 0.0, 1e-3, "load", 0, 0, 1, 0), ("pcie", 0, 1e-3, 2e-3, "writeback", 0, 0, 2, 0),
                    ("gpu", 0, 1e-3, 2e-3, "expert", 0, 0, 1, 1)])
    assert _lane_labels(plot_gantt(frame, window=(0.0, 2e-3))) == ["CPU", "GPU", "PCIe (H2D + D2H)"]
    assert _lane_labels(plot_gantt(frame[frame["kind"] != "writeback"], window=(0.0, 2e-3)))[-1] == "PCIe H2D"


def _stack_tops(ax) -> dict[int, float]:
    tops: dict[int, float] = {}
    for bar in (p for p in ax.patches if isinstance(p, Rectangle)):
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    return tops


def test_breakdown_bars_are_the_runs_makespans_and_say_so() -> None:
    """The bars' labels carried no unit and the figure did not say the parts make up the run: with makespan_s
    the title says each bar adds up to it, and a bar whose parts do not gives the run's time beside them."""
    runs = [{**_metrics("cpu-only", attention=2.0, cpu_other=8.0), "makespan_s": 0.010,
             "inputs": {"trace": "/x/t1.parquet", "hw": "rtx4090"}},
            {**_metrics("smoe", attention=2.0, wait_cache=5.0), "makespan_s": 0.007,
             "inputs": {"trace": "/x/t1.parquet", "hw": "rtx4090"}}]
    fig = plot_breakdown(runs)
    ax = fig.axes[0]
    assert _stack_tops(ax) == pytest.approx({0: 10.0, 1: 7.0})
    assert [t.get_text() for t in ax.texts] == ["10.0 ms", "7.0 ms"]
    assert ax.get_title(loc="left").replace("\n", " ") == \
        ("time breakdown per system on t1.parquet, rtx4090 (NVIDIA GeForce RTX 4090 + AMD EPYC 7T83, 10 cores, "
         "102.4 GB/s DRAM) each bar adds up to its run's makespan")
    assert "(ms)" in ax.get_ylabel()
    assert ax.get_ylim()[0] == 0
    runs[1]["makespan_s"] = 0.009  # parts 2 ms short of the run
    ax = plot_breakdown(runs).axes[0]
    assert [t.get_text() for t in ax.texts] == ["10.0 ms", "7.0 ms\n(run: 9.0 ms)"]
    assert "1 of 2 bars do not add up to their run's makespan" in ax.get_title(loc="left").replace("\n", " ")


def test_a_replays_breakdown_names_its_system_and_trace(tmp_path: Path) -> None:
    """run.plot_breakdown() was titled 'time breakdown per system' whatever the run."""
    import moesim
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, 7, requests=1, prompt=3, decode=4)
    run = moesim.replay(trace, hw=hw, system="hybrimoe", cache__slots_per_layer=1, timeline=False, decisions=False)
    ax = run.plot_breakdown().axes[0]
    title = ax.get_title(loc="left").replace("\n", " ")
    assert title.startswith(f"time breakdown of {run.system} on {Path(run.trace).name}")
    assert "the bar adds up to the run's makespan" in title
    total = sum(run.raw_metrics["breakdown_ms"].values())
    assert _stack_tops(ax)[0] == pytest.approx(total)
    assert total == pytest.approx(run.raw_metrics["makespan_s"] * 1e3, rel=1e-9)


def test_gantt_names_the_kinds_too_short_to_see() -> None:
    """Spans under a pixel are drawn half a pixel wide and faint: a GPU lane of short kernels looked idle with
    nothing said. The legend's title names them per lane (the CPU's wider experts are not named)."""
    frame = _decode_timeline(steps=1)
    note = plot_gantt(frame, window=(0.0, 2.0)).legends[0].get_title().get_text()  # 1.1 ms a pixel
    assert note == ("narrower than a pixel, so drawn faint: attention + gate / shared experts / routed expert "
                    "(GPU); streamed (staging) (PCIe H2D); a shorter window or fewer steps shows them")
    assert not plot_gantt(frame).legends[0].get_title().get_text()  # one step: every span is wide enough


def test_a_gantt_legend_of_many_kinds_stays_inside_the_figure() -> None:
    """Nine kinds (a HybriMoE layer: attention, scheduling, shared and routed experts, loads, prefetches, staged
    copies, the step's ends) in one legend row ran past both edges of the figure; it wraps at five a row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    rows, t = [], 0.0
    for kind, resource in (("embedding", "gpu"), ("attention", "gpu"), ("predict", "gpu"), ("shared", "gpu"),
                           ("expert", "gpu"), ("expert", "cpu"), ("load", "pcie"), ("prefetch", "pcie"),
                           ("stage", "pcie"), ("cache_management", "gpu")):
        rows.append((resource, 0, t, t + 1e-3, kind, 0, 0, -1, 1))
        t += 1e-3
    fig = plot_gantt(_frame(rows), window=(0.0, t))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    legend = fig.legends[0].get_window_extent(canvas.get_renderer())
    width = fig.bbox.width
    assert legend.x0 >= 0 and legend.x1 <= width
    assert len(fig.legends[0].get_texts()) == 9


def test_a_wrapped_title_keeps_each_number_with_its_unit() -> None:
    """A profile's parts in a narrow figure's title were broken between a number and its unit ('102.4' at a
    line's end, 'GB/s DRAM)' on the next)."""
    from moesim.analysis.plots import fit_width
    fig = Figure(figsize=(5.5, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    title = ("time breakdown of fiddler on mixtral-8x7b-humaneval.parquet / rtx4090 (NVIDIA GeForce RTX 4090 + "
             "AMD EPYC 7T83, 10 cores, 102.4 GB/s DRAM)")
    for width in range(30, 60, 2):  # every width of the title's room: no line ends with a number
        fig.set_size_inches(width / 10, 4.4)
        text = ax.set_title(title, loc="left", fontsize=11)
        fit_width(fig, text)
        lines = text.get_text().split("\n")
        assert " ".join(lines) == title
        assert not any(line.endswith(("10", "102.4")) for line in lines), lines
