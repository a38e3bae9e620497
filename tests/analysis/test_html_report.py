"""`moesim report`: one self-contained page; a headless browser loads every image."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess

import pandas as pd
import pytest
import yaml

from moesim.analysis.html_report import render_report
from moesim.cli import main
from moesim.sweep import load_spec, run_sweep
from tests.analysis.test_figures import results
from tests.factories import write_sweep_files

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def test_page_embeds_every_figure_as_a_png_data_uri():
    page = render_report(results(), title="t", gantt=False)
    images = IMG.findall(page)
    assert len(images) == 3 == page.count("<img")  # TPOT vs slots, hit rate, breakdown
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from elsewhere
    assert "<script" not in page


def test_tables_mark_the_fastest_system_and_list_failures():
    frame = results()
    frame.loc[frame["point_id"] == "bad", "error"] = "cache <9 slots> does not fit"
    page = render_report(frame, title="t", gantt=False)
    # at a100-40g, 1 slot: static-hot (60 ms) beats gpu-only-lru (100 ms); all-in-gpu (5 ms) is a reference
    row = re.search(r"<tr><td class=\"text\">a100-40g</td><td class=\"text\">1</td>(.*?)</tr>", page).group(1)
    assert re.findall(r'<td class="best">([^<]*)</td>', row) == ["60.0"]
    assert row.endswith('<td class="text">static-hot</td>')
    assert "all-in-gpu (reference)" in page and "all-in-gpu (bound)" not in page
    assert "Failed points (1)" in page and "cache &lt;9 slots&gt; does not fit" in page
    assert "19 points, 18 finished, 1 failed" in page


def test_all_points_are_listed_in_parameter_order_with_readable_numbers():
    """Workers finish points in any order; the table sorts them, and writes 1,081,344 rather than 1081344."""
    frame = results().sample(frac=1.0, random_state=3)
    frame["pcie_h2d_bytes"] = 1_081_344
    frame["decode_tokens_per_s"] = 78_330.4
    page = render_report(frame, title="t", gantt=False)
    table = page[page.index("<h2>All points</h2>"):]
    cells = re.findall(r"<tr>\s*<td>x.parquet</td>\s*<td>([^<]*)</td>\s*<td>([^<]*)</td>\s*<td>0</td>\s*"
                       r"<td>([^<]*)</td>", table)
    assert cells == sorted(cells, key=lambda c: (c[0], c[1], int(c[2]))) and len(cells) == 19
    assert cells[:4] == [("a100-40g", "all-in-gpu", "1"), ("a100-40g", "all-in-gpu", "2"),
                         ("a100-40g", "all-in-gpu", "4"), ("a100-40g", "gpu-only-lru", "1")]
    assert "<td>1,081,344</td>" in table and "<td>78,330</td>" in table and "e+04" not in table


def test_a_swept_scheduler_is_listed_and_tells_the_rows_apart():
    """Points that differ only in ``scheduler`` were two identical-looking rows, the summary not naming it."""
    frame = results()
    frame = pd.concat([frame.assign(scheduler="vllm"), frame.assign(scheduler="sarathi",
                                                                    point_id=frame["point_id"] + "-s")])
    page = render_report(frame, title="t", gantt=False)
    assert "<li>scheduler: sarathi, vllm</li>" in page
    table = page[page.index("<h2>All points</h2>"):]
    assert "<th>scheduler</th>" in table and table.count("<td>sarathi</td>") == 19


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture
def sweep_results(tmp_path):
    write_sweep_files(tmp_path, seed=13)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "traces": ["t.parquet"], "hw": ["hw.yaml"], "systems": ["cpu-only", "gpu-only-lru", "all-in-gpu"],
        "grid": {"cache.slots_per_layer": [1, 2, 3, 6]},  # 6 per layer do not fit this small GPU: failed points
        "set": {"hw.gpu.memory_gib": 0.5, "hw.gpu.reserved_gib": 0.01, "memory.workspace_gib": 0.4715}}))
    run_sweep(load_spec(tmp_path / "spec.yaml"), tmp_path / "r.parquet", workers=1)
    return tmp_path / "r.parquet"


def test_cli_report_says_which_figure_it_could_not_draw(tmp_path, capsys):
    """The page says why the Gantt chart is missing; so does the command, where the user is looking."""
    path = tmp_path / "r.parquet"
    results().to_parquet(path)  # its points name traces/x.parquet, which is not there to replay
    report = tmp_path / "report.html"
    assert main(["report", str(path), "--out", str(report)]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == f"wrote {report}"  # the notes go to stderr, as moesim plot's do
    note = next(line for line in said.err.splitlines() if line.startswith("note: no Gantt chart:"))
    assert "x.parquet" in note and note.removeprefix("note: ") in report.read_text().replace("&#x27;", "'")
    assert main(["report", str(path), "--out", str(report), "--no-gantt"]) == 0
    said = capsys.readouterr()
    assert "note:" not in said.out + said.err


def test_cli_report_renders_in_a_headless_browser_with_every_image_loaded(sweep_results, tmp_path):
    report = tmp_path / "report.html"
    assert main(["report", str(sweep_results), "--out", str(report)]) == 0
    page = report.read_text()
    assert page.count("<img") == 4 and 'id="gantt"' in page  # with the Gantt chart of a replayed point
    browser = find_browser()
    if browser is None:
        pytest.skip("no chromium found: apt-get install -y chromium")
    # a copy of the page with a script that writes what the browser loaded into the DOM
    check = """<script>window.addEventListener("load", function () {
      var images = Array.from(document.images);
      var loaded = images.filter(function (i) { return i.complete && i.naturalWidth > 0; });
      var out = document.createElement("pre"); out.id = "image-check";
      out.textContent = "images " + images.length + " loaded " + loaded.length + " widths " +
        images.map(function (i) { return i.naturalWidth; }).join(",");
      document.body.appendChild(out);
    });</script>"""
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", check + "</body>"))
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="image-check">images (\d+) loaded (\d+) widths ([\d,]+)</pre>', done.stdout)
    assert found, done.stderr[-2000:]
    assert found.group(1) == found.group(2) == "4"
    assert all(int(w) > 300 for w in found.group(3).split(","))
    assert "<h1>r.parquet</h1>" in done.stdout


def test_every_point_names_the_runtime_it_ran_on(sweep_results, tmp_path):
    report = tmp_path / "report.html"
    assert main(["report", str(sweep_results), "--out", str(report), "--no-gantt"]) == 0
    page = report.read_text()
    table = page[page.index("<h2>All points</h2>"):]
    head = re.findall(r"<th>([^<]*)</th>", table[:table.index("</thead>")])
    assert head[-1] == "runtime"
    runtimes = re.findall(r"<td>(generic|ideal)</td>\s*</tr>", table)
    assert sorted(set(runtimes)) == ["generic", "ideal"]  # cpu-only and gpu-only-lru; all-in-gpu


def test_cli_report_says_unevenly_averaged_points_as_a_note_naming_the_figure(tmp_path, capsys):
    """Points of the TPOT figure averaging fewer runs came out as a raw Python warning
    ('.../figures.py:462: UnevenMeans: results: ...' and the source line), where `moesim plot` says a note."""
    import warnings

    from moesim.analysis.figures import UnevenMeans
    one = results()
    frame = pd.concat([one, one.assign(seed=1, point_id=one["point_id"] + "-1")], ignore_index=True)
    # seed 1 of gpu-only-lru at 4 slots on the A100 failed: that point of the figure averages 1 run, not 2
    frame.loc[(frame["seed"] == 1) & (frame["point_id"] == "a100-40g-gpu-only-lru-4-1"), "status"] = "error"
    path = tmp_path / "r.parquet"
    frame.to_parquet(path)
    report = tmp_path / "report.html"
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        assert main(["report", str(path), "--out", str(report), "--no-gantt"]) == 0
    assert not [w for w in leaked if issubclass(w.category, UnevenMeans)]
    err = " ".join(capsys.readouterr().err.split())
    assert "note: TPOT vs GPU cache slots per layer: 1 of 18 points average 1 run instead of 2" in err


@pytest.fixture
def wordy_system():
    """A system of one's own whose description says "bound" and "reference" in their everyday sense."""
    from moesim.policy.systems import SYSTEMS, SystemSpec, register_system
    register_system("lru-nextbound", SystemSpec("every expert on the GPU; LRU; prefetch bound to the next layer, "
                                                "with reference to 002", cache="lru", assign="gpu",
                                                prefetch="next-layer"))
    yield "lru-nextbound"
    SYSTEMS.pop("lru-nextbound", None)


