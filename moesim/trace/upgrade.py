"""``moesim trace upgrade``: a trace in format v2, whatever version it was written in.

Format v1 stored ``scores`` as a fixed-size list of float16, which Parquet reads
about fourteen times slower than v2's one binary value a row
(``docs/trace-format.md``). Both are replayed alike; upgrading a v1 trace that
has scores makes every later read of them fast. The rows, their order and every
other column stay as they are; the file appears whole at ``out`` or not at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moesim.trace.io import ROW_GROUP_ROWS, PathLike, _open, iter_record_batches, parquet_options, read_meta
from moesim.trace.schema import META_KEY, SCHEMA_VERSION, column_type, score_rows, scores_to_arrow
from moesim.trace.validate import RowsRead, validate_trace
from moesim.trace.writer import RowGroups, refuse_folder, writing_path


@dataclass
class Upgrade:
    """What :func:`upgrade_trace` wrote."""

    rows: int
    #: the version the source was written in
    from_version: int
    #: whether the trace has ``scores``, and whether they were rewritten (a v1 trace's)
    has_scores: bool
    rewrote_scores: bool


def upgrade_trace(path: PathLike, out: PathLike, progress: RowsRead | None = None) -> Upgrade:
    """Validate ``path`` and write it to ``out`` in format v2, a row group at a time (``progress``: told the
    rows each of the two passes reads)."""
    refuse_folder(Path(out))
    validate_trace(path, progress=progress)
    meta = read_meta(path)
    num_experts = meta.model.num_experts
    written = replace(meta, schema_version=SCHEMA_VERSION).to_json().encode()
    out = Path(out)
    tmp = writing_path(out)
    writer: RowGroups | None = None  # the source's row groups gathered whole: one a step was common
    rows, rewrote, has_scores = 0, False, False
    try:
        source = _open(path)
        for batch in iter_record_batches(source, ROW_GROUP_ROWS, source.schema_arrow.names):
            table = pa.Table.from_batches([batch])
            has_scores = "scores" in table.column_names
            if has_scores and not pa.types.is_fixed_size_binary(table.schema.field("scores").type):
                scores = scores_to_arrow(score_rows(table.column("scores"), num_experts), num_experts)
                field = pa.field("scores", column_type("scores", meta.model.top_k, num_experts), nullable=False)
                table = table.set_column(table.column_names.index("scores"), field, scores)
                rewrote = True
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: written})
            if writer is None:
                writer = RowGroups(pq.ParquetWriter(tmp, table.schema, **parquet_options(table.column_names)))
            writer.add(table)
            rows += table.num_rows
            if progress is not None:
                progress(table.num_rows)
        if writer is not None:
            writer.close()
            writer = None
            if tmp != out:
                os.replace(tmp, out)
    finally:
        if writer is not None:
            writer.close(write_rest=False)
        if tmp != out:
            tmp.unlink(missing_ok=True)
    return Upgrade(rows=rows, from_version=meta.schema_version, has_scores=has_scores, rewrote_scores=rewrote)
