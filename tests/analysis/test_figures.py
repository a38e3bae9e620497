"""Sweep figures: lines per hue, panels per facet, averaging, bars, the standard set, `moesim plot`."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from moesim.analysis.figures import (fig_breakdown, fig_gantt, fig_hit_rate_vs_prefetch, fig_tpot_vs_slots,
                                     gantt_point, is_bound, load_results, plot_results, plot_scatter,
                                     representative, standard_figures)
from moesim.cli import main
from moesim.errors import ConfigError
from moesim.sim.bookkeeping import BREAKDOWN
from moesim.sweep import load_spec, run_sweep
from tests.factories import write_sweep_files


def results() -> pd.DataFrame:
    """2 profiles x 3 systems x slots 1, 2, 4: TPOT = base / slots, a bound flat at 5 ms; one failed point."""
    rows = []
    for hw, scale in (("a100-40g", 1.0), ("h100-pcie", 0.5)):
        for system, base in (("gpu-only-lru", 100.0), ("static-hot", 60.0), ("all-in-gpu", None)):
            for slots in (1, 2, 4):
                tpot = 5.0 if base is None else base * scale / slots
                rows.append({"point_id": f"{hw}-{system}-{slots}", "trace": "traces/x.parquet", "hw": hw,
                             "system": system, "seed": 0, "cache.slots_per_layer": slots, "status": "ok",
                             "error": "", "tpot_ms_mean": tpot, "gpu_hit_rate": slots / 8,
                             "prefetches": 0, "decode_tokens": 10, "prefill_tokens": 0,
                             **{f"breakdown_{c}_ms": (i + 1) * slots * scale for i, c in enumerate(BREAKDOWN)}})
    rows.append({**rows[0], "point_id": "bad", "cache.slots_per_layer": 9, "status": "error",
                 "error": "does not fit", "tpot_ms_mean": np.nan})
    return pd.DataFrame(rows)


def lines(ax) -> list:
    return [line for line in ax.get_lines() if len(line.get_xdata())]


def test_one_line_per_hue_and_one_panel_per_facet():
    fig = plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system", facet="hw")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["hw = a100-40g", "hw = h100-pcie"]
    assert [len(lines(ax)) for ax in panels] == [3, 3]
    lru = lines(panels[1])[0]  # registry order: gpu-only-lru first, bounds last
    assert list(lru.get_xdata()) == [1, 2, 4]
    assert list(lru.get_ydata()) == pytest.approx([50.0, 25.0, 12.5])
    bound = lines(panels[0])[2]
    assert bound.get_linestyle() == "--" and list(bound.get_ydata()) == [5.0, 5.0, 5.0]
    assert panels[0].get_yscale() == "log"  # 100 ms vs 5 ms spans more than 10x
    assert panels[0].get_ylabel() == "TPOT, mean (ms), log scale"  # its plain tick labels did not tell it
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["gpu-only-lru", "static-hot", "all-in-gpu (reference)"]
    assert panels[0].get_xlabel() == "GPU cache slots per layer"


def test_a_figure_says_how_many_points_failed_and_are_not_drawn():
    """A facet whose failed points simply had no markers (slots 2 and 3 did not fit on rtx4090) read as a
    sweep that never ran them: the heading says so, in line plots and scatters alike."""
    said = "1 of 19 points failed, not drawn (their 'error' column says why)"
    lined = plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system", facet="hw")
    assert said in lined._suptitle.get_text().replace("\n", " ")
    scattered = plot_scatter(results(), x="gpu_hit_rate", y="tpot_ms_mean")
    assert said in scattered._suptitle.get_text().replace("\n", " ")
    every = results()[results()["status"] == "ok"]
    assert "failed" not in plot_results(every, x="cache.slots_per_layer", y="tpot_ms_mean")._suptitle.get_text()


def test_parameters_not_shown_are_averaged_with_a_min_max_band():
    fig = plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    ax = fig.axes[0]
    lru = lines(ax)[0]
    assert list(lru.get_ydata()) == pytest.approx([75.0, 37.5, 18.75])  # mean of a100 (x1) and h100 (x0.5)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # the bound is the same on both profiles: no band
    assert "mean over hw" in fig._suptitle.get_text()
    linear = plot_results(results(), x="cache.slots_per_layer", y="gpu_hit_rate", hue="system", logy=False)
    assert linear.axes[0].get_yscale() == "linear"


def test_an_undotted_setting_swept_is_a_parameter_named_when_averaged():
    """A sweep over ``scheduler`` (or ``runtime``, ``cache=...``) was averaged without a word: only dotted keys
    counted as parameters, so the heading said nothing of the two schedulers mixed in each point."""
    frame = results()
    frame = pd.concat([frame.assign(scheduler="vllm"), frame.assign(scheduler="sarathi",
                                                                    point_id=frame["point_id"] + "-s")])
    fig = plot_results(frame[frame["hw"] == "a100-40g"], x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    assert "mean over scheduler (band" in fig._suptitle.get_text()
    fig = plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean", facet="scheduler")
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["scheduler = sarathi", "scheduler = vllm"]


def test_points_averaging_fewer_runs_are_hollow_named_and_warned():
    """Drop h100's static-hot at 2 and 4 slots (as failed points would be): those two means are a100's alone
    (60/2 = 30 and 60/4 = 15 ms, not 22.5 and 11.25), so they are drawn hollow, the title says so and a
    warning names them; complete results say nothing."""
    from moesim.analysis.figures import UnevenMeans
    frame = results()
    gone = (frame["hw"] == "h100-pcie") & (frame["system"] == "static-hot") & (frame["cache.slots_per_layer"] > 1)
    with pytest.warns(UnevenMeans, match=r"2 of 9 points average 1 run instead of 2"):
        fig = plot_results(frame[~gone], x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    ax = fig.axes[0]
    static = lines(ax)[1]
    assert list(static.get_ydata()) == pytest.approx([45.0, 30.0, 15.0])
    hollow = [line for line in lines(ax) if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [2, 4]
    assert list(hollow[0].get_ydata()) == pytest.approx([30.0, 15.0])
    assert "2 of 9 points average 1 run instead of 2" in fig._suptitle.get_text()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnevenMeans)
        whole = plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    assert not [line for line in lines(whole.axes[0]) if line.get_markerfacecolor() == "white"]


def test_a_parameter_only_some_systems_take_leaves_the_others_points_complete():
    """A sweep's per_system grid: static-hot ran with prefetch.n 1 and 2, gpu-only-lru has no prefetch.n (empty).
    gpu-only-lru's one run per x is all it has, not a failed point; a missing static-hot run still is one."""
    import warnings
    from moesim.analysis.figures import UnevenMeans
    frame = results().query("status == 'ok' and hw == 'a100-40g' and system != 'all-in-gpu'").copy()
    frame["prefetch.n"] = np.where(frame["system"] == "static-hot", 1.0, np.nan)
    second = frame[frame["system"] == "static-hot"].assign(**{"prefetch.n": 2.0})
    second["tpot_ms_mean"] -= 10.0
    frame = pd.concat([frame, second], ignore_index=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnevenMeans)
        fig = plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    assert "mean over prefetch.n" in fig._suptitle.get_text() and "instead of" not in fig._suptitle.get_text()
    assert not [line for line in lines(fig.axes[0]) if line.get_markerfacecolor() == "white"]
    gone = (frame["system"] == "static-hot") & (frame["prefetch.n"] == 2.0) & (frame["cache.slots_per_layer"] == 4)
    with pytest.warns(UnevenMeans, match=r"1 of 6 points average 1 run instead of 2"):
        fig = plot_results(frame[~gone], x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    hollow = [line for line in lines(fig.axes[0]) if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [4]


def test_runs_without_the_x_parameter_are_left_out_and_named():
    """x a parameter only static-hot took (per_system): gpu-only-lru's rows have no value of it. They were kept
    as a point of their own (3 runs), so every static-hot point was drawn hollow, "averaging 1 run instead of 3",
    and the legend of a hue held an empty 'default' line."""
    import warnings
    from moesim.analysis.figures import UnevenMeans
    frame = results().query("status == 'ok' and hw == 'a100-40g' and system != 'all-in-gpu'").copy()
    frame["prefetch.n"] = np.where(frame["system"] == "static-hot", frame["cache.slots_per_layer"], np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnevenMeans)
        fig = plot_results(frame, x="prefetch.n", y="tpot_ms_mean", hue="system")
    title = " ".join(fig._suptitle.get_text().split())  # wrapped to the figure's width
    assert "instead of" not in title and "3 runs without prefetch.n (gpu-only-lru) not drawn" in title
    assert not [line for line in lines(fig.axes[0]) if line.get_markerfacecolor() == "white"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["static-hot"]
    with pytest.raises(ConfigError, match="no finished point has a value of 'prefetch.n'"):
        plot_results(frame[frame["system"] == "gpu-only-lru"], x="prefetch.n", y="tpot_ms_mean")


def test_cli_plot_notes_failed_and_unevenly_averaged_points(tmp_path, capsys):
    frame = results()
    gone = (frame["hw"] == "h100-pcie") & (frame["system"] == "static-hot") & (frame["cache.slots_per_layer"] > 1)
    frame.loc[gone, "status"] = "error"
    frame.loc[gone, "error"] = "does not fit"
    frame.loc[gone, "tpot_ms_mean"] = np.nan
    path = tmp_path / "r.parquet"
    frame.to_parquet(path)
    assert main(["plot", str(path), "--x", "cache.slots_per_layer", "--y", "tpot_ms_mean",
                 "--out", str(tmp_path / "f.png")]) == 0
    err = capsys.readouterr().err
    assert "3 of 19 points failed and are not drawn" in err
    assert "2 of 9 points average 1 run instead of 2" in err


@pytest.mark.filterwarnings("ignore::moesim.analysis.figures.UnevenMeans")  # slots 1 and 2 share an x
def test_a_narrow_range_is_labelled_in_plain_numbers():
    """Planned GPU memory 23.9913-23.9943 GiB: matplotlib would label it "0.0015 ... +2.399e1"."""
    frame = results().query("status == 'ok'").assign(
        gpu_memory_gib=lambda f: 23.9913 + 0.003 * (f["cache.slots_per_layer"] == 4))
    for fig in (plot_scatter(frame, x="gpu_memory_gib", y="tpot_ms_mean"),
                plot_results(frame, x="gpu_memory_gib", y="tpot_ms_mean", hue="system")):
        fig.canvas.draw()
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert ax.xaxis.get_offset_text().get_text() == "" and labels
        assert all(label.startswith("23.99") for label in labels), labels


def test_categorical_x_draws_grouped_bars():
    """Bars stand on a linear axis from zero though the values span a decade (a log axis drew them from an
    arbitrary bottom, their lengths meaningless); systems in the order of every other figure, bounds last, named
    as in the legends (all-in-gpu's bar read as a deployable system's: the ticks said "all-in-gpu" alone)."""
    fig = plot_results(results(), x="system", y="tpot_ms_mean", hue="hw")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpu-only-lru", "static-hot", "all-in-gpu (reference)"]
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 6
    lru_a100 = np.mean([100.0, 50.0, 25.0])
    assert heights[0] == pytest.approx(lru_a100)
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    assert "log" not in ax.get_ylabel()


def test_bars_past_the_palette_are_hatched_apart():
    """A hue per system of the catalogue is more than the palette's colours: a repeated colour is hatched,
    in the bars and in the legend, so no two hues look the same."""
    from moesim.analysis.figures import PALETTE
    frame = results()
    names = [f"system-{i:02d}" for i in range(len(PALETTE) + 2)]
    frame = pd.concat([frame.assign(system=name) for name in names], ignore_index=True)
    fig = plot_results(frame, x="hw", y="tpot_ms_mean", hue="system")
    looks = [(tuple(p.get_facecolor()), p.get_hatch() or "") for p in fig.axes[0].patches]
    per_hue = looks[::2]  # two profiles: each hue's bars come in pairs
    assert len(per_hue) == len(names) and len(set(per_hue)) == len(names)
    assert per_hue[len(PALETTE)][0] == per_hue[0][0] and per_hue[len(PALETTE)][1] == "///"
    legend = [(tuple(h.get_facecolor()), h.get_hatch() or "") for h in fig.legends[0].legend_handles]
    assert legend == per_hue


def test_unknown_columns_name_what_there_is():
    with pytest.raises(ConfigError) as err:
        plot_results(results(), x="slots", y="tpot_ms_mean")
    text = str(err.value)
    assert "no column 'slots'" in text and "cache.slots_per_layer" in text and "tpot_ms_mean" in text
    fig = plot_results(results(), x="cache__slots_per_layer", y="tpot_ms_mean")  # the Python spelling works
    assert len(lines(fig.axes[0])) == 1


def test_every_point_failed_is_one_line():
    frame = results().assign(status="error")
    with pytest.raises(ConfigError, match="no finished points"):
        plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean")


def test_representative_is_the_middle_value_and_breakdown_stacks_it():
    frame = results()
    assert representative(frame[frame["status"] == "ok"]) == {"hw": "a100-40g", "cache.slots_per_layer": 2}
    fig = fig_breakdown(frame)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpu-only-lru", "static-hot", "all-in-gpu (reference)"]
    per_bar = {}
    for patch in ax.patches:
        per_bar.setdefault(round(patch.get_x(), 3), 0.0)
        per_bar[round(patch.get_x(), 3)] += patch.get_height()
    expected = sum((i + 1) * 2 for i in range(len(BREAKDOWN)))  # slots = 2, a100 scale 1
    assert list(per_bar.values()) == pytest.approx([expected] * 3)
    assert "hw=a100-40g, cache.slots_per_layer=2" in ax.get_title(loc="left")
    # a sweep's rows carry each run's makespan: the figure says whether the bars add up to it
    frame["makespan_s"] = frame.filter(like="breakdown_").sum(axis=1) / 1e3
    assert "each bar adds up to its run's makespan" in fig_breakdown(frame).axes[0].get_title(loc="left")
    frame["makespan_s"] *= 2
    assert "3 of 3 bars do not add up" in fig_breakdown(frame).axes[0].get_title(loc="left").replace("\n", " ")


def test_standard_set_and_bounds():
    assert is_bound("oracle") and is_bound("all-in-gpu") and not is_bound("gpu-only-lru")
    figs = standard_figures(results(), gantt=False)
    assert list(figs) == ["tpot_vs_slots", "hit_rate_vs_prefetch", "breakdown"]
    assert all(isinstance(fig, Figure) for fig, _ in figs.values())
    scatter = fig_hit_rate_vs_prefetch(results().assign(prefetches=3))
    assert sum(len(c.get_offsets()) for c in scatter.axes[0].collections) == 18
    swept = results().assign(**{"prefetch.count": lambda f: f["cache.slots_per_layer"]})
    by_param = fig_hit_rate_vs_prefetch(swept)
    assert by_param.axes[0].get_xlabel() == "prefetch.count"
    assert fig_tpot_vs_slots(results()).axes[0].get_title() == "hw = a100-40g"


@pytest.fixture
def sweep_results(tmp_path):
    write_sweep_files(tmp_path, seed=11)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only", "gpu-only-lru", "static-hot"],
        "grid": {"cache.slots_per_layer": [1, 2, 3]}}))
    run_sweep(load_spec(tmp_path / "spec.yaml"), tmp_path / "r.parquet", workers=1)
    return tmp_path / "r.parquet"


