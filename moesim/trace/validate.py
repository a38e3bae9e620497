"""Trace validator: the first violation of the trace format (v2, or v1) as one clear error.

Every command that reads a trace runs this pass before any work starts
(:func:`checked_meta`, memoised per file and process), and ``moesim trace
validate`` is the same pass. Checks are vectorised over columns, batch by
batch (bounded memory); row numbers in messages are 0-based positions in the
file. An optional column a run does not read (:data:`LAZY_COLUMNS`) is
checked on a thread beside the run, and :func:`settle` refuses the run's
results if it failed. What is checked:

* the file: Parquet magic bytes at both ends, readable footer and pages;
* the metadata: size, nesting, ``schema_version``, the model shape and its limits;
* the columns: every required one present, types and list widths, no nulls;
* the rows: at least one; ``step``, ``request``, ``position``, ``token_id`` not
  negative; ``layer`` in range; sorted by (step, layer, request, position)
  without duplicates; per request, positions grow from step to step and no
  prefill follows a decode;
* the routing: expert ids in range and distinct per row; weights finite, not
  negative, highest first, summing to 1 (times ``source.routed_scaling_factor``)
  when ``weights_renormalized``; scores finite and in [0, 1]; predicted ids in range.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa

from moesim.errors import TraceFormatError
from moesim.trace.io import (PARQUET_MAGIC, PathLike, _open, _phase_codes, iter_record_batches, not_found,
                             not_parquet, read_meta)
from moesim.trace.schema import (OPTIONAL_COLUMNS, PHASES, PREDICTOR_COLUMNS, REQUIRED_COLUMNS, SCORE_BYTES,
                                 SORT_KEYS, TraceMeta, accepted_types, score_rows)
from moesim.trace.validated import record_validated, was_validated

BATCH_ROWS = 65_536
#: told the rows of each batch a pass has read (a command's progress)
RowsRead = Callable[[int], None]
#: relative tolerance of weight sums (float32 weights, float16 scores they may come from)
SUM_TOLERANCE = 2e-2
#: scores are float16 probabilities: allow their rounding above 1
SCORE_MAX = 1.0 + 1e-3
#: checked before a run only when it reads them (and by `trace validate`), otherwise on a thread beside the
#: run: a run reads only the optional columns its system lists (``needed_columns``), and ``scores`` alone,
#: num_experts float16 values per row, costs a third of a DeepSeek-V3 cpu-only replay to decode
#: (benchmarks/validate_speed.py)
LAZY_COLUMNS = OPTIONAL_COLUMNS
REWRITE = "rewrite the file with moesim (trace import, synth or capture)"


@dataclass
class TraceSummary:
    rows: int
    steps: int
    columns: list[str]
    requests: int = 0


@dataclass
class _Carry:
    """State passed from one batch to the next."""

    last_key: np.ndarray | None = None
    steps: int = 0
    #: per request seen so far: (last step, its position, its phase code) of its first-layer rows
    requests: dict[int, tuple[int, int, int]] = field(default_factory=dict)


# ----------------------------------------------------------------------------- entry points
@dataclass
class _Deferred:
    """A check of lazy columns running on its own thread (pyarrow decodes them without holding the GIL)."""

    columns: frozenset[str]
    thread: threading.Thread
    error: BaseException | None = None


@dataclass
class _Checked:
    """What the validation pass has covered of one file (by stamp)."""

    meta: TraceMeta
    #: the lazy columns the file has
    lazy: frozenset[str]
    #: those checked
    done: frozenset[str]
    deferred: _Deferred | None = None


_CHECKED: dict[tuple, _Checked] = {}


def checked_meta(path: PathLike, columns: Iterable[str] | None = None,
                 progress: RowsRead | None = None) -> TraceMeta:
    """The trace's metadata after the validation pass over every column but the :data:`LAZY_COLUMNS` not
    listed in ``columns`` (the optional columns a run reads; None: all). Those are checked on a thread
    started here, beside the run: a caller that reports results calls :func:`settle` first (``simulate``
    does). Each file (by stamp) and column is checked once per process, so ``replay --system all`` and
    sweep workers pay once. ``progress`` is told the rows the validation pass reads, if it runs."""
    key = _stamp(path)
    if key is None:
        validate_trace(path, columns, progress)  # raises the file's own error
        return read_meta(path)
    state = _CHECKED.get(key)
    if state is None:
        lazy = frozenset(c for c in LAZY_COLUMNS if c in _open(path).schema_arrow.names)
        if was_validated(path):  # this very file passed the whole pass before (moesim.trace.validated)
            _CHECKED[key] = _Checked(read_meta(path), lazy, lazy)
            return _CHECKED[key].meta
        validate_trace(path, columns, progress)
        state = _CHECKED[key] = _Checked(read_meta(path), lazy, lazy if columns is None else lazy & set(columns))
    needed = state.lazy - state.done if columns is None else (state.lazy & set(columns)) - state.done
    if needed and state.deferred is not None and needed <= state.deferred.columns:
        settle(path)  # a run that reads them waits for the thread already checking them
    elif needed:
        _check_lazy(path, sorted(needed), state.meta)
        state.done |= needed
    rest = state.lazy - state.done
    if not rest:
        record_validated(path)
    elif state.deferred is None:
        state.deferred = _start_deferred(path, rest, state.meta)
    return state.meta


def settle(path: PathLike) -> None:
    """Wait for the check of ``path``'s lazy columns started by :func:`checked_meta`; raise its error.

    Call before reporting anything computed from the trace: a fault in a column the run did not read
    still refuses the run (exit 2), and nothing gets written."""
    key = _stamp(path)
    state = _CHECKED.get(key) if key is not None else None
    if state is None or state.deferred is None:
        return
    deferred = state.deferred
    deferred.thread.join()
    if deferred.error is not None:
        raise deferred.error  # the state keeps it: every later run of this file is refused too
    state.done |= deferred.columns
    state.deferred = None
    if state.done == state.lazy:
        record_validated(path)


def wait_for_checks() -> None:
    """Wait for every check still running beside a run (their errors stay for :func:`settle`): before a
    fork, no thread may hold a lock the child would inherit."""
    for state in list(_CHECKED.values()):
        if state.deferred is not None:
            state.deferred.thread.join()


def _start_deferred(path: PathLike, columns: frozenset[str], meta: TraceMeta) -> _Deferred:
    def check() -> None:
        try:
            _check_lazy(path, sorted(columns), meta)
        except BaseException as err:  # noqa: BLE001 - handed to settle(), in the thread that reports
            deferred.error = err

    # not a daemon: an interpreter that exits first waits for it rather than tearing pyarrow down under it
    deferred = _Deferred(columns, threading.Thread(target=check, name="moesim-check-lazy"))
    deferred.thread.start()
    return deferred


def _stamp(path: PathLike) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)


def will_validate(path: PathLike) -> bool:
    """Whether :func:`checked_meta` would run the validation pass over ``path`` now: neither checked in this
    process nor recorded as valid on disk."""
    key = _stamp(path)
    return key is None or (key not in _CHECKED and not was_validated(path))


def validate_trace(path: PathLike, columns: Iterable[str] | None = None,
                   progress: RowsRead | None = None) -> TraceSummary:
    """Raise :class:`TraceFormatError` on the first problem; return a summary if the trace is valid.

    Every column's type is checked, and every column's values row by row except
    :data:`LAZY_COLUMNS` not named in ``columns`` (default: all, as ``moesim trace validate`` does).
    ``progress`` is called with the rows of each batch checked (a long trace takes seconds a million rows).
    """
    name = str(path)
    _check_magic(path)
    pf = _open(path)
    meta = read_meta(path)
    model = meta.model
    schema = pf.schema_arrow
    for col in REQUIRED_COLUMNS:
        if col not in schema.names:
            raise TraceFormatError("required column missing", source=name, field=col,
                                   fix=f"add the '{col}' column (see docs/trace-format.md)")
    known = [c for c in schema.names if c in REQUIRED_COLUMNS or c in OPTIONAL_COLUMNS]
    for col in known:
        accepted = accepted_types(col, model.top_k, model.num_experts)
        _check_list_lengths(pf, name, col, schema.field(col).type, accepted[-1])
        _check_type(name, col, schema.field(col).type, accepted)
    wanted = None if columns is None else set(columns)
    present = [c for c in known if wanted is None or c not in LAZY_COLUMNS or c in wanted]
    if pf.metadata.num_rows == 0:
        raise TraceFormatError("the trace has no rows", source=name, fix="write at least one forward pass")
    weight_sum = _weight_sum(meta, name) if meta.weights_renormalized else None
    carry = _Carry()
    offset = 0
    try:
        batches = iter_record_batches(pf, BATCH_ROWS, present)
        for batch in batches:
            _check_batch(batch, name, meta, weight_sum, offset, carry)
            offset += batch.num_rows
            if progress is not None:
                progress(batch.num_rows)
    except (pa.ArrowException, OSError) as err:
        raise _unreadable(err, name, offset) from None
    return TraceSummary(rows=offset, steps=carry.steps, columns=known, requests=len(carry.requests))


def _check_lazy(path: PathLike, columns: list[str], meta: TraceMeta) -> None:
    """The row checks of lazy ``columns`` alone (:func:`validate_trace` has checked the rest, and their
    types), reading only them, in one thread."""
    name = str(path)
    weight_sum = _weight_sum(meta, name) if meta.weights_renormalized else None
    offset = 0
    try:
        for batch in iter_record_batches(_open(path), BATCH_ROWS, columns, use_threads=False):
            _check_nulls(batch, name, offset)
            _check_optional(batch, name, meta, weight_sum, offset)
            offset += batch.num_rows
    except (pa.ArrowException, OSError) as err:
        raise _unreadable(err, name, offset) from None


def _unreadable(err: Exception, name: str, offset: int) -> TraceFormatError:
    return TraceFormatError(f"unreadable data after row {offset} ({type(err).__name__}: "
                            f"{str(err).splitlines()[0][:120]})", source=name, fix="the file is damaged: " + REWRITE)


# ----------------------------------------------------------------------------- file level
def _check_magic(path: PathLike) -> None:
    name = str(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - 4, 0))
            tail = fh.read(4)
    except FileNotFoundError:
        raise not_found(name) from None
    except IsADirectoryError:
        raise TraceFormatError("is a folder, not a trace file", source=name, fix="give a .parquet file") from None
    except OSError as err:
        raise TraceFormatError(f"cannot read: {err.strerror or err}", source=name,
                               fix="check the path and permissions") from None
    if head != PARQUET_MAGIC or tail != PARQUET_MAGIC or size < 12:
        raise not_parquet(name, head, " (wrong magic bytes)")


def _weight_sum(meta: TraceMeta, name: str) -> float:
    factor = meta.source.get("routed_scaling_factor", 1.0) if isinstance(meta.source, dict) else 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not np.isfinite(factor) or factor <= 0:
        raise TraceFormatError(f"routed_scaling_factor {factor!r} is not a positive number", source=name,
                               field="moesim.source.routed_scaling_factor", fix=REWRITE)
    return float(factor)


def _check_type(path: str, name: str, actual: pa.DataType, accepted: tuple[pa.DataType, ...]) -> None:
    """``actual`` is one of the ``accepted`` types (the written one first), or one error naming the fault."""
    if name == "phase" and (pa.types.is_string(actual) or pa.types.is_large_string(actual)
                            or (pa.types.is_dictionary(actual) and pa.types.is_string(actual.value_type))):
        return
    if actual in accepted:
        return
    for expected in accepted:
        if isinstance(expected, pa.FixedSizeListType) and isinstance(actual, pa.FixedSizeListType) \
                and actual.value_type == expected.value_type:
            what = "experts per row (top_k)" if name in ("experts", "weights") else "scores per row (num_experts)"
            raise TraceFormatError(f"list length {actual.list_size}, but the model metadata says "
                                   f"{expected.list_size} {what}", source=path, field=name,
                                   fix="make every row's list match the model metadata")
        if pa.types.is_fixed_size_binary(expected) and pa.types.is_fixed_size_binary(actual):
            raise TraceFormatError(f"{actual.byte_width} bytes per row, but the model metadata says "
                                   f"{expected.byte_width // SCORE_BYTES} scores (num_experts) of {SCORE_BYTES} "
                                   f"bytes each", source=path, field=name,
                                   fix=f"write {expected.byte_width} bytes per row: every expert's float16 score")
    alternatives = " or ".join(map(str, accepted))
    raise TraceFormatError(f"has type {actual}, expected {alternatives}", source=path, field=name,
                           fix=f"cast the column to {accepted[0]}")


def _check_list_lengths(pf, path: str, name: str, actual: pa.DataType, expected: pa.DataType) -> None:
    """A variable-length list where a fixed one belongs: name the first row of the wrong length."""
    if not (isinstance(expected, pa.FixedSizeListType)
            and (pa.types.is_list(actual) or pa.types.is_large_list(actual))):
        return
    width = expected.list_size
    what = "top_k" if name in ("experts", "weights") else "num_experts"
    offset = 0
    try:
        for batch in iter_record_batches(pf, BATCH_ROWS, [name]):
            lengths = batch.column(0).value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
            bad = lengths != width
            if bad.any():
                row = _first(bad)
                raise TraceFormatError(f"{lengths[row]} values, but the model metadata says {what} = {width}",
                                       source=path, field=name, row=offset + row,
                                       fix=f"every row needs exactly {width} values ({what})")
            offset += batch.num_rows
    except (pa.ArrowException, OSError):
        return  # the main pass names the damage


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _fail(message: str, name: str, field_: str, row: int, fix: str) -> TraceFormatError:
    return TraceFormatError(message, source=name, field=field_, row=row, fix=fix)


# ----------------------------------------------------------------------------- one batch
def _check_batch(batch: pa.RecordBatch, name: str, meta: TraceMeta, weight_sum: float | None, offset: int,
                 carry: _Carry) -> None:
    model = meta.model
    _check_nulls(batch, name, offset)
    phase = _phase_codes(batch.column("phase"))
    if (phase < 0).any():
        row = _first(phase < 0)
        raise _fail(f"phase must be one of {PHASES}", name, "phase", offset + row, "use 'prefill' or 'decode'")
    keys = {c: batch.column(c).to_numpy(zero_copy_only=False).astype(np.int64) for c in SORT_KEYS}
    for col in ("step", "request", "position"):
        bad = keys[col] < 0
        if bad.any():
            row = _first(bad)
            raise _fail(f"negative {col} {keys[col][row]}", name, col, offset + row,
                        f"{col} counts from 0")
    layer = keys["layer"]
    bad = (layer < 0) | (layer >= model.num_layers)
    if bad.any():
        row = _first(bad)
        raise _fail(f"layer {layer[row]} outside [0, {model.num_layers})", name, "layer", offset + row,
                    "index MoE layers from 0, or fix num_layers in the model metadata")
    _check_order(keys, name, offset, carry)
    _check_requests(keys, phase, name, offset, carry)
    experts = _matrix(batch, "experts", model.top_k).astype(np.int64)
    bad_rows = ((experts < 0) | (experts >= model.num_experts)).any(axis=1)
    if bad_rows.any():
        row = _first(bad_rows)
        raise _fail(f"expert id in {experts[row].tolist()} outside [0, {model.num_experts})", name, "experts",
                    offset + row, "expert ids must index the model's routed experts")
    if model.top_k > 1:
        dup = _duplicate_rows(experts)
        if dup.any():
            row = _first(dup)
            raise _fail(f"duplicate expert in {experts[row].tolist()}", name, "experts", offset + row,
                        "each routed expert appears once per row")
    _check_optional(batch, name, meta, weight_sum, offset)


def _check_optional(batch: pa.RecordBatch, name: str, meta: TraceMeta, weight_sum: float | None,
                    offset: int) -> None:
    """The row checks of the optional columns in ``batch``."""
    model = meta.model
    if "weights" in batch.schema.names:
        _check_weights(_matrix(batch, "weights", model.top_k), weight_sum, name, offset)
    if "scores" in batch.schema.names:
        _check_scores(score_rows(batch.column("scores"), model.num_experts), name, offset)
    if "token_id" in batch.schema.names:
        token = batch.column("token_id").to_numpy(zero_copy_only=False)
        if (token < 0).any():
            row = _first(token < 0)
            raise _fail(f"negative token_id {token[row]}", name, "token_id", offset + row,
                        "token ids index the vocabulary from 0")
    for pred in PREDICTOR_COLUMNS:
        if pred in batch.schema.names:
            _check_predictor(batch.column(pred), pred, model.num_experts, name, offset)


def _check_nulls(batch: pa.RecordBatch, name: str, offset: int) -> None:
    for i, col in enumerate(batch.schema.names):
        column = batch.column(i)
        nulls = column.null_count
        if not nulls and isinstance(column, (pa.ListArray, pa.FixedSizeListArray, pa.LargeListArray)):
            nulls = column.flatten().null_count
        if nulls:
            row = _first_null_row(column)
            raise _fail("null value", name, col, offset + row, "every row needs a value in every column")


def _first_null_row(column: pa.Array) -> int:
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    if not valid.all():
        return _first(~valid)
    inner_valid = column.flatten().is_valid().to_numpy(zero_copy_only=False)
    if isinstance(column, pa.FixedSizeListArray):
        return _first(~inner_valid) // column.type.list_size
    lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    return int(np.repeat(np.arange(len(column)), lengths)[_first(~inner_valid)])


def _matrix(batch: pa.RecordBatch, col: str, width: int) -> np.ndarray:
    return batch.column(col).flatten().to_numpy(zero_copy_only=False).reshape(batch.num_rows, width)


def _duplicate_rows(experts: np.ndarray) -> np.ndarray:
    """Rows holding an expert twice: every pair of columns compared (top_k up to 16), else rows sorted."""
    k = experts.shape[1]
    if k > 16:
        ordered = np.sort(experts, axis=1)
        return (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    columns = np.ascontiguousarray(experts.T)
    dup = np.zeros(len(experts), dtype=bool)
    for i in range(k):
        for j in range(i + 1, k):
            dup |= columns[i] == columns[j]
    return dup


def _increasing(columns: list[np.ndarray]) -> bool:
    """Rows strictly increasing in these (non-negative) key columns, if their bit widths fit one int64
    (one composite key, compared once); False when they do not fit or the rows are not in order."""
    widths = [int(c.max()).bit_length() if len(c) else 0 for c in columns]
    if sum(widths) > 62:
        return False
    composite = np.zeros(len(columns[0]), dtype=np.int64)
    for column, width in zip(columns, widths):
        composite = (composite << width) | column
    return bool((composite[1:] > composite[:-1]).all())


def _check_order(keys: dict[str, np.ndarray], name: str, offset: int, carry: _Carry) -> None:
    """Rows strictly increasing in (step, layer, request, position): sorted, no duplicate rows."""
    columns = [keys[c] if carry.last_key is None else np.concatenate(([carry.last_key[i]], keys[c]))
               for i, c in enumerate(SORT_KEYS)]
    if not _increasing(columns):
        _order_fault(columns, name, offset, carry)
    carry.steps += int(np.count_nonzero(np.diff(columns[0]))) + (1 if carry.last_key is None else 0)
    carry.last_key = np.array([c[-1] for c in columns])


def _order_fault(columns: list[np.ndarray], name: str, offset: int, carry: _Carry) -> None:
    """Name the first row out of order (or duplicated), if any."""
    with_prev = np.stack(columns, axis=1)
    diff = with_prev[1:] - with_prev[:-1]
    nonzero = diff != 0
    first_nz = np.where(nonzero.any(axis=1), nonzero.argmax(axis=1), -1)
    sign = np.where(first_nz >= 0, diff[np.arange(len(diff)), np.maximum(first_nz, 0)], 0)
    bad = sign <= 0
    if bad.any():
        i = _first(bad)
        row = i + (0 if carry.last_key is not None else 1)
        field_ = SORT_KEYS[max(int(first_nz[i]), 0)]
        what = "duplicate row" if sign[i] == 0 else f"{field_} out of order"
        raise _fail(f"{what} (rows must be sorted by step, layer, request, position)", name, field_,
                    offset + row, "sort the rows by step, layer, request, position")


def _check_requests(keys: dict[str, np.ndarray], phase: np.ndarray, name: str, offset: int,
                    carry: _Carry) -> None:
    """Per request, over its rows of each step's first layer: positions grow and no prefill follows decode."""
    step, layer, request, position = keys["step"], keys["layer"], keys["request"], keys["position"]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(step)) + 1))
    first_layer = np.repeat(layer[starts], np.diff(np.concatenate((starts, [len(step)]))))
    rows = np.flatnonzero(layer == first_layer)
    req = request[rows]
    order = np.argsort(req, kind="stable")  # within a request: step order, then position
    rows = rows[order]
    req = req[order]
    # prepend each request's last state from earlier batches
    uniq, first_idx = np.unique(req, return_index=True)
    prev = [carry.requests.get(int(r)) for r in uniq]
    s, p, ph = step[rows], position[rows], phase[rows].astype(np.int64)
    same = req[1:] == req[:-1]
    back = same & ((p[1:] <= p[:-1]) & (s[1:] > s[:-1]))
    later_prefill = same & (ph[1:] < ph[:-1])
    for i, state in zip(first_idx, prev):
        if state is None:
            continue
        last_step, last_pos, last_phase = state
        if s[i] > last_step and p[i] <= last_pos:
            raise _fail(f"position {p[i]} of request {req[i]} is not after its position {last_pos} in step "
                        f"{last_step}", name, "position", offset + int(rows[i]),
                        "each step continues a request at later positions")
        if ph[i] < last_phase:
            raise _fail(f"request {req[i]} has a prefill row after a decode row", name, "phase",
                        offset + int(rows[i]), "prefill a request before decoding it")
    if back.any():
        i = _first(back) + 1
        raise _fail(f"position {p[i]} of request {req[i]} is not after its position {p[i - 1]} in step {s[i - 1]}",
                    name, "position", offset + int(rows[i]), "each step continues a request at later positions")
    if later_prefill.any():
        i = _first(later_prefill) + 1
        raise _fail(f"request {req[i]} has a prefill row after a decode row", name, "phase",
                    offset + int(rows[i]), "prefill a request before decoding it")
    last_idx = np.concatenate((first_idx[1:] - 1, [len(req) - 1])) if len(req) else first_idx
    for r, i in zip(uniq.tolist(), last_idx.tolist()):
        carry.requests[r] = (int(s[i]), int(p[i]), int(ph[i]))


