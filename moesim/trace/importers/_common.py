"""Shared pieces of the importers: line-checked JSONL reading, a row table, the report, writing.

Every importer turns a third-party log into a :class:`RoutingRows` table (one row
per request, token and MoE layer), counts what it dropped or repaired and why,
and hands the table to :func:`write_import`, which sorts it into trace order
and writes it through :class:`~moesim.trace.io.TraceWriter` (atomic rename).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from moesim.errors import TraceFormatError
from moesim.model.presets import load_preset
from moesim.model.spec import ModelSpec
from moesim.trace.io import TraceWriter
from moesim.trace.schema import PHASES, TraceMeta

WRITE_CHUNK_ROWS = 65_536
PREFILL, DECODE = PHASES.index("prefill"), PHASES.index("decode")


# ----------------------------------------------------------------------------- progress
#: called with (bytes just read, the file) while an import reads its logs; set by :func:`reading_progress`
_READ_PROGRESS: ContextVar[Callable[[int, Path], None] | None] = ContextVar("import_read_progress", default=None)
#: bytes of a JSON-lines log read between two progress reports
PROGRESS_BYTES = 1 << 20


@contextmanager
def reading_progress(callback: Callable[[int, Path], None] | None) -> Iterator[None]:
    """Report the bytes the importers read to ``callback`` (one long log was '0 files' until it was done)."""
    token = _READ_PROGRESS.set(callback)
    try:
        yield
    finally:
        _READ_PROGRESS.reset(token)


def report_read(nbytes: int, path: Path) -> None:
    callback = _READ_PROGRESS.get()
    if callback is not None and nbytes:
        callback(nbytes, path)


# ----------------------------------------------------------------------------- input checks
def where(path: Path, line: int | None = None, unit: str = "line") -> str:
    """``path``, with the line (or, in an array file, the ``unit``, e.g. token) an error is at."""
    return f"{path} {unit} {line}" if line is not None else str(path)


UTF8_BOM = b"\xef\xbb\xbf"


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for every non-blank line; bad JSON or bytes that are not UTF-8 are a
    one-line error naming the line (decoded line by line: a decoder's byte offset counts from its buffer)."""
    pending = 0  # bytes read and not yet reported
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            pending += len(raw)
            if pending >= PROGRESS_BYTES:
                report_read(pending, path)
                pending = 0
            if number == 1:  # a byte-order mark an editor left (it was 'line 1: not valid JSON')
                raw = raw.removeprefix(UTF8_BOM)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                if number == 1 and b"\0" in raw:  # no text log holds NUL bytes: a binary file, no line to repair
                    raise TraceFormatError("a binary file (NUL bytes in its first line), not a log of JSON lines",
                                           source=str(path), field="line",
                                           fix="give the log as its tool wrote it (moesim trace import "
                                               "--list-formats); check the file and --format") from None
                raise TraceFormatError(f"not UTF-8 text (byte {err.start + 1} of the line)", source=where(path, number),
                                       field="line", fix="repair or delete the garbled line") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError:
                raise TraceFormatError("not valid JSON", source=where(path, number), field="line",
                                       fix="repair or delete the truncated/garbled line") from None
            if not isinstance(obj, dict):
                raise TraceFormatError("line is not a JSON object", source=where(path, number), field="line",
                                       fix="each line must be one JSON object")
            yield number, obj
    report_read(pending, path)


def get_field(obj: dict[str, Any], name: str, path: Path, line: int) -> Any:
    if name not in obj:
        raise TraceFormatError("missing field", source=where(path, line), field=name,
                               fix=f"every record of this format needs '{name}'")
    return obj[name]


def get_int(obj: dict[str, Any], name: str, path: Path, line: int) -> int:
    """An index field (layer, token index or position, problem id): an integer, 0 or more."""
    value = get_field(obj, name, path, line)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceFormatError(f"expected an integer >= 0, got {value!r}", source=where(path, line), field=name,
                               fix=f"'{name}' must be a whole number, 0 or more")
    return value