def test_gantt_replays_the_point_with_its_timeline(sweep_results):
    frame = load_results(sweep_results)
    row = frame[(frame["system"] == "gpu-only-lru") & (frame["cache.slots_per_layer"] == 1)].iloc[0]
    fig = fig_gantt(row)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["CPU", "GPU", "PCIe H2D"]
    bars = sum(len(c.get_paths()) for c in ax.collections if isinstance(c, PolyCollection))
    assert bars > 0
    assert "cache.slots_per_layer=1" in fig._suptitle.get_text()
    gone = row.copy()
    gone["trace_path"] = str(sweep_results.parent / "moved.parquet")
    with pytest.raises(ConfigError, match="--no-gantt"):
        fig_gantt(gone)


def test_cli_plot_draws_a_line_per_system_unless_told_otherwise(sweep_results, tmp_path, monkeypatch):
    """Averaging TPOT over the systems (and bounds) of a sweep hides the comparison the sweep was run for."""
    import moesim.analysis.figures as figures
    hues = []
    monkeypatch.setattr(figures, "plot_results", lambda frame, **kw: hues.append(kw["hue"]))
    monkeypatch.setattr(figures, "plot_scatter", lambda frame, **kw: hues.append(kw["hue"]))
    out = str(tmp_path / "f.png")
    for extra in ([], ["--hue", "none"], ["--hue", "hw"], ["--facet", "system"]):
        assert main(["plot", str(sweep_results), "--x", "cache.slots_per_layer", "--y", "tpot_ms_mean",
                     *extra, "--out", out]) == 0
    assert main(["plot", str(sweep_results), "--x", "system", "--y", "gpu_hit_rate", "--out", out]) == 0
    assert main(["plot", str(sweep_results), "--x", "gpu_memory_gib", "--y", "tpot_ms_mean", "--out", out]) == 0
    assert hues == ["system", None, "hw", None, None, "system"]


