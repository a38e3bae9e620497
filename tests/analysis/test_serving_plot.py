"""The serving figure: latency percentiles against the arrival rate, one colour and marker per system."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from moesim.analysis.figures import PALETTE
from moesim.analysis.serving import PERCENTILES, plot_latency_vs_qps


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
        if scale == "log":  # plain numbers, not 2 x 10^3
            labels = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
            assert labels and all("10^" not in t and "times" not in t for t in labels)
    finally:
        plt.close(fig)


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