def test_a_system_whose_description_says_bound_is_no_bound(wordy_system):
    """`lru-nextbound` ("prefetch bound to the next layer") was labelled "(bound)", drawn dashed and left out
    of the fastest: the word in its description decided. The spec decides now (portfolio, ignores_memory)."""
    from moesim.analysis.figures import is_bound
    assert not is_bound(wordy_system) and is_bound("oracle") and is_bound("all-in-gpu")
    frame = results()
    frame = frame[frame["system"] != "static-hot"].copy()
    mine = frame["system"] == "gpu-only-lru"
    frame = pd.concat([frame, frame[mine].assign(system=wordy_system, tpot_ms_mean=frame.loc[mine, "tpot_ms_mean"] / 4,
                                                 point_id=frame.loc[mine, "point_id"] + "-w")], ignore_index=True)
    page = render_report(frame, title="t", gantt=False)
    assert f"{wordy_system} (bound)" not in page and f"<th>{wordy_system}</th>" in page
    row = re.search(r"<tr><td class=\"text\">a100-40g</td><td class=\"text\">1</td>(.*?)</tr>", page).group(1)
    assert row.endswith(f'<td class="text">{wordy_system}</td>')  # 25 ms, the fastest (all-in-gpu's 5 ms aside)


def test_a_reference_is_labelled_a_reference_and_a_bound_a_bound():
    """all-in-gpu was labelled "(bound)" and the caption said "dashed lines are bounds", while `moesim systems`
    calls it a reference, not a bound (it ignores GPU memory). The oracle stays a bound."""
    from moesim.analysis.figures import plot_scatter
    from moesim.analysis.serving import plot_latency_vs_qps
    frame = results()
    oracle = frame[frame["system"] == "static-hot"].assign(system="oracle", tpot_ms_mean=1.0)
    frame = pd.concat([frame, oracle.assign(point_id=oracle["point_id"] + "-o")], ignore_index=True)
    page = render_report(frame, title="t", gantt=False)
    assert "<th>all-in-gpu (reference)</th>" in page and "<th>oracle (bound)</th>" in page
    assert "all-in-gpu (bound)" not in page
    assert "dashed lines are bounds and references" in page
    assert "the fastest system that is neither a bound nor a reference" in page
    lines = standard_figures_legend(frame)
    assert lines[-2:] == ["all-in-gpu (reference)", "oracle (bound)"]
    scatter = plot_scatter(frame.assign(gpu_memory_gib=frame["cache.slots_per_layer"]), x="gpu_memory_gib",
                           y="tpot_ms_mean")
    names = [t.get_text() for t in scatter.legends[0].get_texts()]
    assert "all-in-gpu (reference)" in names and "oracle (bound)" in names
    serving = pd.DataFrame([{"system": s, "qps": q, **{f"ttft_ms_p{p}": 10.0 * q + p for p in (50, 90, 99)}}
                            for s in ("gpu-only-lru", "all-in-gpu") for q in (0.5, 1.0)])
    names = [t.get_text() for t in plot_latency_vs_qps(serving).legends[0].get_texts()]
    assert names[:2] == ["gpu-only-lru", "all-in-gpu (reference)"]


