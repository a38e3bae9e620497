"""A fault inside a trace a sweep spec lists names the trace, as `moesim replay` does, then where the spec lists
it, as a fault inside a listed profile does (tests/sweep/test_sweep.py): a trace cut short named the trace but not
the spec."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import moesim
from moesim.cli import main
from moesim.errors import MoesimError


def cut_trace(files):
    whole = (files / "t.parquet").read_bytes()
    (files / "cut.parquet").write_bytes(whole[:len(whole) // 2])
    return "cut.parquet"


def foreign_parquet(files):
    pq.write_table(pa.table({"x": [1]}), files / "foreign.parquet")
    return "foreign.parquet"


@pytest.mark.parametrize("write, words", [
    (cut_trace, "cut.parquet: a Parquet file cut short or damaged"),
    (foreign_parquet, "foreign.parquet, field 'moesim': no 'moesim' key-value metadata"),
])
def test_a_fault_in_a_listed_trace_names_the_trace_then_the_spec(files, capsys, write, words):
    name = write(files)
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": [name], "hw": ["hw.yaml"], "systems": ["cpu-only"]}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: error: {files / name}") and words in err, err
    assert f" (listed in {path} under 'traces') (fix: " in err, err
    assert err.count("\n") == 1 and not (files / "r.parquet").exists()
    with pytest.raises(MoesimError) as api:  # moesim.sweep says the same
        moesim.sweep(str(path))
    assert f"(listed in {path} under 'traces')" in str(api.value)


def test_a_profile_or_trace_not_found_is_the_spec_own_field(files, capsys):
    """Not found is a fault of the spec (its entry), not inside a file: named at the spec's field, as before."""
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["nosuch.yaml"], "systems": ["cpu-only"]}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: error: {path}, field 'hw': hardware profile not found") and "listed" not in err


def test_a_listed_profile_that_is_not_yaml_names_the_profile_then_the_spec(files, capsys):
    """It was named at the spec's field 'hw' with the profile in brackets, unlike a profile's missing field."""
    (files / "broken.yaml").write_text("gpu: [\n")
    path = files / "spec.yaml"
    path.write_text(yaml.safe_dump({"traces": ["t.parquet"], "hw": ["broken.yaml"], "systems": ["cpu-only"]}))
    assert main(["sweep", str(path), "--out", str(files / "r.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moesim: error: {files / 'broken.yaml'}: not valid YAML") and \
        f"(listed in {path} under 'hw') (fix: " in err, err
