"""moesim.util: outputs staged beside their targets land together, or not at all."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.mark.parametrize("command, suggested", [
    (["trace", "synth", "--model", "mixtral-8x7b", "--out", "{dir}/t.csv"], "t.parquet"),
    (["trace", "synth", "--model", "mixtral-8x7b", "--out", "{dir}/t"], "t.parquet"),
    (["trace", "import", "{readme}", "--out", "{dir}/t.pq"], "t.parquet"),
    (["replay", "{trace}", "--system", "cpu-only", "--timeline", "{dir}/t.csv"], "t.parquet"),
    (["replay", "{trace}", "--system", "cpu-only", "--decisions", "{dir}/d.json"], "d.parquet"),
    (["replay", "{trace}", "--system", "cpu-only", "--plot", "{dir}/g.jpg"], "g.png"),
    (["serve-sim", "{trace}", "--qps", "1", "--requests-out", "{dir}/r.csv"], "r.parquet"),
    (["sweep", "{dir}/spec.yaml", "--out", "{dir}/r.csv"], "r.parquet"),
    (["plot", "{dir}/r.parquet", "--x", "a", "--y", "b", "--out", "{dir}/f.gif"], "f.png"),
    (["report", "{dir}/r.parquet", "--out", "{dir}/r.pdf"], "r.html"),
    (["profile", "--model", "mixtral-8x7b", "--device", "cpu", "--out", "{dir}/p.json"], "p.yaml"),
])
def test_an_output_named_for_another_format_is_refused_before_any_work(tmp_path, capsys, command, suggested):
    """`--out trace.csv` would get Parquet under a CSV name: one line naming the format and the name to use."""
    readme = Path(__file__).resolve().parents[1] / "README.md"  # an input that exists (click checks)
    args = [a.format(dir=tmp_path, trace=tmp_path / "missing.parquet", readme=readme) for a in command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "this output is written as" in err, err
    assert err.endswith(f"(fix: name it e.g. {suggested})"), err
    assert list(tmp_path.iterdir()) == []  # nothing read, nothing written


def test_a_figure_to_a_special_file_is_a_png(tmp_path):
    """A special file's name has no suffix: its figure is drawn as PNG (it used to fail on the suffix)."""
    from moesim.util import FIGURE
    with output_file("/dev/null", "--plot", FIGURE) as path:
        assert path.name == "null.png"
    with output_file(os.devnull, "--plot") as path:
        assert path.name == "null"