def standard_figures_legend(frame) -> list[str]:
    from moesim.analysis.figures import standard_figures
    fig, _ = standard_figures(frame, gantt=False)["tpot_vs_slots"]
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_a_system_that_substitutes_experts_is_marked_where_it_ranks(tmp_path):
    """buddymoe (routed experts replaced by resident buddies) headed the "fastest" column as if it computed the
    model as routed. It still ranks, marked with a dagger in the table, the fastest column and the legend, and
    a footnote gives the share of routed experts it substituted (substituted_experts over the activations)."""
    from moesim.analysis.figures import standard_figures
    from tests.factories import write_trace_and_profile
    trace, _ = write_trace_and_profile(tmp_path, seed=3)  # 2 layers, top-2: 4 activations a token
    frame = results().assign(trace_path=trace, prefill_tokens=4, decode_tokens=6, substituted_experts=0)
    frame = frame[frame["system"] != "static-hot"]
    lru = frame[frame["system"] == "gpu-only-lru"]
    buddy = lru.assign(system="buddymoe", point_id=lru["point_id"] + "-b", tpot_ms_mean=lru["tpot_ms_mean"] / 10,
                       substituted_experts=[4, 8, 10, 4, 8, 10, 0])  # of 40 activations: 10%, 20%, 25%
    frame = pd.concat([frame, buddy], ignore_index=True)
    page = render_report(frame, title="t", gantt=False)
    assert "<th>buddymoe \u2020</th>" in page
    row = re.search(r"<tr><td class=\"text\">a100-40g</td><td class=\"text\">1</td>(.*?)</tr>", page).group(1)
    assert row.endswith('<td class="text">buddymoe \u2020</td>')  # still the fastest, marked
    assert re.findall(r'<td class="best">([^<]*)</td>', row) == ["10.0"]
    assert ("\u2020 substitutes routed experts by others" in page
            and "buddymoe 18.3% (10.0% to 25.0% over its points)" in page)
    assert "gpu-only-lru \u2020" not in page
    fig, _ = standard_figures(frame, gantt=False)["tpot_vs_slots"]
    assert "buddymoe (substitutes)" in [t.get_text() for t in fig.legends[0].get_texts()]
    # without the trace file the share is unknown: the footnote gives the experts a run substituted
    page = render_report(frame.assign(trace_path="gone.parquet", trace="gone.parquet"), title="t", gantt=False)
    assert "buddymoe 7 experts a run on average (the share needs the trace file, not found here)" in page