def test_cli_plot_writes_png_and_svg(sweep_results, tmp_path, capsys):
    png, svg = tmp_path / "f.png", tmp_path / "f.svg"
    assert main(["plot", str(sweep_results), "--x", "cache.slots_per_layer", "--y", "tpot_ms_mean",
                 "--hue", "system", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(sweep_results), "--x", "system", "--y", "gpu_hit_rate", "--out", str(svg)]) == 0
    assert b"<svg" in svg.read_bytes()[:500]
    capsys.readouterr()
    assert main(["plot", str(sweep_results), "--x", "cache.slots_per_layer", "--y", "nope", "--out",
                 str(png)]) == 2
    assert "no column 'nope'" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "t.parquet"), "--x", "a", "--y", "b", "--out", str(png)]) == 2
    assert "not a sweep result" in capsys.readouterr().err


def test_representative_of_a_zipped_sweep_is_a_point_it_ran():
    """zip: varies parameters together: their middle values taken one by one make a point never run
    (kernels 1 with bandwidth 0.5 here), and `moesim report` failed with 'no finished point with ...'."""
    frame = pd.concat([results().assign(**{"hw.pcie.bandwidth_scale": bw, "engine.kernels_per_expert": k,
                                           "point_id": lambda f, bw=bw: f["point_id"] + f"-{bw}"})
                       for bw, k in ((0.5, 3), (1.0, 1))], ignore_index=True)
    ok = frame[frame["status"] == "ok"]
    where = representative(ok)
    assert where == {"hw": "a100-40g", "cache.slots_per_layer": 2, "hw.pcie.bandwidth_scale": 0.5,
                     "engine.kernels_per_expert": 3}
    fig = fig_breakdown(frame)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["gpu-only-lru", "static-hot",
                                                                     "all-in-gpu (reference)"]
    assert list(standard_figures(frame, gantt=False)) == ["tpot_vs_slots", "hit_rate_vs_prefetch", "breakdown"]