def get_list(obj: dict[str, Any], name: str, length: int, path: Path, line: int) -> list[Any]:
    value = get_field(obj, name, path, line)
    if not isinstance(value, list) or len(value) != length:
        got = f"{len(value)} values" if isinstance(value, list) else repr(value)
        raise TraceFormatError(f"expected a list of {length} values, got {got}", source=where(path, line),
                               field=name, fix=f"'{name}' must hold exactly {length} numbers, this format's top_k "
                                               "(a log of another tool or model: check --format, --list-formats)")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise TraceFormatError(f"non-numeric value in {value!r}", source=where(path, line), field=name,
                               fix=f"'{name}' must hold numbers only")
    if name in ID_FIELDS:
        check_ids(np.asarray(value, dtype=np.float64), path, name, line)
    else:
        check_weights(np.asarray(value, dtype=np.float64), path, name, line)
    return value


#: list fields that hold expert ids (every other list field holds gate weights or probabilities)
ID_FIELDS = ("topk_ids", "experts", "indices")
#: expert ids beyond this cannot be stored (int16 in a trace) and are no model's
ID_LIMIT = 2**15


def check_ids(values: np.ndarray, path: Path, name: str, line: int | None = None) -> np.ndarray:
    """Expert ids as int64: whole numbers within int16, never silently truncated or wrapped."""
    values = np.asarray(values)
    if values.dtype.kind not in "iuf":
        raise TraceFormatError(f"expert ids of type {values.dtype} are not numbers", source=where(path, line),
                               field=name, fix="expert ids are integers")
    if values.dtype.kind == "f":
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            value = values[bad].flat[0]
            raise TraceFormatError(f"expert id {value} is not a whole number", source=where(path, line),
                                   field=name, fix="expert ids are integers; check the log's columns")
    bad = (values < -ID_LIMIT) | (values >= ID_LIMIT)
    if bad.any():
        value = values[bad].flat[0]
        # the id as written (1099511627776, not 1.09951e+12) while it is a whole number a log could hold
        shown = str(int(value)) if abs(value) < 1e18 else f"{value:g}"
        raise TraceFormatError(f"expert id {shown} is out of any model's range",
                               source=where(path, line), field=name, fix="check --format and the log's columns")
    return values.astype(np.int64)


def check_weights(values: np.ndarray, path: Path, name: str, line: int | None = None) -> np.ndarray:
    """Gate weights/probabilities: finite and not negative."""
    values = np.asarray(values)
    if values.dtype.kind not in "iuf":
        raise TraceFormatError(f"weights of type {values.dtype} are not numbers", source=where(path, line),
                               field=name, fix="weights are numbers")
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        raise TraceFormatError(f"weight {values[bad].flat[0]} is not a finite number >= 0", source=where(path, line),
                               field=name, fix="gate weights are probabilities or scaled probabilities")
    return values


def check_experts(experts: np.ndarray, model: ModelSpec, path: Path, lines: np.ndarray,
                  name: str, unit: str = "line") -> None:
    """Expert ids in [0, E) and unique within a row; the error names the first bad line (or the ``unit``,
    e.g. token, that ``lines`` counts in an array file)."""
    experts = np.asarray(experts)
    bad = ((experts < 0) | (experts >= model.num_experts)).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TraceFormatError(f"expert id in {experts[i].tolist()} outside [0, {model.num_experts})",
                               source=where(path, int(lines[i]), unit), field=name,
                               fix=f"{model.name} has {model.num_experts} routed experts; check --format")
    ordered = np.sort(experts, axis=1)
    dup = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise TraceFormatError(f"duplicate expert in {experts[i].tolist()}", source=where(path, int(lines[i]), unit),
                               field=name, fix="each routed expert appears once per row")


#: the start of an OLMoE-routing-stats .json conversion: a list of per-layer counters {"expert": count} or
#: {"expert_i,expert_j": count}
_COUNTERS_JSON = re.compile(rb'^\s*\[\s*\{\s*"\d+(,\d+)?"\s*:\s*\d+')


def _counters_json(path: Path) -> bool:
    """Whether ``path`` is a .json file of expert counters (found by its content: copied out of its folder, its
    path no longer says so)."""
    if path.suffix != ".json" or not path.is_file():
        return False
    with open(path, "rb") as handle:
        return _COUNTERS_JSON.match(handle.read(256)) is not None


