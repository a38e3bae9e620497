"""moesim.util: outputs staged beside their targets land together, or not at all."""

from __future__ import annotations

import os

import pytest

from moesim.cli import main
from moesim.errors import ConfigError
from moesim.util import atomic_write_text, clean_stale_tmps, output_file, staged_outputs


def test_staged_outputs_land_together_when_the_block_ends(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.png"
    with staged_outputs():
        with output_file(first) as path:
            assert path != first and path.parent == first.parent and path.suffix == ".json"
            atomic_write_text(path, "new a")
        with output_file(second) as path:
            path.write_text("new b")
        assert not first.exists() and not second.exists()  # nothing lands before the end
    assert (first.read_text(), second.read_text()) == ("new a", "new b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.png"]


def test_an_error_in_a_later_output_leaves_every_output_as_it_was(tmp_path):
    kept = tmp_path / "metrics.json"
    kept.write_text("precious")
    with pytest.raises(ConfigError, match="timeline.parquet: cannot write the output: No space"), staged_outputs():
        with output_file(kept) as path:
            path.write_text("new")
        with output_file(tmp_path / "timeline.parquet"):
            raise OSError(28, "No space left on device")
    assert kept.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_staged_file_of_a_writer_that_died_is_cleaned(tmp_path):
    target = tmp_path / "plot.png"
    stale = tmp_path / ".plot.999999999.tmp.png"  # no such process
    stale.write_text("half a plot")
    mine = tmp_path / f".plot.{os.getpid()}.tmp.png"
    mine.write_text("being written")
    assert clean_stale_tmps(target) == 1 and not stale.exists() and mine.exists()


def test_a_command_that_fails_after_writing_one_output_keeps_the_old_one(tmp_path, capsys, monkeypatch):
    import numpy as np

    from moesim.analysis import plots
    from tests.factories import random_routing, tiny_model, write_tiny_trace
    model = tiny_model(layers=2, experts=6, top_k=2)
    trace = write_tiny_trace(tmp_path / "t.parquet", model,
                             random_routing(np.random.default_rng(3), model, requests=1, prompt=4, decode=6))
    kept = tmp_path / "m.json"
    kept.write_text("precious")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "plot_gantt", broken)
    code = main(["replay", str(trace), "--system", "cpu-only", "--json", str(kept), "--plot", str(tmp_path / "g.png")])
    assert code == 2 and "No space left on device" in capsys.readouterr().err
    assert kept.read_text() == "precious" and not (tmp_path / "g.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "t.parquet"]