def _check_weights(weights: np.ndarray, expected_sum: float | None, name: str, offset: int) -> None:
    # each test over the whole batch first; rows are located only when one fails
    if not np.isfinite(weights).all():
        row = _first(~np.isfinite(weights).all(axis=1))
        raise _fail(f"weight {weights[row].tolist()} is not finite", name, "weights", offset + row,
                    "weights are the router's gate values (finite numbers)")
    if (weights < 0).any():
        row = _first((weights < 0).any(axis=1))
        raise _fail(f"negative weight in {weights[row].tolist()}", name, "weights", offset + row,
                    "weights are gate values >= 0")
    if weights.shape[1] > 1 and (weights[:, 1:] > weights[:, :-1]).any():
        row = _first((weights[:, 1:] > weights[:, :-1]).any(axis=1))
        raise _fail(f"weights {weights[row].tolist()} are not highest first", name, "weights", offset + row,
                    "order each row's experts and weights by weight, highest first")
    if expected_sum is not None:
        sums = np.ascontiguousarray(weights.T, dtype=np.float64).sum(axis=0)  # row sums, vectorised across rows
        bad = np.abs(sums - expected_sum) > SUM_TOLERANCE * expected_sum
        if bad.any():
            row = _first(bad)
            raise _fail(f"weights sum to {sums[row]:.4g}, but weights_renormalized says {expected_sum:g}", name,
                        "weights", offset + row, "renormalize the weights, or set weights_renormalized: false")


