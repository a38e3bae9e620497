"""A per-layer list setting (cache.slots_per_layer=1,2,1,2,... for 32 layers) in a sweep's figures: tick labels,
legend entries, panel and figure titles show it shortened, told apart, and clear of each other."""

from __future__ import annotations

import pandas as pd

from moesim.analysis.figure_style import short_setting, short_settings
from moesim.analysis.figures import fig_breakdown, plot_results, plot_scatter
from moesim.sim.bookkeeping import BREAKDOWN

ALTERNATING = ",".join(["1", "2"] * 16)
OTHER_WAY = ",".join(["2", "1"] * 16)


def results() -> pd.DataFrame:
    rows = []
    for system, base in (("gpu-only-lru", 600.0), ("static-hot", 50.0)):
        for i, slots in enumerate(("1", ALTERNATING, OTHER_WAY)):
            rows.append({"point_id": f"{system}-{i}", "trace": "traces/x.parquet", "hw": "a100-40g", "system": system,
                         "seed": 0, "cache.slots_per_layer": slots, "status": "ok", "error": "",
                         "tpot_ms_mean": base - i, "gpu_memory_gib": 14.0 + i, "makespan_s": 1.0,
                         "decode_tokens": 10, "prefill_tokens": 0,
                         **{f"breakdown_{c}_ms": 10.0 * (j + 1) for j, c in enumerate(BREAKDOWN)}})
    return pd.DataFrame(rows)


def test_a_long_list_is_shortened_to_its_ends_and_length_and_apart_from_its_neighbours():
    assert short_setting("1,2,4") == "1,2,4"
    shown = short_setting(ALTERNATING)
    assert shown.startswith("1,2,") and shown.endswith(",1,2 (32 values)") and "\u2026" in shown
    assert len(shown) < 40
    middle = ALTERNATING[:30] + "3" + ALTERNATING[31:]  # differs from ALTERNATING only in the middle
    a, b, c = short_settings([ALTERNATING, middle, "1"])
    assert a != b and c == "1"


def _overlapping(texts) -> bool:
    """Whether two of ``texts`` (tick labels at one angle) overlap: their rectangles, turned by the labels'
    rotation, compared along the text's direction and across it (a slanted label's upright box overlaps its
    neighbour's even when the letters keep apart)."""
    import math
    texts = [t for t in texts if t.get_text()]
    fig = texts[0].figure
    renderer = fig.canvas.get_renderer()
    boxes = []
    for t in texts:
        theta = math.radians(t.get_rotation())
        w, h, _ = renderer.get_text_width_height_descent(t.get_text(), t.get_fontproperties(), ismath=False)
        box = t.get_window_extent(renderer)
        centre = ((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2)
        boxes.append((centre, w, h, theta))

    def apart(a, b) -> bool:
        (ca, wa, ha, theta), (cb, wb, hb, _) = a, b
        dx, dy = cb[0] - ca[0], cb[1] - ca[1]
        along = abs(dx * math.cos(theta) + dy * math.sin(theta))
        across = abs(-dx * math.sin(theta) + dy * math.cos(theta))
        return along >= (wa + wb) / 2 or across >= (ha + hb) / 2
    return any(not apart(p, q) for i, p in enumerate(boxes) for q in boxes[i + 1:])


def test_bars_of_list_settings_have_short_distinct_tick_labels_that_do_not_overlap():
    """The whole 63-character lists ran into each other under the bars, unreadable."""
    fig = plot_results(results(), x="cache.slots_per_layer", y="tpot_ms_mean", hue="system")
    fig.draw_without_rendering()
    ax = fig.axes[0]
    ticks = ax.get_xticklabels()
    names = [t.get_text() for t in ticks]
    assert names[0] == "1" and len(set(names)) == 3
    assert all(len(n) < 40 and (n == "1" or n.endswith("(32 values)")) for n in names), names
    assert not _overlapping(ticks), names


def test_legend_entries_and_panel_titles_of_list_settings_are_short():
    fig = plot_scatter(results(), x="gpu_memory_gib", y="tpot_ms_mean", hue="cache.slots_per_layer", facet="system")
    entries = [t.get_text() for t in fig.legends[0].get_texts()]
    assert entries[:3] == ["1", short_setting(ALTERNATING), short_setting(OTHER_WAY)]
    fig = plot_scatter(results(), x="gpu_memory_gib", y="tpot_ms_mean", facet="cache.slots_per_layer")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert titles[1:] == [f"GPU cache slots per layer = {short_setting(v)}" for v in (ALTERNATING, OTHER_WAY)]


def test_a_breakdown_at_a_list_setting_names_it_short_and_its_bars_stay_apart():
    """The whole list in the title made it wider than the figure; the layout then squeezed the two bars so their
    names ('gpu-only-lru', 'static-hot') overlapped."""
    fig = fig_breakdown(results(), where={"cache.slots_per_layer": ALTERNATING})
    fig.draw_without_rendering()
    title = fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title(loc="left")
    assert ALTERNATING not in title.replace("\n", "") and short_setting(ALTERNATING) in title.replace("\n", " ")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpu-only-lru", "static-hot"]
    assert not _overlapping(ax.get_xticklabels())
    text = fig._suptitle or ax.title
    assert text.get_window_extent().x1 <= fig.bbox.x1  # the title within the figure
