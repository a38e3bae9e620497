"""Which tool wrote a routing log, told from its first records (``moesim trace import`` without ``--format``).

Each format's files have a layout no other format shares (the record layouts are
documented in each format's module):

* ``.npz`` holding ``layers, token_ids, indices, scores``: ``flame-moe``; one
  holding ``topk_ids``: the ``vllm-qwen3-prefill`` extract;
* JSON lines with ``problem_id, experts, gating_probs``: ``speculative-moe``;
* JSON lines with ``topk_ids`` and ``topk_weights`` and no ``type``:
  ``vllm-qwen3-prefill`` (its ``topk_weights`` is a shape);
* a ``{"type": "meta"}`` line, then ``{"type": "route"}`` lines: the vLLM MoE
  logger of ``cerebras-olmoe`` (OLMoE, top-8) or ``vllm-moe-logger``
  (Qwen1.5-MoE, top-4), told apart by the meta's ``model_id`` or, without
  one, by the first route's number of experts (a log whose meta line is
  missing, starting with a route, by that alone). A meta naming another
  model is no format's: the routes' length would take it for one.

A file no layout fits is answered with what it lacks where that is clear: an
npz that is no readable archive, a first record with all but one of a
format's telling fields (a misspelled or missing field, named), or
speculative-moe's prompts-and-outputs file, which holds no routing.

Only the first records are read, so detection costs nothing on large logs; the
importer still checks every line.
"""

from __future__ import annotations

import difflib
import json
import zipfile
from pathlib import Path
from typing import Any

from moesim.errors import TraceFormatError
from moesim.trace.importers import cerebras_olmoe, flame_moe, qwen3_prefill, speculative_moe, vllm_moe_logger

#: non-blank lines read from a JSON-lines log to tell its format
HEAD_RECORDS = 2
#: the first records of a logger log, by model: (words of its meta's model_id, experts per route)
_LOGGER_MODELS = ((cerebras_olmoe.FORMAT, cerebras_olmoe.MODEL_ID_WORDS, cerebras_olmoe.TOP_K),
                  (vllm_moe_logger.FORMAT, vllm_moe_logger.MODEL_ID_WORDS, vllm_moe_logger.TOP_K))


def detect_format(sources: list[Path]) -> str:
    """The import format of ``sources`` (every file must be of the same one)."""
    found = {path: format_of(path) for path in sources}
    for path, fmt in found.items():
        if fmt is None and _blank(path):  # no record to tell a format by: say that, not that the layout is odd
            raise TraceFormatError("file has no records (it is empty or blank)", source=str(path),
                                   fix="give a log the tool has written records to")
        if fmt is None:
            near = _near_miss(path)
            if near is not None:
                raise near
            raise TraceFormatError("cannot tell which tool wrote this log", source=str(path), field="--format",
                                   fix="name its format: --format NAME (moesim trace import --list-formats)")
    formats = sorted(set(found.values()))  # type: ignore[arg-type]
    if len(formats) > 1:
        which = "; ".join(f"{path.name}: {fmt}" for path, fmt in found.items())
        raise TraceFormatError(f"the files are logs of different formats ({which})",
                               source=", ".join(map(str, sources)), field="--format",
                               fix="import each format into a trace of its own")
    return formats[0]


def format_of(path: Path) -> str | None:
    """The format whose layout ``path`` has, or None when no format's does (or it cannot be read)."""
    if path.suffix == ".npz":
        return _npz_format(path)
    records = _head(path)
    if not records:
        return None
    first = records[0]
    if {"problem_id", "experts", "gating_probs"} <= first.keys():
        return speculative_moe.FORMAT
    if "type" not in first and {"topk_ids", "topk_weights"} <= first.keys():
        return qwen3_prefill.FORMAT
    if first.get("type") == "meta":
        return _logger_format(first, records[1:])
    if first.get("type") == "route":  # a logger log whose meta line is missing: its routes tell the model
        return _logger_format({}, records)
    return None


#: the fields (JSON lines) or arrays (npz) that tell a format, for naming the one a near miss lacks
_SIGNATURES = ((speculative_moe.FORMAT, ("problem_id", "experts", "gating_probs")),
               (qwen3_prefill.FORMAT, ("topk_ids", "topk_weights")),
               (flame_moe.FORMAT, ("layers", "token_ids", "indices", "scores")))