def test_an_output_to_dev_stdout_redirected_to_a_file_lands_in_that_file(tmp_path):
    """`moesim trace synth ... --out /dev/stdout > t.parquet` was refused ('no suffix (name it e.g.
    stdout.parquet)'): /dev/stdout then is a regular file. It is written through, as to a pipe, never replaced
    by a rename (which would replace the link in /dev)."""
    import subprocess
    import sys

    import pyarrow.parquet as pq
    out = tmp_path / "t.parquet"
    with open(out, "wb") as stdout:
        done = subprocess.run([sys.executable, "-m", "moesim.cli", "trace", "synth", "--model", "mixtral-8x7b",
                               "--requests", "1", "--prompt-len", "4", "--decode-len", "4", "--out", "/dev/stdout"],
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert pq.ParquetFile(out).metadata.num_rows == 8 * 32
    assert os.path.islink("/dev/stdout")


_OUTPUT_COMMANDS = [
    ["replay", "{trace}", "--system", "cpu-only", "--json", "{out}"],
    ["replay", "{trace}", "--system", "cpu-only", "--timeline", "{out}"],
    ["replay", "{trace}", "--system", "cpu-only", "--plot", "{out}"],
    ["replay", "{trace}", "--system", "cpu-only", "--decisions", "{out}"],
    ["replay", "{trace}", "--system", "cpu-only", "--chrome-trace", "{out}"],
    ["trace", "synth", "--model", "mixtral-8x7b", "--requests", "1", "--prompt-len", "1", "--decode-len", "1",
     "--out", "{out}"],
    ["trace", "upgrade", "{trace}", "--out", "{out}"],
    ["sweep", "{dir}/spec.yaml", "--out", "{out}"],
    ["report", "{dir}/r.parquet", "--out", "{out}"],
]


def _output_case(tmp_path, command, out):
    from tests.fuzz.corpus import write_valid
    import numpy as np
    trace = write_valid(tmp_path / "t.parquet", np.random.default_rng(0))
    (tmp_path / "spec.yaml").write_text(f"traces: [{trace}]\nsystems: [cpu-only]\n")
    (tmp_path / "r.parquet").write_bytes(b"")
    before = sorted(p.name for p in tmp_path.iterdir())
    return [a.format(dir=tmp_path, trace=trace, out=out) for a in command], before


@pytest.mark.parametrize("command", _OUTPUT_COMMANDS, ids=lambda c: " ".join(c[:1] + c[-2:-1]))
def test_an_empty_output_path_is_refused_before_any_work(tmp_path, capsys, command):
    """`--json ''` (an unset shell variable) wrote nothing and exited 0; `--out ''` ended in an internal
    error (PosixPath('.') has an empty name)."""
    args, before = _output_case(tmp_path, command, "")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "empty" in err and "fix: give a file name" in err, err
    assert "internal error" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("command", _OUTPUT_COMMANDS, ids=lambda c: " ".join(c[:1] + c[-2:-1]))
def test_an_output_path_ending_in_a_slash_is_refused(tmp_path, capsys, command, existing):
    """`--json out/` wrote a file named 'out' (the folder meant did not exist), and `--json m.json/` wrote
    over the file m.json."""
    suffix = {"--json": ".json", "--chrome-trace": ".json", "--plot": ".png"}.get(command[-2], ".parquet")
    if command[0] == "report":
        suffix = ".html"
    name = tmp_path / f"kept{suffix}"
    if existing:
        name.write_text("precious")
    args, before = _output_case(tmp_path, command, f"{name}/")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ends in '/'" in err and "internal error" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not existing or name.read_text() == "precious"


@pytest.mark.parametrize("command", [c for c in _OUTPUT_COMMANDS if c[-2] in ("--timeline", "--decisions", "--out")
                                     and c[0] != "report"], ids=lambda c: " ".join(c[:1] + c[-2:-1]))
def test_a_parquet_output_whose_name_is_not_utf8_is_refused_before_any_work(tmp_path, capsys, command):
    """pyarrow cannot encode such a name: the command ended in an internal error (UnicodeEncodeError), and a
    sweep left its OUT.parts folder behind."""
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/o\xff.parquet")
    args, before = _output_case(tmp_path, command, out)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not UTF-8" in err and "internal error" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_output_folder_where_no_file_can_be_created_is_refused_before_any_work(tmp_path, monkeypatch):
    """os.access says yes to root where creating fails (/proc, a read-only or root-squashed mount): every
    command's output check now creates a file there for a moment, so serve-sim, sweep or trace synth refuse
    the path at once instead of failing at the end of their run."""
    import os

    from moesim.errors import ConfigError
    from moesim.util import check_output_path
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)  # as root: every check says yes
    try:
        if os.geteuid() == 0:  # root creates files in a 0o500 folder: fail the creation itself
            import tempfile

            def refuse(*args, **kwargs):
                raise PermissionError(13, "Permission denied")
            monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
        with pytest.raises(ConfigError, match="cannot create a file in") as refused:
            check_output_path(folder / "m.json", "--json")
        assert refused.value.field == "--json"
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)
        monkeypatch.undo()
    assert check_output_path(tmp_path / "m.json", "--json") == tmp_path / "m.json"
    assert list(tmp_path.glob(".moesim-write-check-*")) == []  # the trial file is gone


def test_an_output_named_by_a_suffix_alone_is_told_to_put_a_name_before_it(tmp_path):
    """'--out .parquet' was told 'name it e.g. .parquet.parquet' (Path('.parquet') has no suffix: it is a
    hidden file's name)."""
    from moesim.util import PARQUET, check_output_path
    with pytest.raises(ConfigError, match="the file name is only a suffix, '.parquet'") as refused:
        check_output_path(tmp_path / ".parquet", "--out", PARQUET)
    assert refused.value.fix == "put a name before it, e.g. out.parquet"
    with pytest.raises(ConfigError, match="its name has '.txt'") as refused:
        check_output_path(tmp_path / "x.txt", "--out", PARQUET)
    assert refused.value.fix == "name it e.g. x.parquet"
