"""Traces: format v2 (and v1), streaming I/O, validation, statistics, importers, synthesis, capture."""

from moesim.trace.io import Step, TraceWriter, iter_steps, read_frame, read_meta, read_table, write_trace
from moesim.trace.schema import PHASES, PREDICTOR_COLUMNS, SCHEMA_VERSION, TraceMeta
from moesim.trace.validate import validate_trace

__all__ = ["PHASES", "PREDICTOR_COLUMNS", "SCHEMA_VERSION", "Step", "TraceMeta", "TraceWriter",
           "iter_steps", "read_frame", "read_meta", "read_table", "validate_trace", "write_trace"]
