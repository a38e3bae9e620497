"""Timeline and decision-log files, and busy time computed from a timeline.

A timeline is a DataFrame with the columns of
:data:`moesim.sim.result.TIMELINE_COLUMNS`: one row per interval a resource
(``gpu``, ``cpu``, ``pcie``) spent on one piece of work, on one of its lanes
(stream, core pool or copy engine). The decision log has the columns of
:data:`moesim.sim.result.DECISION_COLUMNS`. Both are written as Parquet with a
fixed Arrow schema, so files from the simulator and the real backend read the
same way.

Timeline columns: ``resource``; ``lane`` (the GPU stream 0, the CPU expert pool 0,
or the copy engine); ``start_s`` and ``end_s`` (simulated seconds from the trace's
start); ``kind`` (:data:`TIMELINE_KINDS`); ``step``; ``layer`` (the MoE layer, -1
for work outside the MoE layers: embedding, dense layers, LM head, sampling);
``expert`` (-1 for work of no one expert); ``tokens`` (tokens computed; 0 for
copies). Decision-log columns: ``step``, ``layer`` (the layer planned),
``expert``, ``action`` (:data:`DECISION_ACTIONS`) and ``target_layer`` (the layer
the expert belongs to: a prefetch or an eviction may concern another layer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.errors import ConfigError
from moesim.sim.result import DECISION_COLUMNS, TIMELINE_COLUMNS
from moesim.util import tmp_path_for

RESOURCES = ("pcie", "gpu", "cpu")

#: the ``kind`` of a timeline row, per resource, and what it is
TIMELINE_KINDS: dict[str, dict[str, str]] = {
    "gpu": {"embedding": "token embedding", "attention": "attention and gate of a layer",
            "predict": "the next layer's attention and gate run early on the stream to name its prefetches "
                       "(004 Sec. 4.2); a plan's own decision time (plan.overhead_s: SMoE's predictor, HybriMoE's "
                       "and DALI's scheduling, cache management) is host time the stream waits for, a gap as "
                       "kernel launches are, not a span",
            "dense_ffn": "the dense layers' FFN", "shared": "a layer's shared experts",
            "expert": "a routed expert", "lm_head": "LM head", "sampling": "sampling"},
    "cpu": {"expert": "a routed expert on the CPU pool", "deferred": "a deferred expert (Expert Deferral)"},
    "pcie": {"load": "a demand load into a cache slot", "prefetch": "a prefetch into a cache slot",
             "stage": "a copy into a staging buffer (the expert is not kept)",
             "chunk": "the part of a prefetch copied before a demand load preempted it (engine.copy_chunk_bytes)",
             "writeback": "an evicted expert copied back to the host (device to host)"},
}
#: the ``action`` of a decision-log row, and what it means
DECISION_ACTIONS: dict[str, str] = {
    "gpu_hit": "computed on the GPU from a slot that held it when the layer was planned",
    "gpu_inflight": "computed on the GPU once a copy already under way arrived",
    "gpu_load": "computed on the GPU after a demand load into a slot",
    "gpu_stream": "computed on the GPU from a staging buffer, not kept",
    "cpu": "computed on the CPU",
    "deferred": "computed on the CPU, deferred past the layer (Expert Deferral)",
    "prefetch": "copied ahead of need into a slot of target_layer",
    "evict": "removed from a slot of target_layer",
    "cancel": "a prefetch into target_layer dropped from the copy queue before it started; its slot free again",
}

_DICT = pa.dictionary(pa.int8(), pa.string())
TIMELINE_SCHEMA = pa.schema([
    ("resource", _DICT), ("lane", pa.int16()), ("start_s", pa.float64()), ("end_s", pa.float64()),
    ("kind", _DICT), ("step", pa.int32()), ("layer", pa.int16()), ("expert", pa.int32()),
    ("tokens", pa.int32()),
])
DECISION_SCHEMA = pa.schema([
    ("step", pa.int32()), ("layer", pa.int16()), ("expert", pa.int32()), ("action", _DICT),
    ("target_layer", pa.int16()),
])


def check_columns(frame: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    """Raise a one-line :class:`ConfigError` naming the first column ``frame`` lacks."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ConfigError(f"{what} lacks column '{missing[0]}'", field=missing[0],
                          fix=f"pass a frame with columns {', '.join(columns)} (result_to_frames gives one)")


def check_timeline(frame: pd.DataFrame) -> None:
    """Columns present and every interval ends no earlier than it starts."""
    check_columns(frame, TIMELINE_COLUMNS, "timeline")
    start = frame["start_s"].to_numpy(dtype=float)
    end = frame["end_s"].to_numpy(dtype=float)
    bad = np.flatnonzero(~(end >= start))  # also catches NaN
    if bad.size:
        row = int(bad[0])
        raise ConfigError(f"interval ends before it starts ({start[row]!r} > {end[row]!r})",
                          field="end_s", row=row, fix="every timeline row needs start_s <= end_s")


def _column(values: pd.Series, typ: pa.DataType) -> pa.Array:
    if pa.types.is_dictionary(typ):
        return pa.array(values.astype(str).to_numpy(), type=typ.value_type).dictionary_encode()
    return pa.array(values.to_numpy(), type=typ)


def _write_parquet(frame: pd.DataFrame, path: str | os.PathLike, schema: pa.Schema) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = [_column(frame[f.name], f.type) for f in schema]
    table = pa.Table.from_arrays(columns, schema=schema)
    tmp = tmp_path_for(path)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_timeline(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a timeline as Parquet; the file appears whole at ``path`` or not at all."""
    check_timeline(frame)
    return _write_parquet(frame, path, TIMELINE_SCHEMA)


def write_decisions(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a decision log as Parquet; the file appears whole at ``path`` or not at all."""
    check_columns(frame, DECISION_COLUMNS, "decision log")
    return _write_parquet(frame, path, DECISION_SCHEMA)


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total length covered by intervals ``[start, end)``; overlapping parts count once."""
    if len(start) == 0:
        return 0.0
    order = np.argsort(start, kind="stable")
    start, end = np.asarray(start, dtype=float)[order], np.asarray(end, dtype=float)[order]
    reach = np.maximum.accumulate(end)
    # an interval opens a new merged block when it starts after everything before it ended
    opens = np.ones(len(start), dtype=bool)
    opens[1:] = start[1:] > reach[:-1]
    first = np.flatnonzero(opens)
    last = np.append(first[1:] - 1, len(start) - 1)
    return float(np.sum(reach[last] - start[first]))


def busy_time(frame: pd.DataFrame, resource: str, lane: int | None = None) -> float:
    """Seconds during which ``resource`` (on ``lane``, or on any of its lanes) was doing something.

    Spans that overlap, on one lane or across lanes (two copy engines moving
    experts at once), count once: this is wall-clock busy time, so busy time
    divided by the makespan is a utilization no greater than 1.
    """
    check_columns(frame, TIMELINE_COLUMNS, "timeline")
    mask = frame["resource"].to_numpy() == resource
    if lane is not None:
        mask &= frame["lane"].to_numpy() == lane
    rows = frame.loc[mask]
    return union_length(rows["start_s"].to_numpy(dtype=float), rows["end_s"].to_numpy(dtype=float))


def in_steps(frame: pd.DataFrame, steps: tuple[int, int] | None) -> pd.DataFrame:
    """The rows of timeline ``frame`` in steps ``first..last`` (inclusive); all of them for None."""
    if steps is None:
        return frame
    return frame[frame["step"].between(steps[0], steps[1])]