def test_representative_skips_a_middle_value_whose_points_failed_there():
    frame = results()
    # the middle cache size failed on the first profile only
    frame.loc[(frame["cache.slots_per_layer"] == 2) & (frame["hw"] == "a100-40g"), "status"] = "error"
    ok = frame[frame["status"] == "ok"]
    assert representative(ok) == {"hw": "a100-40g", "cache.slots_per_layer": 1}
    fig_breakdown(frame)


def _inside_figure(fig, text) -> bool:
    """Whether every line of ``text`` (a title) ends inside the figure as saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    return text.get_window_extent(fig.canvas.get_renderer()).x1 <= fig.bbox.x1


def test_long_titles_are_wrapped_inside_the_figure():
    """A layout engine makes room for a title's height, not its width: the note under a plot's heading and
    the breakdown's setting were cut off at the right edge ('... average 2 runs instead of 4 (runs fa')."""
    frame = results()
    frame.loc[frame["hw"] == "h100-pcie", "status"] = "error"  # fewer runs at some points: a long note
    frame = frame.assign(**{"engine.kernels_per_expert": 1}, trace="traces/a-rather-long-trace-name.parquet")
    frame = pd.concat([frame, frame.assign(trace="traces/another-rather-long-trace-name.parquet",
                                           point_id=frame["point_id"] + "-2")], ignore_index=True)
    frame.loc[(frame["trace"].str.contains("another")) & (frame["cache.slots_per_layer"] == 4), "status"] = "error"
    with pytest.warns(UserWarning):
        fig = plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    title = fig._suptitle
    assert "points average 1 run instead of 2" in title.get_text().replace("\n", " ")
    assert title.get_text().count("\n") >= 2 and _inside_figure(fig, title)
    scatter = plot_scatter(frame, x="cache.slots_per_layer", y="tpot_ms_mean", hue="system",
                           title="TPOT, mean (ms) against GPU cache slots per layer on every trace of this sweep")
    assert _inside_figure(scatter, scatter._suptitle)
    wide = frame.assign(**{f"engine.setting_{i}": i for i in range(4)})
    bars = fig_breakdown(wide, {"trace": "traces/a-rather-long-trace-name.parquet", "hw": "a100-40g",
                                "cache.slots_per_layer": 2, "engine.kernels_per_expert": 1})
    heading = bars.axes[0].title if bars.axes[0].title.get_text() else bars.axes[0]._left_title
    assert heading.get_text().replace("\n", " ") == ("time breakdown per system (trace=a-rather-long-trace-name.parquet, "
                                                     "hw=a100-40g, cache.slots_per_layer=2, engine.kernels_per_expert=1) "
                                                     "on a100-40g (NVIDIA A100 40GB + 2x Intel Xeon Platinum 8452Y, "
                                                     "72 cores, 440 GB/s DRAM)")
    assert "\n" in heading.get_text() and _inside_figure(bars, heading)


def test_breakdown_bars_follow_registry_order_with_bounds_last():
    """Rows come in the order the workers finished them: the bars followed it (a bound between systems). The bars
    are named as the legends name systems: the reference's said 'all-in-gpu' alone, as if it were deployable."""
    frame = results().sample(frac=1.0, random_state=3).reset_index(drop=True)
    frame = pd.concat([frame[frame["system"] == "all-in-gpu"], frame[frame["system"] == "static-hot"],
                       frame[frame["system"] == "gpu-only-lru"]], ignore_index=True)
    fig = fig_breakdown(frame, {"hw": "h100-pcie", "cache.slots_per_layer": 4})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpu-only-lru", "static-hot", "all-in-gpu (reference)"]
    totals = {}
    for patch in ax.patches:
        totals[round(patch.get_x(), 3)] = totals.get(round(patch.get_x(), 3), 0.0) + patch.get_height()
    expected = sum((i + 1) * 4 * 0.5 for i in range(len(BREAKDOWN)))  # slots 4, h100 scale 0.5: all the same
    assert list(totals.values()) == pytest.approx([expected] * 3)


def _many_systems() -> pd.DataFrame:
    from moesim.policy.systems import SYSTEMS
    names = [s for s in SYSTEMS][:18]
    return pd.DataFrame([{"point_id": f"{s}-{slots}", "trace": "t.parquet", "hw": "a100-40g", "system": s,
                          "seed": 0, "cache.slots_per_layer": slots, "status": "ok", "error": "",
                          "tpot_ms_mean": 10.0 * (i + 1) / slots, "gpu_memory_gib": 4.0 * slots + i}
                         for i, s in enumerate(names) for slots in (1, 2)])


def test_a_long_legend_stays_clear_of_the_title_and_inside_the_figure():
    """18 systems (`systems: all`) in one legend column ran over the scatter's two title lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    for fig in (plot_scatter(_many_systems(), x="gpu_memory_gib", y="tpot_ms_mean"),
                plot_results(_many_systems(), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")):
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        assert not box.overlaps(fig._suptitle.get_window_extent(renderer))
        assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
        texts = [t.get_text() for t in legend.get_texts()]
        assert len([t for t in texts if t != "Pareto front"]) == 18
    scatter = plot_scatter(_many_systems(), x="gpu_memory_gib", y="tpot_ms_mean")
    assert scatter.legends[0]._ncols == 2  # the two title lines span the figure: two columns fit below them
    line = plot_results(_many_systems().head(6), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    assert line.legends[0]._ncols == 1  # a short legend keeps one column


def test_without_any_prefetch_the_hit_rate_is_drawn_against_the_cache_size():
    """Every run's prefetches are 0: against prefetches per token every marker sat at x = 0. The hit rate
    is drawn per cache size instead (slots / 8: 0.125, 0.25, 0.5 for every system), and the caption says why."""
    frame = results()
    fig = fig_hit_rate_vs_prefetch(frame)
    assert "no run prefetched" in fig._suptitle.get_text()
    panel = fig.axes[0]
    assert panel.get_xlabel() == "GPU cache slots per layer"
    lru = lines(panel)[0]
    assert list(lru.get_xdata()) == [1, 2, 4] and list(lru.get_ydata()) == pytest.approx([0.125, 0.25, 0.5])
    caption = standard_figures(frame, gantt=False)["hit_rate_vs_prefetch"][1]
    assert caption.endswith("against the cache size (or per system): no run prefetched.")
    one_size = fig_hit_rate_vs_prefetch(frame[frame["cache.slots_per_layer"] == 2])
    assert [t.get_text() for t in one_size.axes[0].get_xticklabels()] == ["gpu-only-lru", "static-hot",
                                                                          "all-in-gpu (reference)"]


def test_rows_without_the_hue_parameter_are_drawn_as_a_line_of_their_own():
    """Two sweeps in one file: one set engine.staging_slots to 2, the other left it out (the system's default,
    in a file written before sweeps recorded the values points ran with; since then an empty cell is a system
    without the parameter). The second's rows read back as NaN and were dropped unseen; they are a line of their
    own, 'not set' (it was 'default', wrong for a system without the parameter), and the first's whole numbers,
    stored as floats beside the NaN, are labelled 2, not 2.0."""
    frame = results().query("status == 'ok'").copy()
    frame["engine.staging_slots"] = np.where(frame["system"] == "static-hot", np.nan, 2.0)
    with pytest.warns(UserWarning, match="3 of 6 points average 2 runs instead of 4"):  # static-hot alone
        fig = plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean", hue="engine.staging_slots")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["2", "not set"]
    default = lines(fig.axes[0])[1]
    assert list(default.get_ydata()) == pytest.approx([45.0, 22.5, 11.25])  # static-hot: 60 and 30 / slots
    scatter = plot_scatter(frame.assign(prefetches=1), x="gpu_hit_rate", y="tpot_ms_mean",
                           hue="engine.staging_slots")
    assert [t.get_text() for t in scatter.legends[0].get_texts()][:2] == ["2", "not set"]


def test_bars_say_error_bars_and_one_run_is_one_run():
    frame = results().query("`cache.slots_per_layer` == 1")
    gone = (frame["hw"] == "h100-pcie") & (frame["system"] == "static-hot")
    with pytest.warns(UserWarning, match="1 of 3 points average 1 run instead of 2"):
        fig = plot_results(frame[~gone], x="system", y="tpot_ms_mean")
    assert "(error bars: min to max)" in fig._suptitle.get_text()


def test_a_results_file_without_points_says_so(tmp_path):
    path = tmp_path / "zero.parquet"
    results().iloc[:0].to_parquet(path)
    with pytest.raises(ConfigError) as err:
        load_results(path)
    assert str(err.value) == (f"{path}: the results file holds no points (fix: run `moesim sweep SPEC.yaml --out` "
                              "into it first)")


def test_another_word_for_a_base_parameter_is_suggested():
    with pytest.raises(ConfigError) as err:
        plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", facet="hardware")
    assert "did you mean 'hw'?" in str(err.value)


def test_the_uneven_means_warning_of_a_standard_figure_names_the_callers_line():
    """fig_tpot_vs_slots warned from figures.py:496 (stacklevel=2 stopped inside moesim): a notebook showed
    moesim's source line instead of the cell's."""
    import inspect
    import warnings

    from moesim.analysis.figures import UnevenMeans
    once = results()
    frame = pd.concat([once, once.assign(seed=1, point_id=once["point_id"] + "-1")], ignore_index=True)
    frame = frame.drop(index=frame.index[frame["system"] == "static-hot"][0])  # one point averages 1 seed of 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        fig_tpot_vs_slots(frame)
    uneven = [w for w in caught if issubclass(w.category, UnevenMeans)]
    assert [(w.filename, w.lineno) for w in uneven] == [(__file__, line)]


@pytest.mark.parametrize("draw", [plot_results, plot_scatter])
def test_a_list_where_one_column_goes_is_one_line_naming_the_argument(draw):
    """y=['tpot_ms_mean', 'ttft_ms'] failed with AttributeError: 'list' object has no attribute 'replace'."""
    with pytest.raises(ConfigError, match=r"field 'y': y must be one column's name, got \['tpot_ms_mean', "
                                          r"'gpu_hit_rate'\] \(fix: one figure per column"):
        draw(results(), x="cache.slots_per_layer", y=["tpot_ms_mean", "gpu_hit_rate"])


@pytest.mark.parametrize("where, words", [
    ({"sytem": "static-hot"}, "no column 'sytem' (fix: did you mean system?"),  # KeyError: 'sytem'
    ("static-hot", "where must be a dict of parameter values, got 'static-hot'"),  # AttributeError: .items
    ({"cache.slots_per_layer": 3}, "no finished point with cache.slots_per_layer=3"),  # gantt_point: IndexError
])
@pytest.mark.parametrize("pick", [fig_breakdown, gantt_point])
def test_a_where_that_picks_no_point_is_one_line(pick, where, words):
    with pytest.raises(ConfigError) as err:
        pick(results(), where)
    assert err.value.field == "where" and words in str(err.value)
    assert gantt_point(results(), {"cache__slots_per_layer": 2, "hw": "a100-40g"})["system"] == "static-hot"


@pytest.mark.parametrize("draw", [plot_results, plot_scatter])
@pytest.mark.parametrize("kwargs, field", [
    ({"x": "cache.slots_per_layer", "y": "nope"}, "y"),
    ({"x": "nope", "y": "tpot_ms_mean"}, "x"),
    ({"x": "cache.slots_per_layer", "y": "tpot_ms_mean", "hue": "nope"}, "hue"),
    ({"x": "cache.slots_per_layer", "y": "tpot_ms_mean", "facet": "nope"}, "facet"),
    ({"x": "cache.slots_per_layer", "y": "system"}, "y"),  # not numeric
])
def test_figure_errors_name_the_python_keyword_and_plot_names_the_option(draw, kwargs, field, tmp_path, capsys):
    """Called from Python, an error named the command line's '--y' where the caller wrote y=."""
    with pytest.raises(ConfigError) as err:
        draw(results(), **kwargs)
    assert err.value.field == field and f"field '{field}'" in str(err.value) and "--" not in str(err.value)
    path = tmp_path / "r.parquet"
    results().to_parquet(path)
    kind = ["--kind", "scatter" if draw is plot_scatter else "line"]
    options = [a for k, v in kwargs.items() for a in (f"--{k}", v)]
    assert main(["plot", str(path), *options, *kind, "--out", str(tmp_path / "f.png")]) == 2
    out_err = capsys.readouterr().err.strip()
    assert len(out_err.splitlines()) == 1 and f"field '--{field}'" in out_err
    assert not (tmp_path / "f.png").exists()


def test_an_undefined_metric_names_the_python_keyword():
    frame = results().assign(tpot_ms_mean=np.nan)
    with pytest.raises(ConfigError, match=r"^field 'y': column 'tpot_ms_mean' has no finite values"):
        plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean")
    with pytest.raises(ConfigError, match=r"^field 'y': no run has finite"):
        plot_scatter(frame, x="gpu_hit_rate", y="tpot_ms_mean")


@pytest.mark.parametrize("draw, x", [(plot_results, "cache.slots_per_layer"), (plot_scatter, "gpu_hit_rate")])
def test_a_value_too_large_to_draw_is_one_line_not_a_matplotlib_error(draw, x, tmp_path):
    """1e308 in a metric column failed inside matplotlib ("arange: cannot compute length")."""
    frame = results()
    frame.loc[0, "tpot_ms_mean"] = 1e308
    with pytest.raises(ConfigError, match=r"^field 'y': column 'tpot_ms_mean' holds 1e\+308, too large to draw"):
        draw(frame, x=x, y="tpot_ms_mean", path=tmp_path / "f.png")
    assert not (tmp_path / "f.png").exists()


def test_the_log_axis_test_does_not_overflow_near_the_largest_float():
    """LOG_RATIO * min overflowed to inf, with a RuntimeWarning, for values near 1.8e308."""
    import warnings

    from moesim.analysis.figure_style import spans_decade
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not spans_decade(pd.Series([1e308, 1e308]))
        assert spans_decade(pd.Series([1.0, 1e300]))


def test_a_report_leaves_out_a_figure_of_values_too_large_to_draw(tmp_path, capsys):
    path = tmp_path / "r.parquet"
    results().assign(tpot_ms_mean=1e308).to_parquet(path)
    assert main(["report", str(path), "--out", str(tmp_path / "r.html"), "--no-gantt"]) == 0
    assert "no latency figure: column 'tpot_ms_mean' holds 1e+308, too large to draw" in capsys.readouterr().err  # a note: stderr


def test_every_system_of_the_catalogue_has_a_colour_of_its_own():
    """18 systems (`systems: all`) drew from 15 colours: gpu-only-lru and all-in-gpu were both orange,
    static-hot and the oracle both green. Every system now has its own colour (and marker); bounds and
    references keep their dashes, in black and greys no system has."""
    from moesim.analysis.figure_style import PALETTE
    from moesim.analysis.serving import plot_latency_vs_qps
    from moesim.policy.systems import system_names
    names = system_names()
    assert len(names) >= 18
    frame = pd.DataFrame([{"point_id": f"{s}-{slots}", "trace": "t.parquet", "hw": "a100-40g", "system": s,
                           "seed": 0, "cache.slots_per_layer": slots, "status": "ok", "error": "",
                           "tpot_ms_mean": 10.0 * (i + 1) / slots, "gpu_memory_gib": 4.0 * slots + i}
                          for i, s in enumerate(names) for slots in (1, 2)])
    fig = plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    drawn = lines(fig.axes[0])
    looks = {(line.get_color(), line.get_marker()) for line in drawn}
    assert len(drawn) == len(names) and len({c for c, _ in looks}) == len(names)
    dashed = [line.get_color() for line in drawn if line.get_linestyle() == "--"]
    assert len(dashed) == 2 and not set(dashed) & set(PALETTE)  # oracle and all-in-gpu
    legend = fig.legends[0]
    assert len({h.get_color() for h in legend.legend_handles}) == len(names)
    scatter = plot_scatter(frame, x="gpu_memory_gib", y="tpot_ms_mean", pareto=False)
    colours = {tuple(c.get_edgecolor()[0]) for c in scatter.axes[0].collections}
    assert len(colours) == len(names)
    serving = pd.DataFrame([{"system": s, "qps": q, **{f"ttft_ms_p{p}": 10.0 * q + p for p in (50, 90, 99)}}
                            for s in names if s != "oracle" for q in (0.5, 1.0)])
    served = plot_latency_vs_qps(serving)
    assert len({line.get_color() for line in served.axes[0].get_lines()}) == len(names) - 1


def test_serving_metrics_are_labelled_in_words_with_their_units():
    """`moesim plot --x workload.qps --y ttft_ms_p99` was titled "ttft_ms_p99 vs workload.qps", its axes the
    raw column names without a unit; serving metrics are labelled as the replay metrics are."""
    from moesim.analysis.figures import label
    frame = pd.DataFrame([{"point_id": f"{s}-{q}", "trace": "t.parquet", "hw": "a100-40g", "system": s, "seed": 0,
                           "workload.qps": q, "status": "ok", "error": "", "ttft_ms_p99": 100.0 * q + i,
                           "e2e_ms_mean": 900.0 * q, "throughput_rps": q, "engine_gpu_hit_rate": 0.5}
                          for i, s in enumerate(("gpu-only-lru", "static-hot")) for q in (0.5, 1.0, 2.0)])
    fig = plot_results(frame, x="workload.qps", y="ttft_ms_p99", hue="system")
    assert fig._suptitle.get_text().replace("\n", " ") == ("TTFT, p99 (ms) vs arrival rate (requests/s) on a100-40g "
                                                          "(NVIDIA A100 40GB + 2x Intel Xeon Platinum 8452Y, 72 "
                                                          "cores, 440 GB/s DRAM)")
    assert fig.axes[0].get_xlabel() == "arrival rate (requests/s)" and fig.axes[0].get_ylabel() == "TTFT, p99 (ms)"
    scatter = plot_scatter(frame, x="throughput_rps", y="e2e_ms_mean")
    assert (scatter.axes[0].get_xlabel(), scatter.axes[0].get_ylabel()) == \
        ("throughput (requests/s)", "end-to-end latency, mean (ms)")
    assert label("tpot_ms_p90") == "TPOT, p90 (ms)" and label("queue_ms_p50") == "queueing delay, p50 (ms)"
    assert label("engine_gpu_hit_rate") == "GPU hit rate" and label("goodput_rps") == "goodput (requests/s)"
    assert label("cpu_util") == "CPU utilisation" and label("cache.slots") == "GPU cache slots, all layers"
    assert label("kv_peak_blocks") == "KV cache peak (blocks)" and label("kv_block_tokens") == "KV block size (tokens)"
    assert label("scheduler.kv_allocation") == "KV allocation (prompt or chunk)"
    assert label("kv_tokens_set") == "kv_tokens_set"  # a column no table knows keeps its name


def _grid(traces=2, scales=(0.5, 1.0, 2.0), hws=("a100-40g",)) -> pd.DataFrame:
    """Systems x traces x PCIe bandwidth scales (x profiles) x cache.slots, as `moesim sweep` writes them:
    the slots each run got are the metric slots_per_layer (cpu-only: none, whatever cache.slots asked)."""
    rows = []
    for hw in hws:
        for t in range(traces):
            for scale in scales:
                for system in ("cpu-only", "gpu-only-lru", "all-in-gpu"):
                    for slots in (96, 192, 384):
                        per_layer = 0 if system == "cpu-only" else 128 if system == "all-in-gpu" else slots / 48
                        rows.append({"point_id": f"{hw}{t}{scale}{system}{slots}", "trace": f"traces/b{t}.parquet",
                                     "hw": hw, "system": system, "seed": 0, "hw.pcie.bandwidth_scale": scale,
                                     "cache.slots": slots, "status": "ok", "error": "",
                                     "slots_per_layer": per_layer, "prefetches": 0, "gpu_hit_rate": 0.5,
                                     "tpot_ms_mean": (t + 1) * 100.0 / scale / (per_layer + 1)})
    return pd.DataFrame(rows)


def test_the_reports_figure_shows_two_swept_axes_as_rows_and_columns_not_a_mean():
    """A sweep over two traces and three PCIe bandwidths (besides the cache size on x) was drawn as one panel
    per trace, each line the mean over the bandwidths ("mean over hw.pcie.bandwidth_scale, cache.slots",
    hollow markers "averaging 3 runs instead of 15"). It is now 2 x 3 panels, nothing averaged: cache.slots
    is what slots_per_layer on x stands for."""
    import warnings

    from moesim.analysis.figures import UnevenMeans
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnevenMeans)  # no point averages fewer runs than another
        fig, caption = standard_figures(_grid(), gantt=False)["tpot_vs_slots"]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 6
    assert panels[0].get_title() == "trace = b0.parquet\nPCIe bandwidth scale = 0.5"
    assert panels[5].get_title() == "trace = b1.parquet\nPCIe bandwidth scale = 2.0"
    assert fig.axes[0].get_subplotspec().get_geometry()[:2] == (2, 3)  # traces down, bandwidths across
    assert "mean over" not in fig._suptitle.get_text() and "instead of" not in fig._suptitle.get_text()
    lru = lines(panels[5])[1]
    assert list(lru.get_ydata()) == pytest.approx([200.0 / 2 / (s / 48 + 1) for s in (96, 192, 384)])
    assert "a panel per setting of the other swept parameters (up to 12 panels)" in caption


