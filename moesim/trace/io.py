"""Reading traces (format v2, and v1 read as well); the writer is :mod:`moesim.trace.writer`, re-exported here.

The writer streams row groups into a temporary file and renames it into place
on close, so a trace appears whole or not at all. The reader streams one
forward pass (``step``) at a time with memory bounded by one row group; a
sweep worker keeps the decoded trace (bounded in bytes) for its next points.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.errors import TraceFormatError
from moesim.trace.schema import (META_KEY, OPTIONAL_COLUMNS, PHASES, PREDICTOR_COLUMNS, REQUIRED_COLUMNS, TraceMeta,
                                 score_rows)
# the writer, re-exported: moesim.trace.io keeps every name
from moesim.trace.writer import (PLAIN_COLUMNS, ROW_GROUP_ROWS, UNCOMPRESSED_COLUMNS, PathLike, TraceWriter,
                                 parquet_options, write_trace)


# ----------------------------------------------------------------------------- reading
#: the first and last four bytes of every Parquet file
PARQUET_MAGIC = b"PAR1"


#: the first bytes of compressed files: (what, the suffix such a file gets, the tool that writes it out with -dc)
COMPRESSED_MAGIC = {b"\x1f\x8b": ("gzip", ".gz", "gzip"), b"\x28\xb5\x2f\xfd": ("zstd", ".zst", "zstd"),
                    b"BZh": ("bzip2", ".bz2", "bzip2"), b"\xfd7zX": ("xz", ".xz", "xz")}


def compressed(path: PathLike, head: bytes, why: str, plain: str) -> TraceFormatError | None:
    """The error of a compressed file (``head``: its first four bytes or more), saying ``why`` that will not
    do, with the command that decompresses it beside itself (as ``path`` less its suffix, or ``plain``; never
    over a file that exists); None if it is not one."""
    path = Path(path)
    for magic, (kind, suffix, tool) in COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            target = path.with_suffix("") if path.suffix == suffix else path.with_name(plain)
            if target.exists():
                target = target.with_name(f"{target.stem}-decompressed{target.suffix}")
            return TraceFormatError(f"{kind}-compressed; {why}", source=str(path),
                                    fix=f"decompress it first ({tool} -dc {path} > {target}) and give that")
    return None


def not_parquet(path: PathLike, head: bytes, detail: str = "") -> TraceFormatError:
    """The error of a file Parquet cannot open: empty, cut short or damaged when it starts as Parquet does
    (``head``: its first bytes), compressed, else some other format (a tool's log)."""
    packed = compressed(path, head, "a trace is read as the Parquet file itself", "trace.parquet")
    if packed is not None:  # it was 'not a Parquet file (fix: convert the log with moesim trace import)'
        return packed
    if head[:4] == PARQUET_MAGIC:
        return TraceFormatError("a Parquet file cut short or damaged (its footer is missing or broken)",
                                source=str(path), fix="copy it again, or re-run the command that wrote it")
    if not head and _size(path) == 0:  # no log to convert either
        return TraceFormatError("the file is empty (0 bytes)", source=str(path),
                                fix="copy it again, or re-run the command that wrote it")
    own = _moesim_file(path)
    if own is not None:  # `trace import` would say it cannot tell the tool that wrote this "log"
        what, fix = own
        return TraceFormatError(f"not a trace but {what}", source=str(path), fix=fix)
    return TraceFormatError(f"not a Parquet file{detail}", source=str(path),
                            fix="convert the log with `moesim trace import`")


def _moesim_file(path: PathLike) -> tuple[str, str] | None:
    """(what, fix) when ``path`` is one of moesim's own other files, given where a trace goes (a hardware
    profile as TRACE, say, or a replay's --json): told from its first 16 KiB; None otherwise."""
    import re
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 14).decode("utf-8", "replace")
    except OSError:
        return None

    def top_keys(*keys: str) -> bool:
        return all(re.search(rf"^{key}\s*:", text, re.MULTILINE) for key in keys)
    if top_keys("schema_version", "gpu"):
        return "a hardware profile (YAML)", "give it as the hardware profile (--hw), and a trace (.parquet) as the trace"
    if top_keys("traces", "systems"):
        return "a sweep spec (YAML)", "run it with `moesim sweep` (moesim.sweep from Python)"
    if text.lstrip().startswith(("{", "[")) and re.search(r'"(tpot_ms_mean|ttft_ms|traceEvents)"', text):
        return ("moesim's JSON output (the --json metrics or a --chrome-trace)",
                "give the trace (.parquet) that the run read; its path is under inputs.trace in the --json metrics")
    return None


