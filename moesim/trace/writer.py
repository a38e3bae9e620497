"""Writing traces (format v2): :class:`TraceWriter` streams row groups into a temporary file and renames it
into place on close, so a trace appears whole or not at all; the Parquet options every trace writer uses."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.errors import TraceFormatError
from moesim.trace.schema import (OPTIONAL_COLUMNS, PHASES, REQUIRED_COLUMNS, TraceMeta, arrow_schema, column_type,
                                 scores_to_arrow)
from moesim.util import tmp_path_for

ROW_GROUP_ROWS = 262_144
#: a row group is also closed once the rows gathered for it hold this many bytes (scores of a many-expert
#: model take 512 bytes a row: 262,144 such rows would be held in memory at once)
ROW_GROUP_BYTES = 64 << 20
#: small tables gathered are joined into one block this many at a time: each table costs about 11 KB of
#: objects beside its data, 360 MB for the 32,768 eight-row steps of one row group of a one-token-request trace
COMPACT_TABLES = 256
PathLike = str | os.PathLike
#: columns written without a dictionary: float16 router probabilities repeat too little for one to pay
#: (a DeepSeek-V3 trace's file is 2% smaller with it), and decoding dictionary pages of 2-byte values
#: is 5 to 8 times slower than plain ones (benchmarks/validate_speed.py reads this column in full)
PLAIN_COLUMNS = ("scores",)
#: columns written uncompressed: zstd took 13% off a 4,096-token DeepSeek-V3 prefill's scores (101 MiB
#: against 116) and made reading them five times slower (0.24 s against 0.05, benchmarks/trace_io.py
#: --scores); snappy and lz4 took nothing off
UNCOMPRESSED_COLUMNS = ("scores",)


def _leaf_paths(column: str) -> tuple[str, str]:
    """The names Parquet may know a column by: its own, and its values' path when it is a list (`experts`,
    `weights` and the predictors: `experts.list.element`); a name the file lacks is ignored."""
    return column, f"{column}.list.element"


def parquet_options(columns: Sequence[str]) -> dict[str, Any]:
    """Writer options of a trace with these columns (zstd but :data:`UNCOMPRESSED_COLUMNS`; dictionaries but
    :data:`PLAIN_COLUMNS`). Options of a list column apply only under its values' path: keyed by the column's
    name alone, `experts`, `weights` and the predictors were written uncompressed and without a dictionary
    (a 5.1M-row Mixtral trace without scores took 211 MB, 65 MB with them compressed)."""
    return {"compression": {path: "none" if c in UNCOMPRESSED_COLUMNS else "zstd"
                            for c in columns for path in _leaf_paths(c)},
            "use_dictionary": [path for c in columns if c not in PLAIN_COLUMNS for path in _leaf_paths(c)]}


def _to_arrow(name: str, values: Any, meta: TraceMeta) -> pa.Array:
    model = meta.model
    typ = column_type(name, model.top_k, model.num_experts)
    if name == "scores":
        return scores_to_arrow(values, model.num_experts)
    if name == "phase":
        codes = np.asarray(values)
        if codes.dtype.kind in "US" or codes.dtype == object:
            lookup = {p: i for i, p in enumerate(PHASES)}
            codes = np.array([lookup[str(v)] for v in codes], dtype=np.int8)
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int8)), pa.array(PHASES))
    if isinstance(typ, pa.FixedSizeListType):
        width = typ.list_size
        flat = np.ascontiguousarray(values, dtype=typ.value_type.to_pandas_dtype()).reshape(-1)
        if flat.size % width:
            raise ValueError(f"column {name}: {flat.size} values is not a multiple of {width}")
        return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=typ.value_type), width)
    if isinstance(typ, pa.ListType):
        if isinstance(values, tuple) and len(values) == 2:  # (offsets, flat values)
            offsets, flat = values
            return pa.ListArray.from_arrays(pa.array(np.asarray(offsets, dtype=np.int32)),
                                            pa.array(np.asarray(flat, dtype=np.int16)))
        return pa.array([list(map(int, v)) for v in values], type=typ)
    return pa.array(np.asarray(values).astype(typ.to_pandas_dtype()), type=typ)


def writing_path(out: Path) -> Path:
    """Where a trace for ``out`` is written before it is renamed into place (leftovers of writers that died are
    removed): a temporary name beside it, or ``out`` itself when it already is this process's staged file
    (:func:`moesim.util.output_file` names it ``.NAME.PID.tmp.SUFFIX``; the command renames it into place at
    its end and removes it on failure). A temporary name inside that one, ``..NAME.PID.tmp.SUFFIX.PID.tmp``,
    was left behind by a ``kill -9`` and never removed: no later run looks for such names."""
    if re.fullmatch(rf"\..+\.{os.getpid()}\.tmp(\.\w+)?", out.name):
        return out
    return tmp_path_for(out)


def refuse_folder(out: Path) -> None:
    """An output trace named as an existing folder is refused before any work (the rename into place failed
    with IsADirectoryError once the whole trace was written)."""
    if out.is_dir():
        raise TraceFormatError("output path is a directory", source=str(out), field="out",
                               fix=f"give a file name ending in .parquet, e.g. {out / 'trace.parquet'}")


class RowGroups:
    """A ParquetWriter fed tables of any size that writes them in whole row groups of ROW_GROUP_ROWS (or of
    ROW_GROUP_BYTES): each write_table call ends a row group, and a synthetic trace of short requests, written
    a step at a time, had 40,000 groups of 128 rows (a 43 MB footer; trace validate took 23 s, against 2.4 s
    for the same rows in groups of ROW_GROUP_ROWS)."""

    def __init__(self, writer: pq.ParquetWriter) -> None:
        self.writer = writer
        self._pending: list[pa.Table] = []
        self._joined = 0  # the first tables of _pending, each a block of COMPACT_TABLES joined
        self._rows = 0
        self._bytes = 0

    def add(self, table: pa.Table) -> None:
        self._pending.append(table)
        if len(self._pending) - self._joined >= COMPACT_TABLES:
            self._pending[self._joined:] = [pa.concat_tables(self._pending[self._joined:]).combine_chunks()]
            self._joined += 1
        self._rows += table.num_rows
        self._bytes += table.nbytes
        if self._rows >= ROW_GROUP_ROWS or self._bytes >= ROW_GROUP_BYTES:
            self._write(whole_only=self._bytes < ROW_GROUP_BYTES)

    def _write(self, whole_only: bool) -> None:
        """Write the rows gathered; with ``whole_only`` keep a last partial group back for the next tables."""
        gathered = pa.concat_tables(self._pending)
        written = gathered.num_rows - gathered.num_rows % ROW_GROUP_ROWS if whole_only else gathered.num_rows
        if written:
            self.writer.write_table(gathered.slice(0, written), row_group_size=ROW_GROUP_ROWS)
        rest = gathered.slice(written)
        self._pending = [rest] if rest.num_rows else []
        self._joined = len(self._pending)
        self._rows = rest.num_rows
        self._bytes = rest.nbytes if rest.num_rows else 0

    def close(self, write_rest: bool = True) -> None:
        """Write the rows still gathered (unless ``write_rest`` is False: the file is being abandoned) and
        close the file."""
        if self._pending and write_rest:
            self._write(whole_only=False)
        self._pending, self._joined = [], 0
        self.writer.close()


class TraceWriter:
    """Write a trace (format v2) in batches; the file appears at ``path`` only on a clean close.

    ``columns`` names the optional columns the trace will carry besides the
    required ones. Each :meth:`write` takes a mapping of column name to values:
    1-D arrays for scalar columns, ``(n, top_k)`` / ``(n, num_experts)`` arrays for
    the fixed lists, and sequences of id lists (or ``(offsets, values)``) for
    predictor columns. Rows must already be in trace order.
    """

    def __init__(self, path: PathLike, meta: TraceMeta, columns: Sequence[str] = ()) -> None:
        unknown = [c for c in columns if c not in OPTIONAL_COLUMNS]
        if unknown:
            raise ValueError(f"unknown optional column(s): {unknown}")
        self.path = Path(path)
        refuse_folder(self.path)
        self.meta = meta
        self.columns = list(REQUIRED_COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in columns]
        self.schema = arrow_schema(meta, self.columns)
        self.rows = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = writing_path(self.path)
        options = parquet_options(self.columns)
        self._writer: RowGroups | None = RowGroups(pq.ParquetWriter(self._tmp, self.schema, **options))

    def write(self, data: Mapping[str, Any]) -> None:
        missing = [c for c in self.columns if c not in data]
        if missing:
            raise ValueError(f"batch lacks column(s) {missing}")
        arrays = [_to_arrow(c, data[c], self.meta) for c in self.columns]
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        assert self._writer is not None, "writer already closed"
        self._writer.add(table)
        self.rows += table.num_rows

    def close(self) -> Path:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            try:
                if self._tmp != self.path:
                    os.replace(self._tmp, self.path)
            except OSError:  # the file written stays nowhere: no temporary file left behind
                self._tmp.unlink(missing_ok=True)
                raise
        return self.path

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close(write_rest=False)
            self._writer = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_trace(path: PathLike, data: Mapping[str, Any], meta: TraceMeta) -> Path:
    """Write a whole trace in one call (rows already sorted in trace order)."""
    optional = [c for c in OPTIONAL_COLUMNS if c in data]
    with TraceWriter(path, meta, optional) as writer:
        writer.write(data)
    return Path(path)
