"""Timeline and decision-log Parquet files; busy time as a union of intervals."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from moesim.analysis.timeline import busy_time, union_length, write_decisions, write_timeline
from moesim.errors import ConfigError
from moesim.sim.result import DECISION_COLUMNS, TIMELINE_COLUMNS


def _frame(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(TIMELINE_COLUMNS))


ROWS = [
    ("gpu", 0, 0.0, 1.0, "attention", 0, 0, -1, 4),
    ("gpu", 0, 0.5, 2.0, "expert", 0, 0, 3, 2),      # overlaps the previous span: [0, 2] counts 2 s
    ("gpu", 0, 1.0, 1.5, "expert", 0, 0, 4, 1),      # inside [0, 2]: adds nothing
    ("gpu", 0, 3.0, 4.0, "expert", 0, 1, 5, 1),      # separate: +1 s
    ("gpu", 1, 3.5, 5.0, "shared", 0, 1, -1, 4),     # other lane, overlaps [3, 4]: union to [3, 5]
    ("pcie", 0, 0.0, 0.25, "load", 0, 0, 3, 0),
    ("pcie", 0, 0.25, 0.75, "prefetch", 0, 1, 5, 0),  # back to back: [0, 0.75]
    ("cpu", 0, 2.0, 2.0, "expert", 0, 0, 1, 1),      # zero length
]


def test_busy_time_by_hand() -> None:
    frame = _frame(ROWS)
    assert busy_time(frame, "gpu", lane=0) == pytest.approx(3.0)
    assert busy_time(frame, "gpu", lane=1) == pytest.approx(1.5)
    assert busy_time(frame, "gpu") == pytest.approx(4.0)  # [0, 2] and [3, 5]
    assert busy_time(frame, "pcie") == pytest.approx(0.75)
    assert busy_time(frame, "cpu") == 0.0
    assert busy_time(frame, "disk") == 0.0


def test_union_length_cases() -> None:
    assert union_length([], []) == 0.0
    assert union_length([5.0, 0.0, 1.0], [6.0, 2.0, 3.0]) == pytest.approx(4.0)  # unsorted input
    assert union_length([0.0, 0.0], [1.0, 1.0]) == pytest.approx(1.0)  # duplicates
    assert union_length([0.0, 1.0, 2.0], [10.0, 2.0, 3.0]) == pytest.approx(10.0)  # long first span covers all


def test_write_timeline_round_trip(tmp_path: Path) -> None:
    frame = _frame(ROWS)
    path = write_timeline(frame, tmp_path / "sub" / "timeline.parquet")
    back = pd.read_parquet(path)
    assert list(back.columns) == list(TIMELINE_COLUMNS)
    assert back["resource"].astype(str).tolist() == frame["resource"].tolist()
    assert back["kind"].astype(str).tolist() == frame["kind"].tolist()
    for column in ("lane", "start_s", "end_s", "step", "layer", "expert", "tokens"):
        assert back[column].tolist() == frame[column].tolist()
    schema = pq.read_schema(path)
    assert str(schema.field("start_s").type) == "double" and str(schema.field("layer").type) == "int16"
    assert [p.name for p in path.parent.iterdir()] == ["timeline.parquet"]


def test_write_decisions_round_trip(tmp_path: Path) -> None:
    frame = pd.DataFrame([(0, 0, 3, "gpu_load", 0), (0, 0, 5, "prefetch", 1), (1, 2, 7, "cpu", 2)],
                         columns=list(DECISION_COLUMNS))
    back = pd.read_parquet(write_decisions(frame, tmp_path / "decisions.parquet"))
    assert back["action"].astype(str).tolist() == ["gpu_load", "prefetch", "cpu"]
    assert back["target_layer"].tolist() == [0, 1, 2] and back["expert"].tolist() == [3, 5, 7]


def test_bad_timeline_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "timeline.parquet"
    write_timeline(_frame(ROWS), path)
    before = path.read_bytes()
    backwards = _frame(ROWS + [("gpu", 0, 9.0, 8.0, "expert", 1, 0, 1, 1)])
    with pytest.raises(ConfigError, match="row 8") as err:
        write_timeline(backwards, path)
    assert "end_s" in str(err.value)
    with pytest.raises(ConfigError, match="lacks column 'layer'"):
        write_decisions(pd.DataFrame({"step": [0]}), tmp_path / "d.parquet")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.parquet"]