def not_found(path: PathLike) -> TraceFormatError:
    """The error of a trace file that does not exist; '-' is no file but standard input, which a trace is
    not read from (it said '-: file not found (fix: check the path)')."""
    if os.fspath(path) == "-":
        return TraceFormatError("a trace is read from a file, not from standard input ('-')", source="-",
                                fix="save it to a .parquet file and give that file's path")
    return TraceFormatError("file not found", source=str(path), fix="check the path")


def _size(path: PathLike) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def unreadable(path: PathLike, err: OSError) -> TraceFormatError:
    """The error of a trace file that cannot be opened for reading (no read permission, say)."""
    return TraceFormatError(f"cannot read: {err.strerror or err}", source=str(path),
                            fix="check the path and permissions")


def arrow_source(path: PathLike) -> Any:
    """``path`` as pyarrow takes it: the name itself, or an open file where the name is no UTF-8 text (bytes
    a shell passed through, which pyarrow cannot encode)."""
    name = os.fspath(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return open(name, "rb")  # noqa: SIM115 - pyarrow's reader holds it and closes it with itself
    return name


def _open(path: PathLike) -> pq.ParquetFile:
    path = Path(path)
    if not path.exists():
        raise not_found(path)
    if path.is_dir():  # as the validation pass says it (it was 'not a Parquet file: convert the log')
        raise TraceFormatError("is a folder, not a trace file", source=str(path), fix="give a .parquet file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as err:  # no read permission: it is no other format (it was 'not a Parquet file')
        raise unreadable(path, err) from None
    try:
        return pq.ParquetFile(arrow_source(path))
    except (pa.ArrowInvalid, OSError):
        raise not_parquet(path, head) from None


def read_meta(path: PathLike) -> TraceMeta:
    """Read and check a trace's ``moesim`` metadata."""
    pf = _open(path)
    kv = pf.schema_arrow.metadata or {}
    if META_KEY not in kv:
        raise TraceFormatError("no 'moesim' key-value metadata", source=str(path), field="moesim",
                               fix="write traces with moesim (trace import, synth or capture)")
    return TraceMeta.from_json(kv[META_KEY], origin=str(path))


def step_range(path: PathLike) -> tuple[int, int] | None:
    """The first and last step of a trace (None: no rows), from the row groups' statistics when every one
    has them, else from the step column."""
    pf = _open(path)
    at = pf.schema_arrow.get_field_index("step")
    groups = [pf.metadata.row_group(i) for i in range(pf.metadata.num_row_groups)]
    stats = [g.column(at).statistics for g in groups if g.num_rows]
    if not stats:
        return None
    if all(st is not None and st.has_min_max for st in stats):
        return int(min(st.min for st in stats)), int(max(st.max for st in stats))
    steps = pf.read(columns=["step"]).column(0).to_numpy()
    return int(steps.min()), int(steps.max())


def trace_columns(path: PathLike) -> list[str]:
    return list(_open(path).schema_arrow.names)


#: layer ids of a step with one row per layer -> its (layer, row slice) pairs, the same for every such step
_ONE_ROW_LAYERS: dict[tuple[int, ...], list[tuple[int, slice]]] = {}
#: a small step's layer column (dtype, bytes) -> its layer bounds (read-only), shared by the steps that have it
_LAYER_BOUNDS: dict[tuple[str, bytes], np.ndarray] = {}
#: steps up to this many rows look their bounds up there (a decode step of a batch of up to 4 per layer)
_SHARED_BOUNDS_ROWS = 256


@dataclass
class Step:
    """All rows of one forward pass, as numpy arrays in trace order."""

    step: int
    request: np.ndarray
    position: np.ndarray
    layer: np.ndarray
    phase: np.ndarray  # int8 codes into PHASES
    experts: np.ndarray  # (rows, top_k) int16
    weights: np.ndarray | None = None
    scores: np.ndarray | None = None
    token_id: np.ndarray | None = None
    predictors: dict[str, list[np.ndarray]] = field(default_factory=dict)
    _bounds: np.ndarray | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return len(self.layer)

    @property
    def is_prefill(self) -> bool:
        return bool((self.phase == 0).any())

    @property
    def layer_bounds(self) -> np.ndarray:
        """Row offsets: rows of the i-th layer present are ``bounds[i]:bounds[i+1]``."""
        if self._bounds is None:
            # a decode step's few rows: the bounds of the last steps with the same layer column, shared
            key = (self.layer.dtype.str, self.layer.tobytes()) if len(self.layer) <= _SHARED_BOUNDS_ROWS else None
            bounds = _LAYER_BOUNDS.get(key) if key is not None else None
            if bounds is None:
                cuts = np.flatnonzero(np.diff(self.layer)) + 1
                bounds = np.concatenate(([0], cuts, [len(self.layer)]))
                if key is not None:
                    bounds.flags.writeable = False
                    if len(_LAYER_BOUNDS) >= 64:
                        _LAYER_BOUNDS.clear()
                    _LAYER_BOUNDS[key] = bounds
            self._bounds = bounds
        return self._bounds

    def layers(self) -> list[tuple[int, slice]]:
        """(layer, row slice) for every layer present in this step, in order (a shared list: do not change it)."""
        bounds = self.layer_bounds
        if len(bounds) - 1 == len(self.layer):  # one row per layer, as every decode step of one sequence
            ids = tuple(self.layer.tolist())
            pairs = _ONE_ROW_LAYERS.get(ids)
            if pairs is None:
                if len(_ONE_ROW_LAYERS) >= 64:
                    _ONE_ROW_LAYERS.clear()
                pairs = _ONE_ROW_LAYERS[ids] = [(layer, slice(i, i + 1)) for i, layer in enumerate(ids)]
            return pairs
        ids = self.layer[bounds[:-1]].tolist()
        edges = bounds.tolist()
        return [(layer, slice(edges[i], edges[i + 1])) for i, layer in enumerate(ids)]

    @property
    def tokens(self) -> int:
        """Tokens in this forward pass (rows of its first layer)."""
        bounds = self.layer_bounds
        return int(bounds[1] - bounds[0])

    def one_row_layers(self) -> OneRowLayers | None:
        """This step's rows split by layer, when it has one row per layer (a decode step of one sequence)."""
        if len(self.layer_bounds) - 1 != len(self.layer):
            return None
        absent = [None] * len(self.layer)  # a column the trace does not carry
        # one row per layer is one token, of one request (unless a log put other requests' rows on some layers)
        one_request = int(self.request.min()) == int(self.request.max())
        request = [self.request[:1]] * len(self.layer) if one_request else _one_row_views(self.request)
        return OneRowLayers(_one_row_views(self.experts), self.experts.tolist(), request,
                            absent if self.weights is None else _one_row_views(self.weights),
                            absent if self.scores is None else _one_row_views(self.scores),
                            [1] * self.experts.shape[1], one_row_predictors(self.predictors))


@dataclass(slots=True)
class OneRowLayers:
    """The rows of a step with one row per layer, split in one pass per column (an executor then takes a
    layer's row by index, not by slicing each column): entry ``i`` of each list is row ``i``."""

    #: ``experts[i:i + 1]`` of the step, and so on
    experts: list[np.ndarray]
    #: row ``i``'s experts as a list
    active: list[list[int]]
    request: list[np.ndarray]
    weights: list[np.ndarray | None]
    scores: list[np.ndarray | None]
    #: every row's token count per expert, one each (one list for all rows: views only read it)
    ones: list[int]
    #: row ``i``'s predictor columns, each sliced to ``[i:i + 1]`` (empty: the step carries none)
    predictors: list[dict[str, list[np.ndarray]]]


def one_row_predictors(predictors: dict[str, list[np.ndarray]]) -> list[dict[str, list[np.ndarray]]]:
    """Row ``i``'s predictors as a one-row step's view gives them (each column sliced to ``[i:i + 1]``), for
    every row at once: one pass per column rather than a dict built by a comprehension per layer."""
    if not predictors:
        return []
    names = list(predictors)
    columns = [[rows[i:i + 1] for i in range(len(rows))] for rows in predictors.values()]
    if len(names) == 1:  # the usual case: a system reads one predictor column
        name = names[0]
        return [{name: row} for row in columns[0]]
    return [dict(zip(names, row)) for row in zip(*columns)]


def _one_row_views(array: np.ndarray) -> list[np.ndarray]:
    """``array[i:i + 1]`` for every row ``i``, as one list."""
    return list(array.reshape(len(array), 1, *array.shape[1:]))


def _fixed_list(column: pa.ChunkedArray | pa.Array, width: int) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def _var_list(column: pa.Array) -> list[np.ndarray]:
    """Each row's list as a read-only view of one array (views of a read-only array are read-only)."""
    offsets = (column.offsets.to_numpy() - column.offsets[0].as_py()).tolist()
    values = column.flatten().to_numpy(zero_copy_only=False)
    values.flags.writeable = False
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _phase_codes(column: pa.Array) -> np.ndarray:
    if pa.types.is_dictionary(column.type):
        names = column.dictionary.to_pylist()
        remap = np.array([PHASES.index(n) if n in PHASES else -1 for n in names], dtype=np.int8)
        return remap[column.indices.to_numpy(zero_copy_only=False)]
    values = column.to_numpy(zero_copy_only=False)
    return np.array([PHASES.index(v) if v in PHASES else -1 for v in values], dtype=np.int8)


#: decoded traces kept per process while :func:`keeping_decoded` is on (sweep workers, ``replay --system
#: all``, a portfolio's members), least recently used dropped first, up to this many bytes in all
DECODED_CACHE_BYTES = 512 << 20
_KEEP = [False]
#: optional columns decoded for every reader while keeping, besides its own (:func:`keeping_decoded`)
_WIDEN: list[tuple[str, ...] | None] = [()]
#: numpy's own size of one array object, counted beside its data (predictor columns hold one per row)
_ARRAY_OVERHEAD = 112
#: (file stamp, optional columns decoded) -> its decode, shared by its readers
_DECODED: OrderedDict[tuple, _SharedDecode] = OrderedDict()


class _SharedDecode:
    """One decode of a trace, read by several readers at their own pace (a portfolio's members race
    through it step by step; a sweep worker's later points read it again).

    Steps are decoded as the furthest reader needs them and kept for the others.
    While the steps kept fit in :data:`DECODED_CACHE_BYTES` they all stay (and
    the whole decode, once read to its end, serves later readers); past it, the
    decode leaves the cache and keeps only what a current reader has yet to read.
    A reader asking for fewer optional columns than were decoded gets views of
    the same arrays without the others, built once per step and column set.
    """

    def __init__(self, key: tuple, source: Iterator[Step]) -> None:
        self.key, self.source = key, source
        self.steps: list[Step] = []
        self.first = 0  # index of steps[0] (above 0 once steps nobody needs are dropped)
        self.size = 0
        self.keep = True  # within the cache's bytes: kept whole
        self.done = False
        self.readers: dict[object, int] = {}  # reader -> index of its next step
        self.narrowed: dict[tuple[str, ...], list[Step]] = {}

    def read(self, columns: tuple[str, ...] | None) -> Iterator[Step]:
        me = object()  # this reader's key
        self.readers[me] = self.first
        # a reader of every column (None) reads only a decode of every column
        views = None if columns is None or columns == self.key[-1] else self.narrowed.setdefault(columns, [])
        try:
            while True:
                at = self.readers[me]
                if at - self.first >= len(self.steps) and not self._more():
                    return
                step = self.steps[at - self.first]
                self.readers[me] = at + 1
                if views is not None:
                    if len(views) <= at - self.first:
                        views.append(_narrow(step, columns))
                    step = views[at - self.first]
                if not self.keep:
                    self._drop_read()
                yield step
        finally:
            del self.readers[me]
            if not self.done and not self.readers:
                self._forget()  # read partly by everyone: not kept (its source is closed)

    def _more(self) -> bool:
        """Decode one more step; False at the end."""
        if self.done:
            return False
        step = next(self.source, None)
        if step is None:
            self.done = True
            _trim_cache()
            return False
        self.steps.append(step)
        self.size += _step_bytes(step)
        if self.keep and self.size > DECODED_CACHE_BYTES:
            self.keep = False  # too big to keep: shared only while read, and left to later readers to decode
            _DECODED.pop(self.key, None)
        return True

    def _drop_read(self) -> None:
        """Drop the steps every reader is past."""
        cut = min(self.readers.values()) - self.first
        if cut > 0:
            del self.steps[:cut]
            for views in self.narrowed.values():
                del views[:cut]
            self.first += cut

    def _forget(self) -> None:
        if _DECODED.get(self.key) is self:
            del _DECODED[self.key]
        self.source.close()  # type: ignore[attr-defined]


def _narrow(step: Step, wanted: tuple[str, ...]) -> Step:
    """``step`` as a decode of the ``wanted`` optional columns only would give it (the same arrays)."""
    return Step(step.step, step.request, step.position, step.layer, step.phase, step.experts,
                step.weights if "weights" in wanted else None, step.scores if "scores" in wanted else None,
                step.token_id if "token_id" in wanted else None,
                {name: rows for name, rows in step.predictors.items() if name in wanted}, step._bounds)


def _trim_cache() -> None:
    """Drop the least recently used decodes until the rest fit (their current readers read on)."""
    while sum(d.size for d in _DECODED.values()) > DECODED_CACHE_BYTES and _DECODED:
        _DECODED.popitem(last=False)


def iter_record_batches(pf: pq.ParquetFile, batch_size: int, columns: list[str],
                        use_threads: bool = True) -> Iterator[pa.RecordBatch]:
    """``pf.iter_batches(batch_size, columns)``, read one row group at a time: pyarrow 26's reader over a
    whole file kept the fixed-size list columns of every row group it had read until the end (694 MB for
    the weights of a 23-million-row trace, 888 MB in all: the validation pass, and so `trace inspect`,
    peaked at 1.2 GB; one row group at a time, 20 MB). With a list column among ``columns`` the batches are
    the same: with a list column that reader ends a batch at each row group's end and at each multiple of
    ``batch_size`` rows from the file's start (tests/trace/test_stats_scale.py). Every whole-file pass reads
    through it: a replay's steps (:func:`iter_steps`) too, whose memory grew with the trace (16 million rows of
    Mixtral: 317 MiB for the columns a replay reads, 153 MiB one row group at a time)."""
    start = 0  # the row group's first row in the file
    for group in range(pf.metadata.num_row_groups):
        pending: list[pa.RecordBatch] = []
        at = start
        for batch in pf.iter_batches(batch_size=batch_size, row_groups=[group], columns=columns,
                                     use_threads=use_threads):
            while batch.num_rows:
                take = min(batch.num_rows, batch_size - at % batch_size)
                pending.append(batch.slice(0, take))
                batch, at = batch.slice(take), at + take
                if at % batch_size == 0:
                    yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)
                    pending = []
        if pending:
            yield pending[0] if len(pending) == 1 else pa.concat_batches(pending)
        start = at


def iter_steps(path: PathLike, columns: Sequence[str] | None = None,
               batch_rows: int = 65_536) -> Iterator[Step]:
    """Yield one :class:`Step` at a time, in trace order. Their arrays are read-only.

    ``columns`` limits which optional columns are read (default: all present).
    Memory stays bounded by one batch plus one step, except while
    :func:`keeping_decoded` is on: then the file is decoded once for every
    reader in this process that asks for the same columns or fewer (several at
    a time, or one after another while it stays within
    :data:`DECODED_CACHE_BYTES` for all files), so that a portfolio's members,
    the points and systems of a sweep worker and ``replay --system all``
    decode it once. A reader joins a decode when it asks for its first step.
    """
    if not _KEEP[0]:
        yield from _decode_steps(path, columns, batch_rows)
        return
    wanted = _column_set(columns)
    stamp = _file_stamp(path)
    if stamp is None:  # _open names the problem
        yield from _decode_steps(path, columns, batch_rows)
        return
    shared = _reusable(stamp, wanted)
    if shared is None:
        widen = _WIDEN[0]
        decoded = None if wanted is None or widen is None else _column_set((*wanted, *widen))
        key = (*stamp, decoded)
        shared = _DECODED[key] = _SharedDecode(key, _decode_steps(path, decoded, batch_rows))
    _DECODED.move_to_end(shared.key)
    yield from shared.read(wanted)


def _reusable(stamp: tuple, wanted: tuple[str, ...] | None) -> _SharedDecode | None:
    """A kept decode of this file with at least the ``wanted`` optional columns (the fewest such)."""
    def covers(decoded: tuple[str, ...] | None) -> bool:
        return decoded is None or (wanted is not None and set(wanted) <= set(decoded))
    matches = [shared for key, shared in _DECODED.items() if key[:-1] == stamp and covers(key[-1])]
    return min(matches, key=lambda shared: (shared.key[-1] is None, len(shared.key[-1] or ())), default=None)


def _column_set(columns: Sequence[str] | None) -> tuple[str, ...] | None:
    """Optional columns as a cache key: sorted, each once (None: all)."""
    return None if columns is None else tuple(sorted(set(columns)))


@contextmanager
def keeping_decoded(columns: Sequence[str] | None = ()) -> Iterator[None]:
    """Keep traces decoded (:func:`iter_steps`) while inside; what was kept goes on leaving, unless the
    caller had it on already. ``columns``: optional columns to decode for every reader (None: all),
    so that readers asking for different ones share one decode (a portfolio's members: their union)."""
    before, widen = _KEEP[0], _WIDEN[0]
    keep_decoded(columns)
    try:
        yield
    finally:
        _KEEP[0], _WIDEN[0] = before, widen
        if not before:
            _DECODED.clear()


def keep_decoded(columns: Sequence[str] | None = ()) -> None:
    """Keep traces decoded for the rest of this process (a sweep worker's), with ``columns`` as in
    :func:`keeping_decoded`."""
    _KEEP[0] = True
    _WIDEN[0] = None if columns is None else tuple(sorted(set(columns)))


def _file_stamp(path: PathLike) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)


