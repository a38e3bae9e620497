"""The serving figure: latency percentiles against the arrival rate, one colour and marker per system."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from moesim.analysis.figures import PALETTE
from moesim.analysis.serving import PERCENTILES, plot_latency_vs_qps, plot_requests
from moesim.errors import ConfigError


def rows(systems: list[str], low: float, high: float) -> list[dict]:
    """Two rates per system; TTFT percentiles from ``low`` (first system, first rate) rising to ``high``."""
    out = []
    steps = len(systems) * 2 - 1
    for i, system in enumerate(systems):
        for j, qps in enumerate((1.0, 2.0)):
            value = low + (high - low) * (2 * i + j) / max(steps, 1)
            out.append({"system": system, "qps": qps, **{f"ttft_ms_p{q}": value * (1 + q / 1000) for q in PERCENTILES}})
    return out


@pytest.mark.parametrize("low, high, scale", [(1500.0, 3300.0, "linear"), (1500.0, 70000.0, "log")])
def test_the_latency_axis_is_logarithmic_only_across_a_decade(low, high, scale):
    fig = plot_latency_vs_qps(rows(["gpu-only-lru", "cpu-only"], low, high))
    try:
        assert fig.axes[0].get_yscale() == scale
        assert fig.axes[0].get_ylabel() == ("TTFT (ms), log scale" if scale == "log" else "TTFT (ms)")
        if scale == "log":  # plain numbers, not 2 x 10^3
            labels = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
            assert labels and all("10^" not in t and "times" not in t for t in labels)
    finally:
        plt.close(fig)


def test_the_latency_figure_leaves_the_notebooks_backend_and_figures_alone(tmp_path):
    """It used to switch matplotlib to Agg when saving, after which a notebook's inline plots showed nothing."""
    import matplotlib
    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    fig = plot_latency_vs_qps(rows(["cpu-only"], 100.0, 200.0), path=tmp_path / "lat.png")
    assert matplotlib.get_backend() == backend and plt.get_fignums() == figures
    assert (tmp_path / "lat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"  # displays in a notebook without a backend


def test_each_system_has_its_own_colour_past_ten_systems():
    systems = [f"system-{i}" for i in range(12)]
    fig = plot_latency_vs_qps(rows(systems, 100.0, 200.0))
    try:
        lines = fig.axes[0].get_lines()
        colours = [lines[i * len(PERCENTILES)].get_color() for i in range(len(systems))]
        assert len(set(colours)) == len(systems) and colours[0] == PALETTE[0]
        styles = {line.get_linestyle() for line in lines[:len(PERCENTILES)]}
        assert len(styles) == len(PERCENTILES)  # the percentiles of one system: one line style each
    finally:
        plt.close(fig)


def test_the_latency_legend_keys_systems_and_percentiles_outside_the_axes():
    """Nine 'system pNN' entries sat inside the axes where matplotlib found room, over lines (three systems at
    0.05-0.5 req/s), and the figure had no title: now one entry per system and per percentile, right of the
    axes, and a title naming the latency."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = plot_latency_vs_qps([{**row, "requests": 20} for row in rows(["a", "b", "c"], 100.0, 5000.0)])
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    assert not ax.get_legend() and len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b", "c", "p50", "p90", "p99"]
    assert not fig.legends[0].get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    assert ax.get_title(loc="left") == "TTFT per request vs arrival rate, 20 requests a run: p50, p90, p99 per system"
    # serve-sim --plot names the profile, which the rows do not carry
    named = plot_latency_vs_qps(rows(["a"], 100.0, 200.0), hw="rtx4090")
    assert named.axes[0].get_title(loc="left").startswith("TTFT per request vs arrival rate on rtx4090")


def test_each_request_is_a_row_of_queued_prefill_and_decode_bars_in_order_of_arrival():
    import pandas as pd
    frame = pd.DataFrame({"request": [0, 1, 2], "arrival_s": [0.5, 0.0, 1.0], "scheduled_s": [0.7, 0.0, 1.0],
                          "first_token_s": [0.9, 0.2, 1.5], "finish_s": [2.0, 0.6, 1.5], "preemptions": [1, 0, 0]})
    fig = plot_requests(frame)
    try:
        ax = fig.axes[0]
        bars = {c.get_label(): [(round(b.get_y() + b.get_height() / 2), round(b.get_x()), round(b.get_width()))
                                for b in c] for c in ax.containers}
        # rows by arrival: request 1 (row 0), request 0 (row 1), request 2 (row 2); times in ms
        assert bars["queued"] == [(0, 0, 0), (1, 500, 200), (2, 1000, 0)]
        assert bars["prefill to first token"] == [(0, 0, 200), (1, 700, 200), (2, 1000, 500)]
        assert bars["decode"] == [(0, 200, 400), (1, 900, 1100), (2, 1500, 0)]
        marks = [line for line in ax.get_lines() if line.get_label().startswith("preempted")]
        assert len(marks) == 1 and marks[0].get_label() == "preempted (1 request)"
        assert marks[0].get_xdata().tolist() == [2000.0] and marks[0].get_ydata().tolist() == [1]
        assert ax.get_ylim()[0] > ax.get_ylim()[1]  # the first arrival on top
        assert ax.get_xlabel() == "time (ms)"
        assert all(float(t).is_integer() for t in ax.get_yticks())  # rows are requests
    finally:
        plt.close(fig)
    longer = frame.assign(finish_s=frame.finish_s * 10)  # past 10 s: seconds
    fig = plot_requests(longer)
    try:
        assert fig.axes[0].get_xlabel() == "time (s)"
        assert max(b.get_x() + b.get_width() for b in fig.axes[0].containers[2]) == pytest.approx(20.0)
    finally:
        plt.close(fig)
    with pytest.raises(ConfigError, match="no request to draw"):
        plot_requests(frame.iloc[:0])


def test_the_request_legend_covers_no_request():
    """A burst (every request arrives at once, most wait) fills the lower left, where the legend sat inside
    the axes over the last rows' queueing: it stands below them now, every phase named."""
    import pandas as pd
    n = 40
    frame = pd.DataFrame({"request": range(n), "arrival_s": [0.0] * n, "scheduled_s": [3.0 * i for i in range(n)],
                          "first_token_s": [3.0 * i + 0.1 for i in range(n)],
                          "finish_s": [3.0 * i + 3 for i in range(n)], "preemptions": [i % 2 for i in range(n)]})
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = plot_requests(frame)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    assert not fig.axes[0].get_legend() and len(fig.legends) == 1
    legend = fig.legends[0]
    assert sorted(t.get_text() for t in legend.get_texts()) == ["decode", "preempted (20 requests)",
                                                               "prefill to first token", "queued"]
    box = legend.get_window_extent(renderer)
    assert not box.overlaps(fig.axes[0].get_window_extent(renderer))
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)


