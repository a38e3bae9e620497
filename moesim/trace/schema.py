"""Trace format v1: columns, types and file metadata.

One row per (request, token, MoE layer), sorted by ``step``, ``layer``,
``request``, ``position`` so that a reader can stream one forward pass at a
time. The file's key-value metadata ``moesim`` holds JSON with the schema
version, the model shape, ``weights_renormalized`` and the trace's ``source``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from moesim.errors import TraceFormatError
from moesim.model.spec import ModelSpec

SCHEMA_VERSION = 1
META_KEY = b"moesim"
PHASES = ("prefill", "decode")

REQUIRED_COLUMNS = ("request", "step", "phase", "position", "layer", "experts")
PREDICTOR_COLUMNS = ("pred_next_layer", "pred_residual", "pred_next_token")
OPTIONAL_COLUMNS = ("weights", "scores", *PREDICTOR_COLUMNS, "token_id")
SORT_KEYS = ("step", "layer", "request", "position")


def column_type(name: str, top_k: int, num_experts: int) -> pa.DataType:
    """The arrow type a column must have in a v1 trace of this shape."""
    types: dict[str, pa.DataType] = {
        "request": pa.int32(),
        "step": pa.int32(),
        "phase": pa.dictionary(pa.int8(), pa.string()),
        "position": pa.int32(),
        "layer": pa.int16(),
        "experts": pa.list_(pa.int16(), top_k),
        "weights": pa.list_(pa.float32(), top_k),
        "scores": pa.list_(pa.float16(), num_experts),
        "token_id": pa.int32(),
    }
    for name_ in PREDICTOR_COLUMNS:
        types[name_] = pa.list_(pa.int16())
    if name not in types:
        raise KeyError(name)
    return types[name]


def arrow_schema(meta: "TraceMeta", columns: list[str]) -> pa.Schema:
    model = meta.model
    fields = [pa.field(c, column_type(c, model.top_k, model.num_experts), nullable=False) for c in columns]
    return pa.schema(fields, metadata={META_KEY: meta.to_json().encode()})


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
        if isinstance(version, bool) or version != SCHEMA_VERSION:
            raise TraceFormatError(f"unknown schema_version {version!r}; this moesim reads version "
                                   f"{SCHEMA_VERSION}", source=origin, field="moesim.schema_version",
                                   fix="upgrade moesim or convert the trace to version 1")
        if "model" not in data or not isinstance(data["model"], dict):
            raise TraceFormatError("metadata has no model description", source=origin,
                                   field="moesim.model", fix=fix)
        try:
            model = ModelSpec.from_dict(data["model"], origin=f"{origin} metadata")
        except Exception as err:  # ConfigError -> trace error naming the same field
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