def _step_bytes(step: Step) -> int:
    arrays = [a for a in (step.request, step.position, step.layer, step.phase, step.experts, step.weights,
                          step.scores, step.token_id) if a is not None]
    arrays += [a for values in step.predictors.values() for a in values]
    return sum(a.nbytes + _ARRAY_OVERHEAD for a in arrays)


def _read_only(step: Step) -> Step:
    """Steps may be shared by several runs: nothing may write into them."""
    for a in (step.request, step.position, step.layer, step.phase, step.experts, step.weights, step.scores,
              step.token_id):
        if a is not None:
            a.flags.writeable = False
    for values in step.predictors.values():
        if values and values[0].flags.writeable:  # rows from _var_list are read-only views already
            for a in values:
                a.flags.writeable = False
    return step


def _use_system_allocator() -> None:
    """Decode into the C library's allocator, unless the user chose one (``ARROW_DEFAULT_MEMORY_POOL``).

    With pyarrow's default (mimalloc on Linux) the first decode of a process, the one every replay pays,
    of a 4,096-token DeepSeek-V3 prefill with scores took 1.30 s (median of five) against 1.14 s, at
    809 MiB peak RSS against 646 (``benchmarks/trace_io.py --prefill``). Arrays already allocated keep
    their own pool.
    """
    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ and pa.default_memory_pool().backend_name != "system":
        pa.set_memory_pool(pa.system_memory_pool())