def test_past_twelve_panels_the_last_swept_axes_are_averaged_and_said_so():
    frame = _grid(hws=("a100-40g", "h100-pcie", "rtx4090"))  # 3 profiles x 2 traces x 3 bandwidths: 18 panels
    fig, _ = standard_figures(frame, gantt=False)["tpot_vs_slots"]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 6 and panels[0].get_title() == "trace = b0.parquet\nhw = a100-40g"
    assert "mean over hw.pcie.bandwidth_scale (band: min to max)" in fig._suptitle.get_text()
    one = fig_tpot_vs_slots(frame[frame["hw"] == "a100-40g"])  # 6 panels: nothing averaged
    assert len([ax for ax in one.axes if ax.get_visible()]) == 6 and "mean over" not in one._suptitle.get_text()


def test_several_facets_of_plot_results_make_a_grid_and_an_empty_panel_says_so():
    frame = _grid()
    frame = frame[~((frame["trace"] == "traces/b1.parquet") & (frame["hw.pcie.bandwidth_scale"] == 2.0))]
    fig = plot_results(frame, x="slots_per_layer", y="tpot_ms_mean", hue="system",
                       facet=["trace", "hw.pcie.bandwidth_scale"])
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 6 and [t.get_text() for t in panels[5].texts] == ["no finished point"]
    assert [len(lines(ax)) for ax in panels] == [3, 3, 3, 3, 3, 0]