def test_old_results_without_the_substitution_metric_mark_by_the_systems_spec():
    frame = results()
    frame = pd.concat([frame, frame[frame["system"] == "static-hot"].assign(system="importance")],
                      ignore_index=True)
    page = render_report(frame, title="t", gantt=False)
    assert "<th>importance \u2020</th>" in page and "importance (the results do not say how many)" in page


def test_cli_report_of_a_point_whose_profile_moved_draws_the_rest(sweep_results, tmp_path, capsys):
    """The sweep's profile file moved away: `moesim report` failed whole (exit 2, "hardware profile not found"),
    while a missing trace only cost the Gantt chart. Now the profile costs the Gantt chart alone too, with a note."""
    (tmp_path / "hw.yaml").rename(tmp_path / "elsewhere.yaml")
    report = tmp_path / "report.html"
    assert main(["report", str(sweep_results), "--out", str(report)]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == f"wrote {report}"
    assert [line for line in said.err.splitlines() if line.startswith("note: no Gantt chart:")] == [
        f"note: no Gantt chart: {tmp_path / 'hw.yaml'}, field 'hw_path': hardware profile '{tmp_path / 'hw.yaml'}' "
        "of this point is not here (fix: run the report where the sweep ran, or pass --no-gantt)"]
    assert report.read_text().count("<img") == 3  # the other figures


def test_cli_report_of_a_point_whose_trace_was_damaged_draws_the_rest(sweep_results, tmp_path, capsys):
    """The sweep's trace overwritten since by something else: `moesim report` failed whole (exit 2, "not a Parquet
    file"), as if the results were bad. The replay is for the Gantt chart alone, which is left out with a note."""
    (tmp_path / "t.parquet").write_text("garbage\n")
    report = tmp_path / "report.html"
    assert main(["report", str(sweep_results), "--out", str(report)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: no Gantt chart:")]
    assert notes == [f"note: no Gantt chart: {tmp_path / 't.parquet'}: not a Parquet file (fix: convert the log "
                     "with `moesim trace import`)"]
    assert report.read_text().count("<img") == 3
