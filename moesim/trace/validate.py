"""Trace validator: the first violation of format v1 as one clear error.

Checks run batch by batch (bounded memory). Row numbers in messages are
0-based positions in the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from moesim.errors import TraceFormatError
from moesim.trace.io import PathLike, _open, _phase_codes, read_meta
from moesim.trace.schema import OPTIONAL_COLUMNS, PHASES, PREDICTOR_COLUMNS, REQUIRED_COLUMNS, column_type


@dataclass
class TraceSummary:
    rows: int
    steps: int
    columns: list[str]


def _check_type(path: str, name: str, actual: pa.DataType, expected: pa.DataType) -> None:
    if name == "phase" and (pa.types.is_string(actual) or pa.types.is_large_string(actual)
                            or (pa.types.is_dictionary(actual) and pa.types.is_string(actual.value_type))):
        return
    if actual == expected:
        return
    if isinstance(expected, pa.FixedSizeListType) and isinstance(actual, pa.FixedSizeListType) \
            and actual.value_type == expected.value_type:
        what = "experts per row (top_k)" if name in ("experts", "weights") else "scores per row (num_experts)"
        raise TraceFormatError(f"list length {actual.list_size}, but the model metadata says "
                               f"{expected.list_size} {what}", source=path, field=name,
                               fix="make every row's list match the model metadata")
    raise TraceFormatError(f"has type {actual}, expected {expected}", source=path, field=name,
                           fix=f"cast the column to {expected}")


def _check_list_lengths(pf, path: str, name: str, actual: pa.DataType, expected: pa.DataType) -> None:
    """A variable-length list where a fixed one belongs: name the first row of the wrong length."""
    if not (isinstance(expected, pa.FixedSizeListType)
            and (pa.types.is_list(actual) or pa.types.is_large_list(actual))):
        return
    width = expected.list_size
    what = "top_k" if name in ("experts", "weights") else "num_experts"
    offset = 0
    for batch in pf.iter_batches(batch_size=65_536, columns=[name]):
        lengths = batch.column(0).value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
        bad = lengths != width
        if bad.any():
            row = _first(bad)
            raise TraceFormatError(f"{lengths[row]} values, but the model metadata says {what} = {width}",
                                   source=path, field=name, row=offset + row,
                                   fix=f"every row needs exactly {width} values ({what})")
        offset += batch.num_rows


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def validate_trace(path: PathLike) -> TraceSummary:
    """Raise :class:`TraceFormatError` on the first problem; return a summary if the trace is valid."""
    name = str(path)
    pf = _open(path)
    meta = read_meta(path)
    model = meta.model
    schema = pf.schema_arrow
    for col in REQUIRED_COLUMNS:
        if col not in schema.names:
            raise TraceFormatError("required column missing", source=name, field=col,
                                   fix=f"add the '{col}' column (see trace format v1)")
    for col in schema.names:
        if col in REQUIRED_COLUMNS or col in OPTIONAL_COLUMNS:
            expected = column_type(col, model.top_k, model.num_experts)
            _check_list_lengths(pf, name, col, schema.field(col).type, expected)
            _check_type(name, col, schema.field(col).type, expected)
    present = [c for c in schema.names if c in REQUIRED_COLUMNS or c in OPTIONAL_COLUMNS]

    offset = 0
    last_key: tuple[int, int, int, int] | None = None
    steps = 0
    for batch in pf.iter_batches(batch_size=65_536, columns=present):
        n = batch.num_rows
        keys = [batch.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
                for c in ("step", "layer", "request", "position")]
        step, layer, request, position = keys
        phase = _phase_codes(batch.column("phase"))
        if (phase < 0).any():
            row = _first(phase < 0)
            raise TraceFormatError(f"phase must be one of {PHASES}", source=name, field="phase",
                                   row=offset + row, fix="use 'prefill' or 'decode'")
        bad = (layer < 0) | (layer >= model.num_layers)
        if bad.any():
            row = _first(bad)
            raise TraceFormatError(f"layer {layer[row]} outside [0, {model.num_layers})", source=name,
                                   field="layer", row=offset + row,
                                   fix="index MoE layers from 0, or fix num_layers in the model metadata")
        experts = batch.column("experts").flatten().to_numpy(zero_copy_only=False)
        experts = experts.reshape(n, model.top_k).astype(np.int64)
        bad_rows = ((experts < 0) | (experts >= model.num_experts)).any(axis=1)
        if bad_rows.any():
            row = _first(bad_rows)
            raise TraceFormatError(f"expert id in {experts[row].tolist()} outside [0, {model.num_experts})",
                                   source=name, field="experts", row=offset + row,
                                   fix="expert ids must index the model's routed experts")
        ordered = np.sort(experts, axis=1)
        dup = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if dup.any():
            row = _first(dup)
            raise TraceFormatError(f"duplicate expert in {experts[row].tolist()}", source=name,
                                   field="experts", row=offset + row, fix="each routed expert appears once per row")
        for pred in PREDICTOR_COLUMNS:
            if pred in present:
                values = batch.column(pred).flatten().to_numpy(zero_copy_only=False).astype(np.int64)
                if ((values < 0) | (values >= model.num_experts)).any():
                    lengths = batch.column(pred).value_lengths().to_numpy()
                    row_of = np.repeat(np.arange(n), lengths)
                    row = int(row_of[_first((values < 0) | (values >= model.num_experts))])
                    raise TraceFormatError(f"predicted expert outside [0, {model.num_experts})", source=name,
                                           field=pred, row=offset + row, fix="predictions must be expert ids")
        # sort order: (step, layer, request, position) strictly increasing
        stacked = np.stack(keys, axis=1)
        if last_key is not None:
            stacked = np.vstack([np.array(last_key)[None, :], stacked])
        prev, cur = stacked[:-1], stacked[1:]
        diff = cur - prev
        # lexicographic comparison: first non-zero difference must be positive
        nonzero = diff != 0
        first_nz = np.where(nonzero.any(axis=1), nonzero.argmax(axis=1), -1)
        sign = np.where(first_nz >= 0, diff[np.arange(len(diff)), np.maximum(first_nz, 0)], 0)
        bad = sign <= 0
        if bad.any():
            row = _first(bad) + (0 if last_key is not None else 1)
            field = ("step", "layer", "request", "position")[max(int(first_nz[_first(bad)]), 0)]
            what = "duplicate row" if sign[_first(bad)] == 0 else f"{field} out of order"
            raise TraceFormatError(f"{what} (rows must be sorted by step, layer, request, position)",
                                   source=name, field=field, row=offset + row,
                                   fix="sort the rows by step, layer, request, position")
        steps += int(np.count_nonzero(np.diff(stacked[:, 0]))) + (1 if last_key is None else 0)
        last_key = tuple(int(k[-1]) for k in keys)  # type: ignore[assignment]
        offset += n
    return TraceSummary(rows=offset, steps=steps, columns=present)


def check_path_writable(path: PathLike) -> Path:
    path = Path(path)
    if path.exists() and path.is_dir():
        raise TraceFormatError("output path is a directory", source=str(path), fix="give a file name")
    return path