def test_the_latency_figure_and_the_slo_search_take_serve_runs_and_name_a_wrong_argument():
    """plot_latency_vs_qps(metric='ttft') and max_qps_under_slo(slo={'ttft': ...}) failed with KeyError
    ('ttft_p50', 'ttft_p90'), a list of moesim.serve runs with KeyError on the percentile columns, no runs with
    KeyError 'system', percentile=95 with KeyError 'ttft_ms_p95', and an SLO string (as moesim.serve takes it)
    with AttributeError."""
    from types import SimpleNamespace

    from moesim.analysis.serving import max_qps_under_slo
    table = rows(["gpu-only-lru", "cpu-only"], 100.0, 200.0)
    runs = [SimpleNamespace(metrics=row) for row in table]  # what moesim.serve returns, as far as these read
    plt.close(plot_latency_vs_qps(runs))
    # p90 TTFT: gpu-only-lru 109 and 145 ms, cpu-only 182 and 218 ms at 1 and 2 req/s
    assert max_qps_under_slo(runs, "ttft_ms=190") == max_qps_under_slo(table, {"ttft_ms": 190}) == \
        {"gpu-only-lru": 2.0, "cpu-only": 1.0}
    for call, field, words in [
        (lambda: plot_latency_vs_qps(table, metric="ttft"), "metric",
         "no latency 'ttft' in the runs (fix: did you mean ttft_ms? use one of ttft_ms)"),
        (lambda: plot_latency_vs_qps([]), "rows", "no serving runs given"),
        (lambda: max_qps_under_slo(table, {"ttft": 1}), "slo", "unknown SLO 'ttft'"),
        (lambda: max_qps_under_slo(table, {"ttft_ms": 1}, percentile=95), "percentile",
         "no p95 of ttft_ms: runs keep p50, p90, p99"),
        (lambda: max_qps_under_slo([{"qps": 1.0}], {"ttft_ms": 1}), "rows", "no column 'system'"),
    ]:
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.field == field and words in str(err.value)


