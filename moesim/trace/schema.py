"""Trace format v2: columns, types and file metadata.

One row per (request, token, MoE layer), sorted by ``step``, ``layer``,
``request``, ``position`` so that a reader can stream one forward pass at a
time. The file's key-value metadata ``moesim`` holds JSON with the schema
version, the model shape, ``weights_renormalized`` and the trace's ``source``.

Version 2 differs from version 1 in one column: ``scores``, a row's router
probabilities over every expert, is one fixed-size binary value of
``num_experts`` little-endian float16 numbers, where version 1 had a fixed-size
list of float16. Parquet stores a list with a repetition and a definition level
per value, and decoding those levels made reading the column about fourteen
times slower (0.69 s against 0.05 s for a 4,096-token DeepSeek-V3 prefill's
237,568 rows of 256 scores, ``benchmarks/trace_io.py --scores``). Both forms are
read (:func:`score_rows`); writers write version 2.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from moesim.errors import MoesimError, TraceFormatError
from moesim.model.spec import ModelSpec

SCHEMA_VERSION = 2
#: versions this moesim reads (1: ``scores`` as a fixed-size list of float16, still read as it was)
READ_VERSIONS = (1, 2)
META_KEY = b"moesim"
PHASES = ("prefill", "decode")

REQUIRED_COLUMNS = ("request", "step", "phase", "position", "layer", "experts")
PREDICTOR_COLUMNS = ("pred_next_layer", "pred_residual", "pred_next_token")
OPTIONAL_COLUMNS = ("weights", "scores", *PREDICTOR_COLUMNS, "token_id")
SORT_KEYS = ("step", "layer", "request", "position")


@functools.lru_cache(maxsize=256)
def column_type(name: str, top_k: int, num_experts: int) -> pa.DataType:
    """The arrow type a column is written with in a trace of this shape (cached: the writer asks for every
    column of every table it is given, 5 us a call, a tenth of ``trace synth`` of one-token requests)."""
    types: dict[str, pa.DataType] = {
        "request": pa.int32(),
        "step": pa.int32(),
        "phase": pa.dictionary(pa.int8(), pa.string()),
        "position": pa.int32(),
        "layer": pa.int16(),
        "experts": pa.list_(pa.int16(), top_k),
        "weights": pa.list_(pa.float32(), top_k),
        "scores": pa.binary(SCORE_BYTES * num_experts),
        "token_id": pa.int32(),
    }
    for name_ in PREDICTOR_COLUMNS:
        types[name_] = pa.list_(pa.int16())
    if name not in types:
        raise KeyError(name)
    return types[name]


#: bytes of one stored score (a little-endian float16)
SCORE_BYTES = 2
SCORE_DTYPE = np.dtype("<f2")


def scores_list_type(num_experts: int) -> pa.DataType:
    """``scores`` as version 1 wrote it (and as a file written by hand may still have it): read as well."""
    return pa.list_(pa.float16(), num_experts)


def accepted_types(name: str, top_k: int, num_experts: int) -> tuple[pa.DataType, ...]:
    """The arrow types a column may have when read: the written one first."""
    written = column_type(name, top_k, num_experts)
    return (written, scores_list_type(num_experts)) if name == "scores" else (written,)


def scores_to_arrow(values: np.ndarray, num_experts: int) -> pa.Array:
    """Rows of ``num_experts`` scores as the written ``scores`` column: one fixed-size binary value per row."""
    rows = np.ascontiguousarray(values, dtype=SCORE_DTYPE).reshape(-1, num_experts)
    return pa.FixedSizeBinaryArray.from_buffers(column_type("scores", 1, num_experts), len(rows),
                                                [None, pa.py_buffer(rows)])


def score_rows(column: pa.Array | pa.ChunkedArray, num_experts: int) -> np.ndarray:
    """A ``scores`` column, in either stored form, as a (rows, ``num_experts``) float16 array; the
    binary form without a copy (a read-only view of the column's buffer) when it is one chunk."""
    if isinstance(column, pa.ChunkedArray):
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if pa.types.is_fixed_size_binary(column.type):
        width = column.type.byte_width
        if column.null_count or width != SCORE_BYTES * num_experts:  # the validator names the fault
            raise ValueError(f"scores of {width} bytes per row with nulls or not {num_experts} float16 values")
        values = np.frombuffer(column.buffers()[1], dtype=SCORE_DTYPE, count=len(column) * num_experts,
                               offset=column.offset * width)
        return values.reshape(len(column), num_experts)
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, num_experts)