def _decode_steps(path: PathLike, columns: Sequence[str] | None, batch_rows: int) -> Iterator[Step]:
    _use_system_allocator()
    pf = _open(path)
    meta = read_meta(path)
    top_k, num_experts = meta.model.top_k, meta.model.num_experts
    present = pf.schema_arrow.names
    optional = [c for c in OPTIONAL_COLUMNS if c in present and (columns is None or c in columns)]
    read_cols = list(REQUIRED_COLUMNS) + optional
    pending: list[dict[str, Any]] = []

    def assemble(parts: list[dict[str, Any]]) -> Step:
        def cat(key: str) -> Any:
            vals = [p[key] for p in parts]
            if key in PREDICTOR_COLUMNS:
                return vals[0] if len(vals) == 1 else [x for v in vals for x in v]
            return vals[0] if len(vals) == 1 else np.concatenate(vals)
        preds = {c: cat(c) for c in optional if c in PREDICTOR_COLUMNS}
        step = Step(step=int(parts[0]["step"][0]), request=cat("request"), position=cat("position"),
                    layer=cat("layer"), phase=cat("phase"), experts=cat("experts"),
                    weights=cat("weights") if "weights" in optional else None,
                    scores=cat("scores") if "scores" in optional else None,
                    token_id=cat("token_id") if "token_id" in optional else None,
                    predictors=preds)
        # one piece: views of the batch's read-only columns; several: new arrays, made read-only here
        return step if len(parts) == 1 else _read_only(step)

    for batch in iter_record_batches(pf, batch_rows, read_cols):
        cols: dict[str, Any] = {}
        for name in read_cols:
            col = batch.column(name)
            if name == "experts":
                cols[name] = _fixed_list(col, top_k)
            elif name == "weights":
                cols[name] = _fixed_list(col, top_k)
            elif name == "scores":
                cols[name] = score_rows(col, num_experts)
            elif name in PREDICTOR_COLUMNS:
                cols[name] = _var_list(col)
            elif name == "phase":
                cols[name] = _phase_codes(col)
            else:
                cols[name] = col.to_numpy(zero_copy_only=False)
        for values in cols.values():
            if isinstance(values, np.ndarray):
                values.flags.writeable = False  # steps may be shared by several runs; their views inherit this
        steps = cols["step"]
        cuts = np.flatnonzero(np.diff(steps)) + 1
        starts = np.concatenate(([0], cuts))
        stops = np.concatenate((cuts, [len(steps)]))
        for start, stop in zip(starts, stops):
            piece = {k: v[start:stop] for k, v in cols.items()}
            if pending and pending[0]["step"][0] != piece["step"][0]:
                yield assemble(pending)
                pending = []
            pending.append(piece)
    if pending:
        yield assemble(pending)