def test_runs_of_other_settings_are_drawn_apart_in_the_report_and_named_when_averaged():
    """A sweep over two traces and two schedulers was averaged into one line per system, the figure not saying
    so: a Mixtral trace's TTFT and a small model's made one line of neither."""
    import pandas as pd

    from moesim.analysis.serving import serving_figures
    frame = pd.DataFrame([{**row, "trace": f"traces/{trace}.parquet", "hw": "rtx4090", "scheduler": scheduler,
                           "workload.qps": row["qps"], "tpot_ms_p50": 1.0, "tpot_ms_p90": 1.0, "tpot_ms_p99": 1.0,
                           "e2e_ms_p50": 1.0, "e2e_ms_p90": 1.0, "e2e_ms_p99": 1.0}
                          for trace, scale in (("big", 100.0), ("small", 1.0)) for scheduler in ("sarathi", "vllm")
                          for row in rows(["cpu-only"], 10.0 * scale, 20.0 * scale)])
    fig = plot_latency_vs_qps(frame)
    try:
        assert "mean over trace, scheduler" in fig.axes[0].get_title(loc="left")
    finally:
        plt.close(fig)
    figures = serving_figures(frame)
    try:
        assert len(figures) == 3 * 4
        fig, caption = figures["ttft_ms_vs_qps_3"]
        assert caption.endswith("(trace = small.parquet, scheduler = vllm).")
        title = fig.axes[0].get_title(loc="left")
        assert "on rtx4090" in title and "trace = small.parquet, scheduler = vllm" in title and "mean" not in title
        assert max(fig.axes[0].get_lines()[0].get_ydata()) < 30  # the small trace's alone
    finally:
        for fig, _ in figures.values():
            plt.close(fig)


@pytest.mark.parametrize("rates, scale", [((0.05, 0.4), "linear"), ((0.01, 4.0), "log")])
def test_the_rate_axis_is_logarithmic_only_across_a_decade(rates, scale):
    """Rates from 0.01 to 4 req/s on a linear axis put every point below 0.5 req/s, where the latency of an
    offloading system turns up, in a smear at its left edge."""
    frame = [{**row, "qps": rates[int(row["qps"]) - 1]} for row in rows(["cpu-only"], 100.0, 200.0)]
    fig = plot_latency_vs_qps(frame)
    try:
        assert fig.axes[0].get_xscale() == scale
        assert fig.axes[0].get_xlabel() == "arrival rate (requests/s)" + (", log scale" if scale == "log" else "")
    finally:
        plt.close(fig)


def test_a_long_request_title_is_wrapped_inside_the_figure():
    """serve-sim's title (system, the profile's GPU and CPU, the requests and their rate) ran past the right
    edge of the request figure, cut off mid-rate ("at 0.5" with no unit)."""
    import pandas as pd
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    frame = pd.DataFrame({"request": [0, 1], "arrival_s": [0.0, 1.0], "scheduled_s": [0.0, 1.0],
                          "first_token_s": [0.2, 1.2], "finish_s": [0.6, 1.6], "preemptions": [0, 0]})
    title = ("static-hot on a100-40g (NVIDIA A100 40GB + 2x Intel Xeon Platinum 8452Y, 72 cores, 440 GB/s DRAM): "
             "20 requests at 0.5 req/s")
    fig = plot_requests(frame, title=title)
    try:
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        text = fig.axes[0].title if fig.axes[0].get_title() else fig.axes[0]._left_title
        assert " ".join(text.get_text().split("\n")) == title
        box = text.get_window_extent(canvas.get_renderer())
        assert box.x1 <= fig.bbox.x1
    finally:
        plt.close(fig)