def check_logger_meta(meta: dict[str, Any], path: Path, line: int, fmt: str, model_words: str,
                      upstream_model: str, top_k: int) -> None:
    """A vLLM MoE logger meta record naming another model (or another top_k) than the one ``fmt`` reads: its
    routes would be imported under the wrong model's shape (an OLMoE trace of a Qwen2-MoE log), so refuse it."""
    model_id = meta.get("model_id")
    if model_id is not None and model_words not in str(model_id).lower():
        raise TraceFormatError(f"the log's meta names model {model_id!r}; {fmt} reads logs of {upstream_model} only",
                               source=where(path, line), field="model_id",
                               fix="moesim has no import format for this model's logs (moesim trace import "
                                   "--list-formats); write them as a trace (docs/trace-format.md)")
    logged_k = meta.get("top_k")
    if logged_k is not None and logged_k != top_k:
        raise TraceFormatError(f"the log's meta gives top_k {logged_k!r}; {upstream_model} routes {top_k} experts "
                               "a token", source=where(path, line), field="top_k",
                               fix="check --format (moesim trace import --list-formats)")


def refuse_aggregates(paths: list[Path]) -> None:
    """OLMoE-routing-stats holds per-layer expert counters, not per-token routing: no trace can come of it."""
    for path in paths:
        names = {p.name for p in path.iterdir()} if path.is_dir() else set()
        if path.suffix == ".pkl" or any(part.startswith("expert_counts") for part in path.parts) \
                or any(n.startswith("expert_counts") for n in names) or {"olmoe", "mistral"} <= names \
                or _counters_json(path):
            raise TraceFormatError(
                "holds aggregate expert counts (OLMoE routing statistics), not per-token routing; "
                "a trace needs one routed-expert list per token and layer", source=str(path),
                field="format", fix="use these counters to check a synthetic trace's skew; import a per-token log instead")


# ----------------------------------------------------------------------------- rows
@dataclass
class RoutingRows:
    """Columns of an imported trace before sorting; append blocks, then :meth:`columns`."""

    top_k: int
    with_weights: bool
    with_token_id: bool = False
    _blocks: list[dict[str, np.ndarray]] = field(default_factory=list)

    def add(self, *, request: Any, step: Any, phase: int, position: Any, layer: Any, experts: Any,
            weights: Any = None, token_id: Any = None) -> None:
        experts = np.asarray(experts, dtype=np.int16).reshape(-1, self.top_k)
        n = len(experts)
        block = {
            "request": np.broadcast_to(np.asarray(request, dtype=np.int32), (n,)),
            "step": np.broadcast_to(np.asarray(step, dtype=np.int32), (n,)),
            "phase": np.full(n, phase, dtype=np.int8),
            "position": np.broadcast_to(np.asarray(position, dtype=np.int32), (n,)),
            "layer": np.broadcast_to(np.asarray(layer, dtype=np.int16), (n,)),
            "experts": experts,
        }
        if self.with_weights:
            block["weights"] = np.asarray(weights, dtype=np.float32).reshape(n, self.top_k)
        if self.with_token_id:
            block["token_id"] = np.broadcast_to(np.asarray(token_id, dtype=np.int32), (n,))
        self._blocks.append(block)

    def columns(self) -> dict[str, np.ndarray]:
        """All rows, sorted by step, layer, request, position (trace order)."""
        if not self._blocks:
            return {}
        data = {key: np.concatenate([b[key] for b in self._blocks]) for key in self._blocks[0]}
        order = np.lexsort((data["position"], data["request"], data["layer"], data["step"]))
        return {key: value[order] for key, value in data.items()}