def _near_miss(path: Path) -> TraceFormatError | None:
    """For a file no format's layout fits: a truncated npz archive, or the format whose telling fields the
    first record has all but one of (a misspelled or missing field), as one error naming it; None otherwise."""
    if path.suffix == ".npz":
        try:
            with zipfile.ZipFile(path) as archive:
                keys = [name.removesuffix(".npy") for name in archive.namelist()]
        except (OSError, zipfile.BadZipFile):
            return TraceFormatError("not a readable .npz archive (truncated, or not an npz)", source=str(path),
                                    fix="give the complete .npz file as it was written")
        what = "array"
    else:
        records = _head(path)
        if records and records[0].get("type") == "meta" and records[0].get("model_id"):
            known = "; ".join(f"{mod.FORMAT}: {mod.UPSTREAM_MODEL_ID}" for mod in (cerebras_olmoe, vllm_moe_logger))
            return TraceFormatError(f"a vLLM MoE logger log of model {records[0]['model_id']!r}; the logger formats "
                                    f"read these models' logs only ({known})", source=str(path), field="model_id",
                                    fix="moesim has no import format for this model's logs; write them as a trace "
                                        "(docs/trace-format.md)")
        if not records or "type" in records[0]:
            return None
        keys, what = list(records[0]), "field"
        if {"problem_id", "prompt", "generated"} <= set(keys):  # speculative-moe's *_outputs.jsonl beside its logs
            return TraceFormatError("holds prompts and generated text (speculative-moe's *_outputs.jsonl), not "
                                    "routing", source=str(path),
                                    fix="import the routing log beside it (*_routing.jsonl, routing_raw.jsonl)")
    for fmt, wanted in _SIGNATURES:
        missing = [name for name in wanted if name not in keys]
        if len(missing) != 1 or (fmt == flame_moe.FORMAT) != (what == "array"):
            continue
        name = missing[0]
        close = difflib.get_close_matches(name, [k for k in keys if k not in wanted], n=1, cutoff=0.6)
        has = f"; it has '{close[0]}'" if close else f"; it has {', '.join(repr(k) for k in keys)}"
        where = "the npz" if what == "array" else "the first record"
        fix = (f"rename '{close[0]}' to '{name}'" if close else f"give a complete {fmt} log") + \
              ", or name the format with --format (moesim trace import --list-formats)"
        return TraceFormatError(f"looks like a {fmt} log, but {where} has no {what} '{name}'{has}",
                                source=str(path), field=name, fix=fix)
    return None


def _npz_format(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            arrays = {name.removesuffix(".npy") for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile):
        return None
    if {"layers", "token_ids", "indices", "scores"} <= arrays:
        return flame_moe.FORMAT
    if "topk_ids" in arrays:
        return qwen3_prefill.FORMAT
    return None


def _blank(path: Path) -> bool:
    """Whether ``path`` is empty or holds only whitespace (an unreadable file is not blank: it is reported
    as what it is by the importer)."""
    try:
        with open(path, "rb") as handle:
            return all(not chunk.strip() for chunk in iter(lambda: handle.read(1 << 16), b""))
    except OSError:
        return False


def _head(path: Path) -> list[dict[str, Any]]:
    """The first :data:`HEAD_RECORDS` JSON objects of a JSON-lines file; [] if it does not start with one."""
    records: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8-sig") as handle:  # -sig: a leading byte-order mark is no record's
            for text in handle:
                if not text.strip():
                    continue
                record = json.loads(text)
                if not isinstance(record, dict):
                    break
                records.append(record)
                if len(records) == HEAD_RECORDS:
                    break
    except (OSError, UnicodeDecodeError, ValueError):
        return records
    return records


def _logger_format(meta: dict[str, Any], routes: list[dict[str, Any]]) -> str | None:
    model = str(meta.get("model_id", "")).lower()
    for fmt, words, _ in _LOGGER_MODELS:
        if words in model:
            return fmt
    if model:  # another model's log: its routes' length is no sign of either format (it made a Qwen2-MoE log OLMoE's)
        return None
    experts = routes[0].get("topk_ids") if routes and routes[0].get("type") == "route" else None
    for fmt, _, top_k in _LOGGER_MODELS:
        if isinstance(experts, list) and len(experts) == top_k:
            return fmt
    return None