def iter_columns(path: PathLike, columns: Sequence[str], batch_rows: int = 1 << 20) -> Iterator[dict[str, np.ndarray]]:
    """Plain columns of a trace (``step``, ``request``, ...) as numpy arrays, ``batch_rows`` rows at a
    time in trace order: a whole-trace pass in bounded memory."""
    for batch in iter_record_batches(_open(path), batch_rows, list(columns)):
        yield {name: batch.column(name).to_numpy(zero_copy_only=False) for name in columns}


def read_table(path: PathLike, columns: Sequence[str] | None = None) -> pa.Table:
    """Read a whole (small) trace as an arrow table, columns as stored (``scores`` in either form:
    :func:`~moesim.trace.schema.score_rows` decodes it)."""
    return _open(path).read(columns=list(columns) if columns else None)


def read_frame(path: PathLike, columns: Sequence[str] | None = None) -> Any:
    """A whole (small) trace as a pandas DataFrame, one row per trace row: list columns as one numpy array
    per row, ``scores`` included (decoded from its stored bytes to ``num_experts`` float16 values)."""
    table = read_table(path, columns)
    if "scores" in table.column_names:
        rows = score_rows(table.column("scores"), read_meta(path).model.num_experts)
        scores = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
        table = table.set_column(table.column_names.index("scores"), "scores", scores)
    return table.to_pandas()


__all__ = ["PARQUET_MAGIC", "PLAIN_COLUMNS", "ROW_GROUP_ROWS", "UNCOMPRESSED_COLUMNS", "OneRowLayers", "PathLike", "Step",
           "COMPRESSED_MAGIC", "TraceWriter", "compressed", "iter_columns", "iter_steps", "keep_decoded", "keeping_decoded", "not_parquet",
           "parquet_options", "read_frame", "read_meta", "read_table", "step_range", "trace_columns", "write_trace"]