def test_the_prefetch_scatters_legend_stays_clear_of_its_title_on_two_profiles():
    """Every system on two profiles, with prefetches: the scatter's legend (one column, placed before the title
    was wrapped to three lines) ran into the title's last line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    frame = pd.concat([_many_systems().assign(hw=hw) for hw in ("a100-40g", "h100-pcie")], ignore_index=True)
    frame = frame.assign(gpu_hit_rate=0.5, prefetches=range(len(frame)), decode_tokens=10, prefill_tokens=0)
    fig = fig_hit_rate_vs_prefetch(frame)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert fig._suptitle.get_text().count("\n") >= 1  # both profiles named: the title takes several lines
    assert not box.overlaps(fig._suptitle.get_window_extent(renderer))
    assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1


def test_the_prefetch_figures_panels_vary_only_among_the_runs_it_draws():
    """smoe swept over prefetch.n beside dali over prefetch.size: the figure against prefetch.n draws smoe's
    runs alone, yet split them by prefetch.size, a panel titled 'prefetch.size = not set' per profile."""
    rows = [{"point_id": f"{hw}-{system}-{value}", "trace": "t.parquet", "hw": hw, "system": system, "seed": 0,
             "status": "ok", "error": "", "gpu_hit_rate": 0.1 * value, "prefetches": 10 * value,
             "decode_tokens": 10, "prefill_tokens": 0, "tpot_ms_mean": 100.0 / value,
             "prefetch.n": value if system == "smoe" else np.nan,
             "prefetch.size": value if system == "dali" else np.nan}
            for hw in ("a100-40g", "h100-pcie") for system in ("smoe", "dali") for value in (1, 2, 3)]
    fig = fig_hit_rate_vs_prefetch(pd.DataFrame(rows))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["hw = a100-40g", "hw = h100-pcie"]


@pytest.mark.parametrize("call, words", [
    (lambda: fig_breakdown(results(), {"cache.slots_per_layer": 3}), "no finished point with cache.slots_per_layer=3"),
    (lambda: gantt_point(results(), {"sytem": "static-hot"}), "no column 'sytem'"),
    (lambda: plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", hu="system"),
     "plot_results() has no argument 'hu' (fix: did you mean hue?"),
    (lambda: plot_scatter(results(), x="gpu_hit_rate", y="nope"), "field 'y'"),
    (lambda: fig_tpot_vs_slots(results(), pth="f.png"), "fig_tpot_vs_slots() has no argument 'pth'"),
    (lambda: fig_hit_rate_vs_prefetch(results(), path=3), "path"),
    (lambda: standard_figures(results(), gant=False), "did you mean gantt?"),
])
def test_a_figure_helpers_error_in_a_notebook_shows_the_callers_line_and_one_line(call, words):
    """In Jupyter a bad argument to a figure helper showed the moesim frames above the message (figures.py's
    source around the raise), and a misspelt keyword Python's 'unexpected keyword argument'; the API's own
    functions show the caller's line and the one-line message."""
    with pytest.raises(ConfigError) as err:
        call()
    shown = err.value._render_traceback_()
    assert words in shown[-1] and "\n" not in shown[-1]
    assert all("moesim/analysis" not in line for line in shown)
    assert any(__file__ in line for line in shown)