def _largest_float16_at_most(limit: float) -> int:
    """The bit pattern of the largest float16 <= ``limit`` (> 0)."""
    value = np.float16(limit)
    if float(value) > limit:
        value = np.nextafter(value, np.float16(0))
    return int(np.array(value).view(np.uint16))


#: float16 values in [+0, SCORE_MAX] are exactly the bit patterns 0 .. this (IEEE order of positive
#: numbers); negatives (sign bit), inf and NaN all lie above, so one integer max over the bits checks a batch
SCORE_BITS_MAX = _largest_float16_at_most(SCORE_MAX)


def _check_scores(scores: np.ndarray, name: str, offset: int) -> None:
    if scores.dtype == np.float16 and (scores.size == 0 or int(scores.view(np.uint16).max()) <= SCORE_BITS_MAX):
        return  # the common case in one pass; -0.0 (bits 0x8000) and faults go on to the exact check below
    bad = ~np.isfinite(scores).all(axis=1) | (scores < 0).any(axis=1) | (scores > SCORE_MAX).any(axis=1)
    if bad.any():
        row = _first(bad)
        values = scores[row]
        worst = values[~np.isfinite(values) | (values < 0) | (values > SCORE_MAX)][0]
        raise _fail(f"score {float(worst)} outside [0, 1]", name, "scores", offset + row,
                    "scores are the router's probabilities (softmax or sigmoid)")


def _check_predictor(column: pa.Array, pred: str, num_experts: int, name: str, offset: int) -> None:
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    bad = (values < 0) | (values >= num_experts)
    if bad.any():
        lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
        row_of = np.repeat(np.arange(len(column)), lengths)
        row = int(row_of[_first(bad)])
        raise _fail(f"predicted expert outside [0, {num_experts})", name, pred, offset + row,
                    "predictions must be expert ids")


def check_path_writable(path: PathLike) -> Path:
    """An output trace path that can be written (one line naming the problem otherwise)."""
    from moesim.util import PARQUET, check_output_path
    return check_output_path(path, "--out", PARQUET)
