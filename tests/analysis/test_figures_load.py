"""Reading a sweep's results for `moesim plot` and `moesim report`: why a file cannot be read."""

from __future__ import annotations

import pytest

from moesim.analysis.figures import load_results
from moesim.cli import main
from moesim.errors import ConfigError
from tests.analysis.test_figures import results


@pytest.mark.parametrize("damage, words", [
    (lambda data: b"", "the file is empty"),
    (lambda data: data[:len(data) // 2], "a Parquet file cut short (its footer is missing)"),
    (lambda data: b"point_id,status\n1,ok\n", "not a Parquet file"),
])
def test_an_unreadable_results_file_says_what_is_wrong_with_it(tmp_path, capsys, damage, words):
    """Each was "not a readable Parquet file": an empty file, one cut short by a full disk and a CSV alike."""
    good = tmp_path / "good.parquet"
    results().to_parquet(good)
    path = tmp_path / "r.parquet"
    path.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ConfigError) as err:
        load_results(path)
    assert str(err.value).startswith(f"{path}: {words} (fix: give the --out file of `moesim sweep`")
    for command in (["plot", str(path), "--x", "system", "--y", "tpot_ms_mean", "--out", str(tmp_path / "f.png")],
                    ["report", str(path), "--out", str(tmp_path / "r.html")]):
        assert main(command) == 2
        assert capsys.readouterr().err.strip() == f"moesim: error: {err.value}"


def test_results_of_a_sweep_killed_before_its_first_merge_say_where_its_points_are(tmp_path, capsys):
    """Killed (-9) before OUT was first written, a sweep keeps its points in OUT.parts/: plot and report said
    "results file not found", as if no sweep had run."""
    path = tmp_path / "r.parquet"
    parts = tmp_path / "r.parquet.parts"
    parts.mkdir()
    results().head(1).to_parquet(parts / "0123456789abcdef.parquet")
    with pytest.raises(ConfigError) as err:
        load_results(path)
    assert f"1 finished point(s), kept in {parts}/" in str(err.value) and "moesim sweep" in str(err.value)
    assert main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err.strip() == f"moesim: error: {err.value}"
    (parts / "0123456789abcdef.parquet").unlink()  # a parts folder with no point: nothing ran, not found
    with pytest.raises(ConfigError, match="results file not found"):
        load_results(path)