def test_a_point_is_described_with_whole_numbers_as_such():
    """A parameter column some rows leave empty is read back as floats: the breakdown's caption said
    'prefetch.n=2.0' of a count."""
    from moesim.analysis.figures import describe
    assert describe({"trace": "runs/t.parquet", "prefetch.n": 2.0, "hw.pcie.bandwidth_scale": 0.5,
                     "assign.decode_on_demand": True}) == \
        "trace=t.parquet, prefetch.n=2, hw.pcie.bandwidth_scale=0.5, assign.decode_on_demand=true"


def test_a_flag_picked_from_a_results_column_is_described_as_set_writes_it():
    """A flag column without missing values reads back as numpy's bool, which the caption wrote 'True' (the point
    representative() picks from the column: 'assign.decode_on_demand=True' where --set writes true); a float32 2.0
    '2.0'."""
    from moesim.analysis.figures import describe, representative
    frame = pd.DataFrame({"system": ["a", "a", "a"], "assign.decode_on_demand": [False, True, True],
                          "prefetch.n": np.array([2.0, 1.0, 3.0], dtype=np.float32)})
    assert describe(representative(frame)) == "assign.decode_on_demand=false, prefetch.n=2"


def test_panels_per_system_are_ordered_and_named_as_the_legends():
    """--facet system drew the panels alphabetically with bare names: "system = all-in-gpu" first, a reference read
    as a deployable system. Now systems come in the legends' order (bounds and references last), named as there."""
    frame = results()
    titles = [ax.get_title() for ax in plot_results(frame, x="cache.slots_per_layer", y="tpot_ms_mean",
                                                    facet="system").axes if ax.get_visible()]
    expected = ["system = gpu-only-lru", "system = static-hot", "system = all-in-gpu (reference)"]
    assert titles == expected
    scatter = plot_scatter(frame.assign(prefetches=1), x="gpu_hit_rate", y="tpot_ms_mean", hue=None, facet="system")
    assert [ax.get_title() for ax in scatter.axes if ax.get_visible()] == expected