def order_by_weight(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Sort each row's experts by gate weight, highest first (as the trace format has them); count rows changed."""
    order = np.argsort(-weights, axis=1, kind="stable")
    changed = int((order != np.arange(weights.shape[1])).any(axis=1).sum())
    return (np.take_along_axis(experts, order, axis=1), np.take_along_axis(weights, order, axis=1), changed)


# ----------------------------------------------------------------------------- report and writing
@dataclass
class ImportReport:
    """What an import read, wrote, dropped and repaired; the same counts go into the trace's ``source``."""

    fmt: str
    out: Path
    model: str
    rows: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    requests: int = 0
    layers_present: list[int] = field(default_factory=list)
    num_layers: int = 0
    dropped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def summary_lines(self) -> list[str]:
        layers = ("all" if len(self.layers_present) == self.num_layers
                  else ", ".join(map(str, self.layers_present)))
        lines = [f"wrote {self.out} ({self.fmt}, model {self.model}): {self.rows:,} rows, {self.steps:,} steps "
                 f"({self.prefill_steps:,} prefill, {self.decode_steps:,} decode), {self.requests} request(s), "
                 f"layers {layers} of {self.num_layers}"]
        dropped, repaired = +self.dropped, +self.repaired  # unary + keeps positive counts only
        if dropped:
            lines.append("dropped rows: " + ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items())))
        if repaired:
            lines.append("repaired: " + ", ".join(f"{k} {v:,}" for k, v in sorted(repaired.items())))
        lines.extend(f"note: {note}" for note in self.notes)
        return lines


def write_import(out: Path, rows: RoutingRows, model: ModelSpec, report: ImportReport,
                 source: dict[str, Any], weights_renormalized: bool) -> ImportReport:
    """Sort ``rows`` into trace order and write them; fill the report's counts and the ``source`` metadata."""
    data = rows.columns()
    if data and "weights" in data:
        check_weights(data["weights"], Path(", ".join(source.get("files", []))), "weights")
    if not data:
        raise TraceFormatError("no routing rows left after dropping dummy/warm-up rows",
                               source=", ".join(source.get("files", [])), field="rows",
                               fix="check that the files are the per-token logs this format expects")
    _refuse_duplicate_rows(data, source)
    steps = data["step"]
    starts = np.r_[0, np.flatnonzero(np.diff(steps)) + 1]
    report.rows = len(steps)
    report.steps = len(starts)
    report.prefill_steps = int((data["phase"][starts] == PREFILL).sum())
    report.decode_steps = report.steps - report.prefill_steps
    report.requests = int(len(np.unique(data["request"])))
    report.layers_present = sorted(int(x) for x in np.unique(data["layer"]))
    report.num_layers = model.num_layers
    source = {
        "kind": "imported",
        "format": report.fmt,
        **source,
        "layers_present": report.layers_present,
        "dropped_rows": dict(sorted((+report.dropped).items())),
        "repairs": dict(sorted((+report.repaired).items())),
        "notes": list(report.notes),
    }
    meta = TraceMeta(model=model, source=source, weights_renormalized=weights_renormalized)
    optional = [c for c in ("weights", "token_id") if c in data]
    with TraceWriter(out, meta, optional) as writer:
        for start in range(0, report.rows, WRITE_CHUNK_ROWS):
            writer.write({key: value[start:start + WRITE_CHUNK_ROWS] for key, value in data.items()})
    return report


def _refuse_duplicate_rows(data: dict[str, np.ndarray], source: dict[str, Any]) -> None:
    """Two rows for one (step, layer, request, position) make a trace that no reader accepts: refuse them here,
    naming the token, rather than write it (``data`` is in trace order, so repeats are neighbours)."""
    keys = ("step", "layer", "request", "position")
    same = np.ones(len(data["step"]) - 1, dtype=bool)
    for key in keys:
        same &= data[key][1:] == data[key][:-1]
    if same.any():
        i = int(np.flatnonzero(same)[0])
        step, layer, request, position = (int(data[key][i]) for key in keys)
        raise TraceFormatError(f"the logs give the routing of request {request}, position {position} at MoE layer "
                               f"{layer} (step {step}) twice", source=", ".join(source.get("files", [])),
                               field="layer", fix="give each layer's and each token's routing once")


def new_report(fmt: str, out: Path, model_name: str) -> tuple[ImportReport, ModelSpec]:
    model = load_preset(model_name)
    return ImportReport(fmt=fmt, out=out, model=model.name), model