def arrow_schema(meta: "TraceMeta", columns: list[str]) -> pa.Schema:
    model = meta.model
    fields = [pa.field(c, column_type(c, model.top_k, model.num_experts), nullable=False) for c in columns]
    # what is written is this version, whichever file the metadata came from
    written = meta if meta.schema_version == SCHEMA_VERSION else replace(meta, schema_version=SCHEMA_VERSION)
    return pa.schema(fields, metadata={META_KEY: written.to_json().encode()})


#: limits on the ``moesim`` metadata, checked before it is used
META_MAX_BYTES = 1 << 20
META_MAX_DEPTH = 32


def _check_depth(data: Any, origin: str) -> None:
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > META_MAX_DEPTH:
            raise RecursionError
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


@dataclass
class TraceMeta:
    """The ``moesim`` file metadata of a trace."""

    model: ModelSpec
    source: dict[str, Any] = field(default_factory=dict)
    weights_renormalized: bool = False
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps({
            "schema_version": self.schema_version,
            "model": self.model.to_dict(),
            "weights_renormalized": self.weights_renormalized,
            "source": self.source,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, origin: str) -> "TraceMeta":
        fix = "rewrite the file with moesim (trace import/synth/capture)"
        if len(text) > META_MAX_BYTES:
            raise TraceFormatError(f"metadata is {len(text):,} bytes; the limit is {META_MAX_BYTES:,}",
                                   source=origin, field="moesim", fix=fix)
        try:
            data = json.loads(text)
            _check_depth(data, origin)
        except RecursionError:
            raise TraceFormatError(f"metadata JSON nested deeper than {META_MAX_DEPTH} levels", source=origin,
                                   field="moesim", fix=fix) from None
        except ValueError:
            raise TraceFormatError("metadata is not valid JSON", source=origin, field="moesim", fix=fix) from None
        if not isinstance(data, dict):
            raise TraceFormatError("metadata is not a JSON object", source=origin, field="moesim", fix=fix)
        version = data.get("schema_version")
        if version is None:
            raise TraceFormatError("metadata has no schema_version", source=origin,
                                   field="moesim.schema_version", fix=fix)
        if isinstance(version, bool) or version not in READ_VERSIONS:
            raise TraceFormatError(f"unknown schema_version {version!r}; this moesim reads versions "
                                   f"{', '.join(map(str, READ_VERSIONS))}", source=origin,
                                   field="moesim.schema_version",
                                   fix=f"upgrade moesim or convert the trace to version {SCHEMA_VERSION}")
        if "model" not in data or not isinstance(data["model"], dict):
            raise TraceFormatError("metadata has no model description", source=origin,
                                   field="moesim.model", fix=fix)
        try:
            model = ModelSpec.from_dict(data["model"], origin=f"{origin} metadata")
        except MoesimError as err:  # the same fault as a trace error: one file, one field, one fix
            field_name = f"moesim.model.{err.field}" if err.field else "moesim.model"
            raise TraceFormatError(err.detail, source=origin, field=field_name,
                                   fix=f"{err.fix}; or {fix}" if err.fix else fix) from None
        except Exception as err:  # a value ModelSpec could not even hold (a wrong type)
            raise TraceFormatError(str(err), source=origin, field="moesim.model", fix=fix) from None
        source = data.get("source", {})
        if not isinstance(source, dict):
            raise TraceFormatError(f"source must be a JSON object, got {type(source).__name__}", source=origin,
                                   field="moesim.source", fix=fix)
        renormalized = data.get("weights_renormalized", False)
        if not isinstance(renormalized, bool):
            raise TraceFormatError(f"weights_renormalized must be true or false, got {renormalized!r}",
                                   source=origin, field="moesim.weights_renormalized", fix=fix)
        return cls(model=model, source=source, weights_renormalized=renormalized,
                   schema_version=version)