def test_large_values_are_labelled_with_thousands_separators():
    """PCIe bytes (about 1e12) on a linear axis read "2500000000000": the digits had to be counted. Ticks now
    carry thousands separators, as a log axis's do, and small ones stay as they are."""
    frame = results().assign(pcie_h2d_bytes=lambda f: f["cache.slots_per_layer"] * 5e11)
    fig = plot_results(frame, x="cache.slots_per_layer", y="pcie_h2d_bytes", logy=False)
    fig.canvas.draw()
    ax = fig.axes[0]
    ys = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert "1,000,000,000,000" in ys and "2,000,000,000,000" in ys
    assert not any("e+" in y or "1e" in y for y in ys)
    assert [t.get_text() for t in ax.get_xticklabels() if t.get_text()] == ["1", "2", "4"]


@pytest.mark.parametrize("kind", ["line", "scatter"])
def test_a_hue_of_more_values_than_a_legend_tells_apart_is_one_line(tmp_path, capsys, kind):
    """`moesim plot R --hue point_id` (68 values) drew a legend over the title and panels squeezed to nothing,
    with a matplotlib warning, exit 0. Now it is one line, exit 2, and an existing figure is left as it was."""
    frame = results()
    frame["tag"] = [f"t{i}" for i in range(len(frame))]  # 18 finished rows (and a failed one): 18 hues
    wide = pd.concat([frame.assign(point_id=frame["point_id"] + f"-{k}", tag=frame["tag"] + f"-{k}")
                      for k in range(3)], ignore_index=True)  # 54 hues
    x = "cache.slots_per_layer" if kind == "line" else "gpu_hit_rate"
    draw = plot_results if kind == "line" else plot_scatter
    draw(frame, x=x, y="tpot_ms_mean", hue="tag")
    with pytest.raises(ConfigError) as err:
        draw(wide, x=x, y="tpot_ms_mean", hue="tag")
    assert str(err.value) == ("field 'hue': column 'tag' has 54 values, more than a legend tells apart (40) "
                              "(fix: pick a column with fewer values, or make it the facet (one panel per value))")
    path, figure = tmp_path / "r.parquet", tmp_path / "f.png"
    wide.to_parquet(path)
    figure.write_bytes(b"mine")
    assert main(["plot", str(path), "--x", x, "--y", "tpot_ms_mean", "--hue", "tag", "--out", str(figure)]) == 2
    assert "field '--hue': column 'tag' has 54 values" in capsys.readouterr().err
    assert figure.read_bytes() == b"mine"
